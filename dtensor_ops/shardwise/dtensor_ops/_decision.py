"""The sharding decision for one (op, input specs, non-tensor arguments) combination: plain data.

Propagation computes an :class:`OpDecision` once on a cache miss; dispatch executes it on every
hit.  Besides what the sharding rule chose (output specs, target spec per input, local argument
overrides, a local kernel), a decision carries what dispatch derives from the op's schema and the
chosen output (how the result is returned, its global shape and stride, whether the op draws
random values and how), so that a cache hit does no analysis at all.  Nothing in it is a per-call
closure: a compiled fast path can hold and replay decisions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from shardwise.placement import DTensorSpec

from ._call_schema import schema_facts

__all__ = [
    "ArgPosition",
    "OpDecision",
    "OutputSpecs",
    "RandomPlan",
    "WRAP_INPLACE",
    "WRAP_NESTED",
    "WRAP_NONE",
    "WRAP_OUT",
    "WRAP_PASSTHROUGH",
    "WRAP_TENSOR",
]

# Where a DTensor sits among an op's arguments: positional index or keyword name.
ArgPosition = int | str

OutputSpecs = DTensorSpec[Any] | tuple[DTensorSpec[Any] | None, ...] | None

# How the local result becomes the op's result.
WRAP_TENSOR = 0  # one tensor output: a new DTensor with the output spec
WRAP_NESTED = 1  # tuple/list outputs (or a mix of tensors and non-tensors)
WRAP_PASSTHROUGH = 2  # non-tensor result (bool, number, ...): returned as is
WRAP_INPLACE = 3  # in-place op: the written DTensor itself
WRAP_OUT = 4  # out= op: the out DTensor(s)
WRAP_NONE = 5  # returns nothing (e.g. _foreach_add_)


@dataclass(frozen=True, slots=True)
class RandomPlan:
    """How this rank draws the values of one random op (see ``_shard_rng``).

    ``shard_index`` is None when the values are the same on every rank of the mesh
    (no Shard mesh dim of size > 1): the op then runs on the generator as it is.
    ``cuda_offset_stride`` is the Philox offset range reserved per shard.
    ``holds_zeros``: this rank's part of a Partial(sum) fill is zero.
    ``generator_arg``: where the op takes an explicit generator (position or keyword), if anywhere.
    ``per_rank``: under torch's LocalTensorMode (every rank simulated in one process), each simulated
    rank's own plan as ``(rank, plan)`` pairs; empty otherwise (the fields above are this rank's).
    """

    shard_index: int | None
    num_shards: int
    cuda_offset_stride: int
    holds_zeros: bool
    generator_arg: int | str | None
    per_rank: tuple[tuple[int, RandomPlan], ...] = ()


@dataclass(frozen=True, slots=True)
class OpDecision:
    """What dispatch does for one call.

    ``output_specs`` follows the op's output structure: one spec for a single
    tensor, a tuple for several (``None`` for a non-tensor entry), ``None`` when
    the op returns no tensor.  ``input_specs`` has the target spec of every DTensor
    argument in flattened argument order (positional arguments left to right,
    descending into lists, then keyword arguments in their order); it is the given
    spec object itself where nothing changes.  ``local_arg_overrides`` maps a
    positional index or keyword name to the value the local op takes instead of
    the global one (a view's local size).  ``local_kernel`` runs on the local
    tensors instead of the op (same arguments) where the shard-local computation is
    not the op itself (a lookup in a row-sharded table); it is plain data and never
    communicates.  ``random_plan``: the op draws random values, in this rank's shard
    stream.

    ``op`` (set by propagation, or by :meth:`for_op`) completes the decision with
    what dispatch derives from the schema: ``wrap_kind``, ``out_names``, ``written``,
    the single output's ``output_spec``/``output_shape``/``output_stride``, the
    ``call`` that runs locally and ``simple`` (nothing to move, override or draw:
    run and wrap one tensor).
    """

    output_specs: OutputSpecs
    input_specs: tuple[DTensorSpec[Any], ...]
    needs_redistribute: bool
    local_arg_overrides: tuple[tuple[ArgPosition, object], ...] = ()
    local_kernel: Callable[..., Any] | None = None
    random_plan: RandomPlan | None = None
    op: torch._ops.OpOverload | None = None
    # Derived from the above when op is given (see for_op); never compared.
    call: Callable[..., Any] | None = field(default=None, init=False, compare=False, repr=False)
    wrap_kind: int = field(default=WRAP_PASSTHROUGH, init=False, compare=False, repr=False)
    out_names: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    written: frozenset[int | str] = field(default=frozenset(), init=False, compare=False, repr=False)
    views_first_argument: bool = field(default=False, init=False, compare=False, repr=False)
    output_spec: DTensorSpec[Any] | None = field(default=None, init=False, compare=False, repr=False)
    output_shape: torch.Size | None = field(default=None, init=False, compare=False, repr=False)
    output_stride: tuple[int, ...] | None = field(default=None, init=False, compare=False, repr=False)
    simple: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        op = self.op
        if op is None:
            return
        facts = schema_facts(op)
        output_specs = self.output_specs
        set_field = object.__setattr__
        set_field(self, "call", getattr(op, "_op", op) if self.local_kernel is None else self.local_kernel)
        set_field(self, "out_names", facts.out_names)
        set_field(self, "written", facts.written)
        set_field(self, "views_first_argument", facts.returns_view_of_first_argument)
        if facts.out_names:
            wrap_kind = WRAP_OUT
        elif facts.returns_nothing:
            wrap_kind = WRAP_NONE
        elif facts.returns_written_first_argument:
            wrap_kind = WRAP_INPLACE
            if isinstance(output_specs, DTensorSpec):
                set_field(self, "output_spec", output_specs)
        elif isinstance(output_specs, DTensorSpec):
            wrap_kind = WRAP_TENSOR
            meta = output_specs.tensor_meta
            if meta is None:
                raise RuntimeError(f"{op}: the sharding rule returned an output spec without tensor_meta: {output_specs!r}")
            set_field(self, "output_spec", output_specs)
            set_field(self, "output_shape", meta.shape)
            set_field(self, "output_stride", meta.stride)
        elif output_specs is None:
            wrap_kind = WRAP_PASSTHROUGH
        else:
            wrap_kind = WRAP_NESTED
        set_field(self, "wrap_kind", wrap_kind)
        set_field(
            self,
            "simple",
            wrap_kind == WRAP_TENSOR
            and not self.needs_redistribute
            and not self.local_arg_overrides
            and self.random_plan is None,
        )

    def for_op(self, op: torch._ops.OpOverload) -> OpDecision:
        """This decision completed for ``op`` (itself when it already is)."""
        if self.op is op:
            return self
        return dataclasses.replace(self, op=op)
