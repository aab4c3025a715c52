"""The parallel styles on 4 ranks: the layouts, values and gradients they produce, and the exact number
of collectives per forward and backward (those of PyTorch's own style tests)."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from style_helpers import RMSNormPython, expect_counts, my_chunk, rank_and_world

from shardwise.dtensor_ops import DTensor, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.placement import Partial, Replicate, Shard
from shardwise.testing import multi_rank
from shardwise.tp_styles import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from shardwise.tp_styles.style import LayoutMismatchError


def _full_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output, input grad, weight grad and bias grad of a plain Linear on the whole input."""
    reference = deepcopy(model)
    x_full = x.detach().clone().requires_grad_(True)
    out = reference(x_full)
    out.sum().backward()
    assert x_full.grad is not None and reference.weight.grad is not None and reference.bias.grad is not None
    return out.detach(), x_full.grad, reference.weight.grad, reference.bias.grad


@multi_rank
def test_colwise_linear_counts_layouts_and_values() -> None:
    rank, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    model = nn.Linear(16, 16)
    x_full = torch.rand(8, 16)
    out_ref, x_grad_ref, w_grad_ref, b_grad_ref = _full_grads(model, x_full)
    mode = CommDebugMode()

    # Replicated input: nothing to move forward; backward all-reduces the input's partial gradient.
    colwise = parallelize_module(deepcopy(model), mesh, ColwiseParallel())
    assert colwise.weight.placements == (Shard(0),) and colwise.bias.placements == (Shard(0),)
    x = x_full.clone().requires_grad_(True)
    with mode:
        out = colwise(x)
        assert type(out) is not DTensor and out.shape == (8, 16 // world)
        expect_counts(mode, "colwise forward", 0)
        out.sum().backward()
        expect_counts(mode, "colwise forward+backward", 1, all_reduce=1)
    torch.testing.assert_close(out, my_chunk(out_ref, 1))
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x_grad_ref)
    torch.testing.assert_close(colwise.weight.grad.to_local(), my_chunk(w_grad_ref, 0))
    torch.testing.assert_close(colwise.bias.grad.to_local(), my_chunk(b_grad_ref, 0))

    # Batch-sharded input: all-gather forward, reduce-scatter of its gradient backward.
    colwise = parallelize_module(deepcopy(model), mesh, ColwiseParallel(input_layouts=Shard(0)))
    x_global = torch.rand(8 * world, 16)
    out_ref, x_grad_ref, w_grad_ref, _ = _full_grads(model, x_global)
    x = my_chunk(x_global, 0).clone().requires_grad_(True)
    with mode:
        out = colwise(x)
        assert out.shape == (8 * world, 16 // world)
        expect_counts(mode, "colwise Shard(0) input forward", 1, all_gather_into_tensor=1)
        out.sum().backward()
        expect_counts(mode, "colwise Shard(0) input forward+backward", 2, all_gather_into_tensor=1, reduce_scatter_tensor=1)
    torch.testing.assert_close(out, my_chunk(out_ref, 1))
    assert x.grad is not None
    torch.testing.assert_close(x.grad, my_chunk(x_grad_ref, 0))
    torch.testing.assert_close(colwise.weight.grad.to_local(), my_chunk(w_grad_ref, 0))

    # use_local_output=False hands back the DTensor, here asked to be replicated (one all-gather).
    colwise = parallelize_module(
        deepcopy(model), mesh, ColwiseParallel(output_layouts=Replicate(), use_local_output=False)
    )
    with mode:
        out = colwise(x_full)
        expect_counts(mode, "colwise Replicate output forward", 1, all_gather_into_tensor=1)
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    torch.testing.assert_close(out.to_local(), model(x_full).detach())
    del rank


@multi_rank
def test_rowwise_linear_counts_layouts_and_values() -> None:
    rank, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(2)
    model = nn.Linear(16, 16)
    x_global = torch.rand(8, 16)
    out_ref, x_grad_ref, w_grad_ref, b_grad_ref = _full_grads(model, x_global)
    mode = CommDebugMode()

    # Feature-sharded input, replicated output: one all-reduce forward, nothing backward.
    rowwise = parallelize_module(deepcopy(model), mesh, RowwiseParallel())
    assert rowwise.weight.placements == (Shard(1),) and rowwise.bias.placements == (Replicate(),)
    x = my_chunk(x_global, 1).clone().requires_grad_(True)
    with mode:
        out = rowwise(x)
        assert out.shape == (8, 16)
        expect_counts(mode, "rowwise forward", 1, all_reduce=1)
        out.sum().backward()
        expect_counts(mode, "rowwise forward+backward", 1, all_reduce=1)
    torch.testing.assert_close(out, out_ref)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, my_chunk(x_grad_ref, 1))
    torch.testing.assert_close(rowwise.weight.grad.full_tensor(), w_grad_ref)
    torch.testing.assert_close(rowwise.bias.grad.full_tensor(), b_grad_ref)

    # Batch-sharded output: reduce-scatter forward, all-gather of the gradient backward.
    rowwise = parallelize_module(deepcopy(model), mesh, RowwiseParallel(output_layouts=Shard(0)))
    x = my_chunk(x_global, 1).clone().requires_grad_(True)
    with mode:
        out = rowwise(x)
        assert out.shape == (8 // world, 16)
        expect_counts(mode, "rowwise Shard(0) output forward", 1, reduce_scatter_tensor=1)
        out.sum().backward()
        expect_counts(
            mode, "rowwise Shard(0) output forward+backward", 2, reduce_scatter_tensor=1, all_gather_into_tensor=1
        )
    torch.testing.assert_close(out, my_chunk(out_ref, 0))
    assert x.grad is not None
    torch.testing.assert_close(x.grad, my_chunk(x_grad_ref, 1))
    torch.testing.assert_close(rowwise.weight.grad.full_tensor(), w_grad_ref)

    # A DTensor input keeps its own layout: replicated here, so the style chunks it locally (no collective).
    rowwise = parallelize_module(deepcopy(model), mesh, RowwiseParallel(use_local_output=False))
    x_dt = distribute_tensor(x_global, mesh, [Replicate()])
    with mode:
        out = rowwise(x_dt)
        expect_counts(mode, "rowwise replicated DTensor input forward", 1, all_reduce=1)
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    torch.testing.assert_close(out.to_local(), out_ref)
    del rank


@multi_rank
def test_colwise_embedding_counts() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    model = nn.Embedding(16, 16)
    indices = torch.arange(8).reshape(4, 2)
    colwise = parallelize_module(deepcopy(model), mesh, ColwiseParallel())
    assert colwise.weight.placements == (Shard(1),)
    mode = CommDebugMode()
    with mode:
        out = colwise(indices)
        assert out.shape == (4, 2, 16 // world)
        expect_counts(mode, "colwise embedding forward", 0)
        out.sum().backward()
        expect_counts(mode, "colwise embedding forward+backward", 0)
    torch.testing.assert_close(out, my_chunk(model(indices).detach(), 2))


@multi_rank
def test_rowwise_embedding_counts() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(4)
    model = nn.Embedding(16, 16)
    mode = CommDebugMode()

    rowwise = parallelize_module(deepcopy(model), mesh, RowwiseParallel(input_layouts=Replicate()))
    assert rowwise.weight.placements == (Shard(0),)
    indices = torch.arange(8).reshape(4, 2)
    with mode:
        out = rowwise(indices)
        assert out.shape == (4, 2, 16)
        expect_counts(mode, "rowwise embedding forward", 1, all_reduce=1)
        out.sum().backward()
        expect_counts(mode, "rowwise embedding forward+backward", 1, all_reduce=1)
    torch.testing.assert_close(out, model(indices).detach())

    rowwise = parallelize_module(
        deepcopy(model), mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    )
    indices = torch.arange(8)
    with mode:
        out = rowwise(indices)
        assert out.shape == (8, 16 // world)
        expect_counts(mode, "rowwise embedding Shard(1) forward", 1, reduce_scatter_tensor=1)
        out.sum().backward()
        expect_counts(
            mode, "rowwise embedding Shard(1) forward+backward", 2, reduce_scatter_tensor=1, all_gather_into_tensor=1
        )
    torch.testing.assert_close(out, my_chunk(model(indices).detach(), 1))


class _Pair(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a, b


@multi_rank
def test_prepare_module_input_and_output_on_identity() -> None:
    rank, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    mode = CommDebugMode()
    # Distinct values per rank, so that gathering in the wrong order would show.
    piece = torch.full((2, 16), float(rank))
    gathered = torch.cat([torch.full((2, 16), float(r)) for r in range(world)])

    allgather = parallelize_module(
        nn.Identity(), mesh, PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate())
    )
    with mode:
        out = allgather(piece)
        expect_counts(mode, "PrepareModuleInput S(0)->R", 1, all_gather_into_tensor=1)
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    torch.testing.assert_close(out.full_tensor(), gathered)

    local_in = parallelize_module(
        nn.Identity(),
        mesh,
        PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate(), use_local_output=True),
    )
    out = local_in(piece)
    assert type(out) is not DTensor
    torch.testing.assert_close(out, gathered)

    chunk = parallelize_module(
        nn.Identity(), mesh, PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    )
    whole = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)
    with mode:
        out = chunk(whole)
        expect_counts(mode, "PrepareModuleOutput R->S(0)", 0)
    assert type(out) is not DTensor
    torch.testing.assert_close(out, my_chunk(whole, 0))

    both = parallelize_module(
        nn.Identity(),
        mesh,
        PrepareModuleInputOutput(
            input_layouts=Shard(0),
            desired_input_layouts=Replicate(),
            output_layouts=Replicate(),
            desired_output_layouts=Shard(1),
        ),
    )
    with mode:
        out = both(piece)
        expect_counts(mode, "PrepareModuleInputOutput", 1, all_gather_into_tensor=1)
    assert type(out) is not DTensor and out.shape == (2 * world, 16 // world)
    torch.testing.assert_close(out, my_chunk(gathered, 1))

    # Tuple outputs: one layout per element, None leaves an element alone.
    pair = parallelize_module(
        _Pair(),
        mesh,
        PrepareModuleOutput(
            output_layouts=(Shard(0), None), desired_output_layouts=(Replicate(), None), use_local_output=False
        ),
    )
    first, second = pair(piece, piece)
    assert isinstance(first, DTensor) and type(second) is not DTensor
    torch.testing.assert_close(first.to_local(), gathered)
    with pytest.raises(ValueError, match="module outputs and output_layouts should have same length!"):
        chunk_pair = parallelize_module(
            _Pair(), mesh, PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        )
        chunk_pair(piece, piece)


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + y


@multi_rank
def test_prepare_module_input_multiple_inputs() -> None:
    rank, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    with pytest.raises(AssertionError, match="input_layouts and desired_input_layouts should have same length!"):
        PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=(Replicate(), None))
    with pytest.raises(LayoutMismatchError):
        PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=(Replicate(), None))

    torch.manual_seed(5)
    module = _TwoInputs()
    reference = deepcopy(module)
    too_short = PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate())
    parallelize_module(module.linear, mesh, ColwiseParallel())
    parallelize_module(module, mesh, too_short)
    x_full = torch.randn(2 * world, 8)
    y = torch.ones(world * 2, 8 // world)
    with pytest.raises(ValueError, match="module inputs and input_layouts should have same length!"):
        module(my_chunk(x_full, 0), y)

    module = deepcopy(reference)
    parallelize_module(module.linear, mesh, ColwiseParallel())
    parallelize_module(
        module, mesh, PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None))
    )
    mode = CommDebugMode()
    with mode:
        out = module(my_chunk(x_full, 0), y)
        expect_counts(mode, "two inputs, the first gathered", 1, all_gather_into_tensor=1)
    assert out.shape == (world * 2, 8 // world)
    torch.testing.assert_close(out, my_chunk(reference.linear(x_full).detach(), 1) + y)

    # No declared layout but a desired one: a DTensor is moved from its own layout; a plain tensor,
    # whose layout nobody knows, is refused - after checking every input, before any collective.
    pair = parallelize_module(
        _Pair(), mesh, PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), Replicate()))
    )
    piece = torch.full((2, 3), float(rank))
    with mode:
        with pytest.raises(ValueError, match=r"input 1 has no declared layout \(None\) but a desired layout Replicate\(\)"):
            pair(piece, piece)
        expect_counts(mode, "refused inputs", 0)
    first, second = pair(piece, DTensor.from_local(piece, mesh, [Shard(0)]))
    assert first.placements == second.placements == (Replicate(),)
    torch.testing.assert_close(second.to_local(), torch.cat([torch.full((2, 3), float(r)) for r in range(world)]))


