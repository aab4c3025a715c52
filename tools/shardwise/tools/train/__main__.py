"""``python -m shardwise.tools.train``: see the package docstring, or run with --help."""

import sys

from shardwise.tools.train import main

if __name__ == "__main__":
    sys.exit(main())
