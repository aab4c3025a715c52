"""Writes test_seconds.bzl: how long each test file's cases took in a `bazel test //...` run.

    python3 tools/build_defs/test_seconds.py "$(./tools/bazel info bazel-testlogs)" > tools/build_defs/test_seconds.bzl

`sw_package` packs a package's test files into a few test targets (one pytest process each) by these
figures, so that the targets come out about the same length. The figures only balance the packing: a
file that is missing or stale still runs (it counts as DEFAULT_TEST_SECONDS).
"""

from __future__ import annotations

import collections
import pathlib
import sys
import xml.etree.ElementTree as ElementTree


def seconds_per_file(testlogs: pathlib.Path) -> dict[str, float]:
    """{'<package>/tests/test_x.py': seconds} summed over the test cases of every JUnit XML under testlogs.

    pytest names a case's class by the file's path (`dtensor_ops.tests.test_api`, maybe followed by a class
    name); the file is the longest prefix of that path which exists as `<prefix>.py` in the workspace.
    """
    workspace = pathlib.Path(__file__).resolve().parents[2]
    totals: dict[str, float] = collections.defaultdict(float)
    for xml_path in testlogs.rglob("test.xml"):
        try:
            root = ElementTree.parse(xml_path).getroot()
        except (OSError, ElementTree.ParseError):
            continue
        for case in root.iter("testcase"):
            parts = case.get("classname", "").split(".")
            for end in range(len(parts), 0, -1):
                candidate = "/".join(parts[:end]) + ".py"
                if (workspace / candidate).is_file():
                    totals[candidate] += float(case.get("time", 0.0))
                    break
    return dict(totals)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    totals = seconds_per_file(pathlib.Path(sys.argv[1]))
    if not totals:
        print(f"no test results under {sys.argv[1]}", file=sys.stderr)
        return 1
    print('"""Seconds of test cases per test file, measured by tools/build_defs/test_seconds.py (see its docstring)."""')
    print()
    print("TEST_SECONDS = {")
    for path in sorted(totals):
        print(f'    "{path}": {max(1, round(totals[path]))},')
    print("}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
