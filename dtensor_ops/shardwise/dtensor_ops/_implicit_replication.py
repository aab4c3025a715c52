"""Whether plain tensors mixed with DTensors count as replicated (``experimental.implicit_replication``)."""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["implicit_replication", "is_implicit_replication_enabled"]

_depth = 0


def is_implicit_replication_enabled() -> bool:
    return _depth > 0


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside this context a plain ``torch.Tensor`` used with DTensors counts as replicated.

    Every rank must hold the same value for that tensor; nothing checks it.
    """
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
