"""The one module that issues and waits on collectives, and the tensor an asynchronous redistribution returns.

Redistribution, ``distribute_tensor``'s scatter and broadcast, ``from_local(run_check=True)``'s
metadata exchange, seeds and the op handlers all communicate through the functions here, which
take a mesh dim's group name from :func:`group_name` (the mesh's public ``get_group_name``).

Every collective goes through ``torch.ops._c10d_functional`` so that it is traceable by
``torch.compile`` and counted by ``CommDebugMode`` under the op keys PyTorch uses.  The
functional ops return as soon as the collective is launched; their result must pass
through ``torch.ops._c10d_functional.wait_tensor`` before anything reads it.  The
launch helpers below therefore return *unwaited* tensors, and callers either wait right
away (:func:`wait`) or hand the tensor to an :class:`AsyncCollectiveTensor`.

The ``launch_*`` helpers work on dim 0 with equal, already padded pieces; the planner's
executor moves the interesting dim to the front and pads/trims around them.  The
``*_along_mesh_dim`` helpers wait themselves and move any dtype (gloo has no bool or
complex: those travel as bytes / real pairs).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils._pytree import tree_map_only

from shardwise.mesh import DeviceMesh
from shardwise.placement import chunk_sizes, norm_order_of

from ._options import ENVIRONMENT_OVERRIDES, current_options

__all__ = [
    "AsyncCollectiveTensor",
    "PENDING_TENSOR_TYPES",
    "all_gather_rows_over_mesh",
    "all_reduce_along_mesh_dim",
    "broadcast_along_mesh_dim",
    "mesh_dim_group_name",
    "mesh_group_names",
    "scatter_along_mesh_dim",
    "launch_all_gather",
    "launch_reduce_scatter",
    "launch_all_reduce",
    "launch_all_to_all",
    "launch_all_to_all_exact",
    "launch_all_gather_one_round",
    "launch_reduce_scatter_one_round",
    "one_round_collectives",
    "reduce_received_blocks",
    "reduce_in_dtype",
    "ONE_ROUND_SWITCH",
    "mark_arrived",
    "wait",
    "wait_local_tensor",
    "c10d_reduce_op",
]

_functional = torch.ops._c10d_functional

# Partial(avg) is reduced as a sum and divided by the group size afterwards: every backend
# supports "sum", not every backend supports "avg".
_C10D_REDUCE_OP = {"sum": "sum", "avg": "sum", "max": "max", "min": "min", "product": "product"}


def c10d_reduce_op(reduce_op: str) -> str:
    """The functional-collective reduce op used for a Partial's ``reduce_op`` (a p-norm sums |x|^p: see
    :func:`to_reducible`)."""
    if norm_order_of(reduce_op) is not None:
        return "sum"
    try:
        return _C10D_REDUCE_OP[reduce_op]
    except KeyError:
        raise ValueError(
            f"cannot reduce Partial(reduce_op={reduce_op!r}); expected one of {sorted(_C10D_REDUCE_OP)}"
        ) from None


def to_reducible(tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """What a rank sends into the reduction of ``reduce_op``: the tensor itself, or |x|^p for a p-norm."""
    order = norm_order_of(reduce_op)
    return tensor if order is None else tensor.abs().pow(order)


def from_reduced(tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """The reduced value from what the collective returned: itself, or the p-th root for a p-norm."""
    order = norm_order_of(reduce_op)
    return tensor if order is None else tensor.pow(1.0 / order)


def mesh_dim_group_name(mesh: Any, mesh_dim: int) -> str:
    """The c10d group name of ``mesh_dim`` (what the functional collectives take)."""
    get_group_name = getattr(mesh, "get_group_name", None)
    if get_group_name is None:
        raise TypeError(
            f"collectives need the process group name of mesh dim {mesh_dim}: {mesh!r} has no get_group_name(); "
            "expected a shardwise.mesh.DeviceMesh"
        )
    name: str = get_group_name(mesh_dim)
    return name


def mesh_group_names(mesh: Any) -> tuple[str, ...]:
    """The group name of every mesh dim, in dim order."""
    return tuple(mesh_dim_group_name(mesh, mesh_dim) for mesh_dim in range(len(mesh.shape)))


# Marks a collective's result that was waited already (see mark_arrived).
_ARRIVED = "_shardwise_arrived"


def mark_arrived(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor``, the result of collectives already waited for, so that ``wait(tensor)`` is a no-op.

    For results that went through host memory (``_as_real_collective``) or through several collectives
    in turn, each waited (a strided layout's whole gather), but that a caller waits as one.
    """
    setattr(tensor, _ARRIVED, True)
    return tensor


