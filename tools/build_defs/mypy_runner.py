"""Type-checks shardwise packages (`shardwise.<name> ...`) in one mypy run with the repository's mypy.ini, as a Bazel test."""

from __future__ import annotations

import os
import sys

from mypy import api


def main() -> int:
    packages = sys.argv[1:]
    if not packages:
        print("usage: mypy_runner shardwise.<package> [shardwise.<package> ...]", file=sys.stderr)
        return 2
    cache_dir = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), "mypy_cache")
    package_args = [argument for package in packages for argument in ("-p", package)]
    stdout, stderr, status = api.run(["--config-file", "mypy.ini", "--cache-dir", cache_dir, "--no-error-summary", *package_args])
    sys.stdout.write(stdout)
    sys.stderr.write(stderr)
    if status == 0:
        print(f"mypy: {', '.join(packages)} type-check clean")
    return status


if __name__ == "__main__":
    sys.exit(main())
