"""The harness under a pytest started the way Bazel's py_test starts it.

Bazel runs pytest from a generated main script (without an ``if __name__ == "__main__"`` guard
in the worst case), with the test's directory prepended to sys.path. The rank processes must find
the test body and must never run the main script again. (Test files imported under names that
are not importable are covered in-process by test_harness.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import shardwise.testing

# Every folder holding a portion of the `shardwise` namespace (shardwise.testing imports the DTensor stack).
SHARDWISE_SOURCE_ROOTS = os.pathsep.join(str(Path(portion).resolve().parent) for portion in shardwise.__path__)

INNER_TESTS = '''
import pytest
import torch
import torch.distributed as dist

from shardwise.testing import multi_rank


@pytest.mark.parametrize("value", [1.0, 2.5])
@multi_rank(world_size=2)
def test_inner_all_reduce(value: float) -> None:
    summed = torch.tensor([value])
    dist.all_reduce(summed)
    assert summed.item() == 2 * value


@multi_rank(world_size=2)
def test_inner_failure_shows_rank_output() -> None:
    print(f"printed by rank {dist.get_rank()}")
    assert dist.get_rank() == 0, "only rank 0 passes"
'''

# Deliberately unguarded, like a generated test main script: running it again would start a
# second pytest session, which the marker file would show.
MAIN_SCRIPT = '''
import os
import sys

import pytest

with open(os.environ["MAIN_RUNS_FILE"], "a") as runs:
    runs.write(f"{os.getpid()}\\n")
pytest_arguments = ["-q", "-p", "no:cacheprovider", "--import-mode=" + os.environ["IMPORT_MODE"]]
sys.exit(pytest.main(pytest_arguments + [os.environ["INNER_TEST_FILE"]]))
'''


def test_generated_main_script_runs_each_test_once_on_ranks(tmp_path: Path) -> None:
    # Laid out like runfiles: the main script apart from the package's tests directory.
    tests_dir = tmp_path / "pkg" / "tests"
    tests_dir.mkdir(parents=True)
    (tests_dir / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    main_dir = tmp_path / "bin"
    main_dir.mkdir()
    (main_dir / "generated_main.py").write_text(textwrap.dedent(MAIN_SCRIPT))
    runs_file = tmp_path / "main_runs.txt"
    environment = dict(os.environ)
    environment.update(
        {
            "PYTHONPATH": SHARDWISE_SOURCE_ROOTS,
            "MAIN_RUNS_FILE": str(runs_file),
            "IMPORT_MODE": "prepend",
            "INNER_TEST_FILE": str(tests_dir / "test_inner.py"),
            "SHARDWISE_TEST_TIMEOUT": "60",
        }
    )
    completed = subprocess.run(
        [sys.executable, str(main_dir / "generated_main.py")],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 1, output
    assert "1 failed, 2 passed" in output, output
    assert len(runs_file.read_text().splitlines()) == 1, output
    assert "rank 1 raised AssertionError: only rank 0 passes" in output, output
    assert "[rank 1] printed by rank 1" in output, output
