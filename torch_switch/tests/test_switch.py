"""The switch, in fresh interpreters of an environment that has its .pth installed, as a wheel leaves it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import switch_helpers
from shardwise.torch_switch import ALIASES, ENVIRONMENT_VARIABLE, shardwise_path_for

HELPERS = pathlib.Path(switch_helpers.__file__).resolve()


@pytest.fixture(scope="module")
def switched_python(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return switch_helpers.make_environment(tmp_path_factory.mktemp("venv"))


def _run(python: pathlib.Path, args: list[str], switch: bool, extra_env: dict[str, str] | None = None) -> str:
    env = dict(os.environ)
    env.pop(ENVIRONMENT_VARIABLE, None)
    if switch:
        env[ENVIRONMENT_VARIABLE] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(HELPERS.parent), *sys.path])
    env.update(extra_env or {})
    done = subprocess.run([str(python), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_paths_map_module_for_module() -> None:
    assert shardwise_path_for("torch.distributed.tensor._api") == "shardwise.dtensor_ops._api"
    assert shardwise_path_for("torch.distributed.tensor.placement_types") == "shardwise.placement"
    assert shardwise_path_for("torch.distributed.tensor.parallel.style") == "shardwise.tp_styles.style"
    assert shardwise_path_for("torch.distributed.tensor.parallel.fsdp") == "shardwise.fsdp_ext"
    assert shardwise_path_for("torch.distributed._tensor") == "shardwise.dtensor_ops"
    assert shardwise_path_for("torch.distributed.device_mesh") == "shardwise.mesh"
    # Neighbours whose names merely start alike stay torch's.
    assert shardwise_path_for("torch.distributed.tensor_x") is None
    assert shardwise_path_for("torch.distributed.fsdp") is None
    assert shardwise_path_for("torch.distributed.distributed_c10d") is None
    assert all(target.startswith("shardwise.") for target in ALIASES.values())


def test_torchs_semi_private_paths_map_onto_the_alias_table_of_dtensor_ops() -> None:
    from shardwise.dtensor_ops._torch_compat.pytorch_paths import PYTORCH_PATHS

    for path in PYTORCH_PATHS:
        torch_path = "torch.distributed.tensor" + path[len("shardwise.dtensor_ops"):]
        expected = "shardwise.placement" if path.endswith(".placement_types") else path
        assert shardwise_path_for(torch_path) == expected, torch_path
    assert shardwise_path_for("torch.distributed._tensor.device_mesh") == "shardwise.dtensor_ops.device_mesh"


def test_without_the_variable_nothing_of_torch_changes(switched_python: pathlib.Path) -> None:
    assert "switch off" in _run(switched_python, [str(HELPERS), "off"], switch=False)


def test_with_the_variable_torch_paths_are_shardwise_modules(switched_python: pathlib.Path) -> None:
    out = _run(switched_python, [str(HELPERS), "identities"], switch=True, extra_env={"SWITCH_EXPECT_ACTIVE": "1"})
    assert "switch on" in out


def test_installing_after_torch_dtensor_was_imported_is_refused(switched_python: pathlib.Path) -> None:
    assert "too late" in _run(switched_python, [str(HELPERS), "too_late"], switch=False)


def test_torchrun_workers_inherit_the_switch(switched_python: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = _run(
        switched_python,
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(HELPERS), "ranks"],
        switch=True,
        extra_env={"SWITCH_CHECKPOINT_DIR": str(tmp_path / "checkpoint"), "SWITCH_EXPECT_ACTIVE": "1"},
    )
    assert "ranks: functional collectives" in out
