"""CommDebugMode with real collectives on two ranks: counts by op, totals, per-module passes, reports."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from shardwise.dtensor_ops.debug import CommCounts, CommDebugMode
from shardwise.testing import multi_rank

F = torch.ops._c10d_functional
LEGACY = torch.ops.c10d_functional  # registered by importing shardwise.dtensor_ops.debug
WORLD = 2


def _group_name() -> str:
    group = dist.group.WORLD
    assert group is not None
    return group.group_name


@multi_rank(world_size=WORLD)
def test_functional_collectives_are_counted_by_op_and_still_compute() -> None:
    group = _group_name()
    rank = dist.get_rank()
    mode = CommDebugMode()
    with mode:
        summed = F.wait_tensor(F.all_reduce(torch.full((2,), rank + 1.0), "sum", group))
        summed_again = F.wait_tensor(F.all_reduce(torch.ones(1), "max", group))
        gathered = F.wait_tensor(F.all_gather_into_tensor(torch.full((1,), float(rank)), WORLD, group))
        scattered = F.wait_tensor(F.reduce_scatter_tensor(torch.arange(2.0), "sum", WORLD, group))
        to_exchange = torch.tensor([10.0 * rank, 10.0 * rank + 1])
        exchanged = F.wait_tensor(F.all_to_all_single(to_exchange, [1, 1], [1, 1], group))
        broadcast = F.wait_tensor(F.broadcast(torch.full((1,), float(rank)), 0, group))
        reduced_pair = [F.wait_tensor(t) for t in F.all_reduce_coalesced([torch.ones(1), torch.ones(2)], "sum", group)]
        gathered_pair = [
            F.wait_tensor(t) for t in F.all_gather_into_tensor_coalesced([torch.ones(1), torch.ones(2)], WORLD, group)
        ]
        scattered_pair = [
            F.wait_tensor(t)
            for t in F.reduce_scatter_tensor_coalesced([torch.ones(2), torch.ones(4)], "sum", WORLD, group)
        ]

    assert summed.tolist() == [3.0, 3.0] and summed_again.tolist() == [1.0]
    assert gathered.tolist() == [0.0, 1.0]
    assert scattered.tolist() == [2.0 * rank]
    assert exchanged.tolist() == [float(rank), 10.0 + rank]
    assert broadcast.tolist() == [0.0]
    assert [t.tolist() for t in reduced_pair] == [[2.0], [2.0, 2.0]]
    assert [t.shape for t in gathered_pair] == [torch.Size([2]), torch.Size([4])]
    assert [t.tolist() for t in scattered_pair] == [[2.0], [2.0, 2.0]]

    counts = mode.get_comm_counts()
    expected = {
        LEGACY.all_reduce: 2,
        LEGACY.all_gather_into_tensor: 1,
        LEGACY.reduce_scatter_tensor: 1,
        LEGACY.all_to_all_single: 1,
        LEGACY.broadcast: 1,
        LEGACY.all_reduce_coalesced: 1,
        LEGACY.all_gather_into_tensor_coalesced: 1,
        LEGACY.reduce_scatter_tensor_coalesced: 1,
    }
    assert counts == expected
    for op, count in expected.items():
        op_name = str(op).split(".")[-1]
        assert counts[getattr(F, op_name)] == count  # the _c10d_functional spelling reads the same entry
    assert len(counts) == len(expected)
    assert mode.get_total_counts() == 9  # wait_tensor is not a collective


@multi_rank(world_size=WORLD)
def test_c10d_collectives_called_directly_are_counted() -> None:
    rank = dist.get_rank()
    mode = CommDebugMode()
    with mode:
        total = torch.full((2,), float(rank))
        dist.all_reduce(total)
        gathered = torch.empty(WORLD)
        dist.all_gather_into_tensor(gathered, torch.full((1,), float(rank)))
        dist.barrier()
    assert total.tolist() == [1.0, 1.0]
    assert gathered.tolist() == [0.0, 1.0]
    counts = mode.get_comm_counts()
    assert counts == {torch.ops.c10d.allreduce_: 1, torch.ops.c10d._allgather_base_: 1}
    assert mode.get_total_counts() == 2  # the barrier moves no data and is not counted


@multi_rank(world_size=WORLD)
def test_entering_again_resets_the_counts() -> None:
    group = _group_name()
    mode = CommDebugMode()
    with mode:
        F.wait_tensor(F.all_reduce(torch.ones(1), "sum", group))
        F.wait_tensor(F.all_reduce(torch.ones(1), "sum", group))
    assert mode.get_total_counts() == 2
    with mode:
        assert mode.get_total_counts() == 0
        F.wait_tensor(F.all_gather_into_tensor(torch.ones(1), WORLD, group))
    assert mode.get_comm_counts() == {F.all_gather_into_tensor: 1}
    # Collectives after the block are not counted.
    F.wait_tensor(F.all_reduce(torch.ones(1), "sum", group))
    assert mode.get_total_counts() == 1


# --------------------------------------------------- a module tree with collectives


class _ReduceForwardGatherBackward(torch.autograd.Function):
    """all_reduce in forward; all_gather (then this rank's slice) in backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return F.wait_tensor(F.all_reduce(x, "sum", _group_name()))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        gathered = F.wait_tensor(F.all_gather_into_tensor(grad.contiguous(), WORLD, _group_name()))
        return gathered.chunk(WORLD)[dist.get_rank()]


class _ScatterForwardAllToAllBackward(torch.autograd.Function):
    """reduce_scatter in forward (keeps the shape by gathering back locally); all_to_all in backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        scattered = F.wait_tensor(F.reduce_scatter_tensor(x.contiguous(), "sum", WORLD, _group_name()))
        return scattered.repeat(WORLD, *([1] * (x.dim() - 1)))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        splits = [grad.shape[0] // WORLD] * WORLD
        return F.wait_tensor(F.all_to_all_single(grad.contiguous(), splits, splits, _group_name()))


class Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceForwardGatherBackward.apply(self.proj(x))


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaf = Leaf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.leaf(x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Leaf()
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Outer's own collectives, between its children's.
        return self.inner(_ScatterForwardAllToAllBackward.apply(self.first(x)))


def _run_outer_step(mode: CommDebugMode) -> None:
    torch.manual_seed(0)
    model = Outer()
    x = torch.randn(2, 4, requires_grad=True)
    with mode:
        model(x).sum().backward()
        # Outside every module: counted for Global only.
        dist.all_reduce(torch.ones(1))


def _as_plain(counts: dict[str, dict[str, CommCounts]]) -> dict[str, dict[str, dict[str, int]]]:
    return {
        fqn: {phase: {str(op): n for op, n in per_op.items()} for phase, per_op in per_pass.items()}
        for fqn, per_pass in counts.items()
    }


@multi_rank(world_size=WORLD)
def test_collectives_are_attributed_to_modules_and_passes() -> None:
    mode = CommDebugMode()
    _run_outer_step(mode)

    ar, ag = "c10d_functional.all_reduce", "c10d_functional.all_gather_into_tensor"
    rs, a2a = "c10d_functional.reduce_scatter_tensor", "c10d_functional.all_to_all_single"
    leaf = {"forward": {ar: 1}, "backward": {ag: 1}}
    assert _as_plain(mode.get_per_module_comm_counts()) == {
        "Global": {"forward": {ar: 2, rs: 1, "c10d.allreduce_": 1}, "backward": {ag: 2, a2a: 1}},
        "Outer": {"forward": {ar: 2, rs: 1}, "backward": {ag: 2, a2a: 1}},
        "Outer.first": leaf,
        "Outer.first.proj": {"forward": {}, "backward": {}},
        "Outer.inner": leaf,
        "Outer.inner.leaf": leaf,
        "Outer.inner.leaf.proj": {"forward": {}, "backward": {}},
    }
    assert mode.comm_module_counts["Outer.inner.leaf"]["backward"][F.all_gather_into_tensor] == 1
    assert mode.get_total_counts() == 7


EXPECTED_LEVEL0_TABLE = """\
Global
  FORWARD PASS
    *c10d_functional.all_reduce: 2
    *c10d_functional.reduce_scatter_tensor: 1
    *c10d.allreduce_: 1
  BACKWARD PASS
    *c10d_functional.all_gather_into_tensor: 2
    *c10d_functional.all_to_all_single: 1
    Outer
      FORWARD PASS
        *c10d_functional.all_reduce: 2
        *c10d_functional.reduce_scatter_tensor: 1
      BACKWARD PASS
        *c10d_functional.all_gather_into_tensor: 2
        *c10d_functional.all_to_all_single: 1
        Outer.first
          FORWARD PASS
            *c10d_functional.all_reduce: 1
          BACKWARD PASS
            *c10d_functional.all_gather_into_tensor: 1
            Outer.first.proj
        Outer.inner
          FORWARD PASS
            *c10d_functional.all_reduce: 1
          BACKWARD PASS
            *c10d_functional.all_gather_into_tensor: 1
            Outer.inner.leaf
              FORWARD PASS
                *c10d_functional.all_reduce: 1
              BACKWARD PASS
                *c10d_functional.all_gather_into_tensor: 1
                Outer.inner.leaf.proj
"""


@multi_rank(world_size=WORLD)
def test_tracing_table_shows_modules_passes_and_collectives() -> None:
    mode = CommDebugMode()
    _run_outer_step(mode)
    assert mode.generate_comm_debug_tracing_table(noise_level=0) == EXPECTED_LEVEL0_TABLE

    level1 = mode.generate_comm_debug_tracing_table(noise_level=1)
    assert "*module type: test_comm_mode_collectives.Leaf" in level1
    # Each collective call is listed with its input shape under the module that issued it.
    leaf_section = level1[level1.index("        Outer.first\n") : level1.index("        Outer.inner\n")]
    reduce_entry = "            **_c10d_functional.all_reduce.default\n              shape: [torch.Size([2, 4])]\n"
    assert reduce_entry in leaf_section
    assert "**_c10d_functional.all_gather_into_tensor.default" in leaf_section
    assert "aten." not in level1

    level2 = mode.generate_comm_debug_tracing_table(noise_level=2)
    assert "**aten.addmm.default" in level2


@multi_rank(world_size=WORLD)
def test_json_dump_and_log_file_round_trip(tmp_path: Path) -> None:
    mode = CommDebugMode()
    _run_outer_step(mode)
    rank_dir = tmp_path / f"rank{dist.get_rank()}"
    rank_dir.mkdir()

    json_path = rank_dir / "comm.json"
    mode.generate_json_dump(str(json_path), noise_level=1)
    tree = json.loads(json_path.read_text())
    assert tree["fqn"] == "Global"
    assert tree["collectives_backward"] == [
        ["c10d_functional.all_gather_into_tensor", 2],
        ["c10d_functional.all_to_all_single", 1],
    ]
    (outer,) = tree["children"]
    assert outer["fqn"] == "Outer" and outer["module_type"] == "test_comm_mode_collectives.Outer"
    first, inner = outer["children"]
    assert first["collectives_forward"] == [["c10d_functional.all_reduce", 1]]
    assert [op["name"] for op in first["operations_forward"]] == ["_c10d_functional.all_reduce.default"]
    assert first["operations_forward"][0]["input_shape"] == [[2, 4]]
    assert [op["name"] for op in first["operations_backward"]] == ["_c10d_functional.all_gather_into_tensor.default"]
    assert first["operations_backward"][0]["is_bw"] is True
    assert [op["name"] for op in outer["operations_forward"]] == ["_c10d_functional.reduce_scatter_tensor.default"]
    assert inner["children"][0]["fqn"] == "Outer.inner.leaf"

    mode.generate_json_dump(str(rank_dir / "level0.json"), noise_level=0)
    outer_level0 = json.loads((rank_dir / "level0.json").read_text())["children"][0]
    assert outer_level0["module_type"] == "" and outer_level0["operations_forward"] == []
    assert outer_level0["collectives_forward"] == outer["collectives_forward"]

    log_path = rank_dir / "comm.txt"
    mode.log_comm_debug_tracing_table_to_file(str(log_path), noise_level=2)
    assert log_path.read_text() == mode.generate_comm_debug_tracing_table(noise_level=2)


class CheckpointedLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaf = Leaf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = checkpoint(self._squared_leaf, x, use_reentrant=False)
        assert isinstance(out, torch.Tensor)
        return out

    def _squared_leaf(self, x: torch.Tensor) -> torch.Tensor:
        # The product saves the all_reduce output, so backward must recompute through it.
        reduced = self.leaf(x)
        return reduced * reduced


@multi_rank(world_size=WORLD)
def test_recomputed_forward_counts_in_the_backward_pass() -> None:
    torch.manual_seed(0)
    model = CheckpointedLeaf()
    mode = CommDebugMode()
    with mode:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    per_module = mode.get_per_module_comm_counts()
    # The recomputation repeats the forward all_reduce while backward runs.
    for fqn in ("Global", "CheckpointedLeaf", "CheckpointedLeaf.leaf"):
        assert per_module[fqn]["forward"] == {F.all_reduce: 1}, fqn
        assert per_module[fqn]["backward"] == {F.all_reduce: 1, F.all_gather_into_tensor: 1}, fqn
    table = mode.generate_comm_debug_tracing_table(noise_level=1)
    recomputed = (
        "          ACTIVATION CHECKPOINTING (forward recomputed during backward)\n"
        "            **_c10d_functional.all_reduce.default\n"
    )
    assert recomputed in table
