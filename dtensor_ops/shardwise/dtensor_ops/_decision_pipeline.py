"""Where an op on DTensors gets its behaviour: one table of deciders, one walk over it, one memo.

Every call is offered to the deciders of :data:`DECIDERS` in this order (its real priority); the
first that does not decline wins:

====  ==================  =========  ==========================================================
 #    decider             cacheable  answers
====  ==================  =========  ==========================================================
 1    user handlers       no         run this algorithm: the op's handlers (asked before the memo)
 2    built-in handlers   yes        run this algorithm: the op's handlers
 3    the op's rule       yes        a decision (from specs)
 4    decomposition       yes        run this algorithm: torch's decomposition of the op, run on
                                     the DTensors (each inner op decided by its own rule)
 5    replicate fallback  yes        a decision (from specs); off unless switched on
====  ==================  =========  ==========================================================

and an op no decider takes raises ``NotImplementedError`` naming the op and its input placements.

One signature: ``decide(call) -> OpDecision | Algorithm | NotImplemented`` (declining), where
``call`` is the one :class:`Call` object dispatch's reader builds (its key a property built once).
A *decision* is plain data dispatch executes; an :class:`Algorithm` is "run this": the walk runs it
on the call's DTensors, and it may still decline when run (a handler returning ``NotImplemented``,
a decomposition already running for this op on this thread), in which case the walk goes on (and
memoises nothing for the call where declining depended on more than its key: the decomposition's).  *Cacheable* answers depend only on the call's key: they are kept in
the memo (``RANK_CACHES.decisions``), algorithms included, so a hit runs ``_foreach_norm``'s
algorithm without asking anything again.  Handlers registered without ``declines_by_key`` (a
user's, ``loss_parallel``'s) say they are not cacheable: their op is in :data:`ASKED_EVERY_CALL`,
which dispatch checks before its lookup.

* *Handlers* (``_op_handlers``) run an algorithm with its own communication on the call's
  DTensors and return the op's result.
* *The op's rule*: the rule engine (``_propagation``) over ``rule_for(op)`` (built-in rule families,
  ``register_sharding``, PyTorch-style strategy registrations, all one :class:`ShardingRule`);
  ``_StridedShard`` inputs (FSDP over TP) are the engine's too.
* *Decomposition* (as PyTorch 2.13), for ops without a rule: a decomposition registered with
  ``torch._decomp`` (a custom op's ``register_decomposition`` included), plain tensors it makes
  itself taken as replicated (``implicit_replication``); and the CompositeImplicitAutograd ops that
  reach DTensor whole when autograd is off (``torch.inference_mode()``: ``matmul``, ``linear``),
  decomposed as autograd would have.
* *Replicate fallback*: the same engine over an all-replicate rule.

Entry points: :func:`decide` (dispatch: the walk, answers stored once), :func:`ask_every_call`
(dispatch, before its lookup, for ops in :data:`ASKED_EVERY_CALL`) and :func:`propagate_op_sharding`
(PyTorch's API: the same walk asked for specs only, cached under the same key; algorithms need
DTensors, so their deciders decline).  Layer: propagation (no collectives, no DTensor class).

The memo's key (:func:`call_key`) is ``(op, part, part, ...)``: one part per positional argument
and, when there are keyword arguments, :data:`KWARGS_MARK` followed by ``name, part`` pairs.  A part
is :func:`key_part` of the argument with DTensors replaced by their specs:

* specs, ints, strings, None, dtypes, devices, layouts, memory formats: the value itself;
* bools: ``(bool, value)`` (``True == 1`` but they can give different result dtypes);
* floats and complex numbers: ``(type, value)``, or just the type for rules that say values cannot
  change their decision (pointwise ops, fills, foreach ops: an optimizer passes new step sizes every
  step, which would otherwise add an entry per step);
* lists, tuples and sizes: ``(list, part, ...)``;
* a plain tensor (only when propagation is called directly): ``(torch.Tensor, dtype, shape)``.

Dispatch's flat reader writes ``(op, *specs)`` where every part is its own part (that *is*
``call_key``'s value) and calls :func:`call_key` otherwise.  Decisions may carry this rank's local
sizes, so the memo is rank-local (``_caches``); a plain dict cleared when full.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, NamedTuple, Sequence

import torch
import torch._decomp

from shardwise.placement import DTensorSpec

from ._caches import RANK_CACHES, SHARED_CACHES, SYMBOLIC, lookup, store
from ._decision import ArgPosition, OpDecision
from ._engine import ENGINE
from ._implicit_replication import replicated_within_this_thread
from ._op_handlers import ASKED_EVERY_CALL, CACHEABLE_HANDLERS, OpHandler
from ._ops import rule_for
from ._ops.fallback import replicate_fallback_rule
from ._propagation import collect_specs, decide_with_rule, describe_inputs

__all__ = [
    "ASKED_EVERY_CALL",
    "Algorithm",
    "Call",
    "DECIDERS",
    "DISPATCH_LOOKUPS",
    "Decider",
    "Handled",
    "KWARGS_MARK",
    "MAX_CACHED_DECISIONS",
    "PropagationCacheInfo",
    "SELF_KEYED_TYPES",
    "ask_every_call",
    "call_key",
    "clear_decisions",
    "decide",
    "decide_from_specs",
    "decision_cache_size",
    "float_values_matter",
    "key_part",
    "lookup_decision",
    "propagate_op_sharding",
    "propagation_cache_info",
    "remember_decision",
]

MAX_CACHED_DECISIONS = 1 << 16

# [hits, misses] of dispatch's lookups in the memo (the engine's statistics).  debug._get_fast_path_sharding_prop_cache_stats
# reports them and the debug clear functions zero them.  Process-wide (rank threads share the counts): a list bumped
# in place costs a few tens of ns per op, a per-rank mapping would cost a lookup.
DISPATCH_LOOKUPS: list[int] = ENGINE.dispatch_lookups

# Non-tensor argument types whose value is its own key part.
SELF_KEYED_TYPES: frozenset[type] = frozenset(
    {int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)


class _KwargsMark:
    """Separates positional from keyword parts, so op(x, "a", "b") and op(x, a="b") never share a key."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "KWARGS_MARK"


