"""Shared by the tp_styles tests: collective counting, small models, global-versus-local checks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from shardwise.dtensor_ops.debug import CommDebugMode

c10d_functional = torch.ops.c10d_functional

COUNTED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    """The counts of the collectives that matter here, plus ``total`` (every collective counted)."""
    counts = mode.get_comm_counts()
    result = {name: int(counts[getattr(c10d_functional, name)]) for name in COUNTED}
    result["total"] = int(mode.get_total_counts())
    return result


def expect_counts(mode: CommDebugMode, what: str, total: int, **named: int) -> None:
    """Assert the total count and the named collectives' counts (others may be anything within total)."""
    got = comm_counts(mode)
    wanted = dict(named, total=total)
    mismatched = {name: (got[name], count) for name, count in wanted.items() if got[name] != count}
    assert not mismatched, f"{what}: collective counts (got, expected) {mismatched}; all counts {got}"


def rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def my_chunk(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's torch.chunk piece of ``tensor`` along ``dim``."""
    rank, world = rank_and_world()
    return tensor.chunk(world, dim)[rank]


class RMSNormPython(nn.Module):
    """RMSNorm written with pointwise ops and a mean, as Llama-style models do."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.weight


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.net1 = nn.Linear(dim, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))
