"""The model zoo on plain CPU tensors: structure, shapes, seeding, weight tying, checkpointing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwise.testing import (
    Attention,
    FeedForward,
    MLPModule,
    MLPStacked,
    ModelArgs,
    RMSNormPython,
    Transformer,
    TransformerBlock,
)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


def test_model_args_defaults() -> None:
    assert dataclasses.asdict(ModelArgs()) == {
        "n_layers": 2,
        "vocab_size": 8,
        "max_seq_len": 16,
        "dim": 16,
        "n_heads": 4,
        "dropout_p": 0.1,
        "use_attn_mask": True,
        "weight_tying": True,
        "checkpoint_activations": False,
    }


def test_mlp_module_names_shapes_and_seeded_init() -> None:
    torch.manual_seed(123)
    first = MLPModule("cpu")
    torch.manual_seed(456)
    second = MLPModule("cpu")
    shapes = {name: tuple(p.shape) for name, p in first.named_parameters()}
    assert shapes == {"net1.weight": (16, 10), "net1.bias": (16,), "net2.weight": (10, 16), "net2.bias": (10,)}
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name  # seeded inside __init__, whatever the caller's seed
    x = torch.randn(3, 10, requires_grad=True)
    out = first(x)
    assert out.shape == (3, 10)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (3, 10)
    assert sorted(_grads(first)) == sorted(shapes)
    assert [name for name, _ in MLPModule("cpu", bias=False).named_parameters()] == ["net1.weight", "net2.weight"]


def test_mlp_reset_parameters_draws_new_weights() -> None:
    model = MLPModule("cpu")
    before = model.net1.weight.detach().clone()
    model.reset_parameters()
    assert not torch.equal(before, model.net1.weight)


def test_mlp_stacked() -> None:
    model = MLPStacked("cpu", n_layers=3)
    assert len(model.layers) == 3
    assert "layers.2.net2.bias" in dict(model.named_parameters())
    x = torch.randn(2, 10)
    expected = x
    for layer in model.layers:
        expected = layer(expected)
    assert torch.equal(model(x), expected)


def test_rms_norm_python() -> None:
    norm = RMSNormPython(4, eps=0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 1.0, 1.0]))
    x = torch.tensor([[3.0, 3.0, -3.0, 3.0]])
    assert torch.allclose(norm(x), torch.tensor([[1.0, 2.0, -1.0, 1.0]]))


def test_transformer_parameter_names_follow_the_reference_zoo() -> None:
    model = Transformer(ModelArgs(n_layers=1))
    names = {name for name, _ in model.named_parameters()}
    expected_block = {
        "attention_norm.weight",
        "attention_norm.bias",
        "attention.wq.weight",
        "attention.wk.weight",
        "attention.wv.weight",
        "attention.wo.weight",
        "ffn_norm.weight",
        "ffn_norm.bias",
        "feed_forward.w1.weight",
        "feed_forward.w1.bias",
        "feed_forward.w2.weight",
        "feed_forward.w2.bias",
    }
    # named_parameters lists the tied weight once, under its first name.
    assert names == {"tok_embeddings.weight", "pos_embeddings.weight", "norm.weight", "norm.bias"} | {
        f"layers.0.{name}" for name in expected_block
    }
    assert tuple(model.get_parameter("layers.0.feed_forward.w1.weight").shape) == (64, 16)


def test_transformer_forward_backward_shapes() -> None:
    args = ModelArgs(dropout_p=0.0)
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (2, 5))
    logits = model(tokens)
    assert logits.shape == (2, 5, args.vocab_size) and logits.dtype == torch.float32
    logits.sum().backward()
    grads = _grads(model)
    assert set(grads) == {name for name, _ in model.named_parameters()}
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_attention_is_causal_when_masked() -> None:
    args = ModelArgs(dropout_p=0.0, use_attn_mask=True)
    attention = Attention(args)
    x = torch.randn(1, 6, args.dim)
    changed_future = x.clone()
    changed_future[:, 4:] += 1.0
    # Masked attention: positions before 4 cannot see the change.
    assert torch.allclose(attention(x)[:, :4], attention(changed_future)[:, :4])
    unmasked = Attention(dataclasses.replace(args, use_attn_mask=False))
    unmasked.load_state_dict(attention.state_dict())
    assert not torch.allclose(unmasked(x)[:, :4], unmasked(changed_future)[:, :4])


def test_attention_rejects_dims_not_divisible_by_heads() -> None:
    with pytest.raises(ValueError, match="dim=10 must be a multiple of n_heads=4"):
        Attention(ModelArgs(dim=10))


def test_block_and_feed_forward_keep_the_shape() -> None:
    args = ModelArgs(dropout_p=0.0)
    x = torch.randn(2, 3, args.dim)
    assert TransformerBlock(args)(x).shape == x.shape
    assert FeedForward(args.dim, 4 * args.dim, 0.0)(x).shape == x.shape


def test_transformer_init_is_deterministic_under_a_seed() -> None:
    torch.manual_seed(7)
    first = Transformer(ModelArgs())
    torch.manual_seed(7)
    second = Transformer(ModelArgs())
    torch.manual_seed(8)
    third = Transformer(ModelArgs())
    first_state, second_state, third_state = first.state_dict(), second.state_dict(), third.state_dict()
    assert all(torch.equal(first_state[k], second_state[k]) for k in first_state)
    assert not torch.equal(first_state["layers.0.attention.wq.weight"], third_state["layers.0.attention.wq.weight"])


def test_weight_tying_shares_the_tensor() -> None:
    tied = Transformer(ModelArgs(weight_tying=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    with torch.no_grad():
        tied.tok_embeddings.weight[0, 0] = 42.0
    assert tied.output.weight[0, 0].item() == 42.0
    untied = Transformer(ModelArgs(weight_tying=False))
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert "output.weight" in dict(untied.named_parameters())


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    args = ModelArgs(dropout_p=0.0)
    torch.manual_seed(0)
    plain = Transformer(args)
    checkpointed = Transformer(dataclasses.replace(args, checkpoint_activations=True))
    checkpointed.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, args.vocab_size, (2, 6))
    plain(tokens).square().mean().backward()
    checkpointed(tokens).square().mean().backward()
    plain_grads, checkpointed_grads = _grads(plain), _grads(checkpointed)
    assert set(plain_grads) == set(checkpointed_grads)
    for name, grad in plain_grads.items():

        def explain(message: str, name: str = name) -> str:
            return f"gradient of {name} under checkpointing: {message}"

        torch.testing.assert_close(checkpointed_grads[name], grad, msg=explain)


def test_checkpointing_recomputes_the_blocks_in_backward() -> None:
    args = ModelArgs(dropout_p=0.0, n_layers=1, checkpoint_activations=True)
    model = Transformer(args)
    calls: list[str] = []
    model.get_submodule("layers.0.attention").register_forward_hook(lambda *_: calls.append("attention"))
    model(torch.randint(0, args.vocab_size, (1, 4))).sum().backward()
    assert calls == ["attention", "attention"]  # forward, then recomputed in backward


def test_sequence_longer_than_max_seq_len_is_rejected() -> None:
    model = Transformer(ModelArgs(max_seq_len=4))
    with pytest.raises(ValueError, match="sequence length 5 exceeds max_seq_len=4"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_parallelize_checks_its_arguments_before_touching_a_mesh() -> None:
    with pytest.raises(TypeError, match="expects a Transformer, got MLPModule"):
        Transformer.parallelize(MLPModule("cpu"), None, False)  # type: ignore[arg-type]
    model = Transformer(ModelArgs())
    with pytest.raises(TypeError, match="device_mesh must be a DeviceMesh, got str"):
        Transformer.parallelize(model, "cpu", False)  # type: ignore[arg-type]
    assert all(type(param) is torch.nn.Parameter for param in model.parameters())
