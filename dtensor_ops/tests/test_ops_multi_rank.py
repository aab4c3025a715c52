"""Sharding rules through the real DTensor on 4 ranks: every family against plain torch, and nn.Linear.

Each op runs on DTensors built with ``DTensor.from_local`` from shards cut out of
the full inputs, for every combination of Replicate / Shard(i) / Partial(sum) of
its inputs on a 1-D mesh of 4 (on the 2x2 mesh an evenly spread subset; the
pure simulation in test_ops_simulated.py covers all of them), and
``full_tensor()`` must equal the op on the full tensors.  Many cases run per
multi-rank call, since starting the ranks dominates the cost.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, Partial, Placement, Replicate, Shard, init_device_mesh
from shardwise.dtensor_ops._sharding_prop import ShardingPropagationError
from shardwise.placement import select_local_shard
from shardwise.testing import multi_rank

LAYOUTS_PER_CASE_ON_2X2 = 10


def to_dtensor(full: torch.Tensor, mesh: Any, placements: Sequence[Placement], seed: int = 0) -> DTensor:
    """A DTensor holding ``full`` laid out as ``placements``; Partial parts are random but reduce to ``full``."""
    coordinate = tuple(mesh.get_coordinate())
    mesh_shape = tuple(mesh.shape)
    value = full
    generator = torch.Generator().manual_seed(seed)  # the same on every rank
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            parts = mesh_shape[mesh_dim]
            noise = torch.randn((parts, *full.shape), dtype=full.dtype, generator=generator)
            noise = noise - noise.mean(0)
            value = value / parts + noise[coordinate[mesh_dim]]
    local = select_local_shard(value, mesh_shape, coordinate, tuple(placements)).clone()
    return DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())


@dataclass(frozen=True)
class OpCase:
    name: str
    fn: Callable[..., Any]
    inputs: tuple[torch.Tensor, ...]
    compare_values: bool = True
    mutates_first: bool = False  # in-place on input 0: the result is input 0 itself
    partial_inputs: bool = True  # False where rounding in the reduction of random parts would change the answer


def _g(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _layouts(case: OpCase, mesh_shape: tuple[int, ...]) -> list[tuple[tuple[Placement, ...], ...]]:
    per_input = []
    for tensor in case.inputs:
        options: list[Placement] = [Replicate(), *(Shard(dim) for dim in range(tensor.dim()))]
        if tensor.is_floating_point() and case.partial_inputs:
            options.append(Partial())
        per_input.append(list(itertools.product(options, repeat=len(mesh_shape))))
    every = [tuple(layout) for layout in itertools.product(*per_input)]
    if len(mesh_shape) == 1 or len(every) <= LAYOUTS_PER_CASE_ON_2X2:
        return every
    limit = LAYOUTS_PER_CASE_ON_2X2
    return [every[round(index * (len(every) - 1) / (limit - 1))] for index in range(limit)]


def _check_tensor(result: Any, expected: torch.Tensor, compare_values: bool, where: str) -> None:
    assert isinstance(result, DTensor), where
    assert result.shape == expected.shape and result.dtype == expected.dtype, where
    assert result.to_local().shape == result._spec.local_shape(), where
    if compare_values:
        torch.testing.assert_close(result.full_tensor(), expected, msg=where)


def _check_case(case: OpCase, mesh: Any) -> int:
    expected = case.fn(*[tensor.clone() for tensor in case.inputs])
    checked = 0
    for layouts in _layouts(case, tuple(mesh.shape)):
        dtensors = [
            to_dtensor(tensor, mesh, layout, seed) for seed, (tensor, layout) in enumerate(zip(case.inputs, layouts))
        ]
        where = f"{case.name} with inputs {layouts} on mesh {tuple(mesh.shape)}"
        try:
            result = case.fn(*dtensors)
        except ShardingPropagationError:
            # Only a tensor written in place may be refused, and only when it is Partial.
            assert case.mutates_first and any(p.is_partial() for p in layouts[0]), where
            continue
        if case.mutates_first:
            assert result is dtensors[0], where
            assert result.placements == layouts[0], where
        if isinstance(expected, torch.Tensor):
            _check_tensor(result, expected, case.compare_values, where)
        elif isinstance(expected, (tuple, list)):
            assert isinstance(result, (tuple, list)) and len(result) == len(expected), where
            for index, (piece, expected_piece) in enumerate(zip(result, expected)):
                _check_tensor(piece, expected_piece, case.compare_values, f"{where}, output {index}")
        elif isinstance(expected, float):
            assert result == pytest.approx(expected, rel=1e-9, abs=1e-12), where
        else:
            assert result == expected, where
        checked += 1
    return checked


def _pointwise_cases() -> list[OpCase]:
    x, y, bias = _g(1, 5, 3), _g(2, 5, 3), _g(3, 3)
    positive = _g(4, 5, 3).abs() + 0.5
    mask = _g(5, 5, 3) > 0
    return [
        OpCase("neg", torch.neg, (x,)),
        OpCase("relu", torch.relu, (x,)),
        OpCase("exp", torch.exp, (x,)),
        OpCase("add", torch.add, (x, y)),
        OpCase("add_bias", torch.add, (x, bias)),
        OpCase("add_python_scalar", lambda a: a + 2.5, (x,)),
        OpCase("sub_alpha", lambda a, b: torch.sub(a, b, alpha=2), (x, y)),
        OpCase("mul", torch.mul, (x, y)),
        OpCase("mul_python_scalar", lambda a: a * 3, (x,)),
        OpCase("div", torch.div, (x, positive)),
        OpCase("maximum", torch.maximum, (x, y)),
        OpCase("gt", torch.gt, (x, y)),
        OpCase("where", torch.where, (mask, x, bias)),
        OpCase("add_", lambda a, b: a.add_(b), (x, y), mutates_first=True),
        OpCase("mul_scalar_", lambda a: a.mul_(2.0), (x,), mutates_first=True),
        OpCase("relu_", torch.relu_, (x,), mutates_first=True),
        OpCase("add_out", lambda a, b, out: torch.add(a, b, out=out), (x, y, torch.zeros(5, 3, dtype=torch.float64))),
    ]


def _matrix_cases() -> list[OpCase]:
    return [
        OpCase("mm", torch.mm, (_g(1, 5, 4), _g(2, 4, 3))),
        OpCase("mm_even", torch.mm, (_g(1, 8, 4), _g(2, 4, 8))),
        OpCase("addmm", torch.addmm, (_g(3, 3), _g(1, 5, 4), _g(2, 4, 3))),
        OpCase(
            "addmm_scaled",
            lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
            (_g(3, 5, 3), _g(1, 5, 4), _g(2, 4, 3)),
        ),
        OpCase("bmm", torch.bmm, (_g(1, 2, 5, 4), _g(2, 2, 4, 3))),
        OpCase("baddbmm", torch.baddbmm, (_g(3, 2, 5, 3), _g(1, 2, 5, 4), _g(2, 2, 4, 3))),
        OpCase("t", torch.t, (_g(1, 5, 3),)),
        OpCase("transpose", lambda a: a.transpose(0, 2), (_g(1, 2, 5, 3),)),
    ]


def _reduction_cases() -> list[OpCase]:
    x, even = _g(1, 5, 3), _g(2, 4, 8)
    return [
        OpCase("sum", torch.sum, (x,)),
        OpCase("sum_dim0", lambda a: a.sum(0), (x,)),
        OpCase("sum_dim1_keepdim", lambda a: a.sum(1, keepdim=True), (x,)),
        OpCase("sum_dims_3d", lambda a: a.sum((0, 2)), (_g(3, 2, 5, 3),)),
        OpCase("mean", torch.mean, (x,)),
        OpCase("mean_even", torch.mean, (even,)),
        OpCase("mean_dim0_uneven", lambda a: a.mean(0), (x,)),
        OpCase("mean_dim0_even", lambda a: a.mean(0), (even,)),
        OpCase("mean_dim1_keepdim", lambda a: a.mean(1, keepdim=True), (even,)),
    ]


def _basics_cases() -> list[OpCase]:
    x, y = _g(1, 5, 3), _g(2, 5, 3)
    return [
        OpCase("detach", torch.Tensor.detach, (x,)),
        OpCase("clone", torch.clone, (x,)),
        OpCase("to_float32", lambda a: a.to(torch.float32), (x,)),
        OpCase("to_int64", lambda a: (a * 4).to(torch.int64), (x,)),
        OpCase("copy_", lambda a, b: a.copy_(b), (x, y), mutates_first=True),
        OpCase("copy_broadcast", lambda a, b: a.copy_(b), (x, _g(3, 3)), mutates_first=True),
        OpCase("zeros_like", torch.zeros_like, (x,)),
        OpCase("ones_like", torch.ones_like, (x,)),
        OpCase("full_like", lambda a: torch.full_like(a, 7.0), (x,)),
        OpCase("empty_like", torch.empty_like, (x,), compare_values=False),
        OpCase("rand_like", torch.rand_like, (x,), compare_values=False),
        OpCase("new_zeros", lambda a: a.new_zeros((3, 2)), (x,)),
        OpCase("new_full", lambda a: a.new_full((2, 2), 1.5), (x,)),
        OpCase("fill_", lambda a: a.fill_(1.5), (x,), mutates_first=True),
        OpCase("zero_", torch.Tensor.zero_, (x,), mutates_first=True),
        OpCase("equal_false", torch.equal, (x, y), partial_inputs=False),
        OpCase("equal_true", torch.equal, (x, x.clone()), partial_inputs=False),
        OpCase("view_merge", lambda a: a.view(12, 2), (_g(1, 4, 3, 2),)),
        OpCase("view_merge_uneven", lambda a: a.view(6, 2), (_g(1, 2, 3, 2),)),
        OpCase("view_split", lambda a: a.view(2, 3, 2), (_g(1, 6, 2),)),
        OpCase("reshape_flatten", lambda a: a.reshape(-1), (x,)),
        OpCase("expand", lambda a: a.expand(5, 3), (_g(1, 1, 3),)),
        OpCase("expand_new_dim", lambda a: a.expand(4, 3), (_g(1, 3),)),
    ]


def _concat_split_cases() -> list[OpCase]:
    x, y = _g(1, 5, 3), _g(2, 5, 3)
    return [
        OpCase("cat", lambda a, b: torch.cat([a, b], dim=1), (x, y)),
        OpCase("cat_dim0", lambda a, b: torch.cat([a, b]), (x, _g(3, 2, 3))),
        OpCase("split", lambda a: torch.split(a, 2, dim=1), (_g(4, 5, 4),)),
        OpCase("split_sizes", lambda a: torch.split(a, [1, 4], dim=0), (_g(4, 5, 4),)),
        OpCase("unbind", torch.unbind, (_g(5, 3, 4),)),
        OpCase("max_dim", lambda a: torch.max(a, dim=1), (x,)),
        OpCase("min_dim_keepdim", lambda a: torch.min(a, dim=0, keepdim=True), (x,)),
        OpCase("item", lambda a: a.sum().item(), (x,), partial_inputs=False),
    ]


FAMILIES: dict[str, Callable[[], list[OpCase]]] = {
    "concat_split": _concat_split_cases,
    "pointwise": _pointwise_cases,
    "matrix": _matrix_cases,
    "reduction": _reduction_cases,
    "basics_and_views": _basics_cases,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@multi_rank(world_size=4)
def test_family_matches_torch_on_every_sharding(family: str) -> None:
    for mesh_shape in ((4,), (2, 2)):
        mesh = init_device_mesh("cpu", mesh_shape)
        for case in FAMILIES[family]():
            assert _check_case(case, mesh) > 0, case.name


# -- nn.Linear -------------------------------------------------------------------------------

# (name, weight placements, bias placements, input placements), one placement per mesh dim.
LinearPlan = tuple[str, tuple[Placement, ...], tuple[Placement, ...], tuple[Placement, ...]]
LINEAR_PLANS_1D: list[LinearPlan] = [
    ("colwise", (Shard(0),), (Shard(0),), (Replicate(),)),
    ("rowwise", (Shard(1),), (Replicate(),), (Shard(-1),)),
    ("replicated_weight_batch_sharded_input", (Replicate(),), (Replicate(),), (Shard(0),)),
    ("colwise_batch_sharded_input", (Shard(0),), (Shard(0),), (Shard(0),)),
    ("rowwise_replicated_input", (Shard(1),), (Replicate(),), (Replicate(),)),
    ("replicated", (Replicate(),), (Replicate(),), (Replicate(),)),
]
# Mesh dim 0 is data parallel (batch), mesh dim 1 tensor parallel.
LINEAR_PLANS_2D: list[LinearPlan] = [
    ("dp_colwise", (Replicate(), Shard(0)), (Replicate(), Shard(0)), (Shard(0), Replicate())),
    ("dp_rowwise", (Replicate(), Shard(1)), (Replicate(), Replicate()), (Shard(0), Shard(-1))),
    ("colwise_on_both", (Shard(0), Shard(0)), (Shard(0), Shard(0)), (Replicate(), Replicate())),
]


def _linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = x.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    bias = None if bias is None else bias.clone().requires_grad_()
    out = F.linear(x, weight, bias)
    out.sum().backward()
    assert x.grad is not None and weight.grad is not None
    return out.detach(), x.grad, weight.grad, None if bias is None else bias.grad


def _check_linear(mesh: Any, plan: LinearPlan, input_shape: tuple[int, ...], with_bias: bool, as_module: bool) -> None:
    name, weight_placements, bias_placements, input_placements = plan
    where = f"{name} input {input_shape} bias={with_bias} module={as_module} mesh={tuple(mesh.shape)}"
    in_features, out_features = input_shape[-1], 8
    x_full = _g(11, *input_shape)
    weight_full = _g(12, out_features, in_features)
    bias_full = _g(13, out_features) if with_bias else None
    ref_out, ref_x_grad, ref_weight_grad, ref_bias_grad = _linear_reference(x_full, weight_full, bias_full)

    x = to_dtensor(x_full, mesh, input_placements).requires_grad_()
    weight = to_dtensor(weight_full, mesh, weight_placements)
    bias = None if bias_full is None else to_dtensor(bias_full, mesh, bias_placements)
    if as_module:
        module = torch.nn.Linear(in_features, out_features, bias=with_bias, dtype=torch.float64)
        module.weight = torch.nn.Parameter(weight)
        if bias is not None:
            module.bias = torch.nn.Parameter(bias)
        out = module(x)
        weight_param: torch.Tensor = module.weight
        bias_param: torch.Tensor | None = module.bias
    else:
        weight_param = weight.requires_grad_()
        bias_param = None if bias is None else bias.requires_grad_()
        out = F.linear(x, weight_param, bias_param)
    loss = out.sum()
    loss.backward()

    assert isinstance(out, DTensor), where
    torch.testing.assert_close(out.full_tensor(), ref_out, msg=where)
    assert isinstance(x.grad, DTensor) and isinstance(weight_param.grad, DTensor), where
    torch.testing.assert_close(x.grad.full_tensor(), ref_x_grad, msg=where)
    torch.testing.assert_close(weight_param.grad.full_tensor(), ref_weight_grad, msg=where)
    if bias_param is not None:
        assert isinstance(bias_param.grad, DTensor), where
        torch.testing.assert_close(bias_param.grad.full_tensor(), ref_bias_grad, msg=where)


@pytest.mark.parametrize("as_module", [False, True], ids=["functional", "module"])
@multi_rank(world_size=4)
def test_linear_forward_and_backward_under_every_plan(as_module: bool) -> None:
    for mesh_shape, plans in (((4,), LINEAR_PLANS_1D), ((2, 2), LINEAR_PLANS_2D)):
        mesh = init_device_mesh("cpu", mesh_shape)
        # 2-D input, 3-D input (the view / _unsafe_view path), and uneven batch sizes.
        for input_shape in ((8, 6), (4, 3, 6), (5, 6), (3, 2, 6)):
            for with_bias in (True, False):
                for plan in plans:
                    _check_linear(mesh, plan, input_shape, with_bias, as_module)
