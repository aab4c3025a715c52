"""Creating and caching the c10d process groups of mesh dims: only the groups this rank is in.

Protocol (``member_only_creation()``: every default group not bound to a device, i.e. gloo, the
fake backend, torch's threaded test backend, and NCCL initialised lazily)
-----------------------------------------------------------------------------------------------

* **Only members create a group.** A rank never calls into c10d for a group it is not in: a mesh
  dim costs each rank one group, created with the ranks of that dim through this rank only
  (``MeshLayout.group_through``), so set-up time and memory follow this rank's groups, not the
  number of groups in the mesh (at 64x64x4 = 16,384 ranks: 3 groups instead of 4,608 calls).
* **The name comes from the ranks.** c10d's ``new_group`` names a group from a world-wide counter
  that every rank of the world must advance in step (hence its rule that all ranks call it for
  every group), or, with ``use_local_synchronization=True``, from a hash of the ranks *and of the
  number of groups this process already has*, which differs between members with different
  histories and makes them rendezvous under different store keys until the timeout. We name the
  group ``shardwise_<digest of (backend, ordered ranks)>`` instead and hand that name to c10d's
  group constructor (``_new_process_group_helper``, the function ``new_group`` itself ends in), so
  every member derives the same name from the ranks alone, whatever else it created before, and
  c10d's counter is never touched (user code mixing in ``new_group`` stays in step).
* **Order.** A group's creation is a rendezvous of its members (gloo connects them; nothing for
  the fake backend). Members must therefore not wait on two shared groups in opposite orders.
  Groups of a mesh are created in one order on every rank: mesh construction order, then dim
  order, then flattening order (all SPMD calls); joint groups (several dims at once, see
  ``DeviceMesh._joint_group``) are created by their members at the first redistribution that
  uses them, immediately before its collective on that group, so they are ordered exactly as the
  collectives on them, which DTensor's SPMD contract already requires to be the same on every
  member. Every rank thus meets shared groups in one global order, so waits cannot form a cycle.
* **At most once per world.** The registry maps (backend, ordered ranks) to the group and is
  dropped when the default group changes, so no name is created twice in a world.

Default groups bound to a device (NCCL with ``device_id``, ``bound_device_id`` set) split new
communicators from the world's, which ``ncclCommSplit`` makes a collective of the whole world:
there every rank of the world calls ``new_group`` for every sub-group in a fixed order (c10d then
splits for members and makes a no-colour split for the others), as before. That path needs GPUs
to test and keeps joint groups eager (``world_ordered_creation``).

The registry holds groups weakly: c10d owns them (see ``_GroupRegistry``).

Backend overrides (``_unflatten``/``_flatten``'s ``backend_override``)
------------------------------------------------------------------------

A dim may ask for another backend (``"gloo"``, ``"nccl"``...), backend options, or both: its group
is then keyed by that backend (and the options' type and timeout) instead of the world's, is never
the default group, and is created as above with that backend and options. ``"fake"`` means the
program never communicates over that dim (torchtitan gives it to dims of degree 1): the group is
c10d's ``FakeProcessGroup`` of the dim's size, created by each member alone (no rendezvous, nothing
to connect, also on device-bound worlds), one per dim name and rank list (fake dims of one name
share it across meshes), registered with c10d like any group so that
``get_process_group_ranks``, ``_resolve_process_group`` and functional collectives find it by name.
A collective over it does nothing (its result is not the collective's); over a dim of size 1 none
is needed, and redistribution issues none there.
"""

from __future__ import annotations

import atexit
import hashlib
import time
import weakref
from typing import Any, Sequence, cast

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import Backend as C10dBackend

from shardwise.mesh._errors import MeshError
from shardwise.mesh._layout import MeshLayout

__all__ = [
    "BackendChoice",
    "DEFAULT_BACKEND",
    "FAKE_BACKEND",
    "backend_choice",
    "backend_choices_for_new_dims",
    "default_process_group",
    "group_for_dim",
    "member_only_creation",
    "member_group_name",
    "registered_group",
    "registered_group_count",
]

_GroupKey = tuple[str, tuple[int, ...]]
_MISSING = object()

FAKE_BACKEND = "fake"


