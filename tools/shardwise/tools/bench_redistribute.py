"""Bytes moved per rank by redistribution: shardwise's planner vs a lower bound vs PyTorch's DTensor.

Run (from the repository root)::

    PYTHONPATH=mesh:placement:dtensor_ops:testing:tools python -m shardwise.tools.bench_redistribute
    ... --shape 63,47          # uneven shards
    ... --partial-targets      # also transitions to Partial (PyTorch refuses them)
    ... --json out.json        # every row as JSON

It starts 4 gloo ranks on this machine.  For every transition on a 1-D mesh of 4 and a
2x2 mesh, each rank redistributes the same tensor twice — with
``shardwise.dtensor_ops``' ``redistribute_local_tensor`` and with PyTorch's
``DTensor.redistribute`` — under a dispatch mode that records every functional
collective with its tensor sizes.  Bytes are what a rank receives with bandwidth-optimal
algorithms (the planner's cost model): all-gather (n-1)*input, reduce-scatter
(n-1)*output, ring all-reduce 2(n-1)*ceil(numel/n), all-to-all what the other members
send.  A row reports the most loaded rank.  Both results are compared with each other.

PyTorch is imported here only to compare against (benchmarks may; product code may not).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta, select_local_shard

__all__ = ["main", "CollectiveBytes", "Row"]

_functional = torch.ops._c10d_functional


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)  # type: ignore[arg-type]  # a GroupName is a str at runtime


def _group_size(group_name: str) -> int:
    return int(_group(group_name).size())


class CollectiveBytes(TorchDispatchMode):
    """Records the collectives run inside it and the bytes this rank receives in each."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[str] = []
        self.received = 0
        self.unknown: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        namespace = func.namespace
        if packet is _functional.all_gather_into_tensor:
            tensor, size = args[0], int(args[1])
            self._add("all_gather", (size - 1) * tensor.numel() * tensor.element_size())
        elif packet is _functional.reduce_scatter_tensor:
            tensor, size = args[0], int(args[2])
            self._add("reduce_scatter", (size - 1) * (tensor.numel() // size) * tensor.element_size())
        elif packet is _functional.all_reduce:
            tensor, size = args[0], _group_size(args[2])
            self._add("all_reduce", 2 * (size - 1) * -(-tensor.numel() // size) * tensor.element_size())
        elif packet is _functional.all_to_all_single:
            tensor, output_splits, input_splits, group_name = args[0], args[1], args[2], args[3]
            size = _group_size(group_name)
            # One dim-0 row's bytes, from the shape: a rank that sends nothing passes an empty tensor.
            row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size() if tensor.dim() else 0
            if output_splits:
                own = dist.get_group_rank(_group(group_name), dist.get_rank())
                received_rows = sum(int(s) for i, s in enumerate(output_splits) if i != own)
            else:
                received_rows = tensor.size(0) - tensor.size(0) // size
            self._add("all_to_all", received_rows * row_bytes)
        elif packet in (_functional.wait_tensor, _functional._wrap_tensor_autograd):
            pass  # no communication: waiting for one, or PyTorch tagging a result for autograd
        elif namespace in ("_c10d_functional", "c10d", "c10d_functional", "_c10d_functional_autograd"):
            self.unknown.append(str(func))
        return func(*args, **kwargs)

    def _add(self, name: str, received: int) -> None:
        self.collectives.append(name)
        self.received += received


@dataclass
class Row:
    mesh: str
    src: str
    dst: str
    shape: str
    ours_bytes: int
    ours_model_bytes: int
    lower_bound_bytes: int
    torch_bytes: int | None
    ours_collectives: str
    torch_collectives: str
    ours_ms: float
    torch_ms: float | None
    values_agree: bool | None
    note: str = ""


def _text(placements: Sequence[Placement]) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def _torch_placements(placements: Sequence[Placement]) -> list[Any]:
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    converted: list[Any] = []
    for placement in placements:
        if isinstance(placement, Shard):
            converted.append(TorchShard(placement.dim))
        elif isinstance(placement, Partial):
            converted.append(TorchPartial(placement.reduce_op))
        else:
            converted.append(TorchReplicate())
    return converted


def _source_local(
    full: torch.Tensor, mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Placement]
) -> torch.Tensor:
    """This rank's source shard; a Partial dim keeps the value on coordinate 0 and the identity elsewhere.

    Both implementations get the same input, so only their communication differs.
    """
    local = select_local_shard(full, mesh_shape, coordinate, placements).clone()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Partial) and coordinate[mesh_dim] != 0:
            if placement.reduce_op == "sum":
                local.zero_()
            elif placement.reduce_op == "avg":
                pass  # the average of equal values is that value
            elif placement.reduce_op == "max":
                local.sub_(1.0)  # below the value: the max is coordinate 0's
            else:
                local.add_(1.0)
    return local


def _median_ms(samples: list[float]) -> float:
    ordered = sorted(samples)
    return 1000.0 * ordered[len(ordered) // 2]


def _transitions(mesh_ndim: int, partial_targets: bool) -> list[tuple[tuple[Placement, ...], tuple[Placement, ...]]]:
    if mesh_ndim == 1:
        sources: list[Placement] = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("avg"), Partial("max"), Partial("min")]
        targets: list[Placement] = [Shard(0), Shard(1), Replicate()]
    else:
        sources = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("max")]
        targets = [Shard(0), Shard(1), Replicate()]
    if partial_targets:
        targets = targets + [Partial("sum"), Partial("max")]
    source_tuples = list(itertools.product(sources, repeat=mesh_ndim))
    target_tuples = list(itertools.product(targets, repeat=mesh_ndim))
    return [(src, dst) for src in source_tuples for dst in target_tuples if src != dst]


def rank_body(shape: tuple[int, ...], partial_targets: bool, repeat: int) -> list[dict[str, Any]]:
    """Runs on every rank: both implementations on every transition; this rank's measurements."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor import DTensor

    from shardwise.dtensor_ops._plan_executor import (
        plan_redistribute,
        redistribute_local_tensor,
        redistribute_lower_bound_bytes,
    )
    from shardwise.dtensor_ops._planner import plan_bytes_per_rank
    from shardwise.mesh import init_device_mesh

    rows: list[dict[str, Any]] = []
    full = (torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) % 97) - 48.0
    stride = full.stride()
    for mesh_shape in [(4,), (2, 2)]:
        ours_mesh = init_device_mesh("cpu", mesh_shape)
        torch_mesh = torch_init_device_mesh("cpu", mesh_shape)
        coordinate = tuple(ours_mesh.get_coordinate() or ())
        meta = TensorMeta(torch.Size(shape), stride, torch.float32)
        for src, dst in _transitions(len(mesh_shape), partial_targets):
            local = _source_local(full, mesh_shape, coordinate, src)
            src_spec, dst_spec = DTensorSpec(ours_mesh, src, meta), DTensorSpec(ours_mesh, dst, meta)
            plan = plan_redistribute(src_spec, dst_spec)

            ours_log = CollectiveBytes()
            with ours_log:
                ours_result = redistribute_local_tensor(local, src_spec, dst_spec)
            ours_times = []
            for _ in range(repeat):
                dist.barrier()
                start = time.perf_counter()
                redistribute_local_tensor(local, src_spec, dst_spec)
                ours_times.append(time.perf_counter() - start)

            torch_log = CollectiveBytes()
            torch_bytes: int | None = None
            torch_ms: float | None = None
            agree: bool | None = None
            note = ""
            try:
                source = DTensor.from_local(
                    local, torch_mesh, _torch_placements(src), run_check=False, shape=torch.Size(shape), stride=stride
                )
                with torch_log:
                    torch_result = source.redistribute(torch_mesh, _torch_placements(dst)).to_local()
            except (RuntimeError, NotImplementedError, AssertionError, ValueError) as error:
                note = f"PyTorch refused: {str(error).splitlines()[0][:60]}"
                dist.barrier()  # keep the ranks in step even when PyTorch raised
            else:
                torch_bytes = torch_log.received
                torch_times = []
                for _ in range(repeat):
                    dist.barrier()
                    start = time.perf_counter()
                    source.redistribute(torch_mesh, _torch_placements(dst)).to_local()
                    torch_times.append(time.perf_counter() - start)
                torch_ms = _median_ms(torch_times)
                if not any(isinstance(p, Partial) for p in dst):
                    agree = bool(
                        torch_result.shape == ours_result.shape and torch.allclose(torch_result, ours_result)
                    )
            if ours_log.unknown or torch_log.unknown:
                note += f" unrecognised collectives: {ours_log.unknown + torch_log.unknown}"
            rows.append(
                asdict(
                    Row(
                        mesh="x".join(map(str, mesh_shape)),
                        src=_text(src),
                        dst=_text(dst),
                        shape="x".join(map(str, shape)),
                        ours_bytes=ours_log.received,
                        ours_model_bytes=plan_bytes_per_rank(plan),
                        lower_bound_bytes=redistribute_lower_bound_bytes(src_spec, dst_spec),
                        torch_bytes=torch_bytes,
                        ours_collectives="+".join(ours_log.collectives) or "-",
                        torch_collectives="+".join(torch_log.collectives) or "-",
                        ours_ms=_median_ms(ours_times),
                        torch_ms=torch_ms,
                        values_agree=agree,
                        note=note.strip(),
                    )
                )
            )
    return rows


def _merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per transition: the most loaded rank's bytes and the slowest rank's time."""
    merged = []
    for rows in zip(*per_rank):
        row = dict(rows[0])
        for key in ("ours_bytes", "torch_bytes", "ours_ms", "torch_ms"):
            values = [r[key] for r in rows if r[key] is not None]
            row[key] = max(values) if values else None
        row["values_agree"] = None if rows[0]["values_agree"] is None else all(r["values_agree"] for r in rows)
        merged.append(row)
    return merged


def _format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| mesh | source | target | ours B | model B | lower bound B | PyTorch B | PyTorch/ours "
        "| ours collectives | PyTorch collectives | values agree | note |"
    )
    lines = [header, "|" + "---|" * 12]
    for row in rows:
        torch_bytes = row["torch_bytes"]
        ratio = "-" if torch_bytes is None else ("=" if torch_bytes == row["ours_bytes"] else (
            "inf" if row["ours_bytes"] == 0 else f"{torch_bytes / row['ours_bytes']:.2f}"
        ))
        lines.append(
            f"| {row['mesh']} | {row['src']} | {row['dst']} | {row['ours_bytes']} | {row['ours_model_bytes']} "
            f"| {row['lower_bound_bytes']} | {'-' if torch_bytes is None else torch_bytes} | {ratio} "
            f"| {row['ours_collectives']} | {row['torch_collectives']} "
            f"| {'-' if row['values_agree'] is None else row['values_agree']} | {row['note']} |"
        )
    return "\n".join(lines)


