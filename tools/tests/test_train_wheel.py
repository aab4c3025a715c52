"""The demo trainer's wheel (shardwise-tools) installs with the other shardwise wheels and gives a
working ``shardwise-train`` command.

Runs under Bazel (`//tools:test_train_wheel`), whose runfiles hold the built wheels: they are installed
with ``pip install --no-index --no-deps --target`` into an empty folder, and the console script pip
wrote there is run with only that folder on the import path.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

RUNFILES_ROOT = pathlib.Path.cwd()
WHEELS = sorted(RUNFILES_ROOT.glob("*/shardwise_*.whl"))
TOOLS_WHEELS = [wheel for wheel in WHEELS if wheel.name.startswith("shardwise_tools-")]

pytestmark = pytest.mark.skipif(
    not TOOLS_WHEELS, reason="needs the built wheels: run as the Bazel target //tools:test_train_wheel"
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env["PIP_CONFIG_FILE"] = os.devnull  # the machine's indexes and find-links must not take part
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def test_the_wheel_declares_the_console_script() -> None:
    (wheel,) = TOOLS_WHEELS
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        text = archive.read(entry_points).decode()
    assert text.splitlines() == ["[console_scripts]", "shardwise-train = shardwise.tools.train.__main__:console_script"]
    # The trainer (with its corpus) and nothing of the developer tools that need PyTorch's DTensor.
    assert "shardwise/tools/train/corpus.txt" in names
    assert not any(n.startswith("shardwise/tools/bench_") for n in names), names


def test_shardwise_train_runs_from_the_installed_wheels(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(target),
         *(str(wheel) for wheel in WHEELS)],
        env=_clean_env(), capture_output=True, text=True,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    script = target / "bin" / "shardwise-train"
    assert script.is_file(), sorted(p.name for p in (target / "bin").iterdir()) if (target / "bin").exists() else []
    run = subprocess.run(
        [str(script), "--help"], env=_clean_env(PYTHONPATH=str(target)), capture_output=True, text=True, cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("usage: shardwise-train "), run.stdout
    for flag in ("--dp", "--tp", "--checkpoint-dir", "--resume"):
        assert flag in run.stdout, run.stdout
    # A bad flag value is the trainer's own error (exit status 2, argparse), not an import failure.
    bad = subprocess.run(
        [str(script), "--tp", "0"], env=_clean_env(PYTHONPATH=str(target)), capture_output=True, text=True, cwd=tmp_path
    )
    assert bad.returncode == 2 and "--tp" in bad.stderr, bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr
