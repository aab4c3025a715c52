"""PyTorch's op_db OpInfo samples on shardwise's DTensor (rank threads, 1-D mesh of 4).

The sweep logic is ``shardwise.testing._opinfo_sweep``; ``python -m shardwise.tools.opinfo_sweep
[--torch]`` prints the full report. Here:

- the sweep machinery itself, on a few made-up ops whose outcome is known (pass, wrong result,
  no rule, error, ranks that diverge, skipped, random), so that the guard below cannot pass by
  failing to notice things;
- the guard: the whole op_db sweep may show no wrong result beyond the named exceptions of
  ``opinfo_sweep_helpers.KNOWN_WRONG_RESULTS``, must try at least ``MIN_OPS_TRIED`` ops, and must
  keep at least ``PASSING_OPS_FLOOR`` of them passing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from opinfo_sweep_helpers import KNOWN_WRONG_RESULTS, MIN_OPS_TRIED, PASSING_OPS_FLOOR
from shardwise.dtensor_ops import DTensor, Placement, Replicate, Shard
from shardwise.testing._opinfo_sweep import (
    NOT_DIFFERENTIABLE_PREFIX,
    ShardwiseBackend,
    SweepConfig,
    SweepReport,
    _pick_combinations,
    plan_sweep,
    run_sweep,
)

_STALL_TIMEOUT_S = 3.0

# An op shardwise has no rule for, whatever rules the op families add.
_probe_library = torch.library.Library("opinfo_sweep_probe", "DEF")
_probe_library.define("twice(Tensor x) -> Tensor")
_probe_library.impl("twice", lambda x: x * 2, "CPU")


@dataclasses.dataclass
class _Sample:
    input: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _MadeUpOpInfo:
    """The part of an OpInfo the sweep reads."""

    name: str
    op: Callable[..., Any]
    samples: list[_Sample]
    variant_test_name: str = ""

    def supported_dtypes(self, device_type: str) -> set[torch.dtype]:
        return {torch.float32}

    def sample_inputs(self, device: str, dtype: torch.dtype, requires_grad: bool = False) -> Iterator[_Sample]:
        return iter(self.samples)


def _sum_of_local_shard_only(x: torch.Tensor) -> torch.Tensor:
    # The classic sharding bug: reduce the local shard and call it the global (replicated) result.
    if isinstance(x, DTensor):
        return DTensor.from_local(x.to_local().sum(), x.device_mesh, [Replicate()])
    return x.sum()


def _rejects_dtensors(x: torch.Tensor) -> torch.Tensor:
    if isinstance(x, DTensor):
        raise ValueError("made-up failure on DTensors")
    return x + 1


def _collective_skipped_by_rank_3(x: torch.Tensor) -> torch.Tensor:
    if isinstance(x, DTensor):
        if dist.get_rank() == 3:
            raise RuntimeError("rank 3 gives up before the all_reduce the others wait in")
        dist.all_reduce(torch.ones(1))
    return x * 3


def _every_rank_stalls(x: torch.Tensor) -> torch.Tensor:
    # Nobody reaches the per-call barrier in time: only the stall watchdog ends this.
    if isinstance(x, DTensor):
        if dist.get_rank() == 3:
            time.sleep(_STALL_TIMEOUT_S + 2.0)
        else:
            dist.all_reduce(torch.ones(1))
    return x * 4


def _local_tensor_out(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() * 1 if isinstance(x, DTensor) else x * 1


def _made_up_ops() -> list[_MadeUpOpInfo]:
    vector = torch.arange(8, dtype=torch.float32)
    matrix = torch.arange(30, dtype=torch.float32).reshape(5, 6)
    return [
        _MadeUpOpInfo("add", torch.add, [_Sample(matrix, (matrix.flip(0),)), _Sample(vector, (2.5,))]),
        _MadeUpOpInfo("local_sum", _sum_of_local_shard_only, [_Sample(vector), _Sample(matrix)]),
        _MadeUpOpInfo("probe_twice", torch.ops.opinfo_sweep_probe.twice, [_Sample(matrix)]),
        _MadeUpOpInfo("rejects", _rejects_dtensors, [_Sample(vector)]),
        _MadeUpOpInfo("diverges", _collective_skipped_by_rank_3, [_Sample(vector)]),
        _MadeUpOpInfo("stalls", _every_rank_stalls, [_Sample(vector)]),
        _MadeUpOpInfo("plain_out", _local_tensor_out, [_Sample(vector)]),
        _MadeUpOpInfo("after_divergence", torch.neg, [_Sample(matrix)]),
        _MadeUpOpInfo("no_tensors", lambda data: torch.tensor(data), [_Sample([1.0, 2.0])]),
        _MadeUpOpInfo("coin", torch.bernoulli, [_Sample(torch.full((8,), 0.5))]),
        _MadeUpOpInfo("reference_fails", torch.mm, [_Sample(matrix, (matrix,))]),
    ]


@pytest.fixture(scope="module")
def made_up_report() -> SweepReport:
    config = SweepConfig(
        samples_per_op=2,
        shardings_per_sample=3,
        divergence_timeout_s=2.0,
        stall_timeout_s=_STALL_TIMEOUT_S,
        world_timeout_s=120.0,
    )
    return run_sweep(ShardwiseBackend(), plan_sweep(config, _made_up_ops()))


def test_made_up_ops_get_their_outcomes(made_up_report: SweepReport) -> None:
    outcomes = {key: result.outcome for key, result in made_up_report.results.items()}
    assert outcomes == {
        "add": "pass",
        "local_sum": "wrong",
        "probe_twice": "no_rule",
        "rejects": "error",
        "diverges": "error",
        "stalls": "error",
        "plain_out": "error",
        "after_divergence": "pass",
        "no_tensors": "skipped",
        "reference_fails": "skipped",
    }
    assert made_up_report.tried == 8 and made_up_report.passing == 2


def test_failures_say_what_and_where(made_up_report: SweepReport) -> None:
    results = made_up_report.results
    wrong = results["local_sum"].first_failure
    # Every replicated call is right; the first sharded one is not, and the message says so.
    assert "Shard(dim=0)" in wrong or "S(0)" in wrong, wrong
    assert "not close" in wrong or "differ" in wrong, wrong
    assert results["local_sum"].calls_passed >= 1
    assert results["probe_twice"].missing_rules == ["opinfo_sweep_probe.twice.default"]
    assert "made-up failure on DTensors" in results["rejects"].first_failure
    assert "plain torch.Tensor" in results["plain_out"].first_failure
    assert "reference_fails" not in made_up_report.excluded
    assert "plain torch rejects" in results["reference_fails"].first_failure
    assert "no tensor argument" in results["no_tensors"].first_failure


def test_ranks_that_diverge_are_reported_and_the_sweep_goes_on(made_up_report: SweepReport) -> None:
    diverged = made_up_report.results["diverges"]
    assert "ranks disagreed" in diverged.first_failure, diverged.first_failure
    assert "rank 3" in diverged.first_failure
    stalled = made_up_report.results["stalls"]
    assert "no rank finished the call within" in stalled.first_failure, stalled.first_failure
    # Each of them tore its world down; the ops after them still ran.
    assert made_up_report.worlds == 3
    assert made_up_report.results["after_divergence"].calls_passed == made_up_report.results["after_divergence"].calls_run > 0


def test_random_ops_are_left_out_with_the_reason(made_up_report: SweepReport) -> None:
    assert "coin" not in made_up_report.results
    assert "aten.bernoulli.default" in made_up_report.excluded["coin"]


class _TripleInBackward(torch.autograd.Function):
    """x * 2 whose backward is wrong (x 3) on DTensors only: the classic sharded-gradient bug."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.on_dtensor = isinstance(x, DTensor)
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * (3.0 if ctx.on_dtensor else 2.0)