def _summary(rows: list[dict[str, Any]]) -> str:
    compared = [r for r in rows if r["torch_bytes"] is not None]
    less = [r for r in compared if r["ours_bytes"] < r["torch_bytes"]]
    more = [r for r in compared if r["ours_bytes"] > r["torch_bytes"]]
    at_bound = [r for r in rows if r["ours_bytes"] == r["lower_bound_bytes"]]
    model_mismatch = [r for r in rows if r["ours_bytes"] != r["ours_model_bytes"]]
    disagree = [r for r in rows if r["values_agree"] is False]
    lines = [
        f"transitions: {len(rows)} ({len(compared)} also run by PyTorch)",
        f"ours moves fewer bytes than PyTorch: {len(less)}; the same: {len(compared) - len(less) - len(more)}; "
        f"more: {len(more)}",
        f"total bytes (transitions run by both): ours {sum(r['ours_bytes'] for r in compared)}, "
        f"PyTorch {sum(r['torch_bytes'] for r in compared)}",
        f"ours at the lower bound: {len(at_bound)} of {len(rows)}",
        f"measured bytes differ from the planner's model: {len(model_mismatch)}",
        f"results that differ from PyTorch's: {len(disagree)}",
        "time (slowest rank, median of repeats, summed over transitions run by both): "
        f"ours {sum(r['ours_ms'] for r in compared):.1f} ms, PyTorch {sum(r['torch_ms'] for r in compared):.1f} ms",
    ]
    biggest = sorted(less, key=lambda r: r["torch_bytes"] - r["ours_bytes"], reverse=True)[:8]
    if biggest:
        lines.append("largest savings:")
        for r in biggest:
            lines.append(
                f"  {r['mesh']} {r['src']} -> {r['dst']}: ours {r['ours_bytes']} B ({r['ours_collectives']}) vs "
                f"PyTorch {r['torch_bytes']} B ({r['torch_collectives']}), lower bound {r['lower_bound_bytes']} B"
            )
    for r in more:
        lines.append(f"  PyTorch moves less: {r['mesh']} {r['src']} -> {r['dst']}: {r['ours_bytes']} vs {r['torch_bytes']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="64,48", help="global tensor shape, comma separated (default 64,48)")
    parser.add_argument("--partial-targets", action="store_true", help="also run transitions to Partial")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions per transition (default 3)")
    parser.add_argument("--json", dest="json_path", help="write every row to this JSON file")
    args = parser.parse_args(argv)
    shape = tuple(int(part) for part in args.shape.split(","))
    if len(shape) != 2 or min(shape) < 1:
        parser.error(f"--shape must be two positive sizes like 64,48, got {args.shape!r}")
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")

    from shardwise.testing import run_on_ranks

    per_rank = run_on_ranks(rank_body, shape, args.partial_targets, args.repeat, world_size=4, timeout=1800)
    rows = _merge(per_rank)
    print(f"# redistribute: bytes received per rank (most loaded rank), float32 {shape}, 4 gloo ranks\n")
    print(_format_table(rows))
    print()
    print(_summary(rows))
    if args.json_path:
        with open(args.json_path, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
