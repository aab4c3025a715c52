"""DTensor code compiled with aot_eager while torch's structured trace log is on, on 2 gloo ranks.

With the log on (``TORCH_TRACE``, or PyTorch's own test harness), AOTAutograd prints the traced DTensor
metadata, so the mesh's repr, while its fake and proxy modes are still active. The mesh once kept its
rank listing as a tensor, which was fake there: reading it back raised ``GuardOnDataDependentSymNode``.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch._dynamo
import torch.distributed as dist

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.testing import multi_rank


def _with_structured_trace_log(fn: Callable[[], None]) -> None:
    """Run ``fn`` with torch's structured trace log on (as ``TORCH_TRACE`` or PyTorch's test harness turn it on).

    AOTAutograd then prints the traced DTensor metadata, mesh included, while its modes are active.
    """
    from torch._logging._internal import trace_log

    handler = logging.NullHandler()
    trace_log.addHandler(handler)
    try:
        fn()
    finally:
        trace_log.removeHandler(handler)


@multi_rank(world_size=2)
def test_aot_eager_compile_of_dtensor_code_with_the_trace_log_on_matches_eager() -> None:
    def check() -> None:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        x = distribute_tensor(full, mesh, [Shard(0)])

        def fn(a: DTensor) -> torch.Tensor:
            coordinate = a.device_mesh.get_coordinate()
            assert coordinate is not None
            scaled = a * (a.device_mesh.size() + a.device_mesh.get_local_rank() - coordinate[0])
            assert isinstance(scaled, DTensor)
            return scaled.redistribute(a.device_mesh, [Replicate()]) + 1

        torch._dynamo.reset()
        try:
            compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
            out = compiled(x)
        finally:
            torch._dynamo.reset()
        expected = fn(x)
        assert isinstance(out, DTensor) and isinstance(expected, DTensor) and out.placements == (Replicate(),)
        torch.testing.assert_close(out.to_local(), expected.to_local())
        torch.testing.assert_close(out.to_local(), full * 2 + 1)
        assert dist.get_world_size() == 2

    _with_structured_trace_log(check)