def _backward_made_up_ops() -> list[_MadeUpOpInfo]:
    matrix = torch.arange(30, dtype=torch.float32).reshape(5, 6) / 7.0
    return [
        _MadeUpOpInfo("mul", torch.mul, [_Sample(matrix, (matrix.flip(0),))]),
        _MadeUpOpInfo("wrong_grad", _TripleInBackward.apply, [_Sample(matrix)]),
        _MadeUpOpInfo("argmax", torch.argmax, [_Sample(matrix, (1,))]),
        _MadeUpOpInfo("heaviside", torch.heaviside, [_Sample(matrix - 2.0, (matrix,))]),
    ]


def test_backward_mode_compares_gradients_and_leaves_out_what_torch_cannot_differentiate() -> None:
    config = SweepConfig(samples_per_op=1, shardings_per_sample=3, backward=True, world_timeout_s=120.0)
    opinfos = [
        dataclasses.replace(op, samples=[_Sample(s.input.requires_grad_(True), s.args) for s in op.samples])
        for op in _backward_made_up_ops()
    ]
    plan = plan_sweep(config, opinfos)
    assert plan.excluded["argmax"].startswith(NOT_DIFFERENTIABLE_PREFIX), plan.excluded
    assert "no float output requires grad" in plan.excluded["argmax"]
    assert plan.excluded["heaviside"].startswith(NOT_DIFFERENTIABLE_PREFIX)
    assert "torch has no derivative" in plan.excluded["heaviside"]
    report = run_sweep(ShardwiseBackend(), plan)
    outcomes = {key: result.outcome for key, result in report.results.items()}
    assert outcomes == {"mul": "pass", "wrong_grad": "wrong"}
    # The forward values agree; only a sharded gradient is off, and the message says it is output 1 (the grads).
    assert "output 1" in report.results["wrong_grad"].first_failure, report.results["wrong_grad"].first_failure


