"""``python -m shardwise.tools.train``: see the package docstring, or run with --help."""

import os
import sys

from shardwise.tools.train import main
from shardwise.tools.train._worker import is_worker_process

if __name__ == "__main__":
    status = main()
    if is_worker_process():
        # A worker leaves without interpreter teardown: shardwise.mesh keeps its c10d groups
        # referenced after destroy_process_group, so they would be destroyed during teardown,
        # where a gloo group whose peers are still exiting can abort the process
        # ("terminate called without an active exception", SIGABRT) after a successful run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