class _KwargModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, y: torch.Tensor, z: int = 2) -> torch.Tensor:
        return self.linear(x) + y + z


class _KwargOnlyModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, *, x: torch.Tensor, y: int = 2, z: torch.Tensor | None = None) -> torch.Tensor:
        assert z is not None
        return self.linear(x) + y + z


@multi_rank
def test_prepare_module_kwargs_input() -> None:
    rank, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    mode = CommDebugMode()
    torch.manual_seed(6)

    module = _KwargModule()
    reference = deepcopy(module)
    parallelize_module(module.linear, mesh, ColwiseParallel(use_local_output=False))
    parallelize_module(
        module,
        mesh,
        PrepareModuleInput(input_kwarg_layouts={"y": Shard(0)}, desired_input_kwarg_layouts={"y": Replicate()}),
    )
    x = torch.randn(world, 8)
    y_full = torch.arange(world * 8, dtype=torch.float32).reshape(world, 8)
    with mode:
        out = module(x, y=my_chunk(y_full, 0))
        expect_counts(mode, "keyword y gathered", 1, all_gather_into_tensor=1)
    assert isinstance(out, DTensor) and out.shape == (world, 8)
    torch.testing.assert_close(out.full_tensor(), reference(x, y=y_full).detach())

    only = _KwargOnlyModule()
    reference_only = deepcopy(only)
    parallelize_module(only.linear, mesh, ColwiseParallel(use_local_output=False))
    parallelize_module(
        only,
        mesh,
        PrepareModuleInput(
            input_kwarg_layouts={"x": Shard(0), "z": Shard(0)},
            desired_input_kwarg_layouts={"x": Replicate(), "z": Replicate()},
        ),
    )
    x_full = torch.randn(world, 8)
    z_full = torch.randn(world, 8)
    with mode:
        out = only(x=my_chunk(x_full, 0), z=my_chunk(z_full, 0))
        expect_counts(mode, "keyword-only x and z gathered", 2, all_gather_into_tensor=2)
    assert out.shape == (world, 8)
    expected = reference_only(x=x_full, z=z_full).detach()
    torch.testing.assert_close(out.full_tensor(), expected)

    # x already a DTensor: its own layout is used and it is gathered like the plain one.
    x_dt = DTensor.from_local(my_chunk(x_full, 0), mesh, [Shard(0)])
    with mode:
        out = only(x=x_dt, z=my_chunk(z_full, 0))
        expect_counts(mode, "keyword-only x as DTensor", 2, all_gather_into_tensor=2)
    torch.testing.assert_close(out.full_tensor(), expected)

    # Local tensors for the forward when asked.
    local_only = deepcopy(reference_only)
    parallelize_module(
        local_only,
        mesh,
        PrepareModuleInput(
            input_kwarg_layouts={"x": Shard(0), "z": Shard(0)},
            desired_input_kwarg_layouts={"x": Replicate(), "z": Replicate()},
            use_local_output=True,
        ),
    )
    out = local_only(x=my_chunk(x_full, 0), z=my_chunk(z_full, 0))
    assert type(out) is not DTensor
    torch.testing.assert_close(out, expected)
    del rank


