"""Factory functions that build a DTensor shard by shard (``torch.distributed.tensor.zeros`` & co).

Each rank allocates only its local shard (``torch.chunk`` layout, uneven shapes
included).  ``Partial`` mesh dims hold the value so that the reduction gives the
requested global value (e.g. ``ones`` with ``Partial("sum")``: one rank holds the
ones, the others zeros).

Random factories (``rand``, ``randn``) draw one seed from the default CPU
generator (so ``torch.manual_seed`` makes them reproducible), agree on it across
the mesh (the first rank's seed wins, one tiny broadcast per mesh dim: factories
run at initialisation, where this buys robustness against ranks seeded
differently) and draw from a private generator with that seed in this rank's
*shard stream* (``_shard_rng.run_in_shard_stream``, the same derivation random ops
on DTensors use): only the mesh dims that shard the tensor count, so ranks
holding the same shard get the same values and different shards get
independent values.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch
from shardwise.mesh import DeviceMesh
from shardwise.mesh import _simulation as simulation
from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    TensorMeta,
    compute_local_shape,
    contiguous_strides,
)

from ._decision import RandomPlan
from ._dtensor import DTensor, new_dtensor
from ._placement_args import normalize_placements, resolve_device_mesh
from ._shard_rng import plan_for_spec, run_in_shard_stream
from ._plan_executor import redistribute_local_tensor
from ._src_data import agree_on_int

__all__ = ["zeros", "ones", "empty", "full", "rand", "randn"]

SizeArg = int | Sequence[int] | torch.Size

# Where a random factory draws from: a generator seeded alike on every rank, and this rank's shard stream.
_RandomSource = tuple[torch.Generator, RandomPlan]
# A local-tensor builder: (local shape, dtype, layout, device, random source or None) -> tensor.
_Builder = Callable[[tuple[int, ...], torch.dtype, torch.layout, torch.device, _RandomSource | None], torch.Tensor]


def _parse_size(size: tuple[Any, ...], where: str) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    dims: list[int] = []
    for extent in size:
        if isinstance(extent, bool):
            raise TypeError(f"{where}: size must be ints, got bool {extent!r} in {size}")
        try:
            value = operator.index(extent)
        except TypeError:
            raise TypeError(
                f"{where}: size must be ints (varargs or one sequence), got {type(extent).__name__} {extent!r} "
                f"in {size}"
            ) from None
        if value < 0:
            raise ValueError(f"{where}: size must be non-negative, got {tuple(size)}")
        dims.append(value)
    return tuple(dims)


_SEED_MODULUS = 1 << 63


def _create(
    where: str,
    size: tuple[Any, ...],
    build: _Builder,
    *,
    random: bool,
    partial_needs_conversion: bool,
    dtype: torch.dtype | None,
    layout: torch.layout,
    requires_grad: bool,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
) -> DTensor:
    mesh = resolve_device_mesh(device_mesh, where)
    global_shape = _parse_size(size, where)
    target = normalize_placements(placements, mesh, len(global_shape), where)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    device = torch.device(mesh.device_type)
    meta = TensorMeta(torch.Size(global_shape), contiguous_strides(global_shape), dtype)
    spec = DTensorSpec(mesh, target, meta)
    if isinstance(simulation.simulated_view(), frozenset):
        # Every rank simulated here (torch's LocalTensorMode): each rank builds its own shard; one seed,
        # drawn once, is every rank's (no agreement needed).
        seed: int | None = None
        if random:
            with simulation.mode_disabled():
                seed = int(torch.randint(0, _SEED_MODULUS - 1, (1,), dtype=torch.int64).item())
        local = simulation.run_for_each_simulated_rank(_build_own_shard, spec, build, seed, layout)
    else:
        seed = None
        if random and mesh.get_coordinate() is not None:
            drawn = int(torch.randint(0, _SEED_MODULUS - 1, (1,), dtype=torch.int64).item())
            seed = agree_on_int(drawn, mesh)
        local = _build_own_shard(spec, build, seed, layout)
    coordinate = mesh.get_coordinate()
    if partial_needs_conversion and coordinate is not None and any(isinstance(p, Partial) for p in target):
        as_replicated = tuple(Replicate() if isinstance(p, Partial) else p for p in target)
        local = redistribute_local_tensor(local, DTensorSpec(mesh, as_replicated, meta), spec)
    return new_dtensor(local, spec, requires_grad=requires_grad)


def _build_own_shard(spec: DTensorSpec[Any], build: _Builder, seed: int | None, layout: torch.layout) -> torch.Tensor:
    """This rank's shard of a factory's DTensor (``seed``: the agreed seed of a random factory)."""
    mesh = spec.mesh
    meta = spec.tensor_meta
    assert meta is not None
    coordinate = mesh.get_coordinate()
    # Outside the mesh: nothing (PyTorch's tensor([])).
    local_shape = (0,) if coordinate is None else compute_local_shape(meta.shape, mesh.shape, coordinate, spec.placements)
    device = torch.device(mesh.device_type)
    source: _RandomSource | None = None
    if seed is not None and coordinate is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        source = (generator, plan_for_spec(spec))
    return build(tuple(local_shape), meta.dtype, layout, device, source)


def zeros(
    *size: Any,
    requires_grad: bool = False,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """A DTensor of zeros of global shape ``size``; each rank allocates its shard only."""
    return _create(
        "zeros",
        size,
        lambda shape, dt, lay, dev, _: torch.zeros(shape, dtype=dt, layout=lay, device=dev),
        random=False,
        partial_needs_conversion=False,
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        device_mesh=device_mesh,
        placements=placements,
    )


def ones(
    *size: Any,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """A DTensor of ones of global shape ``size``."""
    return _create(
        "ones",
        size,
        lambda shape, dt, lay, dev, _: torch.ones(shape, dtype=dt, layout=lay, device=dev),
        random=False,
        partial_needs_conversion=True,
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        device_mesh=device_mesh,
        placements=placements,
    )


def empty(
    *size: Any,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """An uninitialised DTensor of global shape ``size``."""
    return _create(
        "empty",
        size,
        lambda shape, dt, lay, dev, _: torch.empty(shape, dtype=dt, layout=lay, device=dev),
        random=False,
        partial_needs_conversion=False,
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        device_mesh=device_mesh,
        placements=placements,
    )


def full(
    size: SizeArg,
    fill_value: bool | int | float | complex,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """A DTensor of global shape ``size`` filled with ``fill_value``."""
    if dtype is None:
        # As torch.full: the dtype follows the fill value (int -> int64, bool -> bool, float -> default).
        dtype = torch.full((), fill_value).dtype
    return _create(
        "full",
        (size,),
        lambda shape, dt, lay, dev, _: torch.full(shape, fill_value, dtype=dt, layout=lay, device=dev),
        random=False,
        partial_needs_conversion=True,
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        device_mesh=device_mesh,
        placements=placements,
    )


def _random_builder(
    sample: Callable[..., torch.Tensor],
) -> _Builder:
    def build(
        shape: tuple[int, ...],
        dtype: torch.dtype,
        layout: torch.layout,
        device: torch.device,
        source: _RandomSource | None,
    ) -> torch.Tensor:
        if source is None:
            return sample(shape, dtype=dtype, layout=layout, device=device)
        generator, plan = source
        return run_in_shard_stream(
            plan, generator, lambda: sample(shape, generator=generator, dtype=dtype, layout=layout, device=device)
        )

    return build


def rand(
    *size: Any,
    requires_grad: bool = False,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """Uniform [0, 1) values; independent per shard, equal on ranks holding the same shard."""
    return _create(
        "rand",
        size,
        _random_builder(torch.rand),
        random=True,
        partial_needs_conversion=True,
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        device_mesh=device_mesh,
        placements=placements,
    )


def randn(
    *size: Any,
    requires_grad: bool = False,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """Standard normal values; independent per shard, equal on ranks holding the same shard."""
    return _create(
        "randn",
        size,
        _random_builder(torch.randn),
        random=True,
        partial_needs_conversion=True,
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        device_mesh=device_mesh,
        placements=placements,
    )
