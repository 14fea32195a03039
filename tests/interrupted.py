"""A federation in one process (tests/inprocess.py), run as a child process that a test kills.

    python tests/interrupted.py '<run config as JSON>' <number of nodes> [<round whose fit hangs>]

With a third argument, every node's fit of that round waits until the process is killed: the run
cannot pass that round's checkpoint, however slowly the test that kills it is scheduled.
"""

import json
import sys
import threading

from inprocess import InProcessProxy, run_in_process

from protofl.client_app import PrototypeClientApp
from protofl.federation.wire import server_round as server_round_of
from protofl.settings import ExperimentSettings


def hanging_in_round(server_round, run_config):
    """The nodes of the run config's front whose fit of ``server_round`` waits until killed."""
    if ExperimentSettings.from_run_config(run_config).flower_api == "legacy":
        class HangingProxy(InProcessProxy):
            def fit(self, ins, timeout, group_id):
                if server_round_of(ins.config) == server_round:
                    threading.Event().wait()  # until killed
                return super().fit(ins, timeout, group_id)

        return lambda partition_id: HangingProxy

    app = PrototypeClientApp(run_config)

    def hanging(message, context):
        if (message.metadata.message_type == "train"
                and server_round_of(dict(message.content.config_records["config"])) == server_round):
            threading.Event().wait()  # until killed
        return app(message, context)

    return lambda partition_id: hanging


if __name__ == "__main__":
    run_config = json.loads(sys.argv[1])
    hang = hanging_in_round(int(sys.argv[3]), run_config) if len(sys.argv) > 3 else None
    run_in_process(run_config, int(sys.argv[2]), node_class=hang)
