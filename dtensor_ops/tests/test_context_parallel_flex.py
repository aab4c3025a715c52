"""Context parallelism for flex_attention, and the per-document and PTRR load balancers.

Layouts are compared with PyTorch's own balancers where PyTorch accepts the case (every document or
block count dividing evenly) and checked for their promise where it does not.  Across ranks, a module
under ``_ContextParallel(FLEX)`` with the ``BlockMask`` from ``_context_parallel_shard`` must give
exactly the rows of ``flex_attention`` on the whole sequence, for every balancer and uneven lengths,
with one all-gather forward (key and value together) and one reduce-scatter backward.  Flex's own
backward does not run on CPU (torch refuses it), so the gradients are checked through a module that
applies the same CP mask densely with SDPA.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.experimental._attention import (
    _PerDocumentHeadTailLoadBalancer as TorchPerDocumentHeadTailLoadBalancer,
)
from torch.distributed.tensor.experimental._attention import _PTRRLoadBalancer as TorchPTRRLoadBalancer
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

from shardwise.dtensor_ops import init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.dtensor_ops.experimental._attention import (
    _context_parallel_shard,
    _ContextParallel,
    _create_cp_block_mask,
    _HeadTailLoadBalancer,
    _LoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _PTRRLoadBalancer,
    context_parallel_unshard,
)
from shardwise.dtensor_ops.experimental._cp_layout import head_tail_chunk_sizes, ptrr_groups
from shardwise.testing import multi_rank, run_on_ranks
from context_parallel_helpers import comm_counts

ALL_GATHER = "c10d_functional.all_gather_into_tensor"
REDUCE_SCATTER = "c10d_functional.reduce_scatter_tensor"

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")


def _documents_of(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((length,), doc) for doc, length in enumerate(lengths)])


def _document_causal(document_rows: list[list[int]]) -> Callable[..., torch.Tensor]:
    """A document-causal mask_mod (a token sees earlier tokens of its own document), per batch row."""
    document_ids = torch.stack([_documents_of(row) for row in document_rows])

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        row = b if document_ids.size(0) > 1 else 0
        return (document_ids[row, q_idx] == document_ids[row, kv_idx]) & (q_idx >= kv_idx)

    return mask_mod


# -- pure: the balancers' layouts --------------------------------------------------------------------------


def _causal_work(order: list[int], documents: list[int], world_size: int) -> list[int]:
    """Per rank, the (query, key) pairs a document-causal mask keeps, when rank r holds the r-th 1/W of ``order``."""
    starts = [sum(documents[:i]) for i in range(len(documents))]
    document_start = [starts[doc] for doc, length in enumerate(documents) for _ in range(length)]
    share = len(order) // world_size
    return [sum(p - document_start[p] + 1 for p in order[r * share : (r + 1) * share]) for r in range(world_size)]


def test_per_document_head_tail_is_pytorchs_documented_layout_and_balances_where_pytorchs_does_not() -> None:
    # PyTorch's docstring (documents 4, 8, 4 on 2 ranks): rank 0 holds 0, 3 | 4, 5, 10, 11 | 12, 15.
    ours = _PerDocumentHeadTailLoadBalancer([[4, 8, 4]], 2, "cpu")
    assert ours._generate_indices()[0, :8].tolist() == [0, 3, 4, 5, 10, 11, 12, 15]
    restore = ours._generate_indices(restore=True)[0]
    assert torch.equal(ours._generate_indices()[0][restore], torch.arange(16))
    # PyTorch's implementation orders document by document, so a contiguous share can take whole
    # documents: on documents 4 and 12 its ranks do 26 and 62 units of causal work; ours 44 and 44.
    documents = [4, 12]
    theirs = TorchPerDocumentHeadTailLoadBalancer([documents], 2, "cpu")._generate_indices()[0].tolist()
    assert _causal_work(theirs, documents, 2) == [26, 62]
    assert _causal_work(_PerDocumentHeadTailLoadBalancer([documents], 2, "cpu")._generate_indices()[0].tolist(), documents, 2) == [44, 44]


def test_per_document_head_tail_cuts_any_document_length() -> None:
    world_size, documents = 2, [7, 10, 1]
    (layout,) = _PerDocumentHeadTailLoadBalancer([documents], world_size, "cpu")._row_layouts()
    start = 0
    for length in documents:
        sizes = head_tail_chunk_sizes(length, world_size)
        chunk_starts = [start + sum(sizes[:i]) for i in range(len(sizes))]
        for rank in range(world_size):
            held = {p for s, e in layout.segments[rank] for p in range(s, e)}
            for chunk in (rank, 2 * world_size - 1 - rank):
                assert set(range(chunk_starts[chunk], chunk_starts[chunk] + sizes[chunk])) <= held
        start += length
    assert sorted(layout.order()) == list(range(sum(documents)))
    assert max(layout.local_lengths()) - min(layout.local_lengths()) <= len(documents)


def test_per_document_rows_must_add_up_alike() -> None:
    with pytest.raises(ValueError, match=r"batch rows hold \[8, 9\] tokens"):
        _PerDocumentHeadTailLoadBalancer([[4, 4], [9]], 2, "cpu")


def test_ptrr_scheduling_is_pytorchs() -> None:
    process_time = torch.tensor([9, 14, 2, 20, 10, 15, 8, 14, 16, 19, 15, 3, 12, 1, 12, 10])
    assert torch.equal(_PTRRLoadBalancer.ptrr_scheduling(process_time, 4), TorchPTRRLoadBalancer.ptrr_scheduling(process_time, 4))


@pytest.mark.parametrize("world_size", [2, 4])
def test_ptrr_balancer_is_pytorchs_on_a_document_mask(world_size: int) -> None:
    rows = [[256, 512, 256], [640, 384]]
    block_mask = create_block_mask(_document_causal(rows), 2, 1, 1024, 1024, device="cpu")
    ours, theirs = _PTRRLoadBalancer(block_mask, world_size), TorchPTRRLoadBalancer(block_mask, world_size)
    for restore in (False, True):
        assert torch.equal(ours._generate_indices(restore=restore), theirs._generate_indices(restore=restore))


def test_ptrr_deals_any_number_of_blocks() -> None:
    work = [5, 1, 4, 4, 2, 9, 3]
    groups = ptrr_groups(work, 3)
    assert sorted(block for group in groups for block in group) == list(range(len(work)))
    assert max(map(len, groups)) - min(map(len, groups)) <= 1
    assert all(group == sorted(group) for group in groups)
    # A partial last block: the layout still covers every token once.
    block_mask = create_block_mask(_document_causal([[300]]), 1, 1, 300, 300, device="cpu")
    (layout,) = _PTRRLoadBalancer(block_mask, 2)._row_layouts()
    assert sorted(layout.order()) == list(range(300))
    with pytest.raises(ValueError, match="make 3 blocks, fewer than the 4 ranks"):
        _PTRRLoadBalancer(block_mask, 4)


def test_a_balancer_with_rows_is_refused_where_one_permutation_is_needed() -> None:
    balancer = _PerDocumentHeadTailLoadBalancer([[8, 8], [4, 12]], 2, "cpu")
    with pytest.raises(ValueError, match="rearranges each of the 2 batch rows its own way"):
        balancer._layout()


def test_flex_style_accepted_and_bad_styles_refused() -> None:
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)
    assert style.attention_type is _ContextParallel.AttentionType.FLEX
    with pytest.raises(ValueError, match="unknown attention type"):
        _ContextParallel(seq_dim=2, attention_type="flex")  # type: ignore[arg-type]


# -- multi-rank: flex attention under _ContextParallel ------------------------------------------------------


class FlexAttention(nn.Module):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
        out: torch.Tensor = flex_attention(query, key, value, block_mask=block_mask)
        return out


class DenseMaskAttention(nn.Module):
    """What ``FlexAttention`` computes, with the BlockMask's mask_mod made dense: differentiable on CPU."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
        mask = create_mask(block_mask.mask_mod, query.size(0), 1, query.size(2), key.size(2), device=query.device)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)


