"""Sharding propagation mechanics, without processes (a fake mesh object stands in for DeviceMesh).

Strategy enumeration per mesh dim, the n-D product, the cost choice, caching,
Partial linearity, in-place / out= handling, local argument overrides and the
errors.  Op-by-op correctness of the values is in test_ops_simulated.py.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import pytest
import torch

from shardwise.dtensor_ops._ops import OneDimStrategy, OpCall, rule_for
from shardwise.dtensor_ops._caches import clear_all_caches
from shardwise.dtensor_ops._decision_pipeline import KWARGS_MARK
from shardwise.dtensor_ops._decision import OpDecision
from shardwise.dtensor_ops._decision_pipeline import decide_from_specs as decide_op_sharding
from shardwise.dtensor_ops._decision_pipeline import propagate_op_sharding
from shardwise.dtensor_ops._propagation import ShardingPropagationError
from shardwise.dtensor_ops._sharding_prop import sharding_cache_key, sharding_cache_size
from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta
from shardwise.testing import FakeMesh

aten = torch.ops.aten
R = Replicate()
P = Partial()
P_AVG = Partial("avg")
P_MAX = Partial("max")


MESH_4 = FakeMesh((4,), (0,))
MESH_2X2 = FakeMesh((2, 2), (0, 0))


def spec(
    mesh: FakeMesh, placements: Sequence[Placement], *shape: int, dtype: torch.dtype = torch.float32
) -> DTensorSpec[Any]:
    return DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), torch.empty(shape).stride(), dtype))


def placements_in(decision: OpDecision) -> list[tuple[Placement, ...]]:
    return [target.placements for target in decision.input_specs]


def placements_out(decision: OpDecision) -> tuple[Placement, ...]:
    assert isinstance(decision.output_specs, DTensorSpec)
    return decision.output_specs.placements


@pytest.fixture(autouse=True)
def fresh_cache() -> None:
    clear_all_caches()


# -- one mesh dim: strategy enumeration ---------------------------------------------------------


def _one_dim(
    op: torch._ops.OpOverload, args: tuple[Any, ...], partials: frozenset[str] = frozenset()
) -> set[OneDimStrategy]:
    rule = rule_for(op)
    assert rule is not None
    specs = tuple(arg for arg in args if isinstance(arg, DTensorSpec))
    positions = tuple(index for index, arg in enumerate(args) if isinstance(arg, DTensorSpec))
    decision = decide_op_sharding(op, args, {})
    assert isinstance(decision.output_specs, DTensorSpec)
    call = OpCall(op, args, {}, specs, positions, (decision.output_specs.tensor_meta,), partials)
    return set(rule.one_dim_strategies(call))


def test_mm_states_the_textbook_strategies_for_one_mesh_dim() -> None:
    a, b = spec(MESH_4, [R], 8, 6), spec(MESH_4, [R], 6, 4)
    assert _one_dim(aten.mm.default, (a, b), frozenset({"sum"})) == {
        OneDimStrategy((Shard(0),), (Shard(0), R)),  # rows of a
        OneDimStrategy((Shard(1),), (R, Shard(1))),  # columns of b
        OneDimStrategy((P,), (Shard(1), Shard(0))),  # contraction dim: partial sums
        OneDimStrategy((R,), (R, R)),
        OneDimStrategy((P,), (P, R)),  # linear in a
        OneDimStrategy((P,), (R, P)),  # linear in b
    }


def test_pointwise_broadcast_inputs_stay_replicated_along_the_broadcast_dim() -> None:
    x, bias = spec(MESH_4, [R], 8, 6), spec(MESH_4, [R], 6)
    strategies = _one_dim(aten.add.Tensor, (x, bias))
    assert OneDimStrategy((Shard(0),), (Shard(0), R)) in strategies
    assert OneDimStrategy((Shard(1),), (Shard(1), Shard(0))) in strategies
    # Carrying a partial through is offered only for kinds some input holds on that mesh dim.
    assert OneDimStrategy((P,), (P, P)) not in strategies
    assert OneDimStrategy((P,), (P, P)) in _one_dim(aten.add.Tensor, (x, bias), frozenset({"sum"}))
    assert OneDimStrategy((P_AVG,), (P_AVG, P_AVG)) in _one_dim(aten.add.Tensor, (x, bias), frozenset({"avg"}))


def test_reduction_turns_a_sharded_reduced_dim_into_partial_and_shifts_kept_dims() -> None:
    x = spec(MESH_4, [R], 2, 8, 6)
    strategies = _one_dim(aten.sum.dim_IntList, (x, [1]))
    assert OneDimStrategy((Shard(0),), (Shard(0),)) in strategies
    assert OneDimStrategy((P,), (Shard(1),)) in strategies
    assert OneDimStrategy((Shard(1),), (Shard(2),)) in strategies
    mean_strategies = _one_dim(aten.mean.dim, (x, [1]))
    assert OneDimStrategy((P_AVG,), (Shard(1),)) in mean_strategies


# -- n-D meshes: the product of the one-dim strategies --------------------------------------------


def test_every_product_of_mm_strategies_runs_without_redistribution_on_a_2d_mesh() -> None:
    a_meta, b_meta = (8, 6), (6, 4)
    per_mesh_dim = [
        ((Shard(0),), (Shard(0), R)),
        ((Shard(1),), (R, Shard(1))),
        ((P,), (Shard(1), Shard(0))),
        ((R,), (R, R)),
        ((P,), (P, R)),
        ((P,), (R, P)),
    ]
    for first, second in itertools.product(per_mesh_dim, repeat=2):
        a = spec(MESH_2X2, [first[1][0], second[1][0]], *a_meta)
        b = spec(MESH_2X2, [first[1][1], second[1][1]], *b_meta)
        decision = propagate_op_sharding(aten.mm.default, (a, b), {})
        assert not decision.needs_redistribute, (first, second)
        assert decision.input_specs == (a, b)
        assert placements_out(decision) == (first[0][0], second[0][0])


def test_nested_sharding_of_one_dim_by_both_mesh_dims_is_kept() -> None:
    x = spec(MESH_2X2, [Shard(0), Shard(0)], 7, 3)
    y = spec(MESH_2X2, [Shard(0), Shard(0)], 7, 3)
    decision = propagate_op_sharding(aten.mul.Tensor, (x, y), {})
    assert not decision.needs_redistribute
    assert placements_out(decision) == (Shard(0), Shard(0))


def test_view_keeps_a_shard_only_where_every_rank_holds_the_same_block() -> None:
    # [8, 3] -> [2, 4, 3] on a 1-D mesh of 4: rank r holds rows 2r..2r+1, i.e. half of new row r // 2,
    # which no single placement of the new shape describes: the input must move.
    x = spec(MESH_4, [Shard(0)], 8, 3)
    assert propagate_op_sharding(aten.view.default, (x, [2, 4, 3]), {}).needs_redistribute
    # On a 2x2 mesh, (S(0), S(0)) rows 4i+2j..4i+2j+1 are exactly new[i, 2j:2j+2]: (S(0), S(1)), no move.
    nested = spec(MESH_2X2, [Shard(0), Shard(0)], 8, 3)
    kept_nested = propagate_op_sharding(aten.view.default, (nested, [2, 4, 3]), {})
    assert not kept_nested.needs_redistribute and placements_out(kept_nested) == (Shard(0), Shard(1))
    # ... and the same split on a 1-D mesh of 2 lines up (rows 4 and 4 = one slice of dim 0 each).
    y = spec(FakeMesh((2,), (0,)), [Shard(0)], 8, 3)
    kept = propagate_op_sharding(aten.view.default, (y, [2, 4, 3]), {})
    assert not kept.needs_redistribute and placements_out(kept) == (Shard(0),)


# -- choosing by cost -------------------------------------------------------------------------------


def test_no_redistribution_is_preferred_when_some_strategy_fits() -> None:
    x, y = spec(MESH_4, [Shard(0)], 8, 6), spec(MESH_4, [Shard(0)], 8, 6)
    decision = propagate_op_sharding(aten.add.Tensor, (x, y), {})
    assert not decision.needs_redistribute
    assert decision.input_specs[0] is x and decision.input_specs[1] is y


def test_free_local_redistribution_beats_any_collective() -> None:
    # Row-sharded x plus replicated y: y is chunked locally rather than x gathered.
    x, y = spec(MESH_4, [Shard(0)], 8, 6), spec(MESH_4, [R], 8, 6)
    decision = propagate_op_sharding(aten.add.Tensor, (x, y), {})
    assert placements_in(decision) == [(Shard(0),), (Shard(0),)]
    # Rowwise matmul: the replicated weight is chunked along the contraction dim, the output is partial.
    a, w = spec(MESH_4, [Shard(1)], 8, 6), spec(MESH_4, [R], 6, 4)
    matmul = propagate_op_sharding(aten.mm.default, (a, w), {})
    assert placements_in(matmul) == [(Shard(1),), (Shard(0),)] and placements_out(matmul) == (P,)


def test_the_smaller_tensor_is_the_one_moved_when_bandwidth_dominates() -> None:
    # Column-sharded big x (2048x2048 fp32, 4 MB a rank) plus a row-sharded [2048, 1] column: on gloo's
    # profile, gathering the column (8 KB) takes about an all-gather's latency, the all-to-all of x
    # its latency plus 3 MB over the wire, so the output follows x.
    x, column = spec(MESH_4, [Shard(1)], 2048, 2048), spec(MESH_4, [Shard(0)], 2048, 1)
    decision = propagate_op_sharding(aten.add.Tensor, (x, column), {})
    assert placements_in(decision) == [(Shard(1),), (R,)]
    assert placements_out(decision) == (Shard(1),)
    # The other way round the big one stays and the small one moves again.
    x_rows, wide = spec(MESH_4, [Shard(0)], 2048, 2048), spec(MESH_4, [Shard(1)], 1, 2048)
    other = propagate_op_sharding(aten.add.Tensor, (x_rows, wide), {})
    assert placements_in(other) == [(Shard(0),), (R,)]


def test_the_faster_move_wins_when_latency_dominates() -> None:
    # The same layouts at 64x64: every move is latency-bound, and gloo's all-to-all (one round) beats
    # its all-gather (a ring of p - 1 rounds), so x moves to the column's Shard(0) although it is bigger.
    x, column = spec(MESH_4, [Shard(1)], 64, 64), spec(MESH_4, [Shard(0)], 64, 1)
    decision = propagate_op_sharding(aten.add.Tensor, (x, column), {})
    assert placements_in(decision) == [(Shard(0),), (Shard(0),)]


def test_ties_are_broken_deterministically() -> None:
    x, y = spec(MESH_4, [Shard(0)], 16, 16), spec(MESH_4, [Shard(1)], 16, 16)
    first = decide_op_sharding(aten.add.Tensor, (x, y), {})
    again = decide_op_sharding(aten.add.Tensor, (x, y), {})
    assert first == again
    # Equal cost either way (one all-to-all of an equally sized tensor): the first strategy, Shard(0), wins.
    assert placements_out(first) == (Shard(0),)


# -- caching ---------------------------------------------------------------------------------------


def test_same_key_gives_the_same_decision_object() -> None:
    x, y = spec(MESH_4, [Shard(0)], 8, 6), spec(MESH_4, [R], 6)
    first = propagate_op_sharding(aten.add.Tensor, (x, y), {})
    equal_specs = (spec(MESH_4, [Shard(0)], 8, 6), spec(MESH_4, [R], 6))
    assert propagate_op_sharding(aten.add.Tensor, equal_specs, {}) is first
    assert sharding_cache_size() == 1


def test_scalar_values_do_not_split_the_cache_for_pointwise_ops_but_their_types_do() -> None:
    x = spec(MESH_4, [Shard(0)], 8, 6)
    by_two = propagate_op_sharding(aten.mul.Tensor, (x, 2.0), {})
    assert propagate_op_sharding(aten.mul.Tensor, (x, 3.5), {}) is by_two
    assert sharding_cache_key(aten.mul.Tensor, (x, 2.0), {}) == sharding_cache_key(aten.mul.Tensor, (x, -1.0), {})
    # An int scalar on an int tensor keeps the int dtype; a float one does not: different keys.
    ints = spec(MESH_4, [Shard(0)], 8, 6, dtype=torch.int64)
    int_result = propagate_op_sharding(aten.mul.Tensor, (ints, 2), {})
    float_result = propagate_op_sharding(aten.mul.Tensor, (ints, 2.0), {})
    assert isinstance(int_result.output_specs, DTensorSpec) and isinstance(float_result.output_specs, DTensorSpec)
    assert int_result.output_specs.dtype == torch.int64
    assert float_result.output_specs.dtype == torch.float32
    assert sharding_cache_key(aten.mul.Tensor, (ints, True), {}) != sharding_cache_key(aten.mul.Tensor, (ints, 1), {})


def test_values_that_matter_stay_in_the_key() -> None:
    x = spec(MESH_4, [Shard(0)], 8, 6)
    assert propagate_op_sharding(aten.view.default, (x, [48]), {}) is not propagate_op_sharding(
        aten.view.default, (x, [8, 6]), {}
    )
    sum_key = sharding_cache_key(aten.sum.dim_IntList, (x, [0]), {})
    assert sum_key != sharding_cache_key(aten.sum.dim_IntList, (x, [1]), {})
    # Lists and tuples of the same sizes are the same argument.
    assert sharding_cache_key(aten.view.default, (x, [48]), {}) == sharding_cache_key(aten.view.default, (x, (48,)), {})
    # A different rank of the mesh may need different local sizes: a different key.
    other_rank = spec(FakeMesh((4,), (3,)), [Shard(0)], 8, 6)
    view_key = sharding_cache_key(aten.view.default, (x, [48]), {})
    assert view_key != sharding_cache_key(aten.view.default, (other_rank, [48]), {})


def test_the_cache_key_is_cheap_plain_data() -> None:
    x = spec(MESH_4, [Shard(0)], 8, 6)
    key = sharding_cache_key(aten.sum.dim_IntList, (x, [0], True), {"dtype": torch.float64})
    assert key == (aten.sum.dim_IntList, x, (list, 0), (bool, True), KWARGS_MARK, "dtype", torch.float64)
    hash(key)


# -- Partial linearity -------------------------------------------------------------------------------


def test_add_and_sub_of_two_partials_stay_partial() -> None:
    for op in (aten.add.Tensor, aten.sub.Tensor):
        for kind in (P, P_AVG):
            x, y = spec(MESH_4, [kind], 8, 6), spec(MESH_4, [kind], 8, 6)
            decision = propagate_op_sharding(op, (x, y), {})
            assert not decision.needs_redistribute and placements_out(decision) == (kind,)


def test_adding_a_replicated_tensor_to_a_partial_makes_it_partial_first_not_the_other_way() -> None:
    x, y = spec(MESH_4, [P], 8, 6), spec(MESH_4, [R], 8, 6)
    decision = propagate_op_sharding(aten.add.Tensor, (x, y), {})
    assert placements_in(decision) == [(P,), (P,)] and placements_out(decision) == (P,)


def test_adding_a_python_scalar_to_a_partial_reduces_it_first() -> None:
    x = spec(MESH_4, [P], 8, 6)
    decision = propagate_op_sharding(aten.add.Tensor, (x, 2.0), {})
    # Reduced straight into shards (reduce-scatter), which moves less than an all-reduce to Replicate.
    assert placements_in(decision) == [(Shard(0),)] and placements_out(decision) == (Shard(0),)


def test_scaling_a_partial_by_a_replicated_value_keeps_it_partial() -> None:
    x, scale = spec(MESH_4, [P], 8, 6), spec(MESH_4, [R], 8, 6)
    for op, args in (
        (aten.mul.Tensor, (x, 3.0)),
        (aten.mul.Tensor, (x, scale)),
        (aten.mul.Tensor, (scale, x)),
        (aten.div.Tensor, (x, scale)),
        (aten.div.Tensor, (x, 4.0)),
        (aten.neg.default, (x,)),
    ):
        decision = propagate_op_sharding(op, args, {})
        assert not decision.needs_redistribute and placements_out(decision) == (P,), op


def test_nonlinear_uses_of_a_partial_reduce_it_first() -> None:
    x, y = spec(MESH_4, [P], 8, 6), spec(MESH_4, [R], 8, 6)
    for op, args in (
        (aten.relu.default, (x,)),
        (aten.exp.default, (x,)),
        (aten.div.Tensor, (y, x)),  # the divisor is partial
        (aten.pow.Tensor_Scalar, (x, 2)),
    ):
        decision = propagate_op_sharding(op, args, {})
        assert not any(p.is_partial() for p in placements_out(decision)), op
        assert not any(p.is_partial() for layout in placements_in(decision) for p in layout), op
    # Two partial factors: only one may stay partial.
    both = propagate_op_sharding(aten.mul.Tensor, (x, spec(MESH_4, [P], 8, 6)), {})
    assert sum(layout == (P,) for layout in placements_in(both)) == 1
    assert placements_out(both) == (P,)


def test_max_partials_are_not_carried_through_arithmetic() -> None:
    x = spec(MESH_4, [P_MAX], 8, 6)
    decision = propagate_op_sharding(aten.mul.Tensor, (x, 2.0), {})
    assert placements_in(decision) == [(Shard(0),)]
    # ... but element-moving ops keep every kind.
    for op, args in ((aten.t.default, (x,)), (aten.view.default, (x, [48])), (aten.clone.default, (x,))):
        assert placements_out(propagate_op_sharding(op, args, {})) == (P_MAX,), op


def test_casting_a_partial_sum_to_integers_reduces_it_first() -> None:
    x = spec(MESH_4, [P], 8, 6)
    to_int = propagate_op_sharding(aten._to_copy.default, (x,), {"dtype": torch.int32})
    assert placements_in(to_int) == [(Shard(0),)] and placements_out(to_int) == (Shard(0),)
    to_double = propagate_op_sharding(aten._to_copy.default, (x,), {"dtype": torch.float64})
    assert placements_out(to_double) == (P,)


def test_mean_over_a_sharded_dim_is_partial_avg_only_when_the_shards_are_even() -> None:
    even = spec(MESH_4, [Shard(0)], 8, 3)
    assert placements_out(propagate_op_sharding(aten.mean.dim, (even, [0]), {})) == (P_AVG,)
    uneven = spec(MESH_4, [Shard(0)], 6, 3)
    decision = propagate_op_sharding(aten.mean.dim, (uneven, [0]), {})
    assert decision.needs_redistribute and placements_out(decision) != (P_AVG,)
    # Nested over a 2x2 mesh: 6 rows split 2 then 2 is uneven (2,1 | 2,1) -> no Partial(avg).
    nested = spec(MESH_2X2, [Shard(0), Shard(0)], 6, 3)
    nested_decision = propagate_op_sharding(aten.mean.dim, (nested, [0]), {})
    assert nested_decision.needs_redistribute
    assert placements_out(nested_decision) != (P_AVG, P_AVG)
    # sum over an uneven sharded dim is exact: Partial(sum).
    assert placements_out(propagate_op_sharding(aten.sum.dim_IntList, (uneven, [0]), {})) == (P,)


# -- in-place and out= ---------------------------------------------------------------------------------


def test_in_place_ops_keep_self_and_return_its_spec() -> None:
    x, y = spec(MESH_4, [Shard(0)], 8, 6), spec(MESH_4, [R], 8, 6)
    decision = propagate_op_sharding(aten.add_.Tensor, (x, y), {})
    assert decision.output_specs is x
    assert decision.input_specs[0] is x and placements_in(decision)[1] == (Shard(0),)
    # Even when moving self would be cheaper, self stays: the other input moves instead.
    rows, cols = spec(MESH_4, [Shard(0)], 4, 64), spec(MESH_4, [Shard(1)], 4, 64)
    kept = propagate_op_sharding(aten.add_.Tensor, (rows, cols), {})
    assert kept.input_specs[0] is rows and kept.output_specs is rows


def test_in_place_partial_sum_that_cannot_stay_partial_is_an_error_naming_op_and_placements() -> None:
    x = spec(MESH_4, [P], 8, 6)
    with pytest.raises(ShardingPropagationError, match=r"aten\.relu_\.default .*self: Partial\(sum\)"):
        propagate_op_sharding(aten.relu_.default, (x,), {})
    with pytest.raises(ShardingPropagationError, match=r"aten\.exp_\.default"):
        propagate_op_sharding(aten.exp_.default, (x,), {})
    # zero_ and fill_ keep any partial (fill_ of a sum: one rank per mesh dim holds the value).
    assert propagate_op_sharding(aten.zero_.default, (x,), {}).output_specs is x
    assert propagate_op_sharding(aten.fill_.Scalar, (x, 1.0), {}).output_specs is x
    averaged = spec(MESH_4, [P_AVG], 8, 6)
    assert propagate_op_sharding(aten.fill_.Scalar, (averaged, 1.0), {}).output_specs is averaged


def test_out_variants_write_into_the_out_layout() -> None:
    x, y = spec(MESH_4, [Shard(0)], 8, 6), spec(MESH_4, [Shard(0)], 8, 6)
    out = spec(MESH_4, [Shard(1)], 8, 6)
    decision = propagate_op_sharding(aten.add.out, (x, y), {"out": out})
    assert decision.output_specs is out
    assert decision.input_specs[2] is out
    assert placements_in(decision)[:2] == [(Shard(1),), (Shard(1),)]
    wrong_shape = spec(MESH_4, [Shard(0)], 4, 6)
    with pytest.raises((ValueError, RuntimeError)):
        propagate_op_sharding(aten.add.out, (x, y), {"out": wrong_shape})


# -- overrides, outputs, errors ----------------------------------------------------------------------


def test_view_gets_each_ranks_local_size_also_for_uneven_and_empty_shards() -> None:
    for rank, expected_rows in enumerate((2, 2, 2, 0)):
        x = spec(FakeMesh((4,), (rank,)), [Shard(0)], 6, 2, 3)
        decision = propagate_op_sharding(aten.view.default, (x, [6, 6]), {})
        assert placements_out(decision) == (Shard(0),)
        assert decision.local_arg_overrides == ((1, (expected_rows, 6)),)
    replicated = spec(MESH_4, [R], 6, 2, 3)
    assert propagate_op_sharding(aten.view.default, (replicated, [-1]), {}).local_arg_overrides == ()


def test_output_specs_carry_global_metadata() -> None:
    x = spec(MESH_4, [Shard(1)], 8, 6)
    w = spec(MESH_4, [Shard(0)], 6, 4)
    decision = propagate_op_sharding(aten.mm.default, (x, w), {})
    assert isinstance(decision.output_specs, DTensorSpec)
    assert decision.output_specs.tensor_meta == TensorMeta(torch.Size([8, 4]), (4, 1), torch.float32)
    transposed = propagate_op_sharding(aten.t.default, (x,), {})
    assert isinstance(transposed.output_specs, DTensorSpec)
    assert transposed.output_specs.tensor_meta == TensorMeta(torch.Size([6, 8]), (1, 6), torch.float32)
    assert transposed.output_specs.placements == (Shard(0),)


def test_ops_returning_python_values_have_no_output_spec() -> None:
    x, y = spec(MESH_4, [Shard(0)], 8, 6), spec(MESH_4, [Shard(1)], 8, 6)
    decision = propagate_op_sharding(aten.equal.default, (x, y), {})
    assert decision.output_specs is None
    assert placements_in(decision) == [(R,), (R,)]


@torch.library.custom_op("shardwise_prop_test::no_rule", mutates_args=())
def _op_without_rule(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def test_an_op_without_a_rule_names_the_op_and_the_input_placements() -> None:
    x = spec(MESH_4, [Shard(0)], 8, 6)
    with pytest.raises(
        NotImplementedError,
        match=(
            r"^shardwise has no sharding rule for shardwise_prop_test\.no_rule\.default \(inputs: Shard\(dim=0\)\): "
            r"Operator shardwise_prop_test\.no_rule\.default does not have a sharding strategy registered\.$"
        ),
    ):
        propagate_op_sharding(torch.ops.shardwise_prop_test.no_rule.default, (x,), {})
    a, b = spec(MESH_2X2, [Shard(0), R], 8, 3), spec(MESH_2X2, [R, P], 8, 3)
    with pytest.raises(
        NotImplementedError,
        match=(
            r"^shardwise has no sharding rule for aten\.cross\.default "
            r"\(inputs: \(Shard\(dim=0\), Replicate\(\)\), \(Replicate\(\), Partial\(sum\)\)\): "
            r"Operator aten\.cross\.default does not have a sharding strategy registered\.$"
        ),
    ):
        propagate_op_sharding(aten.cross.default, (a, b), {})


def test_dtensors_on_different_meshes_are_rejected() -> None:
    x, y = spec(MESH_4, [Shard(0)], 8, 6), spec(FakeMesh((4,), (1,)), [R], 8, 6)
    with pytest.raises(ValueError, match="different device meshes"):
        propagate_op_sharding(aten.add.Tensor, (x, y), {})


def test_plain_tensors_other_than_scalars_are_rejected() -> None:
    x = spec(MESH_4, [Shard(0)], 8, 6)
    with pytest.raises(TypeError, match=r"plain torch\.Tensor of shape \(8, 6\)"):
        propagate_op_sharding(aten.add.Tensor, (x, torch.ones(8, 6)), {})
    scalar = propagate_op_sharding(aten.mul.Tensor, (x, torch.tensor(2.0)), {})
    assert placements_out(scalar) == (Shard(0),)


def test_shape_errors_are_torchs_own() -> None:
    x, y = spec(MESH_4, [Shard(0)], 8, 6), spec(MESH_4, [R], 5, 6)
    with pytest.raises(RuntimeError, match="broadcast"):
        propagate_op_sharding(aten.add.Tensor, (x, y), {})
