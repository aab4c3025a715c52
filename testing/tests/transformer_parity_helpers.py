"""Shared by the Transformer parity tests: a small model, its training data, single-process
training as the oracle, and comparisons of losses and parameters after training.

Dropout is 0 everywhere: parity with single-process training must be exact up to float
rounding, and no random-op scheme reproduces single-process dropout masks on sharded
activations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from shardwise.dtensor_ops import DTensor, Replicate
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.testing import ModelArgs

LEARNING_RATE = 1e-2
# Adam divides each gradient by its running magnitude plus eps. With the default eps (1e-8) an
# entry whose gradient happens to be ~1e-8 (cancellation) moves by up to lr * g / (|g| + eps),
# i.e. float rounding in g, which sharded sums change, is amplified up to lr / eps = 1e6 times.
# eps = 1e-4 bounds that factor at 100 and still normalizes the usual 1e-3..1e-1 gradients, so
# the same optimizer ops run while the comparison stays a test of the DTensor ops, not of noise.
ADAM_EPS = 1e-4
BATCH = 2
SEQ_LEN = 8

c10d_functional = torch.ops.c10d_functional
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def small_args(**overrides: Any) -> ModelArgs:
    """2 blocks, dim 16 in 4 heads (one per rank of 4), vocabulary 16, sequence 8, no dropout."""
    base = ModelArgs(n_layers=2, vocab_size=16, max_seq_len=SEQ_LEN, dim=16, n_heads=4, dropout_p=0.0)
    return dataclasses.replace(base, **overrides)


def training_batches(args: ModelArgs, steps: int, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` batches of (BATCH, SEQ_LEN) tokens and next-token labels, equal on every rank."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(0, args.vocab_size, (steps, BATCH, SEQ_LEN + 1), generator=generator)
    return text[..., :-1].contiguous(), text[..., 1:].contiguous()


def adamw(model: nn.Module, foreach: bool | None = None) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS, foreach=foreach)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss; DTensor logits get their labels as a replicated DTensor."""
    if isinstance(logits, DTensor):
        labels = DTensor.from_local(labels, logits.device_mesh, [Replicate()] * logits.device_mesh.ndim)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def scalar(loss: torch.Tensor) -> float:
    return float(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    step_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> list[float]:
    """One optimizer step per batch; returns the losses. ``step_loss(model, tokens, labels)`` computes a
    batch's loss and runs its backward (default: ``cross_entropy`` of the model's logits)."""
    losses = []
    for step in range(tokens.shape[0]):
        # Dropout masks: each step starts from the same generator state in every run.
        torch.manual_seed(1000 + step)
        optimizer.zero_grad()
        if step_loss is None:
            loss = cross_entropy(model(tokens[step]), labels[step])
            loss.backward()
        else:
            loss = step_loss(model, tokens[step], labels[step])
        optimizer.step()
        losses.append(scalar(loss))
    return losses


def full_value(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def assert_losses_match(parallel: list[float], reference: list[float], what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(parallel), torch.tensor(reference), msg=lambda m: f"{what}: losses per step differ: {m}"
    )


def assert_parameters_match(parallel: nn.Module, reference: nn.Module, what: str) -> None:
    """Same parameter names (tied weights listed once in both) and values after training."""
    parallel_params = dict(parallel.named_parameters())
    reference_params = dict(reference.named_parameters())
    assert list(parallel_params) == list(reference_params), what
    for name, param in parallel_params.items():

        def explain(message: str, name: str = name) -> str:
            return f"{what}: {name}: {message}"

        torch.testing.assert_close(full_value(param), reference_params[name].detach(), msg=explain)


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    """Counts of the collectives named in COLLECTIVES, plus ``total`` over every collective counted."""
    counts = mode.get_comm_counts()
    result = {name: int(counts[getattr(c10d_functional, name)]) for name in COLLECTIVES}
    result["total"] = int(mode.get_total_counts())
    return result
