"""The parity check: the tensor-parallel run against the same training in one process without DTensor."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import torch

__all__ = ["ParityResult", "compare_runs"]


@dataclass
class ParityResult:
    passed: bool
    max_abs_loss_diff: float
    max_abs_param_diff: float
    worst_parameter: str  # the parameter with the largest absolute difference
    rtol: float
    atol: float
    problems: list[str] = field(default_factory=list)  # why it failed, one line each

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def as_dict(self) -> dict[str, Any]:
        result = asdict(self)
        result["verdict"] = self.verdict
        return result


def _excess(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """How far each element is outside ``|a - e| <= atol + rtol * |e|`` (<= 0 inside)."""
    return (actual - expected).abs() - (atol + rtol * expected.abs())


def compare_runs(
    tp_losses: Sequence[float],
    reference_losses: Sequence[float],
    tp_parameters: Mapping[str, torch.Tensor],
    reference_parameters: Mapping[str, torch.Tensor],
    *,
    rtol: float,
    atol: float,
) -> ParityResult:
    """Losses step by step and final parameters by name, each within ``atol + rtol * |reference|``."""
    problems: list[str] = []
    if len(tp_losses) != len(reference_losses):
        problems.append(f"the runs have {len(tp_losses)} and {len(reference_losses)} losses")
    tp_loss = torch.tensor(list(tp_losses)[: len(reference_losses)], dtype=torch.float64)
    reference_loss = torch.tensor(list(reference_losses)[: len(tp_losses)], dtype=torch.float64)
    loss_diff = (tp_loss - reference_loss).abs()
    max_abs_loss_diff = float(loss_diff.max()) if loss_diff.numel() else 0.0
    if not all(math.isfinite(value) for value in tp_losses):
        problems.append("the tensor-parallel run has non-finite losses")
    if loss_diff.numel():
        outside = _excess(tp_loss, reference_loss, rtol, atol) > 0
        if bool(outside.any()):
            first = int(outside.nonzero()[0, 0])
            problems.append(
                f"loss differs at step {first + 1}: {float(tp_loss[first]):.8g} (tensor parallel) vs "
                f"{float(reference_loss[first]):.8g} (single process)"
            )

    missing = sorted(set(reference_parameters) - set(tp_parameters))
    extra = sorted(set(tp_parameters) - set(reference_parameters))
    if missing:
        problems.append(f"parameters missing from the tensor-parallel model: {', '.join(missing)}")
    if extra:
        problems.append(f"parameters only in the tensor-parallel model: {', '.join(extra)}")
    max_abs_param_diff = 0.0
    worst_parameter = ""
    for name in sorted(set(reference_parameters) & set(tp_parameters)):
        actual = tp_parameters[name].detach().to("cpu", torch.float64)
        expected = reference_parameters[name].detach().to("cpu", torch.float64)
        if actual.shape != expected.shape:
            problems.append(
                f"{name}: shape {tuple(actual.shape)} (tensor parallel) vs {tuple(expected.shape)} (single process)"
            )
            continue
        diff = float((actual - expected).abs().max()) if actual.numel() else 0.0
        if not math.isfinite(diff):
            problems.append(f"{name}: non-finite values")
            diff = math.inf
        if diff > max_abs_param_diff or not worst_parameter:
            max_abs_param_diff, worst_parameter = diff, name
        if actual.numel() and bool((_excess(actual, expected, rtol, atol) > 0).any()):
            problems.append(f"{name}: max abs diff {diff:.3g} exceeds atol {atol:g} + rtol {rtol:g} x |reference|")
    return ParityResult(
        passed=not problems,
        max_abs_loss_diff=max_abs_loss_diff,
        max_abs_param_diff=max_abs_param_diff,
        worst_parameter=worst_parameter,
        rtol=rtol,
        atol=atol,
        problems=problems,
    )
