"""context_parallel on 8 ranks simulated in one process (torch's LocalTensorMode), for speed.

The same checks as ``test_context_parallel.py`` (which runs 2 and 4 gloo ranks), without starting
processes: every simulated rank's unsharded output and dq/dk/dv equal single-process
``F.scaled_dot_product_attention`` on the full sequence, and the collectives are exactly the
algorithm's (CommDebugMode): all-to-all rotation ``W - 1`` forward and ``3W - 2`` forward +
backward, all-gather rotation one all-gather of key/value forward (one all-gather and ``W``
all-to-alls backward), Ulysses 2 all-to-alls each way.

The ring cases are a covering array of 6 runs over six two-valued factors (causal, load balanced,
rotation, grouped-query heads, an uneven length, CPU flash or math kernel): every pair of values of
any two factors occurs in some run, at a tenth of the 64 runs of the full product (which
``test_context_parallel.py`` covers on processes).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from shardwise.dtensor_ops import DTensor, Partial, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.dtensor_ops.experimental._attention import (
    _context_parallel_shard,
    _ContextParallel,
    _cp_options,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)
from shardwise.dtensor_ops.experimental._cp_layout import SequenceLayout, contiguous_layout, head_tail_layout
from shardwise.mesh import DeviceMesh
from shardwise.mesh._simulation import mode_disabled
from shardwise.testing import LocalDTensorTestBase, with_comms
from context_parallel_helpers import attention_in_context, comm_counts

WORLD = 8
ALL_TO_ALL = "c10d_functional.all_to_all_single"
ALL_GATHER = "c10d_functional.all_gather_into_tensor"
BACKENDS = {"flash_cpu": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
EVEN, UNEVEN = 32, 13  # 2W divides 32; 13 leaves rank 7 without a token in the contiguous layout
TOLERANCE = 2e-5


# A covering array of strength 2: six runs over six two-valued factors in which every pair of values of
# any two factors occurs (each column has three 1s; no two columns are equal or complementary).
_COVERING_ROWS = (
    (1, 1, 0, 0, 1, 1),
    (1, 0, 1, 0, 0, 0),
    (1, 0, 0, 1, 1, 0),
    (0, 1, 1, 0, 1, 0),
    (0, 1, 0, 1, 0, 1),
    (0, 0, 1, 1, 0, 1),
)
_FACTORS = {
    "causal": (False, True),
    "balance": (False, True),
    "rotate": ("alltoall", "allgather"),
    "kv_heads": (4, 2),  # 4 query heads: plain, or grouped-query attention
    "length": (EVEN, UNEVEN),
    "kernel": ("flash_cpu", "math"),
}


def _ring_cases() -> list[dict[str, Any]]:
    return [{name: values[bit] for (name, values), bit in zip(_FACTORS.items(), row)} for row in _COVERING_ROWS]


RING_CASES = _ring_cases()
# Ulysses needs heads divisible by W: 8 query heads, 8 key/value heads or 4 groups of 2 (16 query heads).
ULYSSES_CASES = [
    {"causal": True, "balance": True, "query_heads": 16, "length": UNEVEN},
    {"causal": True, "balance": False, "query_heads": 8, "length": EVEN},
    {"causal": False, "balance": True, "query_heads": 8, "length": UNEVEN},
    {"causal": False, "balance": False, "query_heads": 16, "length": EVEN},
]


def _name(case: dict[str, Any]) -> str:
    return "_".join(f"{key}_{value}" for key, value in case.items())


def _expected_counts(rotate: str, world: int) -> tuple[dict[str, int], dict[str, int]]:
    """Forward and forward + backward collectives of one attention call."""
    if rotate == "ulysses":
        return {ALL_TO_ALL: 2}, {ALL_TO_ALL: 4}
    if rotate == "alltoall":
        return {ALL_TO_ALL: world - 1}, {ALL_TO_ALL: 3 * world - 2}
    return {ALL_GATHER: 1}, {ALL_GATHER: 2, ALL_TO_ALL: world}


def _pieces(tensor: torch.Tensor) -> dict[int, torch.Tensor]:
    assert isinstance(tensor, LocalTensor), f"expected a LocalTensor (one piece per simulated rank), got {type(tensor).__name__}"
    return dict(tensor._local_tensors)


def _positions(layout: SequenceLayout, rank: int) -> list[int]:
    return [position for start, stop in layout.segments[rank] for position in range(start, stop)]


def _labelled(label: str) -> Callable[[str], str]:
    """An ``assert_close`` message: torch's own, prefixed with which case and rank differed."""
    return lambda message: f"{label}: {message}"


