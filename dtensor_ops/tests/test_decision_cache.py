"""The one decision cache: every dispatch path keys it with the one key builder, one function clears every cache.

Runs in one process on a one-rank fake mesh: the ops used need no communication, so dispatch
runs for real (keys, decisions, local ops, wrapping) without process groups.
"""

from __future__ import annotations

from typing import Any, Hashable

import pytest
import torch

import shardwise.dtensor_ops._op_runner as dispatch
from shardwise.dtensor_ops import DTensor, Replicate, Shard
from shardwise.dtensor_ops._caches import RANK_CACHES, SHARED_CACHES, RankCaches, SharedCaches, clear_all_caches
from shardwise.dtensor_ops._decision_pipeline import call_key, decision_cache_size
from shardwise.dtensor_ops._op_handlers import custom_op_handlers, handlers_for, register_op_handler, unregister_op_handler
from shardwise.dtensor_ops._call_schema import schema_facts
from shardwise.placement import DTensorSpec, Placement, TensorMeta
from shardwise.testing import FakeMesh

aten = torch.ops.aten
MESH = FakeMesh((1,), (0,))


def on_fake_mesh(tensor: torch.Tensor, placement: Placement = Replicate()) -> DTensor:
    meta = TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype)
    return DTensor(tensor, DTensorSpec(MESH, (placement,), meta), requires_grad=False)


@pytest.fixture()
def recorded_misses(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Hashable, Any, tuple[Any, ...], dict[str, Any]]]:
    """Every cache miss of dispatch: (the key it built, the op, the spec args, the spec kwargs)."""
    clear_all_caches()
    misses: list[tuple[Hashable, Any, tuple[Any, ...], dict[str, Any]]] = []
    real = dispatch.decide

    def recording(call: Any) -> Any:
        misses.append((call.key, call.op, call.spec_args, call.spec_kwargs))
        return real(call)

    monkeypatch.setattr(dispatch, "decide", recording)
    return misses


def test_fast_and_general_path_keys_are_the_key_builders_keys(
    recorded_misses: list[tuple[Hashable, Any, tuple[Any, ...], dict[str, Any]]],
) -> None:
    x = on_fake_mesh(torch.arange(8.0).reshape(2, 4))
    y = on_fake_mesh(torch.ones(2, 4), Shard(0))
    calls = [
        lambda: x + y,  # fast path: DTensors only
        lambda: x * 2.5,  # fast path: a float (keyed by type for pointwise ops)
        lambda: x.view(4, 2),  # fast path: an int list
        lambda: torch.add(x, y, alpha=2),  # general path: kwargs
        lambda: torch.sum(x, dim=[0], keepdim=True),  # fast path: bool and list
        lambda: torch._foreach_add([x, y], [y, x]),  # general path: tensor lists
        lambda: torch.where(x > 2, x, y),  # a bool DTensor
    ]
    for call in calls:
        call()
    assert len(recorded_misses) >= len(calls)
    for key, op, spec_args, spec_kwargs in recorded_misses:
        assert key == call_key(op, spec_args, spec_kwargs), op
        assert RANK_CACHES.decisions.get(key) is not None, op


def test_float_values_of_value_blind_ops_share_one_entry_and_ints_do_not() -> None:
    clear_all_caches()
    x = on_fake_mesh(torch.arange(8.0))
    for scale in (0.5, 0.25, 3.0):
        x * scale
    assert decision_cache_size() == 1
    x + 1
    x + 2
    assert decision_cache_size() == 3  # ints may change a result dtype or a size: keyed by value


def test_foreach_elements_are_decided_through_the_same_cache() -> None:
    clear_all_caches()
    params = [on_fake_mesh(torch.ones(3)), on_fake_mesh(torch.ones(2, 2), Shard(0))]
    torch._foreach_add_(params, [on_fake_mesh(torch.ones(3)), on_fake_mesh(torch.ones(2, 2), Shard(0))])
    ops = {key[0] for key in RANK_CACHES.decisions}  # type: ignore[index]
    assert aten._foreach_add_.List in ops and aten.add_.Tensor in ops
    assert torch.equal(params[0].to_local(), torch.full((3,), 2.0))


def test_one_function_clears_every_cache_of_the_two_cache_objects() -> None:
    x = on_fake_mesh(torch.arange(8.0))
    x.view(2, 4)
    assert decision_cache_size() > 0 and SHARED_CACHES.schema_facts
    # Decisions and programs hold this rank's local sizes; the plan of a (source, target) pair does not.
    assert {"decisions", "programs"} <= set(RankCaches.fields())
    assert {"plans_by_specs", "schema_facts"} <= set(SharedCaches.__slots__)
    clear_all_caches()
    assert decision_cache_size() == 0
    assert not any(getattr(RANK_CACHES, name) for name in RankCaches.fields())
    assert not any(getattr(SHARED_CACHES, name) for name in SharedCaches.__slots__)


def test_one_schema_analysis_answers_what_propagation_and_dispatch_ask() -> None:
    add_ = schema_facts(aten.add_.Tensor)
    assert add_.writes_first_argument and add_.returns_written_first_argument and 0 in add_.written
    foreach_add_ = schema_facts(aten._foreach_add_.List)
    assert foreach_add_.writes_first_argument and not foreach_add_.returns_written_first_argument
    assert foreach_add_.returns_nothing and foreach_add_.takes_tensor_list
    add_out = schema_facts(aten.add.out)
    assert add_out.out_names == ("out",) and not add_out.writes_first_argument and "out" in add_out.written
    assert schema_facts(aten.bernoulli.p).generator_argument == "generator"
    assert schema_facts(aten.add.Tensor).written == frozenset()


def test_handlers_that_decline_by_key_are_asked_on_a_miss_and_the_others_on_every_call() -> None:
    clear_all_caches()
    asked: list[str] = []

    def keyed(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        asked.append("keyed")
        return NotImplemented

    def unkeyed(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        asked.append("unkeyed")
        return NotImplemented

    x = on_fake_mesh(torch.arange(4.0))
    x * x  # cached before the handler exists: registering it drops that decision
    register_op_handler(aten.mul.Tensor, keyed, declines_by_key=True)
    try:
        for _ in range(3):
            torch.testing.assert_close((x * x).to_local(), torch.arange(4.0) ** 2)
        assert asked == ["keyed"]
        asked.clear()
        with custom_op_handlers({aten.mul.Tensor: unkeyed}):
            x * x
            x * x
        assert asked == ["unkeyed", "keyed", "unkeyed", "keyed"]
    finally:
        unregister_op_handler(aten.mul.Tensor, keyed)
    assert handlers_for(aten.mul.Tensor) == ()
