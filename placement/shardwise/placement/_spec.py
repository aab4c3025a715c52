"""TensorMeta and DTensorSpec: the global description of a distributed tensor."""

from __future__ import annotations

from typing import Any, Generic, Iterable, NamedTuple, NoReturn, Sequence, TypeVar, cast

import torch

from ._layout import _shard_tensor_dim, compute_local_shape_and_global_offset
from ._mesh_protocol import MeshLike
from ._placements import Partial, Placement, Replicate, Shard, _StridedShard
from ._shard_order import (
    ShardOrder,
    ShardOrderEntry,
    check_shard_order,
    default_shard_order,
    is_default_shard_order,
    shard_order_to_strided_placements,
    strided_placements_to_shard_order,
)

__all__ = ["TensorMeta", "DTensorSpec"]

MeshT = TypeVar("MeshT", bound=MeshLike)


class TensorMeta(NamedTuple):
    """Global shape, stride and dtype of a distributed tensor."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


def _check_dtype_can_average(
    dtype: torch.dtype, mesh_dim: int, placements: tuple[Placement, ...], mesh: MeshLike
) -> None:
    """``Partial("avg")`` needs a dtype that can hold a mean.

    The mean of integers is in general not an integer (0, 1, 2, 3 average to 1.5), so reducing
    such a partial could only round, silently.  This is where the placement meets the dtype
    (every DTensor, redistribution target and op output gets a spec), so the error comes before
    any collective, on every rank alike.
    """
    if dtype.is_floating_point or dtype.is_complex:
        return
    raise ValueError(
        f"Partial('avg') on mesh dim {mesh_dim} (placements {placements}, mesh {mesh!r}) needs a floating-point "
        f"or complex dtype, got {dtype}: the average of {dtype} values across ranks is not a {dtype} in general "
        "and would be truncated; convert the tensor to a floating dtype (e.g. .float()) first, or use "
        "Partial('sum') and divide afterwards"
    )


# DTensorSpec._derived_shard_order before shard_order was first asked for.
_NOT_DERIVED = object()


class DTensorSpec(Generic[MeshT]):
    """How a tensor of (optionally known) global metadata is laid out over ``mesh``.

    Immutable; hashable and compared by ``(mesh, placements, tensor_meta, shard order)`` with the
    hash computed once, so specs can key the dispatch and redistribution caches.
    ``Shard`` dims are stored normalised (non-negative) when ``tensor_meta`` is given.

    ``shard_order`` (PyTorch 2.13's): the order in which mesh dims cut a tensor dim sharded by
    several of them (see ``_shard_order``); given only for ``Shard`` placements, kept only when it
    differs from the default left-to-right order. :attr:`layout_placements` is the same layout in
    ``Shard``/``_StridedShard`` form, which is what the engine lays data out by.
    """

    __slots__ = (
        "mesh",
        "placements",
        "tensor_meta",
        "_hash",
        "_num_shards",
        "_partial_mesh_dims",
        "_num_shards_per_dim",
        "_shard_order",
        "_derived_shard_order",
    )
    mesh: MeshT
    placements: tuple[Placement, ...]
    tensor_meta: TensorMeta | None
    _hash: int | None
    _num_shards: int
    _partial_mesh_dims: tuple[int, ...]
    _num_shards_per_dim: tuple[int, ...] | None
    _shard_order: ShardOrder | None
    # What ``shard_order`` derives from the placements, once asked (_NOT_DERIVED until then): torch.compile
    # reads it on every call of a compiled function, per DTensor input (``DTensor.__tensor_flatten__``).
    _derived_shard_order: ShardOrder | None | object

    def __init__(
        self,
        mesh: MeshT,
        placements: Iterable[Placement],
        tensor_meta: TensorMeta | None = None,
        shard_order: ShardOrder | None = None,
    ) -> None:
        placements = placements if type(placements) is tuple else tuple(placements)
        mesh_shape = mesh.shape
        if len(placements) != len(mesh_shape):
            raise ValueError(
                f"DTensorSpec got {len(placements)} placements {placements} for a {len(mesh_shape)}-D mesh "
                f"of shape {tuple(mesh_shape)} ({mesh!r}); expected one placement per mesh dim"
            )
        if tensor_meta is not None and not isinstance(tensor_meta, TensorMeta):
            raise TypeError(f"tensor_meta must be a TensorMeta or None, got {type(tensor_meta).__name__}")
        global_shape = None if tensor_meta is None else tensor_meta.shape

        num_shards = 1
        partial_mesh_dims = []
        normalized: list[Placement] | None = None
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                num_shards *= mesh_shape[mesh_dim]
                if global_shape is not None and not 0 <= placement.dim < len(global_shape):
                    normalized = normalized or list(placements)
                    normalized[mesh_dim] = Shard(_shard_tensor_dim(placement, mesh_dim, global_shape))
            elif isinstance(placement, _StridedShard):
                num_shards *= mesh_shape[mesh_dim]
                if global_shape is not None and not 0 <= placement.dim < len(global_shape):
                    normalized = normalized or list(placements)
                    normalized[mesh_dim] = _StridedShard(
                        _shard_tensor_dim(placement, mesh_dim, global_shape), split_factor=placement.split_factor
                    )
            elif isinstance(placement, Partial):
                partial_mesh_dims.append(mesh_dim)
                if placement.reduce_op == "avg" and tensor_meta is not None:
                    _check_dtype_can_average(tensor_meta.dtype, mesh_dim, placements, mesh)
            elif not isinstance(placement, Placement):
                raise TypeError(
                    f"placements[{mesh_dim}] is {placement!r} of type {type(placement).__name__}; "
                    "expected a Placement (Shard, Replicate or Partial)"
                )
        if normalized is not None:
            placements = tuple(normalized)
        if shard_order is not None:
            shard_order = tuple(ShardOrderEntry(int(d), tuple(int(m) for m in dims)) for d, dims in shard_order)
            if any(isinstance(p, _StridedShard) for p in placements):
                raise ValueError(
                    f"DTensorSpec got shard_order {shard_order} with _StridedShard placements {placements}; "
                    "_StridedShard already spells an order, expected one of the two"
                )
            check_shard_order(shard_order, placements)
            if is_default_shard_order(shard_order):
                shard_order = None

        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "tensor_meta", tensor_meta)
        try:
            spec_hash: int | None = hash((mesh, placements, tensor_meta, shard_order))
        except TypeError:
            # Symbolic (SymInt) shapes while torch.compile traces: unhashable by design.  Such a spec
            # is compared field by field and never keys a cache (dispatch bypasses it while tracing).
            spec_hash = None
        object.__setattr__(self, "_hash", spec_hash)
        object.__setattr__(self, "_num_shards", num_shards)
        object.__setattr__(self, "_partial_mesh_dims", tuple(partial_mesh_dims))
        object.__setattr__(self, "_num_shards_per_dim", None)
        object.__setattr__(self, "_shard_order", shard_order)
        object.__setattr__(self, "_derived_shard_order", _NOT_DERIVED)

    # -- immutability, hashing, pickling -------------------------------------

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(
            f"DTensorSpec is immutable; cannot set {name!r}. Use with_placements()/with_tensor_meta()."
        )

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"DTensorSpec is immutable; cannot delete {name!r}")

    def __hash__(self) -> int:
        if self._hash is None:
            raise TypeError(
                # No repr of the mesh here: this is raised (and caught) while torch.compile traces, where
                # building a mesh's text would run tensor code under fake tensors.
                f"a DTensorSpec with placements {self.placements} has symbolic (traced) shapes and is not "
                "hashable; expected concrete shapes (symbolic specs are compared, never used as cache keys)"
            )
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DTensorSpec):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.placements == other.placements
            and self.tensor_meta == other.tensor_meta
            and self._shard_order == other._shard_order
            and self.mesh == other.mesh
        )

    def _check_equals(self, other: object, skip_shapes: bool = False) -> bool:
        """PyTorch 2.13's comparison: ``==``, or with ``skip_shapes`` the same but for global shape and stride.

        torch.compile guards a DTensor input under ``shardwise.torch_switch`` with ``skip_shapes=True``
        (dynamo's DTENSOR_SPEC_MATCH): shapes are guarded on the tensor itself, so dynamic shapes do not
        recompile per shape.
        """
        if not skip_shapes:
            return self == other
        if not isinstance(other, DTensorSpec):
            return False
        if not (self.placements == other.placements and self.shard_order == other.shard_order and self.mesh == other.mesh):
            return False
        if self.tensor_meta is None or other.tensor_meta is None:
            return self.tensor_meta is other.tensor_meta
        return self.tensor_meta.dtype == other.tensor_meta.dtype

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (DTensorSpec, (self.mesh, self.placements, self.tensor_meta, self._shard_order))

    def __repr__(self) -> str:
        order = "" if self._shard_order is None else f", shard_order={self._shard_order!r}"
        return f"DTensorSpec(mesh={self.mesh!r}, placements={self.placements!r}, tensor_meta={self.tensor_meta!r}{order})"

    def __str__(self) -> str:
        layout = self.format_shard_order_str(self.placements, self._shard_order)
        if self.tensor_meta is None:
            return f"Spec({layout})"
        return f"Spec({layout} on {tuple(self.tensor_meta.shape)})"

    # -- derived copies ------------------------------------------------------

    def with_placements(self, placements: Iterable[Placement]) -> DTensorSpec[MeshT]:
        """Same mesh and tensor_meta, other placements."""
        return DTensorSpec(self.mesh, placements, self.tensor_meta)

    def with_tensor_meta(self, tensor_meta: TensorMeta | None) -> DTensorSpec[MeshT]:
        """Same mesh, placements and shard order, other tensor_meta."""
        return DTensorSpec(self.mesh, self.placements, tensor_meta, self._shard_order)

    def with_shard_order(self, shard_order: ShardOrder | None) -> DTensorSpec[MeshT]:
        """Same mesh, placements and tensor_meta, another shard order (None: the default)."""
        return DTensorSpec(self.mesh, self.placements, self.tensor_meta, shard_order)

    # -- shard order -----------------------------------------------------------

    @property
    def shard_order(self) -> ShardOrder | None:
        """The order in which mesh dims cut each sharded tensor dim.

        The explicit order when one was given; for ``_StridedShard`` placements the order they
        spell (None when they spell none); else the default left-to-right order.
        """
        if self._shard_order is not None:
            return self._shard_order
        derived = self._derived_shard_order
        if derived is _NOT_DERIVED:
            derived = strided_placements_to_shard_order(self.placements, tuple(self.mesh.shape))
            object.__setattr__(self, "_derived_shard_order", derived)
        return cast("ShardOrder | None", derived)

    @property
    def has_explicit_shard_order(self) -> bool:
        """True when a non-default shard order was given (the layout then differs from the placements' reading)."""
        return self._shard_order is not None

    @property
    def layout_placements(self) -> tuple[Placement, ...]:
        """The placements that lay data out as this spec does, the shard order spelled with ``_StridedShard``."""
        if self._shard_order is None:
            return self.placements
        return shard_order_to_strided_placements(self._shard_order, self.placements, tuple(self.mesh.shape))

    def as_layout_spec(self) -> DTensorSpec[MeshT]:
        """This layout without an explicit shard order (``Shard``/``_StridedShard`` placements)."""
        if self._shard_order is None:
            return self
        return DTensorSpec(self.mesh, self.layout_placements, self.tensor_meta)

    @staticmethod
    def compute_default_shard_order(placements: Sequence[Placement]) -> ShardOrder:
        """Each sharded tensor dim cut by its mesh dims left to right."""
        return default_shard_order(placements)

    @staticmethod
    def is_default_device_order(shard_order: ShardOrder | None) -> bool:
        """True when every tensor dim is cut by its mesh dims left to right."""
        return is_default_shard_order(shard_order)

    @staticmethod
    def _convert_shard_order_to_StridedShard(
        shard_order: ShardOrder, placements: Sequence[Placement], mesh: MeshLike
    ) -> tuple[Placement, ...]:
        """``Shard`` placements plus ``shard_order`` -> the same layout as ``Shard``/``_StridedShard`` placements."""
        return shard_order_to_strided_placements(shard_order, placements, tuple(mesh.shape))

    @staticmethod
    def _maybe_convert_StridedShard_to_shard_order(
        placements: Sequence[Placement], mesh: MeshLike
    ) -> ShardOrder | None:
        """The shard order ``Shard``/``_StridedShard`` placements spell, or None when they spell none."""
        return strided_placements_to_shard_order(placements, tuple(mesh.shape))

    @staticmethod
    def format_shard_order_str(placements: Sequence[Placement], shard_order: ShardOrder | None = None) -> str:
        """Placements in mesh order; a tensor dim cut by several mesh dims shows each one's turn, ``S(0)[1]``."""
        turn: dict[int, int] = {}
        for entry in shard_order or ():
            if len(entry.mesh_dims) > 1:
                turn.update({mesh_dim: index for index, mesh_dim in enumerate(entry.mesh_dims)})
        return "".join(f"{p}[{turn[m]}]" if m in turn else str(p) for m, p in enumerate(placements))

    # -- tensor metadata -----------------------------------------------------

    def _require_meta(self, what: str) -> TensorMeta:
        if self.tensor_meta is None:
            raise ValueError(f"{self!s}: {what} is unknown because this DTensorSpec has no tensor_meta")
        return self.tensor_meta

    @property
    def device_mesh(self) -> MeshT:
        return self.mesh

    @property
    def shape(self) -> torch.Size:
        return self._require_meta("shape").shape

    @property
    def stride(self) -> tuple[int, ...]:
        return self._require_meta("stride").stride

    @property
    def dtype(self) -> torch.dtype:
        return self._require_meta("dtype").dtype

    @property
    def ndim(self) -> int:
        return len(self._require_meta("ndim").shape)

    # -- layout queries ------------------------------------------------------

    @property
    def num_shards(self) -> int:
        """Number of distinct shards: product of the mesh sizes of all sharding mesh dims."""
        return self._num_shards

    @property
    def num_shards_per_dim(self) -> tuple[int, ...]:
        """For each tensor dim, into how many pieces it is cut (product over the mesh dims sharding it)."""
        cached = self._num_shards_per_dim
        if cached is None:
            counts = [1] * self.ndim
            mesh_shape = self.mesh.shape
            for mesh_dim, placement in enumerate(self.placements):
                if isinstance(placement, (Shard, _StridedShard)):
                    counts[placement.dim] *= mesh_shape[mesh_dim]
            cached = tuple(counts)
            object.__setattr__(self, "_num_shards_per_dim", cached)
        return cached

    def shard_mesh_dims(self, tensor_dim: int) -> tuple[int, ...]:
        """Mesh dims sharding ``tensor_dim``, left to right (the order they split it in)."""
        if self.tensor_meta is not None and tensor_dim < 0:
            tensor_dim += len(self.tensor_meta.shape)
        return tuple(
            mesh_dim
            for mesh_dim, placement in enumerate(self.placements)
            if isinstance(placement, Shard) and placement.dim == tensor_dim
        )

    @property
    def partial_mesh_dims(self) -> tuple[int, ...]:
        """Mesh dims whose placement is Partial."""
        return self._partial_mesh_dims

    def is_replicated(self) -> bool:
        """True when every mesh dim replicates."""
        return all(isinstance(p, Replicate) for p in self.placements)

    def is_sharded(self) -> bool:
        """True when at least one mesh dim shards (``Shard`` or ``_StridedShard``)."""
        return any(isinstance(p, (Shard, _StridedShard)) for p in self.placements)

    def has_partial(self) -> bool:
        """True when at least one mesh dim is Partial."""
        return bool(self._partial_mesh_dims)

    # -- PyTorch's dim-map view of a layout (tests and rule code written for it read these) --

    @property
    def dim_map(self) -> list[int]:
        """For each tensor dim, the mesh dim sharding it, or -1; at most one mesh dim per tensor dim.

        A tensor dim sharded by several mesh dims (``[Shard(0), Shard(0)]``) has no dim-map
        form, so it raises, as PyTorch's does, naming both mesh dims.
        """
        sharding_mesh_dim = [-1] * self.ndim
        for mesh_dim, placement in enumerate(self.placements):
            if isinstance(placement, (Shard, _StridedShard)):
                previous = sharding_mesh_dim[placement.dim]
                if previous >= 0:
                    raise ValueError(
                        f"dim_map: tensor dim {placement.dim} is sharded on mesh dims {previous} and {mesh_dim} "
                        f"({self.placements}); a dim map holds one mesh dim per tensor dim, expected placements "
                        "with each tensor dim sharded at most once"
                    )
                sharding_mesh_dim[placement.dim] = mesh_dim
        return sharding_mesh_dim

    @property
    def num_shards_map(self) -> list[int]:
        """:attr:`num_shards_per_dim` as a list (PyTorch's name)."""
        return list(self.num_shards_per_dim)

    @property
    def sums(self) -> list[int]:
        """The Partial mesh dims as a list (PyTorch's name for the pending reductions)."""
        return list(self._partial_mesh_dims)

    @classmethod
    def from_dim_map(
        cls,
        mesh: MeshT,
        dim_map: list[int],
        sums: list[int],
        tensor_meta: TensorMeta | None = None,
    ) -> DTensorSpec[MeshT]:
        """The spec whose :attr:`dim_map` is ``dim_map`` and whose Partial(sum) mesh dims are ``sums``."""
        placements: list[Placement] = [Replicate() for _ in mesh.shape]
        for mesh_dim in sums:
            placements[mesh_dim] = Partial()
        for tensor_dim, mesh_dim in enumerate(dim_map):
            if mesh_dim < 0:
                continue
            taken = placements[mesh_dim]
            if isinstance(taken, Shard):
                raise RuntimeError(
                    f"from_dim_map: mesh dim {mesh_dim} cannot shard both tensor dims {taken.dim} and {tensor_dim}; "
                    "expected each mesh dim in dim_map at most once"
                )
            if isinstance(taken, Partial):
                raise RuntimeError(
                    f"from_dim_map: mesh dim {mesh_dim} is in sums and shards tensor dim {tensor_dim}; expected a "
                    "mesh dim to be either Partial or Shard"
                )
            placements[mesh_dim] = Shard(tensor_dim)
        return cls(mesh, placements, tensor_meta)

    def local_shape_and_offset(
        self, coordinate: Sequence[int] | None = None
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Local shape and global offset of the shard at ``coordinate`` (default: this rank's, from the mesh).

        Delegates to :func:`compute_local_shape_and_global_offset`; a rank outside
        the mesh gets an empty shape.
        """
        meta = self._require_meta("the local shape")
        if coordinate is None:
            coordinate = self.mesh.get_coordinate()
        return compute_local_shape_and_global_offset(meta.shape, self.mesh.shape, coordinate, self.layout_placements)

    def local_shape(self, coordinate: Sequence[int] | None = None) -> tuple[int, ...]:
        """Local shape part of :meth:`local_shape_and_offset`."""
        return self.local_shape_and_offset(coordinate)[0]