@multi_rank
def test_sequence_parallel_rms_norm() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    mode = CommDebugMode()
    torch.manual_seed(7)
    batch, seq_per_rank, dim = 3, 2, 6
    global_input = torch.rand(batch, seq_per_rank * world, dim)
    norm = RMSNormPython(dim)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim) + 0.5)
    reference = deepcopy(norm)
    expected = reference(global_input)
    expected.sum().backward()

    sp_norm = parallelize_module(deepcopy(norm), mesh, SequenceParallel())
    assert sp_norm.weight.placements == (Replicate(),)
    sharded = distribute_tensor(global_input, mesh, [Shard(1)])
    with mode:
        out = sp_norm(sharded)
        out.backward(torch.ones_like(out))
        expect_counts(mode, "SequenceParallel RMSNorm on its sequence shard", 0)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    assert sp_norm.weight.grad.placements == (Partial(),)
    torch.testing.assert_close(out.full_tensor(), expected.detach())
    torch.testing.assert_close(sp_norm.weight.grad.full_tensor(), reference.weight.grad)

    # A plain tensor is taken as this rank's sequence shard; use_local_output hands back the local piece.
    local_norm = parallelize_module(deepcopy(norm), mesh, SequenceParallel(use_local_output=True))
    out_local = local_norm(my_chunk(global_input, 1))
    assert type(out_local) is not DTensor
    torch.testing.assert_close(out_local, my_chunk(expected.detach(), 1))

    # Input sharded on the batch dim: moved to the sequence dim forward, and its gradient back.
    sp_norm = parallelize_module(deepcopy(norm), mesh, SequenceParallel())
    batch_input = torch.rand(world, seq_per_rank * world, dim, requires_grad=True)
    batch_sharded = distribute_tensor(batch_input, mesh, [Shard(0)])
    with mode:
        out = sp_norm(batch_sharded)
        expect_counts(mode, "SequenceParallel RMSNorm on a batch-sharded input, forward", 1)
        out.backward(torch.ones_like(out))
        expect_counts(mode, "SequenceParallel RMSNorm on a batch-sharded input", 2)
    assert out.placements == (Shard(1),)
    assert sp_norm.weight.grad.placements == (Partial(),)
    assert batch_sharded.grad is not None and batch_sharded.grad.placements == (Shard(0),)

    # sequence_dim picks another dim.
    dim0_norm = parallelize_module(deepcopy(norm), mesh, SequenceParallel(sequence_dim=0))
    seq_first = torch.rand(seq_per_rank * world, batch, dim)
    out = dim0_norm(my_chunk(seq_first, 0))
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), reference(seq_first).detach())