class BackendChoice:
    """A dim's backend override: a backend name, backend options, or both (None, None: the world's)."""

    __slots__ = ("backend", "options")

    def __init__(self, backend: str | None = None, options: Any = None) -> None:
        self.backend = backend
        self.options = options

    @property
    def is_default(self) -> bool:
        return self.backend is None and self.options is None

    @property
    def is_fake(self) -> bool:
        return self.backend is not None and self.backend.lower() == FAKE_BACKEND

    def key(self, world_backend: str) -> str:
        """What tells groups over the same ranks apart (the same on every rank)."""
        if self.is_default:
            return world_backend
        text = (self.backend or world_backend).lower()
        if self.options is not None:
            text += f"+{type(self.options).__name__}(timeout={getattr(self.options, '_timeout', None)})"
        return text

    def __repr__(self) -> str:
        return f"BackendChoice({self.backend!r}, {self.options!r})"


DEFAULT_BACKEND = BackendChoice()


def backend_choice(value: object, where: str) -> BackendChoice:
    """A ``backend_override`` value (name, options, or (name, options)) as a ``BackendChoice``."""
    if value is None:
        return DEFAULT_BACKEND
    if isinstance(value, str):
        if not value:
            raise MeshError(f"{where}: an empty backend name; expected e.g. 'gloo', 'nccl' or 'fake'")
        return BackendChoice(value, None)
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[0], str) or value[1] is None:
            raise MeshError(f"{where}: expected (backend name, backend options), got {value!r}")
        return BackendChoice(value[0], value[1])
    if isinstance(value, C10dBackend.Options):
        return BackendChoice(None, value)
    raise MeshError(
        f"{where}: {value!r} is not a backend override; expected a backend name ('gloo', 'nccl', 'fake'...), "
        "backend options, or a (name, options) tuple"
    )


def backend_choices_for_new_dims(
    where: str, backend_override: dict[Any, Any] | None, names: tuple[str, ...]
) -> list[BackendChoice]:
    """One backend choice per new dim from ``backend_override``, keyed by name or by index among ``names``."""
    if backend_override is None:
        return [DEFAULT_BACKEND] * len(names)
    if not isinstance(backend_override, dict):
        raise MeshError(f"{where}: backend_override must be a dict from dim name or index to a backend, got {backend_override!r}")
    unused = dict(backend_override)
    choices = []
    for index, name in enumerate(names):
        if name in unused and index in unused:
            raise MeshError(f"{where}: backend_override names dim {name!r} twice, by name and by index {index}; give one")
        value = unused.pop(name, unused.pop(index, None))
        choices.append(backend_choice(value, f"{where} backend_override[{name!r}]"))
    if unused:
        raise MeshError(
            f"{where}: backend_override has keys {list(unused)} that are not new dims; expected names in {names} "
            f"or indices in [0, {len(names)})"
        )
    return choices


def default_process_group() -> dist.ProcessGroup:
    world = dist.group.WORLD
    if not dist.is_initialized() or world is None:
        raise MeshError(
            "the default process group is not initialized; call torch.distributed.init_process_group() "
            "(or init_device_mesh) first"
        )
    return world


def member_only_creation() -> bool:
    """Whether groups are created by their members alone (True unless the world is bound to a device)."""
    return getattr(default_process_group(), "bound_device_id", None) is None


def member_group_name(backend: str, ranks: Sequence[int]) -> str:
    """The c10d name of the group over ``ranks`` (in group rank order): the same on every member."""
    digest = hashlib.blake2b(repr((backend, tuple(ranks))).encode(), digest_size=12).hexdigest()
    return f"shardwise_{digest}"