def test_shardings_are_spread_over_the_product() -> None:
    first: list[tuple[Placement, ...]] = [(Replicate(),), (Shard(0),), (Shard(1),)]
    second: list[tuple[Placement, ...]] = [(Replicate(),), (Shard(0),), (Shard(1),)]
    picked = _pick_combinations([first, second], 4)
    assert len(set(picked)) == 4
    assert picked[0] == ((Replicate(),), (Replicate(),))
    assert picked[-1] == ((Shard(1),), (Shard(1),))
    assert _pick_combinations([first, second], 9) == _pick_combinations([first, second], 20)
    assert len(_pick_combinations([first] * 12, 4)) == 4  # 3**12 combinations, never listed


def test_op_db_sweep() -> None:
    report = run_sweep(ShardwiseBackend(), plan_sweep(SweepConfig()))
    print(report.summary_line())
    assert report.tried >= MIN_OPS_TRIED, (
        f"the sweep tried only {report.tried} ops (expected at least {MIN_OPS_TRIED}): {report.summary_line()}"
    )
    wrong = report.ops_with("wrong")
    unexplained = [key for key in wrong if key not in KNOWN_WRONG_RESULTS]
    assert not unexplained, "wrong results (bugs: fix them, or name them in KNOWN_WRONG_RESULTS):\n" + "\n".join(
        f"  {key}: {report.results[key].first_failure}" for key in unexplained
    )
    no_longer_wrong = {
        key: report.results[key].outcome if key in report.results else "not swept"
        for key in KNOWN_WRONG_RESULTS
        if key not in wrong
    }
    assert not no_longer_wrong, f"remove these from KNOWN_WRONG_RESULTS, they no longer give wrong results: {no_longer_wrong}"
    assert report.passing >= PASSING_OPS_FLOOR, (
        f"{report.passing} ops pass, fewer than the floor of {PASSING_OPS_FLOOR} in opinfo_sweep_helpers.py "
        f"(a rule regressed?): {report.summary_line()}"
    )
