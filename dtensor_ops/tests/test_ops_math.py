"""Math and reduction ops on DTensors against plain torch, forward and backward, on 4 gloo ranks.

Every case runs on DTensors built from the full inputs for every combination of
Replicate / Shard(d) / Partial placements of its inputs (on a 1-D mesh of 4 all of
them, Partial of several kinds; on a 2x2 mesh an evenly spread subset with
Partial(sum)), with shapes that shard unevenly (a dim of 5 or 3 over 4 ranks
leaves a rank with nothing).  The result's ``full_tensor()`` must equal the op on
the full tensors; then a random upstream gradient is pushed back and every input
gradient (``full_tensor()``) must equal plain autograd's.  Targeted tests check
the placements and the exact collectives where the behaviour is defined by them
(Partial(max) for amax over a sharded dim, no communication for softmax along an
unsharded dim, ...), errors, and DTensorConverter sweeps on even shapes.

The sweeps run in rank processes rather than threads: torch's threaded test process
group cannot reduce-scatter with max/min, which redistributing a Partial(max) to a
Shard needs (gloo can).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeGuard

import pytest
import torch
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops._sharding_prop import propagate_op_sharding
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.placement import DTensorSpec, TensorMeta, _NormPartial, select_local_shard
from shardwise.testing import DTensorConverter, DTensorTestBase, FakeMesh, multi_rank, run_on_threads, with_comms

aten = torch.ops.aten
c10d = torch.ops.c10d_functional

LAYOUTS_PER_CASE_ON_2X2 = 8


# --------------------------------------------------------------------------------- inputs


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(seed: int, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed), dtype=dtype)


def ints(seed: int, *shape: int) -> torch.Tensor:
    return torch.randint(-2, 3, shape, generator=_generator(seed))


def bools(seed: int, *shape: int, true_fraction: float = 0.5) -> torch.Tensor:
    return torch.rand(shape, generator=_generator(seed)) < true_fraction


def _partial_parts(value: torch.Tensor, kind: str, parts: int, generator: torch.Generator) -> torch.Tensor:
    """``parts`` tensors stacked on dim 0 whose ``kind`` reduction is exactly ``value``."""
    shape = (parts, *value.shape)
    if kind in ("sum", "avg"):
        noise = torch.randn(shape, generator=generator, dtype=value.dtype)
        noise = noise - noise.mean(0)
        return (value / parts if kind == "sum" else value) + noise
    holder = torch.randint(parts, tuple(value.shape), generator=generator)
    holds = torch.arange(parts).view(parts, *([1] * value.dim())) == holder
    if value.dtype == torch.bool:
        # The other ranks hold the identity: True for min (all), False for max (any).
        return torch.where(holds, value, torch.full(shape, kind == "min"))
    offsets = torch.rand(shape, generator=generator, dtype=value.dtype) + 0.5
    return torch.where(holds, value, value - offsets if kind == "max" else value + offsets)


def to_dtensor(full: torch.Tensor, mesh: Any, placements: Sequence[Placement], seed: int = 0) -> DTensor:
    """A DTensor holding ``full`` laid out as ``placements``; Partial parts are random but reduce to ``full``."""
    coordinate = tuple(mesh.get_coordinate())
    mesh_shape = tuple(mesh.shape)
    value = full
    generator = _generator(1000 + seed)  # the same draws on every rank
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            value = _partial_parts(value, placement.reduce_op, mesh_shape[mesh_dim], generator)[coordinate[mesh_dim]]
    local = select_local_shard(value, mesh_shape, coordinate, tuple(placements)).clone()
    return DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())


# --------------------------------------------------------------------------------- the sweep


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Any]
    inputs: tuple[torch.Tensor, ...]
    # Partial kinds tried (on a 1-D mesh) for floating inputs; bool inputs take the max/min ones.
    partial_kinds: tuple[str, ...] = ("sum",)
    backward: bool = True
    # False: layouts with a Partial(sum/avg) input are checked forward only, because the backward
    # (a) finds the maximum again by exact equality (amax, max, inf-norms): two reductions of the same
    #     Partial(sum) through different collectives (all-reduce vs reduce-scatter) round differently,
    #     so the mask can miss an element (test_reductions_of_one_partial_round_differently); or
    # (b) writes in place into a tensor that is then Partial (p-norms: masked_fill_ of the partial
    #     product), which DTensor refuses rather than reshard.
    backward_of_partial_inputs: bool = True


def _placement_options(tensor: torch.Tensor, kinds: Sequence[str]) -> list[Placement]:
    options: list[Placement] = [Replicate(), *(Shard(dim) for dim in range(tensor.dim()))]
    if tensor.is_floating_point():
        options.extend(Partial(kind) for kind in kinds)
    elif tensor.dtype == torch.bool:
        options.extend(Partial(kind) for kind in kinds if kind in ("max", "min"))
    return options


def _layouts(case: Case, mesh_shape: tuple[int, ...]) -> list[tuple[tuple[Placement, ...], ...]]:
    kinds = case.partial_kinds if len(mesh_shape) == 1 else tuple(k for k in case.partial_kinds if k == "sum")
    per_input = [
        list(itertools.product(_placement_options(tensor, kinds), repeat=len(mesh_shape))) for tensor in case.inputs
    ]
    every = [tuple(layout) for layout in itertools.product(*per_input)]
    if len(mesh_shape) == 1 or len(every) <= LAYOUTS_PER_CASE_ON_2X2:
        return every
    limit = LAYOUTS_PER_CASE_ON_2X2
    return [every[round(index * (len(every) - 1) / (limit - 1))] for index in range(limit)]


def _differentiable(value: object) -> TypeGuard[torch.Tensor]:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _dt(value: object) -> DTensor:
    """``value`` as a DTensor (fails the test if an op returned something else)."""
    assert isinstance(value, DTensor), f"expected a DTensor, got {type(value).__name__}"
    return value


def _flat_outputs(result: object) -> list[object]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _upstream(seed: int, like: torch.Tensor) -> torch.Tensor:
    return randn(seed, *like.shape, dtype=like.dtype)


def _total(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    assert terms, "nothing to differentiate"
    return functools.reduce(operator.add, terms)


def _reference(case: Case) -> tuple[list[object], list[torch.Tensor | None]]:
    inputs = [t.clone().requires_grad_(case.backward and t.is_floating_point()) for t in case.inputs]
    outputs = _flat_outputs(case.fn(*inputs))
    grads: list[torch.Tensor | None] = [None] * len(inputs)
    if case.backward:
        terms = [(out * _upstream(50 + i, out)).sum() for i, out in enumerate(outputs) if _differentiable(out)]
        assert terms and all(isinstance(t, torch.Tensor) and t.requires_grad for t in terms), case.name
        _total(terms).backward()
        grads = [t.grad if t.requires_grad else None for t in inputs]
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs], grads


Tolerances = tuple[float, float] | tuple[None, None]


def _tolerances(inputs: Sequence[torch.Tensor]) -> Tolerances:
    """(rtol, atol): float32 inputs split into Partial parts round each part, so compare at float32 precision."""
    if any(t.dtype == torch.float32 for t in inputs):
        return (1e-5, 1e-5)
    return (None, None)


def _check_value(actual: object, expected: object, where: str, tolerances: Tolerances = (None, None)) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, DTensor), f"{where}: got {type(actual).__name__}, expected a DTensor"
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
            f"{where}: {tuple(actual.shape)} {actual.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
        )
        assert actual.to_local().shape == actual._spec.local_shape(), where
        rtol, atol = tolerances
        torch.testing.assert_close(
            actual.full_tensor(), expected, equal_nan=True, rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}"
        )
    else:
        assert actual == expected, f"{where}: got {actual!r}, expected {expected!r}"


def _check_case(case: Case, mesh: Any) -> int:
    expected_outputs, expected_grads = _reference(case)
    checked = 0
    for layouts in _layouts(case, tuple(mesh.shape)):
        where = f"{case.name} with inputs {layouts} on mesh {tuple(mesh.shape)}"
        inputs: list[torch.Tensor] = [
            to_dtensor(t, mesh, layout, seed) for seed, (t, layout) in enumerate(zip(case.inputs, layouts))
        ]
        rounded_partial = any(
            isinstance(p, Partial) and p.reduce_op in ("sum", "avg") for layout in layouts for p in layout
        )
        backward = case.backward and (case.backward_of_partial_inputs or not rounded_partial)
        if backward:
            inputs = [d.requires_grad_() if d.is_floating_point() else d for d in inputs]
        outputs = _flat_outputs(case.fn(*inputs))
        assert len(outputs) == len(expected_outputs), where
        for index, (actual, expected) in enumerate(zip(outputs, expected_outputs)):
            _check_value(actual, expected, f"{where}, output {index}", _tolerances(case.inputs))
        if backward:
            terms = []
            for index, out in enumerate(outputs):
                if _differentiable(out):
                    assert isinstance(out, DTensor)
                    upstream = _upstream(50 + index, out)
                    replicated = DTensor.from_local(upstream, mesh, [Replicate()] * mesh.ndim)
                    terms.append((out * replicated).sum())
            _total(terms).backward()
            for index, (dtensor, expected_grad) in enumerate(zip(inputs, expected_grads)):
                if expected_grad is None:
                    continue
                grad = dtensor.grad
                assert isinstance(grad, DTensor), f"{where}: input {index} got no DTensor gradient"
                rtol, atol = _tolerances(case.inputs)
                torch.testing.assert_close(
                    grad.full_tensor(), expected_grad, rtol=rtol, atol=atol, msg=f"{where}, grad of input {index}"
                )
        checked += 1
    return checked


def _with_masked_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows 0 and 3 entirely -inf (masked out): _safe_softmax gives them zeros instead of nan."""
    x = x.clone()
    x[0] = -math.inf
    x[3] = -math.inf
    return x