def _gloo_moves_cuda(tensor: torch.Tensor, group_name: str) -> bool:
    """Whether ``tensor`` is a CUDA tensor that ``group_name``'s group would hand to gloo.

    Ranks sharing a GPU run their CUDA tensors over gloo (shardwise.testing's shared-GPU pool, the
    trainer's ``--backend gloo``). Gloo's CUDA support is partial: ``all_gather_into_tensor`` on CUDA
    tensors crashes the process (SIGSEGV, torch 2.11 on an H200; pytorch#152645), so such tensors
    travel through host memory instead. CPU tensors return at the first test.
    """
    if not tensor.is_cuda:
        return False
    try:
        group = dist.distributed_c10d._resolve_process_group(cast(Any, group_name))  # a GroupName on torch 2.13
        backend = group._get_backend(tensor.device)
    except (RuntimeError, ValueError, AttributeError, KeyError):
        return False  # no real process group (simulated or fake ranks)
    return type(backend).__name__ == "ProcessGroupGloo"


def _as_real_collective(tensor: torch.Tensor, group_name: str, launch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``launch`` on ``tensor``; a complex tensor travels as its real view (gloo has no complex types).

    Every collective here works on dim-0 pieces or elementwise sums, which the trailing (real, imag)
    dim of ``view_as_real`` leaves intact. The complex result is waited here (a view of an unwaited
    result could be read before its collective ends); waiting on it again is a no-op. A CUDA tensor
    bound for gloo runs on a host copy, waited, and comes back (see ``_gloo_moves_cuda``).
    """
    if _gloo_moves_cuda(tensor, group_name):
        return mark_arrived(wait(_as_real_collective(tensor.cpu(), group_name, launch)).to(tensor.device))
    if not tensor.is_complex():
        return launch(tensor.contiguous())
    received = wait(launch(torch.view_as_real(tensor.contiguous())))
    return torch.view_as_complex(received)


def launch_all_gather(tensor: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Concatenate every group member's ``tensor`` along dim 0 (unwaited)."""
    return _as_real_collective(tensor, group_name, lambda t: _functional.all_gather_into_tensor(t, group_size, group_name))


def launch_reduce_scatter(tensor: torch.Tensor, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    """Reduce ``tensor`` over the group and keep this member's equal dim-0 piece (unwaited)."""
    kind = c10d_reduce_op(reduce_op)
    return _as_real_collective(tensor, group_name, lambda t: _functional.reduce_scatter_tensor(t, kind, group_size, group_name))


def launch_all_reduce(tensor: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """Reduce ``tensor`` over the group; every member gets the result (unwaited)."""
    kind = c10d_reduce_op(reduce_op)
    return _as_real_collective(tensor, group_name, lambda t: _functional.all_reduce(t, kind, group_name))


def launch_all_to_all(tensor: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Send dim-0 piece ``i`` of ``tensor`` to member ``i``; piece ``i`` of the result came from member ``i``.

    ``tensor.size(0)`` must be a multiple of ``group_size`` (pieces are equal).
    """
    piece = tensor.size(0) // group_size
    splits = [piece] * group_size
    return _as_real_collective(tensor, group_name, lambda t: _functional.all_to_all_single(t, splits, splits, group_name))


def launch_all_to_all_exact(
    flat: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group_name: str
) -> torch.Tensor:
    """Send the next ``input_splits[i]`` elements of the 1-D ``flat`` to member ``i`` (unwaited).

    The result holds, in member order, the ``output_splits[i]`` elements member ``i`` sent: pieces
    of any sizes, so nothing is padded.
    """
    outputs, inputs = list(output_splits), list(input_splits)
    return _as_real_collective(flat, group_name, lambda t: _functional.all_to_all_single(t, outputs, inputs, group_name))


# -- one-round reduce-scatter and all-gather (opt-in, gloo) ---------------------------------------------
#
# Gloo runs ``reduce_scatter_tensor`` through an all-reduce and ``all_gather_into_tensor`` as a ring of
# n - 1 rounds, while its ``all_to_all_single`` is one round of direct sends.  On small tensors, where
# latency dominates, one all-to-all moves the same bytes per rank as a reduce-scatter (each member gets
# every other member's block for it, then reduces locally) or an all-gather (each member sends its block
# to every other) at a fraction of the latency (4 gloo ranks on 2 cores: ~1.4 ms against ~3.6 ms for an
# all-gather and ~5-7 ms for a reduce-scatter).  It changes which collective CommDebugMode counts
# (all_to_all_single instead of PyTorch's reduce_scatter_tensor / all_gather_into_tensor), so it is off
# unless the ``gloo_all_to_all`` option is on (``_options``; SHARDWISE_GLOO_ALL_TO_ALL=1), asked when a
# redistribution program is compiled.

ONE_ROUND_SWITCH = ENVIRONMENT_OVERRIDES["gloo_all_to_all"]


def one_round_collectives(mesh: Any, mesh_dim: int) -> bool:
    """Whether redistribution runs ``mesh_dim``'s reduce-scatters and all-gathers as one all-to-all each.

    Only when the ``gloo_all_to_all`` option is on and the mesh dim's process group is a gloo group.
    """
    if not current_options().gloo_all_to_all:
        return False
    get_group = getattr(mesh, "get_group", None)
    if get_group is None:
        return False
    try:
        backend = torch.distributed.get_backend(get_group(mesh_dim))
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return False  # no real process group (simulated or fake meshes): the usual collectives
    return str(backend) == "gloo"


def launch_reduce_scatter_one_round(tensor: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """A reduce-scatter's data movement in one round (unwaited): member ``i`` gets every member's dim-0 block ``i``.

    Finish with :func:`reduce_received_blocks` after the wait.
    """
    return launch_all_to_all(tensor, group_size, group_name)


def reduce_received_blocks(received: torch.Tensor, reduce_op: str, group_size: int) -> torch.Tensor:
    """The reduce-scatter result from :func:`launch_reduce_scatter_one_round`'s blocks, reduced in member order."""
    return reduce_in_dtype(received.unflatten(0, (group_size, -1)), 0, c10d_reduce_op(reduce_op))


def reduce_in_dtype(values: torch.Tensor, dim: int, kind: str) -> torch.Tensor:
    """``values`` reduced over ``dim`` by the c10d reduce op ``kind``, in their own dtype, as a collective does.

    torch's ``sum``/``prod`` promote bool and small integers to int64; a collective keeps the dtype
    (a bool sum is a logical or, integers wrap), and a result reduced locally must agree with one reduced
    by the backend: same values, same dtype.
    """
    if kind == "sum":
        return values.sum(dim, dtype=values.dtype)
    if kind == "product":
        return values.prod(dim, dtype=values.dtype)
    if kind == "max":
        return values.amax(dim)
    if kind == "min":
        return values.amin(dim)
    raise ValueError(f"cannot reduce with c10d reduce op {kind!r}; expected one of sum, product, max, min")


def launch_all_gather_one_round(tensor: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """:func:`launch_all_gather`'s result in one round (unwaited): this rank's ``tensor`` goes to every member."""
    tensor = tensor.contiguous()
    repeated = tensor.unsqueeze(0).expand(group_size, *tensor.shape).reshape(group_size * tensor.size(0), *tensor.shape[1:])
    return launch_all_to_all(repeated, group_size, group_name)


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """Wait for the collective that produces ``tensor``."""
    if getattr(tensor, _ARRIVED, False):
        return tensor
    return _functional.wait_tensor(tensor)


def _to_wire(tensor: torch.Tensor) -> torch.Tensor:
    """A view the backends can move (gloo has no bool or complex)."""
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.is_complex():
        return torch.view_as_real(tensor)
    return tensor


def _from_wire(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return tensor.view(torch.bool)
    if dtype.is_complex:
        return torch.view_as_complex(tensor)
    return tensor


def broadcast_along_mesh_dim(tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, src: int) -> torch.Tensor:
    """``tensor`` of the rank at index ``src`` along ``mesh_dim``, on every rank of that group."""
    group_name = mesh_dim_group_name(mesh, mesh_dim)
    if _gloo_moves_cuda(tensor, group_name):
        return broadcast_along_mesh_dim(tensor.cpu(), mesh, mesh_dim, src).to(tensor.device)
    wire = _to_wire(tensor.contiguous())
    received = wait(_functional.broadcast.default(wire, src, group_name))
    return _from_wire(received, tensor.dtype)


def scatter_along_mesh_dim(
    tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, tensor_dim: int, src: int, my_index: int
) -> torch.Tensor:
    """This rank's torch.chunk piece (along ``tensor_dim``) of the tensor held at index ``src`` of ``mesh_dim``.

    Every rank must pass a tensor of the source's shape and dtype (``distribute_tensor`` agrees on
    them first): the receive sizes come from it, and gloo fills a larger receive only partly and
    aborts on a smaller one.  One c10d ``scatter`` from the source, as PyTorch's ``distribute_tensor``
    issues (``CommDebugMode`` counts it as ``c10d.scatter_``): pieces are padded to the largest
    one (uneven shards) and trimmed on arrival.  A mesh dim of one rank keeps its tensor.
    """
    group_size = mesh.shape[mesh_dim]
    dim_size = tensor.size(tensor_dim)
    sizes = chunk_sizes(dim_size, group_size)
    if group_size == 1:
        return tensor.contiguous()
    if _gloo_moves_cuda(tensor, mesh_dim_group_name(mesh, mesh_dim)):
        return scatter_along_mesh_dim(tensor.cpu(), mesh, mesh_dim, tensor_dim, src, my_index).to(tensor.device)
    largest = sizes[0]
    # Move the split dim to the front so every piece is one contiguous run of elements.
    front = _to_wire(tensor.movedim(tensor_dim, 0).contiguous())
    received = torch.empty((largest, *front.shape[1:]), dtype=front.dtype, device=front.device)
    pieces: list[torch.Tensor] | None = None
    if my_index == src:
        pieces = []
        for piece in front.split(sizes, dim=0):
            if piece.size(0) < largest:
                padding = piece.new_zeros((largest - piece.size(0), *piece.shape[1:]))
                piece = torch.cat([piece, padding])
            pieces.append(piece.contiguous())
    dist.scatter(received, pieces, group=mesh.get_group(mesh_dim), group_src=src)
    piece = _from_wire(received[: sizes[my_index]], tensor.dtype)
    return piece.movedim(0, tensor_dim).contiguous()


def _wire_factor(dtype: torch.dtype) -> int:
    # view_as_real doubles the element count of complex tensors.
    return 2 if dtype.is_complex else 1


def all_gather_rows_over_mesh(mesh: DeviceMesh, row: Sequence[int]) -> torch.Tensor:
    """Every rank's ``row`` of ints, as a tensor of shape ``(*mesh.shape, len(row))`` (on every rank)."""
    table = torch.tensor([list(row)], dtype=torch.int64, device=mesh.device_type)
    for mesh_dim in reversed(range(mesh.ndim)):
        group_size = mesh.shape[mesh_dim]
        if group_size > 1:
            table = wait(launch_all_gather(table, group_size, mesh_dim_group_name(mesh, mesh_dim)))
    return table.reshape(*mesh.shape, len(row)).cpu()


def all_reduce_along_mesh_dim(tensor: torch.Tensor, reduce_op: str, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """``tensor`` reduced over ``mesh_dim``'s group (waited); Partial reduce ops, avg divided afterwards."""
    reduced = wait(launch_all_reduce(to_reducible(tensor, reduce_op), reduce_op, mesh_dim_group_name(mesh, mesh_dim)))
    if reduce_op == "avg":
        reduced = reduced / mesh.shape[mesh_dim]
    return from_reduced(reduced, reduce_op)


class AsyncCollectiveTensor(funcol.AsyncCollectiveTensor):
    """A redistribution's local result whose last collective may still be in flight.

    It has the final shape, dtype and device, so it can be wrapped into a DTensor and
    its metadata read freely.  The first time any op touches its data it waits for the
    collective (``wait_tensor``), runs the remaining local post-processing (trimming
    padding, local chunks, ...) and from then on stands for that result; ``wait()`` does
    the same explicitly and returns the plain tensor.  Ops on it return plain tensors,
    except pure views (``view``, ``alias``, ``detach``) of a still pending tensor: they
    return another pending tensor, so that ``DTensor.to_local()`` and autograd's aliasing
    do not force the wait.

    A subclass of torch's ``funcol.AsyncCollectiveTensor`` (whose ``elem`` is the collective's
    output as it arrives, with nothing left to do): torch.compile resolves inputs of that class with
    ``trigger_wait()`` before tracing and at every call (AOTAutograd), which here runs the
    post-processing too; dynamo takes it as a traceable wrapper subclass whose one inner tensor is
    the finished result (``__tensor_flatten__`` waits).  So a pending local tensor can enter a
    compiled region, as torch's own can.

    Like every ``torch.ops._c10d_functional`` result, it must eventually be waited
    (used, or ``wait()``-ed) on every rank that launched the collective.
    """

    _pending: torch.Tensor | None
    _finish: Callable[[torch.Tensor], torch.Tensor] | None
    _result: torch.Tensor | None

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls,
        pending: torch.Tensor,
        finish: Callable[[torch.Tensor], torch.Tensor],
        shape: tuple[int, ...],
    ) -> AsyncCollectiveTensor:
        wrapper: AsyncCollectiveTensor = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=pending.dtype, device=pending.device, requires_grad=False
        )
        return wrapper

    def __init__(
        self,
        pending: torch.Tensor,
        finish: Callable[[torch.Tensor], torch.Tensor],
        shape: tuple[int, ...],
    ) -> None:
        self._pending = pending
        self._finish = finish
        self._result = None

    @classmethod
    def _finished(cls, result: torch.Tensor) -> AsyncCollectiveTensor:
        """One whose collective is done: it stands for ``result`` (what ``__tensor_unflatten__`` rebuilds)."""
        done = cls(result, _identity, tuple(result.shape))
        done._result = result
        done._pending = None
        done._finish = None
        return done

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        self.wait()
        return ["_result"], None

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor], meta: Any, outer_size: Any, outer_stride: Any
    ) -> AsyncCollectiveTensor:
        return AsyncCollectiveTensor._finished(inner_tensors["_result"])

    def trigger_wait(self) -> torch.Tensor:
        """torch's name for :meth:`wait` (what torch.compile calls on pending inputs)."""
        return self.wait()

    def _get_acs_underlying_tensor(self) -> torch.Tensor:
        return self.wait()

    @property
    def elem(self) -> torch.Tensor:  # type: ignore[override]
        """torch's field for the tensor it stands for: here the finished result (waits)."""
        return self.wait()

    def wait(self) -> torch.Tensor:
        """Wait for the collective and return the finished local tensor (a plain tensor)."""
        result = self._result
        if result is None:
            assert self._pending is not None and self._finish is not None
            result = self._finish(_functional.wait_tensor(self._pending))
            if tuple(result.shape) != tuple(self.shape):
                raise AssertionError(
                    f"asynchronous redistribution produced shape {tuple(result.shape)}, "
                    f"announced {tuple(self.shape)}"
                )
            self._result = result
            self._pending = None
            self._finish = None
        return result

    @property
    def completed(self) -> bool:  # type: ignore[override]
        """Whether the collective has been waited for."""
        return self._result is not None

    def __repr__(self) -> str:  # type: ignore[override]
        return f"AsyncCollectiveTensor({self.wait()!r})"

    def numpy(self, *, force: bool = False) -> Any:
        return self.wait().numpy(force=force)

    def tolist(self) -> Any:
        return self.wait().tolist()

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in _DEFERRABLE_VIEWS and args and isinstance(args[0], AsyncCollectiveTensor):
            source = args[0]
            rest, kwargs_ = args[1:], kwargs or {}
            if source._result is None and not _holds_async(rest, kwargs_):
                # A view needs no data: hand back another pending tensor (to_local() and
                # autograd alias their input; that must not force the wait).
                shape = func(torch.empty(source.shape, dtype=source.dtype, device="meta"), *rest, **kwargs_).shape
                return AsyncCollectiveTensor(source, _ApplyAfterWait(func, rest, kwargs_), tuple(shape))

        def finished(tensor: AsyncCollectiveTensor) -> torch.Tensor:
            return tensor.wait()

        args = tree_map_only(AsyncCollectiveTensor, finished, args)
        kwargs = tree_map_only(AsyncCollectiveTensor, finished, kwargs or {})
        return func(*args, **kwargs)


_aten = torch.ops.aten
_DEFERRABLE_VIEWS = frozenset(
    {_aten.view.default, _aten.alias.default, _aten._unsafe_view.default, _aten.detach.default}
)


def _holds_async(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    found: list[bool] = []

    def note(tensor: AsyncCollectiveTensor) -> AsyncCollectiveTensor:
        found.append(True)
        return tensor

    tree_map_only(AsyncCollectiveTensor, note, (args, kwargs))
    return bool(found)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _ApplyAfterWait:
    """Finishes a deferred view: the view op applied to the waited source."""

    __slots__ = ("func", "args", "kwargs")

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs

    def __call__(self, waited: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.func(waited, *self.args, **self.kwargs)
        return result


# What an asynchronous redistribution returns while its last collective is in flight: ours (something
# remains to do on arrival), or torch's functional-collectives tensor (nothing does: as PyTorch's DTensor).
PENDING_TENSOR_TYPES: tuple[type[torch.Tensor], ...] = (AsyncCollectiveTensor, funcol.AsyncCollectiveTensor)


def wait_local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or the finished plain tensor when it is pending (:data:`PENDING_TENSOR_TYPES`)."""
    if isinstance(tensor, PENDING_TENSOR_TYPES):
        return cast(AsyncCollectiveTensor, tensor).wait()  # (both kinds have wait())
    return tensor
