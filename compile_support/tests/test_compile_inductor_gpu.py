"""DTensor under torch.compile with inductor on CUDA (Triton kernels), 2 GPUs over NCCL.

On CPU inductor writes C++; on CUDA it writes Triton kernels and its collectives become NCCL
calls inside the graph. Checked: the model zoo's Transformer with TP + SP (Transformer.parallelize), forward and loss
compiled whole with fullgraph=True, trains five SGD steps with eager's losses in one frame; and a sharded elementwise + reduction chain compiled by inductor gives plain
torch's values on the rank's GPU. Caches go to the test's TEST_TMPDIR (tools/build_defs/pytest_runner.py
sets TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR), so two test actions never share compiled kernels.

Bazel: tagged gpu, gpu-count=2 (with one GPU the ranks share it over gloo). Skips without CUDA, and on
a torch that refuses placements and meshes as opaque value types (2.11), with the reason.
"""

from __future__ import annotations

from typing import Any

import copy
from typing import Callable

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from shardwise.compile_support import compile_refusal
from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.testing import ModelArgs, Transformer, multi_rank

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    # torch 2.11 (the GPU image's) takes no placements or meshes as opaque value types: dynamo cannot trace them.
    pytest.mark.skipif(compile_refusal() is not None, reason=f"torch.compile of DTensor code: {compile_refusal()}"),
]

WORLD = 2
VOCAB = 8
STEPS = 5


def compiled_tp_transformer_matches_eager(device: str, backend: str) -> dict[str, Any]:
    """The Transformer with TP + SP, forward and loss compiled whole: five SGD steps with eager's losses.

    ``device`` is "cuda" with inductor in the tests; "cpu" runs the same check by hand without a GPU.
    """
    mesh = init_device_mesh(device, (WORLD,))
    torch.manual_seed(0)
    args = ModelArgs(n_layers=2, vocab_size=VOCAB, max_seq_len=16, dim=32, n_heads=4, dropout_p=0.0)
    base = Transformer(args).to(device)
    tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1)).to(device)
    targets = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2)).to(device)

    def loss_of(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))

    def train(step: Callable[..., torch.Tensor]) -> list[float]:
        model = Transformer.parallelize(copy.deepcopy(base), mesh, use_seq_parallel=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(STEPS):
            loss = step(model, tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    eager = train(loss_of)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = train(torch.compile(loss_of, backend=counter, fullgraph=True))
    return {"frames": counter.frame_count, "eager": eager, "compiled": compiled}


def compiled_sharded_chain_matches_torch(device: str, backend: str) -> dict[str, Any]:
    mesh = init_device_mesh(device, (WORLD,))
    torch.manual_seed(0)
    full = torch.randn(64, 48, device=device)
    torch.distributed.broadcast(full, 0)
    sharded = distribute_tensor(full, mesh, [Shard(0)])

    def chain(t: DTensor) -> DTensor:
        summed = (torch.sigmoid(t * 3 - 1) + t.pow(2)).sum(dim=1)
        assert isinstance(summed, DTensor)
        return summed.redistribute(mesh, [Replicate()])

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    out = torch.compile(chain, backend=counter, fullgraph=True)(sharded)
    expected = (torch.sigmoid(full * 3 - 1) + full.pow(2)).sum(dim=1)
    return {"frames": counter.frame_count, "error": (out.to_local() - expected).abs().max().item(), "device": str(out.to_local().device)}


@multi_rank(world_size=WORLD, backend="nccl")
def test_tp_sp_transformer_compiled_by_inductor_on_cuda_trains_with_eager_losses() -> None:
    result = compiled_tp_transformer_matches_eager("cuda", "inductor")
    assert result["frames"] == 1, result
    # Triton's reductions may order sums differently from eager's CUDA kernels.
    assert result["compiled"] == pytest.approx(result["eager"], rel=1e-4, abs=1e-5), result
    assert result["compiled"][-1] < result["compiled"][0], result


@multi_rank(world_size=WORLD, backend="nccl")
def test_sharded_chain_compiled_to_triton_matches_plain_torch() -> None:
    result = compiled_sharded_chain_matches_torch("cuda", "inductor")
    assert result["frames"] == 1 and result["error"] < 1e-4, result
    assert result["device"].startswith("cuda"), result
