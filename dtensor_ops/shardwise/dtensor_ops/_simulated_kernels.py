"""Local kernels of decisions made while every rank is simulated in one process (torch's LocalTensorMode).

A rule's local kernel and its local argument overrides are bound when the decision is made and
may depend on the rank's mesh coordinate (the rows an embedding shard holds, which rank keeps the
masked places of a ``Partial`` fill, a view's local size on uneven shards, ...). Under
``LocalTensorMode`` one decision serves every simulated rank, so they are made once per simulated
rank (each with its coordinate, see ``shardwise.mesh._simulation``): kernels that differ run on each
rank's own local tensors, override values that differ become ``LocalIntNode`` SymInts, which the
mode hands each rank's op as that rank's int.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shardwise.mesh import _simulation as simulation

__all__ = [
    "PerSimulatedRankKernel",
    "local_arg_overrides_for_each_simulated_rank",
    "local_kernel_for_each_simulated_rank",
]

LocalKernel = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class PerSimulatedRankKernel:
    """Runs each simulated rank's kernel (``None``: the op itself) on that rank's local tensors."""

    kernels: tuple[tuple[int, LocalKernel | None], ...]
    op: LocalKernel

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if simulation.simulated_view() is None:
            raise RuntimeError(
                f"a decision made under LocalTensorMode (local kernels per simulated rank {[r for r, _ in self.kernels]}) "
                "is used outside the mode; the real rank's decision is needed instead"
            )
        return simulation.run_for_each_simulated_rank(self._run_on_pinned_rank, *args, **kwargs)

    def _run_on_pinned_rank(self, *args: Any, **kwargs: Any) -> Any:
        rank = simulation.pinned_rank()
        kernel = dict(self.kernels).get(rank) if rank is not None else None
        return (kernel if kernel is not None else self.op)(*args, **kwargs)


def local_kernel_for_each_simulated_rank(make: Callable[[], LocalKernel | None], op: LocalKernel) -> LocalKernel | None:
    """``make()``; under LocalTensorMode made per simulated rank, joined when they differ."""
    view = simulation.simulated_view()
    if not isinstance(view, frozenset):
        return make()
    kernels: list[tuple[int, LocalKernel | None]] = []
    for rank in sorted(view):
        with simulation.as_simulated_rank(rank):
            kernels.append((rank, make()))
    first = kernels[0][1]
    if all(kernel == first for _, kernel in kernels):
        return first
    return PerSimulatedRankKernel(tuple(kernels), op)


Overrides = tuple[tuple[Any, object], ...]


def local_arg_overrides_for_each_simulated_rank(make: Callable[[], Overrides]) -> Overrides:
    """``make()``; under LocalTensorMode made per simulated rank, values that differ joined per rank."""
    view = simulation.simulated_view()
    if not isinstance(view, frozenset):
        return make()
    by_rank: dict[int, Overrides] = {}
    for rank in sorted(view):
        with simulation.as_simulated_rank(rank):
            by_rank[rank] = make()
    first = next(iter(by_rank.values()))
    if all(overrides == first for overrides in by_rank.values()):
        return first
    positions = [position for position, _ in first]
    if any([position for position, _ in overrides] != positions for overrides in by_rank.values()):
        raise AssertionError(f"local argument overrides name different arguments on different simulated ranks: {by_rank}")
    return tuple(
        (position, simulation.join_rank_values({rank: overrides[index][1] for rank, overrides in by_rank.items()}))
        for index, position in enumerate(positions)
    )
