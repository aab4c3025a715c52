"""The guard of the OpInfo sweep's backward mode: op_db samples on shardwise's DTensor, input gradients
compared with plain torch's (rank threads, 1-D mesh of 4).

A lighter plan than ``python -m shardwise.tools.opinfo_sweep --backward`` (fewer samples and shardings
per op, so that this target stays within a couple of minutes), the same ops: no wrong gradient beyond
``KNOWN_WRONG_RESULTS``, at least ``BACKWARD_PASSING_OPS_FLOOR`` ops passing, and the ops plain torch
cannot differentiate left out with the not-differentiable reason (never counted as tried).
"""

from __future__ import annotations

from opinfo_sweep_helpers import (
    BACKWARD_PASSING_OPS_FLOOR,
    BACKWARD_SAMPLES_PER_OP,
    BACKWARD_SHARDINGS_PER_SAMPLE,
    KNOWN_WRONG_RESULTS,
)
from shardwise.testing._opinfo_sweep import NOT_DIFFERENTIABLE_PREFIX, ShardwiseBackend, SweepConfig, plan_sweep, run_sweep


def test_op_db_backward_sweep() -> None:
    config = SweepConfig(
        backward=True,
        samples_per_op=BACKWARD_SAMPLES_PER_OP,
        shardings_per_sample=BACKWARD_SHARDINGS_PER_SAMPLE,
    )
    plan = plan_sweep(config)
    report = run_sweep(ShardwiseBackend(), plan)
    print(report.summary_line())
    not_differentiable = [key for key, why in plan.excluded.items() if why.startswith(NOT_DIFFERENTIABLE_PREFIX)]
    # Comparisons, integer outputs and ops torch has no derivative for: measured, not read from OpInfo's flags.
    for key in ("eq", "argmax", "nonzero", "heaviside"):
        assert key in not_differentiable, (key, plan.excluded.get(key), report.results.get(key))
    assert not set(not_differentiable) & set(report.results)
    wrong = [key for key in report.ops_with("wrong") if key not in KNOWN_WRONG_RESULTS]
    assert not wrong, "wrong gradients (bugs):\n" + "\n".join(
        f"  {key}: {report.results[key].first_failure}" for key in wrong
    )
    assert report.passing >= BACKWARD_PASSING_OPS_FLOOR, (
        f"{report.passing} ops pass backward, fewer than the floor of {BACKWARD_PASSING_OPS_FLOOR} in "
        f"opinfo_sweep_helpers.py (a backward rule regressed?): {report.summary_line()}"
    )
