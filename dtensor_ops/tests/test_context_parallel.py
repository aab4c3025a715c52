"""context_parallel: ring attention against plain SDPA on the whole sequence, collective counts, layouts, bad input.

Each multi-rank test runs a sweep on every rank (one pool call), comparing the unsharded output and
dq/dk/dv with single-process ``F.scaled_dot_product_attention`` on the full sequence, and asserting
the exact collectives (CommDebugMode): all-to-all rotation ``W - 1`` forward and ``3W - 2`` forward +
backward; all-gather rotation one all-gather forward, one all-gather and ``W`` all-to-alls backward.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.dtensor_ops.experimental import context_parallel as exported_context_parallel
from shardwise.dtensor_ops.experimental._attention import (
    _CausalBehavior,
    _cp_options,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    _is_causal_behavior,
    _RotateMethod,
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)
from shardwise.dtensor_ops.experimental._cp_kernels import kernel_by_name
from shardwise.dtensor_ops.experimental._cp_layout import (
    SequenceLayout,
    contiguous_layout,
    head_tail_chunk_sizes,
    head_tail_layout,
)
from shardwise.dtensor_ops.experimental._cp_ring import BlockCall, RingSpec, block_calls
from shardwise.testing import multi_rank, run_on_ranks
from context_parallel_helpers import attention_in_context, split_kv_matches_sdpa

ALL_TO_ALL = "c10d_functional.all_to_all_single"
ALL_GATHER = "c10d_functional.all_gather_into_tensor"
KERNELS = {"flash_cpu": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def _reset_options() -> None:
    # Options are process state: pooled rank processes keep them from one test to the next.
    _cp_options.enable_load_balance = True
    set_rotate_method("allgather")


@pytest.fixture(autouse=True)
def _default_options() -> Any:
    yield
    _reset_options()


# -- pure: layouts, plans, options -----------------------------------------------------------------------


def test_head_tail_layout_is_pytorchs_permutation_when_2w_divides_the_length() -> None:
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer as TorchHeadTail

    for length, world in ((16, 2), (32, 4), (8, 4)):
        ours = _HeadTailLoadBalancer(length, world, "cpu")
        theirs = TorchHeadTail(length, world, "cpu")
        for restore in (False, True):
            assert ours._generate_indices(restore).tolist() == theirs._generate_indices(restore).tolist()


@pytest.mark.parametrize("length", [0, 1, 5, 7, 13, 17, 31])
def test_head_tail_layout_of_any_length_keeps_ranks_within_one_token(length: int) -> None:
    world = 4
    layout = head_tail_layout(length, world)
    lengths = layout.local_lengths()
    assert sum(lengths) == length
    assert max(lengths) - min(lengths) <= 1, lengths
    assert sorted(layout.order()) == list(range(length))
    sizes = head_tail_chunk_sizes(length, world)
    assert max(sizes) - min(sizes) <= 1
    restore = _HeadTailLoadBalancer(length, world, "cpu")._generate_indices(restore=True)[0]
    assert torch.tensor(layout.order())[restore].tolist() == list(range(length))


def test_layout_from_order_refuses_positions_out_of_order() -> None:
    with pytest.raises(ValueError, match="increasing order; rank 0 would hold \\[3, 1\\]"):
        SequenceLayout.from_order([3, 1, 0, 2], (2, 2))
    with pytest.raises(ValueError, match="permutation"):
        SequenceLayout.from_order([0, 0, 1, 2], (2, 2))


def _sdpa(tensors: Sequence[torch.Tensor], is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    query, key, value = tensors
    return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, enable_gqa=enable_gqa)


def _spec(layout: SequenceLayout, rank: int, causal: bool = True) -> RingSpec:
    return RingSpec("unused", rank, layout.world_size, layout, layout, causal, 1.0, 1, kernel_by_name("math"), "alltoall")


def test_causal_plan_balanced_does_half_a_block_per_step_as_pytorchs() -> None:
    # 16 tokens, 4 ranks, chunks of 2: rank 1 holds positions [2, 4) and [12, 14).
    layout = head_tail_layout(16, 4)
    spec = _spec(layout, rank=1)
    assert block_calls(spec, 1) == (BlockCall(0, 4, 0, 4, True),)
    assert block_calls(spec, 0) == (BlockCall(0, 4, 0, 2, False),)  # every query, the earlier half of keys
    assert block_calls(spec, 3) == (BlockCall(2, 4, 0, 4, False),)  # the later half of queries, every key
    assert block_calls(spec, 2) == (BlockCall(2, 4, 0, 4, False),)


def test_causal_plan_contiguous_skips_later_ranks() -> None:
    spec = _spec(contiguous_layout(10, 4), rank=1)  # chunks 3, 3, 3, 1
    assert block_calls(spec, 0) == (BlockCall(0, 3, 0, 3, False),)
    assert block_calls(spec, 1) == (BlockCall(0, 3, 0, 3, True),)
    assert block_calls(spec, 2) == ()
    assert block_calls(_spec(contiguous_layout(10, 4), rank=3, causal=False), 0) == (BlockCall(0, 1, 0, 3, False),)


def test_is_causal_behavior_is_pytorchs() -> None:
    """Port of PyTorch's RingAttentionTest.test_is_causal_behavior."""
    _cp_options.enable_load_balance = False
    assert _is_causal_behavior(rank=0, world_size=4, i=0, is_causal=False) == _CausalBehavior.NOT_IS_CAUSAL
    expected = [[_CausalBehavior.IS_CAUSAL, _CausalBehavior.SKIP], [_CausalBehavior.IS_CAUSAL, _CausalBehavior.NOT_IS_CAUSAL]]
    for rank, steps in enumerate(expected):
        for i, behaviour in enumerate(steps):
            assert _is_causal_behavior(rank=rank, world_size=2, i=i, is_causal=True) == behaviour
    _cp_options.enable_load_balance = True
    for rank in range(2):
        assert _is_causal_behavior(rank=rank, world_size=2, i=0, is_causal=True) == _CausalBehavior.IS_CAUSAL
        assert _is_causal_behavior(rank=rank, world_size=2, i=1, is_causal=True) == _CausalBehavior.NOT_IS_CAUSAL


