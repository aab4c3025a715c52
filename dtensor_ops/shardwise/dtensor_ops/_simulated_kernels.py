"""Local kernels of decisions made while every rank is simulated in one process (torch's LocalTensorMode).

A rule's local kernel is bound when the decision is made and may depend on the rank's mesh
coordinate (the rows an embedding shard holds, which rank keeps the masked places of a
``Partial`` fill, ...). Under ``LocalTensorMode`` one decision serves every simulated rank, so
the kernel is made once per simulated rank (each with its coordinate, see
``shardwise.mesh._simulation``) and, where they differ, run on each rank's own local tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shardwise.mesh import _simulation as simulation

__all__ = ["PerSimulatedRankKernel", "local_kernel_for_each_simulated_rank"]

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
