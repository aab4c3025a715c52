"""Runs one pytest file as a Bazel test: JUnit XML where Bazel asks for it, no writes to the source tree."""

from __future__ import annotations

import os
import sys

import pytest


def _keep_hypothesis_out_of_runfiles() -> None:
    # Hypothesis keeps its example database in the working directory, which is the runfiles tree.
    # (Set through the environment: importing hypothesis here would stop pytest rewriting its asserts.)
    scratch = os.environ.get("TEST_TMPDIR")
    if scratch:
        os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(scratch, "hypothesis"))


def main() -> int:
    test_files = sys.argv[1:]
    if not test_files:
        print("pytest_runner: no test file given", file=sys.stderr)
        return 2
    _keep_hypothesis_out_of_runfiles()
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