def test_set_rotate_method() -> None:
    set_rotate_method("alltoall")
    assert _cp_options.rotate_method == _RotateMethod.ALL_TO_ALL
    set_rotate_method("allgather")
    assert _cp_options.rotate_method == _RotateMethod.ALL_GATHER
    set_rotate_method("ulysses")
    assert _cp_options.rotate_method == _RotateMethod.ULYSSES
    with pytest.raises(NotImplementedError, match="'ring'.*expected one of \\['allgather', 'alltoall', 'ulysses'\\]"):
        set_rotate_method("ring")


def test_exported_at_pytorchs_paths() -> None:
    import shardwise.dtensor_ops.experimental as experimental
    import torch.distributed.tensor.experimental._attention as torch_attention

    assert exported_context_parallel is context_parallel
    assert "context_parallel" in experimental.__all__
    from shardwise.dtensor_ops.experimental import _attention

    ours = set(_attention.__all__)
    missing = {name for name in torch_attention.__all__ if name not in ours}
    # The templated ring's internals are PyTorch's own; everything else is here.
    assert missing <= {"_templated_ring_attention"}, missing
    # PyTorch's newer package path holds the same objects.
    from shardwise.dtensor_ops.experimental._context_parallel import _attention as at_new_path
    from shardwise.dtensor_ops.experimental._context_parallel._load_balancer import _PTRRLoadBalancer

    assert at_new_path is _attention and _PTRRLoadBalancer is _attention._PTRRLoadBalancer


# -- multi-rank: numerics and counts -----------------------------------------------------------------------


def _attention_case(
    mesh: Any, *, causal: bool, balance: bool, rotate: str, kernel: str, length: int, kv_heads: int, dtype: torch.dtype
) -> tuple[list[float], dict[str, int], dict[str, int]]:
    """Max errors of out/dq/dk/dv against plain SDPA, forward counts, forward+backward counts."""
    torch.manual_seed(length * 7 + kv_heads)
    shape_q, shape_kv = (2, 4, length, 8), (2, kv_heads, length, 8)
    query, key, value = (torch.randn(s, dtype=dtype) for s in (shape_q, shape_kv, shape_kv))
    gqa = kv_heads != 4
    reference = [t.clone().requires_grad_(True) for t in (query, key, value)]
    with sdpa_kernel(KERNELS[kernel]):
        expected = _sdpa(reference, is_causal=causal, enable_gqa=gqa)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)

    _cp_options.enable_load_balance = balance
    set_rotate_method(rotate)
    buffers = [t.clone() for t in (query, key, value, grad_out)]
    _, unsharded, forward, total = attention_in_context(mesh, buffers, causal=causal, gqa=gqa, backend=KERNELS[kernel])
    wanted = [expected, *(t.grad for t in reference)]
    errors = [float((got.float() - want.float()).abs().max()) for got, want in zip(unsharded, wanted) if want is not None]
    return errors, forward, total


