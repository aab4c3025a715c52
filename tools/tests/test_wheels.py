"""Each package's wheel installs alone (plus the sibling wheels it declares) and works.

pip resolves the wheel's requirements against a folder holding every shardwise wheel, with torch
satisfied by the pinned environment; the resolved set must be exactly the declared siblings. Those
wheels are installed into an empty target directory and imported by an isolated interpreter that
sees nothing of the source tree.
"""

from __future__ import annotations

import email.parser
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

RUNFILES_ROOT = pathlib.Path.cwd()
WHEELS = sorted(RUNFILES_ROOT.glob("*/shardwise_*.whl"))


def _metadata(wheel: pathlib.Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


def _distribution(wheel: pathlib.Path) -> str:
    return str(_metadata(wheel)["Name"])


def _sibling_requirements(wheel: pathlib.Path) -> list[str]:
    requirements = _metadata(wheel).get_all("Requires-Dist") or []
    return [r for r in requirements if r.startswith("shardwise-")]


def _declared_closure(wheel: pathlib.Path, by_name: dict[str, pathlib.Path]) -> set[str]:
    closure = {_distribution(wheel)}
    pending = [wheel]
    while pending:
        for requirement in _sibling_requirements(pending.pop()):
            name = requirement.split(">")[0].split("<")[0].split("=")[0].strip()
            if name not in closure:
                closure.add(name)
                pending.append(by_name[name])
    return closure


def _pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # the machine's indexes and find-links must not take part
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def test_every_package_has_a_wheel() -> None:
    names = {_distribution(w) for w in WHEELS}
    assert {"shardwise-mesh", "shardwise-placement", "shardwise-testing"} <= names, names


@pytest.mark.parametrize("wheel", WHEELS, ids=lambda w: w.name)
def test_wheel_installs_alone_and_imports(wheel: pathlib.Path, tmp_path: pathlib.Path) -> None:
    by_name = {_distribution(w): w for w in WHEELS}
    links = tmp_path / "links"
    links.mkdir()
    for other in WHEELS:
        shutil.copy(other, links / other.name)

    report = tmp_path / "report.json"
    resolve = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-index",
         "--find-links", str(links), "--report", str(report), _distribution(wheel)],
        env=_pip_env(), capture_output=True, text=True,
    )
    assert resolve.returncode == 0, resolve.stdout + resolve.stderr
    resolved = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    assert resolved == _declared_closure(wheel, by_name), (
        f"pip resolved {sorted(resolved)} for {wheel.name}; its declared requirements give "
        f"{sorted(_declared_closure(wheel, by_name))}"
    )

    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(target),
         *(str(by_name[name]) for name in sorted(resolved))],
        env=_pip_env(), capture_output=True, text=True,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    package = _distribution(wheel).removeprefix("shardwise-").replace("-", "_")
    not_installed = sorted(
        name.removeprefix("shardwise-").replace("-", "_") for name in set(by_name) - resolved
    )
    probe = f"""
import importlib, pkgutil, sys
sys.path.insert(0, {str(target)!r})
import shardwise.{package} as package
assert package.__file__.startswith({str(target)!r}), package.__file__
modules = [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
for name in modules:
    importlib.import_module(name)
for absent in {not_installed!r}:
    try:
        importlib.import_module("shardwise." + absent)
    except ModuleNotFoundError:
        continue
    raise AssertionError("shardwise." + absent + " is importable but was not installed")
print("imported", 1 + len(modules), "modules of shardwise.{package}")
"""
    # -I: no PYTHONPATH, no user site, no script directory: only the target dir and the pinned env.
    run = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "imported" in run.stdout


def test_every_wheel_is_pure_python() -> None:
    # No compiled module: dispatch's C++ cache hit saved under 10 % of the per-op overhead and the
    # planner's C++ search made cold decisions no faster end to end (dtensor_ops/README.md), so both
    # were removed; every wheel is py3-none-any.
    for wheel in WHEELS:
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
            wheel_file = archive.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
        assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
        assert not [n for n in names if n.endswith(".so")], wheel.name
        assert "Root-Is-Purelib: true" in wheel_file, wheel_file


def test_the_installed_switch_takes_over_at_interpreter_start(tmp_path: pathlib.Path) -> None:
    """Every wheel installed together: the switch's .pth sits at the site root and, with SHARDWISE_AS_TORCH=1,
    torch's DTensor paths are shardwise's as soon as torch is imported; without it they are torch's."""
    switch = [w for w in WHEELS if _distribution(w) == "shardwise-torch-switch"]
    assert switch, "no shardwise-torch-switch wheel among " + ", ".join(w.name for w in WHEELS)
    with zipfile.ZipFile(switch[0]) as archive:
        assert "shardwise_torch_switch.pth" in archive.namelist()
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(target),
         *map(str, WHEELS)],
        env=_pip_env(), capture_output=True, text=True,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    # site.addsitedir processes the target's .pth files exactly as Python does for site-packages at start.
    probe = f"""
import site
site.addsitedir({str(target)!r})
import torch.distributed.tensor as t
print(t.__name__)
"""
    for value, expected in (("1", "shardwise.dtensor_ops"), ("", "torch.distributed.tensor")):
        env = {k: v for k, v in os.environ.items() if k != "SHARDWISE_AS_TORCH"}
        if value:
            env["SHARDWISE_AS_TORCH"] = value
        run = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.stdout.strip().splitlines()[-1] == expected, run.stdout