def _balancer(kind: str, documents: list[list[int]], length: int, world: int, full_mask: BlockMask) -> _LoadBalancer | None:
    if kind == "none":
        return None
    if kind == "head_tail":
        return _HeadTailLoadBalancer(length, world, "cpu")
    if kind == "per_document":
        return _PerDocumentHeadTailLoadBalancer(documents, world, "cpu")
    return _PTRRLoadBalancer(full_mask, world)


def _flex_case(mesh: Any, balancer_kind: str, documents: list[list[int]], backward: bool) -> list[str]:
    world = mesh.size()
    length, batch = sum(documents[0]), 2
    torch.manual_seed(length + len(documents))
    query, key, value = (torch.randn(batch, 4, length, 8) for _ in range(3))
    mask_mod = _document_causal(documents)
    full_mask = create_block_mask(mask_mod, batch, 1, length, length, device="cpu")
    module = DenseMaskAttention() if backward else FlexAttention()
    _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)._apply(module, mesh)
    balancer = _balancer(balancer_kind, documents, length, world, full_mask)
    reference = [t.clone().requires_grad_(backward) for t in (query, key, value)]
    expected = (DenseMaskAttention() if backward else FlexAttention())(*reference, full_mask)
    grad_out = torch.randn_like(expected)
    if backward:
        expected.backward(grad_out)

    pieces = _context_parallel_shard(mesh, [query, key, value, grad_out, full_mask], [2, 2, 2, 2, 0], load_balancer=balancer)
    *qkv, grad_piece, cp_mask = pieces
    qkv = [t.requires_grad_(backward) for t in qkv]
    case = f"world={world} balancer={balancer_kind} documents={documents} backward={backward}"
    failures = []
    if backward:
        # Collectives are counted here only: torch 2.13's eager flex_attention cannot run under a
        # dispatch mode such as CommDebugMode (PyTorch's own fails the same way); the hook is the same.
        with CommDebugMode() as comm:
            out = module(*qkv, cp_mask)
            out.backward(grad_piece)
        if comm_counts(comm) != {ALL_GATHER: 1, REDUCE_SCATTER: 1}:
            failures.append(f"{case}: collectives {comm_counts(comm)}, expected one all-gather and one reduce-scatter")
        results, wanted = [out.detach(), *(t.grad for t in qkv)], [expected.detach(), *(t.grad for t in reference)]
    else:
        out = module(*qkv, cp_mask)
        results, wanted = [out], [expected]
    unsharded = context_parallel_unshard(mesh, results, [2] * len(results), load_balancer=balancer)
    for name, got, want in zip(("out", "dq", "dk", "dv"), unsharded, wanted):
        if not torch.allclose(got, want, atol=2e-5, rtol=1e-4):
            failures.append(f"{case}: {name} differs by {float((got - want).abs().max())}")
    return failures