KWARGS_MARK = _KwargsMark()


# -- the key ----------------------------------------------------------------------------------------


def float_values_matter(op: torch._ops.OpOverload) -> bool:
    """Whether ``op``'s decision may depend on the values of its float arguments (not only their type)."""
    matters = SHARED_CACHES.float_values_matter.get(op)
    if matters is None:
        rule = rule_for(op)
        matters = rule is None or rule.scalar_values_matter
        SHARED_CACHES.float_values_matter[op] = matters
    return matters


def key_part(value: Any, keep_float_values: bool) -> Hashable:
    """The key part of one argument (DTensors already replaced by their specs)."""
    value_type = type(value)
    if value_type is DTensorSpec or value_type in SELF_KEYED_TYPES:
        return value
    if value_type is float or value_type is complex:
        return (value_type, value) if keep_float_values else value_type  # type: ignore[return-value]
    if value_type is bool:
        return (bool, value)
    if value_type is list or value_type is tuple or value_type is torch.Size:
        parts: list[Hashable] = [list]
        for item in value:
            # Ints (sizes, dims) are their own part: no call for them.
            parts.append(item if type(item) is int else key_part(item, keep_float_values))
        return tuple(parts)
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, value.dtype, tuple(value.shape))
    return value


def call_key(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> Hashable:
    """The memo key of ``op(*args, **kwargs)`` (DTensors replaced by their specs): the one key builder.

    Dispatch calls it on its hit path for calls with a float, a bool or a list: specs and self-keyed
    values are taken as they are, and the rule is asked whether float values matter only when needed.
    """
    keep: bool | None = None
    parts: list[Hashable] = [op]
    for arg in args:
        arg_type = type(arg)
        if arg_type is DTensorSpec or arg_type in SELF_KEYED_TYPES:
            parts.append(arg)
        else:
            if keep is None:
                keep = float_values_matter(op)
            parts.append(key_part(arg, keep))
    if kwargs:
        if keep is None:
            keep = float_values_matter(op)
        parts.append(KWARGS_MARK)
        for name, value in kwargs.items():
            parts.append(name)
            parts.append(key_part(value, keep))
    return tuple(parts)


# -- the call ---------------------------------------------------------------------------------------


class Call:
    """One op call as every decider sees it.

    ``args``/``kwargs``: the call's own values (DTensors), or None when only specs are known (a direct
    :func:`propagate_op_sharding`); ``spec_args``/``spec_kwargs``: DTensors (and accepted plain tensors)
    replaced by their specs; ``local_args``/``local_kwargs``: the local tensors dispatch runs on (None
    when only specs are known).  :attr:`key` is built once (or handed over by dispatch's reader);
    :attr:`specs` / :attr:`positions` flatten the specs once.
    """

    __slots__ = (
        "op",
        "args",
        "kwargs",
        "spec_args",
        "spec_kwargs",
        "local_args",
        "local_kwargs",
        "_key",
        "_specs",
        "_positions",
    )

    def __init__(
        self,
        op: torch._ops.OpOverload,
        args: tuple[Any, ...] | None,
        kwargs: dict[str, Any] | None,
        spec_args: Sequence[object],
        spec_kwargs: Mapping[str, object],
        local_args: list[Any] | None = None,
        local_kwargs: dict[str, Any] | None = None,
        key: Hashable | None = None,
    ) -> None:
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.spec_args = spec_args
        self.spec_kwargs = spec_kwargs
        self.local_args = local_args
        self.local_kwargs = local_kwargs
        self._key = key
        self._specs: tuple[DTensorSpec[Any], ...] | None = None
        self._positions: tuple[ArgPosition, ...] = ()

    @classmethod
    def of_specs(
        cls, op: torch._ops.OpOverload, spec_args: Sequence[object], spec_kwargs: Mapping[str, object], key: Hashable | None = None
    ) -> Call:
        """A call known by its specs only (no DTensors: algorithms cannot run on it)."""
        return cls(op, None, None, spec_args, spec_kwargs, key=key)

    @property
    def key(self) -> Hashable:
        """The memo key (:func:`call_key`), built once."""
        key = self._key
        if key is None:
            key = self._key = call_key(self.op, self.spec_args, self.spec_kwargs)
        return key

    @property
    def has_tensors(self) -> bool:
        return self.args is not None

    @property
    def specs(self) -> tuple[DTensorSpec[Any], ...]:
        """Every spec in flattened argument order (a ValueError when there is none)."""
        if self._specs is None:
            specs: list[DTensorSpec[Any]] = []
            positions: list[ArgPosition] = []
            for index, arg in enumerate(self.spec_args):
                collect_specs(self.op, arg, index, specs, positions)
            for name, value in self.spec_kwargs.items():
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


# -- answers ----------------------------------------------------------------------------------------


class Algorithm:
    """A decider's answer "run this": ``run(op, args, kwargs)`` gives the op's result from its DTensors, or
    ``NotImplemented`` (it declines; the walk goes on).  ``declines_by_key``: whether declining depends only
    on the call's key (a handler's promise), so that what the walk answers next may be memoised; a
    decomposition declines by thread state (its op already decomposing).  ``decider``: the index in
    :data:`DECIDERS` of the decider that answered (the walk resumes after it).  ``simple`` is False, as for
    any decision dispatch cannot run inline."""

    __slots__ = ("name", "run", "decider", "declines_by_key")
    simple = False

    def __init__(
        self,
        name: str,
        run: Callable[[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]], Any],
        decider: int,
        declines_by_key: bool,
    ) -> None:
        self.name = name
        self.run = run
        self.decider = decider
        self.declines_by_key = declines_by_key

    def __repr__(self) -> str:
        return f"Algorithm({self.name!r})"


