"""Random numbers on DTensors: per-shard streams derived from generators that every rank keeps in step.

The engine's half of random ops (plans and execution); PyTorch's names for it (``OffsetBasedRNGTracker``,
``_rng_tracker``, ``_PhiloxState``) are at ``shardwise.dtensor_ops._random``, its public API
(``manual_seed``, ``is_rng_supported_mesh``) in ``shardwise.dtensor_ops.random``.

The contract (see the package README, "Random ops"):

* the values a random op produces are a function of the *shard* a rank holds:
  ranks that hold the same shard (they differ only along Replicate or Partial
  mesh dims) get identical values, ranks holding different shards (along Shard
  mesh dims) get different ones;
* every rank's generator advances by the same amount for the same op, whatever
  its shard size (uneven and empty shards included), so the ranks stay in step
  for the next op without any communication;
* the generators start in step because every rank seeds them alike
  (``torch.manual_seed(seed)`` or ``random.manual_seed``; the default seeds of a
  fresh process agree too).  Nothing checks it: a check would cost a collective
  per op.

How a sharded op gets its stream (values with no Shard mesh dim simply run the op
on the generator as it is, so they equal plain torch's values for the same seed).
The shard index is this rank's coordinate, row-major, over the mesh dims of size > 1
that cut the tensor, ``Shard`` or ``_StridedShard`` alike (FSDP over TP): a strided
piece is a fixed set of indices, disjoint from the other coordinates' pieces, so it
gets its own stream, the same on every run with the same seed (not the values a
replicated draw gives its elements: no layout gets those, see below).  A strided
mesh dim of size 1 cuts nothing, so FSDP x TP on one data-parallel rank draws TP's
values exactly.

* CUDA (Philox, counter based): the generator keeps its seed; shard ``k`` of
  ``n`` runs at offset ``start + k * stride`` and afterwards every rank sets the
  offset to ``start + n * stride``.  ``stride`` bounds what a kernel consumes for
  the largest shard, so the shards' counter ranges never overlap.
* CPU (mt19937, no offsets): one 32-bit value is drawn from the generator (the
  only advance, equal on every rank), the generator is seeded with a bijective
  mix of (that value, shard index) for the op and then restored.

Only ops whose sharding rule is marked as drawing random values (``ShardingRule.random``)
take this path; propagation plans it once per cached decision, so everything else pays
nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, TypeVar

import torch
from shardwise.mesh import _simulation as simulation
from shardwise.placement import DTensorSpec, Partial, Shard, _StridedShard, compute_local_shape

from ._caches import SHARED_CACHES
from ._decision import OpDecision, OutputSpecs, RandomPlan
from ._engine import ENGINE
from ._rules import RandomDraw, registered_ops, rule_for
from ._call_schema import schema_facts

__all__ = [
    "INSTALLED_RNG_TRACKER",
    "RandomPlan",
    "default_generator_for",
    "enter_shard_stream",
    "plan_random_draw",
    "random_draw_of",
    "is_random_op",
    "plan_for_spec",
    "plan_random_op",
    "random_ops",
    "run_in_shard_stream",
    "run_random_op",
    "set_traced_random_runner",
]

aten = torch.ops.aten
_T = TypeVar("_T")


class DistributeRegionSwitch(Protocol):
    """What the engine reads of a tracker installed as PyTorch's ``_random._rng_tracker``."""

    distribute_region_enabled: bool


@dataclass
class InstalledRngTracker:
    """The tracker a user installed (``shardwise.dtensor_ops._random._rng_tracker = ...``, PyTorch's handle), or
    None.  While it has ``distribute_region_enabled`` False, random ops on DTensors run on each rank's generator as
    it is, like plain local ops.  One object, process-wide: the compat module reads and writes its ``tracker``."""

    tracker: DistributeRegionSwitch | None = None


INSTALLED_RNG_TRACKER = InstalledRngTracker()
ENGINE.random_state = INSTALLED_RNG_TRACKER  # the engine owns it; this module keeps its name

_U32 = 1 << 32


def random_draw_of(op: torch._ops.OpOverload) -> RandomDraw:
    """How ``op`` draws random values, as its sharding rule says (``NONE`` for ops without a rule)."""
    rule = rule_for(op)
    return RandomDraw.NONE if rule is None else rule.random


def is_random_op(op: torch._ops.OpOverload) -> bool:
    return random_draw_of(op) is not RandomDraw.NONE


def random_ops() -> frozenset[torch._ops.OpOverload]:
    """Every registered op whose rule says it draws random values."""
    return frozenset(op for op in registered_ops() if is_random_op(op))


