"""Counting every c10d group construction on this rank, whichever API asked for it.

``dist.new_group`` (PyTorch's DeviceMesh, user code) and shardwise's member-only creation both end
in ``distributed_c10d._new_process_group_helper``, which ``new_group`` also enters on ranks that
are not members; that is where we listen, so a count covers both stacks and non-member calls.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


@dataclass
class GroupConstructions:
    ranks: list[list[int]] = field(default_factory=list)
    """The rank list of every call, members or not."""
    member_ranks: list[list[int]] = field(default_factory=list)
    """The rank lists of the calls that made a group holding this rank."""
    names: list[str] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.ranks)

    @property
    def created(self) -> int:
        return len(self.member_ranks)


@contextlib.contextmanager
def count_group_constructions() -> Iterator[GroupConstructions]:
    counts = GroupConstructions()
    original = c10d._new_process_group_helper

    def counting(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        global_ranks = args[2]  # (group_size, group_rank, global_ranks_in_group, ...)
        counts.ranks.append(list(global_ranks))
        group = result[0] if isinstance(result, tuple) else result
        if isinstance(group, dist.ProcessGroup):
            counts.member_ranks.append(list(global_ranks))
            counts.names.append(group.group_name)
        return result

    c10d._new_process_group_helper = counting
    try:
        yield counts
    finally:
        c10d._new_process_group_helper = original
