"""Phase 1 of the OpInfo sweep (see ``_opinfo_sweep``): the plan, made once, run on every backend.

For every selected OpInfo with float32 CPU support: its first few samples that ``DTensorConverter``
can turn into DTensors, the expected output (and, in backward mode, input gradients) computed with
plain torch on the full tensors, and a few sharding combinations per sample spread over the
converter's choices. Samples that draw random numbers are dropped; ops left with no sample say why.
Also the helpers the run shares with the plan (tensor copies, the backward mode's weighted loss).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import itertools
import math
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement, Replicate, Shard
from shardwise.testing._converter import DTensorConverter
from shardwise.testing._threaded import run_on_threads

__all__ = [
    "NOT_DIFFERENTIABLE_PREFIX",
    "OpInfoLike",
    "OpPlan",
    "PlacementsPerTensor",
    "PlannedCall",
    "PlannedSample",
    "SweepConfig",
    "SweepPlan",
    "load_op_db",
    "op_key",
    "plan_sweep",
]


# OpInfos whose output is uninitialised memory: only the shape and dtype mean anything.
_UNINITIALISED_OUTPUT_OPS = frozenset(
    {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"}
)
# Backward mode: the start of the reason an op is left out when plain torch itself gives no gradient.
NOT_DIFFERENTIABLE_PREFIX = "not differentiable: "


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """What the sweep runs. The defaults keep the whole sweep within a few minutes on 2 cores.

    ``op_patterns``: ``fnmatch`` patterns matched against the op key (``name`` or
    ``name.variant``); empty means every op. ``candidate_samples``: how many samples of an
    OpInfo are looked at to find ``samples_per_op`` convertible ones.
    """

    world_size: int = 4
    # The mesh the ranks form: (4,) by default, (2, 2) for the 2-D mode (nested and mixed shardings).
    mesh_shape: tuple[int, ...] = (4,)
    # Backward mode: each call also back-propagates a fixed weighting of its outputs and compares the
    # gradient of every input with plain torch's (ops plain torch cannot differentiate on any sample are left
    # out with a reason starting NOT_DIFFERENTIABLE_PREFIX).
    backward: bool = False
    samples_per_op: int = 4
    shardings_per_sample: int = 6
    candidate_samples: int = 24
    op_patterns: tuple[str, ...] = ()
    # Also shard dims the mesh does not divide (see _placement_choices).
    uneven_shardings: bool = True
    # How long a rank waits at the per-call barrier for the others before the world is declared
    # diverged (some rank stuck in a collective the others skipped).
    divergence_timeout_s: float = 5.0
    # How long no rank may finish a call before the world is torn down (all ranks stuck).
    stall_timeout_s: float = 60.0
    world_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("world_size", "samples_per_op", "shardings_per_sample", "candidate_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SweepConfig.{name} must be a positive int, got {value!r}")
        if math.prod(self.mesh_shape) != self.world_size or not all(size >= 1 for size in self.mesh_shape):
            raise ValueError(
                f"SweepConfig.mesh_shape {self.mesh_shape} must multiply to world_size ({self.world_size})"
            )
        if self.candidate_samples < self.samples_per_op:
            raise ValueError(
                f"SweepConfig.candidate_samples ({self.candidate_samples}) must be at least "
                f"samples_per_op ({self.samples_per_op})"
            )

    def selects(self, op_key: str) -> bool:
        return not self.op_patterns or any(fnmatch.fnmatchcase(op_key, pattern) for pattern in self.op_patterns)


PlacementsPerTensor = tuple[tuple[Placement, ...], ...]


@dataclasses.dataclass(frozen=True)
class PlannedCall:
    """One sample of an op with one sharding of its tensor arguments (in flattened arg order)."""

    sample_index: int
    sample_description: str
    placements: PlacementsPerTensor

    def describe(self) -> str:
        layout = ", ".join("(" + ", ".join(str(p) for p in per_tensor) + ")" for per_tensor in self.placements)
        return f"sample {self.sample_index} [{self.sample_description}] with placements [{layout}]"


@dataclasses.dataclass(frozen=True)
class PlannedSample:
    index: int
    description: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    expected: Any
    placements: tuple[PlacementsPerTensor, ...]


@dataclasses.dataclass(frozen=True)
class OpPlan:
    key: str
    call: Callable[..., Any]
    samples: tuple[PlannedSample, ...]
    metadata_only: bool
    # Why no sample was kept (the op is "skipped"); empty when samples were kept.
    skip_reason: str = ""

    def calls(self) -> Iterator[tuple[PlannedSample, PlacementsPerTensor]]:
        for sample in self.samples:
            for placements in sample.placements:
                yield sample, placements


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    config: SweepConfig
    ops: tuple[OpPlan, ...]
    # op key -> why it was left out before running (not counted as tried).
    excluded: dict[str, str]
    planning_s: float
    # CPU time of the whole process (every thread): on a loaded machine, wall time says little.
    planning_cpu_s: float

    @property
    def num_calls(self) -> int:
        return sum(1 for op in self.ops for _ in op.calls())


class OpInfoLike(Protocol):
    """What the sweep reads from an OpInfo (tests may pass their own objects)."""

    name: str
    variant_test_name: str

    @property
    def op(self) -> Callable[..., Any]: ...

    def supported_dtypes(self, device_type: str) -> Any: ...

    def sample_inputs(self, device: str, dtype: torch.dtype, requires_grad: bool = False) -> Any: ...


def load_op_db() -> list[Any]:
    """PyTorch's OpInfo database (needs the ``expecttest`` package, which torch's test utilities import)."""
    try:
        # Imported by name: mypy would otherwise analyse torch's 25k-line test module on every run.
        module = importlib.import_module("torch.testing._internal.common_methods_invocations")
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"the OpInfo sweep needs torch.testing._internal.common_methods_invocations, whose import failed "
            f"({error}); torch's test utilities need the `expecttest` package: pip install expecttest"
        ) from error
    op_db: list[Any] = list(module.op_db)
    return op_db


def op_key(opinfo: OpInfoLike) -> str:
    return f"{opinfo.name}.{opinfo.variant_test_name}" if opinfo.variant_test_name else opinfo.name


def plan_sweep(config: SweepConfig, opinfos: Sequence[OpInfoLike] | None = None) -> SweepPlan:
    """Choose the samples and shardings to run and compute their expected outputs (see module doc).

    ``opinfos`` defaults to PyTorch's ``op_db``. Planning runs on rank 0 of a thread world (the
    converter enumerates shardings for a real mesh); it issues no collectives.
    """
    started, started_cpu = time.perf_counter(), time.process_time()
    candidates = list(load_op_db() if opinfos is None else opinfos)
    selected = [opinfo for opinfo in candidates if config.selects(op_key(opinfo))]
    results = run_on_threads(
        _plan_on_rank, selected, config, world_size=config.world_size, timeout=config.world_timeout_s
    )
    planned = results[0]
    if planned is None:
        raise RuntimeError("planning rank 0 returned no plan")
    plans, excluded = planned
    return SweepPlan(
        config=config,
        ops=tuple(plans),
        excluded=excluded,
        planning_s=time.perf_counter() - started,
        planning_cpu_s=time.process_time() - started_cpu,
    )


def _build_mesh(mesh_shape: tuple[int, ...]) -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(math.prod(mesh_shape)).reshape(mesh_shape).tolist())


def _plan_on_rank(
    opinfos: list[OpInfoLike], config: SweepConfig
) -> tuple[list[OpPlan], dict[str, str]] | None:
    mesh = _build_mesh(config.mesh_shape)
    if dist.get_rank() != 0:
        return None
    plans: list[OpPlan] = []
    excluded: dict[str, str] = {}
    seen: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for opinfo in opinfos:
            key = op_key(opinfo)
            if key in seen:
                continue
            seen.add(key)
            plan_or_reason = _plan_op(opinfo, key, mesh, config)
            if isinstance(plan_or_reason, str):
                excluded[key] = plan_or_reason
            else:
                plans.append(plan_or_reason)
    return plans, excluded


def _clone_tensors(tree: Any) -> Any:
    """Fresh copies; a tensor requiring grad stays a leaf requiring grad (backward mode)."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.requires_grad), tree)


