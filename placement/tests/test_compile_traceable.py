"""Placements and specs are built and queried inside compiled regions (DTensor.from_local under
torch.compile does exactly that): dynamo must trace them without graph breaks."""

from __future__ import annotations

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta
from shardwise.testing import FakeMesh

MESH = FakeMesh((2,), coordinate=(1,))


def layout_dependent_compute(values: torch.Tensor, placement: Placement) -> torch.Tensor:
    spec = DTensorSpec(MESH, (placement,), TensorMeta(values.shape, values.stride(), values.dtype))
    (local_rows,), (first_row,) = spec.local_shape_and_offset()
    if placement == Shard(0) and placement.is_shard(dim=0) and spec.num_shards == 2:
        return values.narrow(0, first_row, local_rows) * 2
    if placement.is_partial() and spec.has_partial():
        return values - 1
    return values + 1


def test_placements_and_specs_trace_with_fullgraph() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(layout_dependent_compute, backend="eager", fullgraph=True)
    values = torch.arange(5.0)
    for placement in (Shard(0), Replicate(), Partial("max")):
        assert torch.equal(compiled(values, placement), layout_dependent_compute(values, placement)), placement
    assert compiled(values, Shard(0)).tolist() == [6.0, 8.0]
