"""Runs one pytest file as a Bazel test: JUnit XML where Bazel asks for it, no writes to the source tree."""

from __future__ import annotations

import os
import sys

import pytest


def _quiet_hypothesis() -> None:
    # Hypothesis keeps an example database in the working directory, which is the read-only runfiles tree.
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("bazel", database=None, deadline=None, print_blob=True)
    settings.load_profile("bazel")


def main() -> int:
    test_files = sys.argv[1:]
    if not test_files:
        print("pytest_runner: no test file given", file=sys.stderr)
        return 2
    _quiet_hypothesis()
    args = ["-p", "no:cacheprovider", "-ra", "--tb=short", *test_files]
    xml_output = os.environ.get("XML_OUTPUT_FILE")
    if xml_output:
        args += ["--junitxml", xml_output]
    shard_filter = os.environ.get("TESTBRIDGE_TEST_ONLY")
    if shard_filter:
        args += ["-k", shard_filter]
    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main())
