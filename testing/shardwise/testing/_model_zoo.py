"""Small models for DTensor and tensor-parallel tests.

Module and parameter names follow PyTorch's test model zoo (``common_dtensor``), so that
parallelize plans written for those models (``{"net1": ColwiseParallel(), ...}``,
``"layers.0.attention.wq"``, ...) apply to these unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

__all__ = [
    "Attention",
    "FeedForward",
    "MLPModule",
    "MLPStacked",
    "ModelArgs",
    "RMSNormPython",
    "Transformer",
    "TransformerBlock",
]

# MLPModule reseeds torch's generator with this before creating its layers, so every rank (and
# every instance) starts from the same weights without coordinating.
MLP_INIT_SEED = 5


class RMSNormPython(nn.Module):
    """Root-mean-square layer norm written with plain tensor ops (no fused kernel)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        mean_square = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(mean_square + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x) * self.weight


class MLPModule(nn.Module):
    """``net1`` (10 -> 16), ReLU, ``net2`` (16 -> 10); seeded, so all instances start equal."""

    def __init__(self, device: torch.device | str | None, bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(MLP_INIT_SEED)
        self.net1 = nn.Linear(10, 16, bias=bias, device=device)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 10, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.net2(self.relu(self.net1(x))))

    def reset_parameters(self) -> None:
        self.net1.reset_parameters()
        self.net2.reset_parameters()


class MLPStacked(nn.Module):
    """``n_layers`` MLPModules applied in sequence, held in ``layers``."""

    def __init__(self, device: torch.device | str | None, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLPModule(device) for _ in range(n_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.1
    use_attn_mask: bool = True  # causal attention
    weight_tying: bool = True  # the output projection shares the token embedding's weight
    checkpoint_activations: bool = False  # recompute each block's activations in backward


class Attention(nn.Module):
    """Multi-head self-attention: ``wq``/``wk``/``wv``/``wo`` projections without bias."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.dim % args.n_heads != 0:
            raise ValueError(
                f"Attention: dim={args.dim} must be a multiple of n_heads={args.n_heads} (each head gets dim // n_heads)"
            )
        self.head_dim = args.dim // args.n_heads
        self.n_heads = args.n_heads
        self.dropout_p = args.dropout_p
        self.resid_dropout = nn.Dropout(args.dropout_p)
        self.use_attn_mask = args.use_attn_mask
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def _split_heads(self, x: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
        # The head count is inferred (-1): under tensor parallelism a rank may see a local
        # tensor holding only its share of the heads.
        return x.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.size()
        queries = self._split_heads(self.wq(x), batch, seq_len)
        keys = self._split_heads(self.wk(x), batch, seq_len)
        values = self._split_heads(self.wv(x), batch, seq_len)
        attended = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            None,
            self.dropout_p if self.training else 0.0,
            self.use_attn_mask,
        )
        merged = attended.transpose(1, 2).contiguous().view(batch, seq_len, -1)
        return cast(torch.Tensor, self.resid_dropout(self.wo(merged)))


class FeedForward(nn.Module):
    """``w1`` (dim -> hidden_dim), GELU, ``w2`` (hidden_dim -> dim), dropout."""

    def __init__(self, dim: int, hidden_dim: int, dropout_p: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.resid_dropout(self.w2(self.gelu(self.w1(x)))))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``h + feed_forward(norm(h))``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, hidden_dim=4 * args.dim, dropout_p=args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + cast(torch.Tensor, self.feed_forward(self.ffn_norm(h)))


class Transformer(nn.Module):
    """A toy GPT-style decoder (in the spirit of nanoGPT): tokens (batch, seq) -> logits (batch, seq, vocab).

    Learned token and position embeddings, ``n_layers`` TransformerBlocks, a final LayerNorm and
    an output projection (``output``) that shares ``tok_embeddings.weight`` when
    ``weight_tying`` is set. Logits are returned in float32.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.vocab_size is None or args.max_seq_len is None:
            raise ValueError(
                f"Transformer needs vocab_size and max_seq_len, got vocab_size={args.vocab_size}, "
                f"max_seq_len={args.max_seq_len}"
            )
        self.model_args = args
        self.max_seq_len = args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight
        self.checkpoint_activations = args.checkpoint_activations

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _batch, seq_len = tokens.size()
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"Transformer: sequence length {seq_len} exceeds max_seq_len={self.max_seq_len} "
                "(the number of position embeddings)"
            )
        positions = torch.arange(0, seq_len, device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        h = self.dropout(h)
        for layer in self.layers:
            if self.checkpoint_activations:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        h = self.norm(h)
        return cast(torch.Tensor, self.output(h)).float()
