"""Where an op on DTensors gets its behaviour: the ordered list of deciders, as data, and its two entry points.

Every call is offered to the deciders below in this order; the first that does not decline wins.

====  ==================  ===========================  ==========================================
 #    decider             asked                        gives
====  ==================  ===========================  ==========================================
 1    user handlers       every call, before the cache  the result (never cached)
 2    built-in handlers   on a decision-cache miss      the result (never cached; declining is)
 3    decomposition       on a miss, ops with no rule   the result of torch's decomposition of the
                          that torch can decompose      op run on the DTensors (never cached)
 4    the op's rule       on a miss, from specs         a decision (cached)
 5    replicate fallback  on a miss, from specs         a decision (cached); off unless switched on
====  ==================  ===========================  ==========================================

and an op no decider takes raises ``NotImplementedError`` naming the op and its input placements.

* *Handlers* (``_op_handlers``) run an algorithm with its own communication on the call's
  DTensors and return the op's result.  Those registered with ``declines_by_key`` (every
  built-in one) promise that declining depends only on the cache key, so they are asked on a
  miss and their declining is cached with the decision that follows; any other (a user's,
  ``loss_parallel``'s) is asked on every call of its op, before the cache.
* *Decomposition* (as PyTorch 2.13): an op without a rule whose decomposition is registered with
  ``torch._decomp`` (a custom op's ``register_decomposition`` included) runs as that decomposition,
  each op inside it dispatched on the DTensors as usual (and so decided and cached by its own
  rule), plain tensors it makes itself taken as replicated (``implicit_replication``).  It declines for ops with a rule and, on one thread, for an op whose decomposition is
  already running (a decomposition that calls its own op goes on to the spec deciders).
* *Spec deciders* see the call with DTensors replaced by their specs and return a plain-data
  :class:`OpDecision` that dispatch caches and executes.  ``the op's rule`` is the
  rule engine (``_propagation``) over ``rule_for(op)`` (built-in rule families, ``register_sharding``,
  and PyTorch-style strategy registrations, all stored as one :class:`ShardingRule`);
  ``replicate fallback`` is the same engine over an all-replicate rule.  ``_StridedShard`` inputs
  (FSDP over TP) are the engine's too: it relabels a rule's shards to the inputs' strided layouts
  where that is exact and prices those variants with the rest (``_propagation._strided_variants``).

Entry points: :func:`decide_on_miss` (dispatch, after its one lookup missed: every decider from 2
on, the decision stored once) and :func:`propagate_op_sharding` (a direct call with specs: the
spec deciders, cached under the same key).  Layer: propagation (no collectives, no DTensor class).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch
import torch._decomp

from shardwise.placement import DTensorSpec

from ._decision import ArgPosition, OpDecision
from ._caches import RANK_CACHES
from ._decision_cache import call_key, lookup_decision, remember_decision
from ._implicit_replication import implicit_replication
from ._op_handlers import HANDLERS_BY_OP_ID, UNKEYED_HANDLERS_BY_OP_ID, OpHandler
from ._ops import rule_for
from ._ops.fallback import replicate_fallback_rule
from ._propagation import collect_specs, decide_with_rule, describe_inputs

__all__ = [
    "DECIDERS",
    "Decider",
    "Handled",
    "SpecCall",
    "ask_before_cache",
    "decide_from_specs",
    "decide_on_miss",
    "propagate_op_sharding",
]


class Handled:
    """A handler's answer: the op's result itself (dispatch returns it as it is, and caches nothing)."""

    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result


class SpecCall:
    """One call as spec deciders see it: DTensors replaced by their specs (with tensor_meta)."""

    __slots__ = ("op", "args", "kwargs", "_specs", "_positions")

    def __init__(self, op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> None:
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self._specs: tuple[DTensorSpec[Any], ...] | None = None
        self._positions: tuple[ArgPosition, ...] = ()

    @property
    def specs(self) -> tuple[DTensorSpec[Any], ...]:
        """Every spec in flattened argument order (a ValueError when there is none)."""
        if self._specs is None:
            specs: list[DTensorSpec[Any]] = []
            positions: list[ArgPosition] = []
            for index, arg in enumerate(self.args):
                collect_specs(self.op, arg, index, specs, positions)
            for name, value in self.kwargs.items():
                collect_specs(self.op, value, name, specs, positions)
            if not specs:
                raise ValueError(f"{self.op}: no DTensor among the arguments; sharding propagation needs at least one")
            self._specs, self._positions = tuple(specs), tuple(positions)
        return self._specs

    @property
    def positions(self) -> tuple[ArgPosition, ...]:
        """Where each of :attr:`specs` sits (positional index or keyword name)."""
        self.specs
        return self._positions


@dataclass(frozen=True)
class Decider:
    """One entry of :data:`DECIDERS`.

    ``asked``: ``"every call"`` (before the decision cache) or ``"on a miss"``.  ``from_specs``: the
    decider needs only the specs (it can serve :func:`propagate_op_sharding`, and its answer is a
    cached :class:`OpDecision`); otherwise it needs the call's DTensors and answers :class:`Handled`.
    ``decide(op, args, kwargs)`` returns ``NotImplemented`` to decline; ``args``/``kwargs`` are the
    call's own values for handlers and a :class:`SpecCall` for spec deciders (as ``args``).
    """

    name: str
    asked: str
    from_specs: bool
    decide: Callable[..., Any]


def _ask_handlers(
    handlers: tuple[OpHandler, ...] | None, op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    for handler in handlers or ():
        result = handler(op, args, kwargs)
        if result is not NotImplemented:
            return Handled(result)
    return NotImplemented


def _user_handlers(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return _ask_handlers(UNKEYED_HANDLERS_BY_OP_ID.get(id(op)), op, args, kwargs)


def _builtin_handlers(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    op_id = id(op)
    if op_id in UNKEYED_HANDLERS_BY_OP_ID:
        return NotImplemented  # this op's handlers were all asked before the cache (decider 1)
    return _ask_handlers(HANDLERS_BY_OP_ID.get(op_id), op, args, kwargs)


_DECOMPOSING = threading.local()  # .ops: the ops whose decomposition runs on this thread (rank threads share none)


def _decomposition(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if rule_for(op) is not None:
        return NotImplemented
    decompose = torch._decomp.decomposition_table.get(op)
    if decompose is None:
        return NotImplemented
    running: set[torch._ops.OpOverload] = getattr(_DECOMPOSING, "ops", None) or set()
    if op in running:
        return NotImplemented
    _DECOMPOSING.ops = running | {op}
    try:
        # Plain tensors a decomposition makes itself (an arange, a constant) are the same on every rank.
        with implicit_replication():
            return Handled(decompose(*args, **kwargs))
    finally:
        _DECOMPOSING.ops = running


def _rule(call: SpecCall) -> Any:
    rule = rule_for(call.op)
    if rule is None:
        return NotImplemented
    return decide_with_rule(call.op, rule, call.args, call.kwargs, call.specs, call.positions, propagate_op_sharding)


def _replicate_fallback(call: SpecCall) -> Any:
    rule = replicate_fallback_rule(call.op, call.specs)  # None unless the fallback is switched on
    if rule is None:
        return NotImplemented
    return decide_with_rule(call.op, rule, call.args, call.kwargs, call.specs, call.positions, propagate_op_sharding)


DECIDERS: tuple[Decider, ...] = (
    Decider("user handlers", "every call", from_specs=False, decide=_user_handlers),
    Decider("built-in handlers", "on a miss", from_specs=False, decide=_builtin_handlers),
    Decider("decomposition", "on a miss", from_specs=False, decide=_decomposition),
    Decider("the op's rule", "on a miss", from_specs=True, decide=_rule),
    Decider("replicate fallback", "on a miss", from_specs=True, decide=_replicate_fallback),
)
_BEFORE_CACHE = tuple(d.decide for d in DECIDERS if d.asked == "every call")
_HANDLERS_ON_MISS = tuple(d.decide for d in DECIDERS if d.asked == "on a miss" and not d.from_specs)
_SPEC_DECIDERS = tuple(d.decide for d in DECIDERS if d.from_specs)


def _no_decider(call: SpecCall) -> OpDecision:
    # PyTorch's words after ours: code matching on either keeps working.
    raise NotImplementedError(
        f"shardwise has no sharding rule for {call.op} (inputs: {describe_inputs(call.specs)}): "
        f"Operator {call.op} does not have a sharding strategy registered."
    )


def _walk(deciders: tuple[Callable[[SpecCall], Any], ...], call: SpecCall) -> OpDecision:
    for decide in deciders:
        decision = decide(call)
        if decision is not NotImplemented:
            return decision
    return _no_decider(call)


def decide_from_specs(op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> OpDecision:
    """The spec deciders' decision for ``op(*args, **kwargs)`` (DTensors as specs), not cached."""
    return _walk(_SPEC_DECIDERS, SpecCall(op, args, kwargs))


