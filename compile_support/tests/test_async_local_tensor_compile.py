"""A local tensor still in flight (``redistribute(..., async_op=True).to_local()``) entering a compiled region.

torchtitan's sequence parallel hands the first compiled block such a tensor: the embedding's output is
reduce-scattered asynchronously in eager and its local piece goes into ``DTensor.from_local`` inside
the compiled block. On 4 gloo ranks, compiled with ``fullgraph=True`` (``aot_eager``), the result must
equal eager's for even and uneven reduce-scatters along dim 0 and dim 1, and for an all-gather.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, init_device_mesh
from shardwise.testing import multi_rank

WORLD = 4


def _rebuild_and_use(local: torch.Tensor, mesh: Any, placement: Any, shape: tuple[int, ...]) -> torch.Tensor:
    stride = torch.empty(shape).stride()
    rebuilt = DTensor.from_local(local, mesh, [placement], shape=shape, stride=stride)
    return (rebuilt * 2 + 1).full_tensor()


# (global shape, source placement, target placement)
CASES = [
    ((8, 6), Partial(), Shard(0)),  # even reduce-scatter along dim 0
    ((4, 8, 3), Partial(), Shard(1)),  # even along dim 1 (sequence parallel's embedding output)
    ((6, 5), Partial(), Shard(0)),  # uneven: 2, 2, 2, 0 rows
    ((3, 7), Partial(), Shard(1)),  # uneven along dim 1: 2, 2, 2, 1
    ((8, 6), Shard(0), Replicate()),  # all-gather
    ((6, 5), Shard(1), Replicate()),  # uneven all-gather along dim 1
]


@pytest.mark.parametrize("case", range(len(CASES)))
@multi_rank(world_size=WORLD)
def test_async_local_tensor_enters_a_compiled_from_local(case: int) -> None:
    shape, source, target = CASES[case]
    mesh = init_device_mesh("cpu", (WORLD,))
    rank = torch.distributed.get_rank()
    torch.manual_seed(1234)
    full = torch.randn(shape)
    if source == Partial():
        # Each rank holds a part; the parts sum to `full`.
        local = full * (rank + 1) / sum(range(1, WORLD + 1))
        dt = DTensor.from_local(local, mesh, [Partial()])
    else:
        from shardwise.dtensor_ops import distribute_tensor

        dt = distribute_tensor(full, mesh, [source])
    expected = full * 2 + 1

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_rebuild_and_use, backend=counter, fullgraph=True)
    try:
        in_flight = dt.redistribute(mesh, [target], async_op=True).to_local()
        out = compiled(in_flight, mesh, target, shape)
        torch.testing.assert_close(out, expected)
        eager = _rebuild_and_use(dt.redistribute(mesh, [target], async_op=True).to_local(), mesh, target, shape)
        torch.testing.assert_close(out, eager)
        assert counter.frame_count == 1
        # The same tensor with its collective already waited gives the same values.
        waited = dt.redistribute(mesh, [target]).to_local()
        torch.testing.assert_close(compiled(waited, mesh, target, shape), expected)

        # The DTensor itself, its local tensor still in flight, as a compiled function's input.
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled_use = torch.compile(_use, backend=counter, fullgraph=True)
        torch.testing.assert_close(compiled_use(dt.redistribute(mesh, [target], async_op=True)), expected)
        assert counter.frame_count == 1
    finally:
        torch._dynamo.reset()


def _use(dtensor: DTensor) -> torch.Tensor:
    return (dtensor * 2 + 1).full_tensor()