@multi_rank
def test_sequence_parallel_layer_norm() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    mode = CommDebugMode()
    torch.manual_seed(8)
    global_input = torch.rand(3, 2 * world, 6)
    # The input requires grad so that the round without affine parameters still has a backward.
    sharded = distribute_tensor(global_input, mesh, [Shard(1)]).requires_grad_()
    for elementwise_affine in (True, False):
        norm = nn.LayerNorm(6, elementwise_affine=elementwise_affine)
        reference = deepcopy(norm)
        expected = reference(global_input)
        sp_norm = parallelize_module(deepcopy(norm), mesh, SequenceParallel())
        with mode:
            out = sp_norm(sharded)
            out.backward(torch.ones_like(out))
            expect_counts(mode, f"SequenceParallel LayerNorm(elementwise_affine={elementwise_affine})", 0)
        assert isinstance(out, DTensor) and out.placements == (Shard(1),)
        if elementwise_affine:
            assert sp_norm.weight.grad.placements == (Partial(),)
            assert sp_norm.bias.grad.placements == (Partial(),)
        torch.testing.assert_close(out.full_tensor(), expected.detach())


@multi_rank
def test_sequence_parallel_dropout() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    mode = CommDebugMode()
    global_input = torch.rand(3, 2 * world, 6, requires_grad=True)
    sharded = distribute_tensor(global_input, mesh, [Shard(1)])
    sp_dropout = parallelize_module(nn.Dropout(0.5), mesh, SequenceParallel())
    with mode:
        out = sp_dropout(sharded)
        out.backward(torch.ones_like(out))
        expect_counts(mode, "SequenceParallel Dropout", 0)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    # Kept elements are scaled by 2, dropped ones are 0: nothing else.
    values = out.to_local()
    kept = values != 0
    torch.testing.assert_close(values[kept], 2 * sharded.to_local()[kept])