def ask_before_cache(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Decider 1 (dispatch asks it only while some op has such handlers): a :class:`Handled` or NotImplemented."""
    for decide in _BEFORE_CACHE:
        handled = decide(op, args, kwargs)
        if handled is not NotImplemented:
            return handled
    return NotImplemented


def decide_on_miss(
    op: torch._ops.OpOverload,
    key: Hashable,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    spec_args: Sequence[object],
    spec_kwargs: Mapping[str, object],
) -> Handled | OpDecision:
    """Dispatch's miss of ``key``: the handlers asked on a miss, then the spec deciders; a decision is
    completed for dispatch and stored under ``key`` (once)."""
    for decide in _HANDLERS_ON_MISS:
        handled = decide(op, args, kwargs)
        if handled is not NotImplemented:
            return handled
    _count("misses")
    decision = decide_from_specs(op, spec_args, spec_kwargs).for_op(op)
    remember_decision(key, decision)
    return decision


def propagate_op_sharding(
    op: torch._ops.OpOverload,
    args: Sequence[object],
    kwargs: Mapping[str, object],
    *,
    key: Hashable | None = None,
) -> OpDecision:
    """The cached decision for ``op(*args, **kwargs)`` where every DTensor is replaced by its spec.

    The same key gives the same :class:`OpDecision` object as dispatch uses.  Raises
    ``NotImplementedError`` naming the op and the input placements when no decider takes the op,
    and ``ShardingPropagationError`` when the op's rule has no strategy that fits.  Handlers are not
    asked (they need DTensors).  Under symbolic shapes (torch.compile with dynamic shapes) the key
    cannot be hashed and the call is decided afresh.
    """
    if key is None:
        key = call_key(op, args, kwargs)
    decision = lookup_decision(key)
    if decision is None:
        _count("misses")
        decision = decide_from_specs(op, args, kwargs).for_op(op)
        remember_decision(key, decision)
    else:
        _count("hits")
    return decision


def _count(outcome: str) -> None:
    counts = RANK_CACHES.propagation_counts
    counts[outcome] = counts.get(outcome, 0) + 1
