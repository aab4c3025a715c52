"""The decision pipeline as stated (ordered deciders), the options object and the one rule for cache keys.

One process on a one-rank fake mesh: the ops used need no communication, so dispatch runs for real
(reading, the lookup, the pipeline, execution) without process groups.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch._decomp
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from shardwise.dtensor_ops import DTensor, Replicate, Shard
from shardwise.dtensor_ops._caches import RANK_CACHES, SYMBOLIC, clear_all_caches, lookup, store
from shardwise.dtensor_ops._decision import OpDecision
from shardwise.dtensor_ops._decision_pipeline import call_key
from shardwise.dtensor_ops._decision_pipeline import (
    DECIDERS,
    DISPATCH_LOOKUPS,
    Algorithm,
    decide_from_specs,
    propagate_op_sharding,
)
from shardwise.dtensor_ops._op_handlers import custom_op_handlers, register_op_handler, unregister_op_handler
from shardwise.dtensor_ops._options import ENVIRONMENT_OVERRIDES, Options, current_options, use_options
from shardwise.dtensor_ops.experimental import replicate_fallback
from shardwise.placement import DTensorSpec, Placement, TensorMeta
from shardwise.testing import FakeMesh

aten = torch.ops.aten
MESH = FakeMesh((1,), (0,))


def on_fake_mesh(tensor: torch.Tensor, placement: Placement = Replicate()) -> DTensor:
    meta = TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype)
    return DTensor(tensor, DTensorSpec(MESH, (placement,), meta), requires_grad=False)


def local_of(value: object) -> torch.Tensor:
    assert isinstance(value, DTensor), type(value)
    return value.to_local()


def test_the_deciders_are_stated_in_their_real_priority_with_what_can_be_cached() -> None:
    assert [(d.name, d.cacheable) for d in DECIDERS] == [
        ("user handlers", False),
        ("built-in handlers", True),
        ("the op's rule", True),
        ("decomposition", True),
        ("replicate fallback", True),
    ]


def test_a_handler_that_takes_a_call_is_memoised_as_an_algorithm_and_a_hit_runs_it() -> None:
    clear_all_caches()
    x = on_fake_mesh(torch.arange(4.0))
    asked: list[int] = []

    def doubled(op: Any, args: Any, kwargs: Any) -> Any:
        asked.append(1)
        return on_fake_mesh(args[0].to_local() * 2)

    register_op_handler(aten.abs.default, doubled, declines_by_key=True)
    try:
        misses_before = DISPATCH_LOOKUPS[1]
        for _ in range(3):
            assert torch.equal(local_of(torch.abs(x)), torch.arange(4.0) * 2)
        assert DISPATCH_LOOKUPS[1] - misses_before == 1  # one miss, then hits of the memoised algorithm
        (answer,) = RANK_CACHES.decisions.values()
        assert isinstance(answer, Algorithm) and len(asked) == 3
        # Propagation asks for specs only: the algorithm's key is decided afresh by the rule, not stored over.
        decision = propagate_op_sharding(aten.abs.default, (x._spec,), {})
        assert isinstance(decision, OpDecision)
        assert isinstance(RANK_CACHES.decisions[call_key(aten.abs.default, (x._spec,))], Algorithm)
    finally:
        unregister_op_handler(aten.abs.default, doubled)
    assert not RANK_CACHES.decisions  # removing a handler forgets what was memoised with it
    assert torch.equal(local_of(torch.abs(x)), torch.arange(4.0))


def test_matmul_arriving_whole_under_inference_mode_runs_as_its_decomposition() -> None:
    clear_all_caches()
    x_full, w_full = torch.arange(12.0).reshape(3, 4), torch.arange(8.0).reshape(4, 2)
    x, w, w_t = on_fake_mesh(x_full, Shard(0)), on_fake_mesh(w_full), on_fake_mesh(w_full.t().contiguous())
    with torch.inference_mode():
        out = torch.matmul(x, w)
        assert isinstance(out, DTensor) and out.placements == (Shard(0),)
        assert torch.equal(out.to_local(), x_full @ w_full)
        linear = torch.nn.functional.linear(x, w_t)
        assert torch.equal(local_of(linear), x_full @ w_full)


def test_a_user_handler_is_asked_on_every_call_before_the_cache_and_caches_nothing() -> None:
    clear_all_caches()
    x = on_fake_mesh(torch.arange(4.0))
    asked: list[int] = []

    def count_then_decline(op: Any, args: Any, kwargs: Any) -> Any:
        asked.append(1)
        return NotImplemented

    with custom_op_handlers({aten.neg.default: count_then_decline}):
        for _ in range(3):
            assert torch.equal(local_of(torch.neg(x)), -torch.arange(4.0))
        # Asked on all three calls although the rule's decision was cached after the first.
        assert len(asked) == 3
        assert len(RANK_CACHES.decisions) == 1


def test_a_handler_declining_by_key_is_asked_on_a_miss_only() -> None:
    clear_all_caches()
    x = on_fake_mesh(torch.arange(4.0))
    asked: list[int] = []

    def count_then_decline(op: Any, args: Any, kwargs: Any) -> Any:
        asked.append(1)
        return NotImplemented

    register_op_handler(aten.abs.default, count_then_decline, declines_by_key=True)
    try:
        for _ in range(3):
            torch.abs(x)
    finally:
        unregister_op_handler(aten.abs.default, count_then_decline)
    assert len(asked) == 1


def test_a_handler_answer_is_the_result_and_is_never_cached() -> None:
    clear_all_caches()
    x = on_fake_mesh(torch.arange(4.0))

    def ten(op: Any, args: Any, kwargs: Any) -> Any:
        return on_fake_mesh(torch.full((4,), 10.0))

    with custom_op_handlers({aten.exp.default: ten}):
        assert torch.equal(local_of(torch.exp(x)), torch.full((4,), 10.0))
    assert not RANK_CACHES.decisions
    # Without the handler, the op's rule decides.
    assert torch.allclose(local_of(torch.exp(x)), torch.exp(torch.arange(4.0)))


_DECOMP_LIB = torch.library.Library("shardwise_decomp_test", "DEF")
_DECOMP_LIB.define("scaled_matmul(Tensor x, Tensor y) -> Tensor")
_DECOMP_LIB.define("via_scaled(Tensor x, Tensor y) -> Tensor")
_DECOMP_LIB.define("self_calling(Tensor x) -> Tensor")
for _name, _impl in (
    ("scaled_matmul", lambda x, y: (x @ y) * 2.0),
    ("via_scaled", lambda x, y: (x @ y) * 2.0 + 1.0),
    ("self_calling", lambda x: x + 1.0),
):
    _DECOMP_LIB.impl(_name, _impl, "CPU")
    _DECOMP_LIB.impl(_name, _impl, "Meta")
_ops = torch.ops.shardwise_decomp_test


@torch._decomp.register_decomposition(_ops.scaled_matmul.default)
def _scaled_matmul_decomposition(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, y) * 2.0


@torch._decomp.register_decomposition(_ops.via_scaled.default)
def _via_scaled_decomposition(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _ops.scaled_matmul(x, y) + 1.0  # a decomposition into another decomposed op


@torch._decomp.register_decomposition(_ops.self_calling.default)
def _self_calling_decomposition(x: torch.Tensor) -> torch.Tensor:
    return _ops.self_calling(x)  # decomposes into itself: must not recurse


def test_an_op_without_a_rule_runs_as_its_registered_decomposition_each_inner_op_decided_by_its_rule() -> None:
    clear_all_caches()
    x_full, y_full = torch.arange(12.0).reshape(3, 4), torch.arange(8.0).reshape(4, 2)
    x, y = on_fake_mesh(x_full, Shard(0)), on_fake_mesh(y_full)
    out = _ops.via_scaled(x, y)
    assert isinstance(out, DTensor) and out.placements == (Shard(0),)
    assert torch.equal(out.to_local(), (x_full @ y_full) * 2.0 + 1.0)
    decided = set(RANK_CACHES.decisions)
    _ops.via_scaled(x, y)
    _ops.scaled_matmul(x, y)
    assert set(RANK_CACHES.decisions) == decided  # the inner ops' decisions, reused; nothing stored for the decomposed ops
    with pytest.raises(NotImplementedError, match="self_calling.*does not have a sharding strategy registered"):
        _ops.self_calling(x)


def test_an_op_no_decider_takes_raises_naming_it_until_the_fallback_takes_it() -> None:
    clear_all_caches()
    spec = on_fake_mesh(torch.eye(4), Shard(0))._spec
    # aten.linalg_eigh has no sharding rule (its decomposition _linalg_eigh has): the rule decider
    # declines, the fallback is off.
    with pytest.raises(NotImplementedError, match="linalg_eigh.*does not have a sharding strategy registered"):
        decide_from_specs(aten.linalg_eigh.default, (spec,), {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with replicate_fallback():
            decision = decide_from_specs(aten.linalg_eigh.default, (spec,), {})
    assert decision.input_specs[0].placements == (Replicate(),)


def test_direct_propagation_and_dispatch_share_one_decision_under_one_key() -> None:
    clear_all_caches()
    x = on_fake_mesh(torch.arange(6.0).reshape(2, 3), Shard(0))
    x * 2.0
    decision = propagate_op_sharding(aten.mul.Tensor, (x._spec, 2.0), {})
    assert isinstance(decision, OpDecision)
    assert RANK_CACHES.decisions[call_key(aten.mul.Tensor, (x._spec, 2.0))] is decision
    assert len(RANK_CACHES.decisions) == 1


def test_options_come_from_one_object_with_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    variable = ENVIRONMENT_OVERRIDES["gloo_all_to_all"]
    monkeypatch.delenv(variable, raising=False)
    assert current_options() == Options()
    monkeypatch.setenv(variable, "1")
    assert current_options().gloo_all_to_all
    with use_options(gloo_all_to_all=False) as chosen:
        assert current_options() is chosen and not chosen.gloo_all_to_all
        with use_options(Options(gloo_all_to_all=True)):
            assert current_options().gloo_all_to_all
        assert not current_options().gloo_all_to_all
    monkeypatch.setenv(variable, "yes")
    with pytest.raises(ValueError, match="SHARDWISE_GLOO_ALL_TO_ALL='yes'"):
        current_options()


def test_cache_keys_with_symbolic_sizes_are_never_stored_and_other_unhashable_keys_are_refused() -> None:
    cache: dict[Any, Any] = {}
    size = ShapeEnv().create_unbacked_symint()
    symbolic_key = ("op", (list, size, 3))
    assert lookup(cache, symbolic_key) is SYMBOLIC
    store(cache, symbolic_key, "decision", limit=4)
    assert cache == {}
    with pytest.raises(TypeError, match="not hashable"):
        lookup(cache, ("op", {"a dict": 1}))
    for index in range(5):
        store(cache, index, index, limit=4)
    assert cache == {4: 4}  # emptied when full, then stored


def test_the_engine_owns_what_decisions_depend_on_and_a_change_starts_a_new_generation() -> None:
    from shardwise.dtensor_ops._engine import ENGINE
    from shardwise.dtensor_ops._rules import override_rule, restore_rule, rule_for

    assert ENGINE.rank_caches is RANK_CACHES and ENGINE.dispatch_lookups is DISPATCH_LOOKUPS
    clear_all_caches()
    x = on_fake_mesh(torch.arange(4.0))
    torch.neg(x)
    assert RANK_CACHES.decisions
    generation = ENGINE.generation
    # A rule replaced: nothing made with the old one survives, with no cache cleared by the caller.
    replaced = override_rule([aten.neg.default], rule_for(aten.neg.default))  # type: ignore[arg-type]
    try:
        assert ENGINE.generation > generation and not RANK_CACHES.decisions
    finally:
        restore_rule(aten.neg.default, replaced[aten.neg.default])
    # Options decisions are made from: entering and leaving a block that changes them forget decisions.
    torch.neg(x)
    generation = ENGINE.generation
    with use_options(cost_profile="nccl"):
        assert ENGINE.generation > generation and not RANK_CACHES.decisions
        torch.neg(x)
        inside = ENGINE.generation
    assert ENGINE.generation > inside and not RANK_CACHES.decisions
    # A block that changes no option forgets nothing.
    torch.neg(x)
    generation = ENGINE.generation
    with use_options(cost_profile=current_options().cost_profile):
        pass
    assert ENGINE.generation == generation and RANK_CACHES.decisions


def test_a_decompositions_implicit_replication_and_the_recorded_cp_layout_are_per_thread() -> None:
    import threading

    from shardwise.dtensor_ops._implicit_replication import (
        implicit_replication,
        is_implicit_replication_enabled,
        replicated_within_this_thread,
    )
    import shardwise.dtensor_ops.experimental._cp_layout as cp_layout
    from shardwise.dtensor_ops.experimental._cp_layout import contiguous_layout, record_layouts, recorded_layouts

    seen: dict[str, object] = {}

    def other_thread() -> None:
        seen["implicit"] = is_implicit_replication_enabled()
        record_layouts((contiguous_layout(8, 2),))
        seen["layout"] = recorded_layouts()

    def implicit_seen_from_another_thread() -> object:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        return seen["implicit"]

    mine = (contiguous_layout(6, 3),)
    record_layouts(mine)
    try:
        with replicated_within_this_thread():  # what the pipeline enters around a decomposition
            assert is_implicit_replication_enabled()
            assert implicit_seen_from_another_thread() is False
        assert not is_implicit_replication_enabled()
        assert seen["layout"] == (contiguous_layout(8, 2),)
        assert recorded_layouts() == mine  # this thread's own, not the other thread's later one
        # The user's context is process-wide, as PyTorch's: autograd's device threads and rank threads see it.
        with implicit_replication():
            assert implicit_seen_from_another_thread() is True
        assert not is_implicit_replication_enabled() and implicit_seen_from_another_thread() is False
    finally:
        record_layouts(None)
        del cp_layout._RECORDED.rows  # this thread back to having recorded nothing
