"""The replicate fallback's rule and switch (public API: ``experimental.replicate_fallback``).

While the fallback is on, an op that has no sharding rule gets this one: every DTensor input is
redistributed to ``Replicate`` (the planner's cheapest way: all-gathers, all-reduces of Partial
inputs; ``CommDebugMode`` counts them), every rank runs the plain op on the whole tensors and the
result is replicated.  Correct for any op whose output shape follows from its input shapes, at the
cost of moving every sharded input whole to every rank; so each (op, input placements) warns once,
with the bytes per rank it moves.  Off by default: the default is the error naming the op and its
placements.

The switch is the ``replicate_fallback`` option of the one options object (``_options``: a
``use_options`` block of this thread, ``set_process_options`` for the process,
``SHARDWISE_REPLICATE_FALLBACK=1``); the rule asks it on a decision-cache miss only.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Sequence

import torch

from shardwise.placement import DTensorSpec, Replicate

from .._caches import RANK_CACHES
from .._options import current_options
from .._planner import redistribute_cost_bytes
from .._rules import ShardingRule, rule_for
from .replicated import REPLICATED_RULE

__all__ = [
    "FALLBACK_RULE",
    "ReplicateFallbackWarning",
    "forget_fallback_decisions",
    "replicate_fallback_enabled",
    "replicate_fallback_rule",
]


class ReplicateFallbackWarning(UserWarning):
    """An op without a sharding rule ran on replicated inputs (``experimental.replicate_fallback``)."""


FALLBACK_RULE = ShardingRule(family="replicate fallback", one_dim_strategies=REPLICATED_RULE.one_dim_strategies)

_warned_lock = threading.Lock()
_warned: set[tuple[torch._ops.OpOverload, tuple[Any, ...]]] = set()


def replicate_fallback_enabled() -> bool:
    """Whether the fallback is on for this thread: the ``replicate_fallback`` option (``_options``)."""
    return current_options().replicate_fallback


def forget_fallback_decisions() -> None:
    """Drop cached decisions the fallback made, so that turning it off brings the error back."""
    decisions = RANK_CACHES.decisions
    stale = [key for key, decision in list(decisions.items()) if decision.op is not None and rule_for(decision.op) is None]
    for key in stale:
        decisions.pop(key, None)


def replicate_fallback_rule(op: torch._ops.OpOverload, specs: Sequence[DTensorSpec[Any]]) -> ShardingRule | None:
    """The fallback rule for ``op`` (which has no rule of its own) when the fallback is on, else None.

    Warns once per (op, input placements) with the bytes per rank the replication moves.
    """
    if not replicate_fallback_enabled():
        return None
    placements = tuple(spec.placements for spec in specs)
    key = (op, placements)
    if key not in _warned:
        with _warned_lock:
            first = key not in _warned
            _warned.add(key)
        if first:
            moved = sum(
                redistribute_cost_bytes(spec, spec.with_placements((Replicate(),) * len(spec.placements)))
                for spec in specs
                if spec.tensor_meta is not None
            )
            shown = ", ".join(
                "(" + ", ".join(repr(p) for p in per_tensor) + ")" for per_tensor in placements
            )
            warnings.warn(
                f"replicate_fallback: {op} has no sharding rule; running it on replicated inputs (placements: "
                f"{shown}) moves {moved} bytes per rank, and its result is replicated",
                ReplicateFallbackWarning,
                stacklevel=2,
            )
    return FALLBACK_RULE
