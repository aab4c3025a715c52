"""dtensor_ops's configuration, read in one place: one options object, with environment overrides.

=====================  ================================  =======  ==============================================
option                 environment override              default  what it changes
=====================  ================================  =======  ==============================================
``gloo_all_to_all``    ``SHARDWISE_GLOO_ALL_TO_ALL=1``   off      redistribution runs each reduce-scatter and
                                                                  all-gather on a gloo group as one all-to-all
                                                                  (same bytes, lower latency on gloo; CommDebugMode
                                                                  then counts all-to-alls, not PyTorch's kinds)
``cost_profile``       ``SHARDWISE_COST_PROFILE=NAME``   None     the cost profile plans and strategies are priced
                                                                  by: a built-in name (``gloo-loopback``,
                                                                  ``nccl``, ...) or a JSON file written by
                                                                  ``shardwise.tools.calibrate``; None: the mesh
                                                                  backend's default (``shardwise.mesh``)
``replicate_fallback`` ``SHARDWISE_REPLICATE_FALLBACK=1`` off     an op without a sharding rule runs on replicated
                                                                  inputs instead of raising
                                                                  (``experimental.replicate_fallback``)
=====================  ================================  =======  ==============================================

:func:`current_options` answers what is in force: the options given to :func:`use_options`
(innermost ``with`` block of this thread) if any, else :data:`DEFAULT_OPTIONS` with the environment
overrides applied, read when asked (so a variable set before a redistribution is first planned
takes effect), then the process-wide changes of :func:`set_process_options` (an API's
``enable()``).  Readers ask when they compile or decide something they cache (a redistribution
program, a decision on a cache miss), never per op.  A change of the options decisions and
programs are made from (``cost_profile``, ``replicate_fallback``, ``gloo_all_to_all``), by any of
these ways, starts a new engine generation (``_engine``): the caches made under the old ones are
forgotten, so no caller has to clear them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from dataclasses import dataclass
from typing import Iterator, Mapping

from shardwise.mesh._cost_profile import COST_PROFILE_ENV_VAR, cost_profile_setting

from ._engine import ENGINE

__all__ = [
    "DEFAULT_OPTIONS",
    "ENVIRONMENT_OVERRIDES",
    "Options",
    "current_options",
    "set_process_options",
    "use_options",
]


# Text options with a fixed set of values (the first is the default).
_CHOICES: Mapping[str, tuple[str, ...]] = {}


@dataclass(frozen=True)
class Options:
    """Process-level switches of dtensor_ops (see the module docstring for each)."""

    gloo_all_to_all: bool = False
    cost_profile: str | None = None
    replicate_fallback: bool = False

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"option {name}={getattr(self, name)!r}: expected one of {list(choices)}")


DEFAULT_OPTIONS = Options()

# option name -> the environment variable that overrides it (switches: "1" on, "0" or unset the
# default; text options: the value as given).
ENVIRONMENT_OVERRIDES: Mapping[str, str] = {
    "gloo_all_to_all": "SHARDWISE_GLOO_ALL_TO_ALL",
    "cost_profile": COST_PROFILE_ENV_VAR,
    "replicate_fallback": "SHARDWISE_REPLICATE_FALLBACK",
}

_TEXT_OPTIONS = frozenset({"cost_profile"})

_scoped = threading.local()
# Process-wide changes (set_process_options), as sorted (name, value) pairs: part of the memo key below.
_process_changes: tuple[tuple[str, object], ...] = ()
_process_lock = threading.Lock()


# The options cached decisions and redistribution programs are made from (the cost profile prices strategies and
# plans; the fallback decides ops without a rule; gloo_all_to_all shapes programs): every option.
_DECISION_INPUTS: tuple[str, ...] = ("cost_profile", "replicate_fallback", "gloo_all_to_all")
# The process-level options last answered (environment + set_process_options), to notice a change.
_last_process_options: list[Options | None] = [None]


def _made_from(options: Options) -> tuple[object, ...]:
    return tuple(getattr(options, name) for name in _DECISION_INPUTS)


def _notice(before: Options | None, after: Options) -> None:
    """A new engine generation when ``after`` changes what decisions are made from (see ``_engine``)."""
    if before is not None and before is not after and _made_from(before) != _made_from(after):
        ENGINE.changed("options")


def _from_environment(environ: Mapping[str, str]) -> Options:
    values = tuple(
        cost_profile_setting(environ) if name == "cost_profile" else environ.get(variable)  # mesh reads that one
        for name, variable in ENVIRONMENT_OVERRIDES.items()
    )
    options = _from_values(values, _process_changes)
    before = _last_process_options[0]
    if options is not before:  # memoised: the same values give the same object
        _last_process_options[0] = options
        _notice(before, options)
    return options


@functools.lru_cache(maxsize=16)
def _from_values(values: tuple[str | None, ...], process_changes: tuple[tuple[str, object], ...] = ()) -> Options:
    """The options the override variables' values (in ``ENVIRONMENT_OVERRIDES`` order) give, then the
    process-wide changes; memoised, since the planner asks on every lookup and the values rarely change."""
    changes: dict[str, object] = {}
    for (name, variable), value in zip(ENVIRONMENT_OVERRIDES.items(), values):
        if value is None or value.strip() == "":
            continue
        if name in _TEXT_OPTIONS:
            text = value.strip()  # a built-in name or a file path (a path keeps its case)
            choices = _CHOICES.get(name)
            if choices is not None and text not in choices:
                expected = " or ".join(repr(choice) for choice in choices)
                raise ValueError(f"{variable}={value!r}: expected {expected} (unset means {choices[0]!r})")
            changes[name] = text
            continue
        if value.strip() not in ("0", "1"):
            raise ValueError(f"{variable}={value!r}: expected 1 (on) or 0 (off) for option {name!r}")
        changes[name] = value.strip() == "1"
    changes.update(process_changes)
    return dataclasses.replace(DEFAULT_OPTIONS, **changes)  # type: ignore[arg-type]


def set_process_options(**changes: object) -> Options:
    """Change options for the whole process, every thread, until changed back (over the environment's).

    ``use_options`` blocks still win inside them. Returns the options now in force outside such blocks.
    """
    global _process_changes
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Options)})
    if unknown:
        raise TypeError(f"set_process_options: unknown options {unknown}; known: {[f.name for f in dataclasses.fields(Options)]}")
    with _process_lock:
        merged = dict(_process_changes)
        merged.update(changes)
        _process_changes = tuple(sorted(merged.items()))
    return _from_environment(os.environ)


def current_options() -> Options:
    """The options in force on this thread (see the module docstring)."""
    stack: list[Options] | None = getattr(_scoped, "stack", None)
    if stack:
        return stack[-1]
    return _from_environment(os.environ)


@contextlib.contextmanager
def use_options(options: Options | None = None, **changes: object) -> Iterator[Options]:
    """Run the block with ``options`` (or the current ones with ``changes``) in force on this thread.

    Entering and leaving start a new engine generation when the options decisions and programs are
    made from change (``_engine``): nothing cached under other options is reused.
    """
    before = current_options()
    chosen = dataclasses.replace(options or before, **changes)  # type: ignore[arg-type]
    stack: list[Options] | None = getattr(_scoped, "stack", None)
    if stack is None:
        stack = _scoped.stack = []
    _notice(before, chosen)
    stack.append(chosen)
    try:
        yield chosen
    finally:
        stack.pop()
        _notice(chosen, current_options())