# --------------------------------------------------------------------------- plans


def _round_up_to_4(value: int) -> int:
    return (value + 3) // 4 * 4


def _offset_stride(spec: DTensorSpec[Any]) -> int:
    """Philox offsets that cover any kernel's consumption on the largest shard.

    CUDA's distribution kernels advance the offset by 4 per ``unroll`` elements a
    thread handles (``unroll`` is 4 for float, 2 for double), i.e. at most
    ``2 * numel + 4``; the first shard (coordinate 0 everywhere) is the largest
    under torch.chunk's layout. A margin of 16 keeps it safe for kernels that
    round up further.
    """
    meta = spec.tensor_meta
    if meta is None:
        raise ValueError(f"random ops need the output spec's tensor_meta, got {spec!r}")
    mesh = spec.mesh
    return _round_up_to_4(2 * _largest_shard_numel(tuple(meta.shape), tuple(mesh.shape), tuple(spec.placements))) + 16


# Beyond this many mesh coordinates a strided layout's stride is bounded by the whole tensor instead.
_MAX_COORDINATES_SCANNED = 4096


def _largest_shard_numel(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Any, ...]) -> int:
    """The element count of the largest local piece of ``shape`` laid out as ``placements``.

    Under torch.chunk cuts the piece at coordinate 0 is the largest; a ``_StridedShard``'s piece
    (one chunk of each of its split pieces) is not monotone in the extent it cuts, so with one the
    pieces are all measured (or, on a very large mesh, the whole tensor bounds them).
    """

    def numel(local_shape: Sequence[int]) -> int:
        count = 1
        for extent in local_shape:
            count *= extent
        return count

    if not any(isinstance(p, _StridedShard) for p in placements):
        return numel(compute_local_shape(shape, mesh_shape, (0,) * len(mesh_shape), placements))
    if numel(mesh_shape) > _MAX_COORDINATES_SCANNED:
        return numel(shape)
    return max(
        numel(compute_local_shape(shape, mesh_shape, coordinate, placements))
        for coordinate in itertools.product(*(range(size) for size in mesh_shape))
    )


def plan_for_spec(
    spec: DTensorSpec[Any], *, zeros_off_root_of_partial_sum: bool = False, generator_arg: int | str | None = None
) -> RandomPlan:
    """The plan for drawing a tensor laid out as ``spec`` on this rank.

    ``zeros_off_root_of_partial_sum``: the values are to be stored in ``spec``'s
    Partial(sum) layout (one rank per group holds them, the others zeros).

    Under torch's LocalTensorMode (every rank simulated here) the plan holds each simulated
    rank's plan in ``per_rank`` (see :func:`run_random_op`).
    """
    mesh = spec.mesh
    simulated = simulation.simulated_view()
    if isinstance(simulated, frozenset):
        plans = []
        for rank in sorted(simulated):
            with simulation.as_simulated_rank(rank):
                plans.append(
                    (rank, plan_for_spec(spec, zeros_off_root_of_partial_sum=zeros_off_root_of_partial_sum, generator_arg=generator_arg))
                )
        first = plans[0][1]
        if all(plan == first for _, plan in plans):
            return first
        return dataclasses.replace(first, per_rank=tuple(plans))
    coordinate = mesh.get_coordinate()
    shard_index = 0
    num_shards = 1
    holds_zeros = False
    for mesh_dim, placement in enumerate(spec.placements):
        size = mesh.shape[mesh_dim]
        # A _StridedShard mesh dim cuts the tensor like a Shard one (its pieces are disjoint index sets),
        # so its coordinate picks the stream as a Shard's does.
        if isinstance(placement, (Shard, _StridedShard)) and size > 1:
            num_shards *= size
            shard_index = shard_index * size + (coordinate[mesh_dim] if coordinate is not None else 0)
        elif (
            zeros_off_root_of_partial_sum
            and isinstance(placement, Partial)
            and placement.reduce_op == "sum"
            and coordinate is not None
            and coordinate[mesh_dim] != 0
        ):
            holds_zeros = True
    if num_shards == 1 or coordinate is None:
        return RandomPlan(None, 1, 0, holds_zeros, generator_arg)
    return RandomPlan(shard_index, num_shards, _offset_stride(spec), holds_zeros, generator_arg)


def _first_spec(value: Any) -> DTensorSpec[Any] | None:
    if isinstance(value, DTensorSpec):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_spec(item)
            if found is not None:
                return found
    return None