def _softmax_cases() -> list[Case]:
    return [
        Case("softmax_last", lambda x: torch.softmax(x, -1), (randn(1, 5, 6),)),
        Case("softmax_first", lambda x: torch.softmax(x, 0), (randn(2, 5, 6),)),
        Case("log_softmax_3d_middle", lambda x: torch.log_softmax(x, 1), (randn(3, 3, 5, 4),)),
        Case("log_softmax_last", lambda x: F.log_softmax(x, dim=-1), (randn(4, 6, 5),)),
        Case("safe_softmax_masked_rows", lambda x: aten._safe_softmax(x, 1), (_with_masked_rows(randn(5, 5, 6)),)),
    ]


def _statistics_cases() -> list[Case]:
    x = randn(10, 5, 6)
    x3 = randn(11, 3, 5, 4)
    return [
        Case("var_dim", lambda t: torch.var(t, 1), (x,)),
        Case("var_dims_keepdim_correction0", lambda t: torch.var(t, [0, 2], correction=0, keepdim=True), (x3,)),
        Case("var_all", lambda t: torch.var(t), (x,)),
        Case("std_dim0_correction2", lambda t: torch.std(t, 0, correction=2), (x,)),
        Case("var_mean", lambda t: torch.var_mean(t, 1), (x,)),
        Case("std_mean_keepdim", lambda t: torch.std_mean(t, -1, keepdim=True), (x3,)),
        Case("logsumexp", lambda t: torch.logsumexp(t, 1), (x,)),
        Case("logsumexp_dims_keepdim", lambda t: torch.logsumexp(t, (0, 2), keepdim=True), (x3,)),
        Case("sum_dims_dtype", lambda t: torch.sum(t, (0, 2), dtype=torch.float64), (randn(12, 3, 5, 4, dtype=torch.float32),)),
        Case("mean_keepdim_dtype", lambda t: torch.mean(t, 1, keepdim=True, dtype=torch.float64), (randn(13, 4, 6, dtype=torch.float32),)),
        Case("mean_negative_dims", lambda t: t.mean((-1, -2)), (x3,)),
        # prod's backward builds a plain tensor (at::ones) next to DTensors: forward only.
        Case("prod_dim", lambda t: torch.prod(t, 1), (randn(14, 5, 3),), backward=False),
        Case("prod_all", lambda t: torch.prod(t), (randn(15, 3, 2),), backward=False),
    ]  # fmt: skip