def _expected_counts(rotate: str, world: int) -> tuple[dict[str, int], dict[str, int]]:
    if rotate == "ulysses":  # q/k/v in, output back; the same two backward
        return {ALL_TO_ALL: 2}, {ALL_TO_ALL: 4}
    if rotate == "alltoall":
        return {ALL_TO_ALL: world - 1}, {ALL_TO_ALL: 3 * world - 2}
    return {ALL_GATHER: 1}, {ALL_GATHER: 2, ALL_TO_ALL: world}


def _sweep(lengths: tuple[int, ...], dtype: torch.dtype, tolerance: float, rotations: tuple[str, ...] = ("alltoall", "allgather")) -> None:
    _reset_options()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    failures = []
    for causal, balance, rotate, kernel, length, kv_heads in itertools.product(
        (True, False), (True, False), rotations, ("flash_cpu", "math"), lengths, (4, 2)
    ):
        if rotate == "ulysses" and kv_heads % world:
            continue  # refused (tested below)
        case = f"causal={causal} balance={balance} rotate={rotate} kernel={kernel} length={length} kv_heads={kv_heads}"
        errors, forward, total = _attention_case(
            mesh, causal=causal, balance=balance, rotate=rotate, kernel=kernel, length=length, kv_heads=kv_heads, dtype=dtype
        )
        expected_forward, expected_total = _expected_counts(rotate, world)
        if max(errors) > tolerance:
            failures.append(f"{case}: max errors out/dq/dk/dv {errors}")
        if forward != expected_forward or total != expected_total:
            failures.append(f"{case}: collectives forward {forward} (expected {expected_forward}), in all {total} (expected {expected_total})")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_matches_sdpa_on_the_whole_sequence(world_size: int) -> None:
    # 16 divides by 2W (PyTorch's case); 13 does not (uneven chunks, head-tail kept within one token).
    run_on_ranks(_sweep_float32, world_size=world_size, timeout=300)


