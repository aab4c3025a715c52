"""loss_parallel on 4 ranks: cross-entropy on class-sharded logits equals plain cross-entropy on the
whole logits (loss and gradient), with 3 all-reduces forward, none backward and no gather of the logits."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from style_helpers import comm_counts, expect_counts, rank_and_world

from shardwise.dtensor_ops import DTensor, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops._op_handlers import handlers_for
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.placement import Replicate, Shard
from shardwise.testing import multi_rank
from shardwise.tp_styles import ColwiseParallel, loss_parallel, parallelize_module
from shardwise.tp_styles.loss import LOSS_PARALLEL_OPS


def _targets(rows: int, classes: int) -> torch.Tensor:
    target = torch.randint(0, classes, (rows,))
    target[1] = -100  # an ignored row
    target[2] = classes - 1  # the last class lives on the last non-empty shard
    return target


@multi_rank
def test_cross_entropy_matches_plain_torch_with_three_all_reduces_forward_and_none_backward() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(20)
    mode = CommDebugMode()
    failures = []
    # 16 classes: even shards; 10: uneven (3, 3, 3, 1); 3: rank 3 holds no class at all.
    for classes in (16, 10, 3):
        for reduction in ("mean", "sum", "none"):
            for with_weight in (False, True):
                case = f"classes={classes} reduction={reduction} weight={with_weight}"
                logits = torch.randn(6, classes, requires_grad=True)
                target = _targets(6, classes)
                weight = torch.rand(classes) if with_weight else None
                expected = F.cross_entropy(logits, target, weight=weight, reduction=reduction)
                expected.sum().backward()

                sharded = distribute_tensor(logits.detach(), mesh, [Shard(1)]).requires_grad_(True)
                with loss_parallel(), mode:
                    loss = F.cross_entropy(sharded, target, weight=weight, reduction=reduction)
                    forward_counts = comm_counts(mode)
                    loss.sum().backward()
                counts = comm_counts(mode)
                if forward_counts != dict(forward_counts, all_reduce=3, total=3):
                    failures.append(f"{case}: forward collectives {forward_counts}")
                if counts["total"] != 3:
                    failures.append(f"{case}: backward collectives {counts} (forward {forward_counts})")
                assert isinstance(loss, DTensor) and loss.placements == (Replicate(),), case
                assert sharded.grad is not None and sharded.grad.placements == (Shard(1),), case
                torch.testing.assert_close(loss.full_tensor(), expected.detach(), msg=lambda m: f"{case}: {m}")
                torch.testing.assert_close(sharded.grad.full_tensor(), logits.grad, msg=lambda m: f"{case}: {m}")
    assert not failures, "\n".join(failures)


@multi_rank
def test_column_parallel_output_layer_trains_like_the_plain_model() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(21)
    batch, seq, dim, vocab = 2, 3, 8, 12
    head = nn.Linear(dim, vocab)
    reference = deepcopy(head)
    parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
    hidden = torch.rand(batch, seq, dim)
    labels = torch.randint(0, vocab, (batch, seq))

    expected = F.cross_entropy(reference(hidden).flatten(0, 1), labels.flatten())
    expected.backward()
    mode = CommDebugMode()
    with loss_parallel(), mode:
        logits = head(hidden)  # (batch, seq, vocab), Shard(2): never gathered
        assert logits.placements == (Shard(2),)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        # 3 all-reduces in the loss; backward: the head's input gradient is a partial sum,
        # reduced once (hidden needs no gradient here, so nothing at all).
        expect_counts(mode, "column-parallel head + loss_parallel", 3, all_reduce=3)
    torch.testing.assert_close(loss.full_tensor(), expected.detach())
    torch.testing.assert_close(head.weight.grad.full_tensor(), reference.weight.grad)
    torch.testing.assert_close(head.bias.grad.full_tensor(), reference.bias.grad)


@multi_rank
def test_log_softmax_output_used_twice_still_gets_the_exact_gradient() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(22)
    logits = torch.randn(5, 8, requires_grad=True)
    target = torch.randint(0, 8, (5,))

    def objective(x: torch.Tensor) -> torch.Tensor:
        log_probs = F.log_softmax(x, dim=-1)
        # The gradient reaching log_softmax is then the nll one plus another: no longer one-hot rows.
        return F.nll_loss(log_probs, target) + 0.5 * (log_probs * log_probs).mean()

    expected = objective(logits)
    expected.backward()
    sharded = distribute_tensor(logits.detach(), mesh, [Shard(1)]).requires_grad_(True)
    mode = CommDebugMode()
    with loss_parallel():
        loss = objective(sharded)
        with mode:
            loss.backward()
        # log_softmax's backward needs the row sums of that gradient: one all-reduce.
        expect_counts(mode, "backward with a second use of the log-probabilities", 1, all_reduce=1)
    torch.testing.assert_close(loss.full_tensor(), expected.detach())
    assert sharded.grad is not None
    torch.testing.assert_close(sharded.grad.full_tensor(), logits.grad)


@multi_rank
def test_targets_as_dtensors_one_dim_inputs_and_errors() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(23)
    logits = torch.randn(4, 8, requires_grad=True)
    target = torch.randint(0, 8, (4,))
    weight = torch.rand(8)
    expected = F.cross_entropy(logits, target, weight=weight)
    expected.backward()
    sharded = distribute_tensor(logits.detach(), mesh, [Shard(1)]).requires_grad_(True)
    with loss_parallel():
        loss = F.cross_entropy(
            sharded,
            distribute_tensor(target, mesh, [Replicate()]),
            weight=distribute_tensor(weight, mesh, [Shard(0)]),
        )
        loss.backward()
    torch.testing.assert_close(loss.full_tensor(), expected.detach())
    assert sharded.grad is not None
    torch.testing.assert_close(sharded.grad.full_tensor(), logits.grad)

    # One sample: logits (C,), target a 0-dim tensor.
    single = torch.randn(8, requires_grad=True)
    expected_single = F.cross_entropy(single, torch.tensor(5))
    expected_single.backward()
    sharded_single = distribute_tensor(single.detach(), mesh, [Shard(0)]).requires_grad_(True)
    with loss_parallel():
        loss = F.cross_entropy(sharded_single, torch.tensor(5))
        loss.backward()
    torch.testing.assert_close(loss.full_tensor(), expected_single.detach())
    assert sharded_single.grad is not None
    torch.testing.assert_close(sharded_single.grad.full_tensor(), single.grad)

    # Replicated logits work too (no collective needed for them).
    replicated = distribute_tensor(logits.detach(), mesh, [Replicate()]).requires_grad_(True)
    mode = CommDebugMode()
    with loss_parallel(), mode:
        loss = F.cross_entropy(replicated, target, weight=weight)
        loss.backward()
        expect_counts(mode, "replicated logits", 0)
    torch.testing.assert_close(loss.full_tensor(), expected.detach())

    with loss_parallel(), mode:
        with pytest.raises(IndexError, match="Target 8 is out of bounds"):
            F.cross_entropy(sharded, torch.tensor([0, 8, 1, 2]))
        with pytest.raises(ValueError, match=r"target of shape \(4, 3\) does not match input of shape \(4, 8\)"):
            F.nll_loss(sharded, torch.zeros(4, 3, dtype=torch.long))
        # log_softmax's two all-reduces ran; the rejected nll_loss calls issued nothing more.
        expect_counts(mode, "rejected calls", 2, all_reduce=2)


@multi_rank
def test_class_dim_one_of_three_and_four_dim_inputs() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(24)
    for shape in ((2, 8, 3), (2, 6, 2, 3)):
        for reduction in ("mean", "none"):
            case = f"shape={shape} reduction={reduction}"
            logits = torch.randn(*shape, requires_grad=True)
            target = torch.randint(0, shape[1], (shape[0], *shape[2:]))
            target.view(-1)[0] = -100
            weight = torch.rand(shape[1])
            expected = F.cross_entropy(logits, target, weight=weight, reduction=reduction)
            expected.sum().backward()
            sharded = distribute_tensor(logits.detach(), mesh, [Shard(1)]).requires_grad_(True)
            mode = CommDebugMode()
            with loss_parallel(), mode:
                loss = F.cross_entropy(sharded, target, weight=weight, reduction=reduction)
                expect_counts(mode, f"{case} forward", 3, all_reduce=3)
                loss.sum().backward()
                # 3-D inputs reach nll_loss2d through a view, whose backward makes a new gradient
                # tensor: the row sums are then all-reduced instead of known.
                expect_counts(mode, f"{case} forward+backward", 4 if len(shape) == 3 else 3)
            torch.testing.assert_close(loss.full_tensor(), expected.detach(), msg=lambda m: f"{case}: {m}")
            assert sharded.grad is not None
            torch.testing.assert_close(sharded.grad.full_tensor(), logits.grad, msg=lambda m: f"{case}: {m}")


def test_handlers_are_registered_only_inside_the_context() -> None:
    assert not any(handler in handlers_for(op) for op, handler in LOSS_PARALLEL_OPS.items())
    with loss_parallel():
        assert all(handlers_for(op)[0] is handler for op, handler in LOSS_PARALLEL_OPS.items())
        with loss_parallel():
            assert all(handlers_for(op)[0] is handler for op, handler in LOSS_PARALLEL_OPS.items())
        assert all(handlers_for(op)[0] is handler for op, handler in LOSS_PARALLEL_OPS.items())
    assert not any(handler in handlers_for(op) for op, handler in LOSS_PARALLEL_OPS.items())