def _extremum_cases() -> list[Case]:
    x = randn(20, 5, 6)
    x3 = randn(21, 4, 3, 6)
    return [  # fmt: skip
        Case("amax_dim0", lambda t: torch.amax(t, 0), (x,), partial_kinds=("sum", "max", "min"), backward_of_partial_inputs=False),
        Case("amax_dims_keepdim", lambda t: torch.amax(t, (0, 2), keepdim=True), (x3,), partial_kinds=("sum", "max"), backward_of_partial_inputs=False),
        Case("amin_dim1", lambda t: torch.amin(t, 1), (x,), partial_kinds=("sum", "min", "max"), backward_of_partial_inputs=False),
        Case("max_all", lambda t: torch.max(t), (x,), partial_kinds=("max", "sum"), backward_of_partial_inputs=False),
        Case("min_all_3d", lambda t: torch.min(t), (x3,), partial_kinds=("sum", "min"), backward_of_partial_inputs=False),
        Case("max_dim", lambda t: torch.max(t, 1), (x,)),
        Case("min_dim_keepdim", lambda t: torch.min(t, 0, keepdim=True), (x,)),
        Case("aminmax", lambda t: torch.aminmax(t, dim=0), (x,), backward=False),
        Case("aminmax_all", lambda t: torch.aminmax(t), (x3,), backward=False),
        Case("argmax_dim", lambda t: torch.argmax(t, 1), (x,), backward=False),
        Case("argmax_all", lambda t: torch.argmax(t), (x,), backward=False),
        Case("argmin_keepdim", lambda t: torch.argmin(t, 0, keepdim=True), (x3,), backward=False),
        Case("topk_dim1", lambda t: torch.topk(t, 2, dim=1), (x,)),
        Case("topk_smallest_dim0", lambda t: torch.topk(t, 3, dim=0, largest=False), (x3,)),
        Case("sort", lambda t: torch.sort(t, 1), (x,)),
        Case("sort_stable_descending", lambda t: torch.sort(t, dim=0, descending=True, stable=True), (x,)),
    ]


