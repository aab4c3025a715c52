"""The collectives redistribution runs, and the tensor an asynchronous redistribution returns.

Every collective goes through ``torch.ops._c10d_functional`` so that it is traceable by
``torch.compile`` and counted by ``CommDebugMode`` under the op keys PyTorch uses.  The
functional ops return as soon as the collective is launched; their result must pass
through ``torch.ops._c10d_functional.wait_tensor`` before anything reads it.  The
launch helpers below therefore return *unwaited* tensors, and callers either wait right
away (:func:`wait`) or hand the tensor to an :class:`AsyncCollectiveTensor`.

All helpers here work on dim 0 with equal, already padded pieces; the planner's
executor moves the interesting dim to the front and pads/trims around them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map_only

__all__ = [
    "AsyncCollectiveTensor",
    "launch_all_gather",
    "launch_reduce_scatter",
    "launch_all_reduce",
    "launch_all_to_all",
    "wait",
    "wait_local_tensor",
    "c10d_reduce_op",
]

_functional = torch.ops._c10d_functional

# Partial(avg) is reduced as a sum and divided by the group size afterwards: every backend
# supports "sum", not every backend supports "avg".
_C10D_REDUCE_OP = {"sum": "sum", "avg": "sum", "max": "max", "min": "min"}


def c10d_reduce_op(reduce_op: str) -> str:
    """The functional-collective reduce op used for a Partial's ``reduce_op``."""
    try:
        return _C10D_REDUCE_OP[reduce_op]
    except KeyError:
        raise ValueError(
            f"cannot reduce Partial(reduce_op={reduce_op!r}); expected one of {sorted(_C10D_REDUCE_OP)}"
        ) from None


def launch_all_gather(tensor: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Concatenate every group member's ``tensor`` along dim 0 (unwaited)."""
    return _functional.all_gather_into_tensor(tensor.contiguous(), group_size, group_name)


def launch_reduce_scatter(tensor: torch.Tensor, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    """Reduce ``tensor`` over the group and keep this member's equal dim-0 piece (unwaited)."""
    return _functional.reduce_scatter_tensor(tensor.contiguous(), c10d_reduce_op(reduce_op), group_size, group_name)


def launch_all_reduce(tensor: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """Reduce ``tensor`` over the group; every member gets the result (unwaited)."""
    return _functional.all_reduce(tensor.contiguous(), c10d_reduce_op(reduce_op), group_name)


def launch_all_to_all(tensor: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Send dim-0 piece ``i`` of ``tensor`` to member ``i``; piece ``i`` of the result came from member ``i``.

    ``tensor.size(0)`` must be a multiple of ``group_size`` (pieces are equal).
    """
    piece = tensor.size(0) // group_size
    splits = [piece] * group_size
    return _functional.all_to_all_single(tensor.contiguous(), splits, splits, group_name)


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """Wait for the collective that produces ``tensor``."""
    return _functional.wait_tensor(tensor)


class AsyncCollectiveTensor(torch.Tensor):
    """A redistribution's local result whose last collective may still be in flight.

    It has the final shape, dtype and device, so it can be wrapped into a DTensor and
    its metadata read freely.  The first time any op touches its data it waits for the
    collective (``wait_tensor``), runs the remaining local post-processing (trimming
    padding, local chunks, ...) and from then on stands for that result; ``wait()`` does
    the same explicitly and returns the plain tensor.  Ops on it return plain tensors,
    except pure views (``view``, ``alias``, ``detach``) of a still pending tensor: they
    return another pending tensor, so that ``DTensor.to_local()`` and autograd's aliasing
    do not force the wait.

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
    def completed(self) -> bool:
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


def wait_local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or the finished plain tensor when it is an :class:`AsyncCollectiveTensor`."""
    if isinstance(tensor, AsyncCollectiveTensor):
        return tensor.wait()
    return tensor
