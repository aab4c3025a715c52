"""Training utilities on DTensor parameters: clip_grad_norm_, zero_grad, in-place updates, checkpointing.

Every check compares with plain torch on the full tensors (ranks as threads; one
end-to-end training step on 4 gloo processes), and
counts the collectives where they are the point: the total gradient norm is one
all_reduce per group of gradients sharded on the same mesh dims, an in-place update
moves the gradient (never the parameter), zeroing moves nothing.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardwise.dtensor_ops import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.testing import multi_rank, run_on_threads

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()
c10d = torch.ops.c10d_functional
Layout = tuple[Placement, ...]


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _partial(full: torch.Tensor, mesh: Any, placements: Layout) -> DTensor:
    """``full`` laid out as ``placements`` where Partial mesh dims hold unequal parts (not just full / n)."""
    replicated = distribute_tensor(full, mesh, [R] * mesh.ndim)
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            size = mesh.shape[mesh_dim]
            weights = torch.arange(1, size + 1, dtype=full.dtype)
            weights = weights / weights.sum()
            local = replicated.to_local() * weights[coordinate[mesh_dim]]
            as_partial = tuple(p if d != mesh_dim else P for d, p in enumerate(replicated.placements))
            replicated = DTensor.from_local(local, mesh, as_partial, shape=full.shape, stride=full.stride())
    return replicated.redistribute(mesh, placements)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    full = actual.full_tensor() if isinstance(actual, DTensor) else actual
    torch.testing.assert_close(full, expected, rtol=1e-9, atol=1e-11, msg=lambda m: f"{where}: {m}")


# ------------------------------------------------------------------------------------ clip_grad_norm_

GRAD_SHAPES = ((10, 6), (10,), (3, 10), (3,), (7, 5))
GRAD_LAYOUTS_1D: tuple[Layout, ...] = ((S0,), (S0,), (S1,), (R,), (R,))
GRAD_LAYOUTS_2X2: tuple[Layout, ...] = ((S0, S1), (R, S0), (S1, R), (R, R), (S0, S0))
# Groups by sharded mesh dims: 1-D {0}: one all_reduce; 2x2 {0, 1} (two), {1}, {0}: four in all.
NORM_ALL_REDUCES = {1: 1, 2: 4}


def _params_with_grads(mesh: Any, layouts: tuple[Layout, ...]) -> tuple[list[DTensor], list[torch.Tensor]]:
    dist_params: list[DTensor] = []
    plain_params: list[torch.Tensor] = []
    for index, (shape, layout) in enumerate(zip(GRAD_SHAPES, layouts)):
        full = _randn(index, *shape)
        grad = _randn(100 + index, *shape) * (index + 1)
        param = distribute_tensor(full, mesh, layout).requires_grad_(True)
        param.grad = distribute_tensor(grad, mesh, layout)
        plain = full.clone().requires_grad_(True)
        plain.grad = grad.clone()
        dist_params.append(param)
        plain_params.append(plain)
    return dist_params, plain_params


def _check_clip_grad_norm(
    mesh_shape: tuple[int, ...], layouts: tuple[Layout, ...], thread_ranks: bool = True
) -> None:
    mesh = init_device_mesh("cpu", mesh_shape)
    for norm_type in (2.0, math.inf):
        for foreach in (True, False):
            if thread_ranks and mesh.ndim == 2 and norm_type == math.inf and not foreach:
                # linalg_vector_norm's Partial(max) norms reach a reduce_scatter(max), which torch's threaded
                # process group does not implement: test_clip_grad_norm_on_gloo_processes covers this one.
                continue
            for max_norm in (1.0, 1e6):  # clipping, and a coefficient clamped to 1
                dist_params, plain_params = _params_with_grads(mesh, layouts)
                expected = torch.nn.utils.clip_grad_norm_(plain_params, max_norm, norm_type, foreach=foreach)
                with CommDebugMode() as mode:
                    total = torch.nn.utils.clip_grad_norm_(dist_params, max_norm, norm_type, foreach=foreach)
                where = f"clip_grad_norm_(norm_type={norm_type}, foreach={foreach}, max_norm={max_norm}) on {mesh_shape}"
                assert isinstance(total, DTensor), where
                if foreach:  # without foreach the placement is linalg_vector_norm's (it may stay Partial(max))
                    assert total.placements == (R,) * mesh.ndim, where
                _assert_close(total, expected, f"{where}: total norm")
                for index, (param, plain) in enumerate(zip(dist_params, plain_params)):
                    assert param.grad is not None and plain.grad is not None
                    assert param.grad.placements == layouts[index], f"{where}: grad {index} moved"
                    _assert_close(param.grad, plain.grad, f"{where}: grad {index}")
                if foreach:
                    # The norms' reduction is the only communication: the clip coefficient is replicated.
                    counts = mode.get_comm_counts()
                    assert counts[c10d.all_reduce] == NORM_ALL_REDUCES[mesh.ndim], (where, counts)
                    assert mode.get_total_counts() == NORM_ALL_REDUCES[mesh.ndim], (where, counts)


@pytest.mark.parametrize("mesh_shape, layouts", [((4,), GRAD_LAYOUTS_1D), ((2, 2), GRAD_LAYOUTS_2X2)])
def test_clip_grad_norm_matches_plain_torch(mesh_shape: tuple[int, ...], layouts: tuple[Layout, ...]) -> None:
    run_on_threads(_check_clip_grad_norm, mesh_shape, layouts, world_size=4)


def _check_clip_with_partial_and_default_foreach() -> None:
    mesh = init_device_mesh("cpu", (4,))
    grads_full = [_randn(7, 6, 4), _randn(8, 9)]
    params = [distribute_tensor(_randn(1, 6, 4), mesh, [S0]), distribute_tensor(_randn(2, 9), mesh, [R])]
    params[0].grad = distribute_tensor(grads_full[0], mesh, [S0])
    params[1].grad = _partial(grads_full[1], mesh, (P,))  # e.g. a replicated norm weight's grad
    plain = [torch.zeros(6, 4, dtype=torch.float64), torch.zeros(9, dtype=torch.float64)]
    for tensor, grad in zip(plain, grads_full):
        tensor.grad = grad.clone()
    # foreach=None: torch picks the foreach path for DTensors (they are in torch's foreach-supported types).
    expected = torch.nn.utils.clip_grad_norm_(plain, 0.5)
    with CommDebugMode() as mode:
        total = torch.nn.utils.clip_grad_norm_(params, 0.5)
    assert mode.get_comm_counts()[c10d.all_reduce] == 2  # the Partial grad's reduction, then the norms'
    assert mode.get_total_counts() == 2
    _assert_close(total, expected, "total norm with a Partial grad")
    for param, reference in zip(params, plain):
        assert param.grad is not None and reference.grad is not None
        _assert_close(param.grad, reference.grad, "clipped grads with a Partial grad")


def test_clip_grad_norm_with_partial_grad_and_default_foreach() -> None:
    run_on_threads(_check_clip_with_partial_and_default_foreach, world_size=4)


def _check_clip_grad_value() -> None:
    mesh = init_device_mesh("cpu", (4,))
    for foreach in (True, False):
        dist_params, plain_params = _params_with_grads(mesh, GRAD_LAYOUTS_1D)
        torch.nn.utils.clip_grad_value_(plain_params, 0.7, foreach=foreach)
        with CommDebugMode() as mode:
            torch.nn.utils.clip_grad_value_(dist_params, 0.7, foreach=foreach)
        assert mode.get_total_counts() == 0
        for index, (param, plain) in enumerate(zip(dist_params, plain_params)):
            assert param.grad is not None and plain.grad is not None
            assert param.grad.placements == GRAD_LAYOUTS_1D[index]
            _assert_close(param.grad, plain.grad, f"clip_grad_value_(foreach={foreach}) grad {index}")
    # Clamping is not linear: a Partial grad cannot be clamped in place without reducing it first.
    param = distribute_tensor(_randn(0, 4, 4), mesh, [R]).requires_grad_(True)
    param.grad = _partial(_randn(1, 4, 4), mesh, (P,))
    with CommDebugMode() as mode:
        with pytest.raises(RuntimeError, match=r"_foreach_clamp_min_.*Partial"):
            torch.nn.utils.clip_grad_value_([param], 0.7, foreach=True)
    assert mode.get_total_counts() == 0


def test_clip_grad_value_keeps_layouts() -> None:
    run_on_threads(_check_clip_grad_value, world_size=4)


# ------------------------------------------------------------------------------------------ zero_grad


def _check_zero_grad() -> None:
    mesh = init_device_mesh("cpu", (4,))
    param_layouts: tuple[Layout, ...] = ((S0,), (R,), (R,), (S1,))
    layouts: tuple[Layout, ...] = ((S0,), (P,), (R,), (S1,))  # grads; a replicated param may get a Partial grad
    shapes = ((5, 3), (4,), (2, 2), (3, 6))
    for foreach in (True, False):
        for set_to_none in (False, True):
            params = [
                nn.Parameter(distribute_tensor(_randn(index, *shape), mesh, param_layout))
                for index, (shape, param_layout) in enumerate(zip(shapes, param_layouts))
            ]
            for index, (param, layout) in enumerate(zip(params, layouts)):
                param.grad = _partial(_randn(50 + index, *shapes[index]), mesh, layout)
            optimizer = torch.optim.SGD(params, lr=0.1, foreach=foreach)
            with CommDebugMode() as mode:
                optimizer.zero_grad(set_to_none=set_to_none)
            assert mode.get_total_counts() == 0
            for param, layout in zip(params, layouts):
                if set_to_none:
                    assert param.grad is None
                else:
                    assert isinstance(param.grad, DTensor) and param.grad.placements == layout
                    assert torch.count_nonzero(param.grad.full_tensor()) == 0
    module = nn.Linear(4, 3).double()
    module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [S0]))
    module.bias = nn.Parameter(distribute_tensor(module.bias.detach(), mesh, [R]))
    # create_graph=True gives the grads a history: zero_grad(set_to_none=False) then detaches them in place.
    module(distribute_tensor(_randn(3, 2, 4), mesh, [R])).pow(2).sum().backward(create_graph=True)
    assert all(param.grad is not None and param.grad.grad_fn is not None for param in module.parameters())
    for zero_grad in (module.zero_grad, torch.optim.SGD(module.parameters(), lr=0.1, foreach=True).zero_grad):
        zero_grad(set_to_none=False)
        for param in module.parameters():
            assert isinstance(param.grad, DTensor) and param.grad.grad_fn is None
            assert torch.count_nonzero(param.grad.full_tensor()) == 0


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_zero_grad_keeps_placements_and_moves_nothing() -> None:
    run_on_threads(_check_zero_grad, world_size=4)


# ---------------------------------------------------------------------------------- in-place updates

# (param layout, grad layout, the collective the grad needs to reach the param's layout)
UPDATE_CASES: tuple[tuple[Layout, Layout, Any], ...] = (
    ((S0,), (S0,), None),
    ((S0,), (R,), None),  # a local chunk
    ((R,), (S0,), c10d.all_gather_into_tensor),
    ((S0,), (S1,), c10d.all_to_all_single),
    ((R,), (P,), c10d.all_reduce),
    ((S1,), (P,), c10d.reduce_scatter_tensor),
)


def _check_inplace_updates() -> None:
    mesh = init_device_mesh("cpu", (4,))
    for index, (param_layout, grad_layout, collective) in enumerate(UPDATE_CASES):
        full = _randn(index, 8, 4)
        grad_full = _randn(200 + index, 8, 4)
        param = nn.Parameter(distribute_tensor(full, mesh, param_layout))
        grad = _partial(grad_full, mesh, grad_layout)
        expected = full.clone()
        with CommDebugMode() as mode, torch.no_grad():
            param.data.add_(grad, alpha=-0.1)  # the classic hand-written SGD step
            param.add_(grad, alpha=0.5)
            param.mul_(0.9)
        expected = (expected - 0.1 * grad_full + 0.5 * grad_full) * 0.9
        where = f"param {param_layout}, grad {grad_layout}"
        assert param.placements == param_layout, f"{where}: the parameter moved"
        _assert_close(param, expected, where)
        counts = mode.get_comm_counts()
        if collective is None:
            assert mode.get_total_counts() == 0, (where, counts)
        else:
            # The grad is redistributed once per update that reads it (two here), the param never.
            assert counts[collective] == 2 and mode.get_total_counts() == 2, (where, counts)
        with torch.no_grad():
            param.copy_(grad)
        _assert_close(param, grad_full, f"{where}: copy_")
        assert param.placements == param_layout


def test_inplace_parameter_updates_redistribute_the_grad_only() -> None:
    run_on_threads(_check_inplace_updates, world_size=4)


# ------------------------------------------------------------------------------------ checkpointing


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, checkpointing: str | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointing is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        return x


TP_PLAN: Mapping[str, Layout] = {"up.weight": (S0,), "up.bias": (S0,), "down.weight": (S1,), "down.bias": (R,)}


def _stack(checkpointing: str | None, mesh: Any | None) -> Stack:
    model = Stack(checkpointing).double()
    generator = torch.Generator().manual_seed(0)
    for block in model.blocks:
        for name, param in list(block.named_parameters()):
            value = torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.3
            module = getattr(block, name.split(".")[0])
            leaf = value if mesh is None else distribute_tensor(value, mesh, TP_PLAN[name])
            module.register_parameter(name.split(".")[1], nn.Parameter(leaf))
    return model


def _check_checkpoint() -> None:
    mesh = init_device_mesh("cpu", (4,))
    x_full = _randn(9, 3, 5, 6)
    plain = _stack(None, None)
    plain_x = x_full.clone().requires_grad_(True)
    plain(plain_x).pow(2).sum().backward()
    assert plain_x.grad is not None
    for checkpointing in (None, "non-reentrant", "reentrant"):
        model = _stack(checkpointing, mesh)
        x = distribute_tensor(x_full, mesh, [R]).requires_grad_(True)
        with CommDebugMode() as mode:
            out = model(x)
        forward_collectives = mode.get_total_counts()
        out.pow(2).sum().backward()
        where = f"checkpointing={checkpointing}"
        assert x.grad is not None
        _assert_close(x.grad, plain_x.grad, f"{where}: input grad")
        for (name, param), (_, reference) in zip(model.named_parameters(), plain.named_parameters()):
            assert isinstance(param.grad, DTensor) and reference.grad is not None, f"{where}: {name}"
            _assert_close(param.grad, reference.grad, f"{where}: {name}")
        assert forward_collectives == 2, f"{where}: one all_reduce per row-wise Linear, got {forward_collectives}"


def test_checkpoint_with_dtensor_activations_gives_the_same_grads() -> None:
    run_on_threads(_check_checkpoint, world_size=4)


# -------------------------------------------------------------- end to end on 4 gloo processes


@multi_rank(world_size=4)
def test_training_steps_on_gloo_processes() -> None:
    """Checkpointed TP forward, backward, clip_grad_norm_, AdamW, zero_grad: the same as plain torch."""
    _check_clip_grad_norm((2, 2), GRAD_LAYOUTS_2X2, thread_ranks=False)
    mesh = init_device_mesh("cpu", (4,))
    plain = _stack(None, None)
    model = _stack("non-reentrant", mesh)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.1, foreach=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, foreach=True)
    for step in range(2):
        x = _randn(300 + step, 3, 5, 6)
        plain(x).pow(2).sum().backward()
        model(distribute_tensor(x, mesh, [R])).pow(2).sum().backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0, foreach=True)
        total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        _assert_close(total_norm, expected_norm, f"step {step}: total norm")
        plain_optimizer.step()
        optimizer.step()
        plain_optimizer.zero_grad()
        optimizer.zero_grad()
        for (name, param), (_, reference) in zip(model.named_parameters(), plain.named_parameters()):
            assert isinstance(param, DTensor)
            _assert_close(param, reference.detach(), f"step {step}: {name}")
