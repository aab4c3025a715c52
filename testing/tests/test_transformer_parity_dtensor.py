"""The toy Transformer trains on DTensors laid out by hand (no tp_styles) as it does on one process.

The parameters are distributed with ``distribute_tensor`` (through ``distribute_module``) either
all replicated or the way a column/row-wise tensor-parallel plan shards them; the only code
between the model and the DTensor engine is a handful of module hooks: plain index tensors
become replicated DTensors, and (in some variants) block outputs are redistributed to a chosen
layout with ``DTensor.redistribute``. Everything else (embedding, layer norm, attention, GELU,
cross-entropy, AdamW's in-place and foreach updates, activation checkpointing, a tied weight)
runs through the sharding rules. Losses and parameters after 10 AdamW steps on 4 ranks must
match single-process training.
"""

from __future__ import annotations

import copy
import dataclasses
from fnmatch import fnmatchcase
from typing import Any, Mapping

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from shardwise.dtensor_ops import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.testing import Transformer, multi_rank
from transformer_parity_helpers import (
    adamw,
    assert_losses_match,
    assert_parameters_match,
    small_args,
    train,
    training_batches,
)

STEPS = 10

# How a Megatron-style plan shards the parameters (fnmatch patterns over parameter names;
# anything unnamed is replicated): attention heads and the MLP's hidden units split across
# ranks, the token embedding and the output projection by vocabulary (so a tied weight has
# one layout for both), the position embedding by feature.
COLUMN_ROW_LAYOUT: dict[str, Placement] = {
    "tok_embeddings.weight": Shard(0),
    "pos_embeddings.weight": Shard(1),
    "layers.*.attention.w[qkv].weight": Shard(0),
    "layers.*.attention.wo.weight": Shard(1),
    "layers.*.feed_forward.w1.weight": Shard(0),
    "layers.*.feed_forward.w1.bias": Shard(0),
    "layers.*.feed_forward.w2.weight": Shard(1),
    "output.weight": Shard(0),
}


def _layout_of(name: str, layout: Mapping[str, Placement]) -> Placement:
    matches = {placement for pattern, placement in layout.items() if fnmatchcase(name, pattern)}
    if len(matches) > 1:
        raise ValueError(f"parameter {name!r} matches layout patterns with different placements: {matches}")
    return matches.pop() if matches else Replicate()


class _DistributeParameters:
    """``partition_fn``: each distinct parameter distributed once, so tied parameters stay one."""

    def __init__(self, layout: Mapping[str, Placement]) -> None:
        self.layout = layout
        # id of the original parameter -> (its first name, its layout, the distributed parameter)
        self.distributed: dict[int, tuple[str, Placement, nn.Parameter]] = {}

    def __call__(self, module_name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module._parameters.items()):
            if param is None:
                continue
            name = f"{module_name}.{param_name}" if module_name else param_name
            placement = _layout_of(name, self.layout)
            if id(param) in self.distributed:
                first_name, first_placement, shared = self.distributed[id(param)]
                if first_placement != placement:
                    raise ValueError(
                        f"{name} is tied to {first_name}, laid out as {first_placement}, but its layout says {placement}"
                    )
                module.register_parameter(param_name, shared)
                continue
            distributed = nn.Parameter(distribute_tensor(param.detach(), mesh, [placement]), requires_grad=param.requires_grad)
            self.distributed[id(param)] = (name, placement, distributed)
            module.register_parameter(param_name, distributed)