def _logical_cases() -> list[Case]:
    b = bools(30, 5, 6, true_fraction=0.9)
    with_zeros = torch.where(bools(31, 4, 6, true_fraction=0.2), 0.0, randn(32, 4, 6))
    return [
        Case("all", lambda t: torch.all(t), (b,), partial_kinds=("min", "max"), backward=False),
        Case("all_dim", lambda t: torch.all(t, 1), (b,), partial_kinds=("min", "max"), backward=False),
        Case("any_dims_keepdim", lambda t: torch.any(t, (0, 1), keepdim=True), (~b,), partial_kinds=("max", "min"), backward=False),
        Case("any_dim0", lambda t: torch.any(t, 0), (~b,), partial_kinds=("max",), backward=False),
        # Exact zeros: no Partial parts (their rounded sum need not be exactly 0).
        Case("all_of_floats", lambda t: torch.all(t, 0), (with_zeros,), partial_kinds=(), backward=False),
        Case("any_of_ints", lambda t: t.any(), (ints(33, 5, 3),), backward=False),
        Case("all_uint8", lambda t: torch.all(t, 1), (ints(34, 5, 3).abs().to(torch.uint8),), backward=False),
        Case("logical_and", torch.logical_and, (b, bools(35, 5, 6)), backward=False),
        Case("logical_or_xor_not", lambda a, c: torch.logical_not(torch.logical_xor(a, torch.logical_or(a, c))), (b, bools(36, 5, 6)), backward=False),
    ]  # fmt: skip


def _norm_cases() -> list[Case]:
    x = randn(40, 5, 6)
    cases = [
        Case(
            f"vector_norm_ord{order}_dim1",
            lambda t, o=order: torch.linalg.vector_norm(t, o, dim=1),
            (x,),
            backward_of_partial_inputs=False,
        )
        for order in (2, 1, 0, math.inf, -math.inf, 3)
    ]
    cases += [
        Case("vector_norm_all", lambda t: torch.linalg.vector_norm(t), (x,), backward_of_partial_inputs=False),
        Case("vector_norm_inf_all_keepdim", lambda t: torch.linalg.vector_norm(t, math.inf, keepdim=True), (x,), backward_of_partial_inputs=False),
        Case("vector_norm_ord1_dims_dtype", lambda t: torch.linalg.vector_norm(t, 1, (0, 2), dtype=torch.float64), (randn(41, 3, 5, 4, dtype=torch.float32),), backward_of_partial_inputs=False),
        Case("tensor_norm_dim_keepdim", lambda t: t.norm(dim=0, keepdim=True), (x,), backward_of_partial_inputs=False),
        Case("aten_norm_scalar_opt_dim", lambda t: aten.norm.ScalarOpt_dim(t, 1, [1]), (x,), backward_of_partial_inputs=False),
        Case("aten_norm_scalar", lambda t: aten.norm.Scalar(t, math.inf), (x,), backward_of_partial_inputs=False),
    ]  # fmt: skip
    return cases


def _cumulative_cases() -> list[Case]:
    x = randn(50, 5, 6)
    return [
        Case("cumsum_dim0", lambda t: torch.cumsum(t, 0), (x,), partial_kinds=("sum", "avg")),
        Case("cumsum_dim1_dtype", lambda t: torch.cumsum(t, 1, dtype=torch.float64), (randn(51, 5, 6, dtype=torch.float32),)),
        Case("cumsum_ints", lambda t: torch.cumsum(t, 0), (ints(52, 5, 3),), backward=False),
        # cumprod's backward builds a plain tensor (at::zeros) next to DTensors: forward only.
        Case("cumprod", lambda t: torch.cumprod(t, 1), (x,), backward=False),
        Case("flip_dim0", lambda t: torch.flip(t, [0]), (x,), partial_kinds=("sum", "max")),
        Case("flip_both", lambda t: torch.flip(t, [0, -1]), (randn(53, 3, 5, 4),)),
    ]  # fmt: skip


