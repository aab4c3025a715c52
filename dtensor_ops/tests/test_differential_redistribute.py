"""Differential test of redistribution: shardwise against plain torch and PyTorch's DTensor, every rank simulated.

Hypothesis draws a mesh (1-D to 3-D, 1 to 8 ranks), a dtype, a global shape (empty, one, prime, fewer and
more elements than ranks), a source and a target layout (Shard with negative dims, _StridedShard,
Replicate, Partial with each reduce op its dtype defines) and the data; ``differential_helpers`` says
what is compared. The run is bounded in seconds (``SHARDWISE_DIFFERENTIAL_SECONDS`` for a longer one).
Failures it found are the named regression tests in ``test_differential_regressions.py``.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from differential_helpers import (
    RedistributeCase,
    check_redistribute_case,
    redistribute_cases,
    run_for_budget,
    simulated_world,
)
from hypothesis import given

CI_SECONDS = 16.0


def test_redistribute_matches_plain_torch_and_pytorch_dtensor() -> None:
    outcomes: Counter[str] = Counter()
    with simulated_world() as world:

        def make_property(out_of_time: Callable[[], bool]) -> Callable[..., None]:
            @given(redistribute_cases())
            def redistribute_matches(case: RedistributeCase) -> None:
                if out_of_time():
                    return
                outcomes[check_redistribute_case(world, case)] += 1

            return redistribute_matches

        run_for_budget(make_property, CI_SECONDS)
    # The cases must mostly run, not be refused: a drawing that only finds refusals tests nothing.
    assert outcomes["ok"] > sum(outcomes.values()) // 3, dict(outcomes)
