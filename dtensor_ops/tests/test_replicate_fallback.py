"""experimental.replicate_fallback: ops without a sharding rule on replicated inputs (opt in), on 4 gloo ranks."""

from __future__ import annotations

import warnings

import pytest
import torch

from shardwise.dtensor_ops import Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.dtensor_ops.experimental import ReplicateFallbackWarning, replicate_fallback
from shardwise.testing import multi_rank

# An op no rule family will ever cover: its value at i needs every element (a reversed cumulative sum).
_library = torch.library.Library("replicate_fallback_probe", "DEF")
_library.define("suffix_sum(Tensor x) -> Tensor")
_library.impl("suffix_sum", lambda x: x.flip(0).cumsum(0).flip(0), "CPU")
_library.impl("suffix_sum", lambda x: torch.empty_like(x), "Meta")
_suffix_sum = torch.ops.replicate_fallback_probe.suffix_sum.default


def _fallback_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ReplicateFallbackWarning)]


@multi_rank(world_size=4)
def test_fallback_is_off_by_default_and_runs_replicated_when_on() -> None:
    mesh = init_device_mesh("cpu", (4,))
    full = torch.arange(10, dtype=torch.float32).reshape(5, 2)  # 5 rows on 4 ranks: uneven
    x = distribute_tensor(full, mesh, [Shard(0)])
    with pytest.raises(NotImplementedError, match=r"suffix_sum.*Shard\(dim=0\)"):
        _suffix_sum(x)

    with replicate_fallback(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert replicate_fallback.is_enabled()
        with CommDebugMode() as comm:
            y = _suffix_sum(x)
        again = _suffix_sum(x)
    assert y.placements == (Replicate(),) and again.placements == (Replicate(),)
    torch.testing.assert_close(y.full_tensor(), _suffix_sum(full))
    torch.testing.assert_close(y.to_local(), _suffix_sum(full))  # replicated: every rank holds the result
    # the inputs went through redistribution: one all-gather, counted
    assert comm.get_comm_counts()[torch.ops.c10d_functional.all_gather_into_tensor] == 1
    assert comm.get_total_counts() == 1
    messages = _fallback_warnings(caught)
    assert len(messages) == 1, messages  # once per (op, placements)
    assert "suffix_sum" in messages[0] and "Shard(dim=0)" in messages[0]
    assert "bytes per rank" in messages[0]

    # off again: the cached fallback decision is forgotten and the error comes back
    assert not replicate_fallback.is_enabled()
    with pytest.raises(NotImplementedError, match="suffix_sum"):
        _suffix_sum(x)

    # the global switch
    replicate_fallback.enable()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            z = _suffix_sum(distribute_tensor(full, mesh, [Replicate()]))
        torch.testing.assert_close(z.to_local(), _suffix_sum(full))
        # a replicated input moves nothing, and the warning says so (new placements: warned once more)
        assert any("moves 0 bytes per rank" in message for message in _fallback_warnings(caught))
    finally:
        replicate_fallback.disable()
    with pytest.raises(NotImplementedError, match="suffix_sum"):
        _suffix_sum(x)


@multi_rank(world_size=2)
def test_the_switch_is_one_of_the_options_with_an_environment_override() -> None:
    import os

    from shardwise.dtensor_ops._options import current_options, use_options

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(6, dtype=torch.float32)
    x = distribute_tensor(full, mesh, [Shard(0)])
    os.environ["SHARDWISE_REPLICATE_FALLBACK"] = "1"
    try:
        assert current_options().replicate_fallback and replicate_fallback.is_enabled()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplicateFallbackWarning)
            torch.testing.assert_close(_suffix_sum(x).full_tensor(), _suffix_sum(full))
        # A block of options wins over the environment on its thread.
        with use_options(replicate_fallback=False):
            assert not replicate_fallback.is_enabled()
    finally:
        del os.environ["SHARDWISE_REPLICATE_FALLBACK"]
    replicate_fallback.disable()  # the decision made under the variable stays cached until turned off here
    with pytest.raises(NotImplementedError, match="suffix_sum"):
        _suffix_sum(x)