def _as_leaves(tree: Any) -> Any:
    # op_db builds some samples by computing on tensors that require grad: make every tensor a leaf.
    return tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), tree)


def _detached(tree: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.detach(), tree)


def _output_weights(output: torch.Tensor) -> torch.Tensor:
    """A fixed, uneven weighting of an output's elements (so that a gradient laid out wrongly differs)."""
    count = output.numel()
    return torch.cos(torch.arange(count, dtype=torch.float64) * 0.7 + 0.3).reshape(output.shape)


def _weighted_loss(outputs: list[torch.Tensor]) -> torch.Tensor | None:
    terms = [
        (out * _output_weights(out).to(out.dtype)).sum()
        for out in outputs
        if out.requires_grad and (out.dtype.is_floating_point or out.dtype.is_complex)
    ]
    if not terms:
        return None
    return torch.stack([term.real if term.is_complex() else term for term in terms]).sum()


class _NotDifferentiable(Exception):
    """Plain torch gives no gradient for this sample: no float output depends on an input requiring grad,
    or torch has no derivative formula for the op."""


def _backward_of(result: Any, inputs: Any) -> tuple[torch.Tensor | None, ...]:
    """Gradients of the weighted loss of ``result`` (plain tensors) for every input tensor requiring grad.

    Raises ``_NotDifferentiable`` when plain torch cannot differentiate the sample."""
    outputs = [leaf for leaf in tree_flatten(result)[0] if isinstance(leaf, torch.Tensor)]
    loss = _weighted_loss(outputs)
    leaves = [leaf for leaf in tree_flatten(inputs)[0] if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    if not leaves:
        raise _NotDifferentiable("no input requires grad")
    if loss is None:
        raise _NotDifferentiable("no float output requires grad (integer, bool or constant outputs)")
    try:
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    except (RuntimeError, NotImplementedError) as error:
        if "not implemented" in str(error) or "does not require grad" in str(error):
            raise _NotDifferentiable(f"torch has no derivative: {_first_line(str(error))[:160]}") from error
        raise
    return tuple(None if grad is None else grad.detach() for grad in grads)


def _op_seed(key: str) -> int:
    # Stable per op, so a filtered run draws the same samples as the full sweep.
    return zlib.crc32(key.encode())


def _plan_op(opinfo: OpInfoLike, key: str, mesh: DeviceMesh, config: SweepConfig) -> OpPlan | str:
    try:
        supports_float32 = torch.float32 in opinfo.supported_dtypes("cpu")
    except Exception as error:  # noqa: BLE001 - an OpInfo that cannot say is left out with the reason
        return f"supported_dtypes('cpu') raised {type(error).__name__}: {error}"
    if not supports_float32:
        return "no float32 support on CPU"
    call = opinfo.op
    metadata_only = opinfo.name in _UNINITIALISED_OUTPUT_OPS
    if config.backward and metadata_only:
        return f"{NOT_DIFFERENTIABLE_PREFIX}uninitialised output"
    torch.manual_seed(_op_seed(key))
    shardable: list[PlannedSample] = []
    replicate_only: list[PlannedSample] = []
    seen = 0
    unconvertible = 0
    failing_reference = 0
    # Backward mode: why plain torch gave no gradient for samples it ran (reason -> count). Whether an op
    # can be differentiated is measured on its samples, not read from OpInfo's supports_autograd flag.
    not_differentiable: dict[str, int] = {}
    random_ops: set[str] = set()
    try:
        samples = iter(opinfo.sample_inputs("cpu", torch.float32, requires_grad=config.backward))
        for index in range(config.candidate_samples):
            if len(shardable) >= config.samples_per_op:
                break
            try:
                sample = next(samples)
            except StopIteration:
                break
            seen += 1
            args = _as_leaves((sample.input, *sample.args))
            kwargs = _as_leaves(dict(sample.kwargs))
            converter = DTensorConverter(mesh, args, kwargs)
            if not _converts_every_tensor(converter):
                unconvertible += 1
                continue
            spy = _RandomOpSpy()
            try:
                with spy:
                    expected_args, expected_kwargs = _clone_tensors(args), _clone_tensors(kwargs)
                    expected = call(*expected_args, **expected_kwargs)
                    if config.backward:
                        grads = _backward_of(expected, (expected_args, expected_kwargs))
                        expected = (_detached(expected), grads)
            except _NotDifferentiable as why:
                not_differentiable[str(why)] = not_differentiable.get(str(why), 0) + 1
                continue
            except Exception:  # noqa: BLE001 - samples plain torch rejects are not DTensor's business
                failing_reference += 1
                continue
            if spy.random_ops and not metadata_only:
                # op_db runs its random ops under a fixed seed, but DTensor draws per shard:
                # the values are not comparable with plain torch's.
                random_ops.update(spy.random_ops)
                continue
            choices = [
                _placement_choices(converter, leaf, uneven=config.uneven_shardings)
                for leaf in _tensor_leaves(args, kwargs)
            ]
            planned = PlannedSample(
                index=index,
                description=_describe_sample(args, kwargs),
                args=args,
                kwargs=kwargs,
                expected=expected,
                placements=_pick_combinations(choices, config.shardings_per_sample),
            )
            (shardable if math.prod(len(c) for c in choices) > 1 else replicate_only).append(planned)
    except Exception as error:  # noqa: BLE001 - a broken sample generator leaves the op out, with the reason
        return f"sample_inputs('cpu', float32) raised {type(error).__name__}: {_first_line(str(error))}"
    kept = sorted((shardable + replicate_only)[: config.samples_per_op], key=lambda s: s.index)
    reason = ""
    if not kept and random_ops:
        return (
            f"every convertible sample among the first {seen} draws random numbers "
            f"({', '.join(sorted(random_ops))}): no single expected value to compare with"
        )
    if not kept and not_differentiable and not failing_reference:
        reasons = "; ".join(f"{why} ({count})" for why, count in sorted(not_differentiable.items()))
        return f"{NOT_DIFFERENTIABLE_PREFIX}every sample plain torch runs gives no gradient: {reasons}"
    if not kept:
        reason = (
            f"no convertible sample among the first {seen}: {unconvertible} with no tensor argument DTensor "
            f"can carry, {failing_reference} that plain torch rejects"
        )
    return OpPlan(key=key, call=call, samples=tuple(kept), metadata_only=metadata_only, skip_reason=reason)


def _tensor_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    leaves = tree_flatten(args)[0] + tree_flatten(kwargs)[0]
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _converts_every_tensor(converter: DTensorConverter) -> bool:
    tensors = _tensor_leaves(converter.args, converter.kwargs)
    return bool(tensors) and all(
        type(t) in (torch.Tensor, nn.Parameter) and converter.is_supported_tensor(t) for t in tensors
    )


def _placement_choices(
    converter: DTensorConverter, leaf: torch.Tensor, *, uneven: bool
) -> list[tuple[Placement, ...]]:
    """The converter's choices for ``leaf`` (even shards only), plus uneven ``Shard(d)`` when asked.

    OpInfo samples mostly have dims of 5 and 10, which a mesh of 4 does not divide: with even
    shards only, most calls would be fully replicated and test little. Uneven shards follow
    ``torch.chunk`` (trailing shards smaller or empty), which both DTensors support. 1-D meshes
    only; bool tensors stay replicated (as in the converter: c10d has no bool collectives).
    """
    even = converter.gen_placement_choices_for_arg(leaf)
    if not uneven or leaf.dtype == torch.bool or not converter.is_supported_tensor(leaf):
        return even
    ndim = converter.mesh.ndim
    extra: list[tuple[Placement, ...]] = []
    for dim, size in enumerate(leaf.shape):
        if size <= 1:
            continue
        if ndim == 1:
            extra.append((Shard(dim),))
        elif ndim == 2:
            # nested (both mesh dims cut the same dim, left to right) and one mesh dim left replicated
            extra += [(Shard(dim), Shard(dim)), (Replicate(), Shard(dim)), (Shard(dim), Replicate())]
    return even + [choice for choice in extra if choice not in even]


def _pick_combinations(choices: list[list[tuple[Placement, ...]]], limit: int) -> tuple[PlacementsPerTensor, ...]:
    """At most ``limit`` of the cartesian product of ``choices``, spread evenly over it.

    The first (everything replicated) and the last (every tensor on its last choice) are always
    in; the product is indexed, never materialised (a call with many tensors has a huge one).
    """
    total = math.prod(len(per_tensor) for per_tensor in choices)
    if total <= limit:
        return tuple(tuple(combo) for combo in itertools.product(*choices))
    if limit == 1:
        indices = [0]
    else:
        indices = sorted({round(i * (total - 1) / (limit - 1)) for i in range(limit)})
    return tuple(_combination_at(choices, index) for index in indices)


def _combination_at(choices: list[list[tuple[Placement, ...]]], index: int) -> PlacementsPerTensor:
    # itertools.product order: the last tensor varies fastest.
    picked: list[tuple[Placement, ...]] = []
    for per_tensor in reversed(choices):
        index, position = divmod(index, len(per_tensor))
        picked.append(per_tensor[position])
    return tuple(reversed(picked))


class _RandomOpSpy(TorchDispatchMode):
    """Records the aten ops tagged ``nondeterministic_seeded`` (they draw random numbers) that run inside."""

    def __init__(self) -> None:
        super().__init__()
        self.random_ops: set[str] = set()

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random_ops.add(str(func))
        return func(*args, **(kwargs or {}))


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe_value(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _describe_sample(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    parts = [_describe_value(arg) for arg in args]
    parts += [f"{name}={_describe_value(value)}" for name, value in kwargs.items()]
    return ", ".join(parts)


def _first_line(text: str) -> str:
    stripped = text.strip()
    return stripped.splitlines()[0] if stripped else ""
