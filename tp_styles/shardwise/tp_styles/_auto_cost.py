"""What one training step of a candidate plan costs per rank: time, bytes received, collectives, peak memory.

Communication is not modelled here: every place a plan lays a tensor out differently is stated as a layout
change (a tensor's spec before and after, on the planning mesh), and dtensor_ops prices it
(``shardwise.dtensor_ops._pricing``): the layouts ops produce come from the decisions dispatch takes for
them (the traced ops of a styled module, replayed on specs: a row-wise product's partial sum, a
vocabulary-cut lookup's masked partial, a class-dim reduction's partial max), and each change costs the
redistribution plan the planner makes for it at the calibrated cost model's prices. A redistribution's
gradient goes back to its source layout (Partial dims as Replicate), as dispatch's autograd does, and a
linear's input gradient takes the layout the engine decides for ``grad_output @ weight``. So a new rule
or planner step changes the price of a plan the way it changes the run.

Compute is the traced forward's FLOPs (three times, for forward and backward) over a ``ComputeProfile``'s
rate, plus a per-op dispatch cost that is much larger for an op on DTensors than for one on plain tensors:
on small models on CPU this term, not the FLOPs, separates plans. Memory is parameters, gradients and
optimizer state per rank, the forward's activations (every op output, an upper bound of what autograd
keeps) and the parameters FSDP holds unsharded.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import torch

from shardwise.dtensor_ops._pricing import NO_MOVEMENT, Movement, decide, gradient_placements, price_move, spec_of
from shardwise.placement import DTensorSpec, Placement, Replicate, Shard

from ._auto_trace import ModelTrace, TensorId, TracedOp

__all__ = ["ComputeProfile", "Estimate", "LayoutPricer", "Ledger", "default_compute_profile"]


@dataclasses.dataclass(frozen=True)
class ComputeProfile:
    """Compute rate and per-op dispatch costs of one rank (estimates; pass your own to ``auto_plan``)."""

    flops_per_second: float
    plain_op_seconds: float  # one aten op on plain tensors: dispatch and launch
    dtensor_op_seconds: float  # one op on DTensors (shardwise's dispatch, cached decision), on top of the kernel
    backward_ops_per_forward_op: float = 1.5


# CPU: 4 ranks sharing a 2-core machine, float64 (what the trainer runs here); CUDA: one H100 in bf16,
# kernel launches of ~5 us. DTensor dispatch: shardwise's cached path measured by bench_dispatch_overhead
# (a few us per op on a quiet core; several times that with four ranks on two cores).
_DEFAULT_PROFILES = {
    "cpu": ComputeProfile(flops_per_second=4e9, plain_op_seconds=4e-6, dtensor_op_seconds=40e-6),
    "cuda": ComputeProfile(flops_per_second=4e14, plain_op_seconds=6e-6, dtensor_op_seconds=30e-6),
}


def default_compute_profile(device_type: str) -> ComputeProfile:
    return _DEFAULT_PROFILES.get(device_type, _DEFAULT_PROFILES["cuda"])




@dataclasses.dataclass
class Estimate:
    """One candidate's step, per rank."""

    seconds: float = 0.0
    communication_seconds: float = 0.0
    compute_seconds: float = 0.0
    dispatch_seconds: float = 0.0
    bytes_received: float = 0.0
    collectives: int = 0
    optimizer_collectives: int = 0  # of ``collectives``: those after backward (gradient norm, partial gradients, cp sum)
    peak_memory_bytes: float = 0.0
    by_kind: dict[str, int] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        kinds = ", ".join(f"{kind} x{count}" for kind, count in sorted(self.by_kind.items()))
        return (
            f"{self.seconds * 1e3:.2f} ms (communication {self.communication_seconds * 1e3:.2f}, compute "
            f"{self.compute_seconds * 1e3:.2f}, dispatch {self.dispatch_seconds * 1e3:.2f}); {_human(self.bytes_received)} "
            f"received; {self.collectives} collectives ({kinds or 'none'}); peak memory {_human(self.peak_memory_bytes)}"
        )


