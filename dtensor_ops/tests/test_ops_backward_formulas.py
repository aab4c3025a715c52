"""Plain tensors that torch's own backward formulas build next to DTensors (rank threads, 1-D mesh of 4).

Formulas such as cumprod's, prod's, trace's or the ``*_scatter`` ops' make plain tensors (``zeros``,
index tensors, masks) from global sizes and constants, the same on every rank, and mix them with
the DTensor gradients: dispatch counts them as replicated. The gradients must equal plain torch's
on every sharding. A custom ``autograd.Function``'s backward is user code and keeps the usual
error, as does a plain tensor mixed in outside backward.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.distributed as dist

from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.dtensor_ops.experimental import implicit_replication
from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement
from shardwise.testing import run_on_threads

_WORLD = 4


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", list(range(_WORLD)))


def _input(shape: tuple[int, ...]) -> torch.Tensor:
    # Zeros included: cumprod's and prod's formulas take their zero-handling branches then.
    values = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) / 7.0
    values.view(-1)[3] = 0.0
    return values


def _weights(shape: torch.Size) -> torch.Tensor:
    return torch.cos(torch.arange(shape.numel(), dtype=torch.float32) * 0.7).reshape(shape)


_CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "cumprod_dim0": lambda t: torch.cumprod(t, 0),
    "cumprod_dim1": lambda t: torch.cumprod(t, 1),
    "prod_dim1": lambda t: torch.prod(t, 1),
    "trace": lambda t: torch.trace(t),
    "select_scatter": lambda t: torch.select_scatter(t, t[1] * 2.0, 0, 2),
    "slice_scatter": lambda t: torch.slice_scatter(t, t[:, :2] * 3.0, 1, 1, 3),
    "diagonal_scatter": lambda t: torch.diagonal_scatter(t, t.diagonal() * 5.0),
}


def _gradients_match(name: str, placements: tuple[Placement, ...]) -> None:
    mesh = _mesh()
    fn = _CASES[name]
    full = _input((6, 6)).requires_grad_(True)
    expected_out = fn(full)
    (expected_grad,) = torch.autograd.grad((expected_out * _weights(expected_out.shape)).sum(), full)

    source = distribute_tensor(_input((6, 6)), mesh, list(placements)).requires_grad_(True)
    out = fn(source)
    assert isinstance(out, DTensor)
    loss = (out.full_tensor() * _weights(out.shape)).sum()
    (grad,) = torch.autograd.grad(loss, source)
    assert isinstance(grad, DTensor)
    torch.testing.assert_close(out.full_tensor(), expected_out.detach())
    torch.testing.assert_close(grad.full_tensor(), expected_grad)


@pytest.mark.parametrize("placements", [(Replicate(),), (Shard(0),), (Shard(1),)], ids=str)
@pytest.mark.parametrize("name", sorted(_CASES))
def test_plain_tensors_of_builtin_backward_formulas_count_as_replicated(name: str, placements: tuple[Placement, ...]) -> None:
    run_on_threads(_gradients_match, name, placements, world_size=_WORLD)


class _AddsPlainOnesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        # User code: this plain tensor could hold anything per rank, so it must not count as replicated.
        return grad * 2.0 + torch.ones(grad.shape)


def _custom_backward_raises() -> None:
    source = distribute_tensor(torch.ones(8, 4), _mesh(), [Shard(0)]).requires_grad_(True)
    out = _AddsPlainOnesInBackward.apply(source)
    with pytest.raises(RuntimeError, match=r"aten\.add\.Tensor: got mixed torch\.Tensor and DTensor arguments"):
        out.sum().backward()


def test_a_custom_functions_backward_keeps_the_mixed_tensor_error() -> None:
    run_on_threads(_custom_backward_raises, world_size=_WORLD)


def _forward_mixing_raises_backward_of_implicit_replication_works() -> None:
    mesh = _mesh()
    plain = torch.arange(4, dtype=torch.float32) + 1.0
    source = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)]).requires_grad_(True)
    with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor arguments"):
        source * plain
    # implicit_replication is process-wide and the ranks are threads: no rank enters it before all have checked.
    dist.barrier()
    with implicit_replication():
        out = source * plain
    # mul's backward multiplies the gradient by the saved plain tensor, after the context has closed.
    out.sum().backward()
    assert isinstance(source.grad, DTensor)
    torch.testing.assert_close(source.grad.full_tensor(), plain.expand(8, 4))


def test_plain_tensor_outside_backward_still_raises_and_saved_implicit_ones_differentiate() -> None:
    run_on_threads(_forward_mixing_raises_backward_of_implicit_replication_works, world_size=_WORLD)


# ------------------------------------------------------------------- masked_fill of partial values


def _masked_fill_of_partials() -> None:
    mesh = _mesh()
    rank = dist.get_rank()
    whole = _input((4, 5))
    mask = whole > 1.0
    mask_dt = distribute_tensor(mask, mesh, [Replicate()])
    pieces = {
        # Pieces whose reduction is `whole`: sum of (whole + rank) - offsets, avg of whole +- rank, max/min.
        "sum": whole / _WORLD,
        "avg": whole + (rank - 1.5),
        "max": whole - rank,
        "min": whole + rank,
    }
    for reduce_op, piece in pieces.items():
        partial = DTensor.from_local(piece, mesh, [Partial(reduce_op)], shape=whole.shape, stride=whole.stride())
        with CommDebugMode() as comm:
            filled = partial.masked_fill(mask_dt, -3.0)
            partial.masked_fill_(mask_dt, -3.0)
        assert comm.get_total_counts() == 0, reduce_op
        assert filled.placements == (Partial(reduce_op),) and partial.placements == (Partial(reduce_op),)
        torch.testing.assert_close(filled.full_tensor(), whole.masked_fill(mask, -3.0))
        torch.testing.assert_close(partial.full_tensor(), whole.masked_fill(mask, -3.0))


def test_masked_fill_keeps_partial_values_partial_without_communication() -> None:
    run_on_threads(_masked_fill_of_partials, world_size=_WORLD)


def _scatter_reduce_mean_backward(index_placement: Placement) -> None:
    mesh = _mesh()
    full = _input((6, 4))
    source = _input((5, 4)) * 2.0
    index = torch.tensor([[0, 1, 2, 3], [5, 5, 0, 1], [2, 2, 2, 2], [0, 4, 4, 1], [3, 0, 5, 2]])
    leaves = [full.clone().requires_grad_(True), source.clone().requires_grad_(True)]
    expected_out = torch.scatter_reduce(leaves[0], 0, index, leaves[1], "mean", include_self=False)
    expected = torch.autograd.grad((expected_out * _weights(expected_out.shape)).sum(), leaves)

    dt_full = distribute_tensor(full, mesh, [Replicate()]).requires_grad_(True)
    dt_source = distribute_tensor(source, mesh, [Shard(1)]).requires_grad_(True)
    dt_index = distribute_tensor(index, mesh, [index_placement])
    out = torch.scatter_reduce(dt_full, 0, dt_index, dt_source, "mean", include_self=False)
    grads = torch.autograd.grad((out.full_tensor() * _weights(out.shape)).sum(), [dt_full, dt_source])
    torch.testing.assert_close(out.full_tensor(), expected_out.detach())
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got.full_tensor(), want)


@pytest.mark.parametrize("index_placement", [Replicate(), Shard(0), Shard(1)], ids=str)
def test_scatter_reduce_mean_backward_with_a_sharded_index(index_placement: Placement) -> None:
    run_on_threads(_scatter_reduce_mean_backward, index_placement, world_size=_WORLD)
