"""Build dispatch's C++ fast path (fastpath.cpp) into shardwise/dtensor_ops/ for this interpreter.

    python dtensor_ops/csrc/build.py          # from the repository root, with the pinned interpreter

Compiles against pybind11's headers from the installed ``pybind11`` package and the running
interpreter's headers (``sysconfig``), and writes ``_fastpath_ext<EXT_SUFFIX>`` next to the
package's ``__init__.py`` through a temporary file and a rename, so processes that have the old
module loaded keep a valid mapping.  Without the module the package runs in pure Python.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path


def main() -> int:
    import pybind11

    here = Path(__file__).resolve().parent
    source = here / "fastpath.cpp"
    target = here.parent / "shardwise" / "dtensor_ops" / ("_fastpath_ext" + sysconfig.get_config_var("EXT_SUFFIX"))
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