class _GroupRegistry:
    """Process-wide map from (backend, ordered ranks) to a group, for the current default group.

    It holds the groups (and the default group it follows) by weak reference only: c10d keeps
    every group it created alive until ``destroy_process_group``, and nothing in shardwise may keep
    one alive past that. A gloo group that outlives ``destroy_process_group`` keeps its worker
    threads running into interpreter shutdown; a worker that then drops the last C++ reference to
    a finished collective's tensors must take the GIL to release their Python objects, and a
    thread taking the GIL during finalisation is killed with "terminate called without an active
    exception" (SIGABRT), failing a job that did everything right.

    In member-only mode only this rank's groups are recorded. In world-ordered mode a group this
    rank is not in is recorded as None, so that every rank skips the same ``new_group`` calls.
    """

    def __init__(self) -> None:
        self._world: weakref.ref[dist.ProcessGroup] | None = None
        self._backend = ""
        self._world_size = 0
        self._groups: dict[_GroupKey, weakref.ref[dist.ProcessGroup] | None] = {}

    def _follow_world(self) -> dist.ProcessGroup:
        world = default_process_group()
        if self._world is None or self._world() is not world:
            # Groups of an earlier default process group are dead; their names may even be reused.
            self._world = weakref.ref(world)
            self._backend = dist.get_backend_config(world)
            self._world_size = world.size()
            self._groups = {}
        return world

    def _is_whole_world(self, ranks: tuple[int, ...]) -> bool:
        # Not kept as a registry key: at 16,384 ranks that tuple alone would hold ~0.6 MB per process.
        return len(ranks) == self._world_size and ranks == tuple(range(self._world_size))

    def _live(self, key: _GroupKey, reference: weakref.ref[dist.ProcessGroup] | None) -> dist.ProcessGroup:
        group = None if reference is None else reference()
        if group is None:
            # Recreating it here alone would put this rank out of step with the other members
            # (or, world-ordered, with the ranks outside the group), who cannot see that it is gone.
            raise MeshError(
                f"the process group of ranks {list(key[1])} was destroyed "
                "(destroy_process_group(group)) while the default process group lives on; "
                "meshes over these ranks need a new default process group"
            )
        return group

    def member_group(
        self, ranks: tuple[int, ...], my_rank: int, description: str, choice: BackendChoice = DEFAULT_BACKEND
    ) -> dist.ProcessGroup:
        """The group over ``ranks`` (group rank order; they hold ``my_rank``), created by members only."""
        world = self._follow_world()
        if choice.is_default and self._is_whole_world(ranks):
            return world
        # Fake groups cost nothing to make: one per dim name (description), so that code naming axes
        # by ``group_desc`` (spmd_types) sees "mesh_cp" for cp, not the first fake dim's name.
        key = (choice.key(self._backend) + (f"/{description}" if choice.is_fake else ""), ranks)
        reference = self._groups.get(key, _MISSING)
        if reference is not _MISSING:  # one lookup: hashing a 16,384-rank key is not free
            return self._live(key, cast(weakref.ref[dist.ProcessGroup], reference))
        created = _create_by_members(world, ranks, my_rank, key[0], description, choice)
        self._groups[key] = weakref.ref(created)
        return created

    def group_among(
        self,
        sub_groups: Sequence[tuple[int, ...]],
        my_rank: int,
        description: str,
        choice: BackendChoice = DEFAULT_BACKEND,
    ) -> dist.ProcessGroup | None:
        """World-ordered: every rank of the world passes every rank list, in the same order."""
        world = self._follow_world()
        mine: dist.ProcessGroup | None = None
        for ranks in sub_groups:
            if choice.is_default and self._is_whole_world(ranks):
                mine = world if my_rank in ranks else mine
                continue
            key = (choice.key(self._backend), ranks)
            if key not in self._groups:
                created = _create_by_whole_world(world, ranks, my_rank, description, choice)
                self._groups[key] = None if created is None else weakref.ref(created)
            if my_rank in ranks:
                mine = self._live(key, self._groups[key])
        return mine

    def forget(self) -> None:
        """Drop every record of the groups (the next use starts from the current default group)."""
        self._world = None
        self._backend = ""
        self._world_size = 0
        self._groups = {}

    def lookup_by_name(self, group_name: str) -> dist.ProcessGroup | None:
        """A registered group (or the default group) by its c10d name, for unpickling meshes."""
        world = self._follow_world()
        if world.group_name == group_name:
            return world
        for reference in self._groups.values():
            group = None if reference is None else reference()
            if group is not None and group.group_name == group_name:
                return group
        return None

    def member_group_count(self) -> int:
        """How many groups this rank holds records of (the default group, always reused, not counted)."""
        return len(self._groups)


def _create_by_members(
    world: dist.ProcessGroup,
    ranks: tuple[int, ...],
    my_rank: int,
    backend_config: str,
    description: str,
    choice: BackendChoice = DEFAULT_BACKEND,
) -> dist.ProcessGroup:
    if my_rank not in ranks:
        raise AssertionError(f"rank {my_rank} asked to create the group of ranks {list(ranks)}, which it is not in")
    name = member_group_name(backend_config, ranks)
    # The world's own backend and store, as new_group uses when no backend is given; read per call
    # because torch's threaded test backend swaps c10d's world state per thread.
    backend, store = c10d._world.pg_map[world]
    if choice.backend is not None:
        backend = choice.backend
        if choice.is_fake:
            _ensure_fake_backend_registered()
    options = choice.options
    if name in c10d._world.pg_names.values():
        raise MeshError(
            f"a process group named {name!r} (ranks {list(ranks)}) already exists in this process but not in "
            "shardwise's registry; it was created outside shardwise.mesh"
        )
    created, _ = c10d._new_process_group_helper(
        len(ranks),
        ranks.index(my_rank),
        list(ranks),
        backend,
        store,
        c10d.GroupName(name),
        backend_options=options,
        timeout=_timeout(options, backend),
        group_desc=description,
    )
    if not isinstance(created, dist.ProcessGroup):
        raise MeshError(f"c10d did not create the process group of ranks {list(ranks)} on member rank {my_rank}: {created!r}")
    # What new_group records after the constructor, so get_process_group_ranks / get_group_rank work.
    c10d._world.pg_group_ranks[created] = {rank: group_rank for group_rank, rank in enumerate(ranks)}
    return created


