"""A federation in one process (tests/inprocess.py), run as a child process that a test kills.

    python tests/interrupted.py '<run config as JSON>' <number of nodes>
"""

import json
import sys

from inprocess import run_in_process

if __name__ == "__main__":
    run_in_process(json.loads(sys.argv[1]), int(sys.argv[2]))
