"""CommDebugMode without processes: count keys, op classification, noise levels, module attribution.

Module attribution is checked here through the ops each module's forward and
backward run (every op is traced, collective or not); test_comm_mode_collectives.py
checks the same with real collectives on two ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from shardwise.dtensor_ops.debug import CommCounts, CommDebugMode, canonical_comm_key
from shardwise.dtensor_ops.debug._comm_keys import comm_key_for_op
from shardwise.dtensor_ops.debug._trace import is_metadata_only_op

NEW = torch.ops._c10d_functional
LEGACY = torch.ops.c10d_functional  # registered by importing shardwise.dtensor_ops.debug


# ----------------------------------------------------------------- count keys


def test_both_namespaces_and_overloads_share_one_key() -> None:
    assert canonical_comm_key(NEW.all_reduce) is canonical_comm_key(LEGACY.all_reduce)
    assert canonical_comm_key(NEW.all_reduce.default) is canonical_comm_key(LEGACY.all_reduce)
    # The key is the spelling PyTorch's CommDebugMode reports.
    assert canonical_comm_key(NEW.all_gather_into_tensor) is LEGACY.all_gather_into_tensor
    # In-place variants have no legacy spelling and keep their own key.
    assert canonical_comm_key(NEW.all_reduce_) is NEW.all_reduce_
    assert canonical_comm_key(torch.ops.c10d.allreduce_) is torch.ops.c10d.allreduce_


def test_comm_counts_reads_either_namespace_and_lists_each_op_once() -> None:
    counts = CommCounts()
    counts.add(NEW.all_reduce)
    counts.add(LEGACY.all_reduce)
    counts.add(NEW.reduce_scatter_tensor.default, 3)

    assert counts[NEW.all_reduce] == 2
    assert counts[LEGACY.all_reduce] == 2
    assert counts[LEGACY.reduce_scatter_tensor] == 3
    assert len(counts) == 2
    assert list(counts) == [LEGACY.all_reduce, LEGACY.reduce_scatter_tensor]
    assert counts.total() == 5
    assert NEW.all_reduce in counts and LEGACY.all_reduce in counts


def test_comm_counts_missing_op_reads_zero_without_being_added() -> None:
    counts = CommCounts({NEW.all_reduce: 1})
    assert counts[NEW.all_to_all_single] == 0
    assert NEW.all_to_all_single not in counts
    assert len(counts) == 1
    assert counts.get(NEW.broadcast) is None
    assert counts.get(NEW.broadcast, 0) == 0


def test_comm_counts_equality_normalises_the_other_mapping() -> None:
    counts = CommCounts({NEW.all_reduce: 2})
    assert counts == {LEGACY.all_reduce: 2}
    assert counts == {NEW.all_reduce: 2}
    assert counts != {NEW.all_reduce: 1}
    assert counts != {NEW.all_reduce: 2, NEW.broadcast: 1}
    assert counts != {"all_reduce": 2}


def test_comm_counts_rejects_keys_that_are_not_ops() -> None:
    counts = CommCounts()
    with pytest.raises(KeyError, match="torch.ops._c10d_functional.all_reduce.*got 'all_reduce'"):
        counts["all_reduce"]
    assert "all_reduce" not in counts


def test_comm_counts_copy_is_independent() -> None:
    counts = CommCounts({NEW.all_reduce: 1})
    snapshot = counts.copy()
    counts.add(NEW.all_reduce)
    assert isinstance(snapshot, CommCounts)
    assert snapshot[NEW.all_reduce] == 1 and counts[NEW.all_reduce] == 2


# ------------------------------------------------------------ classification


@pytest.mark.parametrize(
    "op",
    [
        NEW.all_reduce.default,
        NEW.all_gather_into_tensor.default,
        NEW.reduce_scatter_tensor.default,
        NEW.all_to_all_single.default,
        NEW.broadcast.default,
        NEW.all_reduce_coalesced.default,
        NEW.all_gather_into_tensor_coalesced.default,
        NEW.reduce_scatter_tensor_coalesced.default,
        LEGACY.all_reduce.default,
        torch.ops._c10d_functional_autograd.all_gather_into_tensor.default,
        torch.ops.c10d.allreduce_.default,
        torch.ops.c10d._allgather_base_.default,
        torch.ops.c10d.broadcast_.default,
    ],
)
def test_collectives_are_counted(op: torch._ops.OpOverload) -> None:
    key = comm_key_for_op(op)
    assert key is not None
    assert key is canonical_comm_key(op)


@pytest.mark.parametrize(
    "op",
    [
        NEW.wait_tensor.default,
        LEGACY.wait_tensor.default,
        torch.ops.c10d.barrier.default,
        torch.ops.aten.add.Tensor,
        torch.ops.aten.mm.default,
    ],
)
def test_non_communication_ops_are_not_counted(op: torch._ops.OpOverload) -> None:
    assert comm_key_for_op(op) is None


def test_autograd_functional_collective_counts_as_the_plain_one() -> None:
    autograd_op = torch.ops._c10d_functional_autograd.reduce_scatter_tensor.default
    assert comm_key_for_op(autograd_op) is LEGACY.reduce_scatter_tensor


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (torch.ops.aten.view.default, True),
        (torch.ops.aten.t.default, True),
        (torch.ops.aten.detach.default, True),
        (torch.ops.aten._to_copy.default, True),
        (torch.ops.aten.mm.default, False),
        (torch.ops.aten.add_.Tensor, False),  # writes through its alias: real work
    ],
)
def test_metadata_only_ops(op: torch._ops.OpOverload, expected: bool) -> None:
    assert is_metadata_only_op(op) is expected


# ------------------------------------------------------------- noise levels


@pytest.mark.parametrize("bad_level", [-1, 4, True, 1.0])
def test_bad_noise_level_is_rejected(bad_level: object, tmp_path: Path) -> None:
    mode = CommDebugMode()
    with mode:
        torch.ones(2) + 1
    with pytest.raises(ValueError, match=r"noise_level must be an int in \[0, 3\]"):
        mode.generate_comm_debug_tracing_table(bad_level)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="noise_level"):
        mode.generate_json_dump(str(tmp_path / "x.json"), bad_level)  # type: ignore[arg-type]
    assert not (tmp_path / "x.json").exists()


# ------------------------------------------- module attribution (no collectives)


class _MarkForwardAndBackward(torch.autograd.Function):
    """Runs aten.cumsum in forward and aten.flip in backward: ops easy to find in a trace."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, dim=0)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return torch.flip(grad, dims=(0,))