def _flex_sweep() -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    failures: list[str] = []
    # One document layout for the whole batch (divisible and not) and one per batch row.
    layouts = [[[256, 128, 128]], [[130, 70]], [[64 * world, 256 - 64 * world], [128, 128]]]
    for balancer_kind, documents, backward in itertools.product(("none", "head_tail", "per_document", "ptrr"), layouts, (False, True)):
        if balancer_kind == "head_tail" and len(documents) > 1:
            continue  # the same as one row
        if balancer_kind == "ptrr" and sum(documents[0]) < 128 * world:
            continue  # fewer 128-token blocks than ranks: refused (tested above)
        failures += _flex_case(mesh, balancer_kind, documents, backward)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", [2, 4])
def test_flex_attention_under_context_parallel_matches_the_whole_sequence(world_size: int) -> None:
    run_on_ranks(_flex_sweep, world_size=world_size, timeout=600)


@multi_rank
def test_create_cp_block_mask_takes_the_default_balancer_and_any_length() -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    length = 150  # neither 2W nor W * 128 divides it
    mask_mod = _document_causal([[length]])
    cp_mask = _create_cp_block_mask(mask_mod, 1, 1, length, length, mesh)
    query = torch.randn(1, 2, length, 8)
    balancer = _HeadTailLoadBalancer(length, world, "cpu")
    (piece,) = _context_parallel_shard(mesh, [query], [2], load_balancer=balancer)
    dense = create_mask(cp_mask.mask_mod, 1, 1, piece.size(2), length, device="cpu")[0, 0]
    (layout,) = balancer._row_layouts()
    rank_positions = [p for s, e in layout.segments[dist.get_rank()] for p in range(s, e)]
    expected = torch.tensor(rank_positions)[:, None] >= torch.tensor(layout.order())[None, :]
    assert torch.equal(dense, expected)


