"""Differential testing of shardwise's DTensor against plain torch and PyTorch's own DTensor.

Shared by ``test_differential_*.py``. A *case* is plain data (a mesh shape, a dtype, a global shape,
source and target placements, a seed); hypothesis draws cases, and every check runs the same case

* on shardwise (``shardwise.dtensor_ops``),
* on plain torch on the whole tensor (the truth for values, dtype and shape), and
* on PyTorch's ``torch.distributed.tensor`` where it runs the case (the oracle for layouts: each rank's
  piece, global strides, gradients), allowed in tests only as an oracle.

Every rank is simulated in this process by torch's ``LocalTensorMode`` over a ``fake`` process group
(``SimulatedWorld``), so a case costs milliseconds; ``test_differential_real_ranks.py`` runs a smaller
set on gloo processes.

Time budget: each property test runs batches of examples, batch ``i`` with hypothesis seed ``i``, until
its budget in seconds is spent (at least one batch). So the CI run is reproducible (the same seeds, in
order) and its length is bounded in seconds, not examples; ``SHARDWISE_DIFFERENTIAL_SECONDS=600`` gives
every property test 600 s instead (a longer search). Failures shrink and are kept in hypothesis'
database (under ``TEST_TMPDIR`` in Bazel: the runner points ``HYPOTHESIS_STORAGE_DIRECTORY`` there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import hypothesis
import torch
import torch.distributed as dist
import torch.distributed.tensor as torch_dtensor
from hypothesis import strategies as st
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.tensor.placement_types import _StridedShard as TorchStridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, init_device_mesh
from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement, _StridedShard

BUDGET_ENV_VAR = "SHARDWISE_DIFFERENTIAL_SECONDS"
EXAMPLES_PER_BATCH = 25

# Errors a refusal may raise: each names what was wrong. Anything else (AssertionError, IndexError,
# KeyError, AttributeError, ZeroDivisionError, ...) is an internal failure, not a refusal.
REFUSAL_TYPES: tuple[type[BaseException], ...] = (ValueError, NotImplementedError, TypeError, RuntimeError)

# Every mesh of 1 to 8 ranks that the property tests draw from: 1-D, 2-D and 3-D, size-1 dims included.
MESH_SHAPES: tuple[tuple[int, ...], ...] = (
    (1,), (2,), (3,), (4,), (5,), (7,), (8,),
    (1, 1), (2, 1), (1, 4), (2, 2), (2, 3), (3, 2), (2, 4), (4, 2),
    (1, 2, 2), (2, 1, 2), (2, 2, 2), (1, 1, 3),
)  # fmt: skip

DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
)  # fmt: skip

# Sizes of a tensor dim: empty, one, primes (never divisible by a mesh dim > 1 of another size),
# fewer and more elements than ranks.
DIM_SIZES: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 7, 8, 11, 13)
MAX_ELEMENTS = 600


# -- budget -----------------------------------------------------------------------------------------------


def budget_seconds(default: float) -> float:
    """The seconds a property test may run: ``default``, or ``$SHARDWISE_DIFFERENTIAL_SECONDS``."""
    text = os.environ.get(BUDGET_ENV_VAR, "").strip()
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"${BUDGET_ENV_VAR} must be a number of seconds, got {text!r}") from None
    if seconds <= 0:
        raise ValueError(f"${BUDGET_ENV_VAR} must be positive, got {seconds}")
    return seconds


def run_for_budget(
    make_property: Callable[[Callable[[], bool]], Callable[..., None]],
    default_seconds: float,
    examples_per_batch: int = EXAMPLES_PER_BATCH,
) -> int:
    """Run the ``@given`` property ``make_property(out_of_time)`` in seeded batches until the budget is spent.

    ``make_property`` returns a fresh ``@given``-decorated function each time (hypothesis keeps
    per-function state); its body returns at once while ``out_of_time()``, so the batch running when
    the budget ends finishes in moments. Batch ``i`` runs with ``hypothesis.seed(i)``: a CI run replays
    the same examples in the same order, as many batches as the machine's speed allows (at least one
    example). Returns the number of batches run. A failing example shrinks (shrinking is not cut short)
    and is stored in hypothesis' database as usual, which replays it first next time.
    """
    deadline = time.monotonic() + budget_seconds(default_seconds)
    started = [False]

    def out_of_time() -> bool:
        # The first example always runs: a loaded machine still tests something.
        if not started[0]:
            started[0] = True
            return False
        return time.monotonic() >= deadline

    batch = 0
    while time.monotonic() < deadline or batch == 0:
        prop = make_property(out_of_time)
        configured = hypothesis.settings(
            max_examples=examples_per_batch,
            deadline=None,
            print_blob=True,
            suppress_health_check=list(hypothesis.HealthCheck),
        )(prop)
        hypothesis.seed(batch)(configured)()
        batch += 1
    return batch


# -- the simulated world ----------------------------------------------------------------------------------


class SimulatedWorld:
    """A fake process group of as many ranks as the current mesh, every rank simulated by LocalTensorMode.

    Meshes (shardwise's and PyTorch's) are made once per shape while the world keeps its size.
    """

    def __init__(self) -> None:
        self._size = 0
        self._meshes: dict[tuple[int, ...], tuple[DeviceMesh, Any]] = {}

    def meshes(self, mesh_shape: tuple[int, ...]) -> tuple[DeviceMesh, Any]:
        """Shardwise's and PyTorch's mesh of ``mesh_shape`` over a world of that many ranks."""
        size = math.prod(mesh_shape)
        if size != self._size:
            self.close()
            dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
            self._size = size
        if mesh_shape not in self._meshes:
            self._meshes[mesh_shape] = (
                init_device_mesh("cpu", mesh_shape),
                torch_init_device_mesh("cpu", mesh_shape),
            )
        return self._meshes[mesh_shape]

    def mode(self) -> LocalTensorMode:
        return LocalTensorMode(frozenset(range(self._size)))

    def close(self) -> None:
        self._meshes.clear()
        self._size = 0
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def simulated_world() -> Iterator[SimulatedWorld]:
    """A :class:`SimulatedWorld` for one test; refuses to replace a process group someone else made."""
    if dist.is_initialized():
        raise RuntimeError(
            f"a process group ({dist.get_backend()}, {dist.get_world_size()} ranks) is already initialised; "
            "the differential tests simulate ranks over fake groups of their own"
        )
    world = SimulatedWorld()
    try:
        yield world
    finally:
        world.close()


# -- placements -------------------------------------------------------------------------------------------


def reduce_ops_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The Partial reduce ops defined for ``dtype``: avg needs a division (floating and complex only),
    max/min an order (not complex); a bool sum is a logical or, a bool product a logical and."""
    ops = ["sum", "product"]
    if dtype.is_floating_point or dtype.is_complex:
        ops.append("avg")
    if not dtype.is_complex:
        ops += ["max", "min"]
    return tuple(ops)