class Marker(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MarkForwardAndBackward.apply(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Marker()
        self.scale = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.first(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = Marker()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x)) * 2


def _op_names(node: dict[str, Any], key: str) -> list[str]:
    return [str(op["name"]) for op in node[key]]


def _find(node: dict[str, Any], fqn: str) -> dict[str, Any]:
    pending = [node]
    while pending:
        candidate = pending.pop()
        if candidate["fqn"] == fqn:
            return candidate
        pending.extend(candidate["children"])
    raise AssertionError(f"module {fqn} is not in the trace")


def test_ops_are_attributed_to_the_innermost_module_and_pass(tmp_path: Path) -> None:
    net = Net()
    x = torch.ones(4, 3, requires_grad=True)
    mode = CommDebugMode()
    with mode:
        net(x).sum().backward()

    dump = tmp_path / "trace.json"
    mode.generate_json_dump(str(dump), noise_level=2)
    tree = json.loads(dump.read_text())

    assert tree["fqn"] == "Global"
    assert [child["fqn"] for child in tree["children"]] == ["Net"]
    net_node = _find(tree, "Net")
    assert [child["fqn"] for child in net_node["children"]] == ["Net.block", "Net.head"]
    assert [child["fqn"] for child in _find(tree, "Net.block")["children"]] == ["Net.block.first", "Net.block.scale"]

    for marker in ("Net.block.first", "Net.head"):
        node = _find(tree, marker)
        assert _op_names(node, "operations_forward") == ["aten.cumsum.default"]
        assert _op_names(node, "operations_backward") == ["aten.flip.default"]
    scale = _find(tree, "Net.block.scale")
    assert _op_names(scale, "operations_forward") == ["aten.addmm.default"]
    assert "aten.mm.default" in _op_names(scale, "operations_backward")
    # The parent's own op (the * 2) stays with the parent, in both passes.
    assert _op_names(net_node, "operations_forward") == ["aten.mul.Tensor"]
    assert _op_names(net_node, "operations_backward") == ["aten.mul.Tensor"]
    assert "aten.sum.default" in _op_names(tree, "operations_forward")
    assert "aten.flip.default" not in _op_names(tree, "operations_backward")


def test_sequential_sharing_its_last_childs_output_attributes_backward_to_the_child(tmp_path: Path) -> None:
    # The container returns the very tensor its last child returns, so the hooks that start
    # both modules' backward sit on the same tensor.
    model = nn.Sequential(Marker(), Marker())
    x = torch.ones(3, requires_grad=True)
    mode = CommDebugMode()
    with mode:
        model(x).sum().backward()
    dump = tmp_path / "trace.json"
    mode.generate_json_dump(str(dump), noise_level=2)
    tree = json.loads(dump.read_text())
    assert _op_names(_find(tree, "Sequential.0"), "operations_backward") == ["aten.flip.default"]
    assert _op_names(_find(tree, "Sequential.1"), "operations_backward") == ["aten.flip.default"]
    assert _op_names(_find(tree, "Sequential"), "operations_backward") == []


def test_noise_levels_filter_plain_and_metadata_ops() -> None:
    net = Net()
    mode = CommDebugMode()
    with mode:
        net(torch.ones(4, 3, requires_grad=True)).sum().backward()

    level0 = mode.generate_comm_debug_tracing_table(0)
    level1 = mode.generate_comm_debug_tracing_table(1)
    level2 = mode.generate_comm_debug_tracing_table(2)
    level3 = mode.generate_comm_debug_tracing_table(3)
    for table in (level0, level1, level2, level3):
        assert table.splitlines()[0] == "Global"
        for fqn in ("Net", "Net.block", "Net.block.first", "Net.block.scale", "Net.head"):
            assert fqn in table
    # No collectives ran: level 0 has module names only, no pass headers.
    assert "FORWARD PASS" not in level0 and "aten." not in level0
    assert "*module type: torch.nn.modules.linear.Linear" in level1
    assert "aten." not in level1  # plain-tensor ops start at level 2
    assert "**aten.cumsum.default" in level2 and "**aten.flip.default" in level2
    assert "aten.t.default" not in level2  # metadata-only ops start at level 3
    assert "**aten.t.default" in level3


def test_entering_again_starts_from_scratch() -> None:
    mode = CommDebugMode()
    with mode:
        Net()(torch.ones(4, 3))
    assert "Net.head" in mode.get_per_module_comm_counts()
    with mode:
        Marker()(torch.ones(2))
    assert list(mode.get_per_module_comm_counts()) == ["Global", "Marker"]
    assert mode.get_total_counts() == 0


def test_two_outermost_modules_of_one_class_get_distinct_names() -> None:
    mode = CommDebugMode()
    with mode:
        Marker()(torch.ones(2))
        Marker()(torch.ones(2))
    assert list(mode.get_per_module_comm_counts()) == ["Global", "Marker", "Marker#1"]


def test_hooks_are_removed_on_exit() -> None:
    marker = Marker()
    mode = CommDebugMode()
    with mode:
        marker(torch.ones(2))
        assert len(marker._forward_hooks) == 1
    assert len(marker._forward_hooks) == 0
    with mode:
        pass
    Marker()(torch.ones(2))  # outside the block: nothing is tracked
    assert list(mode.get_per_module_comm_counts()) == ["Global"]


def test_exception_inside_a_module_leaves_tracking_consistent() -> None:
    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    failing = Failing()
    after = Marker()
    mode = CommDebugMode()
    with mode:
        with pytest.raises(RuntimeError, match="boom"):
            failing(torch.ones(2))
        after(torch.ones(2))
    tree_text = mode.generate_comm_debug_tracing_table(2)
    lines = tree_text.splitlines()
    # Marker ran after Failing returned (by raising): it is top-level, not Failing's child.
    assert "    Marker" in lines and "        Marker" not in lines


def test_ops_on_meta_tensors_are_metadata_only() -> None:
    # Shape inference (e.g. DTensor running an op on meta tensors) does no arithmetic.
    mode = CommDebugMode()
    with mode:
        torch.empty(2, 2, device="meta") @ torch.empty(2, 2, device="meta")
        torch.empty(3, device="meta")
        torch.ones(2) * 3
    level2 = mode.generate_comm_debug_tracing_table(2)
    level3 = mode.generate_comm_debug_tracing_table(3)
    assert "**aten.mul.Tensor" in level2
    assert "aten.mm.default" not in level2 and "aten.empty" not in level2
    assert "**aten.mm.default" in level3 and "**aten.empty.memory_format" in level3


def test_entering_an_active_mode_again_is_an_error() -> None:
    mode = CommDebugMode()
    with mode:
        torch.ones(2) + 1
        with pytest.raises(RuntimeError, match="already active"):
            with mode:
                pass
        torch.ones(2) * 2
    # Still usable, and a separate mode nests fine.
    outer, inner = CommDebugMode(), CommDebugMode()
    with outer:
        with inner:
            Marker()(torch.ones(2))
    assert "Marker" in outer.get_per_module_comm_counts()
    assert "Marker" in inner.get_per_module_comm_counts()