def plan_random_op(op: torch._ops.OpOverload, decision: OpDecision) -> RandomPlan | None:
    """The plan for ``op`` under ``decision``; None if ``op`` draws no random values."""
    return plan_random_draw(op, random_draw_of(op), decision.output_specs, decision.input_specs)


def plan_random_draw(
    op: torch._ops.OpOverload,
    draw: RandomDraw,
    output_specs: OutputSpecs,
    input_specs: Sequence[DTensorSpec[Any]],
) -> RandomPlan | None:
    """The plan for ``op`` drawing as ``draw`` says; None for ``RandomDraw.NONE``.

    The values are laid out like the op's first tensor output (for in-place ops:
    the written tensor).
    """
    if draw is RandomDraw.NONE:
        return None
    spec = _first_spec(output_specs)
    if spec is None:
        spec = _first_spec(tuple(input_specs))
    if spec is None:
        return None
    return plan_for_spec(
        spec,
        zeros_off_root_of_partial_sum=draw is RandomDraw.FILL_IGNORING_SELF,
        generator_arg=schema_facts(op).generator_argument,
    )


# --------------------------------------------------------------------------- execution


def default_generator_for(device: torch.device) -> torch.Generator | None:
    """The default generator random ops on ``device`` draw from; None for devices without one (meta)."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None


def _mix32(value: int) -> int:
    """A bijection on 32-bit ints that scatters nearby inputs (MurmurHash3's finaliser)."""
    value ^= value >> 16
    value = (value * 0x85EBCA6B) % _U32
    value ^= value >> 13
    value = (value * 0xC2B2AE35) % _U32
    value ^= value >> 16
    return value


def shard_seed(base: int, shard_index: int) -> int:
    """The mt19937 seed of one shard: distinct for distinct shard indices (below 2**32) of one ``base``.

    torch's CPU generator keeps only the low 32 bits of a seed, so distinctness is
    ensured in 32 bits: an odd multiple of the index plus ``base`` and then the
    finaliser are both bijections.
    """
    return _mix32((base + 0x9E3779B9 * (shard_index + 1)) % _U32)


# One reusable 0-dim tensor per device receives the draw: allocating it per op costs more than the draw.


def _draw_u32(generator: torch.Generator) -> int:
    device = generator.device
    carrier: torch.Tensor | None = SHARED_CACHES.draw_carriers.get(device)
    if carrier is None:
        carrier = torch.empty((), dtype=torch.int64, device=device)
        SHARED_CACHES.draw_carriers[device] = carrier
    carrier.random_(0, _U32, generator=generator)
    return int(carrier)


_warned_devices: set[str] = set()


def _warn_unsupported(device: torch.device) -> None:
    if device.type not in _warned_devices:
        _warned_devices.add(device.type)
        warnings.warn(
            f"shardwise random ops on {device.type!r} DTensors run on each rank's generator as it is: sharded "
            "values are not made distinct per shard (supported: 'cpu' and 'cuda')",
            UserWarning,
            stacklevel=4,
        )


def run_in_shard_stream(plan: RandomPlan, generator: torch.Generator, sample: Callable[[], _T]) -> _T:
    """Run ``sample`` (which draws from ``generator``) in this rank's shard stream of ``plan``.

    Afterwards ``generator`` has advanced by the same amount on every rank.
    """
    shard_index = plan.shard_index
    if shard_index is None:
        return sample()
    leave = enter_shard_stream(plan, shard_index, generator)
    try:
        return sample()
    finally:
        leave()


def enter_shard_stream(plan: RandomPlan, shard_index: int, generator: torch.Generator) -> Callable[[], None]:
    """Put ``generator`` in shard ``shard_index``'s stream; the returned function leaves it, in step on every rank."""
    if generator.device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a sharded DTensor random op cannot run under CUDA graph capture: its per-shard Philox offset is "
                "set on the host; run it outside the captured region (or on replicated values)"
            )
        start = generator.get_offset()
        generator.set_offset(start + shard_index * plan.cuda_offset_stride)
        end = start + plan.num_shards * plan.cuda_offset_stride

        def leave_cuda_stream() -> None:
            generator.set_offset(end)

        return leave_cuda_stream
    base = _draw_u32(generator)
    saved = generator.get_state()
    generator.manual_seed(shard_seed(base, shard_index))

    def leave_cpu_stream() -> None:
        generator.set_state(saved)

    return leave_cpu_stream


def _first_tensor_device(values: Sequence[Any]) -> torch.device | None:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, (list, tuple)):
            device = _first_tensor_device(value)
            if device is not None:
                return device
    return None


