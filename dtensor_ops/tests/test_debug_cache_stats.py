"""``debug._get_fast_path_sharding_prop_cache_stats()``: dispatch's decision-cache (hits, misses).

On 2 rank processes, the same short sequence of ops (simple decisions, a decision that moves an
input, a call with kwargs read by the nested reader) is counted exactly, and the clear functions
reset the counts.  Ranks are processes: rank threads share a process's counters.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.testing import run_on_ranks


def _count_a_sequence() -> dict[str, Any]:
    from shardwise.dtensor_ops import DTensor, Replicate, Shard
    from shardwise.dtensor_ops.debug import (
        _clear_fast_path_sharding_prop_cache,
        _clear_python_sharding_prop_cache,
        _clear_sharding_prop_cache,
        _get_fast_path_sharding_prop_cache_stats as stats,
    )
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    rows = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])
    whole = DTensor.from_local(torch.ones(4, 4), mesh, [Replicate()])
    seen: dict[str, Any] = {}
    _clear_sharding_prop_cache()
    seen["start"] = stats()
    for _ in range(3):
        rows + rows  # a simple decision: one miss, then hits
    seen["simple"] = stats()
    for _ in range(2):
        rows + whole  # the replicated input is cut to rows first
    seen["moving"] = stats()
    for _ in range(2):
        torch.add(rows, rows, alpha=2)  # kwargs: read by the nested reader
    seen["kwargs"] = stats()
    _clear_python_sharding_prop_cache()  # drops the decisions, keeps the fast path's counts
    rows + rows
    seen["after_python_clear"] = stats()
    _clear_fast_path_sharding_prop_cache()
    seen["after_fast_path_clear"] = stats()
    rows + rows
    rows + rows
    seen["counting_again"] = stats()
    _clear_sharding_prop_cache()
    seen["after_clear_all"] = stats()
    return seen


def test_hits_and_misses_are_counted_exactly_and_reset_by_the_clear_functions() -> None:
    for seen in run_on_ranks(_count_a_sequence, world_size=2):
        assert seen["start"] == (0, 0)
        assert seen["simple"] == (2, 1)
        assert seen["moving"] == (3, 2)
        assert seen["kwargs"] == (4, 3)
        assert seen["after_python_clear"] == (4, 4)
        assert seen["after_fast_path_clear"] == (0, 0)
        assert seen["counting_again"] == (1, 1)
        assert seen["after_clear_all"] == (0, 0)

