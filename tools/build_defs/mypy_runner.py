"""Type-checks one shardwise package (`shardwise.<name>`) with the repository's mypy.ini, as a Bazel test."""

from __future__ import annotations

import os
import sys

from mypy import api


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: mypy_runner shardwise.<package>", file=sys.stderr)
        return 2
    cache_dir = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), "mypy_cache")
    stdout, stderr, status = api.run(
        ["--config-file", "mypy.ini", "--cache-dir", cache_dir, "--no-error-summary", "-p", sys.argv[1]]
    )
    sys.stdout.write(stdout)
    sys.stderr.write(stderr)
    if status == 0:
        print(f"mypy: {sys.argv[1]} type-checks clean")
    return status


if __name__ == "__main__":
    sys.exit(main())
