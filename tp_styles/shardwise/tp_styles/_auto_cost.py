"""What one training step of a candidate plan costs per rank: time, bytes received, collectives, peak memory.

Communication is priced by shardwise's calibrated cost model (``alpha + bytes / beta`` per
collective and mesh dim, ``shardwise.dtensor_ops._cost_model.collective_time``), for exactly the
collectives shardwise's styles issue for the plan (listed per layer below and checked against
``CommDebugMode`` counts by the tests). Compute is the traced forward's FLOPs (three times, for
forward and backward) over a ``ComputeProfile``'s rate, plus a per-op dispatch cost that is much
larger for an op on DTensors than for one on plain tensors: on small models on CPU this term, not
the FLOPs, separates plans. Memory is parameters, gradients and optimizer state per rank, the
forward's activations (every op output, an upper bound of what autograd keeps) and the parameters
FSDP holds unsharded.

Collectives a step issues, per layer (``T`` tensor-parallel ranks, stream sequence-cut = SP):

=====================  ===============================================  ================================
layer                  forward                                          backward
=====================  ===============================================  ================================
region, no SP          all-reduce of the output                         all-reduce of the input's gradient
                                                                        (once per region input laid out
                                                                        at the parent, else per entry)
region, SP             all-gather of the input (same once/per entry),   reduce-scatter(s) of the input's
                       reduce-scatter of the output                     gradient, all-gather of the output's
embedding by vocab     all-reduce (SP: reduce-scatter)                  (SP: all-gather)
embedding by feature   all-gather (SP: all-to-all)                      (SP: all-to-all)
head by vocab          all-gather of the input under SP; gathered       reduce-scatter (SP) or all-reduce
                       logits: all-gather; loss parallel: 3 small       of the input's gradient
                       all-reduces
FSDP unit              all-gather of its parameters                     all-gather again if resharded after
                                                                        forward; reduce-scatter of gradients
context parallel       one all-gather of K and V per attention          one all-gather, two all-to-alls
optimizer              gradient clipping: one all-reduce per mesh dim the DTensor gradients are spread over (tp;
                       under FSDP dp and tp, and dp for the rest); the SP norms' partial gradients, batched in
                       one all-reduce (under FSDP: in backward, one per unit holding them); the gradients' sum
                       over cp
=====================  ===============================================  ================================

The optimizer row is what the demo trainer's step does (``reduce_partial_gradients``, ``clip_gradients``,
``sum_gradients_over``); ``Estimate.optimizer_collectives`` says how many of the count are there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardwise.dtensor_ops._cost_model import collective_time, received_bytes

__all__ = ["ComputeProfile", "Estimate", "Ledger", "default_compute_profile"]


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

    def collective(self, kind: str, full_bytes: float, mesh_dim: int | None, count: int = 1, *, optimizer: bool = False) -> None:
        """``count`` collectives of ``kind`` over ``mesh_dim`` on a tensor of ``full_bytes`` (the gathered tensor of
        an all-gather, the input of a reduce-scatter or all-reduce, one rank's tensor of an all-to-all)."""
        if mesh_dim is None or count <= 0:
            return
        size = int(self.mesh.shape[mesh_dim])
        if size <= 1:
            return
        received = received_bytes(kind, full_bytes, size)
        seconds = collective_time(kind, received, self.mesh, mesh_dim, profile=self.profile)
        self.estimate.communication_seconds += count * seconds
        self.estimate.bytes_received += count * received
        self.estimate.collectives += count
        if optimizer:
            self.estimate.optimizer_collectives += count
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
