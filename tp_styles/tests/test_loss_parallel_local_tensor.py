"""loss_parallel under torch's LocalTensorMode: every rank simulated in the test process.

Each simulated rank's loss and gradient shard equal plain ``F.cross_entropy`` on the whole logits
(computed with the mode disabled), with the same collectives as on real ranks: 3 all-reduces
forward, none backward, each issued once for all simulated ranks.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensor

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh._simulation import mode_disabled
from shardwise.testing import LocalDTensorTestBase, with_comms
from shardwise.tp_styles import loss_parallel

funcol = torch.ops.c10d_functional  # CommDebugMode counts under these keys, as PyTorch's


def plain(function: Any, *args: Any) -> Any:
    """``function(*args)`` on plain tensors, outside the mode (the reference)."""
    with mode_disabled():
        return function(*args)


def labelled(label: str) -> Callable[[str], str]:
    """An ``assert_close`` message: torch's own, prefixed with which case and rank differed."""
    return lambda message: f"{label}: {message}"


def reference(
    logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, reduction: str, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch on the whole logits: the loss and the logits' gradient of ``loss.sum()``."""
    leaf = logits.clone().requires_grad_(True)
    loss = F.cross_entropy(leaf, target, weight=weight, reduction=reduction, ignore_index=ignore_index)
    loss.sum().backward()
    assert leaf.grad is not None
    return loss.detach(), leaf.grad


class LossParallelUnderLocalTensorModeTest(LocalDTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    def assert_every_rank_equals(self, tensor: torch.Tensor, expected: torch.Tensor, case: str) -> None:
        self.assertIsInstance(tensor, LocalTensor, f"{case}: expected one piece per simulated rank")
        by_rank = dict(tensor._local_tensors)  # type: ignore[attr-defined]
        self.assertEqual(sorted(by_rank), list(range(self.world_size)), case)
        for rank, piece in by_rank.items():
            torch.testing.assert_close(piece, expected, msg=labelled(f"{case}, simulated rank {rank}"))

    def assert_class_shards(self, tensor: torch.Tensor, full: torch.Tensor, dim: int, case: str) -> None:
        """Simulated rank r holds torch.chunk piece r of ``full`` along ``dim`` (empty past the last chunk)."""
        self.assertIsInstance(tensor, LocalTensor, f"{case}: expected one piece per simulated rank")
        chunks = plain(lambda: full.chunk(self.world_size, dim))
        for rank, piece in dict(tensor._local_tensors).items():  # type: ignore[attr-defined]
            expected = chunks[rank] if rank < len(chunks) else plain(lambda: full.narrow(dim, 0, 0))
            torch.testing.assert_close(piece, expected, msg=labelled(f"{case}, simulated rank {rank}"))

    @with_comms
    def test_cross_entropy_matches_plain_torch_on_every_simulated_rank(self) -> None:
        mesh = init_device_mesh("cpu", (self.world_size,))
        generator = torch.Generator().manual_seed(30)
        # 16 classes: even shards; 10: uneven (3, 3, 3, 1); 3: rank 3 holds no class at all.
        # (N, C) logits and (N, C, H) logits (aten's nll_loss2d path), rows ignored via ignore_index.
        for classes in (16, 10, 3):
            for shape in ((6, classes), (2, classes, 2, 2)):
                for reduction in ("mean", "sum", "none"):
                    for with_weight in (False, True):
                        for ignore_index in (-100, 1):
                            case = f"shape={shape} reduction={reduction} weight={with_weight} ignore_index={ignore_index}"
                            self._check_case(mesh, generator, shape, reduction, with_weight, ignore_index, case)

    def _check_case(
        self,
        mesh: Any,
        generator: torch.Generator,
        shape: tuple[int, ...],
        reduction: str,
        with_weight: bool,
        ignore_index: int,
        case: str,
    ) -> None:
        classes = shape[1]
        logits = torch.randn(shape, generator=generator)
        target_shape = (shape[0], *shape[2:])
        target = torch.randint(0, classes, target_shape, generator=generator)
        target.view(-1)[0] = ignore_index  # an ignored row
        target.view(-1)[1] = classes - 1  # the last class lives on the last non-empty shard
        weight = torch.rand(classes, generator=generator) if with_weight else None
        expected_loss, expected_grad = plain(reference, logits, target, weight, reduction, ignore_index)
        with self._get_local_tensor_mode():
            sharded = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_(True)
            with loss_parallel():
                with CommDebugMode() as forward_mode:
                    loss = F.cross_entropy(sharded, target, weight=weight, reduction=reduction, ignore_index=ignore_index)
                with CommDebugMode() as backward_mode:
                    loss.sum().backward()
            self.assertEqual(forward_mode.get_comm_counts(), {funcol.all_reduce: 3}, f"{case}: forward collectives")
            self.assertEqual(backward_mode.get_total_counts(), 0, f"{case}: backward collectives")
            assert isinstance(loss, DTensor), case
            self.assertEqual(loss.placements, (Replicate(),), case)
            self.assert_every_rank_equals(loss.to_local(), expected_loss, case)
            grad = sharded.grad
            assert isinstance(grad, DTensor), case
            self.assertEqual(grad.placements, (Shard(1),), case)
            self.assert_class_shards(grad.to_local(), expected_grad, 1, case)

    @with_comms
    def test_log_softmax_reused_takes_the_all_reduced_row_sums(self) -> None:
        mesh = init_device_mesh("cpu", (self.world_size,))
        generator = torch.Generator().manual_seed(31)
        logits = torch.randn(5, 10, generator=generator)
        target = torch.randint(0, 10, (5,), generator=generator)

        def objective(x: torch.Tensor) -> torch.Tensor:
            log_probs = F.log_softmax(x, dim=-1)
            # The gradient reaching log_softmax is then no longer one-hot rows: its row sums need an all-reduce.
            return F.nll_loss(log_probs, target) + 0.5 * (log_probs * log_probs).mean()

        def expected_loss_and_grad() -> tuple[torch.Tensor, torch.Tensor]:
            leaf = logits.clone().requires_grad_(True)
            loss = objective(leaf)
            loss.backward()
            assert leaf.grad is not None
            return loss.detach(), leaf.grad

        expected_loss, expected_grad = plain(expected_loss_and_grad)
        with self._get_local_tensor_mode():
            sharded = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_(True)
            with loss_parallel():
                loss = objective(sharded)
                assert isinstance(loss, DTensor)
                with CommDebugMode() as backward_mode:
                    loss.backward()
            self.assertEqual(backward_mode.get_comm_counts().get(funcol.all_reduce), 1)
            self.assertEqual(loss.placements, (Replicate(),))
            self.assert_every_rank_equals(loss.to_local(), expected_loss, "reused log_softmax")
            grad = sharded.grad
            assert isinstance(grad, DTensor)
            self.assert_class_shards(grad.to_local(), expected_grad, 1, "reused log_softmax")

    @with_comms
    def test_out_of_bounds_target_raises_before_any_collective(self) -> None:
        mesh = init_device_mesh("cpu", (self.world_size,))
        with self._get_local_tensor_mode():
            log_probs = distribute_tensor(torch.randn(3, 10).log_softmax(-1), mesh, [Shard(1)])
            with loss_parallel(), CommDebugMode() as comm_mode:
                with self.assertRaisesRegex(IndexError, "Target 10 is out of bounds"):
                    F.nll_loss(log_probs, torch.tensor([0, 10, 2]))
            self.assertEqual(comm_mode.get_total_counts(), 0)
