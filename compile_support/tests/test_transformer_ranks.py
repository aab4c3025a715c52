"""The model zoo's Transformer, tensor parallel (TP) and sequence parallel (TP+SP) with parallelize_module,
compiled whole (forward, loss) with fullgraph=True: one frame, five SGD steps with eager's losses.

Dropout is 0: the model's attention dropout with a causal mask mixes a plain mask tensor into DTensor ops, which
needs implicit_replication() in eager too; dropout on sharded DTensors is tested in test_compile_ranks.py."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from shardwise.dtensor_ops import init_device_mesh
from shardwise.testing import ModelArgs, Transformer, multi_rank

WORLD = 2
VOCAB = 8
STEPS = 5


def _losses(model: torch.nn.Module, step: Callable[..., torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        loss = step(model, tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@multi_rank(world_size=WORLD)
def test_parallelized_transformer_trains_compiled_with_eager_losses(sequence_parallel: bool) -> None:
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    args = ModelArgs(n_layers=2, vocab_size=VOCAB, max_seq_len=8, dim=8, n_heads=2, dropout_p=0.0)
    base = Transformer(args)

    def parallel_copy() -> Any:
        return Transformer.parallelize(copy.deepcopy(base), mesh, use_seq_parallel=sequence_parallel)

    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    eager = _losses(parallel_copy(), _loss, tokens, targets)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled_loss = torch.compile(_loss, backend=counter, fullgraph=True)
    torch.manual_seed(3)
    compiled = _losses(parallel_copy(), compiled_loss, tokens, targets)
    assert counter.frame_count == 1
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
    assert compiled[-1] < compiled[0]
