"""Report of the OpInfo sweep: PyTorch's op_db samples on shardwise's DTensor (and PyTorch's).

    python -m shardwise.tools.opinfo_sweep [--torch] [--json out.json] [--ops PATTERN[,PATTERN...]]
                                           [--samples-per-op N] [--shardings-per-sample N]
                                           [--backward] [--mesh 4 | 2x2]

``--backward``: every call also back-propagates a fixed weighting of its outputs and compares the
gradient of every input with plain torch's (samples drawn with ``requires_grad``; an op plain torch
gives no gradient for on any sample is left out as "not differentiable"); the closing lines then
run the same selection forward and say how many of the forward-passing ops that plain torch can
differentiate pass backward (the headline), how many of all forward-passing ops (strict), and name
the differentiable ones that fail or were not tried. ``--mesh 2x2``: a 2-D mesh of the
4 rank threads, with nested shardings (both mesh dims on one tensor dim) and mixed ones.

Plans the sweep once (``shardwise.testing._opinfo_sweep``: float32 CPU samples, the first few a
``DTensorConverter`` can convert, a few of its shardings each, on a 1-D mesh of 4 rank threads),
runs it on shardwise's DTensor and, with ``--torch``, on PyTorch's DTensor with exactly the same
calls, then prints per backend the count of ops per outcome (pass / wrong / no_rule / error /
skipped), the ops of each outcome, the first failure of every wrong / error op, the aten ops most
often missing a sharding rule, and "N ops passing out of M tried" (tried = pass + wrong + no_rule
+ error). ``--ops`` takes ``fnmatch`` patterns on the op key (``name`` or ``name.variant``),
e.g. ``--ops 'nn.functional.*,add'``. ``--json`` writes everything, per op, to a file.

Exit status: 0 when the sweep ran (whatever it found), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import textwrap
import time
from typing import Any

from shardwise.testing._opinfo_sweep import (
    NOT_DIFFERENTIABLE_PREFIX,
    OUTCOMES,
    TRIED_OUTCOMES,
    ShardwiseBackend,
    SweepBackend,
    SweepConfig,
    SweepPlan,
    SweepReport,
    plan_sweep,
    run_sweep,
)

_WIDTH = 110


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m shardwise.tools.opinfo_sweep", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--torch", action="store_true", help="also run the sweep on PyTorch's DTensor (comparison)")
    parser.add_argument("--json", metavar="PATH", help="write the full per-op results as JSON")
    parser.add_argument("--ops", metavar="PATTERNS", default="", help="comma-separated fnmatch patterns on op keys")
    defaults = SweepConfig()
    parser.add_argument("--samples-per-op", type=int, default=defaults.samples_per_op)
    parser.add_argument("--shardings-per-sample", type=int, default=defaults.shardings_per_sample)
    parser.add_argument("--backward", action="store_true", help="compare input gradients too (backward mode)")
    parser.add_argument("--mesh", default="4", help="mesh shape: 4 (1-D, default) or 2x2 (2-D)")
    return parser.parse_args(argv)


def _wrapped(items: list[str], indent: str = "    ") -> str:
    if not items:
        return f"{indent}(none)"
    return textwrap.fill(", ".join(items), width=_WIDTH, initial_indent=indent, subsequent_indent=indent)


def format_plan(plan: SweepPlan) -> str:
    config = plan.config
    sharded_ops = sum(
        1 for op in plan.ops if any(any(p.is_shard() for per in placements for p in per) for _, placements in op.calls())
    )
    lines = [
        f"plan: {len(plan.ops)} ops, {plan.num_calls} calls ({sharded_ops} ops with at least one sharded tensor), "
        f"{len(plan.excluded)} left out; planned in {plan.planning_s:.1f} s "
        f"({plan.planning_cpu_s:.1f} s CPU)",
        f"caps: world of {config.world_size} rank threads, mesh {'x'.join(map(str, config.mesh_shape))}"
        f"{', backward mode' if config.backward else ''}; float32 CPU samples; up to "
        f"{config.samples_per_op} samples per op (from the first {config.candidate_samples}), up to "
        f"{config.shardings_per_sample} shardings per sample",
    ]
    if plan.excluded:
        lines.append("left out (not tried):")
        lines += [f"    {key}: {reason}" for key, reason in sorted(plan.excluded.items())]
    return "\n".join(lines)


def format_report(report: SweepReport) -> str:
    lines = [
        f"== {report.backend} ==",
        report.summary_line(),
        f"ran in {report.running_s:.1f} s, {report.running_cpu_s:.1f} s CPU ({report.worlds} thread worlds)",
    ]
    for outcome in OUTCOMES:
        keys = report.ops_with(outcome)
        lines.append(f"{outcome} ({len(keys)}):")
        if outcome in ("wrong", "error", "skipped"):
            lines += [f"    {key}: {report.results[key].first_failure}" for key in keys] or ["    (none)"]
        elif outcome == "no_rule":
            lines += [f"    {key}: {', '.join(report.results[key].missing_rules)}" for key in keys] or ["    (none)"]
        else:
            lines.append(_wrapped(keys))
    missing = report.missing_rule_counts()
    if missing:
        lines.append("aten ops most often missing a rule (ops that need them):")
        lines.append(_wrapped([f"{op} ({count})" for op, count in list(missing.items())[:40]]))
    return "\n".join(lines)


def format_comparison(ours: SweepReport, theirs: SweepReport) -> str:
    ours_pass = set(ours.ops_with("pass"))
    theirs_pass = set(theirs.ops_with("pass"))
    only_theirs = sorted(theirs_pass - ours_pass)
    only_ours = sorted(ours_pass - theirs_pass)
    return "\n".join(
        [
            "== comparison (same calls) ==",
            f"passing only on {theirs.backend} ({len(only_theirs)}):",
            _wrapped([f"{key} [{ours.results[key].outcome}]" for key in only_theirs]),
            f"passing only on {ours.backend} ({len(only_ours)}):",
            _wrapped([f"{key} [{theirs.results[key].outcome}]" for key in only_ours]),
        ]
    )


def format_backward_coverage(backward: SweepReport, forward: SweepReport) -> str:
    """How many of the ops passing forward pass backward: the headline counts only those plain torch can
    differentiate (on the backward samples); the strict share counts every forward-passing op."""
    forward_pass = set(forward.ops_with("pass"))
    backward_pass = set(backward.ops_with("pass")) & forward_pass
    not_differentiable = {
        key for key, reason in backward.excluded.items() if reason.startswith(NOT_DIFFERENTIABLE_PREFIX)
    } & forward_pass
    differentiable = forward_pass - not_differentiable
    # Forward-passing ops that plain torch can differentiate but backward mode did not try (random samples
    # only, no convertible sample...): shown by name so that a gap in the sweep itself cannot hide.
    untried = sorted(
        key
        for key in differentiable
        if key not in backward.results or backward.results[key].outcome not in TRIED_OUTCOMES
    )
    failing = sorted(differentiable - backward_pass - set(untried))
    share = 100.0 * len(backward_pass) / max(len(differentiable), 1)
    strict = 100.0 * len(backward_pass) / max(len(forward_pass), 1)
    lines = [
        f"{backward.backend}: backward passes for {len(backward_pass)} of the {len(differentiable)} ops passing "
        f"forward that plain torch can differentiate ({share:.1f} %)",
        f"{backward.backend}: strictly, {len(backward_pass)} of all {len(forward_pass)} ops passing forward "
        f"({strict:.1f} %); {len(not_differentiable)} of them are not differentiable in plain torch (integer or "
        "bool outputs, no derivative formula, constant outputs)",
        f"forward-passing, differentiable, failing backward ({len(failing)}):",
        _wrapped([f"{key} [{backward.results[key].outcome}]" for key in failing]),
        f"forward-passing, differentiable, not tried backward ({len(untried)}):",
    ]
    lines += [
        f"    {key}: {backward.excluded.get(key) or _first_failure(backward, key)}" for key in untried
    ] or ["    (none)"]
    lines.append(f"forward-passing, not differentiable in plain torch ({len(not_differentiable)}):")
    lines.append(_wrapped(sorted(not_differentiable)))
    return "\n".join(lines)


def _first_failure(report: SweepReport, key: str) -> str:
    result = report.results.get(key)
    return result.first_failure if result is not None else "(not planned)"


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    patterns = tuple(pattern.strip() for pattern in args.ops.split(",") if pattern.strip())
    try:
        mesh_shape = tuple(int(size) for size in args.mesh.lower().split("x"))
        config = SweepConfig(
            samples_per_op=args.samples_per_op,
            shardings_per_sample=args.shardings_per_sample,
            op_patterns=patterns,
            mesh_shape=mesh_shape,
            world_size=math.prod(mesh_shape),
            backward=args.backward,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    started, started_cpu = time.perf_counter(), time.process_time()
    plan = plan_sweep(config)
    if not plan.ops:
        print(f"error: no op of op_db matches {list(patterns)}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    backends: list[SweepBackend] = [ShardwiseBackend()]
    if args.torch:
        from shardwise.tools.bench_opinfo_pytorch import PyTorchBackend

        backends.append(PyTorchBackend())
    reports = [run_sweep(backend, plan, progress=_progress) for backend in backends]
    for report in reports:
        print()
        print(format_report(report))
    if len(reports) == 2:
        print()
        print(format_comparison(reports[0], reports[1]))
    print()
    for report in reports:
        print(f"{report.backend}: {report.passing} ops passing out of {report.tried} tried")
    forward_reports: dict[str, SweepReport] = {}
    if args.backward:
        forward_plan = plan_sweep(dataclasses.replace(config, backward=False))
        for backend, report in zip(backends, reports):
            forward = run_sweep(backend, forward_plan, progress=_progress)
            forward_reports[report.backend] = forward
            print(format_backward_coverage(report, forward))
    print(f"total {time.perf_counter() - started:.1f} s, {time.process_time() - started_cpu:.1f} s CPU")
    if args.json:
        document: dict[str, Any] = {
            "plan": {
                "ops": len(plan.ops),
                "calls": plan.num_calls,
                "planning_s": round(plan.planning_s, 2),
                "excluded": dict(sorted(plan.excluded.items())),
            },
            "backends": {report.backend: report.to_json() for report in reports},
        }
        if forward_reports:
            document["forward_of_backward_run"] = {name: report.to_json() for name, report in forward_reports.items()}
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(document, out, indent=1, sort_keys=False)
            out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
