"""What the switch's tests run in fresh interpreters: an environment whose site-packages holds the switch's
``.pth`` file (as an installed wheel leaves it), and a program written only against torch's paths.

``python switch_helpers.py <check>`` runs one check of ``CHECKS`` in this interpreter; under torchrun every
rank runs it. The program below never names shardwise except to assert identities.
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Callable


def make_environment(root: pathlib.Path) -> pathlib.Path:
    """A virtual environment over this interpreter's packages with the switch's .pth installed; its python."""
    import shardwise.torch_switch

    return pathlib.Path(shardwise.torch_switch.switched_environment(str(root)))


def _check_off() -> None:
    import torch.distributed.device_mesh
    import torch.distributed.tensor

    import shardwise.torch_switch

    assert not shardwise.torch_switch.is_active()
    assert torch.distributed.tensor.__name__ == "torch.distributed.tensor", torch.distributed.tensor.__name__
    assert torch.distributed.device_mesh.DeviceMesh.__module__ == "torch.distributed.device_mesh"
    assert "shardwise.dtensor_ops" not in sys.modules
    print("switch off: torch's own modules")


def _check_identities() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh
    import torch.distributed.tensor
    import torch.distributed.tensor.debug
    import torch.distributed.tensor.experimental
    import torch.distributed.tensor.parallel
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import shardwise.dtensor_ops
    import shardwise.mesh
    import shardwise.placement
    import shardwise.tp_styles
    import shardwise.torch_switch

    assert shardwise.torch_switch.is_active()
    assert torch.distributed.tensor is shardwise.dtensor_ops
    assert DTensor is shardwise.dtensor_ops.DTensor
    assert distribute_tensor is shardwise.dtensor_ops.distribute_tensor
    assert (Shard, Replicate, Partial) == (
        shardwise.placement.Shard, shardwise.placement.Replicate, shardwise.placement.Partial
    )
    assert torch.distributed.device_mesh is shardwise.mesh
    assert dist.DeviceMesh is shardwise.mesh.DeviceMesh and dist.init_device_mesh is shardwise.mesh.init_device_mesh
    assert torch.distributed.tensor.parallel is shardwise.tp_styles
    import torch.distributed._tensor
    import torch.distributed.tensor.placement_types

    assert torch.distributed._tensor is shardwise.dtensor_ops
    assert torch.distributed.tensor.placement_types is shardwise.placement
    # A module keeps its own name and spec: it is shardwise's module, reachable under torch's path too.
    assert torch.distributed.tensor.__spec__.name == "shardwise.dtensor_ops"
    # torch's semi-private paths resolve through dtensor_ops's alias table: torch's path -> the same path
    # under shardwise.dtensor_ops -> the module serving it, one object under all three names.
    import importlib

    from shardwise.dtensor_ops._torch_compat.pytorch_paths import PYTORCH_PATHS

    for path, served_by in PYTORCH_PATHS.items():
        torch_path = "torch.distributed.tensor" + path[len("shardwise.dtensor_ops"):]
        module = importlib.import_module(torch_path)
        assert module is importlib.import_module(served_by) is importlib.import_module(path), torch_path
        assert module.__spec__.name == served_by, (torch_path, module.__spec__.name)
    from torch.distributed.tensor._ops.utils import normalize_dim

    assert normalize_dim is sys.modules["shardwise.dtensor_ops._torch_compat.ops_utils"].normalize_dim
    # torch's own consumers import cleanly and see shardwise's classes.
    import torch._dynamo
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.checkpoint
    import torch.distributed.fsdp

    assert funcol.DeviceMesh is shardwise.mesh.DeviceMesh
    import torch.distributed.checkpoint.state_dict

    assert torch.distributed.checkpoint.state_dict.DTensor is DTensor  # type: ignore[attr-defined]
    print("switch on: torch's paths are shardwise's modules")


def _check_too_late() -> None:
    import torch.distributed.tensor  # torch's own, the switch is not on

    import shardwise.torch_switch

    try:
        shardwise.torch_switch.install()
    except shardwise.torch_switch.SwitchError as error:
        assert "torch.distributed.tensor" in str(error), str(error)
        print("too late:", error)
    else:
        raise AssertionError("install() after torch.distributed.tensor was imported must refuse")


def _check_ranks() -> None:
    """On every rank of a torchrun job: torch's functional collectives and consumers take shardwise's objects."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import shardwise.mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert isinstance(mesh, shardwise.mesh.DeviceMesh)
    # A mesh, a (mesh, dim) pair and a 1-D sub-mesh as a functional collective's group.
    ones = torch.ones(3)
    assert funcol.all_reduce(ones, "sum", (mesh, 1)).tolist() == [2.0, 2.0, 2.0]
    assert funcol.all_reduce(ones, "sum", mesh["tp"]).tolist() == [2.0, 2.0, 2.0]
    flat = mesh._flatten("dp_tp")
    assert funcol.all_reduce(ones * rank, "sum", flat).tolist() == [6.0, 6.0, 6.0]
    gathered = funcol.all_gather_tensor(torch.tensor([float(rank)]), 0, (mesh, 0))
    assert gathered.tolist() == [float(rank % 2), float(rank % 2 + 2)], gathered

    full = torch.arange(24.0).reshape(4, 6)
    dt = distribute_tensor(full, mesh, [Shard(0), Replicate()])
    assert isinstance(dt, DTensor) and torch.equal(dt.full_tensor(), full)
    partial = DTensor.from_local(torch.ones(2, 2), mesh, [Replicate(), Partial()])
    assert torch.equal(partial.full_tensor(), torch.full((2, 2), 2.0))

    # clip_grad_norm_ over DTensor gradients: torch's function, shardwise's tensors.
    weight = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)]))
    weight.grad = distribute_tensor(torch.full((4, 4), 3.0), mesh, [Shard(0), Shard(1)])
    norm = torch.nn.utils.clip_grad_norm_([weight], max_norm=1.0)
    norm_value = norm.full_tensor() if isinstance(norm, DTensor) else norm
    assert abs(float(norm_value) - 12.0) < 1e-5, norm_value

    # FSDP2's names are shardwise's.
    import torch.distributed.fsdp as fsdp

    import shardwise.fsdp_ext

    assert fsdp.fully_shard is shardwise.fsdp_ext.fully_shard
    model = torch.nn.Linear(4, 4)
    fsdp.fully_shard(model, mesh=mesh["dp"])
    assert isinstance(model.weight, DTensor)
    model(torch.ones(2, 4)).sum().backward()

    # DCP saves and loads shardwise's DTensors.
    import torch.distributed.checkpoint as dcp

    folder = os.environ["SWITCH_CHECKPOINT_DIR"]
    dcp.save({"w": dt}, checkpoint_id=folder)
    loaded = {"w": distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0), Replicate()])}
    dcp.load(loaded, checkpoint_id=folder)
    assert torch.equal(loaded["w"].full_tensor(), full)
    dist.destroy_process_group()
    if rank == 0:
        print("ranks: functional collectives, clip_grad_norm_, fully_shard and DCP on shardwise")


CHECKS: dict[str, Callable[[], None]] = {
    "off": _check_off,
    "identities": _check_identities,
    "too_late": _check_too_late,
    "ranks": _check_ranks,
}


if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
    if os.environ.get("SWITCH_EXPECT_ACTIVE"):
        import shardwise.torch_switch

        assert shardwise.torch_switch.is_active()
