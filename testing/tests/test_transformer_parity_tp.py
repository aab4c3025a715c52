"""``Transformer.parallelize``: its layouts, its errors, training parity with one process, and the
collectives of one tensor-parallel forward and backward (4 ranks, gloo)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from shardwise.dtensor_ops import DTensor, Placement, Replicate, Shard
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.testing import Transformer, TransformerBlock, multi_rank
from shardwise.tp_styles import loss_parallel
from transformer_parity_helpers import (
    adamw,
    assert_losses_match,
    assert_parameters_match,
    comm_counts,
    cross_entropy,
    full_value,
    small_args,
    train,
    training_batches,
)

STEPS = 5


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _expected_layout(name: str, use_seq_parallel: bool) -> Placement | None:
    """The plan's layout of a parameter (None: left a plain tensor)."""
    leaf = ".".join(name.split(".")[-2:])
    by_leaf: dict[str, Placement] = {
        "tok_embeddings.weight": Shard(0),
        "pos_embeddings.weight": Shard(1),
        "wq.weight": Shard(0),
        "wk.weight": Shard(0),
        "wv.weight": Shard(0),
        "wo.weight": Shard(1),
        "w1.weight": Shard(0),
        "w1.bias": Shard(0),
        "w2.weight": Shard(1),
        "w2.bias": Replicate(),
        "output.weight": Shard(0),
    }
    if leaf in by_leaf:
        return by_leaf[leaf]
    assert "norm" in name, name
    return Replicate() if use_seq_parallel else None


# -- the plan ------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_seq_parallel", [False, True])
@multi_rank(world_size=4)
def test_parallelize_lays_out_every_parameter(use_seq_parallel: bool) -> None:
    mesh = _mesh()
    for weight_tying, local_output_for_attn in [(True, False), (False, True)]:
        reference = Transformer(small_args(weight_tying=weight_tying))
        model = copy.deepcopy(reference)
        returned = Transformer.parallelize(model, mesh, use_seq_parallel, local_output_for_attn)
        assert returned is model
        reference_params = dict(reference.named_parameters())
        params = dict(model.named_parameters())
        assert list(params) == list(reference_params)  # a tied weight is still listed once
        for name, param in params.items():
            expected = _expected_layout(name, use_seq_parallel)
            if expected is None:
                assert not isinstance(param, DTensor), name
            else:
                assert isinstance(param, DTensor) and param.placements == (expected,), (name, param)
                assert param.device_mesh == mesh
            assert torch.equal(full_value(param), reference_params[name].detach()), name
        assert (model.output.weight is model.tok_embeddings.weight) == weight_tying
        heads = [layer.attention.n_heads for layer in model.layers if isinstance(layer, TransformerBlock)]
        assert heads == [1 if local_output_for_attn else 4] * 2


@multi_rank(world_size=4)
def test_parallelize_uses_the_tp_dim_of_a_2d_mesh() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Transformer.parallelize(Transformer(small_args()), mesh, True, local_output_for_attn=True)
    wq = model.get_parameter("layers.0.attention.wq.weight")
    assert isinstance(wq, DTensor) and wq.device_mesh == mesh["tp"] and wq.to_local().shape == (8, 16)
    assert model.get_submodule("layers.1.attention").n_heads == 2


@multi_rank(world_size=4)
def test_parallelize_refuses_before_changing_anything() -> None:
    mesh = _mesh()
    unnamed = init_device_mesh("cpu", (2, 2))
    model = Transformer(small_args(n_heads=2))
    with CommDebugMode() as mode:
        with pytest.raises(ValueError, match="n_heads=2 must be a multiple of the tensor-parallel size 4"):
            Transformer.parallelize(model, mesh, False)
        with pytest.raises(ValueError, match="needs a dim named 'tp'"):
            Transformer.parallelize(model, unnamed, False)
    assert mode.get_total_counts() == 0
    assert not any(isinstance(param, DTensor) for param in model.parameters())

    # Sequence parallelism splits the sequence into equal pieces: 6 positions on 4 ranks is refused
    # when the model is called, before any collective.
    model = Transformer.parallelize(Transformer(small_args()), mesh, True)
    with CommDebugMode() as mode:
        with pytest.raises(ValueError, match="sequence length 6 of tokens \\(2, 6\\) must be a multiple of 4"):
            model(torch.zeros(2, 6, dtype=torch.long))
    assert mode.get_total_counts() == 0


# -- training parity -----------------------------------------------------------------------------


def _loss_parallel_step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), logits
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    return loss


@dataclasses.dataclass(frozen=True)
class Variant:
    use_seq_parallel: bool
    loss_parallel: bool = False
    local_output_for_attn: bool = False
    weight_tying: bool = True
    checkpoint_activations: bool = False


TRAINING_VARIANTS = {
    "tp": Variant(use_seq_parallel=False),
    "tp-loss-parallel-local-attention-untied": Variant(
        use_seq_parallel=False, loss_parallel=True, local_output_for_attn=True, weight_tying=False
    ),
    "sp": Variant(use_seq_parallel=True),
    "sp-loss-parallel-checkpointed": Variant(use_seq_parallel=True, loss_parallel=True, checkpoint_activations=True),
}


