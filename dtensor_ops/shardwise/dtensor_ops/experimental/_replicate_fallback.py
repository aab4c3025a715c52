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

import contextlib
from types import TracebackType
from typing import Any

from .._ops.fallback import ReplicateFallbackWarning, forget_fallback_decisions, replicate_fallback_enabled
from .._options import set_process_options, use_options

__all__ = ["ReplicateFallbackWarning", "replicate_fallback"]


class replicate_fallback:  # noqa: N801 - a context manager named like the function it stands for
    """Context manager turning the replicate fallback on for its block on this thread; ``enable()``/``disable()``
    switch it for the whole process, ``is_enabled()`` says whether it is on here (by either).

    It is the ``replicate_fallback`` option of ``shardwise.dtensor_ops``'s options (``_options``), so
    ``SHARDWISE_REPLICATE_FALLBACK=1`` turns it on too. Turning it off drops the decisions it made.
    """

    def __init__(self) -> None:
        self._scopes: list[contextlib.AbstractContextManager[Any]] = []

    def __enter__(self) -> replicate_fallback:
        scope = use_options(replicate_fallback=True)
        scope.__enter__()
        self._scopes.append(scope)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._scopes.pop().__exit__(kind, error, traceback)
        if not replicate_fallback_enabled():
            forget_fallback_decisions()

    @staticmethod
    def enable() -> None:
        set_process_options(replicate_fallback=True)

    @staticmethod
    def disable() -> None:
        set_process_options(replicate_fallback=False)
        if not replicate_fallback_enabled():
            forget_fallback_decisions()

    @staticmethod
    def is_enabled() -> bool:
        return replicate_fallback_enabled()
