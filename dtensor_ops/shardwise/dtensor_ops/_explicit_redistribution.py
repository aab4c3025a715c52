"""Explicit redistribution: a scope in which an op may not move its inputs between layouts on its own.

Inside ``ExplicitRedistributionContext()`` an op whose rule needs an input in another layout raises
instead of redistributing it (``strict=True``: any change of layout; otherwise only changes that
communicate); ``mode="warn"`` logs instead. ``enable=False`` lifts it for an inner block. Calls to
``DTensor.redistribute`` are explicit and never checked. State is per thread.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType
from typing import Callable

__all__ = ["ExplicitRedistributionContext", "check_implicit_redistribution"]

_logger = logging.getLogger(__name__)
_state = threading.local()


class ExplicitRedistributionContext:
    """Refuse (or warn about) implicit redistribution of op inputs inside the block."""

    def __init__(self, enable: bool = True, strict: bool = False, mode: str = "raise") -> None:
        if mode not in ("raise", "warn"):
            raise RuntimeError(f"ExplicitRedistributionContext: mode must be 'raise' or 'warn', got {mode!r}")
        self.enable = enable
        self.strict = strict
        self.mode = mode
        self._outer: ExplicitRedistributionContext | None = None

    def __enter__(self) -> ExplicitRedistributionContext:
        self._outer = getattr(_state, "active", None)
        _state.active = self
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        _state.active = self._outer


def is_active() -> bool:
    """True when an enabled context is in force on this thread (dispatch asks before pricing anything)."""
    active: ExplicitRedistributionContext | None = getattr(_state, "active", None)
    return active is not None and active.enable


def check_implicit_redistribution(describe: Callable[[], str], communicates: Callable[[], bool]) -> None:
    """Called by dispatch before it redistributes an op input itself; raises or warns as the context says."""
    active: ExplicitRedistributionContext | None = getattr(_state, "active", None)
    if active is None or not active.enable:
        return
    if not active.strict and not communicates():
        return
    message = (
        f"Implicit redistribution inside ExplicitRedistributionContext: {describe()}; redistribute the input "
        "explicitly (DTensor.redistribute) before the op, or leave the context (enable=False / strict=False)"
    )
    if active.mode == "raise":
        raise RuntimeError(message)
    _logger.warning(message)
