"""The ``_foreach_*`` ops on lists of DTensors against the same ops on plain tensors.

Ranks run as threads (``run_on_threads``): every case checks values (and, for the
out-of-place ops, gradients) after ``full_tensor()`` against plain torch on the full
tensors, on a 1-D mesh of 4 and on a 2x2 mesh, with lists mixing placements
(Shard on different dims, Replicate, Partial, uneven and empty shards), and counts
the collectives where the layout fixes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pytest
import torch

from shardwise.dtensor_ops import DTensor, Partial, Placement, Replicate, Shard, init_device_mesh
from shardwise.dtensor_ops._ops import rule_for
from shardwise.dtensor_ops import _rules
from shardwise.dtensor_ops._handlers import norms_across_shards
from shardwise.dtensor_ops._op_handlers import handlers_for
from shardwise.dtensor_ops._caches import clear_all_caches
from shardwise.dtensor_ops._sharding_prop import ShardingPropagationError
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.placement import select_local_shard
from shardwise.testing import run_on_threads

aten = torch.ops.aten
Layout = tuple[Placement, ...]
S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()

# Element shapes: even (8, 4), uneven on 4 ranks (5, 3) -> rows 2, 2, 1, 0, a 1-D (6,) -> 2, 2, 2, 0.
SHAPES = ((8, 4), (5, 3), (6,))


def full_tensors(seed: int, shapes: Sequence[tuple[int, ...]] = SHAPES, positive: bool = False) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)  # the same values on every rank thread
    tensors = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    return [tensor.abs() + 0.5 for tensor in tensors] if positive else tensors


def _matrix(seed: int, rows: int, columns: int) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def to_dtensor(full: torch.Tensor, mesh: Any, placements: Layout, seed: int = 7) -> DTensor:
    """``full`` laid out as ``placements``; Partial mesh dims hold random parts that reduce to it."""
    coordinate = tuple(mesh.get_coordinate())
    mesh_shape = tuple(mesh.shape)
    value = full
    generator = torch.Generator().manual_seed(seed)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            parts = mesh_shape[mesh_dim]
            noise = torch.randn((parts, *full.shape), dtype=full.dtype, generator=generator)
            value = value / parts + (noise - noise.mean(0))[coordinate[mesh_dim]]
    local = select_local_shard(value, mesh_shape, coordinate, placements).clone()
    return DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())


def to_dtensors(fulls: Sequence[torch.Tensor], mesh: Any, layouts: Sequence[Layout]) -> list[DTensor]:
    return [to_dtensor(full, mesh, layout, seed=index) for index, (full, layout) in enumerate(zip(fulls, layouts))]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    full = actual.full_tensor() if isinstance(actual, DTensor) else actual
    torch.testing.assert_close(full, expected, rtol=1e-6, atol=1e-8, msg=lambda m: f"{where}: {m}")


def total_collectives(mode: CommDebugMode) -> int:
    return int(mode.get_total_counts())


# ------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class ForeachCase:
    """``fn(lists, extra)`` runs one foreach op; ``lists`` are the tensor-list arguments (self first)."""

    name: str
    fn: Callable[[list[list[torch.Tensor]], list[torch.Tensor]], Any]
    lists: int  # number of tensor-list arguments
    inplace: bool
    positive: bool = False  # inputs must be > 0 (sqrt, log, pow, div)
    differentiable: bool = False  # out-of-place cases also compare gradients
    elementwise: bool = True  # False for reductions: an empty shard may force communication


def _extra_scalar(extra: list[torch.Tensor]) -> torch.Tensor:
    return extra[0]


CASES: tuple[ForeachCase, ...] = (
    # What SGD / Adam / AdamW emit (see the optimizer tests): add_, mul_, lerp_, addcmul_, addcdiv_, div_, ...
    ForeachCase("add_.List", lambda ls, e: torch._foreach_add_(ls[0], ls[1], alpha=0.5), 2, True),
    ForeachCase("add.List", lambda ls, e: torch._foreach_add(ls[0], ls[1], alpha=-2.0), 2, False, differentiable=True),
    ForeachCase("add_.Scalar", lambda ls, e: torch._foreach_add_(ls[0], 1e-3), 1, True),
    ForeachCase("add_.ScalarList", lambda ls, e: torch._foreach_add_(ls[0], [1.0, 2.0, 3.0]), 1, True),
    ForeachCase("add_.Tensor", lambda ls, e: aten._foreach_add_.Tensor(ls[0], _extra_scalar(e), alpha=2.0), 1, True),
    ForeachCase("sub_.List", lambda ls, e: torch._foreach_sub_(ls[0], ls[1], alpha=3.0), 2, True),
    ForeachCase("mul_.Scalar", lambda ls, e: torch._foreach_mul_(ls[0], 0.9), 1, True),
    ForeachCase("mul_.Tensor", lambda ls, e: aten._foreach_mul_.Tensor(ls[0], _extra_scalar(e)), 1, True),
    ForeachCase("mul_.List", lambda ls, e: torch._foreach_mul_(ls[0], ls[1]), 2, True),
    ForeachCase("mul.Scalar", lambda ls, e: torch._foreach_mul(ls[0], 3.0), 1, False, differentiable=True),
    ForeachCase("div_.ScalarList", lambda ls, e: torch._foreach_div_(ls[0], [2.0, 4.0, 8.0]), 1, True),
    ForeachCase("div_.List", lambda ls, e: torch._foreach_div_(ls[0], ls[1]), 2, True, positive=True),
    ForeachCase("lerp_.Scalar", lambda ls, e: torch._foreach_lerp_(ls[0], ls[1], 0.1), 2, True),
    ForeachCase("lerp.List", lambda ls, e: torch._foreach_lerp(ls[0], ls[1], ls[2]), 3, False, differentiable=True),
    ForeachCase("addcmul_.Scalar", lambda ls, e: torch._foreach_addcmul_(ls[0], ls[1], ls[2], 0.001), 3, True),
    ForeachCase(
        "addcmul.ScalarList", lambda ls, e: torch._foreach_addcmul(ls[0], ls[1], ls[2], [0.5, 1.5, -1.0]), 3, False,
        differentiable=True,
    ),
    ForeachCase(
        "addcdiv_.ScalarList", lambda ls, e: torch._foreach_addcdiv_(ls[0], ls[1], ls[2], [-0.1, -0.2, -0.3]), 3, True,
        positive=True,
    ),
    ForeachCase("addcdiv_.Scalar", lambda ls, e: torch._foreach_addcdiv_(ls[0], ls[1], ls[2], 2.0), 3, True, True),
    ForeachCase("sqrt", lambda ls, e: torch._foreach_sqrt(ls[0]), 1, False, positive=True, differentiable=True),
    ForeachCase("sqrt_", lambda ls, e: torch._foreach_sqrt_(ls[0]), 1, True, positive=True),
    ForeachCase("neg", lambda ls, e: torch._foreach_neg(ls[0]), 1, False, differentiable=True),
    ForeachCase("maximum_.List", lambda ls, e: torch._foreach_maximum_(ls[0], ls[1]), 2, True),
    ForeachCase("maximum.Scalar", lambda ls, e: torch._foreach_maximum(ls[0], 0.25), 1, False),
    ForeachCase("minimum_.List", lambda ls, e: torch._foreach_minimum_(ls[0], ls[1]), 2, True),
    ForeachCase("clamp_max_.Scalar", lambda ls, e: torch._foreach_clamp_max_(ls[0], 0.5), 1, True),
    ForeachCase("pow.Scalar", lambda ls, e: torch._foreach_pow(ls[0], 2.0), 1, False, differentiable=True),
    ForeachCase("pow.ScalarAndTensor", lambda ls, e: torch._foreach_pow(0.9, ls[0]), 1, False),
    ForeachCase("pow_.List", lambda ls, e: torch._foreach_pow_(ls[0], ls[1]), 2, True, positive=True),
    ForeachCase("reciprocal_", lambda ls, e: torch._foreach_reciprocal_(ls[0]), 1, True, positive=True),
    ForeachCase("copy_", lambda ls, e: torch._foreach_copy_(ls[0], ls[1]), 2, True),
    ForeachCase("zero_", lambda ls, e: torch._foreach_zero_(ls[0]), 1, True),
    ForeachCase("clone", lambda ls, e: torch._foreach_clone(ls[0]), 1, False),
    ForeachCase("exp", lambda ls, e: torch._foreach_exp(ls[0]), 1, False, differentiable=True),
    ForeachCase("sign_", lambda ls, e: torch._foreach_sign_(ls[0]), 1, True),
    ForeachCase("max", lambda ls, e: torch._foreach_max(ls[0]), 1, False, elementwise=False),
)

# Layouts per list argument (one placement tuple per element), first list = self.
LAYOUTS_1D: tuple[tuple[tuple[Layout, ...], ...], ...] = (
    ((R,), (R,), (R,)),  # replicated everything
    ((S0,), (S0,), (S0,)),  # sharded like self
    ((S0,), (R,), (S0,)),  # mixed across elements
    ((S1,), (S1,), (R,)),  # Shard(1), the 1-D element replicated
)
# How the other list arguments are laid out relative to self: the same, or deliberately different.
OTHER_LAYOUTS_1D: tuple[tuple[Layout, ...], ...] = (
    ((S1,), (R,), (R,)),
    ((R,), (S0,), (S0,)),
)
LAYOUTS_2X2: tuple[tuple[Layout, ...], ...] = (
    ((S0, S1), (R, S0), (S0, R)),
    ((R, R), (S0, S0), (R, S0)),
)


def _run_case(case: ForeachCase, mesh: Any, self_layouts: tuple[Layout, ...], other_layouts: tuple[Layout, ...]) -> int:
    """Run ``case`` on DTensors and on plain tensors; compare; return the number of collectives issued."""
    fulls = [full_tensors(10 * index + 1, positive=case.positive) for index in range(case.lists)]
    scalar = torch.tensor(0.75, dtype=torch.float64)
    plain_lists = [[tensor.clone() for tensor in tensors] for tensors in fulls]
    layouts = [self_layouts] + [other_layouts] * (case.lists - 1)
    dist_lists = [to_dtensors(tensors, mesh, list_layouts) for tensors, list_layouts in zip(fulls, layouts)]
    if case.differentiable:
        for tensors in (*plain_lists, *dist_lists):
            for tensor in tensors:
                tensor.requires_grad_(True)
    expected = case.fn(plain_lists, [scalar])
    with CommDebugMode() as mode:
        actual = case.fn(dist_lists, [scalar])
    collectives = total_collectives(mode)
    where = f"{case.name} on {tuple(mesh.shape)} with self {self_layouts}, others {other_layouts}"
    if case.inplace:
        # torch's Python binding hands back the list it wrote into.
        assert actual is None or all(result is written for result, written in zip(actual, dist_lists[0]))
        for index, (dist_tensor, plain) in enumerate(zip(dist_lists[0], plain_lists[0])):
            assert dist_tensor.placements == layouts[0][index], f"{where}: self[{index}] changed placements"
            assert_close(dist_tensor, plain, f"{where}, self[{index}]")
    else:
        assert len(actual) == len(expected)
        for index, (result, reference) in enumerate(zip(actual, expected)):
            assert isinstance(result, DTensor), f"{where}: output {index} is {type(result)}"
            assert_close(result, reference.detach(), f"{where}, output {index}")
    if case.differentiable:
        weights = full_tensors(99)
        sum(((out * w).sum() for out, w in zip(expected, weights)), torch.zeros((), dtype=torch.float64)).backward()
        dist_weights = to_dtensors(weights, mesh, [(R,) * mesh.ndim] * len(weights))
        total = sum((out * w).sum() for out, w in zip(actual, dist_weights))
        assert isinstance(total, DTensor)
        total.backward()
        for list_index, (dist_tensors, plain_tensors) in enumerate(zip(dist_lists, plain_lists)):
            for index, (dist_tensor, plain) in enumerate(zip(dist_tensors, plain_tensors)):
                assert dist_tensor.grad is not None and plain.grad is not None
                assert_close(dist_tensor.grad, plain.grad, f"{where}, grad of list {list_index}[{index}]")
    return collectives


def _check_all_cases_on(mesh_shape: tuple[int, ...]) -> None:
    mesh = init_device_mesh("cpu", mesh_shape)
    if len(mesh_shape) == 1:
        combos = [(layouts, other) for layouts in LAYOUTS_1D for other in (layouts, *OTHER_LAYOUTS_1D)]
    else:
        combos = [(layouts, other) for layouts in LAYOUTS_2X2 for other in LAYOUTS_2X2]
    for case in CASES:
        for self_layouts, other_layouts in combos:
            collectives = _run_case(case, mesh, self_layouts, other_layouts)
            if case.elementwise and (case.lists == 1 or other_layouts == self_layouts):
                # Every element already sits where its own op runs: nothing may move.
                assert collectives == 0, f"{case.name} {self_layouts}/{other_layouts}: {collectives} collectives"


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_foreach_ops_match_plain_torch_on_mixed_layouts(mesh_shape: tuple[int, ...]) -> None:
    run_on_threads(_check_all_cases_on, mesh_shape, world_size=4)


def test_every_foreach_overload_is_covered() -> None:
    """Each non-out= _foreach_* overload of torch 2.13 has a rule (or the norm handler) in shardwise."""
    packets = sorted(
        {name.split("::")[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names() if "::_foreach_" in name}
    )
    uncovered = []
    for packet_name in packets:
        packet = getattr(aten, packet_name, None)
        if packet is None:  # dispatcher-internal names (e.g. native kernels) are no aten ops
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if any(argument.is_out for argument in op._schema.arguments):
                continue
            if rule_for(op) is None and not handlers_for(op):
                uncovered.append(str(op))
    assert uncovered == []


# ------------------------------------------------------------------------- Partial, scalars, errors


def _check_partial_and_scalar_arguments() -> None:
    mesh = init_device_mesh("cpu", (4,))
    fulls = full_tensors(3)
    others = full_tensors(4)

    # Linear ops keep Partial(sum) elements partial, without communication.
    partial = to_dtensors(fulls, mesh, [(P,), (S0,), (P,)])
    partial_others = to_dtensors(others, mesh, [(P,), (S0,), (P,)])
    with CommDebugMode() as mode:
        torch._foreach_mul_(partial, 0.5)
        torch._foreach_add_(partial, partial_others, alpha=2.0)
    assert total_collectives(mode) == 0
    assert [tensor.placements for tensor in partial] == [(P,), (S0,), (P,)]
    for tensor, full, other in zip(partial, fulls, others):
        assert_close(tensor, full * 0.5 + 2.0 * other, "mul_/add_ on partials")

    # A Replicate grad added into Partial / Shard / Replicate params (grad accumulation style).
    params = to_dtensors(fulls, mesh, [(P,), (S0,), (R,)])
    grads = to_dtensors(others, mesh, [(R,), (R,), (S0,)])
    with CommDebugMode() as mode:
        torch._foreach_add_(params, grads)
    # R -> P and R -> S are local; S -> R (into the replicated param) is one all-gather.
    assert mode.get_comm_counts()[torch.ops.c10d_functional.all_gather_into_tensor] == 1
    assert total_collectives(mode) == 1
    for tensor, full, other in zip(params, fulls, others):
        assert_close(tensor, full + other, "add_ of differently placed grads")

    # Scalars as 0-dim CPU tensors (Adam's step, a tensor lr): plain and as replicated DTensors.
    step = torch.tensor(2.0, dtype=torch.float64)
    tensors = to_dtensors(fulls, mesh, [(S0,), (R,), (S0,)])
    with CommDebugMode() as mode:
        aten._foreach_add_.Tensor(tensors, step, alpha=0.5)
        aten._foreach_mul_.Tensor(tensors, step)
        coefficient = to_dtensor(torch.tensor(0.25, dtype=torch.float64), mesh, (R,))
        aten._foreach_mul_.Tensor(tensors, coefficient)
    assert total_collectives(mode) == 0
    for tensor, full in zip(tensors, fulls):
        assert_close(tensor, (full + 1.0) * 2.0 * 0.25, "0-dim scalar tensors")

    # _foreach_mm: each product decided as aten.mm (a row-sharded left factor keeps its rows sharded).
    lefts = [_matrix(20, 8, 6), _matrix(21, 5, 4)]
    rights = [_matrix(22, 6, 3), _matrix(23, 4, 7)]
    products = torch._foreach_mm(
        to_dtensors(lefts, mesh, [(S0,), (R,)]), to_dtensors(rights, mesh, [(R,), (S1,)])
    )
    assert [product.placements for product in products] == [(S0,), (S1,)]
    for product, left, right in zip(products, lefts, rights):
        assert_close(product, left @ right, "_foreach_mm")

    # Out of place, a Python number added to a Partial must reduce it first (once per rank would be wrong).
    partial = to_dtensors(fulls, mesh, [(P,), (P,), (S0,)])
    shifted = torch._foreach_add(partial, 1.0)
    for tensor, full in zip(shifted, fulls):
        assert not any(isinstance(p, Partial) for p in tensor.placements)
        assert_close(tensor, full + 1.0, "add.Scalar on partials")


def test_partial_elements_and_scalar_tensors() -> None:
    run_on_threads(_check_partial_and_scalar_arguments, world_size=4)


def _check_errors() -> None:
    mesh = init_device_mesh("cpu", (4,))
    fulls = full_tensors(5)

    # In place, a Partial self cannot absorb a Python number: refused, naming the foreach op, before any collective.
    partial = to_dtensors(fulls, mesh, [(S0,), (P,), (R,)])
    with CommDebugMode() as mode:
        with pytest.raises(ShardingPropagationError, match=r"_foreach_add_\.Scalar.*element 1"):
            torch._foreach_add_(partial, 1.0)
    assert total_collectives(mode) == 0

    # A shared tensor argument that two elements need in different placements.
    mixed = to_dtensors(fulls, mesh, [(P,), (R,), (R,)])
    shared = to_dtensor(torch.tensor(3.0, dtype=torch.float64), mesh, (R,))
    with CommDebugMode() as mode:
        with pytest.raises(ShardingPropagationError, match=r"shared tensor argument 'other'"):
            aten._foreach_add_.Tensor(mixed, shared)
    assert total_collectives(mode) == 0

    # Lists of different lengths.
    tensors = to_dtensors(fulls, mesh, [(S0,), (R,), (R,)])
    with pytest.raises((ValueError, RuntimeError), match="same length|same number"):
        torch._foreach_add_(tensors, tensors[:2])

    # Plain tensors mixed into the lists (not 0-dim): the dispatcher's error.
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        torch._foreach_add_(tensors, [fulls[0], fulls[1], fulls[2]])


def test_errors_before_any_collective() -> None:
    run_on_threads(_check_errors, world_size=4)


def _check_missing_element_rule() -> None:
    mesh = init_device_mesh("cpu", (4,))
    tensors = to_dtensors(full_tensors(6, positive=True), mesh, [(S0,), (R,), (S0,)])
    with pytest.raises(NotImplementedError, match=r"_foreach_lgamma\.default.*aten\.lgamma\.default.*Shard\(dim=0\)"):
        torch._foreach_lgamma(tensors)


def test_foreach_op_whose_element_op_has_no_rule_names_both() -> None:
    rules = _rules._RULES
    removed = rules.pop(aten.lgamma.default)
    clear_all_caches()
    try:
        run_on_threads(_check_missing_element_rule, world_size=4)
    finally:
        rules[aten.lgamma.default] = removed
        clear_all_caches()


# ------------------------------------------------------------------------------ _foreach_norm / powsum

NORM_ORDERS = (2.0, 1.0, 0.0, math.inf, -math.inf, 3.0, 0.5)


def _check_norms(mesh_shape: tuple[int, ...]) -> None:
    mesh = init_device_mesh("cpu", mesh_shape)
    shapes = ((8, 4), (5, 3), (3,), (6, 2))  # (3,) on 4 ranks leaves rank 3 an empty shard
    fulls = full_tensors(8, shapes)
    fulls[3][0, 0] = 0.0  # a zero for ord 0
    if len(mesh_shape) == 1:
        layouts: list[Layout] = [(S0,), (S1,), (S0,), (R,)]
        # S0 / S1 / S0 elements share mesh dim 0: one all_reduce for all three; R takes no part.
        expected_all_reduces = 1
    else:
        layouts = [(S0, S1), (R, S0), (S0, R), (R, R)]
        # Groups by sharded mesh dims: {0, 1}: two all_reduces (one per mesh dim), {1}: one, {0}: one.
        expected_all_reduces = 4
    tensors = to_dtensors(fulls, mesh, layouts)
    for order in NORM_ORDERS:
        with CommDebugMode() as mode:
            norms = torch._foreach_norm(tensors, order)
        counts = mode.get_comm_counts()
        assert counts[torch.ops.c10d_functional.all_reduce] == expected_all_reduces, (order, counts)
        assert total_collectives(mode) == expected_all_reduces
        for index, (norm, full) in enumerate(zip(norms, fulls)):
            assert isinstance(norm, DTensor) and norm.placements == (R,) * mesh.ndim
            assert_close(norm, torch.linalg.vector_norm(full, order), f"ord {order}, tensor {index} {layouts[index]}")

    # Partial elements are reduced first (one all_reduce each), then join the norm's group.
    partial_layouts: list[Layout] = [(P,) * mesh.ndim, layouts[0], layouts[1], layouts[3]]
    partial_fulls = [fulls[0], fulls[0], fulls[1], fulls[3]]
    partial = to_dtensors(partial_fulls, mesh, partial_layouts)
    norms = torch._foreach_norm(partial, 2.0, dtype=torch.float32)
    for index, (norm, full) in enumerate(zip(norms, partial_fulls)):
        assert norm.dtype == torch.float32
        torch.testing.assert_close(norm.full_tensor(), torch.linalg.vector_norm(full, 2.0).float(), msg=str(index))

    # Low precision in, low precision out, accumulated in float32 across ranks.
    half = to_dtensors([full.bfloat16() for full in fulls], mesh, layouts)
    for norm, full in zip(torch._foreach_norm(half, 2.0), fulls):
        assert norm.dtype == torch.bfloat16
        torch.testing.assert_close(norm.full_tensor().float(), torch.linalg.vector_norm(full.bfloat16().float()),
                                   rtol=1e-2, atol=1e-2)

    # powsum is linear in the shards: Partial(sum) out, no collective until someone reads it.
    with CommDebugMode() as mode:
        powsums = torch._foreach_powsum(tensors, 2.0)
    assert total_collectives(mode) == 0
    for powsum, layout, full in zip(powsums, layouts, fulls):
        assert powsum.placements == tuple(P if isinstance(p, Shard) else R for p in layout)
        assert_close(powsum, full.pow(2).sum(), f"powsum {layout}")

    # The gradient of a 2-norm flows back into the shards.
    leaves = to_dtensors(fulls[:2], mesh, layouts[:2])
    plain = [full.clone().requires_grad_(True) for full in fulls[:2]]
    for leaf in leaves:
        leaf.requires_grad_(True)
    sum(torch._foreach_norm(leaves, 2.0)).backward()
    sum(torch._foreach_norm(plain, 2.0)).backward()
    for leaf, reference in zip(leaves, plain):
        assert leaf.grad is not None and reference.grad is not None
        assert_close(leaf.grad, reference.grad, "grad of _foreach_norm")


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_foreach_norm_reduces_once_per_group_of_shardings(mesh_shape: tuple[int, ...]) -> None:
    run_on_threads(_check_norms, mesh_shape, world_size=4)


def _check_norm_errors() -> None:
    mesh = init_device_mesh("cpu", (4,))
    empty = to_dtensor(torch.empty(0, 3, dtype=torch.float64), mesh, (S1,))
    with CommDebugMode() as mode:
        with pytest.raises(RuntimeError, match="empty tensor"):
            torch._foreach_norm([empty], math.inf)
    assert total_collectives(mode) == 0
    # An empty global tensor is fine where the reduction has an identity.
    (norm,) = torch._foreach_norm([empty], 2.0)
    assert norm.full_tensor().item() == 0.0
    # Tensors on different meshes (as PyTorch's): each norm is taken over its own mesh.
    other_mesh = init_device_mesh("cpu", (2, 2))
    whole = full_tensors(1)[0]
    first = to_dtensor(whole, mesh, (S0,))
    second = to_dtensor(whole, other_mesh, (S0, R))
    with CommDebugMode() as mode:
        norms = torch._foreach_norm([first, second], 2.0)
    assert [norm.device_mesh for norm in norms] == [mesh, other_mesh]
    assert all(torch.allclose(norm.full_tensor(), torch.linalg.vector_norm(whole)) for norm in norms)
    assert total_collectives(mode) == 2  # one all-reduce over each mesh's sharded mesh dim
    # The single-mesh helper still refuses them, before any collective.
    with CommDebugMode() as mode:
        with pytest.raises(ValueError, match="same device mesh"):
            norms_across_shards([first, second], 2.0)
    assert total_collectives(mode) == 0


def test_foreach_norm_errors() -> None:
    run_on_threads(_check_norm_errors, world_size=4)