def to_torch_placement(placement: Placement) -> Any:
    """PyTorch's placement equal to shardwise's ``placement``."""
    if isinstance(placement, _StridedShard):
        return TorchStridedShard(placement.dim, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return torch_dtensor.Shard(placement.dim)
    if isinstance(placement, Partial):
        return torch_dtensor.Partial(placement.reduce_op)
    if isinstance(placement, Replicate):
        return torch_dtensor.Replicate()
    raise TypeError(f"no PyTorch placement for {placement!r}")


def normalized(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    """``placements`` with negative shard dims counted from the front, as a DTensor reports them (PyTorch's too)."""

    def one(placement: Placement) -> Placement:
        if isinstance(placement, _StridedShard) and placement.dim < 0:
            return _StridedShard(placement.dim + ndim, split_factor=placement.split_factor)
        if isinstance(placement, Shard) and placement.dim < 0:
            return Shard(placement.dim + ndim)
        return placement

    return tuple(one(p) for p in placements)


def describe_placements(placements: Sequence[Placement]) -> str:
    return "[" + ", ".join(repr(p) for p in placements) + "]"


@st.composite
def placement_for(draw: st.DrawFn, ndim: int, dtype: torch.dtype, *, partial: bool = True, strided: bool = True) -> Placement:
    """One mesh dim's placement for a tensor of ``ndim`` dims: Shard (negative dims too), _StridedShard,
    Replicate or Partial (a reduce op defined for ``dtype``)."""
    kinds = ["replicate"]
    if ndim > 0:
        kinds += ["shard", "shard"]
        if strided:
            kinds.append("strided")
    if partial:
        kinds.append("partial")
    kind = draw(st.sampled_from(kinds))
    if kind == "replicate":
        return Replicate()
    if kind == "partial":
        return Partial(draw(st.sampled_from(reduce_ops_for(dtype))))
    dim = draw(st.integers(-ndim, ndim - 1))
    if kind == "shard":
        return Shard(dim)
    return _StridedShard(dim, split_factor=draw(st.sampled_from((2, 3))))


@st.composite
def global_shapes(draw: st.DrawFn, max_ndim: int = 3) -> tuple[int, ...]:
    ndim = draw(st.integers(0, max_ndim))
    shape = tuple(draw(st.sampled_from(DIM_SIZES)) for _ in range(ndim))
    hypothesis.assume(math.prod(shape) <= MAX_ELEMENTS)
    return shape


# -- values -----------------------------------------------------------------------------------------------


def random_values(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator, reduce_op: str = "sum") -> torch.Tensor:
    """Small values of ``dtype``: dyadic fractions for floating types (sums and maxima exact in every
    floating dtype), near one for products (so that a product of 8 stays in range)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=generator).bool()
    if not (dtype.is_floating_point or dtype.is_complex):
        low, high = (-2, 3) if reduce_op == "product" else (-20, 21)
        return torch.randint(low, high, tuple(shape), generator=generator).to(dtype)
    real_dtype = torch.float64
    parts = [torch.randint(-8, 9, tuple(shape), generator=generator).to(real_dtype) / 4 for _ in range(2)]
    if reduce_op == "product":
        parts = [1 + part / 8 for part in parts]
    if dtype.is_complex:
        return torch.complex(parts[0], parts[1]).to(dtype)
    return parts[0].to(dtype)


def reduce_stacked(stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """Plain torch's reduction of dim 0 of ``stacked`` for ``Partial(reduce_op)``, in the tensor's dtype."""
    if reduce_op == "sum":
        return stacked.sum(0, dtype=stacked.dtype)
    if reduce_op == "product":
        return stacked.prod(0, dtype=stacked.dtype)
    if reduce_op == "avg":
        return stacked.sum(0, dtype=stacked.dtype) / stacked.size(0)
    if reduce_op == "max":
        return stacked.amax(0)
    if reduce_op == "min":
        return stacked.amin(0)
    raise ValueError(f"unknown reduce op {reduce_op!r}")


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing results that may be reduced in another order than plain torch's."""
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 2e-2
    if dtype in (torch.float32, torch.complex64):
        return 1e-5, 1e-5
    if dtype in (torch.float64, torch.complex128):
        return 1e-10, 1e-10
    return 0.0, 0.0


def assert_same_tensor(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same dtype, shape and values (exact for bool and integers, within ``tolerances`` otherwise)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    rtol, atol = tolerances(expected.dtype)
    if expected.dtype in (torch.float16, torch.bfloat16) and expected.numel():
        # Partial pieces (a sharded contraction, an R -> P split) are rounded to the dtype before they are
        # summed, up to 8 of them: an error of up to ~8 ulps of the largest value, whatever the element's size.
        largest = float(expected.detach().abs().float().nan_to_num(0.0, 0.0, 0.0).max())
        atol = max(atol, 8 * torch.finfo(expected.dtype).eps * largest)
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=lambda message: f"{what}: {message}"
    )


def pieces_of(value: torch.Tensor, world_size: int) -> dict[int, torch.Tensor]:
    """Each simulated rank's tensor: a LocalTensor's pieces, or ``value`` for every rank."""
    if isinstance(value, LocalTensor):
        return dict(value._local_tensors)
    return {rank: value for rank in range(world_size)}


def assert_every_rank(actual: torch.Tensor, expected: torch.Tensor, world_size: int, what: str) -> None:
    """``actual`` (a LocalTensor or plain tensor) equals ``expected`` on every simulated rank."""
    actual_pieces = pieces_of(actual, world_size)
    expected_pieces = pieces_of(expected, world_size)
    for rank in range(world_size):
        assert_same_tensor(actual_pieces[rank], expected_pieces[rank], f"{what}, simulated rank {rank}")


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(torch.empty(tuple(shape), device="meta").stride())


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a case needs of a source layout: each Partial coordinate's global tensor, and the truth."""

    contributions: dict[tuple[int, ...], torch.Tensor]  # Partial mesh coordinates -> that contribution
    full: torch.Tensor  # what the layout stands for: the contributions reduced, last Partial mesh dim first


def make_layout(
    mesh_shape: tuple[int, ...], placements: Sequence[Placement], shape: tuple[int, ...], dtype: torch.dtype, seed: int
) -> Layout:
    """Random contributions for every Partial mesh coordinate and the value they reduce to."""
    generator = torch.Generator().manual_seed(seed)
    partial_dims = [index for index, p in enumerate(placements) if isinstance(p, Partial)]
    first_op = placements[partial_dims[-1]].reduce_op if partial_dims else "sum"  # type: ignore[attr-defined]
    coordinates = list(_product([range(mesh_shape[d]) for d in partial_dims]))
    contributions = {c: random_values(shape, dtype, generator, first_op) for c in coordinates}
    # Reduce the last Partial mesh dim first (shardwise's and PyTorch's order for mixed reduce ops).
    values = {c: t for c, t in contributions.items()}
    for axis in reversed(range(len(partial_dims))):
        reduce_op = placements[partial_dims[axis]].reduce_op  # type: ignore[attr-defined]
        grouped: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for coordinate, tensor in sorted(values.items()):
            grouped.setdefault(coordinate[:axis], []).append(tensor)
        values = {prefix: reduce_stacked(torch.stack(group), reduce_op) for prefix, group in grouped.items()}
    return Layout(contributions, values[()])


def _product(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for first in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (first, *rest)


def divmod_all(rank: int, mesh_shape: tuple[int, ...]) -> list[int]:
    coordinate = []
    for size in reversed(mesh_shape):
        rank, index = divmod(rank, size)
        coordinate.append(index)
    return list(reversed(coordinate))


def _chunk(extent: int, count: int, index: int) -> tuple[int, int]:
    """(offset, size) of piece ``index`` of ``count`` along an extent: ceil-sized pieces, the trailing ones
    smaller or empty (torch.chunk's sizes, padded out to ``count`` pieces)."""
    size = -(-extent // count) if count else 0
    offset = min(index * size, extent)
    return offset, min(size, extent - offset)


def reference_piece(full: torch.Tensor, placements: Sequence[Placement], coordinate: Sequence[int], mesh_shape: Sequence[int]) -> torch.Tensor:
    """The piece of ``full`` the rank at ``coordinate`` holds, in plain torch (Partial and Replicate keep all).

    Mesh dims cut left to right. ``Shard(d)`` keeps piece ``coordinate[i]`` of ``mesh_shape[i]``;
    ``_StridedShard(d, split_factor=f)`` cuts the current extent into ``f`` pieces, each of those into
    ``mesh_shape[i]``, and keeps piece ``coordinate[i]`` of each, in order (the layout FSDP over TP makes).
    """
    piece = full
    for placement, index, count in zip(placements, coordinate, mesh_shape):
        if not isinstance(placement, (Shard, _StridedShard)):
            continue
        dim = placement.dim % full.dim()
        if isinstance(placement, _StridedShard):
            runs = []
            for part in range(placement.split_factor):
                part_offset, part_size = _chunk(piece.size(dim), placement.split_factor, part)
                offset, size = _chunk(part_size, count, index)
                runs.append(piece.narrow(dim, part_offset + offset, size))
            piece = torch.cat(runs, dim=dim)
        else:
            offset, size = _chunk(piece.size(dim), count, index)
            piece = piece.narrow(dim, offset, size)
    return piece.contiguous()


def reference_pieces(full: torch.Tensor, placements: Sequence[Placement], mesh_shape: tuple[int, ...]) -> LocalTensor:
    """Every rank's :func:`reference_piece` (a LocalTensor; call with the mode disabled)."""
    world_size = math.prod(mesh_shape)
    return LocalTensor({rank: reference_piece(full, placements, divmod_all(rank, mesh_shape), mesh_shape) for rank in range(world_size)})


def local_pieces(mode: LocalTensorMode, placements: Sequence[Placement], layout: Layout, mesh_shape: tuple[int, ...]) -> torch.Tensor:
    """Every rank's local tensor of ``layout`` laid out as ``placements`` (a LocalTensor): the piece of
    its own contribution (that of its coordinates on the Partial mesh dims)."""
    partial_dims = [index for index, p in enumerate(placements) if isinstance(p, Partial)]
    by_rank = {}
    for rank in range(math.prod(mesh_shape)):
        coordinate = divmod_all(rank, mesh_shape)
        contribution = layout.contributions[tuple(coordinate[d] for d in partial_dims)]
        by_rank[rank] = reference_piece(contribution, placements, coordinate, mesh_shape)
    with mode.disable():
        return LocalTensor(by_rank)


# -- redistribution cases ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RedistributeCase:
    """One source layout, one target layout, the data they hold (drawn from ``seed``)."""

    mesh_shape: tuple[int, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    seed: int = 0

    def __str__(self) -> str:
        return (
            f"mesh {self.mesh_shape}, {self.dtype}, shape {self.shape}: "
            f"{describe_placements(self.src)} -> {describe_placements(self.dst)} (seed {self.seed})"
        )


@st.composite
def _target_placement(draw: st.DrawFn, source: Placement, ndim: int, dtype: torch.dtype) -> Placement:
    """A target placement for one mesh dim; Partial mostly where redistribute may go to one (from Replicate,
    or the source's own reduce op), so that few draws end in the refusal of ``-> Partial`` from a Shard."""
    target = draw(placement_for(ndim, dtype))
    if not isinstance(target, Partial) or isinstance(source, Replicate) or draw(st.integers(0, 9)) == 0:
        return target
    if isinstance(source, Partial):
        return source
    return Replicate()


@st.composite
def redistribute_cases(draw: st.DrawFn, mesh_shapes: Sequence[tuple[int, ...]] = MESH_SHAPES) -> RedistributeCase:
    mesh_shape = draw(st.sampled_from(tuple(mesh_shapes)))
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(global_shapes())
    src = tuple(draw(placement_for(len(shape), dtype)) for _ in mesh_shape)
    dst = tuple(draw(_target_placement(source, len(shape), dtype)) for source in src)
    return RedistributeCase(mesh_shape, dtype, shape, src, dst, draw(st.integers(0, 2**16)))


@dataclasses.dataclass
class Outcome:
    """What happened to one case on one implementation: a value, or the error it raised."""

    value: Any = None
    error: BaseException | None = None

    @property
    def ran(self) -> bool:
        return self.error is None


def attempt(run: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(value=run())
    except Exception as error:  # noqa: BLE001 - classified by the caller
        return Outcome(error=error)


def assert_clear_refusal(error: BaseException, what: str) -> None:
    """A refusal is one of REFUSAL_TYPES with a message; anything else is an internal failure."""
    assert isinstance(error, REFUSAL_TYPES) and str(error).strip(), (
        f"{what}: not a clear refusal but {type(error).__name__}: {error}"
    )


def _layout_oracle(full: torch.Tensor, mode: LocalTensorMode, placements: Sequence[Placement], mesh_shape: tuple[int, ...]) -> torch.Tensor | None:
    """Each rank's piece of ``full`` laid out as ``placements``, where none is Partial (a Partial
    layout's pieces are the implementation's choice; only what they reduce to is compared)."""
    if any(isinstance(p, Partial) for p in placements):
        return None
    with mode.disable():
        return reference_pieces(full, placements, mesh_shape)


def _check_dtensor(
    result: Any, case: RedistributeCase, placements: Sequence[Placement], layout: Layout, oracle_pieces: torch.Tensor | None, what: str
) -> None:
    world_size = math.prod(case.mesh_shape)
    assert isinstance(result, DTensor), f"{what}: got {type(result).__name__}, expected a DTensor"
    expected_placements = normalized(placements, len(case.shape))
    assert tuple(result.placements) == expected_placements, (
        f"{what}: placements {tuple(result.placements)}, expected {expected_placements}"
    )
    assert result.dtype == layout.full.dtype, f"{what}: dtype {result.dtype}, expected {layout.full.dtype}"
    assert tuple(result.shape) == tuple(layout.full.shape), f"{what}: shape {tuple(result.shape)}, expected {tuple(layout.full.shape)}"
    assert tuple(result.stride()) == contiguous_strides(layout.full.shape), f"{what}: stride {result.stride()}"
    assert_every_rank(result.full_tensor(), layout.full, world_size, f"{what}: full_tensor()")
    if oracle_pieces is not None:
        assert_every_rank(result.to_local(), oracle_pieces, world_size, f"{what}: to_local() against the reference piece")


def check_redistribute_case(world: SimulatedWorld, case: RedistributeCase, *, backward: bool = True) -> str:
    """Run ``case`` on shardwise, plain torch and PyTorch's DTensor; raise AssertionError on any difference.

    Returns "ok", or "refused: <error type>" where shardwise refused with a clear error.
    """
    mesh, torch_mesh = world.meshes(case.mesh_shape)
    layout = make_layout(case.mesh_shape, case.src, case.shape, case.dtype, case.seed)
    world_size = math.prod(case.mesh_shape)
    stride = contiguous_strides(case.shape)
    torch_src_placements = [to_torch_placement(p) for p in case.src]
    torch_dst_placements = [to_torch_placement(p) for p in case.dst]
    with world.mode() as mode:
        local = local_pieces(mode, case.src, layout, case.mesh_shape)
        source = DTensor.from_local(local, mesh, case.src, shape=torch.Size(case.shape), stride=stride)
        whole = attempt(source.full_tensor)
        if not whole.ran:
            assert whole.error is not None
            assert_clear_refusal(whole.error, f"{case}: full_tensor")
            return f"refused: {type(whole.error).__name__}"
        _check_dtensor(source, case, case.src, layout, None, f"{case}: from_local")
        assert_every_rank(source.to_local(), local, world_size, f"{case}: to_local() of from_local")
        oracle_pieces = _layout_oracle(layout.full, mode, case.dst, case.mesh_shape)

        ours = attempt(lambda: source.redistribute(mesh, case.dst))
        if not ours.ran:
            assert ours.error is not None
            assert_clear_refusal(ours.error, f"{case}: redistribute")
            _assert_pytorch_cannot_either(case, local, torch_mesh, torch_src_placements, torch_dst_placements, layout, ours.error)
            return f"refused: {type(ours.error).__name__}"
        _check_dtensor(ours.value, case, case.dst, layout, oracle_pieces, f"{case}: redistribute")

        # The same move asynchronously: the pending result must finish to the same tensor.
        pending = attempt(lambda: source.redistribute(mesh, case.dst, async_op=True))
        assert pending.ran, f"{case}: redistribute(async_op=True) raised {pending.error!r} where the synchronous one ran"
        _check_dtensor(pending.value, case, case.dst, layout, oracle_pieces, f"{case}: redistribute(async_op=True)")

        # forward_dtype: the collectives and the result in another floating dtype, the same value.
        if case.dtype in (torch.float16, torch.bfloat16, torch.float32):
            wider = attempt(lambda: source.redistribute(mesh, case.dst, forward_dtype=torch.float64))
            assert wider.ran, f"{case}: redistribute(forward_dtype=float64) raised {wider.error!r}"
            assert wider.value.dtype == torch.float64, f"{case}: forward_dtype=float64 gave {wider.value.dtype}"
            narrowed = wider.value.full_tensor().to(case.dtype)
            assert_every_rank(narrowed, layout.full, world_size, f"{case}: redistribute(forward_dtype=float64)")

        # from_local(run_check=True) infers the global shape from every rank's piece (uneven ones too).
        if not any(isinstance(p, _StridedShard) for p in case.src):
            checked = attempt(lambda: DTensor.from_local(local, mesh, case.src, run_check=True))
            if checked.ran:
                assert tuple(checked.value.shape) == case.shape, (
                    f"{case}: from_local(run_check=True) inferred shape {tuple(checked.value.shape)}"
                )
                assert_every_rank(checked.value.full_tensor(), layout.full, world_size, f"{case}: from_local(run_check=True)")
            else:
                assert checked.error is not None
                assert_clear_refusal(checked.error, f"{case}: from_local(run_check=True)")

        # distribute_tensor of the whole value to the target (its own refusals: Partial targets are allowed)
        direct = attempt(lambda: _distribute(layout.full, mesh, case.dst))
        if direct.ran:
            _check_dtensor(direct.value, case, case.dst, layout, oracle_pieces, f"{case}: distribute_tensor")
        else:
            assert direct.error is not None
            assert_clear_refusal(direct.error, f"{case}: distribute_tensor")

        if backward and (case.dtype.is_floating_point or case.dtype.is_complex):
            _check_backward(case, mesh, local, layout, mode)
    return "ok"


# Refusals that are shardwise's choice where PyTorch runs the case (message fragments; README, "Differential
# testing", says why each is refused).
DELIBERATE_REFUSALS: tuple[str, ...] = (
    # The planner's strided steps move Shard pieces; a Partial mesh dim next to a strided one is refused
    # before anything runs (README, Redistribution): reduce the Partial dims first.
    "a layout with both a _StridedShard and a Partial mesh dim",
    "a target with _StridedShard and Partial",
)


def _assert_pytorch_cannot_either(
    case: RedistributeCase,
    local: torch.Tensor,
    torch_mesh: Any,
    torch_src_placements: list[Any],
    torch_dst_placements: list[Any],
    layout: Layout,
    refusal: BaseException,
) -> None:
    """A refusal is a gap where PyTorch's DTensor runs the same case to the right value."""
    if any(fragment in str(refusal) for fragment in DELIBERATE_REFUSALS):
        return
    size, stride = torch.Size(case.shape), contiguous_strides(case.shape)
    theirs = attempt(
        lambda: torch_dtensor.DTensor.from_local(local, torch_mesh, torch_src_placements, shape=size, stride=stride)
        .redistribute(torch_mesh, torch_dst_placements)
        .full_tensor()
    )
    if not theirs.ran:
        return
    try:
        assert_every_rank(theirs.value, layout.full, math.prod(case.mesh_shape), "PyTorch")
    except AssertionError:
        return  # PyTorch runs it to a wrong value: refusing is better
    raise AssertionError(f"{case}: shardwise refuses ({type(refusal).__name__}: {refusal}) what PyTorch's DTensor runs right")


def _distribute(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    from shardwise.dtensor_ops import distribute_tensor

    return distribute_tensor(full, mesh, list(placements))


def _check_backward(
    case: RedistributeCase, mesh: DeviceMesh, local: torch.Tensor, layout: Layout, mode: LocalTensorMode
) -> None:
    """The gradient of each rank's piece through from_local -> redistribute -> full_tensor.

    Expected: plain torch's gradient of the whole value, laid out as the source with Partial mesh dims as
    Replicate (PyTorch 2.13's gradient placements: every contribution gets the whole gradient). Computed, not
    taken from PyTorch's DTensor, whose gradient is wrong for some strided targets (README, "Differential
    testing").
    """
    with mode.disable():
        weights = random_values(case.shape, case.dtype, torch.Generator().manual_seed(case.seed + 1))

        def loss_of(result: torch.Tensor) -> torch.Tensor:
            weighted = (result * weights).sum()
            return weighted.real if weighted.is_complex() else weighted

        whole = layout.full.detach().clone().requires_grad_(True)
        loss_of(whole).backward()
        assert whole.grad is not None
        gradient_layout = tuple(Replicate() if isinstance(p, Partial) else p for p in case.src)
        expected = reference_pieces(whole.grad, gradient_layout, case.mesh_shape)
    leaf = local.detach().clone().requires_grad_(True)
    size, stride = torch.Size(case.shape), contiguous_strides(case.shape)
    loss_of(DTensor.from_local(leaf, mesh, case.src, shape=size, stride=stride).redistribute(mesh, case.dst).full_tensor()).backward()
    assert leaf.grad is not None, f"{case}: backward gave no gradient for the local pieces"
    assert_every_rank(leaf.grad, expected, math.prod(case.mesh_shape), f"{case}: gradient of the local pieces")
