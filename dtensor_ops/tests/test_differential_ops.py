"""Differential test of ops from PyTorch's OpInfo database on random input layouts, forward and backward.

Hypothesis draws an op (a fixed list across op families), a dtype it supports on CPU, one of its first
OpInfo samples, a mesh, and a layout for every tensor argument (Shard with negative dims, Replicate, and
in forward-only draws Partial), runs it on shardwise's DTensors with every rank simulated
(LocalTensorMode), and compares with plain torch on the whole tensors: each output's values, dtype and
shape; its global stride with PyTorch's DTensor where that runs the same case; and for floating dtypes
the input gradients of a weighted sum of the outputs. A refusal must be a clear error
(``differential_helpers.REFUSAL_TYPES`` with a message). The run is bounded in seconds
(``SHARDWISE_DIFFERENTIAL_SECONDS`` for a longer one).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import random
from collections import Counter
from typing import Any, Callable, cast

import torch
import torch.distributed.tensor as torch_dtensor
from differential_helpers import (
    REFUSAL_TYPES,
    SimulatedWorld,
    assert_same_tensor,
    attempt,
    describe_placements,
    pieces_of,
    random_values,
    run_for_budget,
    simulated_world,
    to_torch_placement,
)
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, distribute_tensor
from shardwise.mesh._simulation import mode_disabled
from shardwise.placement import Placement, _StridedShard

CI_SECONDS = 12.0

# One or more ops per family: pointwise (unary, binary, ternary, comparisons), reductions, matmuls,
# views and shapes, concatenation, indexing, normalisation, scans.
OP_NAMES: tuple[str, ...] = (
    "add", "mul", "sub", "div", "neg", "abs", "exp", "sin", "clamp", "where", "eq", "maximum",
    "logical_and", "bitwise_xor",
    "sum", "mean", "amax", "prod", "argmax", "var", "norm",
    "mm", "bmm", "matmul", "addmm", "nn.functional.linear",
    "t", "transpose", "permute", "reshape", "flatten", "unsqueeze", "squeeze", "expand", "view",
    "cat", "stack", "split", "chunk",
    "index_select", "gather", "narrow", "select",
    "softmax", "nn.functional.layer_norm", "cumsum", "tril",
)  # fmt: skip

MESH_SHAPES: tuple[tuple[int, ...], ...] = ((1,), (2,), (3,), (4,), (8,), (2, 2), (3, 2), (2, 1, 2), (2, 2, 2))
OP_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
    torch.float64, torch.complex64,
)  # fmt: skip
SAMPLES_PER_OP = 4


@functools.cache
def _opinfos() -> dict[str, Any]:
    module = importlib.import_module("torch.testing._internal.common_methods_invocations")
    by_name = {}
    for opinfo in module.op_db:
        if opinfo.name in OP_NAMES and not opinfo.variant_test_name and opinfo.name not in by_name:
            by_name[opinfo.name] = opinfo
    return by_name


@functools.cache
def _dtypes_of(name: str) -> tuple[torch.dtype, ...]:
    supported = _opinfos()[name].supported_dtypes("cpu")
    return tuple(dtype for dtype in OP_DTYPES if dtype in supported)


@functools.cache
def _samples(name: str, dtype: torch.dtype) -> tuple[Any, ...]:
    """The op's first OpInfo samples for ``dtype`` (made once, from a fixed seed).

    Asked while hypothesis draws a case, so Python's ``random`` state is put back afterwards (hypothesis
    requires strategies to leave it alone; some sample generators use it).
    """
    python_random_state = random.getstate()
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            random.seed(0)
            samples = []
            for sample in _opinfos()[name].sample_inputs("cpu", dtype, requires_grad=False):
                samples.append(sample)
                if len(samples) == SAMPLES_PER_OP:
                    break
    finally:
        random.setstate(python_random_state)
    return tuple(samples)


@dataclasses.dataclass(frozen=True)
class OpCase:
    name: str
    dtype: torch.dtype
    sample_index: int
    mesh_shape: tuple[int, ...]
    layouts: tuple[tuple[Placement, ...], ...]  # one per tensor argument, in pytree order
    backward: bool

    def __str__(self) -> str:
        layouts = ", ".join(describe_placements(layout) for layout in self.layouts)
        direction = "forward and backward" if self.backward else "forward"
        return f"{self.name} ({self.dtype}, sample {self.sample_index}) on mesh {self.mesh_shape}, inputs {layouts}: {direction}"


def _flat_call(sample: Any) -> tuple[list[Any], Any]:
    return tree_flatten((sample.input, sample.args, sample.kwargs))


def _tensor_indices(leaves: list[Any]) -> list[int]:
    return [index for index, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]


@st.composite
def _layout_for(draw: st.DrawFn, tensor: torch.Tensor, mesh_shape: tuple[int, ...], allow_partial: bool) -> tuple[Placement, ...]:
    choices: list[Placement] = [Replicate()]
    if tensor.dim() > 0:
        choices += [Shard(dim) for dim in range(-tensor.dim(), tensor.dim())]
        choices.append(_StridedShard(draw(st.integers(0, tensor.dim() - 1)), split_factor=2))
    # Not for half types: making a Partial input splits each value into n parts in its dtype (as PyTorch's),
    # an error of the input's magnitude that a difference like x - y leaves larger than the output's tolerance.
    if allow_partial and tensor.dtype in (torch.float32, torch.float64, torch.complex64, torch.complex128):
        choices += [Partial("sum"), Partial("avg")]
        if not tensor.dtype.is_complex:
            choices += [Partial("max"), Partial("min")]
    return tuple(draw(st.sampled_from(choices)) for _ in mesh_shape)


@st.composite
def op_cases(draw: st.DrawFn) -> OpCase:
    name = draw(st.sampled_from(tuple(sorted(_opinfos()))))
    dtypes = _dtypes_of(name)
    dtype = draw(st.sampled_from(dtypes)) if dtypes else torch.float32
    samples = _samples(name, dtype)
    if not samples:
        return OpCase(name, dtype, -1, (1,), (), False)
    sample_index = draw(st.integers(0, len(samples) - 1))
    leaves, _ = _flat_call(samples[sample_index])
    mesh_shape = draw(st.sampled_from(MESH_SHAPES))
    differentiable = bool(_opinfos()[name].supports_autograd) and dtype in (torch.float32, torch.float64)
    backward = differentiable and draw(st.booleans())
    layouts = tuple(
        draw(_layout_for(leaves[index], mesh_shape, allow_partial=not backward)) for index in _tensor_indices(leaves)
    )
    return OpCase(name, dtype, sample_index, mesh_shape, layouts, backward)


def _plain_result(case: OpCase) -> tuple[Any, list[torch.Tensor | None]]:
    """Plain torch's outputs and, for a backward case, the input gradients of the weighted loss."""
    opinfo = _opinfos()[case.name]
    leaves, spec = _flat_call(_samples(case.name, case.dtype)[case.sample_index])
    leaves = [leaf.detach().clone().requires_grad_(case.backward) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    value, args, kwargs = tree_unflatten(leaves, spec)
    outputs = opinfo.op(value, *args, **kwargs)
    gradients: list[torch.Tensor | None] = []
    if case.backward:
        loss = _weighted_loss(outputs, lambda tensor: tensor)
        if loss is not None:
            loss.backward()
        gradients = [leaves[index].grad for index in _tensor_indices(leaves)]
    return outputs, gradients


def _weighted_loss(outputs: Any, whole: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """Sum of each differentiable output times fixed weights (the same on both sides)."""
    flat, _ = tree_flatten(outputs)
    loss: torch.Tensor | None = None
    for position, output in enumerate(flat):
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            continue
        with mode_disabled():  # one set of weights: under LocalTensorMode each rank would draw its own
            weights = random_values(tuple(output.shape), output.dtype, torch.Generator().manual_seed(position))
        term = (whole(output) * weights).sum()
        loss = term if loss is None else loss + term
    return loss


def _distributed_call(
    case: OpCase, mesh: Any, placements_of: Callable[[tuple[Placement, ...]], Any], distribute: Callable[..., Any]
) -> tuple[Any, list[Any]]:
    leaves, spec = _flat_call(_samples(case.name, case.dtype)[case.sample_index])
    inputs = []
    for index, layout in zip(_tensor_indices(leaves), case.layouts):
        source = leaves[index].detach().clone().requires_grad_(case.backward)
        leaves[index] = distribute(source, mesh, placements_of(layout))
        inputs.append(leaves[index])
    value, args, kwargs = tree_unflatten(leaves, spec)
    return _opinfos()[case.name].op(value, *args, **kwargs), inputs


def _compare_outputs(case: OpCase, ours: Any, theirs: Any | None, expected: Any, world_size: int) -> None:
    ours_flat, ours_spec = tree_flatten(ours)
    expected_flat, expected_spec = tree_flatten(expected)
    assert ours_spec == expected_spec, f"{case}: output structure {ours_spec}, expected {expected_spec}"
    theirs_flat = tree_flatten(theirs)[0] if theirs is not None else [None] * len(ours_flat)
    for position, (actual, want, oracle) in enumerate(zip(ours_flat, expected_flat, theirs_flat)):
        what = f"{case}: output {position}"
        if not isinstance(want, torch.Tensor):
            assert not isinstance(actual, torch.Tensor) and actual == want, f"{what}: {actual!r}, expected {want!r}"
            continue
        assert isinstance(actual, DTensor), f"{what}: {type(actual).__name__}, expected a DTensor"
        assert actual.dtype == want.dtype and tuple(actual.shape) == tuple(want.shape), (
            f"{what}: {actual.dtype} {tuple(actual.shape)}, expected {want.dtype} {tuple(want.shape)}"
        )
        # PyTorch's DTensor as the stride oracle only where its own metadata is right: for matmul of a vector
        # by a matrix it reports stride (5, 1) for a result of shape (5,).
        if isinstance(oracle, torch_dtensor.DTensor) and oracle.shape == want.shape and len(oracle.stride()) == want.dim():
            assert actual.stride() == oracle.stride(), f"{what}: stride {actual.stride()}, PyTorch's DTensor {oracle.stride()}"
        for rank, piece in pieces_of(actual.full_tensor(), world_size).items():
            assert_same_tensor(piece, want, f"{what}, simulated rank {rank}")


def check_op_case(world: SimulatedWorld, case: OpCase) -> str:
    if case.sample_index < 0:
        return "no sample"
    mesh, torch_mesh = world.meshes(case.mesh_shape)
    world_size = math.prod(case.mesh_shape)
    expected = attempt(lambda: _plain_result(case))
    if not expected.ran:
        return "plain torch raises"
    outputs, gradients = expected.value
    with world.mode():
        ours = attempt(lambda: _distributed_call(case, mesh, list, distribute_tensor))
        if not ours.ran:
            assert isinstance(ours.error, REFUSAL_TYPES) and str(ours.error).strip(), (
                f"{case}: not a clear refusal but {type(ours.error).__name__}: {ours.error}"
            )
            return f"refused: {type(ours.error).__name__}"
        theirs = attempt(
            lambda: _distributed_call(
                case, torch_mesh, lambda layout: [to_torch_placement(p) for p in layout], torch_dtensor.distribute_tensor
            )[0]
        )
        _compare_outputs(case, ours.value[0], theirs.value if theirs.ran else None, outputs, world_size)
        if case.backward:
            loss = _weighted_loss(ours.value[0], lambda output: cast(DTensor, output).full_tensor())
            if loss is None:
                return "ok"
            loss.backward()
            for position, (dtensor, want) in enumerate(zip(ours.value[1], gradients)):
                what = f"{case}: gradient of input {position}"
                if want is None:
                    continue
                assert dtensor.grad is not None, f"{what}: none, expected one"
                for rank, piece in pieces_of(dtensor.grad.full_tensor(), world_size).items():
                    assert_same_tensor(piece, want, f"{what}, simulated rank {rank}")
    return "ok"


def test_opinfo_ops_match_plain_torch_on_random_layouts() -> None:
    outcomes: Counter[str] = Counter()
    # Loaded before hypothesis runs: importing torch's test utilities registers hypothesis settings profiles,
    # which hypothesis deprecates inside a running test.
    _opinfos()
    with simulated_world() as world:

        def make_property(out_of_time: Callable[[], bool]) -> Callable[..., None]:
            @given(op_cases())
            def op_matches(case: OpCase) -> None:
                if out_of_time():
                    return
                outcomes[check_op_case(world, case)] += 1

            return op_matches

        run_for_budget(make_property, CI_SECONDS)
    assert outcomes["ok"] > sum(outcomes.values()) // 2, dict(outcomes)