@pytest.mark.parametrize("name", list(TRAINING_VARIANTS))
@multi_rank(world_size=4)
def test_parallelized_training_matches_single_process(name: str) -> None:
    variant = TRAINING_VARIANTS[name]
    args = small_args(weight_tying=variant.weight_tying, checkpoint_activations=variant.checkpoint_activations)
    torch.manual_seed(0)
    reference = Transformer(args)
    model = Transformer.parallelize(
        copy.deepcopy(reference),
        _mesh(),
        variant.use_seq_parallel,
        variant.local_output_for_attn,
        loss_parallel=variant.loss_parallel,
    )
    tokens, labels = training_batches(args, STEPS)

    reference_losses = train(reference, adamw(reference), tokens, labels)
    # Without sequence parallelism the norms keep plain parameters, which a foreach optimizer
    # cannot update in the same call as DTensors; with it every parameter is a DTensor.
    optimizer = adamw(model, foreach=variant.use_seq_parallel)
    losses = train(model, optimizer, tokens, labels, _loss_parallel_step if variant.loss_parallel else None)

    assert_losses_match(losses, reference_losses, name)
    assert_parameters_match(model, reference, name)


# -- collectives ---------------------------------------------------------------------------------

# One forward and one backward of the 2-block model (weight tied, tokens without gradient).
# The derivation, region by region:
#
# Without sequence parallelism the residual stream is replicated (plain local tensors):
#   forward  - tok_embeddings (vocabulary rows sharded): its partial sums are all-reduced: 1 all_reduce.
#            - pos_embeddings (feature columns sharded): its (seq, dim/4) pieces are gathered: 1 all_gather.
#            - each block: wo and w2 (row-wise) reduce their partial sums: 2 all_reduce per block.
#              wq/wk/wv/w1 (column-wise) and attention on whole local heads need nothing.
#            - output (column-wise): the logits, sharded by vocabulary, are gathered: 1 all_gather
#              (with loss_parallel they stay sharded; cross-entropy all-reduces the row max, the
#              sum of exponentials and the target logits instead: 3 all_reduce).
#   backward - the gradient of each column-wise linear's replicated input is a partial sum, reduced
#              where the plain input was wrapped: wq, wk and wv each wrap it, and w1: 4 all_reduce
#              per block, plus 1 for the output projection's input.
#            - the mirror of a gather to Replicate is a local slice and the mirror of reducing a
#              partial sum hands the replicated gradient on: no collective; the embeddings' indices
#              need no gradient, and loss_parallel's backward needs no collective.
#
# With sequence parallelism the stream between regions is sharded on the sequence dim:
#   forward  - tok_embeddings: partial sums reduce-scattered to Shard(1): 1 reduce_scatter.
#            - pos_embeddings: (seq, dim/4) pieces to (seq/4, dim) pieces: 1 all_to_all.
#            - each block: the normed input is all-gathered once before attention (shared by
#              wq/wk/wv) and once before w1; wo and w2 reduce-scatter: 2 all_gather + 2
#              reduce_scatter per block. The norms run on the sequence shard: nothing.
#            - output: its input is all-gathered, and the logits too unless loss_parallel (which
#              all-reduces 3 times, as above).
#   backward - every collective mirrored: each all-gather of an input becomes a reduce-scatter of
#              its (partial-sum) gradient, 2 per block plus the output's input (wq/wk/wv's three
#              partial gradients are summed locally first, their input being one DTensor); each
#              reduce-scatter becomes an all-gather of the gradient, 2 per block plus
#              tok_embeddings; the all-to-all becomes an all-to-all; the logits' gather a slice.
EXPECTED_COLLECTIVES = {
    # (use_seq_parallel, loss_parallel): (forward, backward)
    (False, False): ({"all_reduce": 5, "all_gather_into_tensor": 2}, {"all_reduce": 9}),
    (False, True): ({"all_reduce": 8, "all_gather_into_tensor": 1}, {"all_reduce": 9}),
    (True, False): (
        {"reduce_scatter_tensor": 5, "all_gather_into_tensor": 6, "all_to_all_single": 1},
        {"reduce_scatter_tensor": 5, "all_gather_into_tensor": 5, "all_to_all_single": 1},
    ),
    (True, True): (
        {"reduce_scatter_tensor": 5, "all_gather_into_tensor": 5, "all_to_all_single": 1, "all_reduce": 3},
        {"reduce_scatter_tensor": 5, "all_gather_into_tensor": 5, "all_to_all_single": 1},
    ),
}


def _with_zeros(counts: dict[str, int]) -> dict[str, int]:
    full = {name: 0 for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")}
    full.update(counts)
    full["total"] = sum(counts.values())
    return full


@pytest.mark.parametrize(("use_seq_parallel", "use_loss_parallel"), list(EXPECTED_COLLECTIVES))
@multi_rank(world_size=4)
def test_collectives_of_one_forward_and_backward(use_seq_parallel: bool, use_loss_parallel: bool) -> None:
    args = small_args()
    model = Transformer.parallelize(Transformer(args), _mesh(), use_seq_parallel, loss_parallel=use_loss_parallel)
    tokens, labels = training_batches(args, 1)
    expected_forward, expected_backward = EXPECTED_COLLECTIVES[(use_seq_parallel, use_loss_parallel)]

    with CommDebugMode() as forward:
        logits = model(tokens[0])
        if use_loss_parallel:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), labels[0].flatten())
        else:
            loss = cross_entropy(logits, labels[0])
    with CommDebugMode() as backward:
        if use_loss_parallel:
            with loss_parallel():
                loss.backward()
        else:
            loss.backward()

    assert comm_counts(forward) == _with_zeros(expected_forward)
    assert comm_counts(backward) == _with_zeros(expected_backward)
