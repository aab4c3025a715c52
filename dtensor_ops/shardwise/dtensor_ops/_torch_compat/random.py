"""PyTorch's ``torch.distributed.tensor._random``, at the same path (``shardwise.dtensor_ops._random`` is this module).

``OffsetBasedRNGTracker`` and ``_PhiloxState`` are PyTorch's handles on random ops over DTensors;
``_rng_tracker`` is the tracker a user installs (PyTorch code assigns it: ``_random._rng_tracker = tracker``).
The engine (``_shard_rng``) owns where it is kept, ``INSTALLED_RNG_TRACKER``: this module's ``_rng_tracker``
attribute reads and writes that object, so the engine never imports this module.  ``manual_seed`` and
``is_rng_supported_mesh`` are the public ones of ``shardwise.dtensor_ops.random``.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from typing import Any, Iterator, Sequence

import torch
from shardwise.mesh import DeviceMesh
from shardwise.placement import DTensorSpec, Shard, _StridedShard, compute_local_shape

from .._shard_rng import INSTALLED_RNG_TRACKER, default_generator_for, enter_shard_stream, plan_for_spec
from ..random import broadcast_first_rank_rng_state, is_rng_supported_mesh, manual_seed

__all__ = ["OffsetBasedRNGTracker", "is_rng_supported_mesh", "manual_seed"]


class _PhiloxState:
    """A view of a Philox generator's state (``get_rng_state()`` of a CUDA generator: 16 bytes) as
    its two fields, PyTorch's accessor of the same name: ``seed`` (bytes 0-7, uint64) and ``offset``
    (bytes 8-15, int64), each a one-element tensor viewing the state, so a seed with the top bit set
    reads and writes back unchanged (as an int it would not fit int64). The state is kept on the CPU,
    where ``set_rng_state`` takes it.
    """

    def __init__(self, state: torch.Tensor) -> None:
        if state.dtype != torch.uint8 or state.numel() != 16:
            raise ValueError(f"_PhiloxState: expected a 16-byte uint8 generator state, got {state.dtype} of {state.numel()} elements")
        self._state = state.to("cpu")

    @property
    def state(self) -> torch.Tensor:
        return self._state

    @property
    def seed(self) -> torch.Tensor:
        return self._state[:8].view(torch.uint64)

    @seed.setter
    def seed(self, seed: torch.Tensor) -> None:
        self._state[:8] = self._bytes_of(seed, "seed")

    @property
    def offset(self) -> torch.Tensor:
        return self._state[8:].view(torch.int64)

    @offset.setter
    def offset(self, offset: torch.Tensor) -> None:
        self._state[8:] = self._bytes_of(offset, "offset")

    @staticmethod
    def _bytes_of(value: torch.Tensor, name: str) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.element_size() != 8:
            raise AssertionError(f"_PhiloxState.{name} takes a one-element 64-bit tensor, got {value!r}")
        return value.reshape(1).cpu().view(torch.uint8)


class OffsetBasedRNGTracker:
    """PyTorch's name for the object that puts random ops on DTensors in per-shard streams.

    shardwise needs no tracker state (each op derives its shard's stream from the generator,
    see ``_shard_rng``); this object gives PyTorch's handles on that mechanism:

    * ``distribute_region_enabled``: while False on the installed tracker (``_random._rng_tracker``, held by
      ``_shard_rng.INSTALLED_RNG_TRACKER``),
      random ops on DTensors run on each rank's generator as it is, like plain local ops;
    * ``_distribute_region(spec, generator=None)``: a context in which random ops on *plain*
      tensors draw from this rank's stream for a tensor laid out as ``spec`` (what DTensor does
      for its own random ops), leaving the generator in step on every rank afterwards;
    * ``_manual_seed(seed)``: ``torch.manual_seed(seed)`` on this rank.

    Unlike PyTorch's (CUDA-like devices only), it works on CPU and CUDA meshes.  With
    ``run_state_sync=True`` (the default, as in PyTorch) and a mesh, constructing it is a collective
    over the mesh: every rank's default generator for the mesh's device takes the state of the
    mesh's first rank (coordinate 0 on every dim; one broadcast per mesh dim of size > 1), with a
    ``UserWarning`` on ranks whose state differed (PyTorch logs a warning and deprecates the sync:
    seed every rank alike with ``torch.manual_seed`` or :func:`manual_seed` instead).  Ranks
    outside the mesh take no part.
    """

    def __init__(self, device_mesh: DeviceMesh | None = None, run_state_sync: bool = True) -> None:
        if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"OffsetBasedRNGTracker: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
        device_type = device_mesh.device_type if device_mesh is not None else "cpu"
        if device_type not in ("cpu", "cuda") or (device_type == "cuda" and not torch.cuda.is_available()):
            raise RuntimeError(
                f"OffsetBasedRNGTracker supports 'cpu' and 'cuda' meshes (with CUDA available), got {device_type!r}"
            )
        self._device = torch.device(device_type)
        self._use_distribute_region = True
        self.run_state_sync = bool(run_state_sync)
        if self.run_state_sync and device_mesh is not None:
            self._take_first_rank_state(device_mesh)

    def _take_first_rank_state(self, mesh: DeviceMesh) -> None:
        generator = default_generator_for(self._device)
        if generator is None or mesh.get_coordinate() is None:
            return
        own = generator.get_state()
        first = broadcast_first_rank_rng_state(mesh, own)
        if not torch.equal(first, own):
            warnings.warn(
                "OffsetBasedRNGTracker: this rank's random generator state differed from the mesh's first rank's; "
                "it now has the first rank's state (as PyTorch's DTensor synchronises it). Seed every rank alike "
                "with torch.manual_seed(seed) or shardwise.dtensor_ops.random.manual_seed(seed, mesh) instead "
                "(PyTorch deprecates this sync)",
                UserWarning,
                stacklevel=3,
            )
            generator.set_state(first)

    @property
    def distribute_region_enabled(self) -> bool:
        return self._use_distribute_region

    @distribute_region_enabled.setter
    def distribute_region_enabled(self, value: bool) -> None:
        self._use_distribute_region = bool(value)

    def _manual_seed(self, parallel_seed: int) -> None:
        torch.manual_seed(parallel_seed)

    @contextlib.contextmanager
    def _distribute_region(self, spec: DTensorSpec[Any], generator: torch.Generator | None = None) -> Iterator[None]:
        plan = plan_for_spec(spec)
        stream_generator = generator if generator is not None else default_generator_for(self._device)
        if plan.shard_index is None or not self._use_distribute_region or stream_generator is None:
            yield
            return
        leave = enter_shard_stream(plan, plan.shard_index, stream_generator)
        try:
            yield
        finally:
            leave()


# (mesh, this rank's generator state) -> the mesh's first rank's state, on every rank of the mesh.


def _calc_shard_info(mesh_coordinate: Sequence[int], spec: DTensorSpec[Any]) -> tuple[list[int], list[int]]:
    """Per tensor dim of ``spec``: which shard the rank at ``mesh_coordinate`` holds, and how many shards there are.

    A tensor dim cut by several mesh dims is numbered over them in mesh-dim order (the first mesh dim
    outermost), the ``torch.chunk`` nesting of the layout; an uncut dim is shard 0 of 1.
    """
    shard_index = [0] * len(spec.shape)
    shard_count = [1] * len(spec.shape)
    for mesh_dim, placement in enumerate(spec.placements):
        if isinstance(placement, (Shard, _StridedShard)):
            size = spec.mesh.shape[mesh_dim]
            shard_index[placement.dim] = shard_index[placement.dim] * size + mesh_coordinate[mesh_dim]
            shard_count[placement.dim] *= size
    return shard_index, shard_count


def _calc_shard_linear_idx(shard_coord: Sequence[int], shard_size: Sequence[int]) -> int:
    """The shard's number among all shards, its per-dim indices read row-major (the last dim fastest)."""
    linear = 0
    for index, count in zip(shard_coord, shard_size):
        linear = linear * count + index
    return linear


def _calc_first_shard_size(spec: DTensorSpec[Any]) -> list[int]:
    """The local shape of the first shard (mesh coordinate 0 on every mesh dim): the largest, by ``torch.chunk``."""
    return list(compute_local_shape(spec.shape, spec.mesh.shape, (0,) * spec.mesh.ndim, spec.placements))


class _RandomModule(types.ModuleType):
    """This module's type: ``_rng_tracker`` is a view of the engine's ``INSTALLED_RNG_TRACKER.tracker``."""

    @property
    def _rng_tracker(self) -> OffsetBasedRNGTracker | None:
        return INSTALLED_RNG_TRACKER.tracker  # type: ignore[return-value]

    @_rng_tracker.setter
    def _rng_tracker(self, tracker: OffsetBasedRNGTracker | None) -> None:
        INSTALLED_RNG_TRACKER.tracker = tracker


# PyTorch installs a tracker at the first random op; here one is only ever set by the user (or a test base's
# tearDown resets it), and only its ``distribute_region_enabled`` is read.
sys.modules[__name__].__class__ = _RandomModule
