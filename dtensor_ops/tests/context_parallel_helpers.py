"""Shared checks of the context-parallel tests (CPU, GPU and local-tensor files)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.dtensor_ops.experimental._attention import context_parallel, context_parallel_unshard
from shardwise.dtensor_ops.experimental._cp_kernels import BlockKernel


def comm_counts(*comms: CommDebugMode) -> dict[str, int]:
    """The collectives counted by ``comms`` together, by op name."""
    total: dict[str, int] = {}
    for comm in comms:
        for op, count in comm.get_comm_counts().items():
            total[str(op)] = total.get(str(op), 0) + count
    return total


def attention_in_context(
    mesh: Any, buffers: Sequence[torch.Tensor], *, causal: bool, gqa: bool, backend: SDPBackend
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, int], dict[str, int]]:
    """SDPA forward and backward inside ``context_parallel``, used as PyTorch's CP tests use it.

    ``buffers`` are query, key, value and the output's gradient, whole; they are sharded by the
    context, ``requires_grad`` is set inside it and the output and gradients are unsharded before it
    closes. Returns this rank's output piece, the unsharded ``[out, dq, dk, dv]``, the forward's
    collectives and those of forward and backward together.
    """
    *pieces, grad_piece = buffers
    with context_parallel(mesh, buffers=list(buffers), buffer_seq_dims=[2] * len(buffers)):
        for piece in pieces:
            piece.requires_grad_(True)
        query, key, value = pieces
        with sdpa_kernel(backend):
            with CommDebugMode() as forward_comm:
                out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, enable_gqa=gqa)
            with CommDebugMode() as backward_comm:
                out.backward(grad_piece)
        grads = [piece.grad for piece in pieces if piece.grad is not None]
        assert len(grads) == 3, "query, key and value should all have a gradient"
        unsharded = context_parallel_unshard(mesh, [out.detach(), *grads], [2, 2, 2, 2])
        for piece in pieces:
            piece.requires_grad_(False)
    return out.detach(), unsharded, comm_counts(forward_comm), comm_counts(forward_comm, backward_comm)


def split_kv_matches_sdpa(kernel: BlockKernel, device: str, dtype: torch.dtype, causal: bool) -> list[float]:
    """Max errors of out, dq, dk, dv when ``kernel`` attends two key/value blocks and merges them by log-sum-exp.

    What one ring step does: the query attends an earlier block whole and its own block under the
    causal triangle (or both whole); the backward of each block uses the merged output and
    log-sum-exp.  Compared with SDPA on the concatenated keys.
    """
    generator = torch.Generator(device="cpu").manual_seed(11)
    length, scale = 64, 0.125
    query, key, value = (
        torch.randn(2, 4, length, 64, generator=generator).to(device=device, dtype=dtype) for _ in range(3)
    )
    reference = [t.clone().requires_grad_(True) for t in (query, key, value)]
    # Queries are the second half of the sequence; keys the whole of it: with a causal mask the first
    # key block is seen whole and the second under the triangle.
    expected = F.scaled_dot_product_attention(
        reference[0][:, :, length // 2 :], reference[1], reference[2], scale=scale,
        attn_mask=torch.ones(length // 2, length, dtype=torch.bool, device=device).tril(length // 2) if causal else None,
    )  # fmt: skip
    grad_out = torch.randn(expected.shape, generator=generator).to(device=device, dtype=dtype)
    expected.backward(grad_out)

    q = query[:, :, length // 2 :]
    blocks = [(key[:, :, : length // 2], value[:, :, : length // 2], False), (key[:, :, length // 2 :], value[:, :, length // 2 :], causal)]
    outs, lses = zip(*(kernel.forward(q, k, v, is_causal, scale) for k, v, is_causal in blocks))
    lse = torch.logaddexp(lses[0], lses[1])
    out = sum(o.float() * torch.exp(l - lse).unsqueeze(-1) for o, l in zip(outs, lses))
    assert isinstance(out, torch.Tensor)
    grads = [kernel.backward(grad_out, q, k, v, out.to(dtype), lse, is_causal, scale) for k, v, is_causal in blocks]
    grad_query = grads[0][0].float() + grads[1][0].float()
    grad_key = torch.cat([grads[0][1].float(), grads[1][1].float()], dim=2)
    grad_value = torch.cat([grads[0][2].float(), grads[1][2].float()], dim=2)
    assert reference[0].grad is not None and reference[1].grad is not None and reference[2].grad is not None
    return [
        float((out - expected.detach().float()).abs().max()),
        float((grad_query - reference[0].grad[:, :, length // 2 :].float()).abs().max()),
        float((grad_key - reference[1].grad.float()).abs().max()),
        float((grad_value - reference[2].grad.float()).abs().max()),
    ]
