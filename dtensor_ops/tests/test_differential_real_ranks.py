"""The redistribution differential test on 4 gloo rank processes (a smaller set than the simulated one).

Hypothesis draws a batch of cases per example (meshes of 4 ranks: 1-D, 2-D, 3-D; every dtype, shape and
layout of ``differential_helpers.redistribute_cases``), each rank runs the batch and reports per case
"ok", a refusal, or what was wrong; a failing batch shrinks to its failing case. Checked: the result's
placements, dtype, shape, ``full_tensor()`` (plain torch's reduction of the contributions) and each
rank's ``to_local()`` (the reference piece) on every rank; and that a refusal is a clear error raised on
every rank alike, before any collective (``CommDebugMode`` counts none). Bounded in seconds like the
others (``SHARDWISE_DIFFERENTIAL_SECONDS``).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
import torch.distributed as dist
from differential_helpers import (
    REFUSAL_TYPES,
    RedistributeCase,
    assert_same_tensor,
    contiguous_strides,
    divmod_all,
    make_layout,
    normalized,
    redistribute_cases,
    reference_piece,
    run_for_budget,
)
from hypothesis import given
from hypothesis import strategies as st

from shardwise.dtensor_ops import DTensor, Partial, init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import DeviceMesh
from shardwise.testing import run_on_ranks

WORLD_SIZE = 4
CI_SECONDS = 6.0
MESH_SHAPES_OF_4: tuple[tuple[int, ...], ...] = ((4,), (2, 2), (1, 4), (4, 1), (2, 1, 2), (1, 2, 2))
CASES_PER_CALL = 4


def _check_on_rank(case: RedistributeCase, mesh: DeviceMesh, rank: int) -> str:
    """Run ``case`` on this rank: "ok", "refused: <type> after <n> collectives: <message>", or "wrong: ..."."""
    layout = make_layout(case.mesh_shape, case.src, case.shape, case.dtype, case.seed)
    coordinate = divmod_all(rank, case.mesh_shape)
    partial_dims = [index for index, p in enumerate(case.src) if isinstance(p, Partial)]
    contribution = layout.contributions[tuple(coordinate[d] for d in partial_dims)]
    local = reference_piece(contribution, case.src, coordinate, case.mesh_shape)
    source = DTensor.from_local(local, mesh, list(case.src), shape=torch.Size(case.shape), stride=contiguous_strides(case.shape))
    with CommDebugMode() as comm:
        try:
            result = source.redistribute(mesh, list(case.dst))
            whole = result.full_tensor()
        except REFUSAL_TYPES as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            return f"refused: {type(error).__name__} after {comm.get_total_counts()} collectives: {first_line}"
    try:
        expected_placements = normalized(case.dst, len(case.shape))
        assert tuple(result.placements) == expected_placements, f"placements {tuple(result.placements)}, expected {expected_placements}"
        assert result.dtype == case.dtype and tuple(result.shape) == case.shape, f"{result.dtype} {tuple(result.shape)}"
        assert_same_tensor(whole, layout.full, "full_tensor()")
        if not any(isinstance(p, Partial) for p in case.dst):
            assert_same_tensor(result.to_local(), reference_piece(layout.full, case.dst, coordinate, case.mesh_shape), "to_local()")
    except AssertionError as wrong:
        return f"wrong: {wrong}"
    return "ok"


def _run_cases_on_rank(cases: list[RedistributeCase]) -> list[str]:
    rank = dist.get_rank()
    meshes: dict[tuple[int, ...], DeviceMesh] = {}
    outcomes = []
    for case in cases:
        if case.mesh_shape not in meshes:
            meshes[case.mesh_shape] = init_device_mesh("cpu", case.mesh_shape)
        outcomes.append(_check_on_rank(case, meshes[case.mesh_shape], rank))
    return outcomes


def check_cases_on_gloo_ranks(cases: list[RedistributeCase]) -> list[str]:
    """Run ``cases`` on 4 gloo ranks; fail on a wrong result, ranks that disagree, or a late or unclear refusal."""
    per_rank = run_on_ranks(_run_cases_on_rank, cases, world_size=WORLD_SIZE, timeout=120)
    summary = []
    for index, case in enumerate(cases):
        outcomes = [rank_outcomes[index] for rank_outcomes in per_rank]
        for rank, outcome in enumerate(outcomes):
            assert not outcome.startswith("wrong"), f"{case}: rank {rank}: {outcome}"
        kinds = {outcome.split(" after ")[0] for outcome in outcomes}  # "ok" or "refused: <error type>"
        assert len(kinds) == 1, f"{case}: the ranks disagree: {outcomes}"
        if outcomes[0].startswith("refused"):
            assert " after 0 collectives: " in outcomes[0], f"{case}: refused after a collective: {outcomes[0]}"
            assert not outcomes[0].endswith(": "), f"{case}: refused without a message: {outcomes[0]}"
        summary.append(outcomes[0].split(" after ")[0])
    return summary


def test_redistribute_on_gloo_ranks_matches_plain_torch() -> None:
    outcomes: Counter[str] = Counter()

    def make_property(out_of_time: Callable[[], bool]) -> Callable[..., None]:
        @given(st.lists(redistribute_cases(MESH_SHAPES_OF_4), min_size=1, max_size=CASES_PER_CALL))
        def redistribute_on_ranks_matches(cases: list[RedistributeCase]) -> None:
            if out_of_time():
                return
            outcomes.update(check_cases_on_gloo_ranks(cases))

        return redistribute_on_ranks_matches

    run_for_budget(make_property, CI_SECONDS, examples_per_batch=3)
    assert outcomes["ok"] > sum(outcomes.values()) // 3, dict(outcomes)