def _sdpa(tensors: Sequence[torch.Tensor], is_causal: bool, enable_gqa: bool = False) -> torch.Tensor:
    query, key, value = tensors
    return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, enable_gqa=enable_gqa)


def _copies(mode: LocalTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on every simulated rank (a ``LocalTensor`` of equal pieces)."""
    return mode.rank_map(lambda rank: tensor.clone())


def _reset_options() -> None:
    _cp_options.enable_load_balance = True
    set_rotate_method("allgather")


def test_ring_cases_cover_every_pair_of_factor_values() -> None:
    for first, second in itertools.combinations(_FACTORS, 2):
        seen = {(case[first], case[second]) for case in RING_CASES}
        assert seen == set(itertools.product(_FACTORS[first], _FACTORS[second])), (first, second, seen)


class ContextParallelLocalTensorTest(LocalDTensorTestBase):
    @property
    def world_size(self) -> int:
        return WORLD

    def tearDown(self) -> None:
        _reset_options()  # process state: the next test starts from PyTorch's defaults
        super().tearDown()

    # -- helpers -----------------------------------------------------------------------------------

    def assert_every_rank_close(self, tensor: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        by_rank = _pieces(tensor)
        self.assertEqual(sorted(by_rank), list(range(WORLD)))
        with mode_disabled():
            for rank, piece in by_rank.items():
                torch.testing.assert_close(piece.detach(), expected, atol=TOLERANCE, rtol=1e-5, msg=_labelled(f"{what}, simulated rank {rank}"))

    def assert_collectives(self, comm: CommDebugMode, expected: dict[str, int], what: str) -> None:
        self.assertEqual(comm_counts(comm), expected, what)

    def attention_case(
        self,
        mesh: DeviceMesh,
        *,
        causal: bool,
        balance: bool,
        rotate: str,
        length: int,
        query_heads: int,
        kv_heads: int,
        kernel: str = "flash_cpu",
    ) -> None:
        """Ring (or Ulysses) attention forward + backward inside ``context_parallel`` against SDPA on the full sequence."""
        what = f"causal={causal} balance={balance} rotate={rotate} length={length} heads={query_heads}/{kv_heads} kernel={kernel}"
        gqa = query_heads != kv_heads
        generator = torch.Generator().manual_seed(length * 7 + kv_heads)
        with mode_disabled():
            query = torch.randn(2, query_heads, length, 8, generator=generator)
            key, value = (torch.randn(2, kv_heads, length, 8, generator=generator) for _ in range(2))
            reference = [t.clone().requires_grad_(True) for t in (query, key, value)]
            with sdpa_kernel(BACKENDS[kernel]):
                expected = _sdpa(reference, is_causal=causal, enable_gqa=gqa)
            grad_out = torch.randn(expected.shape, generator=generator)
            expected.backward(grad_out)
        expected_forward, expected_total = _expected_counts(rotate, WORLD)
        layout = (head_tail_layout if balance else contiguous_layout)(length, WORLD)

        _cp_options.enable_load_balance = balance
        set_rotate_method(rotate)
        with self._get_local_tensor_mode() as mode:
            # Every simulated rank starts with the whole sequence; context_parallel keeps its share.
            buffers = [_copies(mode, t) for t in (query, key, value, grad_out)]
            out, unsharded, forward, total = attention_in_context(mesh, buffers, causal=causal, gqa=gqa, backend=BACKENDS[kernel])
        self.assertEqual({rank: piece.shape[2] for rank, piece in _pieces(out).items()}, dict(enumerate(layout.local_lengths())), what)
        self.assertEqual(forward, expected_forward, f"forward, {what}")
        self.assertEqual(total, expected_total, f"forward + backward, {what}")
        wanted: list[torch.Tensor | None] = [expected.detach(), *(t.grad for t in reference)]
        for name, got, want in zip(("output", "dq", "dk", "dv"), unsharded, wanted):
            assert want is not None
            self.assert_every_rank_close(got, want, f"{name}, {what}")

    # -- numerics and counts ----------------------------------------------------------------------

    @with_comms
    @parametrize("case", RING_CASES, name_fn=_name)
    def test_ring_attention_matches_sdpa(self, case: dict[str, Any]) -> None:
        self.attention_case(self.build_device_mesh(), query_heads=4, **case)

    @with_comms
    @parametrize("case", ULYSSES_CASES, name_fn=_name)
    def test_ulysses_matches_sdpa(self, case: dict[str, Any]) -> None:
        self.attention_case(self.build_device_mesh(), rotate="ulysses", kv_heads=8, **case)

    # -- sharding and restoring ---------------------------------------------------------------------

    @with_comms
    def test_each_rank_keeps_its_positions_and_buffers_come_back(self) -> None:
        mesh = self.build_device_mesh()
        with mode_disabled():
            tokens = torch.arange(2 * 29).reshape(2, 29)
            positions = torch.arange(29.0)
        layout = head_tail_layout(29, WORLD)
        with self._get_local_tensor_mode() as mode:
            kept_tokens = _copies(mode, tokens)
            kept_positions = _copies(mode, positions)
            with context_parallel(mesh, buffers=[kept_tokens, kept_positions], buffer_seq_dims=[1, 0], no_restore_buffers={kept_positions}):
                with mode_disabled():
                    for rank, piece in _pieces(kept_positions).items():
                        self.assertEqual(piece.tolist(), [float(p) for p in _positions(layout, rank)], f"rank {rank}")
                    for rank, piece in _pieces(kept_tokens).items():
                        self.assertEqual(piece.tolist(), tokens[:, _positions(layout, rank)].tolist(), f"rank {rank}")
            with mode_disabled():
                for rank, piece in _pieces(kept_tokens).items():
                    self.assertTrue(torch.equal(piece, tokens), f"rank {rank}: not restored")
                for rank, piece in _pieces(kept_positions).items():
                    self.assertEqual(piece.tolist(), [float(p) for p in _positions(layout, rank)], f"rank {rank}: restored")

    # -- bad input ----------------------------------------------------------------------------------

    def expect_refusal(self, error: type[Exception], match: str, run: Callable[[], Any]) -> None:
        """``run`` raises ``error`` before any collective."""
        with CommDebugMode() as comm:
            with self.assertRaisesRegex(error, match):
                run()
        self.assertEqual(comm.get_total_counts(), 0, str(comm_counts(comm)))

    @with_comms
    def test_bad_input_refused_before_any_collective_and_buffers_restored(self) -> None:
        mesh = self.build_device_mesh()
        mesh_2d = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("cp", "tp"))
        with mode_disabled():
            original = torch.randn(1, 4, 16, 4, generator=torch.Generator().manual_seed(2))
        with self._get_local_tensor_mode() as mode:
            query = _copies(mode, original)
            labels = mode.rank_map(lambda rank: torch.zeros(1, 12))

            def entered(*args: Any, **kwargs: Any) -> Callable[[], Any]:
                return lambda: context_parallel(*args, **kwargs).__enter__()

            self.expect_refusal(ValueError, "disagree in length \\[16, 12\\]", entered(mesh, buffers=[query, labels], buffer_seq_dims=[2, 1]))
            self.expect_refusal(ValueError, "seq dim 4 of buffer 0 is out of range", entered(mesh, buffers=[query], buffer_seq_dims=[4]))
            self.expect_refusal(ValueError, "needs a 1-D mesh .* 2-D mesh of shape \\(2, 4\\)", entered(mesh_2d, buffers=[query], buffer_seq_dims=[2]))
            self.expect_refusal(
                ValueError, "requires grad and cannot be resized", entered(mesh, buffers=[query.clone().requires_grad_(True)], buffer_seq_dims=[2])
            )

            def inside(attend: Callable[[], Any]) -> Callable[[], None]:
                def run() -> None:
                    with context_parallel(mesh, buffers=[query], buffer_seq_dims=[2]):
                        attend()

                return run

            # Inside the context every rank holds 2 of the 16 queries; one key is a sequence of 8.
            self.expect_refusal(
                ValueError, "is_causal=True needs as many queries as keys; the sequences have 16 queries and 8 keys",
                inside(lambda: F.scaled_dot_product_attention(query, query[:, :, :1], query[:, :, :1], is_causal=True)),
            )  # fmt: skip
            self.expect_refusal(
                ValueError, "attn_mask is not supported",
                inside(lambda: F.scaled_dot_product_attention(query, query, query, attn_mask=torch.ones(2, 2, dtype=torch.bool))),
            )  # fmt: skip
            self.expect_refusal(
                ValueError, "4 query heads against 3 key/value heads",
                inside(lambda: F.scaled_dot_product_attention(query, query[:, :3], query[:, :3], enable_gqa=True)),
            )  # fmt: skip
            set_rotate_method("ulysses")
            self.expect_refusal(
                ValueError, "4 query and 4 key/value heads must both divide by the 8",
                inside(lambda: F.scaled_dot_product_attention(query, query, query)),
            )  # fmt: skip
            set_rotate_method("allgather")

            def nested() -> None:
                with context_parallel(mesh, buffers=[query], buffer_seq_dims=[2]):
                    with context_parallel(mesh, buffers=[labels], buffer_seq_dims=[1]):
                        pass

            self.expect_refusal(RuntimeError, "cannot be nested", nested)
            with mode_disabled():
                for rank, piece in _pieces(query).items():
                    self.assertTrue(torch.equal(piece, original), f"rank {rank}: query not restored")
                self.assertEqual({tuple(piece.shape) for piece in _pieces(labels).values()}, {(1, 12)})

    @with_comms
    def test_more_bad_input_refused_before_any_collective(self) -> None:
        """The checks beyond the issue's list: arguments, attention shapes, the load balancer, the style, DTensor inputs."""
        mesh = self.build_device_mesh()
        mesh_2d = init_device_mesh("cpu", (4, 2), mesh_dim_names=("cp", "tp"))
        with mode_disabled():
            original = torch.randn(2, 8, 16, 4, generator=torch.Generator().manual_seed(5))
        with self._get_local_tensor_mode() as mode:
            query = _copies(mode, original)
            other = _copies(mode, original)

            def entered(*args: Any, **kwargs: Any) -> Callable[[], Any]:
                return lambda: context_parallel(*args, **kwargs).__enter__()

            self.expect_refusal(TypeError, "context_parallel expects a shardwise DeviceMesh, got str", entered("cpu", buffers=[query], buffer_seq_dims=[2]))
            self.expect_refusal(ValueError, "must have the same number of elements", entered(mesh, buffers=[query, other], buffer_seq_dims=[2]))
            self.expect_refusal(ValueError, "must be a subset of `buffers`", entered(mesh, buffers=[query], buffer_seq_dims=[2], no_restore_buffers={other}))
            self.expect_refusal(ValueError, "buffer 1 is given twice", entered(mesh, buffers=[query, query], buffer_seq_dims=[2, 2]))
            self.expect_refusal(
                TypeError, "buffer 0 is a DTensor; context parallel shards plain tensors",
                entered(mesh, buffers=[distribute_tensor(original, mesh, [Shard(0)])], buffer_seq_dims=[2]),
            )  # fmt: skip

            def inside(attend: Callable[[], Any]) -> Callable[[], None]:
                def run() -> None:
                    with context_parallel(mesh, buffers=[query, other], buffer_seq_dims=[2, 2]):
                        attend()

                return run

            sdpa = F.scaled_dot_product_attention
            for match, attend in (
                ("dropout_p=0.5 is not supported", lambda: sdpa(query, query, query, dropout_p=0.5)),
                ("batch sizes differ", lambda: sdpa(query, query[:1], query[:1])),
                ("must agree in heads and sequence", lambda: sdpa(query, query, query[:, :4])),
                ("query head dim 4 differs from key head dim 2", lambda: sdpa(query, query[..., :2], query[..., :2])),
                ("takes \\(batch, heads, seq, head_dim\\) tensors; query has shape", lambda: sdpa(query[0], query[0], query[0])),
            ):
                self.expect_refusal(ValueError, match, inside(attend))
            set_rotate_method("ulysses")
            self.expect_refusal(
                ValueError, "ulysses'\\): queries and keys must have the same length",
                inside(lambda: sdpa(query, query[:, :, :1], query[:, :, :1])),
            )  # fmt: skip
            set_rotate_method("allgather")
            with mode_disabled():
                for rank in range(WORLD):
                    self.assertTrue(torch.equal(_pieces(query)[rank], original) and torch.equal(_pieces(other)[rank], original))

            # Unsharding with a balancer laid out for another mesh; _context_parallel_shard's arguments.
            pieces = mode.rank_map(lambda rank: original[:, :, 2 * rank : 2 * rank + 2].clone())
            self.expect_refusal(
                ValueError, "the load balancer gives rank 0 4 of 16 tokens over 4 ranks; the buffers hold 2 over 8",
                lambda: context_parallel_unshard(mesh, [pieces], [2], load_balancer=_HeadTailLoadBalancer(16, 4, "cpu")),
            )  # fmt: skip
            self.expect_refusal(
                ValueError, "lays out 16 tokens over 4 ranks; the buffers have 16 tokens over a mesh of 8",
                lambda: _context_parallel_shard(mesh, [query], [2], load_balancer=_HeadTailLoadBalancer(16, 4, "cpu")),
            )  # fmt: skip
            self.expect_refusal(ValueError, "pytree structure", lambda: _context_parallel_shard(mesh, [query, [other, other]], [2, 2]))  # type: ignore[list-item]
            self.expect_refusal(TypeError, "buffer 0 is a str; expected a torch.Tensor or a flex_attention BlockMask", lambda: _context_parallel_shard(mesh, ["mask"], [2]))  # type: ignore[list-item]
            self.expect_refusal(
                ValueError, "unknown attention type 'flex'",
                lambda: _ContextParallel(seq_dim=2, attention_type="flex"),  # type: ignore[arg-type]
            )  # fmt: skip
            self.expect_refusal(
                ValueError, "sequence dim of .* attention inputs is 2; got 1",
                lambda: _ContextParallel(seq_dim=1, attention_type=_ContextParallel.AttentionType.SDPA),
            )  # fmt: skip
            self.expect_refusal(ValueError, "needs a 1-D mesh", lambda: _ContextParallel(2, _ContextParallel.AttentionType.SDPA)._apply(nn.Module(), mesh_2d))

            # DTensor inputs under the dispatcher.
            sharded = distribute_tensor(original, mesh_2d, [Shard(2), Shard(1)])
            by_heads = distribute_tensor(original, mesh_2d, [Shard(1), Shard(2)])
            partial = DTensor.from_local(mode.rank_map(lambda rank: original[:, :, :4].clone()), mesh_2d, [Shard(2), Partial()], run_check=False)
            _enable_context_parallel_dispatcher()
            try:
                self.expect_refusal(TypeError, "must all be DTensors or all plain tensors", lambda: sdpa(sharded, original, original))
                self.expect_refusal(ValueError, "key is laid out as \\(Shard\\(dim=1\\), Shard\\(dim=2\\)\\)", lambda: sdpa(sharded, by_heads, sharded))
                self.expect_refusal(ValueError, "Partial inputs .* must be reduced first", lambda: sdpa(partial, partial, partial))
            finally:
                _disable_context_parallel_dispatcher()

    # -- DTensor inputs and the module style -------------------------------------------------------

    @with_comms
    def test_cp_by_tp_dtensors_on_a_4x2_mesh(self) -> None:
        """q/k/v sequence-sharded over "cp" (4) and head-sharded over "tp" (2): the ring crosses cp only."""
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("cp", "tp"))
        cp = mesh.shape[0]
        with mode_disabled():
            generator = torch.Generator().manual_seed(3)
            query, key, value = (torch.randn(2, 8, 16, 4, generator=generator) for _ in range(3))
            reference = [t.clone().requires_grad_(True) for t in (query, key, value)]
            expected = _sdpa(reference, is_causal=True)
            expected.sum().backward()
            order = _HeadTailLoadBalancer(16, cp, "cpu")._generate_indices()[0]
            restore = torch.argsort(order)
        for rotate in ("alltoall", "ulysses"):  # the all-gather ring takes the same DTensor path as the all-to-all one
            set_rotate_method(rotate)
            with self._get_local_tensor_mode():
                inputs = [distribute_tensor(t[:, :, order], mesh, [Shard(2), Shard(1)]).requires_grad_(True) for t in (query, key, value)]
                _enable_context_parallel_dispatcher()
                try:
                    with CommDebugMode() as comm:
                        out = _sdpa(inputs, is_causal=True)
                        out.sum().backward()
                finally:
                    _disable_context_parallel_dispatcher()
                assert isinstance(out, DTensor)
                self.assertEqual(out.placements, (Shard(2), Shard(1)))
                # sum()'s gradient needs no communication: the attention's own collectives over the 4 cp ranks.
                self.assert_collectives(comm, _expected_counts(rotate, cp)[1], f"forward + backward, {rotate}")
                results = [out.full_tensor()] + [t.grad.full_tensor() for t in inputs if isinstance(t.grad, DTensor)]
            wanted: list[torch.Tensor | None] = [expected.detach(), *(t.grad for t in reference)]
            self.assertEqual(len(results), 4)
            for name, got, want in zip(("output", "dq", "dk", "dv"), results, wanted):
                assert want is not None
                with mode_disabled():
                    got_in_order = {rank: piece[:, :, restore] for rank, piece in _pieces(got).items()}
                self.assert_every_rank_close(LocalTensor(got_in_order), want, f"{name}, {rotate}")

    @with_comms
    def test_context_parallel_style_with_head_tail_balancer(self) -> None:
        """``_context_parallel_shard`` + ``_ContextParallel`` on a module, ``context_parallel_unshard`` with the balancer."""

        class Attention(nn.Module):
            def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
                return F.scaled_dot_product_attention(query, key, value, is_causal=True)

        mesh = self.build_device_mesh()
        with mode_disabled():
            generator = torch.Generator().manual_seed(4)
            query, key, value = (torch.randn(1, 2, 24, 4, generator=generator) for _ in range(3))
            expected = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        module = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)._apply(Attention(), mesh)
        set_rotate_method("alltoall")
        balancer = _HeadTailLoadBalancer(24, WORLD, "cpu")
        with self._get_local_tensor_mode():
            pieces = _context_parallel_shard(mesh, [query, key, value], [2, 2, 2], load_balancer=balancer)
            with CommDebugMode() as comm:
                out = module(*pieces)
            (full,) = context_parallel_unshard(mesh, [out], [2], load_balancer=balancer)
        self.assert_collectives(comm, {ALL_TO_ALL: WORLD - 1}, "forward")
        self.assert_every_rank_close(full, expected, "output")


instantiate_parametrized_tests(ContextParallelLocalTensorTest)

