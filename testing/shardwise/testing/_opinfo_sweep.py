"""The OpInfo sweep: PyTorch's ``op_db`` samples run on DTensors, each op classified by outcome.

Shared by ``dtensor_ops/tests/test_opinfo_sweep.py`` (the regression guard) and
``python -m shardwise.tools.opinfo_sweep`` (the report). Two phases:

1. **Plan** (``plan_sweep``): for every OpInfo with float32 CPU support, draw its CPU float32
   samples (no grad), keep the first few that ``DTensorConverter`` can turn into DTensors
   (preferring samples with at least one tensor it can shard), compute the expected output on the
   full tensors with plain torch, and pick a few of the converter's sharding combinations per
   sample. Samples that draw random numbers (their reference run calls an aten op tagged
   ``nondeterministic_seeded``) are dropped: op_db seeds them, but a DTensor draws per shard, so
   there is no single expected value; an op left with no sample for that reason is left out
   (e.g. ``bernoulli``), one with deterministic samples keeps those (e.g. ``dropout`` with
   ``training=False``). Ops whose output is uninitialised memory
   (``empty*``) are compared by shape and dtype only. The plan is plain data, made once, and the
   same for every backend, so two backends are compared on exactly the same calls.
2. **Run** (``run_sweep``): a world of rank threads (``run_on_threads``) runs every planned call
   with each tensor argument laid out as planned, gathers the outputs with ``full_tensor()`` and
   compares them with the expected ones. The backend (``SweepBackend``) says how to build the mesh,
   convert tensors and recognise a missing sharding rule: ``ShardwiseBackend`` here, PyTorch's
   DTensor in ``shardwise.tools.bench_opinfo_pytorch`` (PyTorch's DTensor may not be imported by
   this package).

Per call the ranks meet at a ``threading.Barrier`` after the call: a call that failed on some
ranks but not on others may leave ranks waiting in a collective that the others skipped; the
barrier's timeout detects that (a watchdog catches calls where no rank finishes at all), the
world is torn down (which wakes the waiting ranks), the op is an ``error`` (or ``wrong`` if a
rank saw a wrong result) and a new world resumes at the next op. Calls that fail the same way on
every rank (the usual case: sharding propagation raises before any collective) cost nothing extra.

Outcome of one op (worst over its calls): ``wrong`` (some output differs from plain torch: a
bug) > ``error`` (any other exception, or ranks that disagree or hang) > ``no_rule`` (the
backend's "no sharding rule" error) > ``pass``. ``skipped``: no sample could be converted.
Ops left out before running (random, no float32 on CPU, sample generation failed) are listed
with their reason and are not "tried".

Phase 1 lives in ``_opinfo_sweep_plan`` (its names stay importable from here); the backends, the run and
the report are here.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardwise.dtensor_ops import DTensor
from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement
from shardwise.testing._converter import DTensorConverter

# The plan's public names (and _pick_combinations, which the sweep's tests import) are importable from
# here, as before the plan had a module of its own.
from shardwise.testing._opinfo_sweep_plan import (
    NOT_DIFFERENTIABLE_PREFIX,
    OpInfoLike,
    OpPlan,
    PlacementsPerTensor,
    PlannedCall,
    PlannedSample,
    SweepConfig,
    SweepPlan,
    _build_mesh,
    _clone_tensors,
    _detached,
    _first_line,
    _pick_combinations,
    _weighted_loss,
    load_op_db,
    op_key,
    plan_sweep,
)
from shardwise.testing._rank_pool import MultiRankError
from shardwise.testing._threaded import run_on_threads

__all__ = [
    "NOT_DIFFERENTIABLE_PREFIX",
    "OUTCOMES",
    "TRIED_OUTCOMES",
    "CallOutcome",
    "ConverterLike",
    "OpPlan",
    "OpResult",
    "Outcome",
    "PlannedCall",
    "ShardwiseBackend",
    "SweepBackend",
    "SweepConfig",
    "SweepPlan",
    "SweepReport",
    "load_op_db",
    "plan_sweep",
    "run_sweep",
]

Outcome = Literal["pass", "wrong", "no_rule", "error", "skipped"]
# Worst first: an op's outcome is the worst outcome of its calls.
OUTCOMES: tuple[Outcome, ...] = ("wrong", "error", "no_rule", "pass", "skipped")
TRIED_OUTCOMES: tuple[Outcome, ...] = ("pass", "wrong", "no_rule", "error")
_SEVERITY: dict[str, int] = {outcome: len(OUTCOMES) - index for index, outcome in enumerate(OUTCOMES)}

_MESSAGE_LIMIT = 600


# ------------------------------------------------------------------------------- the backends


class ConverterLike(Protocol):
    """The part of ``DTensorConverter`` (ours or PyTorch's) that the run uses."""

    def to_dist_tensor(self, t: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor: ...

    def successful(self) -> bool: ...


class SweepBackend(Protocol):
    """A DTensor implementation the sweep can run on."""

    name: str

    def world_context(self) -> AbstractContextManager[object]:
        """Entered in the driver around each thread world (process-wide set-up the backend needs)."""
        ...

    def build_mesh(self, mesh_shape: tuple[int, ...]) -> Any:
        """Called on every rank thread: the mesh of ``mesh_shape`` over the whole world."""
        ...

    def new_converter(self, mesh: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ConverterLike: ...

    def placements(self, ours: tuple[Placement, ...]) -> Any:
        """``ours`` (one placement per mesh dim) as the backend's ``to_dist_tensor`` takes them."""
        ...

    def is_dtensor(self, value: object) -> bool: ...

    def full_tensor(self, value: Any) -> torch.Tensor: ...

    def missing_rule(self, error: BaseException) -> str | None:
        """The op named by ``error`` if it is the backend's "no sharding rule" error, else None."""
        ...


_SHARDWISE_NO_RULE_PREFIX = "shardwise has no sharding rule for "


class ShardwiseBackend:
    """shardwise's DTensor, converted by ``shardwise.testing.DTensorConverter``."""

    name = "shardwise"

    def world_context(self) -> AbstractContextManager[object]:
        return nullcontext()

    def build_mesh(self, mesh_shape: tuple[int, ...]) -> DeviceMesh:
        return _build_mesh(mesh_shape)

    def new_converter(self, mesh: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ConverterLike:
        return DTensorConverter(mesh, args, kwargs)

    def placements(self, ours: tuple[Placement, ...]) -> tuple[Placement, ...]:
        return ours

    def is_dtensor(self, value: object) -> bool:
        return isinstance(value, DTensor)

    def full_tensor(self, value: Any) -> torch.Tensor:
        full: torch.Tensor = value.full_tensor()
        return full

    def missing_rule(self, error: BaseException) -> str | None:
        message = str(error)
        if not isinstance(error, NotImplementedError) or not message.startswith(_SHARDWISE_NO_RULE_PREFIX):
            return None
        rest = message[len(_SHARDWISE_NO_RULE_PREFIX) :]
        return rest.split(" ", 1)[0].rstrip(":")


# ----------------------------------------------------------------------------------- the run


@dataclasses.dataclass(frozen=True)
class CallOutcome:
    outcome: Outcome
    message: str = ""
    missing_rule: str | None = None


@dataclasses.dataclass
class OpResult:
    key: str
    outcome: Outcome
    calls_run: int = 0
    calls_passed: int = 0
    # The first call with the op's outcome (not for pass): what failed and how.
    first_failure: str = ""
    # Every op named by a "no sharding rule" error, over all calls.
    missing_rules: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


@dataclasses.dataclass
class SweepReport:
    backend: str
    config: SweepConfig
    results: dict[str, OpResult]
    excluded: dict[str, str]
    planning_s: float
    planning_cpu_s: float
    running_s: float
    running_cpu_s: float
    worlds: int

    def ops_with(self, outcome: Outcome) -> list[str]:
        return sorted(key for key, result in self.results.items() if result.outcome == outcome)

    def counts(self) -> dict[str, int]:
        return {outcome: len(self.ops_with(outcome)) for outcome in OUTCOMES}

    @property
    def tried(self) -> int:
        return sum(1 for result in self.results.values() if result.outcome in TRIED_OUTCOMES)

    @property
    def passing(self) -> int:
        return len(self.ops_with("pass"))

    def summary_line(self) -> str:
        counts = self.counts()
        details = ", ".join(f"{counts[outcome]} {outcome}" for outcome in OUTCOMES)
        return (
            f"{self.backend}: {self.passing} ops passing out of {self.tried} tried ({details}; "
            f"{len(self.excluded)} left out)"
        )

    def missing_rule_counts(self) -> dict[str, int]:
        """aten op -> how many swept ops hit "no sharding rule" for it (most wanted first)."""
        counts: dict[str, int] = {}
        for result in self.results.values():
            for op in result.missing_rules:
                counts[op] = counts.get(op, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "config": dataclasses.asdict(self.config),
            "summary": {"passing": self.passing, "tried": self.tried, "counts": self.counts()},
            "planning_s": round(self.planning_s, 2),
            "planning_cpu_s": round(self.planning_cpu_s, 2),
            "running_s": round(self.running_s, 2),
            "running_cpu_s": round(self.running_cpu_s, 2),
            "worlds": self.worlds,
            "ops": {key: dataclasses.asdict(result) for key, result in sorted(self.results.items())},
            "excluded": dict(sorted(self.excluded.items())),
            "missing_rules": self.missing_rule_counts(),
        }


class _WrongResult(Exception):
    pass


class _RanksDiverged(RuntimeError):
    pass


@dataclasses.dataclass
class _WorldState:
    """What the rank threads of one world share with the driver."""

    world_size: int
    barrier: threading.Barrier
    # (op index, call index) -> rank -> outcome.
    outcomes: dict[tuple[int, int], dict[int, CallOutcome]] = dataclasses.field(default_factory=dict)
    # rank -> the call it is running (or last ran).
    position: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    seconds_per_op: dict[int, float] = dataclasses.field(default_factory=dict)
    last_progress: float = dataclasses.field(default_factory=time.monotonic)
    stalled: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def start(self, where: tuple[int, int], rank: int) -> None:
        with self.lock:
            self.position[rank] = where
            self.last_progress = time.monotonic()

    def record(self, where: tuple[int, int], rank: int, outcome: CallOutcome) -> None:
        with self.lock:
            self.outcomes.setdefault(where, {})[rank] = outcome
            self.last_progress = time.monotonic()


ProgressFn = Callable[[str], None]


def run_sweep(backend: SweepBackend, plan: SweepPlan, progress: ProgressFn | None = None) -> SweepReport:
    """Run every planned call on ``backend`` and classify each op (see the module doc).

    ``progress`` (e.g. a print to stderr) hears about every 50 ops and every torn-down world.
    """
    config = plan.config
    started, started_cpu = time.perf_counter(), time.process_time()
    state_log: list[_WorldState] = []
    start_op = 0
    diverged: dict[tuple[int, int], str] = {}
    while start_op < len(plan.ops):
        state = _WorldState(config.world_size, threading.Barrier(config.world_size))
        state_log.append(state)
        error = _run_world(backend, plan, start_op, state, progress)
        if error is None:
            break
        if not state.position:
            raise RuntimeError(f"the {backend.name} sweep world failed before running any call:\n{error}") from error
        stopped_at = max(state.position.values())
        diverged[stopped_at] = _describe_divergence(error, state, stopped_at, config)
        if progress is not None:
            progress(f"[{backend.name}] {plan.ops[stopped_at[0]].key}: {diverged[stopped_at]}")
        # The rest of a diverging op is not run: each further divergence would cost a timeout.
        start_op = stopped_at[0] + 1
    running_s = time.perf_counter() - started
    running_cpu_s = time.process_time() - started_cpu
    results = _classify(plan, state_log, diverged)
    return SweepReport(
        backend=backend.name,
        config=config,
        results=results,
        excluded=dict(plan.excluded),
        planning_s=plan.planning_s,
        planning_cpu_s=plan.planning_cpu_s,
        running_s=running_s,
        running_cpu_s=running_cpu_s,
        worlds=len(state_log),
    )


def _run_world(
    backend: SweepBackend, plan: SweepPlan, start_op: int, state: _WorldState, progress: ProgressFn | None
) -> MultiRankError | None:
    config = plan.config
    world_over = threading.Event()
    watchdog = threading.Thread(
        target=_abort_on_stall, args=(state, world_over, config.stall_timeout_s), name="opinfo-sweep-watchdog", daemon=True
    )
    with backend.world_context(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watchdog.start()
        try:
            run_on_threads(
                _run_on_rank,
                backend,
                plan,
                start_op,
                state,
                progress,
                world_size=config.world_size,
                timeout=config.world_timeout_s,
            )
        except MultiRankError as error:
            return error
        finally:
            world_over.set()
            watchdog.join()
    return None


def _abort_on_stall(state: _WorldState, world_over: threading.Event, stall_timeout_s: float) -> None:
    """Tear the world down when no rank has finished a call for ``stall_timeout_s``.

    The per-call barrier catches ranks that skipped a collective others wait in; this catches
    the rest (every rank stuck in a collective), which would otherwise last the world timeout.
    """
    from torch.testing._internal.distributed import multi_threaded_pg

    while not world_over.wait(0.5):
        if time.monotonic() - state.last_progress > stall_timeout_s:
            state.stalled = True
            state.barrier.abort()
            multi_threaded_pg.ProcessLocalGroup.exception_handle(TimeoutError("an OpInfo sweep call stalled"))
            return


def _describe_divergence(error: MultiRankError, state: _WorldState, where: tuple[int, int], config: SweepConfig) -> str:
    finished = state.outcomes.get(where, {})
    stuck = sorted(set(range(config.world_size)) - set(finished))
    if state.stalled:
        parts = [f"no rank finished the call within {config.stall_timeout_s:g} s: the world was torn down"]
    else:
        parts = [f"ranks disagreed and the world was torn down: ranks {stuck} did not finish the call"]
    for rank, outcome in sorted(finished.items()):
        detail = f": {outcome.message}" if outcome.message else ""
        parts.append(f"rank {rank} got {outcome.outcome}{detail}")
    raised = [
        f"rank {rank} raised {remote.headline()}"
        for rank, remote in sorted(error.errors.items())
        if "_RanksDiverged" not in remote.exception_type and "termination" not in remote.message
    ]
    return "; ".join(parts + raised)[:_MESSAGE_LIMIT]


_PROGRESS_EVERY_OPS = 50


def _run_on_rank(
    backend: SweepBackend, plan: SweepPlan, start_op: int, state: _WorldState, progress: ProgressFn | None
) -> None:
    mesh = backend.build_mesh(plan.config.mesh_shape)
    rank = dist.get_rank()
    for op_index in range(start_op, len(plan.ops)):
        op = plan.ops[op_index]
        op_started = time.perf_counter()
        for call_index, (sample, placements) in enumerate(op.calls()):
            where = (op_index, call_index)
            state.start(where, rank)
            outcome = _run_call(backend, mesh, op, sample, placements, plan.config.backward)
            state.record(where, rank, outcome)
            try:
                state.barrier.wait(timeout=plan.config.divergence_timeout_s)
            except threading.BrokenBarrierError:
                # Another rank is stuck in a collective this one skipped (or the reverse): only
                # tearing the world down frees it.
                raise _RanksDiverged(f"rank {rank}: the ranks diverged at {op.key} call {call_index}") from None
        if rank == 0:
            state.seconds_per_op[op_index] = time.perf_counter() - op_started
            if progress is not None and (op_index + 1) % _PROGRESS_EVERY_OPS == 0:
                progress(f"[{backend.name}] {op_index + 1}/{len(plan.ops)} ops")


def _dtensor_backward(backend: SweepBackend, gathered: Any, inputs: Any) -> tuple[torch.Tensor | None, ...]:
    """The same weighted loss on the gathered outputs (``full_tensor`` is differentiable), back-propagated
    into the DTensor inputs; their gradients gathered."""
    outputs = [leaf for leaf in tree_flatten(gathered)[0] if isinstance(leaf, torch.Tensor)]
    loss = _weighted_loss(outputs)
    leaves = [leaf for leaf in tree_flatten(inputs)[0] if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    if loss is None:
        raise RuntimeError("no output of the DTensor call requires grad, while plain torch's do")
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return tuple(
        None if grad is None else (backend.full_tensor(grad) if backend.is_dtensor(grad) else grad).detach()
        for grad in grads
    )


def _run_call(
    backend: SweepBackend,
    mesh: Any,
    op: OpPlan,
    sample: PlannedSample,
    placements: PlacementsPerTensor,
    mode_backward: bool = False,
) -> CallOutcome:
    try:
        args, kwargs = _clone_tensors(sample.args), _clone_tensors(sample.kwargs)
        converter = backend.new_converter(mesh, args, kwargs)
        flat_args, args_spec = tree_flatten(args)
        flat_kwargs, kwargs_spec = tree_flatten(kwargs)
        per_tensor = iter(placements)

        def convert(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            return converter.to_dist_tensor(leaf, mesh, backend.placements(next(per_tensor)))

        dist_args = tree_unflatten([convert(leaf) for leaf in flat_args], args_spec)
        dist_kwargs = tree_unflatten([convert(leaf) for leaf in flat_kwargs], kwargs_spec)
        if not converter.successful():
            return CallOutcome("skipped", f"{backend.name}'s converter passed a tensor through unconverted")
        actual = op.call(*dist_args, **dist_kwargs)
        gathered, plain_tensor_outputs = _gather(backend, actual)
        if mode_backward:
            gathered = (_detached(gathered), _dtensor_backward(backend, gathered, (dist_args, dist_kwargs)))
        problem = _mismatch(gathered, sample.expected, metadata_only=op.metadata_only)
        if problem is not None:
            raise _WrongResult(problem)
        if plain_tensor_outputs:
            return CallOutcome(
                "error", f"outputs {plain_tensor_outputs} are plain torch.Tensors where DTensors were expected"
            )
        return CallOutcome("pass")
    except _WrongResult as wrong:
        return CallOutcome("wrong", str(wrong)[:_MESSAGE_LIMIT])
    except Exception as error:  # noqa: BLE001 - every failure is classified and recorded
        missing = backend.missing_rule(error)
        text = f"{type(error).__name__}: {_first_line(str(error))}"[:_MESSAGE_LIMIT]
        return CallOutcome("no_rule" if missing else "error", text, missing)


def _gather(backend: SweepBackend, actual: Any) -> tuple[Any, list[int]]:
    """``actual`` with every DTensor replaced by its full tensor (same collectives on every rank)."""
    leaves, spec = tree_flatten(actual)
    plain_tensor_outputs: list[int] = []
    gathered: list[Any] = []
    for position, leaf in enumerate(leaves):
        if backend.is_dtensor(leaf):
            gathered.append(backend.full_tensor(leaf))
        else:
            if isinstance(leaf, torch.Tensor):
                plain_tensor_outputs.append(position)
            gathered.append(leaf)
    return tree_unflatten(gathered, spec), plain_tensor_outputs


def _mismatch(actual: Any, expected: Any, *, metadata_only: bool) -> str | None:
    """Why ``actual`` differs from ``expected`` (plain values), or None when they agree."""
    actual_leaves = tree_flatten(actual)[0]
    expected_leaves = tree_flatten(expected)[0]
    if len(actual_leaves) != len(expected_leaves):
        return f"the output has {len(actual_leaves)} values, plain torch returns {len(expected_leaves)}"
    for position, (got, want) in enumerate(zip(actual_leaves, expected_leaves)):
        where = f"output {position}" if len(expected_leaves) > 1 else "the output"
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                return f"{where} is a {type(got).__name__}, plain torch returns a tensor"
            if metadata_only:
                if got.shape != want.shape or got.dtype != want.dtype:
                    return f"{where} is {got.dtype}{list(got.shape)}, plain torch gives {want.dtype}{list(want.shape)}"
                continue
            try:
                torch.testing.assert_close(got, want, equal_nan=True, check_device=False, check_layout=False)
            except AssertionError as error:
                return f"{where}: {' '.join(str(error).split())}"
        elif isinstance(want, (bool, int, float, complex)) and isinstance(got, (bool, int, float, complex)):
            if type(got) is not type(want):
                return f"{where} is {got!r} ({type(got).__name__}), plain torch returns {want!r} ({type(want).__name__})"
            if isinstance(want, float) and math.isnan(want) and isinstance(got, float) and math.isnan(got):
                continue
            try:
                torch.testing.assert_close(got, want)
            except AssertionError:
                return f"{where} is {got!r}, plain torch returns {want!r}"
        elif got != want:
            return f"{where} is {got!r}, plain torch returns {want!r}"
    return None


def _merge(per_rank: dict[int, CallOutcome], world_size: int) -> CallOutcome:
    """One outcome for a call from every rank's: agreement, or the worst with who saw what."""
    outcomes = [per_rank[rank] for rank in sorted(per_rank)]
    if len({(o.outcome, o.message) for o in outcomes}) == 1 and len(outcomes) == world_size:
        return outcomes[0]
    worst = max(outcomes, key=lambda o: _SEVERITY[o.outcome])
    outcome: Outcome = worst.outcome if worst.outcome == "wrong" else "error"
    seen = "; ".join(f"rank {rank}: {o.outcome} {o.message}".strip() for rank, o in sorted(per_rank.items()))
    return CallOutcome(outcome, f"ranks disagree: {seen}"[:_MESSAGE_LIMIT], worst.missing_rule)


def _classify(
    plan: SweepPlan, worlds: list[_WorldState], diverged: dict[tuple[int, int], str]
) -> dict[str, OpResult]:
    merged: dict[tuple[int, int], CallOutcome] = {}
    seconds: dict[int, float] = {}
    for state in worlds:
        for where, per_rank in state.outcomes.items():
            merged[where] = _merge(per_rank, plan.config.world_size)
        for op_index, spent in state.seconds_per_op.items():
            seconds[op_index] = seconds.get(op_index, 0.0) + spent
    for where, description in diverged.items():
        recorded = merged.get(where)
        outcome: Outcome = "wrong" if recorded is not None and recorded.outcome == "wrong" else "error"
        merged[where] = CallOutcome(outcome, description)
    results: dict[str, OpResult] = {}
    for op_index, op in enumerate(plan.ops):
        result = OpResult(key=op.key, outcome="skipped", seconds=round(seconds.get(op_index, 0.0), 3))
        if not op.samples:
            result.first_failure = op.skip_reason
        missing: set[str] = set()
        first_call: dict[str, str] = {}
        for call_index, (sample, placements) in enumerate(op.calls()):
            call = merged.get((op_index, call_index))
            if call is None:
                continue
            if call.outcome != "skipped":
                result.calls_run += 1
            if call.outcome == "pass":
                result.calls_passed += 1
            if call.missing_rule:
                missing.add(call.missing_rule)
            described = PlannedCall(sample.index, sample.description, placements).describe()
            first_call.setdefault(call.outcome, f"{described}: {call.message}")
            if _SEVERITY[call.outcome] > _SEVERITY[result.outcome]:
                result.outcome = call.outcome
        if result.outcome != "pass" and result.outcome in first_call:
            result.first_failure = first_call[result.outcome]
        result.missing_rules = sorted(missing)
        results[op.key] = result
    return results
