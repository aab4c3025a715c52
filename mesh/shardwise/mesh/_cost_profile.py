"""How long collectives take on a mesh: a latency-bandwidth profile per collective kind and mesh dim.

A collective of ``kind`` over the group of one mesh dim (or several dims jointly) takes

    time = alpha(kind, dim) + bytes / beta(kind, dim)
    alpha(kind, dim) = alpha_s + alpha_per_peer_s * (group size - 1)

where ``bytes`` is what one rank *receives* in it, counted as the redistribute planner counts a
step's ``bytes_per_rank`` ((p-1)/p of the gathered tensor for an all-gather, 2(p-1)/p of the tensor
for an all-reduce, ...). In those units ``beta`` is what nccl-tests calls *bus bandwidth* (busbw),
so published nccl-tests figures plug in directly. ``local_copy`` prices the copies a step makes on
its own device (chunking, padding, trimming): ``bytes`` copied, ``beta`` the copy bandwidth.

A profile holds one ``CollectiveCost`` per kind for groups within a node, optionally another set for
groups that span nodes, and optionally per-mesh-dim tables written by ``shardwise.tools.calibrate``,
which measured them on the user's own mesh. ``active_cost_profile`` is the one place that decides
which profile is in force (argument > ``SHARDWISE_COST_PROFILE`` > the backend's default).

Pure: no process group is touched; a mesh is only read for its dim names, sizes and the ranks along
a dim (to tell whether a group spans nodes).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

import torch

from shardwise.mesh._errors import MeshError

__all__ = [
    "COLLECTIVE_KINDS",
    "COST_PROFILE_ENV_VAR",
    "BUILTIN_PROFILES",
    "CollectiveCost",
    "CostProfile",
    "active_cost_profile",
    "cost_profile_setting",
    "load_cost_profile",
]

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "local_copy")
COST_PROFILE_ENV_VAR = "SHARDWISE_COST_PROFILE"
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class CollectiveCost:
    """alpha + bytes / beta, with alpha growing by ``alpha_per_peer_s`` for every further group member.

    ``measured_alpha_s``: (group size, alpha) pairs measured at those sizes, which win over the
    line for groups of exactly that size (latency need not grow linearly: on an oversubscribed
    machine a group of 4 costs far more than twice a group of 2).
    """

    alpha_s: float
    beta_bytes_per_s: float
    alpha_per_peer_s: float = 0.0
    measured_alpha_s: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and self.alpha_per_peer_s >= 0 and self.beta_bytes_per_s > 0):
            raise MeshError(
                f"a collective cost needs alpha_s >= 0, alpha_per_peer_s >= 0 and beta_bytes_per_s > 0, got {self}"
            )
        if any(size < 1 or alpha < 0 for size, alpha in self.measured_alpha_s):
            raise MeshError(f"measured_alpha_s needs group sizes >= 1 and alphas >= 0, got {self.measured_alpha_s}")

    def alpha(self, group_size: int) -> float:
        for size, alpha in self.measured_alpha_s:
            if size == group_size:
                return alpha
        return self.alpha_s + self.alpha_per_peer_s * max(group_size - 1, 0)

    def time(self, received_bytes: float, group_size: int) -> float:
        return self.alpha(group_size) + received_bytes / self.beta_bytes_per_s


class MeshLike(Protocol):
    """What pricing reads from a mesh (shardwise's ``DeviceMesh``, PyTorch's, or a test double)."""

    @property
    def shape(self) -> Any: ...

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None: ...


@dataclass(frozen=True)
class CostProfile:
    """Per-kind collective costs, within a node and across nodes, plus calibrated per-dim tables.

    ``dim_costs`` maps a mesh dim's name (or its index as text, e.g. ``"0"``) to per-kind costs;
    where present they win, since they were measured on that dim. ``ranks_per_node`` tells which
    groups span nodes (ranks ``r`` and ``s`` share a node when ``r // ranks_per_node == s //
    ranks_per_node``, torchrun's layout); None reads ``LOCAL_WORLD_SIZE`` and, without it, treats every
    group as within one node.
    """

    name: str
    source: str
    costs: Mapping[str, CollectiveCost]
    inter_node_costs: Mapping[str, CollectiveCost] | None = None
    dim_costs: Mapping[str, Mapping[str, CollectiveCost]] = field(default_factory=dict)
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        tables = [("costs", self.costs)]
        if self.inter_node_costs is not None:
            tables.append(("inter_node_costs", self.inter_node_costs))
        tables += [(f"dim_costs[{dim!r}]", table) for dim, table in self.dim_costs.items()]
        for label, table in tables:
            unknown = sorted(set(table) - set(COLLECTIVE_KINDS))
            if unknown:
                raise MeshError(f"cost profile {self.name!r}: {label} names unknown kinds {unknown}; known: {COLLECTIVE_KINDS}")
        missing = [kind for kind in COLLECTIVE_KINDS if kind not in self.costs]
        if missing:
            raise MeshError(f"cost profile {self.name!r}: costs lacks {missing}; every kind needs a default cost")

    # ------------------------------------------------------------------------------ pricing

    def cost(self, kind: str, mesh: MeshLike, mesh_dims: int | Sequence[int]) -> tuple[CollectiveCost, int]:
        """(the cost that applies, the group size) for ``kind`` over ``mesh_dims`` (one dim or several jointly)."""
        if kind not in COLLECTIVE_KINDS:
            raise MeshError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
        dims = (mesh_dims,) if isinstance(mesh_dims, int) else tuple(mesh_dims)
        shape = tuple(int(size) for size in mesh.shape)
        for dim in dims:
            if not -len(shape) <= dim < len(shape):
                raise MeshError(f"mesh dim {dim} is out of range for a mesh of shape {shape}")
        group_size = 1
        for dim in dims:
            group_size *= shape[dim]
        return self._cost_for(kind, mesh, tuple(dim % len(shape) for dim in dims)), group_size

    def one_dim_costs(self, mesh: MeshLike) -> tuple[dict[str, tuple[CollectiveCost, int]], ...]:
        """Per mesh dim, every kind's ``cost(kind, mesh, dim)``, in one pass (what a pricer reads per mesh).

        Treat the tables as read-only: dims with equal costs may share one.
        """
        shape = tuple(int(size) for size in mesh.shape)
        if not self.dim_costs and self.inter_node_costs is None:
            # The same costs on every dim: dims of one size share one table (the same object).
            by_size: dict[int, dict[str, tuple[CollectiveCost, int]]] = {}
            for size in shape:
                if size not in by_size:
                    by_size[size] = {kind: (self.costs[kind], size) for kind in COLLECTIVE_KINDS}
            return tuple(by_size[size] for size in shape)
        return tuple(
            {kind: (self._cost_for(kind, mesh, (dim,)), size) for kind in COLLECTIVE_KINDS} for dim, size in enumerate(shape)
        )

    def _cost_for(self, kind: str, mesh: MeshLike, dims: tuple[int, ...]) -> CollectiveCost:
        """The cost of ``kind`` over ``dims`` (checked, normalised): calibrated, else across nodes, else within one."""
        if len(dims) == 1:
            calibrated = self._calibrated(kind, mesh, dims[0])
            if calibrated is not None:
                return calibrated
        if self.inter_node_costs is not None and kind in self.inter_node_costs and self._spans_nodes(mesh, dims):
            return self.inter_node_costs[kind]
        return self.costs[kind]

    def alpha(self, kind: str, mesh: MeshLike, mesh_dims: int | Sequence[int]) -> float:
        cost, group_size = self.cost(kind, mesh, mesh_dims)
        return cost.alpha(group_size)

    def beta(self, kind: str, mesh: MeshLike, mesh_dims: int | Sequence[int]) -> float:
        cost, _ = self.cost(kind, mesh, mesh_dims)
        return cost.beta_bytes_per_s

    def _calibrated(self, kind: str, mesh: MeshLike, dim: int) -> CollectiveCost | None:
        if not self.dim_costs:
            return None
        names = getattr(mesh, "mesh_dim_names", None)
        for key in ((names[dim],) if names else ()) + (str(dim),):
            table = self.dim_costs.get(key)
            if table is not None and kind in table:
                return table[kind]
        return None

    def _spans_nodes(self, mesh: MeshLike, dims: tuple[int, ...]) -> bool:
        """Whether any group over ``dims`` spans nodes: the same answer on every rank (so every rank
        prices, and plans, alike) and read from the rank grid alone (no coordinate, which may be
        symbolic while torch.compile traces)."""
        per_node = self.ranks_per_node if self.ranks_per_node is not None else _local_world_size()
        if per_node is None:
            return False
        groups = _groups_along(mesh, dims)
        return groups is not None and any(len({rank // per_node for rank in group}) > 1 for group in groups)

    # -------------------------------------------------------------------------- persistence

    def to_json(self) -> dict[str, Any]:
        def table(costs: Mapping[str, CollectiveCost]) -> dict[str, dict[str, Any]]:
            return {
                kind: {
                    "alpha_s": c.alpha_s,
                    "alpha_per_peer_s": c.alpha_per_peer_s,
                    "beta_bytes_per_s": c.beta_bytes_per_s,
                    "measured_alpha_s": {str(size): alpha for size, alpha in c.measured_alpha_s},
                }
                for kind, c in costs.items()
            }

        return {
            "format": "shardwise-cost-profile",
            "version": _FORMAT_VERSION,
            "name": self.name,
            "source": self.source,
            "ranks_per_node": self.ranks_per_node,
            "costs": table(self.costs),
            "inter_node_costs": None if self.inter_node_costs is None else table(self.inter_node_costs),
            "dim_costs": {dim: table(costs) for dim, costs in self.dim_costs.items()},
        }

    @staticmethod
    def from_json(data: Mapping[str, Any], where: str = "cost profile") -> CostProfile:
        if data.get("format") != "shardwise-cost-profile" or data.get("version") != _FORMAT_VERSION:
            raise MeshError(
                f"{where} is not a shardwise cost profile of version {_FORMAT_VERSION} "
                f"(format={data.get('format')!r}, version={data.get('version')!r}); write it with "
                "`python -m shardwise.tools.calibrate`"
            )

        def table(raw: Mapping[str, Any], label: str) -> dict[str, CollectiveCost]:
            try:
                return {
                    kind: CollectiveCost(
                        alpha_s=float(entry["alpha_s"]),
                        beta_bytes_per_s=float(entry["beta_bytes_per_s"]),
                        alpha_per_peer_s=float(entry.get("alpha_per_peer_s", 0.0)),
                        measured_alpha_s=tuple(
                            sorted((int(size), float(alpha)) for size, alpha in entry.get("measured_alpha_s", {}).items())
                        ),
                    )
                    for kind, entry in raw.items()
                }
            except (KeyError, TypeError, ValueError) as error:
                raise MeshError(f"{where}: {label} is malformed ({error!r}); expected kind -> {{alpha_s, beta_bytes_per_s}}") from None

        inter = data.get("inter_node_costs")
        per_node = data.get("ranks_per_node")
        return CostProfile(
            name=str(data.get("name", where)),
            source=str(data.get("source", "")),
            costs=table(data.get("costs", {}), "costs"),
            inter_node_costs=None if inter is None else table(inter, "inter_node_costs"),
            dim_costs={str(dim): table(costs, f"dim_costs[{dim!r}]") for dim, costs in data.get("dim_costs", {}).items()},
            ranks_per_node=None if per_node is None else int(per_node),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as handle:
            json.dump(self.to_json(), handle, indent=1, sort_keys=True)
            handle.write("\n")


def _local_world_size() -> int | None:
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 0 else None


def _groups_along(mesh: MeshLike, dims: tuple[int, ...]) -> list[tuple[int, ...]] | None:
    """The global ranks of every group over each of ``dims``, or None where the mesh cannot tell.

    A group over several dims spans nodes exactly when a group over one of them does (within a
    node along every dim stays within it), so the groups of each dim alone answer for joint ones.
    From shardwise's mesh layout in plain Python (no tensor: this also runs while torch.compile
    traces a redistribution), else from the rank grid (``mesh.mesh``: other meshes, test doubles).
    """
    layout = getattr(mesh, "_layout", None)
    if layout is not None and hasattr(layout, "root_ranks"):
        return [group for dim in dims for group in _layout_groups(layout, dim % len(layout.dims))]
    grid = getattr(mesh, "mesh", None)
    if not isinstance(grid, torch.Tensor):
        return None
    groups: list[tuple[int, ...]] = []
    for dim in dims:
        rows = grid.movedim(dim % grid.ndim, -1).reshape(-1, int(grid.shape[dim])).tolist()
        groups += [tuple(int(rank) for rank in row) for row in rows]
    return groups


def _layout_groups(layout: Any, dim: int) -> list[tuple[int, ...]]:
    """Every rank list over view dim ``dim`` of a ``MeshLayout`` (root shape, row-major root ranks)."""
    spanned = set(layout.dims[dim])
    shape = tuple(layout.root_shape)
    groups: dict[tuple[int, ...], list[int]] = {}
    for position, rank in enumerate(layout.root_ranks):
        key = []
        for size in reversed(shape):
            position, within = divmod(position, size)
            key.append(within)
        index = tuple(reversed(key))
        fixed = tuple(value for root_dim, value in enumerate(index) if root_dim not in spanned)
        groups.setdefault(fixed, []).append(int(rank))
    return [tuple(group) for group in groups.values()]


# ---------------------------------------------------------------------------------- defaults
#
# gloo on loopback, measured here on the shared 2-core CPU machine (load average 3-7, 2026-11-27,
# torch 2.13), the kinds timed in turn within every iteration (so load swings hit all alike):
# `python -m shardwise.tools.calibrate --nproc 4 --sizes 1K,64K,1M --iters 40` twice and a plain c10d
# loop (1 KB and 64 KB, 150 iterations) twice on a 1-D mesh of 4, and `--nproc 4 --mesh 2x2 --iters 30`
# twice (groups of 2 inside the same 4-process world). Medians over those runs (alpha us):
#   groups of 2: all_gather 487, reduce_scatter 561, all_reduce 529, all_to_all 307, local copy 2.5
#   groups of 4: all_gather 5490, reduce_scatter 8530, all_reduce 8620, all_to_all 3066
# beta (GB/s, groups of 4, medians of the fits where alpha did not swamp the slope): all_gather 0.48,
# reduce_scatter 0.50, all_reduce 0.44, all_to_all 0.74, local copy 37.
# The order held in every interleaved run: all-to-all (one round: every peer gets its block) <
# all-gather (a ring of p - 1 rounds) < reduce-scatter ~ all-reduce (gloo's reduce-scatter takes as
# long as its all-reduce: their medians differ by less than the spread, so both get the pooled
# alpha). Groups of 4 cost ~10x groups of 2 here only because 4 processes share 2 cores (every round
# waits to be scheduled): that is this machine, not gloo, and a default that priced it would split
# every joint or merged collective into smaller ones on machines with a core per rank. So the
# default prices a collective's latency as its groups-of-2 figure whatever the group size (what a
# loopback collective costs when its ranks run), and bytes over the groups-of-4 bandwidth. Calibrate
# (`measured_alpha_s` keeps per-size figures) where group size matters. Timed one kind after another
# under load 9-12, an earlier calibration had put all-to-all above all-gather; interleaved runs never did.
_GLOO_LOOPBACK = CostProfile(
    name="gloo-loopback",
    source=(
        "measured: shardwise.tools.calibrate (kinds interleaved) and a plain c10d loop, gloo over loopback, "
        "shared 2-core CPU machine at load 3-7 (torch 2.13, 2026-11-27); alpha: groups of 2 in a 4-process "
        "world, the same for every group size; beta: groups of 4"
    ),
    costs={
        "all_gather": CollectiveCost(alpha_s=487e-6, beta_bytes_per_s=0.48e9),
        "reduce_scatter": CollectiveCost(alpha_s=545e-6, beta_bytes_per_s=0.50e9),
        "all_reduce": CollectiveCost(alpha_s=545e-6, beta_bytes_per_s=0.44e9),
        "all_to_all": CollectiveCost(alpha_s=307e-6, beta_bytes_per_s=0.74e9),
        "local_copy": CollectiveCost(alpha_s=2.5e-6, beta_bytes_per_s=37e9),
    },
)

# NCCL on H100 SXM nodes (8 GPUs on NVSwitch, one 400 Gb/s NDR InfiniBand NIC per GPU), from
# published figures, not measured here:
# * intra-node all-reduce busbw 460-480 GB/s at large sizes on 8xH100 SXM5 (nccl-tests reference
#   table, docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests); NVLink 4 is 450 GB/s per
#   direction per GPU (NVIDIA H100 datasheet: 900 GB/s bidirectional). All-gather, reduce-scatter and
#   all-to-all use no NVLink SHARP reduction, so we take 80% of the line rate (360 GB/s) for them.
# * inter-node: NDR InfiniBand is 400 Gb/s = 50 GB/s per GPU; the reference tables above expect
#   40-50 GB/s busbw for IB NDR, we take 40 GB/s.
# * alpha: small-message NCCL collectives take some 10-30 us on 8 GPUs in nccl-tests runs; we take
#   8 us + 1 us per peer within a node and 15 us + 2 us per peer across nodes (assumed, to be
#   replaced by `shardwise.tools.calibrate` on the user's cluster).
# * local copy: H100 HBM3 3.35 TB/s (datasheet); a copy reads and writes, so 1.5 TB/s of bytes copied,
#   5 us kernel launch.
_NVLINK_BUSBW_REDUCE = 460e9
_NVLINK_BUSBW_MOVE = 360e9
_IB_NDR_BUSBW = 40e9
_NCCL_SOURCE = (
    "published figures (not measured here): 8xH100 SXM5 nccl-tests busbw 460-480 GB/s all-reduce "
    "(docs.alayanew.com nccl-tests reference table), NVLink 4 450 GB/s/direction (NVIDIA H100 datasheet), "
    "NDR InfiniBand 400 Gb/s per GPU with 40-50 GB/s busbw expected; alphas assumed; calibrate to replace"
)
_NCCL_INTRA = {
    "all_gather": CollectiveCost(alpha_s=8e-6, alpha_per_peer_s=1e-6, beta_bytes_per_s=_NVLINK_BUSBW_MOVE),
    "reduce_scatter": CollectiveCost(alpha_s=8e-6, alpha_per_peer_s=1e-6, beta_bytes_per_s=_NVLINK_BUSBW_MOVE),
    "all_reduce": CollectiveCost(alpha_s=10e-6, alpha_per_peer_s=1e-6, beta_bytes_per_s=_NVLINK_BUSBW_REDUCE),
    "all_to_all": CollectiveCost(alpha_s=8e-6, alpha_per_peer_s=1e-6, beta_bytes_per_s=_NVLINK_BUSBW_MOVE),
    "local_copy": CollectiveCost(alpha_s=5e-6, beta_bytes_per_s=1.5e12),
}
_NCCL_INTER = {
    kind: CollectiveCost(alpha_s=15e-6, alpha_per_peer_s=2e-6, beta_bytes_per_s=_IB_NDR_BUSBW)
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
}
_NCCL_INTRA_NODE = CostProfile(name="nccl-intra-node", source=_NCCL_SOURCE, costs=_NCCL_INTRA)
_NCCL_INTER_NODE = CostProfile(
    name="nccl-inter-node", source=_NCCL_SOURCE, costs={**_NCCL_INTER, "local_copy": _NCCL_INTRA["local_copy"]}
)
# NCCL's default: intra-node costs for groups within a node, inter-node ones for groups that span
# nodes (told apart by LOCAL_WORLD_SIZE, or ranks_per_node in a calibrated profile).
_NCCL = CostProfile(name="nccl", source=_NCCL_SOURCE, costs=_NCCL_INTRA, inter_node_costs=_NCCL_INTER)

BUILTIN_PROFILES: Mapping[str, CostProfile] = {
    profile.name: profile for profile in (_GLOO_LOOPBACK, _NCCL, _NCCL_INTRA_NODE, _NCCL_INTER_NODE)
}
# Which built-in profile a backend gets when nothing else is chosen.
_DEFAULT_FOR_BACKEND = {"gloo": "gloo-loopback", "nccl": "nccl", "fake": "gloo-loopback", "threaded": "gloo-loopback"}

_loaded_files: dict[tuple[str, float], CostProfile] = {}


def load_cost_profile(name_or_path: str | os.PathLike[str]) -> CostProfile:
    """A built-in profile by name, or a JSON profile file (cached until the file changes)."""
    text = os.fspath(name_or_path)
    builtin = BUILTIN_PROFILES.get(text)
    if builtin is not None:
        return builtin
    try:
        modified = os.stat(text).st_mtime
    except OSError:
        raise MeshError(
            f"cost profile {text!r} is neither a built-in profile ({sorted(BUILTIN_PROFILES)}) nor a readable "
            "JSON file; write one with `python -m shardwise.tools.calibrate --output PATH`"
        ) from None
    cached = _loaded_files.get((text, modified))
    if cached is not None:
        return cached
    try:
        with open(text) as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise MeshError(f"cost profile file {text!r} could not be read as JSON: {error}") from None
    if not isinstance(data, dict):
        raise MeshError(f"cost profile file {text!r} holds {type(data).__name__}, expected a JSON object")
    profile = CostProfile.from_json(data, where=f"cost profile file {text!r}")
    _loaded_files[(text, modified)] = profile
    return profile


def cost_profile_setting(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SHARDWISE_COST_PROFILE`` in ``environ`` (default: the process's), stripped; None if unset or blank.

    The one reader of the variable: ``active_cost_profile`` and dtensor_ops' options both ask here.
    """
    value = (os.environ if environ is None else environ).get(COST_PROFILE_ENV_VAR, "").strip()
    return value or None


def active_cost_profile(
    explicit: CostProfile | str | os.PathLike[str] | None = None, *, backend: str | None = None
) -> CostProfile:
    """The profile in force: ``explicit`` if given, else ``$SHARDWISE_COST_PROFILE``, else the backend's default.

    ``explicit`` and the variable take a built-in name (``gloo-loopback``, ``nccl``,
    ``nccl-intra-node``, ``nccl-inter-node``) or the path of a JSON profile. ``backend`` is the
    mesh's c10d backend (``"gloo"``, ``"nccl"``, ...); unknown or None falls back to gloo's profile.
    The variable is read by ``cost_profile_setting``.
    """
    if isinstance(explicit, CostProfile):
        return explicit
    if explicit is not None:
        return load_cost_profile(explicit)
    chosen = cost_profile_setting()
    if chosen:
        return load_cost_profile(chosen)
    return BUILTIN_PROFILES[_DEFAULT_FOR_BACKEND.get((backend or "gloo").lower(), "gloo-loopback")]
