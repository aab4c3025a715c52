"""Shared checks of the context-parallel tests (CPU and GPU files)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.dtensor_ops.experimental._cp_kernels import BlockKernel


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