def _timeout(options: Any, backend: str) -> Any:
    # As new_group: a timeout in the options wins (c10d would otherwise override it with the default).
    timeout = getattr(options, "_timeout", None) if options is not None else None
    return timeout if timeout is not None else c10d._get_default_timeout(dist.Backend(backend))


def _ensure_fake_backend_registered() -> None:
    """c10d knows the "fake" backend only once torch's module registering it is imported; import it then."""
    if FAKE_BACKEND.upper() not in dist.Backend._plugins:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers c10d's "fake" backend)


def _create_by_whole_world(
    world: dist.ProcessGroup,
    ranks: tuple[int, ...],
    my_rank: int,
    description: str,
    choice: BackendChoice = DEFAULT_BACKEND,
) -> dist.ProcessGroup | None:
    in_order = list(ranks) == sorted(ranks)
    extra: dict[str, Any] = {}
    if choice.backend is not None:
        extra["backend"] = choice.backend
    if choice.options is not None:
        extra["pg_options"] = choice.options
        if getattr(choice.options, "_timeout", None) is not None:
            extra["timeout"] = choice.options._timeout
    if in_order:
        created = dist.new_group(ranks=list(ranks), group_desc=description, **extra)
    else:
        # c10d sorts ranks unless told not to; group rank must equal the mesh coordinate, or
        # collectives would gather/scatter shards in the wrong order.
        created = dist.new_group(ranks=list(ranks), group_desc=description, sort_ranks=False, **extra)
    if my_rank not in ranks:
        return None
    if not isinstance(created, dist.ProcessGroup):
        raise MeshError(f"torch.distributed.new_group({list(ranks)}) returned {created!r} on member rank {my_rank}")
    return created


_registry = _GroupRegistry()

# A gloo group that something else keeps alive past destroy_process_group (we found torch.optim's
# step path doing so, through no Python-visible reference) still has worker threads at interpreter
# shutdown. A worker finishing a collective must take the GIL to release the tensors' Python
# objects; once finalisation has begun that kills the thread and aborts the process. atexit
# handlers run before that point: waiting here with the GIL released lets such a worker finish.
_WORKER_GRACE_AT_EXIT_S = 0.05


def _let_collective_workers_finish() -> None:
    if _registry._world is not None:  # only processes that built a mesh pay the wait
        time.sleep(_WORKER_GRACE_AT_EXIT_S)


atexit.register(_let_collective_workers_finish)


def group_for_dim(
    layout: MeshLayout,
    dim: int,
    my_rank: int,
    description: str,
    *,
    in_rank_order: bool = False,
    choice: BackendChoice = DEFAULT_BACKEND,
) -> dist.ProcessGroup | None:
    """This rank's group along ``dim`` of ``layout`` (None when the rank is not in the mesh).

    Group ranks follow the coordinate along ``dim`` unless ``in_rank_order`` (then increasing
    global ranks, which lets rank sets that already have a group, like the world, reuse it).
    Member-only mode: call it on the ranks that need the group, in the order described in the
    module docstring. World-ordered mode: every rank of the world must call it, in the same order.
    ``choice`` overrides the backend (see the module docstring); a fake group is always made by
    its members alone, in either mode, as it connects nothing.
    """
    if choice.is_fake or member_only_creation():
        ranks = layout.group_through(dim, my_rank)
        if ranks is None:
            return None
        return _registry.member_group(tuple(sorted(ranks)) if in_rank_order else ranks, my_rank, description, choice)
    sub_groups = layout.groups_along(dim)
    if in_rank_order:
        sub_groups = tuple(tuple(sorted(ranks)) for ranks in sub_groups)
    return _registry.group_among(sub_groups, my_rank, description, choice)


def registered_group(group_name: str) -> dist.ProcessGroup | None:
    return _registry.lookup_by_name(group_name)


def live_group_named(group_name: str) -> dist.ProcessGroup:
    """The registered group (or the default group) called ``group_name``; raises if there is none."""
    group = _registry.lookup_by_name(group_name)
    if group is None:
        raise MeshError(f"no live process group is called {group_name!r} in this process")
    return group


def registered_group_count() -> int:
    """Groups this process holds records of for the current world (for memory checks and benchmarks)."""
    return _registry.member_group_count()