def _pointwise_cases() -> list[Case]:
    x = randn(60, 5, 6)
    special = randn(61, 5, 6)
    special[0, 1], special[2, 3], special[4, 0] = math.nan, math.inf, -math.inf
    return [
        Case("clamp_scalars", lambda t: torch.clamp(t, -0.5, 0.5), (x,)),
        Case("clamp_tensor_bounds", lambda t, lo, hi: torch.clamp(t, min=lo, max=hi), (x, randn(62, 6) - 1, randn(63, 5, 1) + 1)),
        Case("clamp_min_tensor", lambda t, lo: torch.clamp_min(t, lo), (x, randn(64, 5, 6))),
        Case("clamp_max_scalar", lambda t: torch.clamp_max(t, 0.3), (x,)),
        Case("eq_ne_ints", lambda a, b: (torch.eq(a, b), torch.ne(a, b)), (ints(65, 5, 6), ints(66, 5, 6)), backward=False),
        Case("lt_le_gt_ge", lambda a, b: (a < b, a <= b, a > b, a >= b), (x, randn(67, 6)), backward=False),
        Case("comparisons_with_scalars", lambda a: (a == 0, a != 1, a < 0.2, a <= 0.1, a > -0.3, a >= 0.4), (torch.where(bools(68, 5, 6), 0.0, x),), partial_kinds=(), backward=False),
        Case("isnan_isinf_isfinite", lambda t: (torch.isnan(t), torch.isinf(t), torch.isfinite(t)), (special,), partial_kinds=(), backward=False),
        Case("isclose", lambda a, b: torch.isclose(a, b, rtol=1e-3, atol=0.2), (x, x + 0.3 * randn(69, 5, 6)), backward=False),
        Case("allclose_false", lambda a, b: torch.allclose(a, b), (x, x + 0.3), backward=False),
        Case("allclose_true", lambda a, b: torch.allclose(a, b, atol=1e-3), (x, x + 1e-5), backward=False),
        Case("equal_true", lambda a, b: torch.equal(a, b), (ints(70, 5, 6), ints(70, 5, 6)), backward=False),
        Case("equal_false", lambda a, b: torch.equal(a, b), (ints(71, 5, 6), ints(72, 5, 6)), backward=False),
    ]  # fmt: skip


