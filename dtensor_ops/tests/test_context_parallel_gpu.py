"""Context parallel on CUDA (GPU target; every test skips without CUDA).

The CUDA kernels (flash, memory-efficient, cuDNN) go through the same ring code as the CPU ones:
each kernel's forward/backward on two key/value blocks merged by log-sum-exp must equal SDPA on
the concatenation (one GPU), and with two GPUs ring attention over NCCL must equal SDPA on the
whole sequence with PyTorch's collective counts.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from context_parallel_helpers import split_kv_matches_sdpa
from shardwise.dtensor_ops import init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.dtensor_ops.experimental._attention import _cp_options, context_parallel, context_parallel_unshard, set_rotate_method
from shardwise.dtensor_ops.experimental._cp_kernels import choose_kernel, kernel_by_name
from shardwise.testing import multi_rank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def _supported(kernel: str, dtype: torch.dtype) -> bool:
    query = torch.randn(2, 4, 64, 64, device="cuda", dtype=dtype)
    with sdpa_kernel(BACKENDS[kernel]):
        try:
            return choose_kernel(query, query, query, True, 0.125).name == kernel
        except RuntimeError:
            return False


@pytest.mark.parametrize("kernel", sorted(BACKENDS))
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernel_blocks_merged_by_lse_equal_sdpa(kernel: str, causal: bool) -> None:
    dtype = torch.float32 if kernel == "efficient" else torch.bfloat16
    if not _supported(kernel, dtype):
        pytest.skip(f"{kernel} attention is not available on this GPU")
    errors = split_kv_matches_sdpa(kernel_by_name(kernel), "cuda", dtype, causal)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    assert max(errors) < tolerance, errors


def _ring_on_gpus() -> list[str]:
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    failures = []
    for kernel, causal, balance, rotate in itertools.product(sorted(BACKENDS), (True, False), (True, False), ("alltoall", "allgather")):
        dtype = torch.float32 if kernel == "efficient" else torch.bfloat16
        if not _supported(kernel, dtype):
            continue
        torch.manual_seed(0)
        query, key, value = (torch.randn(2, 8, 64 * world, 64, device="cuda", dtype=dtype) for _ in range(3))
        reference = [t.clone().requires_grad_(True) for t in (query, key, value)]
        with sdpa_kernel(BACKENDS[kernel]):
            expected = F.scaled_dot_product_attention(reference[0], reference[1], reference[2], is_causal=causal)
        expected.sum().backward()
        _cp_options.enable_load_balance = balance
        set_rotate_method(rotate)
        pieces = [t.clone() for t in (query, key, value)]
        with context_parallel(mesh, buffers=pieces, buffer_seq_dims=[2, 2, 2]):
            for piece in pieces:
                piece.requires_grad_(True)
            with CommDebugMode() as comm, sdpa_kernel(BACKENDS[kernel]):
                out = F.scaled_dot_product_attention(pieces[0], pieces[1], pieces[2], is_causal=causal)
                out.sum().backward()
            (full,) = context_parallel_unshard(mesh, [out.detach()], [2])
            grads = context_parallel_unshard(mesh, [p.grad for p in pieces if p.grad is not None], [2, 2, 2])
            for piece in pieces:
                piece.requires_grad_(False)
        tolerance = 1e-4 if dtype == torch.float32 else 8e-3 * world
        case = f"{kernel} causal={causal} balance={balance} rotate={rotate}"
        if not torch.allclose(full.float(), expected.detach().float(), atol=tolerance):
            failures.append(f"{case}: output differs by {float((full.float() - expected.float()).abs().max())}")
        for got, ref in zip(grads, reference):
            assert ref.grad is not None
            if not torch.allclose(got.float(), ref.grad.float(), atol=tolerance * 4):
                failures.append(f"{case}: gradient differs by {float((got.float() - ref.grad.float()).abs().max())}")
        counts = {str(k): v for k, v in comm.get_comm_counts().items()}
        expected_counts = (
            {"c10d_functional.all_to_all_single": 3 * world - 2}
            if rotate == "alltoall"
            else {"c10d_functional.all_gather_into_tensor": 2, "c10d_functional.all_to_all_single": world}
        )
        if counts != expected_counts:
            failures.append(f"{case}: collectives {counts}, expected {expected_counts}")
    _cp_options.enable_load_balance = True
    set_rotate_method("allgather")
    return failures


@multi_rank(world_size=2, backend="nccl")
def test_ring_attention_on_two_gpus_matches_sdpa() -> None:
    failures = _ring_on_gpus()
    assert not failures, "\n".join(failures)