class Handled:
    """The walk's answer when an algorithm ran: the op's result itself (dispatch returns it as it is)."""

    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result


Answer = OpDecision | Algorithm


@dataclass(frozen=True)
class Decider:
    """One entry of :data:`DECIDERS`: ``decide(call)`` gives an :class:`OpDecision`, an :class:`Algorithm` or
    ``NotImplemented``.  ``cacheable``: its answers depend only on the call's key (memoised); otherwise it is
    asked on every call of the ops in :data:`ASKED_EVERY_CALL`, before the memo."""

    name: str
    cacheable: bool
    decide: Callable[[Call], Any]


def _run_handlers(handlers: tuple[OpHandler, ...], op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for handler in handlers:
        result = handler(op, args, kwargs)
        if result is not NotImplemented:
            return result
    return NotImplemented


def _user_handlers(call: Call) -> Any:
    handlers = ASKED_EVERY_CALL.get(id(call.op))
    if handlers is None or not call.has_tensors:
        return NotImplemented
    return Algorithm("user handlers", functools.partial(_run_handlers, handlers), _USER_HANDLERS, False)


def _builtin_handlers(call: Call) -> Any:
    op_id = id(call.op)
    handlers = CACHEABLE_HANDLERS.get(op_id)
    if handlers is None or op_id in ASKED_EVERY_CALL or not call.has_tensors:
        return NotImplemented  # an op with a handler that is not cacheable had all its handlers asked by decider 1
    return Algorithm("handlers", functools.partial(_run_handlers, handlers), _BUILTIN_HANDLERS, True)


def _rule(call: Call) -> Any:
    rule = rule_for(call.op)
    if rule is None:
        return NotImplemented
    return decide_with_rule(call.op, rule, call.spec_args, call.spec_kwargs, call.specs, call.positions, propagate_op_sharding)


# CompositeImplicitAutograd ops that reach DTensor whole with autograd off (torch.inference_mode()): autograd
# would have decomposed them; their decomposition (mm/bmm/addmm/views, each with a rule) is run as it would.
_WHOLE_COMPOSITES: frozenset[torch._ops.OpOverload] = frozenset({torch.ops.aten.matmul.default, torch.ops.aten.linear.default})
_DECOMPOSING = threading.local()  # .ops: the ops whose decomposition runs on this thread (rank threads share none)


def _run_composite(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return op.decompose(*args, **kwargs)


def _run_decomposition(
    decompose: Callable[..., Any], op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    running: set[torch._ops.OpOverload] = getattr(_DECOMPOSING, "ops", None) or set()
    if op in running:
        return NotImplemented  # a decomposition calling its own op: the deciders after this one
    _DECOMPOSING.ops = running | {op}
    try:
        # Plain tensors a decomposition makes itself (an arange, a constant) are the same on every rank.
        with replicated_within_this_thread():
            return decompose(*args, **kwargs)
    finally:
        _DECOMPOSING.ops = running


def _decomposition(call: Call) -> Any:
    if not call.has_tensors:
        return NotImplemented
    op = call.op
    if op in _WHOLE_COMPOSITES:
        return Algorithm("composite", _run_composite, _DECOMPOSITION, True)
    decompose = torch._decomp.decomposition_table.get(op)
    if decompose is None:
        return NotImplemented
    return Algorithm("decomposition", functools.partial(_run_decomposition, decompose), _DECOMPOSITION, False)


def _replicate_fallback(call: Call) -> Any:
    rule = replicate_fallback_rule(call.op, call.specs)  # None unless the fallback is switched on
    if rule is None:
        return NotImplemented
    return decide_with_rule(call.op, rule, call.spec_args, call.spec_kwargs, call.specs, call.positions, propagate_op_sharding)


DECIDERS: tuple[Decider, ...] = (
    Decider("user handlers", cacheable=False, decide=_user_handlers),
    Decider("built-in handlers", cacheable=True, decide=_builtin_handlers),
    Decider("the op's rule", cacheable=True, decide=_rule),
    Decider("decomposition", cacheable=True, decide=_decomposition),
    Decider("replicate fallback", cacheable=True, decide=_replicate_fallback),
)
_USER_HANDLERS, _BUILTIN_HANDLERS, _RULE, _DECOMPOSITION, _FALLBACK = range(len(DECIDERS))


def _no_decider(call: Call) -> OpDecision:
    # PyTorch's words after ours: code matching on either keeps working.
    raise NotImplementedError(
        f"shardwise has no sharding rule for {call.op} (inputs: {describe_inputs(call.specs)}): "
        f"Operator {call.op} does not have a sharding strategy registered."
    )


# -- the walk ---------------------------------------------------------------------------------------


def _walk(call: Call, cacheable: bool, first: int = 0, remember: bool = True) -> OpDecision | Handled | None:
    """Ask the deciders of :data:`DECIDERS` whose ``cacheable`` is ``cacheable``, from index ``first`` on, in
    order.  A decision is returned (completed for dispatch); an algorithm is run, its result returned as
    :class:`Handled`.  With ``remember``, the answer is stored under the call's key, unless an algorithm
    declined when run (then the answer depended on more than the key).  None: every decider declined and
    ``cacheable`` is False (the cacheable deciders come next); otherwise no decider raises."""
    for index in range(first, len(DECIDERS)):
        decider = DECIDERS[index]
        if decider.cacheable is not cacheable:
            continue
        answer = decider.decide(call)
        if answer is NotImplemented:
            continue
        if type(answer) is Algorithm:
            assert call.args is not None and call.kwargs is not None, "algorithms are answered for calls with DTensors"
            result = answer.run(call.op, call.args, call.kwargs)
            if result is NotImplemented:
                remember = remember and answer.declines_by_key
                continue
            if remember and cacheable:
                store(RANK_CACHES.decisions, call.key, answer, MAX_CACHED_DECISIONS)
            return Handled(result)
        decision = answer.for_op(call.op)
        if remember and cacheable:
            _count("misses")
            store(RANK_CACHES.decisions, call.key, decision, MAX_CACHED_DECISIONS)
        return decision
    if not cacheable:
        return None
    return _no_decider(call)


def ask_every_call(call: Call) -> Handled | None:
    """The deciders that are not cacheable (dispatch asks them before its lookup, for ops in
    :data:`ASKED_EVERY_CALL`): a :class:`Handled` or None (every one declined)."""
    answer = _walk(call, cacheable=False)
    assert answer is None or isinstance(answer, Handled)
    return answer


def decide(call: Call) -> OpDecision | Handled:
    """Dispatch's miss: the cacheable deciders in order, the answer stored under ``call.key`` (once)."""
    answer = _walk(call, cacheable=True)
    assert answer is not None
    return answer


def run_algorithm(algorithm: Algorithm, call: Call) -> Any:
    """A memoised algorithm run again (dispatch's hit): its result, or, should it decline now, the answer
    of the deciders after it (not stored)."""
    assert call.args is not None and call.kwargs is not None
    result = algorithm.run(call.op, call.args, call.kwargs)
    if result is not NotImplemented:
        return Handled(result)
    answer = _walk(call, cacheable=True, first=algorithm.decider + 1, remember=False)
    assert answer is not None
    return answer


def decide_from_specs(op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> OpDecision:
    """The decision for ``op(*args, **kwargs)`` (DTensors as specs), decided afresh and not stored."""
    answer = _walk(Call.of_specs(op, args, kwargs), cacheable=True, remember=False)
    assert isinstance(answer, OpDecision)
    return answer


def propagate_op_sharding(
    op: torch._ops.OpOverload,
    args: Sequence[object],
    kwargs: Mapping[str, object],
    *,
    key: Hashable | None = None,
) -> OpDecision:
    """The cached decision for ``op(*args, **kwargs)`` where every DTensor is replaced by its spec.

    The same walk as dispatch's, asked for specs only: the same key gives the same :class:`OpDecision`
    object as dispatch uses.  Raises ``NotImplementedError`` naming the op and the input placements when
    no decider takes the op, and ``ShardingPropagationError`` when the op's rule has no strategy that
    fits.  Algorithms (handlers, decompositions) need DTensors: their deciders decline here, and a key
    dispatch answered with one is decided afresh.  Under symbolic shapes (torch.compile with dynamic
    shapes) the key cannot be hashed and the call is decided afresh.
    """
    call = Call.of_specs(op, args, kwargs, key)
    found = lookup(RANK_CACHES.decisions, call.key)
    if type(found) is OpDecision:
        _count("hits")
        return found
    answer = _walk(call, cacheable=True, remember=found is None)
    assert isinstance(answer, OpDecision)
    return answer


# -- the memo ---------------------------------------------------------------------------------------


def _count(outcome: str) -> None:
    counts = RANK_CACHES.propagation_counts
    counts[outcome] = counts.get(outcome, 0) + 1


def lookup_decision(key: Hashable) -> OpDecision | None:
    """The decision stored under ``key``, or None (no entry, an algorithm, or symbolic sizes, which do not
    hash: torch.compile tracing with dynamic shapes decides such calls afresh)."""
    found = lookup(RANK_CACHES.decisions, key)
    return found if type(found) is OpDecision else None


def remember_decision(key: Hashable, decision: OpDecision) -> None:
    store(RANK_CACHES.decisions, key, decision, MAX_CACHED_DECISIONS)


def decision_cache_size() -> int:
    return len(RANK_CACHES.decisions)


class PropagationCacheInfo(NamedTuple):
    """functools' cache statistics, for the walk's own entries (PyTorch's debug helpers)."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


def propagation_cache_info() -> PropagationCacheInfo:
    """(hits, misses) of the walk: a decision it made, a direct ``propagate_op_sharding`` hit (what
    PyTorch's ``ShardingPropagator.cache_info`` counts)."""
    counts = RANK_CACHES.propagation_counts
    return PropagationCacheInfo(
        counts.get("hits", 0), counts.get("misses", 0), MAX_CACHED_DECISIONS, len(RANK_CACHES.decisions)
    )


def clear_decisions() -> None:
    """Forget every memoised answer and the walk's counts (dispatch's counts: see ``debug``)."""
    RANK_CACHES.decisions.clear()
    RANK_CACHES.propagation_counts.clear()