def _human(nbytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


class Ledger:
    """Adds up one candidate's collectives, compute and memory into an :class:`Estimate`."""

    def __init__(self, mesh: Any, compute: ComputeProfile, profile: Any = None) -> None:
        self.mesh = mesh
        self.compute = compute
        self.profile = profile
        self.estimate = Estimate()
        self._memory = 0.0

    def move(self, movement: Movement, count: int = 1, *, optimizer: bool = False) -> None:
        """``count`` times the redistribution(s) ``movement`` prices (``LayoutPricer``)."""
        if count <= 0 or movement.collectives == 0 and movement.seconds == 0.0:
            return
        self.estimate.communication_seconds += count * movement.seconds
        self.estimate.bytes_received += count * movement.bytes_received
        self.estimate.collectives += count * movement.collectives
        if optimizer:
            self.estimate.optimizer_collectives += count * movement.collectives
        for kind in movement.kinds:
            self.estimate.by_kind[kind] = self.estimate.by_kind.get(kind, 0) + count

    def flops(self, forward_flops: float) -> None:
        self.estimate.compute_seconds += 3 * forward_flops / self.compute.flops_per_second

    def ops(self, forward_ops: int, *, on_dtensors: bool) -> None:
        per_op = self.compute.plain_op_seconds + (self.compute.dtensor_op_seconds if on_dtensors else 0.0)
        self.estimate.dispatch_seconds += forward_ops * (1 + self.compute.backward_ops_per_forward_op) * per_op

    def memory(self, nbytes: float) -> None:
        self._memory += nbytes

    def finish(self, extra_peak_bytes: float = 0.0) -> Estimate:
        estimate = self.estimate
        estimate.peak_memory_bytes = self._memory + extra_peak_bytes
        estimate.seconds = estimate.communication_seconds + estimate.compute_seconds + estimate.dispatch_seconds
        return estimate


class LayoutPricer:
    """Asks dtensor_ops, for one planning mesh, what layouts ops produce and what changing a layout costs.

    Specs are on the whole mesh: ``tp`` holds the layout in question, ``dp`` and ``cp`` cut the batch (dim 0)
    of activations (this rank's share of the data, as the data loader hands it out; context parallelism's
    sequence cut is priced by the same bytes) and hold parameters whole (FSDP's own layout is priced apart).
    """

    def __init__(self, mesh: Any, tp: int | None, dp: int | None, cp: int | None, trace: ModelTrace, profile: Any = None) -> None:
        self.mesh = mesh
        self.tp, self.dp, self.cp = tp, dp, cp
        self.trace = trace
        self.profile = profile
        self.undecided: list[str] = []  # ops of a replay the engine decided nothing for (see ``replay``)

    # -- specs
    def placements(self, on: dict[int | None, Placement]) -> tuple[Placement, ...]:
        return tuple(on.get(dim, Replicate()) for dim in range(self.mesh.ndim))

    def activation(self, tensor: TensorId, tp_placement: Placement) -> DTensorSpec[Any]:
        """A traced activation laid out ``tp_placement`` on tp, its batch cut over dp and cp."""
        shape = self.trace.shapes[tensor]
        return self.activation_of(shape, self.trace.dtypes[tensor], tp_placement, self.trace.strides.get(tensor))

    def activation_of(self, shape: Sequence[int], dtype: torch.dtype, tp_placement: Placement,
                      stride: Sequence[int] | None = None) -> DTensorSpec[Any]:
        on: dict[int | None, Placement] = {}
        if shape:
            on.update({dim: Shard(0) for dim in (self.dp, self.cp) if dim is not None})
        if self.tp is not None:
            on[self.tp] = tp_placement
        return spec_of(self.mesh, self.placements(on), shape, dtype, stride)

    def whole(self, tensor: TensorId, tp_placement: Placement = Replicate()) -> DTensorSpec[Any]:
        """A traced tensor that is not cut by the data (a parameter, a constant), laid out ``tp_placement`` on tp."""
        on: dict[int | None, Placement] = {} if self.tp is None else {self.tp: tp_placement}
        return spec_of(self.mesh, self.placements(on), self.trace.shapes[tensor], self.trace.dtypes[tensor],
                       self.trace.strides.get(tensor))

    def flat(self, numel: int, dtype: torch.dtype, on: dict[int | None, Placement]) -> DTensorSpec[Any]:
        """A flat tensor of ``numel`` elements (a gradient bucket, a parameter unit, a norm's partial sums)."""
        return spec_of(self.mesh, self.placements(on), (max(1, int(numel)),), dtype)

    def on_tp(self, spec: DTensorSpec[Any], placement: Placement) -> DTensorSpec[Any]:
        """``spec`` with its tp placement replaced."""
        placements = list(spec.placements)
        if self.tp is not None:
            placements[self.tp] = placement
        assert spec.tensor_meta is not None
        return spec_of(self.mesh, placements, spec.tensor_meta.shape, spec.tensor_meta.dtype, spec.tensor_meta.stride)

    def tp_placement(self, spec: DTensorSpec[Any]) -> Placement:
        return spec.placements[self.tp] if self.tp is not None else Replicate()

    # -- prices
    def move(self, src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> Movement:
        # Styles, FSDP and context parallelism each run on a one-dim sub-mesh, where no joint step exists.
        return price_move(src, dst, profile=self.profile, allow_joint_steps=False)

    def gradient_back(self, gradient: DTensorSpec[Any], source: DTensorSpec[Any]) -> Movement:
        """A redistribution's backward: its gradient, laid out ``gradient``, back to ``source``'s layout."""
        assert source.tensor_meta is not None
        target = spec_of(self.mesh, gradient_placements(source.placements), source.tensor_meta.shape,
                         source.tensor_meta.dtype, source.tensor_meta.stride)
        return self.move(gradient, target)

    def round_trip(self, src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> Movement:
        """Forward ``src -> dst``, and its gradient (laid out as ``dst``) back to ``src``'s layout."""
        return self.move(src, dst) + self.gradient_back(dst, src)

    def linear_input_gradient(self, output: DTensorSpec[Any], weight: DTensorSpec[Any], source: DTensorSpec[Any]) -> Movement:
        """A linear's input gradient (``grad_output @ weight``, its layout as the engine decides it, ``grad_output``
        laid out as the output) back to the layout its input came in (``source``)."""
        assert output.tensor_meta is not None and source.tensor_meta is not None and weight.tensor_meta is not None
        shape = output.tensor_meta.shape
        rows = 1
        for extent in shape[:-1]:
            rows *= int(extent)
        grad_2d = self.activation_of((rows, int(shape[-1])), output.tensor_meta.dtype, self._as_2d(self.tp_placement(output), len(shape)))
        weight_2d = weight if len(weight.tensor_meta.shape) == 2 else None
        if weight_2d is None:
            return NO_MOVEMENT
        product = decide(torch.ops.aten.mm.default, (grad_2d, weight_2d), {})
        moves = self._input_moves((grad_2d, weight_2d), product.input_specs)
        produced = product.output_specs
        assert isinstance(produced, DTensorSpec)
        produced_tp = self.tp_placement(produced)
        if isinstance(produced_tp, Shard) and produced_tp.dim == 1:  # the features of the 2-D view: the last dim
            produced_tp = Shard(len(source.tensor_meta.shape) - 1)
        gradient = self.on_tp(source, produced_tp)
        return moves + self.gradient_back(gradient, source)

    @staticmethod
    def _as_2d(placement: Placement, ndim: int) -> Placement:
        if isinstance(placement, Shard):
            dim = placement.dim % ndim
            return Shard(1) if dim == ndim - 1 else Shard(0)
        return placement

    def decided(self, op: Any, args: Sequence[object], kwargs: dict[str, object] | None = None) -> tuple[Any, Movement]:
        """The engine's decision for ``op`` on these specs, and the moves of its inputs it plans."""
        decision = decide(op, args, kwargs or {})
        given = [value for value in _flatten((tuple(args), tuple((kwargs or {}).values()))) if isinstance(value, DTensorSpec)]
        return decision, self._input_moves(given, decision.input_specs)

    def _input_moves(self, given: Sequence[DTensorSpec[Any]], wanted: Sequence[DTensorSpec[Any]]) -> Movement:
        total = NO_MOVEMENT
        for src, dst in zip(given, wanted):
            if src is not dst and src.placements != dst.placements:
                total = total + self.move(src, dst)
        return total

    def replay(self, ops: Sequence[TracedOp], specs: dict[TensorId, DTensorSpec[Any]]) -> Movement:
        """Replays traced ops on specs through the engine's decisions (as dispatch would run them on DTensors):
        ops reading a tensor in ``specs`` are decided, their outputs' specs added to ``specs``; returns the moves
        of inputs the decisions plan. Other tensors they read are replicated (implicit replication)."""
        total = NO_MOVEMENT
        for op in ops:
            if op.func.namespace != "aten" or not op.outputs or not any(tensor in specs for tensor in op.inputs):
                continue  # metadata queries (prim.device, ...) never reach a decision

            def value_of(tensor: TensorId) -> object:
                found = specs.get(tensor)
                return found if found is not None else self.whole(tensor)

            args, kwargs = op.call_arguments(value_of)
            try:
                decision, moves = self.decided(op.func, args, kwargs)
            except (NotImplementedError, RuntimeError, ValueError) as refused:
                # Decided by a handler at run time (it needs DTensors), or not at all: priced as moving nothing,
                # and what it produces is not followed further.
                self.undecided.append(f"{op.func}: {str(refused).splitlines()[0][:200]}")
                continue
            total = total + moves
            produced = decision.output_specs
            outputs = [produced] if isinstance(produced, DTensorSpec) else list(_flatten(produced or ()))
            for tensor, spec in zip(op.outputs, [value for value in outputs if isinstance(value, DTensorSpec)]):
                specs[tensor] = spec
        return total


def _flatten(value: object) -> Iterator[object]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)
    else:
        yield value
