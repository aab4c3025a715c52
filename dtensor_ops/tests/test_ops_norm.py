"""Normalisation layers on DTensors: LayerNorm and RMSNorm as sequence / tensor parallelism lays them out.

The op-level sweep over every sharding of input, weight and bias lives in
test_ops_math.py (family "normalization").  Here: the modules (``nn.LayerNorm``,
``shardwise.testing.RMSNormPython``) with the layouts a tensor-parallel plan
produces, on 4 gloo ranks and a 2x2 mesh, forward and backward against plain torch
with the exact collectives; the fused RMSNorm backward's rule (its kernel exists
on accelerators only, so its exactness is checked by simulating the ranks with
the math it computes); and errors.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any, Sequence

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops._sharding_prop import propagate_op_sharding
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.placement import DTensorSpec, TensorMeta, select_local_shard
from shardwise.testing import FakeMesh, RMSNormPython, multi_rank

aten = torch.ops.aten


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: count for op, count in mode.get_comm_counts().items() if count}


def _from_full(full: torch.Tensor, mesh: Any, placements: Sequence[Placement]) -> DTensor:
    """This rank's piece of ``full`` as a DTensor, without communication (Shard / Replicate placements)."""
    local = select_local_shard(full, tuple(mesh.shape), tuple(mesh.get_coordinate()), tuple(placements))
    return DTensor.from_local(local.clone(), mesh, placements, shape=full.shape, stride=full.stride())


def _distribute_module(module: nn.Module, mesh: Any) -> nn.Module:
    """A copy of ``module`` with every parameter replicated on ``mesh`` (what SequenceParallel does)."""
    copy = deepcopy(module)
    for name, parameter in list(copy.named_parameters(recurse=False)):
        replicated = distribute_tensor(parameter.detach(), mesh, [Replicate()] * mesh.ndim)
        setattr(copy, name, nn.Parameter(replicated))
    return copy


def _check_module(
    module: nn.Module,
    mesh: Any,
    input_placements: Sequence[Placement],
    shape: tuple[int, ...],
    *,
    expected_collectives: dict[str, int] | None,
    expected_param_grad_placements: tuple[Placement, ...] | None,
    output_like_input: bool = True,
) -> None:
    """Forward and backward of ``module`` on a DTensor input vs plain torch (values, grads, collectives)."""
    where = f"{type(module).__name__} input {shape} {tuple(input_placements)} on mesh {tuple(mesh.shape)}"
    full_input = _randn(1, *shape)
    upstream = _randn(2, *shape)
    reference = deepcopy(module)
    reference_input = full_input.clone().requires_grad_()
    reference(reference_input).backward(upstream)

    sharded_module = _distribute_module(module, mesh)
    x = _from_full(full_input, mesh, input_placements).requires_grad_()
    mode = CommDebugMode()
    with mode:
        out = sharded_module(x)
        out.backward(_from_full(upstream, mesh, out.placements))
    if expected_collectives is not None:
        counts = _counts(mode)
        assert counts == expected_collectives, f"{where}: collectives {counts}, expected {expected_collectives}"
    assert isinstance(out, DTensor), where
    if output_like_input:
        assert out.placements == tuple(input_placements), f"{where}: output {out.placements}"
    torch.testing.assert_close(out.full_tensor(), reference(full_input).detach(), msg=lambda m: f"{where}: {m}")
    assert isinstance(x.grad, DTensor) and reference_input.grad is not None
    torch.testing.assert_close(x.grad.full_tensor(), reference_input.grad, msg=lambda m: f"{where}, input grad: {m}")
    for (name, parameter), (_, reference_parameter) in zip(
        sharded_module.named_parameters(), reference.named_parameters()
    ):
        grad = parameter.grad
        assert isinstance(grad, DTensor) and reference_parameter.grad is not None, f"{where}: {name}"
        if expected_param_grad_placements is not None:
            assert grad.placements == expected_param_grad_placements, f"{where}: {name}.grad {grad.placements}"
        torch.testing.assert_close(grad.full_tensor(), reference_parameter.grad, msg=f"{where}, {name} grad")


def _norm_modules() -> list[nn.Module]:
    torch.manual_seed(3)
    layer_norm = nn.LayerNorm(8, dtype=torch.float64)
    with torch.no_grad():
        layer_norm.weight.normal_()
        layer_norm.bias.normal_()
    rms_norm = RMSNormPython(8).double()
    with torch.no_grad():
        rms_norm.weight.normal_()
    return [layer_norm, nn.LayerNorm(8, elementwise_affine=False, dtype=torch.float64), rms_norm]