@multi_rank
def test_flex_bad_input_raises_on_every_rank_before_any_collective() -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    module = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)._apply(FlexAttention(), mesh)
    query = torch.randn(1, 2, 8, 4)

    def expect(error: type[Exception], match: str, run: Callable[[], Any]) -> None:
        with CommDebugMode() as comm:
            with pytest.raises(error, match=match):
                run()
        assert comm.get_total_counts() == 0, comm.get_comm_counts()

    expect(TypeError, r"\['value'\] are not tensors", lambda: module(query, query, None, None))
    expect(ValueError, "must share dtype", lambda: module(query, query, query.double(), None))
    per_row = _PerDocumentHeadTailLoadBalancer([[8, 8], [4, 12]], world, "cpu")
    expect(
        ValueError, "rearranges 2 batch rows; a buffer of shape \\(3, 2, 16, 4\\)",
        lambda: _context_parallel_shard(mesh, [torch.randn(3, 2, 16, 4)], [2], load_balancer=per_row),
    )  # fmt: skip
    alive = torch.ones(1)
    dist.all_reduce(alive)
    assert alive.item() == world


@multi_rank
def test_compiled_flex_attention_under_context_parallel_is_one_frame() -> None:
    """A compiled function calling the module: one frame, the key/value all-gather and flex_attention in its graph."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    length = 256
    query, key, value = (torch.randn(1, 2, length, 8) for _ in range(3))
    block_mask = create_block_mask(_document_causal([[100, 156]]), 1, 1, length, length, device="cpu")
    expected = FlexAttention()(query, key, value, block_mask)
    module = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)._apply(FlexAttention(), mesh)
    balancer = _PerDocumentHeadTailLoadBalancer([[100, 156]], world, "cpu")
    *qkv, cp_mask = _context_parallel_shard(mesh, [query, key, value, block_mask], [2, 2, 2, 0], load_balancer=balancer)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q, k, v, mask: module(q, k, v, mask), backend=counter, fullgraph=True)
    out = compiled(*qkv, cp_mask)
    (whole,) = context_parallel_unshard(mesh, [out], [2], load_balancer=balancer)
    torch.testing.assert_close(whole, expected, atol=2e-5, rtol=1e-4)
    assert counter.frame_count == 1
    targets = [str(node.target) for node in counter.graphs[0].graph.nodes if node.op == "call_function"]
    assert sum("all_gather_into_tensor" in target for target in targets) == 1, targets
    assert any("flex_attention" in target.lower() for target in targets), targets


@multi_rank(world_size=2)
def test_flex_cp_allgather_is_a_checked_custom_op_gathering_key_and_value() -> None:
    from shardwise.dtensor_ops.experimental._context_parallel._cp_custom_ops import flex_cp_allgather

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    group_name = mesh.get_group().group_name
    rank = dist.get_rank()
    key = torch.arange(32.0).reshape(1, 2, 4, 4) + 100 * rank
    value = torch.arange(16.0).reshape(1, 2, 4, 2) - 100 * rank
    gathered_key, gathered_value = flex_cp_allgather(key, value, 2, group_name)
    whole_key = torch.cat([torch.arange(32.0).reshape(1, 2, 4, 4) + 100 * r for r in range(dist.get_world_size())], dim=2)
    whole_value = torch.cat([torch.arange(16.0).reshape(1, 2, 4, 2) - 100 * r for r in range(dist.get_world_size())], dim=2)
    assert torch.equal(gathered_key, whole_key) and torch.equal(gathered_value, whole_value)
    # Fake kernel, schema and autograd registration checked by torch.  (A custom op is opaque to
    # CommDebugMode, PyTorch's too: its collectives are not counted.)
    torch.library.opcheck(flex_cp_allgather, (key.clone().requires_grad_(True), value.clone().requires_grad_(True), 2, group_name))
    leaf_key, leaf_value = key.clone().requires_grad_(True), value.clone().requires_grad_(True)
    out_key, out_value = flex_cp_allgather(leaf_key, leaf_value, 2, group_name)
    (out_key.sum() + 2 * out_value.sum()).backward()
    # Every rank's whole-sequence gradient is all ones (twos for value): each piece sums W of them.
    world = dist.get_world_size()
    assert torch.equal(leaf_key.grad, torch.full_like(key, float(world)))
    assert torch.equal(leaf_value.grad, torch.full_like(value, 2.0 * world))
