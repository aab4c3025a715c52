"""Forward-and-backward sweeps of one op over input layouts, for test_ops_views*.py and test_ops_indexing*.py.

``sweep(mesh, fn, inputs)`` runs ``fn`` on plain tensors (the oracle) and then on
DTensors for every layout of its inputs: first every even sharding that
``DTensorConverter`` yields, then the layouts it leaves out (uneven shards and
``Partial(sum)`` inputs, built with ``DTensor.from_local`` from random parts that
reduce to the input).  For each layout the outputs must equal the oracle after
``full_tensor()``, with the global shape and stride torch gives and a local
shape matching the output spec; then a fixed random gradient is sent back
through the outputs (laid out like them) and the gradient of every floating
input must equal the oracle's.  Runs on every rank (thread or process); every
rank builds the same values from fixed seeds.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

from shardwise.dtensor_ops import DTensor, DeviceMesh, Partial, Placement, Replicate, Shard, distribute_tensor
from shardwise.placement import select_local_shard
from shardwise.testing import DTensorConverter

__all__ = ["Layout", "as_dtensor", "check_layout", "layouts_beyond_converter", "sample", "sweep"]

# Placements of one tensor: one per mesh dim.
Layout = tuple[Placement, ...]

# On 2-D meshes the product of every input's layouts is large; tests pass a sample of it.
LAYOUT_SAMPLE_2D = 12


def _options(tensor: torch.Tensor, partial: bool) -> list[Placement]:
    options: list[Placement] = [Replicate(), *(Shard(dim) for dim in range(tensor.dim()))]
    if partial and tensor.is_floating_point():
        options.append(Partial())
    return options


def every_layout(mesh: DeviceMesh, inputs: Sequence[torch.Tensor], *, partial: bool) -> list[tuple[Layout, ...]]:
    per_input = [list(itertools.product(_options(t, partial), repeat=mesh.ndim)) for t in inputs]
    return [tuple(combo) for combo in itertools.product(*per_input)]


def sample(layouts: Sequence[tuple[Layout, ...]], count: int) -> list[tuple[Layout, ...]]:
    """An evenly spread, deterministic subset (first and last included)."""
    return [layouts[index] for index in _spread(len(layouts), count)]


def as_dtensor(full: torch.Tensor, mesh: DeviceMesh, layout: Layout, seed: int) -> DTensor:
    """``full`` laid out as ``layout``; a floating one is a leaf requiring grad.

    Partial mesh dims hold random parts (the same on every rank, from ``seed``) that sum to ``full``.
    """
    if not any(isinstance(placement, Partial) for placement in layout):
        result = distribute_tensor(full, mesh, list(layout), src_data_rank=None)
    else:
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        generator = torch.Generator().manual_seed(seed)
        value = full
        for mesh_dim, placement in enumerate(layout):
            if isinstance(placement, Partial):
                parts = mesh.size(mesh_dim)
                noise = torch.randn((parts, *full.shape), generator=generator, dtype=full.dtype)
                value = value / parts + (noise - noise.mean(0))[coordinate[mesh_dim]]
        local = select_local_shard(value, tuple(mesh.shape), tuple(coordinate), layout).clone()
        result = DTensor.from_local(local, mesh, list(layout), shape=full.shape, stride=full.stride())
    if full.is_floating_point():
        result.requires_grad_()
    return result


def _describe(layouts: Sequence[Layout]) -> str:
    return ", ".join("(" + ", ".join(str(p) for p in layout) + ")" for layout in layouts)


def _gradient_like(output: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(output.shape, generator=generator, dtype=output.dtype)


def check_layout(
    mesh: DeviceMesh,
    fn: Callable[..., Any],
    inputs: Sequence[torch.Tensor],
    layouts: Sequence[Layout],
    *,
    backward: bool = True,
    check_stride: bool = True,
    dtensors: Sequence[DTensor] | None = None,
    differentiable: Sequence[bool] | None = None,
) -> list[DTensor]:
    """Run ``fn`` on ``inputs`` laid out as ``layouts``; compare outputs and input gradients with plain torch.

    ``dtensors``: the inputs already laid out (e.g. by DTensorConverter); built here when absent.
    ``differentiable``: which inputs require grad (default: the floating ones).
    Returns the DTensor outputs (flattened) so that callers can also check their placements.
    """
    where = f"inputs laid out as {_describe(layouts)} on mesh {tuple(mesh.shape)}"
    wants_grad = [
        backward and t.is_floating_point() and (differentiable is None or differentiable[index])
        for index, t in enumerate(inputs)
    ]
    plain = [t.clone().requires_grad_(grad) for t, grad in zip(inputs, wants_grad)]
    expected_leaves, expected_structure = tree_flatten(fn(*plain))
    if dtensors is None:
        dtensors = [as_dtensor(t, mesh, layout, seed) for seed, (t, layout) in enumerate(zip(inputs, layouts))]
    for dtensor, grad in zip(dtensors, wants_grad):
        dtensor.requires_grad_(grad)
    actual_leaves, actual_structure = tree_flatten(fn(*dtensors))
    assert actual_structure == expected_structure, f"{where}: result structure {actual_structure}"
    outputs: list[DTensor] = []
    for index, (actual, expected) in enumerate(zip(actual_leaves, expected_leaves)):
        if not isinstance(expected, torch.Tensor):
            assert actual == expected, f"{where}: output {index} is {actual!r}, expected {expected!r}"
            continue
        assert isinstance(actual, DTensor), f"{where}: output {index} is a {type(actual).__name__}, not a DTensor"
        assert actual.shape == expected.shape, f"{where}: output {index} has shape {tuple(actual.shape)}"
        assert actual.dtype == expected.dtype, f"{where}: output {index} has dtype {actual.dtype}"
        if check_stride:
            assert actual.stride() == expected.stride(), (
                f"{where}: output {index} has global stride {actual.stride()}, torch gives {expected.stride()}"
            )
        assert tuple(actual.to_local().shape) == actual._spec.local_shape(), (
            f"{where}: output {index} local shape {tuple(actual.to_local().shape)} "
            f"!= spec {actual._spec.local_shape()} ({actual.placements})"
        )
        torch.testing.assert_close(
            actual.full_tensor(), expected.detach(), msg=lambda m: f"{where}: output {index} ({actual.placements}): {m}"
        )
        outputs.append(actual)
    if not backward:
        return outputs
    needs_grad = [
        (index, actual, expected)
        for index, (actual, expected) in enumerate(zip(actual_leaves, expected_leaves))
        if isinstance(expected, torch.Tensor) and expected.requires_grad
    ]
    if not needs_grad:
        return outputs
    gradients = [_gradient_like(expected, index) for index, _, expected in needs_grad]
    torch.autograd.backward([expected for _, _, expected in needs_grad], gradients)
    laid_out = [
        distribute_tensor(
            gradient,
            mesh,
            [Replicate() if isinstance(p, Partial) else p for p in actual.placements],
            src_data_rank=None,
        )
        for gradient, (_, actual, _) in zip(gradients, needs_grad)
    ]
    torch.autograd.backward([actual for _, actual, _ in needs_grad], laid_out)
    for index, (dtensor, reference) in enumerate(zip(dtensors, plain)):
        if reference.grad is None:
            assert dtensor.grad is None, f"{where}: input {index} got a gradient that plain torch does not give"
            continue
        assert dtensor.grad is not None, f"{where}: input {index} got no gradient"
        torch.testing.assert_close(
            dtensor.grad.full_tensor(), reference.grad, msg=lambda m: f"{where}: gradient of input {index}: {m}"
        )
    return outputs


def layouts_beyond_converter(
    mesh: DeviceMesh, inputs: Sequence[torch.Tensor], *, partial: bool = True
) -> list[tuple[Layout, ...]]:
    """Every layout of R / S(any dim) / P(sum) per mesh dim that DTensorConverter does not yield."""
    converter = DTensorConverter(mesh, tuple(inputs), {})
    even = {tuple(tuple(choice) for choice in combo) for combo in converter.sharding_combs}
    return [combo for combo in every_layout(mesh, inputs, partial=partial) if combo not in even]


def sweep(
    mesh: DeviceMesh,
    fn: Callable[..., Any],
    inputs: Sequence[torch.Tensor],
    *,
    partial: bool = True,
    backward: bool = True,
    check_stride: bool = True,
    limit: int | None = None,
    differentiable: Sequence[bool] | None = None,
) -> int:
    """Check ``fn`` on every layout of ``inputs`` (DTensorConverter's even ones, then the rest); returns the count.

    ``limit`` keeps an evenly spread sample of that many layouts of each kind (for 2-D meshes).
    """
    converter = DTensorConverter(mesh, tuple(inputs), {})
    even = [tuple(tuple(choice) for choice in combo) for combo in converter.sharding_combs]
    checked = 0
    for layouts in even if limit is None else sample(even, limit):
        dtensors = [converter.to_dist_tensor(t, mesh, layout) for t, layout in zip(inputs, layouts)]
        assert converter.successful(), "DTensorConverter passed a tensor through unconverted"
        check_layout(
            mesh,
            fn,
            inputs,
            layouts,
            backward=backward,
            check_stride=check_stride,
            dtensors=dtensors,
            differentiable=differentiable,
        )
        checked += 1
    extra = layouts_beyond_converter(mesh, inputs, partial=partial)
    for layouts in extra if limit is None else sample(extra, limit):
        check_layout(
            mesh, fn, inputs, layouts, backward=backward, check_stride=check_stride, differentiable=differentiable
        )
        checked += 1
    return checked


def _spread(count: int, wanted: int) -> list[int]:
    if count <= wanted:
        return list(range(count))
    return [round(index * (count - 1) / (wanted - 1)) for index in range(wanted)]