@multi_rank(world_size=4)
def test_norms_under_sequence_parallel_layouts() -> None:
    """Batch / sequence sharded: no communication at all, weight and bias gradients Partial(sum)."""
    mesh = init_device_mesh("cpu", (4,))
    dp_sp = init_device_mesh("cpu", (2, 2))
    for module in _norm_modules():
        # Sequence dim 1: even (8 over 4) and uneven (6: one rank holds nothing).
        for shape in ((3, 8, 8), (2, 6, 8)):
            _check_module(
                module, mesh, [Shard(1)], shape, expected_collectives={}, expected_param_grad_placements=(Partial(),)
            )
        _check_module(
            module, mesh, [Shard(0)], (5, 3, 8), expected_collectives={}, expected_param_grad_placements=(Partial(),)
        )
        # Data parallel on mesh dim 0 (batch), sequence parallel on mesh dim 1.
        _check_module(
            module,
            dp_sp,
            [Shard(0), Shard(1)],
            (4, 6, 8),
            expected_collectives={},
            expected_param_grad_placements=(Partial(), Partial()),
        )
        # Replicated activations: everything stays replicated, nothing moves.
        _check_module(
            module, mesh, [Replicate()], (2, 3, 8), expected_collectives={},
            expected_param_grad_placements=(Replicate(),),
        )  # fmt: skip


def _layer_norm_on_its_normalized_dim() -> None:
    mesh = init_device_mesh("cpu", (4,))
    x_full = _randn(5, 4, 8)
    weight, bias = _randn(6, 8), _randn(7, 8)
    x = distribute_tensor(x_full, mesh, [Shard(1)])
    w = distribute_tensor(weight, mesh, [Replicate()])
    b = distribute_tensor(bias, mesh, [Replicate()])
    mode = CommDebugMode()
    with mode:
        out = F.layer_norm(x, (8,), w, b)
    assert isinstance(out, DTensor)
    # The rows must be whole: one all-to-all moves the shards onto dim 0 (4 rows, cheaper than an all-gather).
    assert _counts(mode) == {"all_to_all_single": 1} and out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), F.layer_norm(x_full, (8,), weight, bias))


@multi_rank(world_size=4)
def test_norms_with_the_normalized_dim_sharded() -> None:
    """Tensor-parallel layouts (hidden dim sharded): the statistics need whole rows, so data moves first."""
    _layer_norm_on_its_normalized_dim()
    mesh = init_device_mesh("cpu", (4,))
    for module in _norm_modules():
        _check_module(
            module,
            mesh,
            [Shard(2)],
            (2, 3, 8),
            expected_collectives=None,
            expected_param_grad_placements=None,
            output_like_input=False,
        )


@multi_rank(world_size=4)
def test_f_rms_norm_with_its_normalized_dim_sharded() -> None:
    """On CPU F.rms_norm is pow, mean (Partial(avg) over the sharded dim), add_(eps) in place, rsqrt, mul.

    Adding a number to a Partial(avg) is exact, so the mean's pending average survives the in-place add
    and is reduced only where rsqrt needs whole values: one all-reduce of the per-row statistic (1/8 of
    the input), or a reduce-scatter of it and then one more collective to line it up with the input for
    the mul: an all-gather of the statistic, or, where latency dominates and all-to-all is the cheaper
    collective (gloo's profile), an all-to-all of the (small) input.
    """
    mesh = init_device_mesh("cpu", (4,))
    x_full, weight = _randn(8, 2, 3, 8), _randn(9, 8)
    x = distribute_tensor(x_full, mesh, [Shard(2)]).requires_grad_()
    w = distribute_tensor(weight, mesh, [Replicate()]).requires_grad_()
    mode = CommDebugMode()
    with mode:
        out = F.rms_norm(x, (8,), w)
    assert isinstance(out, DTensor)
    assert _counts(mode) in (
        {"all_reduce": 1},
        {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1},
        {"reduce_scatter_tensor": 1, "all_to_all_single": 1},
    )
    reference_x, reference_w = x_full.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = F.rms_norm(reference_x, (8,), reference_w)
    torch.testing.assert_close(out.full_tensor(), expected)
    upstream = _randn(10, 2, 3, 8)
    out.backward(_from_full(upstream, mesh, out.placements))
    expected.backward(upstream)
    assert isinstance(x.grad, DTensor) and isinstance(w.grad, DTensor)
    assert reference_x.grad is not None and reference_w.grad is not None
    torch.testing.assert_close(x.grad.full_tensor(), reference_x.grad)
    torch.testing.assert_close(w.grad.full_tensor(), reference_w.grad)


# --------------------------------------------------------------------------------- fused RMSNorm backward


def _meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype)


