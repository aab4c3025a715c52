"""Counting the c10d group creations a piece of code makes on this rank."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


@dataclass
class GroupCalls:
    """``new_group`` calls on this rank: every call, and those that made a group this rank is in."""

    ranks: list[list[int]] = field(default_factory=list)
    member_ranks: list[list[int]] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.ranks)

    @property
    def created(self) -> int:
        return len(self.member_ranks)


@contextlib.contextmanager
def count_new_group_calls() -> Iterator[GroupCalls]:
    """Count calls into c10d's group creation, whoever makes them (shardwise or PyTorch's DeviceMesh).

    Both ``dist.new_group`` and the modules that imported it by name end up in
    ``distributed_c10d._new_group_with_tag``, so that is where we listen.
    """
    counts = GroupCalls()
    original = c10d._new_group_with_tag

    def counting(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        requested = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        result = original(ranks, *args, **kwargs)
        counts.ranks.append(requested)
        if isinstance(result, dist.ProcessGroup):
            counts.member_ranks.append(requested)
        return result

    c10d._new_group_with_tag = counting
    try:
        yield counts
    finally:
        c10d._new_group_with_tag = original
