"""A federation in one process (tests/inprocess.py), run as a child process that a test kills.

    python tests/interrupted.py '<run config as JSON>' <number of nodes> [<round whose fit hangs>]

With a third argument, every node's fit of that round waits until the process is killed: the run
cannot pass that round's checkpoint, however slowly the test that kills it is scheduled.
"""

import json
import sys
import threading

from inprocess import InProcessProxy, run_in_process

from protofl.federation.wire import server_round as server_round_of


def hanging_in_round(server_round):
    class HangingProxy(InProcessProxy):
        def fit(self, ins, timeout, group_id):
            if server_round_of(ins.config) == server_round:
                threading.Event().wait()  # until killed
            return super().fit(ins, timeout, group_id)

    return lambda partition_id: HangingProxy


if __name__ == "__main__":
    hang = hanging_in_round(int(sys.argv[3])) if len(sys.argv) > 3 else None
    run_in_process(json.loads(sys.argv[1]), int(sys.argv[2]), node_class=hang)