def _explicit_generator(plan: RandomPlan, args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Generator | None:
    where = plan.generator_arg
    if where is None:
        return None
    if isinstance(where, str):
        found = kwargs.get(where)
    else:
        found = args[where] if where < len(args) else kwargs.get("generator")
    return found if isinstance(found, torch.Generator) else None


def _zero_result(result: Any) -> None:
    if isinstance(result, torch.Tensor):
        with torch.no_grad():
            result.zero_()


# What runs a sharded random op whose local tensors are being traced (torch.compile): set by an extension
# (shardwise.compile_support) through ``set_traced_random_runner``.  A shard stream moves generator state on
# the host (draw, reseed, restore), which a graph cannot hold, so the runner puts the whole op into the graph
# as one opaque call that does exactly what eager does when the graph runs.
TracedRandomRunner = Callable[[RandomPlan, Callable[..., Any], list[Any], dict[str, Any]], Any]
_traced_random_runner: TracedRandomRunner | None = None


def set_traced_random_runner(runner: TracedRandomRunner | None) -> None:
    """Install (or remove, with None) the runner of sharded random ops on traced local tensors."""
    global _traced_random_runner
    _traced_random_runner = runner


def _is_traced(values: Sequence[Any]) -> bool:
    """Whether a local tensor argument is a tracing stand-in (fake or functional tensor), not a real one."""
    for value in values:
        if isinstance(value, torch.Tensor):
            return type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter)
    return False


def run_random_op(plan: RandomPlan, call: Callable[..., Any], local_args: list[Any], local_kwargs: dict[str, Any]) -> Any:
    """Dispatch's execution step for a random op: ``call`` on the local tensors in this rank's shard stream."""
    if plan.per_rank:
        return _run_random_op_per_simulated_rank(plan, call, local_args, local_kwargs)
    if plan.shard_index is None or (INSTALLED_RNG_TRACKER.tracker is not None and not INSTALLED_RNG_TRACKER.tracker.distribute_region_enabled):
        result = call(*local_args, **local_kwargs)
    elif _traced_random_runner is not None and _is_traced(local_args):
        result = _traced_random_runner(plan, call, local_args, local_kwargs)
    else:
        if isinstance(simulation.simulated_view(), frozenset):
            raise RuntimeError(
                "a sharded random op under LocalTensorMode got a decision made with the mode off (one rank's shard "
                "stream for every simulated rank); run every DTensor op of a simulated world under the mode"
            )
        generator = _explicit_generator(plan, local_args, local_kwargs)
        if generator is None:
            device = _first_tensor_device(local_args) or _first_tensor_device(list(local_kwargs.values()))
            generator = default_generator_for(device) if device is not None else None
            if generator is None:
                if device is not None and device.type != "meta":
                    _warn_unsupported(device)
                return call(*local_args, **local_kwargs)
        result = run_in_shard_stream(plan, generator, lambda: call(*local_args, **local_kwargs))
    if plan.holds_zeros:
        _zero_result(result)
    return result


def _run_random_op_per_simulated_rank(
    plan: RandomPlan, call: Callable[..., Any], local_args: list[Any], local_kwargs: dict[str, Any]
) -> Any:
    """``run_random_op`` once per simulated rank (torch's LocalTensorMode), each with its own plan.

    Real ranks keep their generators in step, so every simulated rank starts from the same
    generator state: replicas draw equal values and shards their own streams, as on real ranks.
    """
    if not isinstance(simulation.simulated_view(), frozenset):
        raise RuntimeError(
            "a random op got a decision made under LocalTensorMode (one shard stream per simulated rank) with the "
            "mode off; run every DTensor op of a simulated world under the mode"
        )
    plans = dict(plan.per_rank)
    with simulation.mode_disabled():
        generator = _explicit_generator(plan, local_args, local_kwargs)
        if generator is None:
            device = _first_tensor_device(local_args) or _first_tensor_device(list(local_kwargs.values()))
            generator = default_generator_for(device) if device is not None else None
        start = generator.get_state() if generator is not None else None

    def one_rank(args: list[Any], kwargs: dict[str, Any]) -> Any:
        rank = simulation.pinned_rank()
        assert rank is not None, "run_for_each_simulated_rank pins each rank"
        if generator is not None and start is not None:
            generator.set_state(start)
        rank_generator = _explicit_generator(plan, args, kwargs)
        if rank_generator is not None and start is not None:
            rank_generator.set_state(start)
        return run_random_op(plans[rank], call, args, kwargs)

    return simulation.run_for_each_simulated_rank(one_rank, list(local_args), dict(local_kwargs))