def _sweep_float32() -> None:
    _sweep((16, 13), torch.float32, 2e-5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_matches_sdpa_on_the_whole_sequence(world_size: int) -> None:
    run_on_ranks(_sweep_ulysses, world_size=world_size, timeout=300)


def _sweep_ulysses() -> None:
    _sweep((16, 13), torch.float32, 2e-5, rotations=("ulysses",))


@multi_rank
def test_ulysses_refuses_heads_that_do_not_divide_by_the_mesh() -> None:
    _reset_options()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    set_rotate_method("ulysses")
    query = torch.randn(1, 6, 16, 4)

    def six_heads() -> None:
        with context_parallel(mesh, buffers=[query], buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(query, query, query, is_causal=True)

    _expect_error_everywhere(mesh, ValueError, "6 query and 6 key/value heads must both divide by the 4", six_heads)


@multi_rank
def test_a_rank_without_tokens_takes_the_kernel_the_others_take() -> None:
    """3 tokens on 4 ranks: rank 3 holds none. The kernel is chosen for the widest rank's shapes, so with
    ``sdpa_kernel`` forcing the CPU flash kernel (which refuses an empty sequence) every rank runs; before,
    rank 3 alone raised "No available kernel" while the others waited in the ring's collectives."""
    _reset_options()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    for balance, rotate, kv_heads in ((False, "alltoall", 2), (True, "allgather", 2), (False, "ulysses", 4)):
        errors, forward, total = _attention_case(
            mesh, causal=True, balance=balance, rotate=rotate, kernel="flash_cpu", length=3, kv_heads=kv_heads, dtype=torch.float32
        )
        assert max(errors) < 2e-5, (balance, rotate, errors)
        assert (forward, total) == _expected_counts(rotate, world), (rotate, forward, total)


@multi_rank
def test_ring_attention_bfloat16_merges_in_float32() -> None:
    _reset_options()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    for kernel in ("flash_cpu", "math"):
        errors, _, _ = _attention_case(
            mesh, causal=True, balance=True, rotate="alltoall", kernel=kernel, length=32, kv_heads=2, dtype=torch.bfloat16
        )
        # bf16 rounding of the output and of the gradients: one ulp at magnitude ~2.
        assert max(errors) < 3e-2, (kernel, errors)


@multi_rank
def test_ring_attention_float64_stays_float64() -> None:
    _reset_options()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for kernel in ("flash_cpu", "math"):
        errors, _, _ = _attention_case(
            mesh, causal=True, balance=True, rotate="alltoall", kernel=kernel, length=22, kv_heads=2, dtype=torch.float64
        )
        # Merging in float32 would leave ~1e-7.
        assert max(errors) < 1e-13, (kernel, errors)


@multi_rank
def test_forward_only_under_no_grad_counts_w_minus_1() -> None:
    _reset_options()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    set_rotate_method("alltoall")
    query = torch.randn(1, 2, 8 * world, 4)
    expected = F.scaled_dot_product_attention(query, query, query, is_causal=True)
    piece = query.clone()
    with context_parallel(mesh, buffers=[piece], buffer_seq_dims=[2]):
        with torch.no_grad(), CommDebugMode() as comm:
            out = F.scaled_dot_product_attention(piece, piece, piece, is_causal=True)
        (full,) = context_parallel_unshard(mesh, [out], [2])
    assert {str(k): v for k, v in comm.get_comm_counts().items()} == {ALL_TO_ALL: world - 1}
    torch.testing.assert_close(full, expected)


@multi_rank
def test_cross_attention_with_other_kv_length_non_causal() -> None:
    _reset_options()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    query, key, value = torch.randn(1, 2, 12, 4), torch.randn(1, 2, 20, 4), torch.randn(1, 2, 20, 4)
    expected = F.scaled_dot_product_attention(query, key, value)
    _cp_options.enable_load_balance = False
    pieces = [query.clone(), key.clone(), value.clone()]
    with context_parallel(mesh, buffers=pieces[:1], buffer_seq_dims=[2]):
        # key/value shared out by hand: contiguous even pieces of 20 / W tokens.
        local_key, local_value = (t.chunk(world, dim=2)[dist.get_rank()] for t in (key, value))
        out = F.scaled_dot_product_attention(pieces[0], local_key, local_value)
        (full,) = context_parallel_unshard(mesh, [out], [2])
    torch.testing.assert_close(full, expected)


@multi_rank
def test_buffers_restored_on_exit_unless_no_restore() -> None:
    _reset_options()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tokens = torch.arange(2 * 13).reshape(2, 13)
    positions = torch.arange(13.0)
    kept = tokens.clone()
    with context_parallel(mesh, buffers=[tokens, positions], buffer_seq_dims=[1, 0], no_restore_buffers={positions}):
        layout = head_tail_layout(13, world)
        mine = [p for start, stop in layout.segments[dist.get_rank()] for p in range(start, stop)]
        assert positions.tolist() == [float(p) for p in mine]  # positions follow the load balancer's permutation
        assert tokens.tolist() == kept[:, mine].tolist()
    assert torch.equal(tokens, kept)
    assert positions.tolist() == [float(p) for p in mine]  # not restored


def _expect_error_everywhere(mesh: Any, error: type[Exception], match: str, run: Any) -> None:
    """``run`` raises ``error`` on this rank, issues no collective, and the group still works afterwards."""
    with CommDebugMode() as comm:
        with pytest.raises(error, match=match):
            run()
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    alive = torch.ones(1)
    dist.all_reduce(alive)
    assert alive.item() == dist.get_world_size()


@multi_rank
def test_bad_input_raises_on_every_rank_before_any_collective_and_restores_buffers() -> None:
    _reset_options()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    query = torch.randn(1, 2, 16, 4)
    original = query.clone()
    labels = torch.zeros(1, 12)

    _expect_error_everywhere(
        mesh, ValueError, "disagree in length \\[16, 12\\]",
        lambda: context_parallel(mesh, buffers=[query, labels], buffer_seq_dims=[2, 1]).__enter__(),
    )  # fmt: skip
    _expect_error_everywhere(
        mesh, ValueError, "seq dim 4 of buffer 0 is out of range for its shape \\(1, 2, 16, 4\\)",
        lambda: context_parallel(mesh, buffers=[query], buffer_seq_dims=[4]).__enter__(),
    )  # fmt: skip
    mesh_2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("cp", "tp"))
    _expect_error_everywhere(
        mesh, ValueError, "needs a 1-D mesh .* got a 2-D mesh of shape \\(2, 2\\)",
        lambda: context_parallel(mesh_2d, buffers=[query], buffer_seq_dims=[2]).__enter__(),
    )  # fmt: skip
    _expect_error_everywhere(
        mesh, ValueError, "requires grad and cannot be resized",
        lambda: context_parallel(mesh, buffers=[query.clone().requires_grad_(True)], buffer_seq_dims=[2]).__enter__(),
    )  # fmt: skip
    assert torch.equal(query, original)

    def causal_with_other_lengths() -> None:
        with context_parallel(mesh, buffers=[query], buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(query, query[:, :, :2], query[:, :, :2], is_causal=True)

    _expect_error_everywhere(mesh, ValueError, "is_causal=True needs as many queries as keys", causal_with_other_lengths)
    assert torch.equal(query, original)

    def nested() -> None:
        with context_parallel(mesh, buffers=[query], buffer_seq_dims=[2]):
            with context_parallel(mesh, buffers=[labels], buffer_seq_dims=[1]):
                pass

    _expect_error_everywhere(mesh, RuntimeError, "cannot be nested", nested)
    assert torch.equal(query, original) and labels.shape == (1, 12)

    def with_mask() -> None:
        with context_parallel(mesh, buffers=[query], buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(query, query, query, attn_mask=torch.ones(4, 4, dtype=torch.bool))

    _expect_error_everywhere(mesh, ValueError, "attn_mask is not supported", with_mask)

    def with_gqa_mismatch() -> None:
        with context_parallel(mesh, buffers=[query], buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(query, query[:, :1], query[:, :1])

    _expect_error_everywhere(mesh, ValueError, "2 query heads against 1 key/value heads; expected .*enable_gqa=True", with_gqa_mismatch)
    assert torch.equal(query, original)
    # Outside the context SDPA is plain again.
    torch.testing.assert_close(F.scaled_dot_product_attention(query, query, query), F.scaled_dot_product_attention(original, original, original))


# -- DTensor inputs: CP x TP on a 2-D mesh, the module style ---------------------------------------------


@multi_rank
def test_cp_by_tp_dtensors_on_a_2d_mesh() -> None:
    """q/k/v DTensors sequence-sharded on "cp" and head-sharded on "tp": ring over cp only, exact."""
    _reset_options()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    torch.manual_seed(3)
    for causal, balance, rotate in itertools.product((True, False), (True, False), ("alltoall", "allgather", "ulysses")):
        _cp_options.enable_load_balance = balance
        set_rotate_method(rotate)
        query, key, value = (torch.randn(2, 4, 16, 8) for _ in range(3))
        reference = [t.clone().requires_grad_(True) for t in (query, key, value)]
        expected = _sdpa(reference, is_causal=causal)
        expected.sum().backward()
        order = _HeadTailLoadBalancer(16, 2, "cpu")._generate_indices()[0] if balance else torch.arange(16)
        placements = [Shard(2), Shard(1)]
        inputs = [distribute_tensor(t[:, :, order], mesh, placements).requires_grad_(True) for t in (query, key, value)]
        _enable_context_parallel_dispatcher()
        try:
            with CommDebugMode() as comm:
                out = _sdpa(inputs, is_causal=causal)
                out.sum().backward()
        finally:
            _disable_context_parallel_dispatcher()
        assert isinstance(out, DTensor) and out.placements == (Shard(2), Shard(1))
        restore = torch.argsort(order)
        torch.testing.assert_close(out.full_tensor()[:, :, restore], expected, atol=2e-5, rtol=1e-5)
        for got, ref in zip(inputs, reference):
            assert got.grad is not None and ref.grad is not None
            assert isinstance(got.grad, DTensor)
            torch.testing.assert_close(got.grad.full_tensor()[:, :, restore], ref.grad, atol=2e-5, rtol=1e-5)
        counts = {str(k): v for k, v in comm.get_comm_counts().items()}
        # Ring over the 2 cp ranks only; the ones(…)-gradient of sum() needs no communication.
        expected_counts = {"alltoall": {ALL_TO_ALL: 4}, "allgather": {ALL_GATHER: 2, ALL_TO_ALL: 2}, "ulysses": {ALL_TO_ALL: 4}}[rotate]
        assert counts == expected_counts, (causal, balance, rotate, counts)
    # Without the dispatcher, the same DTensors take the ordinary sharding rule (no ring).
    replicated = [distribute_tensor(t, mesh, [Replicate(), Shard(1)]) for t in (query, key, value)]
    plain = _sdpa(replicated)
    assert isinstance(plain, DTensor)
    torch.testing.assert_close(plain.full_tensor(), F.scaled_dot_product_attention(query, key, value))


@pytest.mark.parametrize("kernel", ["flash_cpu", "math"])
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_blocks_merged_by_lse_equal_sdpa_on_the_concatenation(kernel: str, causal: bool) -> None:
    errors = split_kv_matches_sdpa(kernel_by_name(kernel), "cpu", torch.float32, causal)
    assert max(errors) < 1e-5, errors
