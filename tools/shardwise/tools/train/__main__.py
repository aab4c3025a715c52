"""``python -m shardwise.tools.train`` (or the ``shardwise-train`` console script of the shardwise-tools
wheel): see the package docstring, or run with --help."""

import os
import sys
from typing import NoReturn

from shardwise.tools.train import main
from shardwise.tools.train._worker import is_worker_process


def console_script() -> NoReturn:
    """Run the trainer and exit with its status (the entry point of ``shardwise-train``)."""
    status = main()
    if is_worker_process():
        # A worker leaves without interpreter teardown: shardwise.mesh keeps its c10d groups
        # referenced after destroy_process_group, so they would be destroyed during teardown,
        # where a gloo group whose peers are still exiting can abort the process
        # ("terminate called without an active exception", SIGABRT) after a successful run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    if status != 0:
        # A failed job ends now: the launcher has reported and has nothing left to save, and Python's
        # finalisation with torch imported takes seconds on a loaded machine (logging's handlers are
        # flushed by hand, as its atexit hook would).
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    console_script()
