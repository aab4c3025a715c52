"""Small models for DTensor and tensor-parallel tests.

Module and parameter names follow PyTorch's test model zoo (``common_dtensor``), so that
parallelize plans written for those models (``{"net1": ColwiseParallel(), ...}``,
``"layers.0.attention.wq"``, ...) apply to these unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

if TYPE_CHECKING:
    from shardwise.mesh import DeviceMesh

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

    @staticmethod
    def parallelize(
        module: Transformer,
        device_mesh: DeviceMesh,
        use_seq_parallel: bool,
        local_output_for_attn: bool = False,
        *,
        loss_parallel: bool = False,
    ) -> Transformer:
        """Tensor-parallelize ``module`` in place over ``device_mesh`` (Megatron-style) and return it.

        ``device_mesh`` is 1-D, or n-D with a dim named ``"tp"`` (that dim is used).  Every block
        keeps whole attention heads on each rank: ``wq``/``wk``/``wv``/``w1`` are column-wise,
        ``wo``/``w2`` row-wise, so each block's forward needs one reduction after attention and
        one after the MLP.  The token embedding is sharded by vocabulary and the output
        projection column-wise (also by vocabulary), so a tied weight is laid out ``Shard(0)``
        for both and stays one parameter.

        ``use_seq_parallel``: between the blocks' tensor-parallel regions the activations stay
        sharded on the sequence dim (1) and the norms run on that shard (``SequenceParallel``);
        each reduction becomes a reduce-scatter and each region entry an all-gather.  The
        sequence length must then be a multiple of the tensor-parallel size.

        ``local_output_for_attn``: ``wq``/``wk``/``wv`` hand plain local tensors (this rank's
        heads) to attention instead of DTensors; each attention module's ``n_heads`` becomes the
        number of heads per rank.

        ``loss_parallel``: the logits are returned as a DTensor sharded on the vocabulary dim
        (``Shard(-1)``), to be consumed by ``F.cross_entropy`` inside
        ``shardwise.tp_styles.loss_parallel()``; otherwise they are gathered and returned as a
        plain tensor, replicated.

        Without sequence parallelism the norms keep plain parameters (as in PyTorch), so an
        optimizer over all parameters cannot use ``foreach=True`` (one foreach call cannot mix
        plain tensors and DTensors). Dropout modules are not parallelized: they run on each
        rank's local activations (replicated, or this rank's sequence shard), drawing from each
        rank's own generator.
        """
        from shardwise import tp_styles
        from shardwise.placement import Placement, Replicate, Shard

        if not isinstance(module, Transformer):
            raise TypeError(f"Transformer.parallelize expects a Transformer, got {type(module).__name__}")
        tp_mesh = _tensor_parallel_dim(device_mesh)
        tp_size = tp_mesh.size()
        n_heads = module.model_args.n_heads
        if n_heads % tp_size != 0:
            raise ValueError(
                f"Transformer.parallelize: n_heads={n_heads} must be a multiple of the tensor-parallel size "
                f"{tp_size}, so that every rank holds whole attention heads"
            )

        # Sequence-parallel activations are plain local tensors between the regions, sharded on
        # the sequence dim: dim 1 of (batch, seq, dim) activations, dim 0 of the (seq, dim)
        # position embeddings that are added to them.
        between_regions: Placement = Shard(1) if use_seq_parallel else Replicate()
        positions_layout: Placement = Shard(0) if use_seq_parallel else Replicate()

        root_plan: dict[str, tp_styles.ParallelStyle] = {
            # Vocabulary-sharded, as the (tied) output projection: each rank looks up the tokens
            # its rows hold, and the partial sums are reduced into the layout between regions.
            "tok_embeddings": tp_styles.RowwiseParallel(input_layouts=Replicate(), output_layouts=between_regions),
            # Sharded by feature rather than by position: moving a (seq, dim/tp) piece to its
            # final layout (all-gather, or all-to-all for sequence parallelism) is cheaper than
            # reducing full (seq, dim) partial sums, and needs no masking of absent rows.
            "pos_embeddings": tp_styles.ColwiseParallel(input_layouts=Replicate(), output_layouts=positions_layout),
            # Column-wise by vocabulary: its weight is Shard(0) like tok_embeddings' (weight tying).
            "output": tp_styles.ColwiseParallel(
                input_layouts=between_regions,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        }
        if use_seq_parallel:
            root_plan["norm"] = tp_styles.SequenceParallel()
        block_plan: dict[str, tp_styles.ParallelStyle] = {
            "attention.wq": tp_styles.ColwiseParallel(use_local_output=local_output_for_attn),
            "attention.wk": tp_styles.ColwiseParallel(use_local_output=local_output_for_attn),
            "attention.wv": tp_styles.ColwiseParallel(use_local_output=local_output_for_attn),
            "attention.wo": tp_styles.RowwiseParallel(output_layouts=between_regions),
            "feed_forward.w1": tp_styles.ColwiseParallel(input_layouts=between_regions),
            "feed_forward.w2": tp_styles.RowwiseParallel(output_layouts=between_regions),
        }
        if use_seq_parallel:
            block_plan["attention_norm"] = tp_styles.SequenceParallel()
            block_plan["ffn_norm"] = tp_styles.SequenceParallel()
            # One all-gather of the normed sequence shard, shared by wq, wk and wv.
            block_plan["attention"] = tp_styles.PrepareModuleInput(
                input_layouts=Shard(1), desired_input_layouts=Replicate()
            )
        plan = root_plan | {f"layers.*.{path}": style for path, style in block_plan.items()}
        tp_styles.parallelize_module(module, tp_mesh, plan)
        if use_seq_parallel:
            module.register_forward_pre_hook(_SequenceLengthCheck(tp_size), with_kwargs=True)

        if module.model_args.weight_tying:
            # Each style distributed its own copy of the tied weight; both are Shard(0) of the
            # same values, so keep one and share it again (one parameter, one gradient).
            module.output.weight = module.tok_embeddings.weight
        if local_output_for_attn:
            for layer in module.layers:
                cast(TransformerBlock, layer).attention.n_heads = n_heads // tp_size
        return module


class _SequenceLengthCheck:
    """Forward pre-hook of a sequence-parallel Transformer: the sequence must split evenly.

    Between regions each rank holds plain local tensors that the styles take as even shards
    of the sequence; an uneven split would give wrong global shapes, so it is refused before
    the first collective.
    """

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size

    def __call__(
        self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> None:
        tokens = args[0] if args else kwargs.get("tokens")
        if isinstance(tokens, torch.Tensor) and tokens.ndim == 2 and tokens.size(1) % self.tp_size != 0:
            raise ValueError(
                f"Transformer (sequence parallel over {self.tp_size} ranks): the sequence length {tokens.size(1)} "
                f"of tokens {tuple(tokens.shape)} must be a multiple of {self.tp_size}, so each rank holds an "
                "equal piece of the sequence"
            )


def _tensor_parallel_dim(device_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh dim tensor parallelism runs on: a 1-D mesh itself, else the dim named ``"tp"``."""
    from shardwise.mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"Transformer.parallelize: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.ndim == 1:
        return device_mesh
    names = device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        raise ValueError(
            f"Transformer.parallelize: a {device_mesh.ndim}-D device_mesh needs a dim named 'tp' (the tensor-parallel "
            f"dim), but its dims are named {device_mesh.mesh_dim_names}; pass the tensor-parallel sub-mesh instead"
        )
    return device_mesh["tp"]
