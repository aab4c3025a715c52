"""input_reshard: saved activations kept as shards during forward, gathered back for backward, same gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import init_device_mesh
from shardwise.testing import run_on_threads
from shardwise.tp_styles.input_reshard import input_reshard

WORLD = 4


class Scale(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.weight)


def _gradients(reshard: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,))
    # 7 rows: uneven shards (2, 2, 2, 1) must come back whole.
    x = torch.linspace(-1, 1, 21).reshape(7, 3).requires_grad_()
    module = Scale(torch.linspace(0.5, 2, 21).reshape(7, 3))
    if reshard:
        input_reshard(module, mesh, input_reshard_dim=0)
    out = module(x)
    with CommDebugMode() as comm:
        out.sum().backward()
    # Replicated DTensors are saved as their Shard(0) pieces and come back replicated.
    replicated = distribute_tensor(torch.linspace(-1, 1, 16).reshape(8, 2), mesh, [Replicate()]).requires_grad_()
    dt_module = Scale(torch.ones(8, 2))
    dt_module.weight = nn.Parameter(distribute_tensor(torch.linspace(0.5, 2, 16).reshape(8, 2), mesh, [Replicate()]))
    if reshard:
        input_reshard(dt_module, mesh, input_reshard_dim=0)
    with CommDebugMode() as dt_comm:
        dt_module(replicated).sum().backward()
    return {
        "x_grad": x.grad,
        "w_grad": module.weight.grad,
        "backward_all_gathers": comm.get_comm_counts()[torch.ops._c10d_functional.all_gather_into_tensor],
        "dt_grad": replicated.grad.full_tensor(),
        "dt_all_gathers": dt_comm.get_comm_counts()[torch.ops._c10d_functional.all_gather_into_tensor],
    }


def test_gradients_are_unchanged_and_saved_tensors_come_back_by_all_gather() -> None:
    plain = run_on_threads(_gradients, False, world_size=WORLD)
    resharded = run_on_threads(_gradients, True, world_size=WORLD)
    for without, with_reshard in zip(plain, resharded):
        torch.testing.assert_close(with_reshard["x_grad"], without["x_grad"])
        torch.testing.assert_close(with_reshard["w_grad"], without["w_grad"])
        torch.testing.assert_close(with_reshard["dt_grad"], without["dt_grad"])
        assert without["backward_all_gathers"] == 0
        # x * w saves x and w; tanh saves its output: three sharded tensors gathered back.
        assert with_reshard["backward_all_gathers"] == 3
        # The same three DTensors; full_tensor() of the gradient adds none (it is replicated).
        assert (without["dt_all_gathers"], with_reshard["dt_all_gathers"]) == (0, 3)


def _checks_arguments() -> None:
    mesh = init_device_mesh("cpu", (WORLD,))
    module = nn.Linear(2, 2)
    assert input_reshard(module, mesh, None) is module
    with pytest.raises(TypeError, match="expects a DeviceMesh"):
        input_reshard(module, "mesh", 0)  # type: ignore[arg-type]
    two_d = init_device_mesh("cpu", (2, 2))
    with pytest.raises(ValueError, match="1-D TP mesh"):
        input_reshard(module, two_d, 0)


def test_bad_arguments_are_refused() -> None:
    run_on_threads(_checks_arguments, world_size=WORLD)


def _sharded_dtensor_saved_as_it_is() -> tuple[str, ...]:
    mesh = init_device_mesh("cpu", (WORLD,))
    module = Scale(torch.ones(8, 2))
    input_reshard(module, mesh, input_reshard_dim=1)
    weight = distribute_tensor(torch.ones(8, 2), mesh, [Shard(0)])
    module.weight = nn.Parameter(weight)
    x = distribute_tensor(torch.linspace(-1, 1, 16).reshape(8, 2), mesh, [Shard(0)]).requires_grad_()
    module(x).sum().backward()
    assert isinstance(x.grad, DTensor)
    return tuple(str(p) for p in x.grad.placements)


def test_a_sharded_dtensor_keeps_its_placements() -> None:
    assert run_on_threads(_sharded_dtensor_saved_as_it_is, world_size=WORLD) == [("S(0)",)] * WORLD
