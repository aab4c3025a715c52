"""``debug._get_fast_path_sharding_prop_cache_stats()``: dispatch's decision-cache (hits, misses).

On 2 rank processes, the same short sequence of ops (simple decisions the C++ fast path serves,
a decision that moves an input, a call with kwargs that takes the general path) is counted exactly
with the C++ fast path on and with the Python path alone, and the clear functions reset the counts.
Ranks are processes: rank threads share a process's counters and bypass the C++ hit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise.dtensor_ops._fastpath import extension
from shardwise.testing import run_on_ranks

_PATHS = ["python", pytest.param("cpp", marks=pytest.mark.skipif(extension() is None, reason="_fastpath_ext is not built"))]


def _count_a_sequence(path: str) -> dict[str, Any]:
    import shardwise.dtensor_ops._dispatch as dispatch
    from shardwise.dtensor_ops import DTensor, Replicate, Shard
    from shardwise.dtensor_ops._fastpath import cpp_hit_count, fast_hit
    from shardwise.dtensor_ops.debug import (
        _clear_fast_path_sharding_prop_cache,
        _clear_python_sharding_prop_cache,
        _clear_sharding_prop_cache,
        _get_fast_path_sharding_prop_cache_stats as stats,
    )
    from shardwise.mesh import init_device_mesh

    # What SHARDWISE_DISPATCH_FASTPATH selects at import, chosen here per test.
    saved_hit = dispatch._cpp_hit
    dispatch._cpp_hit = fast_hit(DTensor) if path == "cpp" else None
    try:
        mesh = init_device_mesh("cpu", (2,))
        rows = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])
        whole = DTensor.from_local(torch.ones(4, 4), mesh, [Replicate()])
        seen: dict[str, Any] = {}
        _clear_sharding_prop_cache()
        seen["start"] = stats()
        for _ in range(3):
            rows + rows  # a simple decision: one miss, then hits (served by C++ where it runs)
        seen["simple"] = stats()
        for _ in range(2):
            rows + whole  # the replicated input is cut to rows first: never a C++ hit
        seen["moving"] = stats()
        for _ in range(2):
            torch.add(rows, rows, alpha=2)  # kwargs: the general path
        seen["kwargs"] = stats()
        seen["cpp_hits"] = cpp_hit_count()
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
    finally:
        dispatch._cpp_hit = saved_hit


@pytest.mark.parametrize("path", _PATHS)
def test_hits_and_misses_are_counted_exactly_and_reset_by_the_clear_functions(path: str) -> None:
    for seen in run_on_ranks(_count_a_sequence, path, world_size=2):
        assert seen["start"] == (0, 0)
        assert seen["simple"] == (2, 1)
        assert seen["moving"] == (3, 2)
        assert seen["kwargs"] == (4, 3)
        # The C++ path served exactly the two repeated simple adds; the Python path served none.
        assert seen["cpp_hits"] == (2 if path == "cpp" else 0)
        assert seen["after_python_clear"] == (4, 4)
        assert seen["after_fast_path_clear"] == (0, 0)
        assert seen["counting_again"] == (1, 1)
        assert seen["after_clear_all"] == (0, 0)

