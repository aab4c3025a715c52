"""Creating and caching the c10d process groups of mesh dims.

Each distinct rank list gets one process group per default process group, however many meshes
use it: the registry is keyed by (backend config, ordered ranks) and is dropped when the default
process group changes (``destroy_process_group`` + ``init_process_group``). It refers to the groups
weakly: c10d owns them (see ``_GroupRegistry``).

How groups are created (measured on gloo; see README.md):

* ``dist.new_group`` without ``use_local_synchronization`` must be entered by every rank of the
  world, members or not, in the same order, because group names come from a world-wide counter.
  A non-member's call returns at once (about 50 us on gloo, no communication); only the groups a
  rank belongs to do a rendezvous. So each rank *creates* one group per mesh dim, but makes one
  call per sub-group.
* ``use_local_synchronization=True`` lets only members call, but c10d then names the group from a
  hash of the ranks and of how many groups *this* process already belongs to. Members that joined
  different numbers of groups before (say after a mesh over ranks [0, 1] only) get different
  names and wait on each other's store keys until the timeout. That is a hang we cannot rule out
  locally, so we do not use it.
* ``split_group`` needs a default group bound to an accelerator (NCCL); gloo refuses it. With a
  bound NCCL default group, c10d's ``new_group`` already splits the default communicator.

All ranks therefore call ``new_group`` for every sub-group not yet in the registry, in a fixed
order. The registry is identical on all ranks (non-members record that the group exists), so
ranks skip exactly the same calls and the world-wide counter stays in step.
"""

from __future__ import annotations

import atexit
import time
import weakref
from typing import Sequence

import torch.distributed as dist

from shardwise.mesh._errors import MeshError

__all__ = ["default_process_group", "group_for_dim", "registered_group"]

_GroupKey = tuple[str, tuple[int, ...]]


def default_process_group() -> dist.ProcessGroup:
    world = dist.group.WORLD
    if not dist.is_initialized() or world is None:
        raise MeshError(
            "the default process group is not initialized; call torch.distributed.init_process_group() "
            "(or init_device_mesh) first"
        )
    return world


class _GroupRegistry:
    """Process-wide map from (backend, ordered ranks) to the group, or None on non-members.

    It holds the groups (and the default group it follows) by weak reference only: c10d keeps
    every group it created alive until ``destroy_process_group``, and nothing in shardwise may keep
    one alive past that. A gloo group that outlives ``destroy_process_group`` keeps its worker
    threads running into interpreter shutdown; a worker that then drops the last C++ reference to
    a finished collective's tensors must take the GIL to release their Python objects, and a
    thread taking the GIL during finalisation is killed with "terminate called without an active
    exception" (SIGABRT), failing a job that did everything right.
    """

    def __init__(self) -> None:
        self._world: weakref.ref[dist.ProcessGroup] | None = None
        self._backend = ""
        self._groups: dict[_GroupKey, weakref.ref[dist.ProcessGroup] | None] = {}

    def _follow_world(self) -> dist.ProcessGroup:
        world = default_process_group()
        if self._world is None or self._world() is not world:
            # Groups of an earlier default process group are dead; their names may even be reused.
            self._world = weakref.ref(world)
            self._backend = dist.get_backend_config(world)
            self._groups = {(self._backend, tuple(range(world.size()))): weakref.ref(world)}
        return world

    def group_for(self, sub_groups: Sequence[tuple[int, ...]], my_rank: int, description: str) -> dist.ProcessGroup | None:
        world = self._follow_world()
        mine: dist.ProcessGroup | None = None
        for ranks in sub_groups:
            key = (self._backend, ranks)
            if key not in self._groups:
                created = self._create(world, ranks, my_rank, description)
                self._groups[key] = None if created is None else weakref.ref(created)
            if my_rank in ranks:
                reference = self._groups[key]
                mine = None if reference is None else reference()
                if mine is None:
                    # Recreating it here alone would put this rank's new_group calls out of step
                    # with the ranks outside the group, who cannot see that it is gone.
                    raise MeshError(
                        f"the process group of ranks {list(ranks)} was destroyed "
                        "(destroy_process_group(group)) while the default process group lives on; "
                        "meshes over these ranks need a new default process group"
                    )
        return mine

    @staticmethod
    def _create(
        world: dist.ProcessGroup, ranks: tuple[int, ...], my_rank: int, description: str
    ) -> dist.ProcessGroup | None:
        in_order = list(ranks) == sorted(ranks)
        if in_order:
            created = dist.new_group(ranks=list(ranks), group_desc=description)
        else:
            # c10d sorts ranks unless told not to; group rank must equal the mesh coordinate, or
            # collectives would gather/scatter shards in the wrong order.
            created = dist.new_group(ranks=list(ranks), group_desc=description, sort_ranks=False)
        if my_rank not in ranks:
            return None
        if not isinstance(created, dist.ProcessGroup):
            raise MeshError(f"torch.distributed.new_group({list(ranks)}) returned {created!r} on member rank {my_rank}")
        return created

    def forget(self) -> None:
        """Drop every record of the groups (the next use starts from the current default group)."""
        self._world = None
        self._backend = ""
        self._groups = {}

    def lookup_by_name(self, group_name: str) -> dist.ProcessGroup | None:
        """A registered group (or the default group) by its c10d name, for unpickling meshes."""
        self._follow_world()
        for reference in self._groups.values():
            group = None if reference is None else reference()
            if group is not None and group.group_name == group_name:
                return group
        return None


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


def group_for_dim(sub_groups: Sequence[tuple[int, ...]], my_rank: int, description: str) -> dist.ProcessGroup | None:
    """This rank's group among ``sub_groups`` (all of a mesh dim's rank lists), creating any missing.

    Every rank of the world must call this with the same ``sub_groups`` in the same order.
    Returns None when ``my_rank`` is in none of them.
    """
    return _registry.group_for(sub_groups, my_rank, description)


def registered_group(group_name: str) -> dist.ProcessGroup | None:
    return _registry.lookup_by_name(group_name)
