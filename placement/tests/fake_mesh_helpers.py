"""A process-free stand-in for DeviceMesh: just a shape and this rank's coordinate."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence


@dataclass(frozen=True)
class FakeMesh:
    shape: tuple[int, ...]
    coordinate: tuple[int, ...] | None = None
    name: str = "fake"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, mesh_dim: int | None = None) -> int:
        if mesh_dim is None:
            total = 1
            for extent in self.shape:
                total *= extent
            return total
        return self.shape[mesh_dim]

    def get_coordinate(self) -> list[int] | None:
        return None if self.coordinate is None else list(self.coordinate)


def all_coordinates(mesh_shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(extent) for extent in mesh_shape))
