"""Pure mesh layout math: which ranks form each sub-mesh and each process group.

Every mesh, sliced or flattened, is a view of its root mesh: the root's n-D grid of ranks plus,
for each of the view's dims, the tuple of root dims it spans (one root dim for a plain dim,
several for a flattened one). Root dims that no view dim spans select *which* sub-mesh a rank
sees. Nothing here knows about processes, so it is unit-tested directly.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from shardwise.mesh._validation import RankGrid

__all__ = ["MeshLayout", "Run", "nested_ranks"]

Run = tuple[int, int]
"""``(size, stride)``: a dim's index ``i`` in ``range(size)`` moves ``i * stride`` places in the root's rank list."""

# Meshes up to this many ranks print every rank; larger ones print a bounded summary.
_RANKS_PRINTED_IN_FULL = 64


class _RankPositions:
    """Where each rank sits in a root's row-major rank list.

    A mesh over consecutive ranks (every ``init_device_mesh`` mesh) needs no table: the position is
    the rank minus the first. Other meshes keep a dict, built once per root.
    """

    __slots__ = ("_first", "_count", "_table")

    def __init__(self, ranks: tuple[int, ...], *, known_consecutive: bool = False) -> None:
        self._first = ranks[0]
        self._count = len(ranks)
        consecutive = known_consecutive or (
            ranks[-1] - ranks[0] == len(ranks) - 1 and ranks == tuple(range(ranks[0], ranks[-1] + 1))
        )
        self._table: dict[int, int] | None = None if consecutive else {rank: i for i, rank in enumerate(ranks)}

    @property
    def consecutive(self) -> bool:
        return self._table is None

    def position(self, rank: int) -> int | None:
        if self._table is not None:
            return self._table.get(rank)
        position = rank - self._first
        return position if 0 <= position < self._count else None


@dataclass(frozen=True)
class MeshLayout:
    root_shape: tuple[int, ...]
    root_ranks: tuple[int, ...]
    dims: tuple[tuple[int, ...], ...]
    """For each dim of this view, the root dims it spans, in increasing order."""

    def __post_init__(self) -> None:
        if math.prod(self.root_shape) != len(self.root_ranks):
            raise ValueError(f"root shape {self.root_shape} does not hold {len(self.root_ranks)} ranks")
        used = [root_dim for root_dims in self.dims for root_dim in root_dims]
        if not self.dims or any(not root_dims for root_dims in self.dims):
            raise ValueError(f"a mesh view needs at least one dim and each dim at least one root dim, got {self.dims}")
        if used != sorted(set(used)) or any(not 0 <= d < len(self.root_shape) for d in used):
            raise ValueError(f"view dims {self.dims} must be disjoint, increasing root dims of {self.root_shape}")

    @staticmethod
    def root(grid: RankGrid) -> MeshLayout:
        layout = MeshLayout(grid.shape, grid.ranks, tuple((d,) for d in range(len(grid.shape))))
        if grid.consecutive:
            layout.__dict__["_position_of_rank"] = _RankPositions(grid.ranks, known_consecutive=True)
        return layout

    def view(self, dims: tuple[tuple[int, ...], ...]) -> MeshLayout:
        view = MeshLayout(self.root_shape, self.root_ranks, dims)
        # Views of one root share its rank -> position map (one per root, not one per slice).
        view.__dict__["_position_of_rank"] = self._position_of_rank
        view.__dict__["ranks_identity"] = self.ranks_identity
        return view

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(math.prod(self.root_shape[d] for d in root_dims) for root_dims in self.dims)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def root_strides(self) -> tuple[int, ...]:
        strides = [1] * len(self.root_shape)
        for d in range(len(self.root_shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * self.root_shape[d + 1]
        return tuple(strides)

    @functools.cached_property
    def runs(self) -> tuple[tuple[Run, ...], ...]:
        """Per dim, how it steps through the root's row-major rank list: ``(size, stride)`` runs, outermost first.

        Root dims of size 1 take no run, and consecutive root dims that step evenly merge into
        one run, so the runs depend only on which ranks a dim walks and in what order, not on how
        the root's grid is cut: layouts of one root rank list over different grids (a mesh and
        its ``unflatten``) compare by them.
        """
        return tuple(
            _coalesce((self.root_shape[d], self.root_strides[d]) for d in root_dims) for root_dims in self.dims
        )

    @functools.cached_property
    def signature(self) -> tuple[object, ...]:
        """What decides the view's sub-meshes and groups, whatever grid its root is cut into (keys, equality)."""
        return (self.ranks_identity, self.shape, self.runs)

    def __eq__(self, other: object) -> bool:
        # By what the view walks, not by how its root grid is cut: torch's pipelining compares
        # ``mesh._layout`` of meshes that may come from different ``_unflatten`` calls.
        if not isinstance(other, MeshLayout):
            return NotImplemented
        return self is other or self.signature == other.signature

    def __hash__(self) -> int:
        return hash(self.signature)

    @functools.cached_property
    def strides(self) -> tuple[int | tuple[int, ...], ...]:
        """Per dim, its stride in the root's row-major rank list; a tuple when not one stride.

        As PyTorch's layouts print them: root dims of size 1 take no stride (a size-1 dim shows
        ``()``), and consecutive root dims that step through the ranks evenly merge into one
        stride (a flattened dp x cp has one); otherwise one stride per evenly stepping run.
        """
        result: list[int | tuple[int, ...]] = []
        for runs in self.runs:
            strides = tuple(stride for _, stride in runs)
            result.append(strides[0] if len(strides) == 1 else strides)
        return tuple(result)

    def unflatten(self, dim: int, sizes: tuple[int, ...]) -> MeshLayout:
        """This view with ``dim`` split row-major into dims of ``sizes`` (product: the dim's size).

        The result's root grid is this root's rank list cut finer where needed (the same ranks in the
        same order). Raises ``ValueError`` when the sizes cut across the root dims the dim spans in
        a way no grid can hold (a flattened 2 x 3 dim split into 3 x 2).
        """
        if math.prod(sizes) != self.shape[dim]:
            raise ValueError(f"sizes {sizes} multiply to {math.prod(sizes)}, not to the dim's size {self.shape[dim]}")
        split = _split_runs(self.runs[dim], sizes)
        return self._from_runs((*self.runs[:dim], *split, *self.runs[dim + 1 :]))

    @staticmethod
    def concatenate(layouts: tuple[MeshLayout, ...]) -> MeshLayout:
        """One view over the dims of several views of the same root rank list, in the order given.

        Raises ``ValueError`` when two dims walk the same ranks (overlap), when the dims are not in
        the order they have in the root, or when their runs fit no common grid.
        """
        first = layouts[0]
        if any(layout.root_ranks != first.root_ranks for layout in layouts[1:]):
            raise ValueError("the layouts are views of different root rank lists")
        return first._from_runs(tuple(runs for layout in layouts for runs in layout.runs))

    def _from_runs(self, dims_runs: tuple[tuple[Run, ...], ...]) -> MeshLayout:
        """A view over this root rank list whose dims step as ``dims_runs`` say, on the coarsest grid holding them all."""
        count = len(self.root_ranks)
        cuts = {1, count}
        for runs in dims_runs:
            for size, stride in runs:
                cuts.update((stride, stride * size))
        ordered = sorted(cuts)
        for inner, outer in zip(ordered, ordered[1:]):
            if outer % inner:
                raise ValueError(f"the dims step through the ranks with strides {ordered} that fit no grid")
        pieces = len(ordered) - 1  # piece i: stride ordered[i], size ordered[i + 1] // ordered[i]
        owner: list[int | None] = [None] * pieces
        positions_of_dim: list[list[int]] = []  # grid position = pieces - 1 - piece (outermost first)
        for dim, runs in enumerate(dims_runs):
            positions: list[int] = []
            for size, stride in runs:
                for piece in range(ordered.index(stride * size) - 1, ordered.index(stride) - 1, -1):
                    if owner[piece] is not None:
                        raise ValueError(f"dims {owner[piece]} and {dim} overlap (they walk the same ranks)")
                    owner[piece] = dim
                    positions.append(pieces - 1 - piece)
            positions_of_dim.append(positions)
        in_order = [position for positions in positions_of_dim for position in positions]
        if in_order != sorted(in_order):
            raise ValueError("the dims are not in the order they have in the root mesh (outer dims first)")
        shape: list[int] = []
        dims: list[tuple[int, ...]] = []
        next_position = 0

        def emit_up_to(position: int) -> None:
            nonlocal next_position
            while next_position < position:
                piece = pieces - 1 - next_position
                shape.append(ordered[piece + 1] // ordered[piece])
                next_position += 1

        for positions in positions_of_dim:
            if not positions:  # a size-1 dim walks no ranks: a grid dim of size 1 of its own
                shape.append(1)
                dims.append((len(shape) - 1,))
                continue
            mine: list[int] = []
            for position in positions:
                emit_up_to(position)
                emit_up_to(position + 1)
                mine.append(len(shape) - 1)
            dims.append(tuple(mine))
        emit_up_to(pieces)
        layout = MeshLayout(tuple(shape), self.root_ranks, tuple(dims))
        layout.__dict__["_position_of_rank"] = self._position_of_rank
        layout.__dict__["ranks_identity"] = self.ranks_identity
        return layout

    @functools.cached_property
    def batch_root_dims(self) -> tuple[int, ...]:
        """Root dims this view does not span: they pick one of the view's sub-meshes."""
        spanned = {d for root_dims in self.dims for d in root_dims}
        return tuple(d for d in range(len(self.root_shape)) if d not in spanned)

    @functools.cached_property
    def _position_of_rank(self) -> _RankPositions:
        return _RankPositions(self.root_ranks)

    @functools.cached_property
    def ranks_identity(self) -> tuple[object, ...]:
        """What tells this root's rank list apart, small for consecutive ranks (for keys and digests)."""
        if self._position_of_rank.consecutive:
            return ("range", self.root_ranks[0], len(self.root_ranks))
        return self.root_ranks

    def _ranks_walking(self, root_dims: Iterable[int], start: int = 0) -> tuple[int, ...]:
        """The root's ranks read row-major over ``root_dims`` (outermost first) from position ``start``.

        Plain Python, on purpose: a mesh's ranks are static data, and mesh queries run while
        torch.compile traces (under fake and proxy modes), where a tensor built here would be fake
        and reading it back (``tolist``) data-dependent.
        """
        order = tuple(root_dims)
        if start == 0 and order == tuple(range(len(self.root_shape))):
            return self.root_ranks
        positions = [start]
        for d in order:  # the first dim varies slowest
            stride = self.root_strides[d]
            positions = [first + step * stride for first in positions for step in range(self.root_shape[d])]
        return tuple(self.root_ranks[position] for position in positions)

    def _root_index(self, rank: int) -> tuple[int, ...] | None:
        position = self._position_of_rank.position(rank)
        if position is None:
            return None
        index: list[int] = []
        for size in reversed(self.root_shape):
            position, within = divmod(position, size)
            index.append(within)
        return tuple(reversed(index))

    def contains(self, rank: int) -> bool:
        """Whether ``rank`` is in the root mesh (the view's sub-mesh for it then contains it too)."""
        return self._position_of_rank.position(rank) is not None

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """``rank``'s index in the sub-mesh of this view that holds it; None if not in the root."""
        root_index = self._root_index(rank)
        if root_index is None:
            return None
        coordinate: list[int] = []
        for root_dims in self.dims:
            value = 0
            for d in root_dims:
                value = value * self.root_shape[d] + root_index[d]
            coordinate.append(value)
        return tuple(coordinate)

    def groups_along(self, dim: int) -> tuple[tuple[int, ...], ...]:
        """Every rank list that varies only along ``dim`` across the whole root, in a fixed order.

        Each list is ordered by the coordinate along ``dim``, so a process group created with it
        gives every rank its coordinate as group rank. All ranks compute the same tuple.
        """
        spanned = self.dims[dim]
        others = [d for d in range(len(self.root_shape)) if d not in spanned]
        ranks = self._ranks_walking((*others, *spanned))
        size = self.shape[dim]
        return tuple(ranks[start : start + size] for start in range(0, len(ranks), size))

    def group_through(self, dim: int, rank: int) -> tuple[int, ...] | None:
        """The one rank list of ``groups_along(dim)`` that holds ``rank`` (None if the root lacks it).

        Costs the group's size, not the mesh's: a rank builds only the groups it belongs to, so at
        thousands of ranks neither time nor memory may grow with the other groups.
        """
        root_index = self._root_index(rank)
        if root_index is None:
            return None
        spanned = self.dims[dim]
        base = sum(root_index[d] * self.root_strides[d] for d in range(len(self.root_shape)) if d not in spanned)
        if len(spanned) == 1:  # a plain dim: one strided slice of the rank list
            stride = self.root_strides[spanned[0]]
            return self.root_ranks[base : base + stride * self.root_shape[spanned[0]] : stride]
        return self._ranks_walking(spanned, base)

    @property
    def submesh_count(self) -> int:
        """How many sub-meshes the view has: one per index of the root dims it leaves out."""
        return len(self.root_ranks) // self.numel

    def submesh_ranks(self, rank: int) -> tuple[int, ...] | None:
        """The ranks of the sub-mesh holding ``rank``, row-major over this view's shape.

        For a rank outside the root there is only an answer when the view has a single sub-mesh
        (no batch dims, e.g. the root itself); otherwise None. Costs the sub-mesh's size.
        """
        batch = self.batch_root_dims
        spanned = [d for root_dims in self.dims for d in root_dims]
        if self.submesh_count == 1:
            return self._ranks_walking((*batch, *spanned))
        root_index = self._root_index(rank)
        if root_index is None:
            return None
        return self._ranks_walking(spanned, sum(root_index[d] * self.root_strides[d] for d in batch))

    @functools.cached_property
    def rank_listing(self) -> str:
        """What tells this layout's ranks apart, the same text on every rank.

        ``ranks=<grid>`` when the view is a single grid of ranks (a root mesh, or a view
        spanning every root dim); ``submeshes=<grids>`` when it has several sub-meshes (a
        slice: one per index of the dims it leaves out), listed in the order of those dims.
        Up to 64 ranks are printed in full; more are summarised as ``range(a, b)`` when they
        are consecutive in row-major order, else by their first ranks, their count and a
        digest of the whole list, so that different layouts never print alike.
        """
        batch = self.batch_root_dims
        flat = list(self._ranks_walking((*batch, *(d for root_dims in self.dims for d in root_dims))))
        label = "ranks" if self.submesh_count == 1 else "submeshes"
        if len(flat) <= _RANKS_PRINTED_IN_FULL:
            shape = self.shape if self.submesh_count == 1 else (self.submesh_count, *self.shape)
            return f"{label}={nested_ranks(flat, shape)}"
        start = flat[0]
        if flat == list(range(start, start + len(flat))):
            return f"{label}=range({start}, {start + len(flat)})"
        digest = hashlib.blake2b(repr(flat).encode(), digest_size=4).hexdigest()
        head = ", ".join(str(rank) for rank in flat[:8])
        return f"{label}=[{head}, ...] ({len(flat)} ranks, digest {digest})"


def nested_ranks(flat: Sequence[int], shape: Sequence[int]) -> list[Any]:
    """``flat`` (row-major) as nested lists of ``shape``, as ``Tensor.tolist()`` would give them."""
    if len(shape) <= 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [nested_ranks(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def _coalesce(runs: Iterable[Run]) -> tuple[Run, ...]:
    merged: list[Run] = []
    for size, stride in runs:
        if size == 1:
            continue
        if merged and merged[-1][1] == size * stride:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    return tuple(merged)


def _split_runs(runs: tuple[Run, ...], sizes: tuple[int, ...]) -> list[tuple[Run, ...]]:
    """The runs of each of ``sizes`` when a dim stepping as ``runs`` is split row-major into them."""
    remaining = list(runs)
    result: list[tuple[Run, ...]] = []
    for size in sizes:
        needed = size
        mine: list[Run] = []
        while needed > 1:
            run_size, stride = remaining[0]
            if run_size <= needed:
                if needed % run_size:
                    raise ValueError(f"a part of size {run_size} of the dim cannot be cut into a dim of size {size}")
                mine.append(remaining.pop(0))
                needed //= run_size
            else:
                if run_size % needed:
                    raise ValueError(f"a part of size {run_size} of the dim cannot be cut into a dim of size {size}")
                mine.append((needed, stride * (run_size // needed)))
                remaining[0] = (run_size // needed, stride)
                needed = 1
        result.append(_coalesce(mine))
    return result
