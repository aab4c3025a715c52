"""Build the planner's C++ search (plan_search.cpp) into shardwise/dtensor_ops/ for this interpreter.

    python dtensor_ops/csrc/build.py          # from the repository root, with the pinned interpreter
    python dtensor_ops/csrc/build.py --output out/_plan_search_ext.so   # what Bazel's //dtensor_ops/csrc:plan_search_ext runs

Compiles against pybind11's headers from the installed ``pybind11`` package (pinned in
third_party/python/requirements.lock) and the running interpreter's headers (``sysconfig``), and
writes ``_plan_search_ext<EXT_SUFFIX>`` next to the package's ``__init__.py`` through a temporary
file and a rename, so processes that have the old module loaded keep a valid mapping.  Without the
module the planner searches in pure Python (the reference), with the same results.

``-ffp-contract=off``: the module prices steps from a pricer's terms (``round((alpha + bytes / beta) *
1e12)``) and must get Python's result to the last picosecond, so no multiply-add may be fused.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import pybind11

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = Path(__file__).resolve().parent
    parser.add_argument("--source", type=Path, default=here / "plan_search.cpp")
    parser.add_argument(
        "--output",
        type=Path,
        default=here.parent / "shardwise" / "dtensor_ops" / ("_plan_search_ext" + sysconfig.get_config_var("EXT_SUFFIX")),
        help="where the module goes (default: inside the package, for this interpreter)",
    )
    args = parser.parse_args(argv)
    source, target = args.source.resolve(), args.output.absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CXX") or shutil.which("c++") or "c++"
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [
            compiler,
            "-O2",
            "-shared",
            "-fPIC",
            "-std=c++17",
            "-fvisibility=hidden",
            "-ffp-contract=off",
            "-Wall",
            "-I" + pybind11.get_include(),
            "-I" + sysconfig.get_paths()["include"],
            str(source),
            "-o",
            str(built),
        ]
        print(" ".join(command))
        subprocess.run(command, check=True)
        os.replace(built, target)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
