"""``replicate_fallback``: run ops that have no sharding rule on replicated inputs (opt in).

    from shardwise.dtensor_ops.experimental import replicate_fallback

    with replicate_fallback():          # for a block
        y = torch.some_op_without_rule(x)
    replicate_fallback.enable()         # or for the whole process (replicate_fallback.disable() undoes it)

Inside, an op with no sharding rule gathers every DTensor input to ``Replicate`` (collectives that
``CommDebugMode`` counts), runs the plain op on every rank and returns a replicated DTensor; each
(op, input placements) warns once (``ReplicateFallbackWarning``) with the bytes per rank moved.
Outside, such an op raises ``NotImplementedError`` naming the op and its placements (the default).
Ops whose output size depends on the values (``nonzero``, ``unique``, boolean-mask reads) still
raise: a decision is made from shapes alone.
"""

from __future__ import annotations

from types import TracebackType

from .._ops.fallback import (
    ReplicateFallbackWarning,
    enter_replicate_fallback,
    exit_replicate_fallback,
    replicate_fallback_enabled,
    set_replicate_fallback_globally,
)

__all__ = ["ReplicateFallbackWarning", "replicate_fallback"]


class replicate_fallback:  # noqa: N801 - a context manager named like the function it stands for
    """Context manager turning the replicate fallback on for its block; ``enable()``/``disable()`` switch it
    for the whole process, ``is_enabled()`` says whether it is on (by either)."""

    def __enter__(self) -> replicate_fallback:
        enter_replicate_fallback()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        exit_replicate_fallback()

    @staticmethod
    def enable() -> None:
        set_replicate_fallback_globally(True)

    @staticmethod
    def disable() -> None:
        set_replicate_fallback_globally(False)

    @staticmethod
    def is_enabled() -> bool:
        return replicate_fallback_enabled()
