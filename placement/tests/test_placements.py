from __future__ import annotations

import copy
import pickle

import pytest

from shardwise.placement import SUPPORTED_REDUCE_OPS, Partial, Placement, Replicate, Shard, _Partial


def every_kind_of_placement() -> list[Placement]:
    return [Shard(0), Shard(1), Shard(-1), Replicate()] + [Partial(op) for op in sorted(SUPPORTED_REDUCE_OPS)]


def test_predicates_identify_each_kind() -> None:
    shard, replicate, partial = Shard(2), Replicate(), Partial()
    assert (shard.is_shard(), shard.is_replicate(), shard.is_partial()) == (True, False, False)
    assert (replicate.is_shard(), replicate.is_replicate(), replicate.is_partial()) == (False, True, False)
    assert (partial.is_shard(), partial.is_replicate(), partial.is_partial()) == (False, False, True)


def test_is_shard_with_dim_matches_only_that_dim() -> None:
    assert Shard(0).is_shard(0) and Shard(0).is_shard(dim=0) and Shard(0).is_shard(dim=None)
    assert not Shard(0).is_shard(1)
    assert not Replicate().is_shard(0)
    assert not Partial().is_shard(dim=0)


def test_bare_placement_base_is_nothing_in_particular() -> None:
    base = Placement()
    assert not base.is_shard() and not base.is_replicate() and not base.is_partial()


def test_partial_defaults_to_sum_and_accepts_supported_ops() -> None:
    assert Partial().reduce_op == "sum"
    assert Partial() == Partial("sum") == Partial(reduce_op="sum")
    assert SUPPORTED_REDUCE_OPS == {"sum", "avg", "max", "min", "product"}
    for op in SUPPORTED_REDUCE_OPS:
        assert Partial(op).reduce_op == op
    assert Partial("prod") == Partial("product")  # c10d's name, and the short one PyTorch code uses


@pytest.mark.parametrize("bad_op", ["PROD", "SUM", "", "mean"])
def test_partial_rejects_unknown_reduce_op_naming_the_choices(bad_op: str) -> None:
    with pytest.raises(ValueError, match=rf"Partial\(reduce_op='{bad_op}'\).*'avg', 'max', 'min', 'product', 'sum'"):
        Partial(bad_op)


def test_partial_rejects_non_string_reduce_op() -> None:
    with pytest.raises(ValueError, match="reduce_op=1"):
        Partial(1)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad_dim", ["0", 1.0, None, True])
def test_shard_rejects_non_integer_dim(bad_dim: object) -> None:
    with pytest.raises(TypeError, match="expects an int tensor dimension"):
        Shard(bad_dim)  # type: ignore[arg-type]


def test_shard_accepts_integer_like_dims() -> None:
    import numpy as np

    assert Shard(np.int64(3)) == Shard(3)  # type: ignore[arg-type]
    assert type(Shard(np.int64(3)).dim) is int  # type: ignore[arg-type]


def test_equality_is_by_value_and_across_kinds_is_false() -> None:
    placements = every_kind_of_placement()
    rebuilt = every_kind_of_placement()
    for i, left in enumerate(placements):
        for j, right in enumerate(rebuilt):
            assert (left == right) == (i == j), (left, right)
            assert (left != right) == (i != j), (left, right)
    assert Shard(0) != 0
    assert Replicate() != "Replicate()"


def test_hash_agrees_with_equality_and_works_as_keys() -> None:
    placements = every_kind_of_placement()
    for left, right in zip(placements, every_kind_of_placement()):
        assert hash(left) == hash(right)
    assert len(set(placements + every_kind_of_placement())) == len(placements)
    cache = {(Shard(0), Replicate()): "a", (Partial("max"),): "b"}
    assert cache[(Shard(0), Replicate())] == "a"
    assert cache[(Partial("max"),)] == "b"
    assert (Partial("min"),) not in cache


def test_repr_is_pytorchs_and_evaluates_back_except_partial() -> None:
    assert repr(Shard(0)) == "Shard(dim=0)"
    assert repr(Shard(-1)) == "Shard(dim=-1)"
    assert repr(Replicate()) == "Replicate()"
    assert repr(Partial()) == "Partial(sum)" and repr(Partial("max")) == "Partial(max)"
    # Partial's repr is PyTorch's (code matches on it), which names the op without quotes.
    for placement in every_kind_of_placement():
        if not isinstance(placement, Partial):
            assert eval(repr(placement)) == placement


def test_short_str_forms() -> None:
    assert [str(p) for p in (Shard(1), Replicate(), Partial(), Partial("avg"))] == ["S(1)", "R", "P(sum)", "P(avg)"]


def test_pickle_and_copy_round_trip_by_value() -> None:
    for placement in every_kind_of_placement():
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            restored = pickle.loads(pickle.dumps(placement, protocol=protocol))
            assert restored == placement and type(restored) is type(placement)
            assert hash(restored) == hash(placement)
        assert copy.copy(placement) == placement
        assert copy.deepcopy(placement) == placement


@pytest.mark.parametrize(
    "placement, attribute", [(Shard(0), "dim"), (Partial(), "reduce_op"), (Replicate(), "anything")]
)
def test_placements_are_immutable(placement: Placement, attribute: str) -> None:
    with pytest.raises(AttributeError, match="immutable"):
        setattr(placement, attribute, 1)
    with pytest.raises(AttributeError, match="immutable"):
        delattr(placement, attribute)


def test_legacy_private_partial_name_is_the_same_class() -> None:
    assert _Partial is Partial
    assert _Partial() == Partial("sum")
