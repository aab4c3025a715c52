"""Default process group start-up and device selection, without processes."""

from __future__ import annotations

import ast
import pathlib
import sys
import warnings

import pytest
import torch.distributed as dist

from shardwise.mesh import DeviceMesh, MeshError, init_device_mesh
from shardwise.mesh._world import default_backend_for, select_device, world_size_for_validation

TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


class FakeDeviceHandle:
    def __init__(self, count: int, initialized: bool = False) -> None:
        self.count = count
        self.initialized = initialized
        self.selected: int | None = None

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return self.count

    def set_device(self, device: int) -> None:
        self.selected = device


def test_world_size_comes_from_the_torchrun_environment() -> None:
    assert not dist.is_initialized()
    assert world_size_for_validation(TORCHRUN_ENV) == 4
    with pytest.raises(MeshError, match=r"torchrun environment is incomplete \(missing MASTER_ADDR, MASTER_PORT\)"):
        world_size_for_validation({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(MeshError, match=r"WORLD_SIZE='four' is not an integer"):
        world_size_for_validation({**TORCHRUN_ENV, "WORLD_SIZE": "four"})
    with pytest.raises(MeshError, match=r"RANK=4, WORLD_SIZE=4"):
        world_size_for_validation({**TORCHRUN_ENV, "RANK": "4"})


def test_meshes_without_a_process_group_or_torchrun_fail_before_any_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(MeshError, match="launch with torchrun or call torch.distributed.init_process_group"):
        init_device_mesh("cpu", (2, 2))
    with pytest.raises(MeshError, match="launch with torchrun"):
        DeviceMesh("cpu", [0, 1])
    assert not dist.is_initialized()


def test_init_device_mesh_checks_the_shape_against_the_environment_first(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    # Port 9 would hang or fail in a rendezvous; the shape error must come before it.
    monkeypatch.setenv("MASTER_PORT", "9")
    with pytest.raises(MeshError, match=r"mesh_shape \(2, 4\) has 8 ranks but the world size is 4"):
        init_device_mesh("cpu", (2, 4))
    with pytest.raises(MeshError, match=r"has 8 ranks but the world has only 4"):
        DeviceMesh("cpu", list(range(8)))
    with pytest.raises(MeshError, match=r"repeats \['x'\]"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "x"))
    assert not dist.is_initialized()


def test_backend_per_device_type() -> None:
    assert default_backend_for("cpu") == "gloo"
    assert default_backend_for("cuda") == "cpu:gloo,cuda:nccl"
    assert default_backend_for("xpu") is None


def test_device_from_local_rank() -> None:
    handle = FakeDeviceHandle(count=8)
    assert select_device("cuda", handle=handle, environ={"LOCAL_RANK": "3"}) == 3
    assert handle.selected == 3
    with pytest.raises(MeshError, match=r"LOCAL_RANK=8 but this host has 8 cuda devices"):
        select_device("cuda", handle=FakeDeviceHandle(count=8), environ={"LOCAL_RANK": "8"})


def test_device_chosen_by_the_user_is_kept() -> None:
    handle = FakeDeviceHandle(count=8, initialized=True)
    assert select_device("cuda", handle=handle, environ={"LOCAL_RANK": "3"}) is None
    assert handle.selected is None


def test_device_without_local_rank_uses_rank_modulo_devices_and_warns() -> None:
    handle = FakeDeviceHandle(count=4)
    assert select_device("cuda", handle=handle, environ={}) is None  # rank unknown yet: wait
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert select_device("cuda", handle=handle, environ={}, rank=6) == 2
    assert handle.selected == 2
    assert any("LOCAL_RANK is not set" in str(w.message) for w in caught)


def test_cpu_has_no_device_to_select() -> None:
    assert select_device("cpu", environ={"LOCAL_RANK": "0"}) is None


# shardwise-mesh declares torch as its only requirement: anything else must be the standard library.
ALLOWED_IMPORT_ROOTS = {"torch", "shardwise"} | set(sys.stdlib_module_names)
FORBIDDEN_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor", "torch.distributed.device_mesh")


def test_package_imports_only_torch_and_the_standard_library() -> None:
    package = pathlib.Path(__file__).resolve().parent.parent / "shardwise" / "mesh"
    for source in sorted(package.glob("*.py")):
        tree = ast.parse(source.read_text(), filename=str(source))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                assert module.split(".")[0] in ALLOWED_IMPORT_ROOTS, f"{source.name} imports {module}"
                assert not module.startswith(FORBIDDEN_MODULES), f"{source.name} imports {module}"
                if module.startswith("shardwise"):
                    assert module.startswith("shardwise.mesh"), f"{source.name} imports {module} (a higher layer)"


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_init_device_mesh_starts_gloo_from_the_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**TORCHRUN_ENV, "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(_free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert not dist.is_initialized()
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("only",))
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert mesh.get_group() is dist.group.WORLD and mesh.get_coordinate() == (0,)
        assert mesh.mesh.tolist() == [0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
