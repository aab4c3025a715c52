"""The little this package needs from a device mesh.

``shardwise.mesh.DeviceMesh`` satisfies it; so does a tiny fake in unit tests,
which is why placement math never needs processes.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

__all__ = ["MeshLike"]


@runtime_checkable
class MeshLike(Protocol):
    """A mesh as seen by layout code: its shape and this rank's coordinate in it.

    Implementations must also be hashable and compare by value (specs holding the
    mesh are cache keys).
    """

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def ndim(self) -> int: ...

    def get_coordinate(self) -> Sequence[int] | None: ...