def _replicated(value: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    # Token and position indices are computed identically on every rank: wrapping needs no collective.
    return value if isinstance(value, DTensor) else DTensor.from_local(value, mesh, [Replicate()])


def _wrap_tokens(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return (_replicated(inputs[0], mesh), *inputs[1:])


def _redistribute_input(placement: Placement) -> Any:
    def hook(module: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return (inputs[0].redistribute(placements=[placement]), *inputs[1:])

    return hook


def _redistribute_output(placement: Placement) -> Any:
    def hook(module: nn.Module, inputs: tuple[Any, ...], output: DTensor) -> DTensor:
        return output.redistribute(placements=[placement])

    return hook


def distribute_by_hand(
    model: Transformer, mesh: DeviceMesh, layout: Mapping[str, Placement], activations: str | None
) -> None:
    """Lay ``model`` out on ``mesh``. ``activations`` fixes the layout of the residual stream between
    blocks by explicit redistributes: ``"replicate"``, ``"sequence"`` (``Shard(1)``, gathered where a
    block's matmuls need the whole sequence), or ``None`` (the sharding rules choose everything)."""
    distribute_module(model, mesh, _DistributeParameters(layout), input_fn=_wrap_tokens)
    model.pos_embeddings.register_forward_pre_hook(lambda module, inputs: (_replicated(inputs[0], mesh),))
    if activations is None:
        return
    # The residual stream is (batch, seq, dim); the position embeddings added to it are (seq, dim).
    stream, positions = {"replicate": (Replicate(), Replicate()), "sequence": (Shard(1), Shard(0))}[activations]
    model.tok_embeddings.register_forward_hook(_redistribute_output(stream))
    model.pos_embeddings.register_forward_hook(_redistribute_output(positions))
    for block in model.layers:
        block.get_submodule("attention.wo").register_forward_hook(_redistribute_output(stream))
        block.get_submodule("feed_forward.w2").register_forward_hook(_redistribute_output(stream))
        if activations == "sequence":
            block.get_submodule("attention").register_forward_pre_hook(_redistribute_input(Replicate()))
            block.get_submodule("feed_forward").register_forward_pre_hook(_redistribute_input(Replicate()))
    if activations == "sequence":
        model.output.register_forward_pre_hook(_redistribute_input(Replicate()))


@dataclasses.dataclass(frozen=True)
class Variant:
    layout: Mapping[str, Placement]  # parameter layouts (unnamed parameters are replicated)
    activations: str | None  # layout of the residual stream, see distribute_by_hand
    weight_tying: bool = True
    checkpoint_activations: bool = False
    foreach: bool = False  # AdamW's foreach implementation (else one tensor at a time)
    dropout_p: float = 0.0


VARIANTS = {
    "replicated": Variant({}, None, foreach=True),
    # Random ops on replicated DTensors draw what plain torch draws from the same generator state,
    # so the dropout masks (embeddings, attention weights, residuals), recomputed ones included,
    # match. Attention is unmasked here: see test_causal_attention_with_dropout_matches_single_process.
    "replicated-dropout-unmasked-checkpointed": Variant(
        {}, None, weight_tying=False, checkpoint_activations=True, dropout_p=0.2
    ),
    "column-row-replicated-stream": Variant(COLUMN_ROW_LAYOUT, "replicate"),
    "column-row-sequence-stream-checkpointed": Variant(
        COLUMN_ROW_LAYOUT, "sequence", checkpoint_activations=True, foreach=True
    ),
    "column-row-untied-rules-decide": Variant(COLUMN_ROW_LAYOUT, None, weight_tying=False, foreach=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
@multi_rank(world_size=4)
def test_hand_distributed_training_matches_single_process(name: str) -> None:
    variant = VARIANTS[name]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    args = small_args(
        weight_tying=variant.weight_tying,
        checkpoint_activations=variant.checkpoint_activations,
        dropout_p=variant.dropout_p,
        use_attn_mask=variant.dropout_p == 0,
    )
    torch.manual_seed(0)
    reference = Transformer(args)
    model = copy.deepcopy(reference)
    distribute_by_hand(model, mesh, variant.layout, variant.activations)
    if variant.weight_tying:
        assert model.output.weight is model.tok_embeddings.weight
    tokens, labels = training_batches(args, STEPS)

    reference_losses = train(reference, adamw(reference), tokens, labels)
    losses = train(model, adamw(model, foreach=variant.foreach), tokens, labels)

    assert_losses_match(losses, reference_losses, name)
    assert_parameters_match(model, reference, name)
    for param_name, param in model.named_parameters():
        # Gradient accumulation and the optimizer's in-place updates keep every layout.
        expected = (_layout_of(param_name, variant.layout),)
        assert isinstance(param, DTensor) and param.placements == expected, (param_name, param)


@pytest.mark.xfail(
    strict=True,
    reason="CPU attention with dropout takes sdpa's math path, which adds a causal mask it builds as a plain "
    "tensor to the DTensor scores (aten.add.Tensor: got mixed torch.Tensor and DTensor)",
)
@multi_rank(world_size=4)
def test_causal_attention_with_dropout_matches_single_process() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    args = small_args(dropout_p=0.2, use_attn_mask=True)
    torch.manual_seed(0)
    reference = Transformer(args)
    model = copy.deepcopy(reference)
    distribute_by_hand(model, mesh, {}, None)
    tokens, _ = training_batches(args, 1)
    torch.manual_seed(5)
    expected = reference(tokens[0])
    torch.manual_seed(5)
    logits = model(tokens[0])
    assert isinstance(logits, DTensor)
    torch.testing.assert_close(logits.full_tensor(), expected)