def _rms_norm_python(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """shardwise.testing.RMSNormPython's forward, written out."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _normalization_cases() -> list[Case]:
    x = randn(110, 5, 4, 6)
    return [
        Case("layer_norm_affine", lambda t, w, b: F.layer_norm(t, (6,), w, b), (x, randn(111, 6), randn(112, 6))),
        Case("layer_norm_two_dims", lambda t, w, b: F.layer_norm(t, (4, 6), w, b, eps=1e-3), (x, randn(113, 4, 6), randn(114, 4, 6))),
        Case("layer_norm_plain", lambda t: F.layer_norm(t, (4,)), (randn(115, 3, 5, 4),)),
        Case("layer_norm_weight_only", lambda t, w: F.layer_norm(t, (6,), w), (x, randn(116, 6))),
        Case("rms_norm_python", _rms_norm_python, (x, randn(117, 6))),
        # On CPU F.rms_norm decomposes into pow, mean, add_(eps) in place, rsqrt, mul.
        Case("f_rms_norm", lambda t, w: F.rms_norm(t, (6,), w), (x, randn(118, 6))),
        Case("f_rms_norm_two_dims", lambda t: F.rms_norm(t, (4, 6), eps=1e-4), (x,)),
    ]  # fmt: skip


FAMILIES: dict[str, Callable[[], list[Case]]] = {
    "softmax": _softmax_cases,
    "statistics": _statistics_cases,
    "extremum": _extremum_cases,
    "logical": _logical_cases,
    "norm": _norm_cases,
    "normalization": _normalization_cases,
    "cumulative": _cumulative_cases,
    "pointwise": _pointwise_cases,
}


def _run_family(family: str) -> int:
    checked = 0
    for mesh_shape in ((4,), (2, 2)):
        mesh = init_device_mesh("cpu", mesh_shape)
        for case in FAMILIES[family]():
            count = _check_case(case, mesh)
            assert count > 0, case.name
            checked += count
    return checked


@pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0")  # var of a rank's empty shard
@pytest.mark.parametrize("family", sorted(FAMILIES))
@multi_rank(world_size=4)
def test_family_matches_torch_forward_and_backward_on_every_sharding(family: str) -> None:
    assert _run_family(family) > 0


# --------------------------------------------------------------------------------- placements and collectives


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: count for op, count in mode.get_comm_counts().items() if count}


def _amax_placements_and_collectives() -> None:
    mesh = init_device_mesh("cpu", (4,))
    x = randn(80, 8, 6)
    mode = CommDebugMode()
    d = to_dtensor(x, mesh, [Shard(0)])
    with mode:
        out = _dt(torch.amax(d, 0))
    assert out.placements == (Partial("max"),) and mode.get_total_counts() == 0
    with mode:
        assert torch.equal(out.full_tensor(), torch.amax(x, 0))
    assert _counts(mode) == {"all_reduce": 1}
    # A Partial(max) input stays partial through amax and max.
    partial = to_dtensor(x, mesh, [Partial("max")])
    with mode:
        assert _dt(torch.amax(partial, 1)).placements == (Partial("max"),)
        assert _dt(torch.max(partial)).placements == (Partial("max"),)
        # The min of per-rank maxima is not the min: the pending max is reduce-scattered first.
        assert _dt(torch.amin(partial, 1)).placements == (Shard(0),)
    assert _counts(mode) == {"reduce_scatter_tensor": 1}
    # Three rows over four ranks leave one rank nothing to take the max of: not Partial then.
    short = to_dtensor(randn(81, 3, 6), mesh, [Shard(0)])
    out = _dt(torch.amax(short, 0))
    assert not out.placements[0].is_partial()
    assert torch.equal(out.full_tensor(), torch.amax(randn(81, 3, 6), 0))
    # aminmax: both partial kinds at once.
    low, high = torch.aminmax(d, dim=0)
    assert (_dt(low).placements, _dt(high).placements) == ((Partial("min"),), (Partial("max"),))


def _all_any_agree_on_every_rank() -> bool:
    mesh = init_device_mesh("cpu", (4,))
    b = bools(82, 7, 3, true_fraction=0.97)
    d = distribute_tensor(b, mesh, [Shard(0)])
    mode = CommDebugMode()
    with mode:
        everything = torch.all(d)
        anything = torch.any(~d)
    assert mode.get_total_counts() == 0
    assert (_dt(everything).placements, _dt(anything).placements) == ((Partial("min"),), (Partial("max"),))
    with mode:
        answer = bool(everything.item())
        assert bool(anything.item()) == (not answer)
    assert _counts(mode) == {"all_reduce": 2}
    assert answer == bool(b.all())
    return answer


def _softmax_collectives() -> None:
    mesh = init_device_mesh("cpu", (4,))
    x = randn(83, 8, 12)
    upstream = randn(84, 8, 12)
    mode = CommDebugMode()
    # Along an unsharded dim: no communication, forward or backward.
    d = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    grad = distribute_tensor(upstream, mesh, [Shard(0)])
    with mode:
        out = _dt(torch.softmax(d, -1))
        out.backward(grad)
    assert mode.get_total_counts() == 0 and out.placements == (Shard(0),)
    reference = x.clone().requires_grad_()
    torch.softmax(reference, -1).backward(upstream)
    assert reference.grad is not None and isinstance(d.grad, DTensor)
    torch.testing.assert_close(d.grad.full_tensor(), reference.grad)
    # Along the sharded dim: one all-to-all moves the shards to the other dim (cheaper than an all-gather).
    d = distribute_tensor(x, mesh, [Shard(1)])
    with mode:
        out = _dt(torch.log_softmax(d, 1))
    assert _counts(mode) == {"all_to_all_single": 1} and out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), torch.log_softmax(x, 1))
    # The backward is linear in the incoming gradient: a Partial(sum) gradient stays partial.
    output = distribute_tensor(torch.softmax(x, 1), mesh, [Replicate()])
    partial_grad = to_dtensor(upstream, mesh, [Partial()])
    with mode:
        grad_input = _dt(aten._softmax_backward_data(partial_grad, output, 1, torch.float64))
    assert mode.get_total_counts() == 0 and grad_input.placements == (Partial(),)
    expected = aten._softmax_backward_data(upstream, torch.softmax(x, 1), 1, torch.float64)
    torch.testing.assert_close(grad_input.full_tensor(), expected)


def _reductions_keep_or_gather() -> None:
    mesh = init_device_mesh("cpu", (4,))
    x = randn(85, 8, 12)
    mode = CommDebugMode()
    row_sharded = distribute_tensor(x, mesh, [Shard(0)])
    column_sharded = distribute_tensor(x, mesh, [Shard(1)])
    with mode:
        assert _dt(torch.var(row_sharded, 1)).placements == (Shard(0),)
        assert _dt(torch.linalg.vector_norm(row_sharded, 1, dim=0)).placements == (Partial(),)
        assert _dt(torch.linalg.vector_norm(row_sharded, math.inf, dim=0)).placements == (Partial("max"),)
        assert _dt(torch.cumsum(row_sharded, 1)).placements == (Shard(0),)
        assert _dt(torch.argmax(row_sharded, 1)).placements == (Shard(0),)
        assert _dt(torch.topk(row_sharded, 3, 1)[1]).placements == (Shard(0),)
    assert mode.get_total_counts() == 0
    # Not linear: variance, argmax and cumsum along a sharded dim move the data first.
    for op in (
        lambda t: torch.var(t, 1),
        lambda t: torch.argmax(t, 1),
        lambda t: torch.cumsum(t, 1),
    ):
        with mode:
            out = _dt(op(column_sharded))
        assert mode.get_total_counts() == 1, _counts(mode)
        torch.testing.assert_close(out.full_tensor(), op(x))
    # A Partial(sum) input keeps its pending sum through cumsum (linear), not through var.
    partial = to_dtensor(x, mesh, [Partial()])
    with mode:
        assert _dt(torch.cumsum(partial, 0)).placements == (Partial(),)
    assert mode.get_total_counts() == 0
    with mode:
        torch.var(partial, 0)
    assert mode.get_total_counts() == 1


def _norms_of_pieces_combine_without_moving_the_pieces() -> None:
    mesh = init_device_mesh("cpu", (4,))
    x = randn(85, 8, 12)
    column_sharded = distribute_tensor(x, mesh, [Shard(1)])
    mode = CommDebugMode()
    for order in (2, 3.5):
        with mode:
            norms = _dt(torch.linalg.vector_norm(column_sharded, order, dim=1))
        # Each rank holds the norm of its columns; the pending reduction is their p-norm.
        assert norms.placements == (_NormPartial(order),) and mode.get_total_counts() == 0
        with mode:
            whole = norms.full_tensor()
        assert _counts(mode) == {"all_reduce": 1}  # of the 8 norms, not of the (8, 12) input
        torch.testing.assert_close(whole, torch.linalg.vector_norm(x, order, dim=1))
        torch.testing.assert_close(
            norms.redistribute(mesh, [Shard(0)]).full_tensor(), torch.linalg.vector_norm(x, order, dim=1)
        )
        # An op that does not carry the pending norm reduces it first.
        torch.testing.assert_close(norms.unsqueeze(0).full_tensor(), torch.linalg.vector_norm(x, order, dim=1)[None])
    # Over a 2-D mesh and every dim; dist of two tensors laid out alike (p = 2, 1, inf).
    grid = init_device_mesh("cpu", (2, 2))
    y = randn(86, 8, 12)
    a, b = distribute_tensor(x, grid, [Shard(0), Shard(1)]), distribute_tensor(y, grid, [Shard(0), Shard(1)])
    total = _dt(torch.linalg.vector_norm(a))
    assert total.placements == (_NormPartial(2), _NormPartial(2))
    torch.testing.assert_close(total.full_tensor(), torch.linalg.vector_norm(x))
    for order in (2, 1, math.inf):
        with mode:
            distance = _dt(torch.dist(a, b, order))
        assert mode.get_total_counts() == 0 and all(p.is_partial() for p in distance.placements)
        torch.testing.assert_close(distance.full_tensor(), torch.dist(x, y, order))


@multi_rank(world_size=4)
def test_placements_and_collectives() -> None:
    _amax_placements_and_collectives()
    _softmax_collectives()
    _reductions_keep_or_gather()
    _norms_of_pieces_combine_without_moving_the_pieces()


@multi_rank(world_size=4)
def test_reductions_of_one_partial_round_differently() -> None:
    """Why backward checks of max-like ops skip Partial(sum) inputs: a sum reduced along two paths
    (all-reduce, reduce-scatter then all-gather) is equal only to rounding (on gloo 7 of these 30 elements
    differ in the last bits), while a max is the same on every path."""
    mesh = init_device_mesh("cpu", (4,))
    x = randn(88, 5, 6)
    partial = to_dtensor(x, mesh, [Partial()])
    torch.testing.assert_close(
        partial.redistribute(mesh, [Replicate()]).to_local(), partial.redistribute(mesh, [Shard(1)]).full_tensor()
    )
    partial_max = to_dtensor(x, mesh, [Partial("max")])
    assert torch.equal(
        partial_max.redistribute(mesh, [Replicate()]).to_local(),
        partial_max.redistribute(mesh, [Shard(1)]).full_tensor(),
    )


def test_all_and_any_give_every_rank_the_same_answer() -> None:
    answers = run_on_threads(_all_any_agree_on_every_rank, world_size=4)
    assert len(set(answers)) == 1


# --------------------------------------------------------------------------------- errors


def _bad_arguments_fail_before_any_collective() -> None:
    mesh = init_device_mesh("cpu", (4,))
    d = distribute_tensor(randn(86, 8, 6), mesh, [Shard(1)])
    other = distribute_tensor(randn(87, 8, 5), mesh, [Shard(0)])
    mode = CommDebugMode()
    with mode:
        with pytest.raises(IndexError):
            torch.softmax(d, 2)
        with pytest.raises(IndexError):
            torch.amax(d, 3)
        with pytest.raises(RuntimeError):
            torch.topk(d, 7, dim=1)
        with pytest.raises(RuntimeError):
            torch.var(d.to(torch.int64), 0)
        with pytest.raises(RuntimeError, match=r"shapes \[8, 6\] and \[8, 5\] do not broadcast"):
            torch.allclose(d, other)
        with pytest.raises(RuntimeError, match="dtypes torch.float64 and torch.float32"):
            torch.allclose(d, d.float())
        with pytest.raises(RuntimeError):
            aten._softmax_backward_data(d, other, 1, torch.float64)
    assert mode.get_total_counts() == 0
    # An op without a rule (poisson: a random op with no per-shard stream yet) names itself and the placements,
    # before any collective.
    with mode:
        with pytest.raises(NotImplementedError, match=r"aten\.poisson\.default .*Shard\(dim=1\)"):
            torch.poisson(d.abs())
    assert mode.get_total_counts() == 0


def test_bad_arguments_fail_before_any_collective() -> None:
    run_on_threads(_bad_arguments_fail_before_any_collective, world_size=4)


def test_decisions_are_cached_plain_data() -> None:
    spec = DTensorSpec(FakeMesh((4,)), (Shard(0),), TensorMeta(torch.Size([8, 6]), (6, 1), torch.float32))
    first = propagate_op_sharding(aten.amax.default, (spec, [0]), {})
    again = propagate_op_sharding(aten.amax.default, (spec, [0]), {})
    assert first is again
    assert first.output_specs is not None and not isinstance(first.output_specs, tuple)
    assert first.output_specs.placements == (Partial("max"),)
    assert first.output_specs.tensor_meta == TensorMeta(torch.Size([6]), (1,), torch.float32)
    norm = propagate_op_sharding(aten.native_layer_norm.default, (spec, [6], None, None, 1e-5), {})
    assert isinstance(norm.output_specs, tuple)
    assert [s.placements if s is not None else None for s in norm.output_specs] == [(Shard(0),)] * 3


# --------------------------------------------------------------------------------- DTensorConverter


class TestWithConverter(DTensorTestBase):
    """Every even sharding DTensorConverter yields, forward and backward against plain torch."""

    def _check_converter(self, fn: Callable[..., Any], *args: torch.Tensor) -> int:
        mesh = self.build_device_mesh()
        leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
        expected = _flat_outputs(fn(*leaves))
        terms = [(o * _upstream(90 + i, o)).sum() for i, o in enumerate(expected) if _differentiable(o)]
        if terms:
            _total(terms).backward()
        converter = DTensorConverter(mesh, tuple(a.detach().clone() for a in args), {})
        checked = 0
        for dist_args, _ in converter:
            assert converter.successful()
            dist_args = tuple(a.requires_grad_() if a.is_floating_point() else a for a in dist_args)
            outputs = _flat_outputs(fn(*dist_args))
            where = f"{[a.placements for a in dist_args]}"
            for actual, want in zip(outputs, expected):
                _check_value(actual, want.detach() if isinstance(want, torch.Tensor) else want, where)
            dist_terms = []
            for i, o in enumerate(outputs):
                if _differentiable(o):
                    upstream = DTensor.from_local(_upstream(90 + i, o), mesh, [Replicate()])
                    dist_terms.append((o * upstream).sum())
            if dist_terms:
                _total(dist_terms).backward()
            for leaf, dist_arg in zip(leaves, dist_args):
                if leaf.grad is not None:
                    assert isinstance(dist_arg.grad, DTensor), where
                    torch.testing.assert_close(dist_arg.grad.full_tensor(), leaf.grad, msg=lambda m: f"{where}: {m}")
            checked += 1
        return checked

    @with_comms
    def test_softmax_family(self) -> None:
        x = randn(100, 8, 4)
        assert self._check_converter(lambda t: torch.softmax(t, 1), x) == 3
        assert self._check_converter(lambda t: torch.log_softmax(t, 0), x) == 3

    @with_comms
    def test_statistics_and_norms(self) -> None:
        x = randn(101, 4, 8)
        self._check_converter(lambda t: torch.var_mean(t, 0, correction=0), x)
        self._check_converter(lambda t: torch.std(t, 1, keepdim=True), x)
        self._check_converter(lambda t: torch.linalg.vector_norm(t, 2, dim=1), x)
        self._check_converter(lambda t: torch.linalg.vector_norm(t, math.inf), x)
        self._check_converter(lambda t: torch.logsumexp(t, 1), x)

    @with_comms
    def test_extremes_and_order(self) -> None:
        x = randn(102, 4, 8)
        self._check_converter(lambda t: torch.amax(t, 1), x)
        self._check_converter(lambda t: torch.max(t, 0), x)
        self._check_converter(lambda t: torch.topk(t, 2, 1), x)
        self._check_converter(lambda t: torch.sort(t, 0), x)
        self._check_converter(lambda t: torch.cumsum(t, 1), x)
        self._check_converter(lambda t: torch.argmin(t, 0), x)

    @with_comms
    def test_clamp_and_comparisons(self) -> None:
        x, y = randn(103, 4, 8), randn(104, 4, 8)
        self._check_converter(lambda a, lo: torch.clamp(a, min=lo), x, y)
        self._check_converter(lambda a, b: (a < b, torch.eq(a, b), torch.isclose(a, b)), x, y)
        self._check_converter(lambda a, b: torch.allclose(a, b), x, x.clone())
