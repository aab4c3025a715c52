"""FSDP x TP (shardwise.fsdp_ext over shardwise.tp_styles) with torch.compile, on a (dp=2, tp=2) mesh of 4 ranks.

The whole model does not compile with fullgraph=True: fully_shard's forward pre-hook compares parameter
storage pointers, which dynamo refuses ("Data pointer comparison"; compile_support's README). What works,
and is tested here: each Transformer block's forward compiled (fullgraph, one frame per block), FSDP's hooks
around it eager; three SGD steps give eager's losses.  (In tools/tests: compile_support's own tests may not
import fsdp_ext, a sibling package.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from shardwise.fsdp_ext import fully_shard
from shardwise.mesh import init_device_mesh
from shardwise.testing import ModelArgs, Transformer, multi_rank

VOCAB = 8


@multi_rank(world_size=4)
def test_fsdp_x_tp_with_compiled_blocks_trains_with_eager_losses() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    base = Transformer(ModelArgs(n_layers=2, vocab_size=VOCAB, max_seq_len=8, dim=8, n_heads=2, dropout_p=0.0))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=generator)
    targets = torch.randint(0, VOCAB, (2, 8), generator=generator)
    dp_rank = mesh["dp"].get_local_rank()
    tokens, targets = tokens[dp_rank : dp_rank + 1], targets[dp_rank : dp_rank + 1]

    def train(counter: CompileCounterWithBackend | None) -> list[float]:
        model = Transformer.parallelize(copy.deepcopy(base), mesh["tp"], False)
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        if counter is not None:
            for block in model.layers:
                block.forward = torch.compile(block.forward, backend=counter, fullgraph=True)  # type: ignore[method-assign]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    eager = train(None)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = train(counter)
    # At most one graph per block (dynamo may share one between blocks of the same code and layouts).
    assert 1 <= counter.frame_count <= 2
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
