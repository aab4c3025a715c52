"""The registry of op handlers: ops whose DTensor behaviour is an algorithm rather than a sharding rule.

A handler gets the op's original arguments (DTensors untouched) below autograd, like any
``__torch_dispatch__`` code, and returns the result, or ``NotImplemented`` to hand the call on
(to the handler registered before it for the same op, and finally to the op's sharding rule).
Handlers are where communication other than redistribution may happen: loss_parallel's
cross-entropy, ``_foreach_norm``'s grouped reduction, the batch-sharded mean of ``nll_loss``.

Several handlers may be registered for one op; the most recent is asked first.  dtensor_ops's own
handlers are installed by the package ``__init__``; users and upper layers (``tp_styles``) add
theirs with :func:`register_op_handler` or for a block with :func:`custom_op_handlers`.

Cacheable or not: a handler registered with ``declines_by_key=True`` promises that whether it
declines depends only on what the decision memo keys a call by (the op, the input specs, the
non-tensor arguments).  Its answer is then cacheable: the decision pipeline asks it on a miss and
memoises what follows ("run these handlers" when one took the call, the rule's decision when all
declined), so every other op pays nothing for it.  Any other handler says it is not cacheable: its
op goes into :data:`ASKED_EVERY_CALL`, and while that is not empty dispatch asks the op's handlers on
every call before its lookup (one dict lookup per op).  Registering or removing a handler forgets
this rank's memoised answers for its op.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, NamedTuple

import torch

from ._engine import ENGINE

__all__ = [
    "OpHandler",
    "custom_op_handlers",
    "handlers_for",
    "register_op_handler",
    "unregister_op_handler",
]

OpHandler = Callable[[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]], Any]


class _Registration(NamedTuple):
    handler: OpHandler
    declines_by_key: bool


# op -> its registrations, most recent first.
_REGISTRATIONS: dict[torch._ops.OpOverload, tuple[_Registration, ...]] = {}
# What the decision pipeline reads, keyed by id(op): OpOverload's hash is a Python function (about 0.1 µs),
# an int's is not, and overloads live as long as the process.  Every handler of ops that have any ...
CACHEABLE_HANDLERS: dict[int, tuple[OpHandler, ...]] = ENGINE.cacheable_handlers
# ... and the same for ops with at least one handler that is not cacheable (empty unless a user handler is
# registered: dispatch then looks here before its lookup on every op).
ASKED_EVERY_CALL: dict[int, tuple[OpHandler, ...]] = ENGINE.asked_every_call


def _store(op: torch._ops.OpOverload, registrations: tuple[_Registration, ...]) -> None:
    handlers = tuple(registration.handler for registration in registrations)
    if registrations:
        _REGISTRATIONS[op] = registrations
        CACHEABLE_HANDLERS[id(op)] = handlers
    else:
        _REGISTRATIONS.pop(op, None)
        CACHEABLE_HANDLERS.pop(id(op), None)
    if any(not registration.declines_by_key for registration in registrations):
        ASKED_EVERY_CALL[id(op)] = handlers
    else:
        ASKED_EVERY_CALL.pop(id(op), None)
    # Answers memoised for this op were made with the handlers it had (an algorithm names them).
    ENGINE.forget_op(op)


def handlers_for(op: torch._ops.OpOverload) -> tuple[OpHandler, ...]:
    """``op``'s handlers, most recently registered first."""
    return tuple(registration.handler for registration in _REGISTRATIONS.get(op, ()))


def register_op_handler(op: torch._ops.OpOverload, handler: OpHandler, *, declines_by_key: bool = False) -> None:
    """Run ``handler(op, args, kwargs)`` for ``op`` on DTensors before the handlers already registered for it.

    Nested registrations of the same handler (a context entered twice) are allowed: each
    unregistration removes one.  ``declines_by_key``: see the module docstring.
    """
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(f"register_op_handler expects an aten OpOverload, got {type(op).__name__} {op!r}")
    if not callable(handler):
        raise TypeError(f"register_op_handler({op}): the handler must be callable, got {handler!r}")
    _store(op, (_Registration(handler, declines_by_key), *_REGISTRATIONS.get(op, ())))


def unregister_op_handler(op: torch._ops.OpOverload, handler: OpHandler | None = None) -> None:
    """Remove the most recent registration of ``handler`` for ``op`` (without ``handler``: the most recent one)."""
    existing = _REGISTRATIONS.get(op, ())
    if not existing:
        return
    if handler is None:
        remaining = existing[1:]
    else:
        handlers = [registration.handler for registration in existing]
        if handler not in handlers:
            return
        index = handlers.index(handler)
        remaining = existing[:index] + existing[index + 1 :]
    _store(op, remaining)


@contextlib.contextmanager
def custom_op_handlers(handlers: dict[torch._ops.OpOverload, OpHandler]) -> Iterator[None]:
    """Register ``handlers`` for the duration of the block (in front of any handler already there)."""
    registered: list[tuple[torch._ops.OpOverload, OpHandler]] = []
    try:
        for op, handler in handlers.items():
            register_op_handler(op, handler)
            registered.append((op, handler))
        yield
    finally:
        for op, handler in registered:
            unregister_op_handler(op, handler)
