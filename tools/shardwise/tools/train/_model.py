"""The models: the toy Transformer and the Llama of ``shardwise.testing``, with their tensor-parallel plans."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from shardwise.dtensor_ops import DTensor
from shardwise.mesh import DeviceMesh
from shardwise.testing import Llama, LlamaArgs, ModelArgs, Transformer

from ._config import TrainConfig

__all__ = [
    "model_args",
    "build_model",
    "build_llama",
    "build_any_model",
    "parallelize_transformer",
    "parallelize_llama",
    "fully_shard_transformer",
    "build_auto_parallel_model",
    "build_optimizer",
]


def model_args(config: TrainConfig, vocab_size: int) -> ModelArgs:
    # No dropout: the parity check compares against a single-process run, and dropout masks drawn
    # on sharded activations cannot match the masks of one process bit for bit.
    return ModelArgs(
        n_layers=config.n_layers,
        vocab_size=vocab_size,
        max_seq_len=config.seq_len,
        dim=config.dim,
        n_heads=config.n_heads,
        dropout_p=0.0,
        use_attn_mask=True,
        weight_tying=True,
    )


def build_model(args: ModelArgs, seed: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Transformer:
    """The same initial weights in every process that calls this with the same seed."""
    torch.manual_seed(seed)
    model = Transformer(args)
    _init_small_weights(model, args.n_layers)
    return model.to(device=device, dtype=dtype)


INIT_STD = 0.02


def _init_small_weights(model: Transformer, n_layers: int) -> None:
    """GPT-2's initialisation instead of PyTorch's defaults.

    With the defaults the tied embedding is N(0, 1), so the first logits have a standard
    deviation of about sqrt(dim) and the first loss is ten times log(vocab): the loss curve
    would show the model unlearning its initialisation rather than learning the text.
    Projections into the residual stream are scaled down by the depth, as GPT-2 does.
    """
    residual_std = INIT_STD / (2 * n_layers) ** 0.5
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("attention.wo", "feed_forward.w2")) else INIT_STD
                module.weight.normal_(0.0, std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()


def llama_args(config: TrainConfig, vocab_size: int) -> LlamaArgs:
    return LlamaArgs(
        dim=config.dim,
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads or None,
        vocab_size=vocab_size,
        ffn_hidden_dim=3 * config.dim,  # torchtitan's debugmodel ratio (256 -> 768)
    )


def build_llama(args: LlamaArgs, seed: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Llama:
    """The same initial weights in every process that calls this with the same seed (GPT-2-style, as the Transformer)."""
    torch.manual_seed(seed)
    model = Llama(args)
    residual_std = INIT_STD / (2 * args.n_layers) ** 0.5
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("attention.wo", "feed_forward.w2")) else INIT_STD
                module.weight.normal_(0.0, std)
    return model.to(device=device, dtype=dtype)


def build_any_model(config: TrainConfig, vocab_size: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``--model``'s model with the run's seed."""
    if config.model == "llama":
        return build_llama(llama_args(config, vocab_size), config.seed, device, dtype)
    return build_model(model_args(config, vocab_size), config.seed, device, dtype)


def parallelize_llama(model: Llama, tp_mesh: DeviceMesh) -> Llama:
    """The model zoo's Llama plan (``Llama.parallelize``): heads and feed-forward units split over ``tp_mesh``."""
    return Llama.parallelize(model, tp_mesh)


def parallelize_transformer(
    model: Transformer, mesh: DeviceMesh, *, seq_parallel: bool, loss_parallel: bool
) -> Transformer:
    """The model zoo's Megatron-style plan (``Transformer.parallelize``), in place.

    Attention is split by heads (``wq``/``wk``/``wv`` by output column, ``wo`` by input row), the
    feed-forward by hidden unit, the token embedding and the tied output projection by
    vocabulary row.  With ``seq_parallel`` the norms and the residual stream stay sharded on the
    sequence dim between those layers, so each row-parallel layer ends in a reduce-scatter
    instead of an all-reduce and each column-parallel one starts with an all-gather.  With
    ``loss_parallel`` the logits stay sharded on the vocabulary dim for
    :func:`shardwise.tp_styles.loss_parallel`; otherwise they are all-gathered.
    """
    return Transformer.parallelize(model, mesh, seq_parallel, loss_parallel=loss_parallel)


def fully_shard_transformer(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """FSDP over the data-parallel mesh dim, one unit per block plus the root (after TP, as PyTorch requires).

    Each block's parameters are all-gathered in one collective before its forward and freed
    after it, and its gradients reduce-scattered in one collective; the root unit holds the
    embeddings, the final norm and the (tied) output projection.
    """
    from shardwise.fsdp_ext import fully_shard

    layers = model.layers
    assert isinstance(layers, nn.ModuleList)  # Transformer and Llama keep their blocks there
    for block in layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def build_auto_parallel_model(
    config: TrainConfig, mesh: DeviceMesh, vocab_size: int, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, Any]:
    """``--plan auto``: the model with the plan ``auto_parallelize`` chose for ``mesh`` applied, and the plan.

    The example input is one global batch of token ids (with Llama, and the positions 0..seq-1); the
    loss is cross-entropy over the logits, so loss parallel is a candidate unless --no-loss-parallel.
    Under --cp the training loop runs forward inside ``context_parallel(...)`` (which shards the
    batch and makes every attention ring attention), so the plan's context-parallel modules are
    not registered again.
    """
    import torch.nn.functional as F
    from shardwise.fsdp_ext import fully_shard
    from shardwise.tp_styles import auto_parallelize

    model = build_any_model(config, vocab_size, device, dtype)
    tokens = torch.zeros(config.batch_size, config.seq_len, dtype=torch.long, device=device)
    example: tuple[torch.Tensor, ...] = (tokens,)
    if config.model == "llama":
        example = (tokens, torch.arange(config.seq_len, device=device))
    plan = auto_parallelize(
        model,
        mesh,
        example,
        loss_fn=F.cross_entropy if config.loss_parallel else None,
        memory_budget_bytes=config.memory_budget_mb * 1e6 if config.memory_budget_mb else None,
        fully_shard=fully_shard,
        context_parallel=False,
    )
    return model, plan


def build_optimizer(config: TrainConfig, parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW or SGD with momentum over ``parameters``, DTensor parameters in their own group (one per mesh).

    Without sequence parallelism the norms keep plain parameters next to the DTensor ones, and
    one multi-tensor (``_foreach_*``) call cannot take both kinds; the optimizer makes one such
    call per group.  The hyperparameters are the same in every group.
    """
    # DTensors of different meshes cannot share a foreach call either (Llama under FSDP x TP: its plain
    # norms become DTensors on the dp mesh, its tensor-parallel weights live on (dp, tp)): a group per mesh.
    meshes: list[Any] = []
    by_mesh: list[list[nn.Parameter]] = []
    for parameter in parameters:
        if isinstance(parameter, DTensor):
            if parameter.device_mesh not in meshes:
                meshes.append(parameter.device_mesh)
                by_mesh.append([])
            by_mesh[meshes.index(parameter.device_mesh)].append(parameter)
    plain = [parameter for parameter in parameters if not isinstance(parameter, DTensor)]
    groups: list[dict[str, Any]] = [{"params": group} for group in (*by_mesh, plain) if group]
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, foreach=config.foreach)
    return torch.optim.SGD(groups, lr=config.lr, momentum=0.9, foreach=config.foreach)
