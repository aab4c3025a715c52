"""What ``torch.distributed.checkpoint`` (DCP) asks of a tensor subclass, for shardwise DTensors.

DCP describes a distributed tensor by the boxes ("chunks": global offsets and sizes) each rank
holds.  A ``Shard``/``Replicate`` layout gives one box per rank (``local_index_runs`` gives one
range per dim); a ``_StridedShard`` piece can consist of several ranges per dim, so it is
described as several boxes (every combination of one range per dim), each a view of the local
tensor.  Ranks holding the same box (replicas) each describe it; DCP's planner writes it once.
On load, DCP reads every saved box that overlaps a requested one, so a checkpoint written with
one mesh and placements loads onto any other.  Partial layouts hold no value to save: refused.
No communication here.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from shardwise.placement import DTensorSpec, local_index_runs

__all__ = ["create_write_items", "create_chunk_list", "get_tensor_shard"]


def _boxes(spec: DTensorSpec[Any]) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(global offsets, sizes, local offsets) of every box this rank holds."""
    if spec.has_partial():
        raise ValueError(
            f"cannot checkpoint a DTensor with Partial placements {spec.placements}: its value is a pending "
            "reduction; expected Shard/Replicate placements (redistribute it first)"
        )
    mesh = spec.mesh
    runs = local_index_runs(spec.shape, mesh.shape, mesh.get_coordinate(), spec.placements)
    if not spec.shape:
        return [((), (), ())]
    per_dim: list[list[tuple[int, int, int]]] = []
    for dim_runs in runs:
        local_start = 0
        entries = []
        for start, length in dim_runs:
            entries.append((start, length, local_start))
            local_start += length
        per_dim.append(entries)
    if any(not entries for entries in per_dim):
        # An empty piece: one empty box at the end of the global tensor (as PyTorch describes it).
        sizes = tuple(sum(length for _, length in dim_runs) for dim_runs in runs)
        offsets = tuple(
            entries[0][0] if entries else spec.shape[dim] for dim, entries in enumerate(per_dim)
        )
        return [(offsets, sizes, (0,) * len(sizes))]
    boxes = []
    for combination in itertools.product(*per_dim):
        boxes.append(
            (
                tuple(entry[0] for entry in combination),
                tuple(entry[1] for entry in combination),
                tuple(entry[2] for entry in combination),
            )
        )
    return boxes


def create_chunk_list(tensor: Any) -> list[Any]:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return [
        ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        for offsets, sizes, _ in _boxes(tensor._spec)
    ]


def create_write_items(tensor: Any, fqn: str) -> list[Any]:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    properties = TensorProperties.create_from_tensor(tensor._local_tensor)
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=properties,
                size=torch.Size(tensor._spec.shape),
            ),
        )
        for offsets, sizes, _ in _boxes(tensor._spec)
    ]


def get_tensor_shard(tensor: Any, index: Any) -> torch.Tensor:
    """The view of the local tensor holding the box that starts at ``index.offset`` (DCP reads into it)."""
    local: torch.Tensor = tensor._local_tensor
    boxes = _boxes(tensor._spec)
    if index.offset is None:
        if len(boxes) == 1:
            return local
        raise ValueError(f"{index.fqn}: this rank holds {len(boxes)} boxes; DCP must name one by its offset")
    wanted = tuple(index.offset)
    for offsets, sizes, local_offsets in boxes:
        if offsets == wanted:
            view = local
            for dim, (start, size) in enumerate(zip(local_offsets, sizes)):
                if size != view.size(dim):
                    view = view.narrow(dim, start, size)
            return view
    raise ValueError(
        f"{index.fqn}: this rank holds no box starting at {wanted}; it holds {[b[0] for b in boxes]}"
    )
