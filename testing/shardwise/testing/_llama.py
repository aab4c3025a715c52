"""A Llama-style decoder for the model zoo: rotary embeddings, grouped-query attention, SwiGLU, RMSNorm.

Default sizes are torchtitan's Llama 3 ``debugmodel`` (dim 256, 6 layers, 16 heads, vocabulary
2048, feed-forward 768).  ``Llama.parallelize(model, tp_mesh)`` applies the usual tensor-parallel
plan; context parallelism needs nothing from the model but the positions of its tokens:
``model(tokens, positions)`` takes the global position of every local token, so that under
``context_parallel`` (whose load balancer permutes the sequence) each token is rotated by its
own position.  Attention is causal ``F.scaled_dot_product_attention``, which ``context_parallel``
runs as ring attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.mesh import DeviceMesh

__all__ = ["Llama", "LlamaArgs", "LlamaAttention", "LlamaBlock", "LlamaFeedForward", "RMSNorm", "rotary_cos_sin"]


@dataclass(frozen=True)
class LlamaArgs:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None  # None: as many as n_heads (no grouping), as torchtitan's debugmodel
    vocab_size: int = 2048
    ffn_hidden_dim: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def check(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaArgs: dim {self.dim} must be a multiple of n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaArgs: the head dim {self.head_dim} must be even (rotary embeddings rotate pairs)")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"LlamaArgs: n_heads {self.n_heads} must be a multiple of n_kv_heads {self.kv_heads}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normalized = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normalized.to(x.dtype) * self.weight


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``(len(positions), head_dim // 2)`` for the given (possibly permuted) positions."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64).unsqueeze(-1) * frequencies
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); pairs are (i, i + head_dim/2), Llama's "rotate half" form.
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism the projections hand over this rank's heads only.
        query = _rotate(self.wq(x).view(batch, seq, -1, self.head_dim), cos, sin).transpose(1, 2)
        key = _rotate(self.wk(x).view(batch, seq, -1, self.head_dim), cos, sin).transpose(1, 2)
        value = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=query.size(1) != key.size(1))
        return self.wo(attended.transpose(1, 2).reshape(batch, seq, -1))


class LlamaFeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = LlamaAttention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = LlamaFeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs = LlamaArgs()) -> None:
        super().__init__()
        args.check()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(LlamaBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)``; ``positions``: the global position of each of the ``seq`` tokens (default 0..seq-1)."""
        if positions is None:
            positions = torch.arange(tokens.size(1), device=tokens.device)
        if positions.shape != (tokens.size(1),):
            raise ValueError(f"Llama: positions must have shape ({tokens.size(1)},) like the tokens' sequence; got {tuple(positions.shape)}")
        x = self.tok_embeddings(tokens)
        cos, sin = rotary_cos_sin(positions, self.args.head_dim, self.args.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))

    @staticmethod
    def parallelize(module: Llama, tp_mesh: DeviceMesh) -> Llama:
        """Tensor parallelism over the 1-D ``tp_mesh``, in place: heads and feed-forward units split over ranks.

        ``wq``/``wk``/``wv``/``w1``/``w3`` column-wise (each rank its heads / hidden units, plain local
        outputs), ``wo``/``w2`` row-wise (one all-reduce each), the embedding row-wise (by vocabulary,
        one all-reduce), the output projection column-wise with gathered logits.  The norms stay plain
        replicated parameters.  Query and key/value heads must divide by the mesh size.
        """
        from shardwise import tp_styles
        from shardwise.placement import Replicate

        if not isinstance(module, Llama):
            raise TypeError(f"Llama.parallelize expects a Llama, got {type(module).__name__}")
        size = tp_mesh.size()
        if module.args.n_heads % size or module.args.kv_heads % size:
            raise ValueError(
                f"Llama.parallelize: {module.args.n_heads} query and {module.args.kv_heads} key/value heads must divide by the "
                f"tensor-parallel size {size}"
            )
        plan: dict[str, tp_styles.ParallelStyle] = {
            "tok_embeddings": tp_styles.RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": tp_styles.ColwiseParallel(output_layouts=Replicate()),
        }
        for index in range(len(module.layers)):
            prefix = f"layers.{index}"
            for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
                plan[f"{prefix}.{name}"] = tp_styles.ColwiseParallel()
            for name in ("attention.wo", "feed_forward.w2"):
                plan[f"{prefix}.{name}"] = tp_styles.RowwiseParallel()
        tp_styles.parallelize_module(module, tp_mesh, plan)
        return module