def _fused_rms_norm_backward_reference(
    grad: torch.Tensor, x: torch.Tensor, normalized: int, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the fused kernel computes, from autograd of the composite RMSNorm on the same rows."""
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    F.rms_norm(x, (normalized,), weight, 1e-5).backward(grad)
    assert x.grad is not None and weight.grad is not None
    return x.grad, weight.grad


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_fused_rms_norm_backward_rule_is_exact(mesh_shape: tuple[int, ...]) -> None:
    """Rows (dims before the normalised one) stay sharded, the weight gradient becomes Partial(sum).

    torch 2.13 has no CPU kernel for aten._fused_rms_norm_backward, so each rank's local call is
    simulated with the math it computes, and the pieces are reassembled by the decided output
    placements.
    """
    grad, x, weight = _randn(20, 5, 6, 8), _randn(21, 5, 6, 8), _randn(22, 8)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    expected_grad_input, expected_grad_weight = _fused_rms_norm_backward_reference(grad, x, 8, weight)
    rows: tuple[Placement, ...] = (Shard(0),) if len(mesh_shape) == 1 else (Shard(0), Shard(1))
    replicated: tuple[Placement, ...] = (Replicate(),) * len(mesh_shape)
    coordinates = [(c,) for c in range(4)] if len(mesh_shape) == 1 else [(i, j) for i in range(2) for j in range(2)]
    grad_input = torch.zeros_like(x)
    grad_weight = torch.zeros_like(weight)
    for coordinate in coordinates:
        mesh = FakeMesh(mesh_shape, coordinate)
        specs = [DTensorSpec(mesh, rows, _meta(t)) for t in (grad, x, rstd)]
        weight_spec = DTensorSpec(mesh, replicated, _meta(weight))
        decision = propagate_op_sharding(
            aten._fused_rms_norm_backward.default, (specs[0], specs[1], [8], specs[2], weight_spec, [True, True]), {}
        )
        assert decision.input_specs == (*specs, weight_spec) and not decision.needs_redistribute
        assert isinstance(decision.output_specs, tuple)
        input_spec, weight_grad_spec = decision.output_specs
        assert input_spec is not None and weight_grad_spec is not None
        assert input_spec.placements == rows
        assert weight_grad_spec.placements == (Partial(),) * len(mesh_shape)
        assert input_spec.tensor_meta == _meta(x) and weight_grad_spec.tensor_meta == _meta(weight)
        local_grad, local_x = (select_local_shard(t, mesh_shape, coordinate, rows) for t in (grad, x))
        local_grad_input, local_grad_weight = _fused_rms_norm_backward_reference(local_grad, local_x, 8, weight)
        shape, offset = input_spec.local_shape_and_offset()
        region = tuple(slice(start, start + size) for start, size in zip(offset, shape))
        grad_input[region] = local_grad_input
        grad_weight += local_grad_weight  # Partial(sum) on every mesh dim: the sum over all ranks
    torch.testing.assert_close(grad_input, expected_grad_input)
    torch.testing.assert_close(grad_weight, expected_grad_weight)


def test_fused_rms_norm_backward_gathers_sharded_rows_of_the_normalized_dim() -> None:
    grad, x, weight = _randn(23, 4, 8), _randn(24, 4, 8), _randn(25, 8)
    rstd = torch.ones(4, 1, dtype=torch.float64)
    mesh = FakeMesh((4,), (1,))
    specs = [DTensorSpec(mesh, (Shard(1),), _meta(t)) for t in (grad, x)]
    decision = propagate_op_sharding(
        aten._fused_rms_norm_backward.default,
        (specs[0], specs[1], [8], DTensorSpec(mesh, (Replicate(),), _meta(rstd)),
         DTensorSpec(mesh, (Replicate(),), _meta(weight)), [True, False]),
        {},
    )  # fmt: skip
    assert decision.needs_redistribute
    assert all(not p.is_shard(1) for spec in decision.input_specs for p in spec.placements)
    assert isinstance(decision.output_specs, tuple) and decision.output_specs[1] is None


# --------------------------------------------------------------------------------- errors


@multi_rank(world_size=4)
def test_bad_layer_norm_arguments_fail_before_any_collective() -> None:
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(_randn(30, 4, 6), mesh, [Shard(1)])
    weight = distribute_tensor(_randn(31, 5), mesh, [Replicate()])
    mode = CommDebugMode()
    with mode:
        with pytest.raises(RuntimeError, match="normalized_shape"):
            F.layer_norm(x, (5,))
        with pytest.raises(RuntimeError):
            F.layer_norm(x, (6,), weight)
    assert mode.get_total_counts() == 0
