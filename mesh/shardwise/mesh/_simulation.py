"""Every rank in one process: what a mesh reports under torch's ``LocalTensorMode``.

``torch.distributed._local_tensor.LocalTensorMode`` (PyTorch 2.13) simulates all ranks of a
world in one process over a "fake" process group: a ``LocalTensor`` holds one tensor per
simulated rank, and an int that differs between ranks is a ``SymInt`` over a ``LocalIntNode``
(``{rank: value}``). The process itself is rank 0, so a mesh built there knows rank 0 only.

This module is how a mesh answers "which rank am I" in that world:

* no mode enabled and no rank pinned (every real run): the mesh's own rank, nothing changes;
* a rank pinned with :func:`as_simulated_rank` (what :func:`run_for_each_simulated_rank` does
  around each rank's call): that rank's rank, coordinate and local ranks, as plain ints;
* a ``LocalTensorMode`` enabled, no rank pinned: every simulated rank at once, as
  ``LocalIntNode`` SymInts (what PyTorch's patched ``DeviceMesh`` returns, so test code that
  reads ``mesh.get_local_rank()`` or ``self.rank`` sees each rank's value).

Code whose result depends on the rank (local shapes and offsets, the shard a rank keeps, its
random stream) runs through :func:`run_for_each_simulated_rank`: once per simulated rank with
that rank pinned and the mode disabled, ``LocalTensor`` arguments replaced by the rank's own
tensor; the results are joined back into ``LocalTensor``s and ``LocalIntNode`` SymInts.

Nothing here imports ``torch.distributed._local_tensor`` unless something else already did: a
process that never simulates ranks pays one ``sys.modules`` lookup per question.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "as_simulated_rank",
    "first_simulated_piece",
    "is_local_tensor",
    "join_rank_values",
    "local_tensor_pieces",
    "mode_disabled",
    "per_rank_int",
    "pinned_rank",
    "rank_of_piece",
    "run_for_each_simulated_rank",
    "simulated_ranks",
    "simulated_view",
]

_LOCAL_TENSOR_MODULE = "torch.distributed._local_tensor"

_R = TypeVar("_R")


class _Pinned(threading.local):
    def __init__(self) -> None:
        self.rank: int | None = None


_pinned = _Pinned()


def pinned_rank() -> int | None:
    """The simulated rank pinned on this thread (:func:`as_simulated_rank`), or None."""
    return _pinned.rank


def _enabled_mode() -> Any:
    """The enabled ``LocalTensorMode`` on this thread, or None.

    The module may be in ``sys.modules`` half imported (another thread importing it right now); no
    mode can be enabled before its import finishes, so a missing function means none is.
    """
    module = sys.modules.get(_LOCAL_TENSOR_MODULE)
    enabled_mode = getattr(module, "enabled_local_tensor_mode", None)
    return enabled_mode() if enabled_mode is not None else None


def simulated_ranks() -> frozenset[int] | None:
    """The ranks of the enabled ``LocalTensorMode`` on this thread, or None when none is enabled."""
    mode = _enabled_mode()
    if mode is None:
        return None
    ranks: frozenset[int] = mode.ranks
    return ranks


def simulated_view() -> int | frozenset[int] | None:
    """What a mesh answers for: a pinned rank, every simulated rank, or None (its own rank)."""
    rank = _pinned.rank
    if rank is not None:
        return rank
    if _LOCAL_TENSOR_MODULE not in sys.modules:
        return None
    return simulated_ranks()


@contextlib.contextmanager
def as_simulated_rank(rank: int) -> Iterator[None]:
    """Meshes on this thread report ``rank``'s rank and coordinates inside the block."""
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"as_simulated_rank expects a global rank (an int >= 0), got {rank!r}")
    previous = _pinned.rank
    _pinned.rank = rank
    try:
        yield
    finally:
        _pinned.rank = previous


@contextlib.contextmanager
def mode_disabled() -> Iterator[None]:
    """The enabled ``LocalTensorMode`` (if any) disabled inside the block: ops on plain tensors stay plain."""
    mode = _enabled_mode()
    if mode is None:
        yield
        return
    with mode.disable():
        yield


def per_rank_int(values: dict[int, int]) -> int | torch.SymInt:
    """One int per simulated rank: a plain int when all agree, else a ``LocalIntNode`` SymInt."""
    first = next(iter(values.values()))
    if all(value == first for value in values.values()):
        return first
    module = sys.modules[_LOCAL_TENSOR_MODULE]
    return torch.SymInt(module.LocalIntNode(dict(values)))


def is_local_tensor(value: object) -> bool:
    """Whether ``value`` is a ``LocalTensor`` (one tensor per simulated rank)."""
    module = sys.modules.get(_LOCAL_TENSOR_MODULE)
    return module is not None and isinstance(value, module.LocalTensor)


def local_tensor_pieces(tensor: torch.Tensor, ranks: frozenset[int]) -> dict[int, torch.Tensor]:
    """Each rank's tensor: a ``LocalTensor``'s own pieces, or ``tensor`` itself for every rank."""
    if is_local_tensor(tensor):
        pieces: dict[int, torch.Tensor] = dict(tensor._local_tensors)  # type: ignore[attr-defined]
        missing = sorted(ranks - pieces.keys())
        if missing:
            raise ValueError(f"a LocalTensor holds ranks {sorted(pieces)} but ranks {missing} are simulated too")
        return pieces
    return {rank: tensor for rank in ranks}


def first_simulated_piece(tensor: torch.Tensor) -> torch.Tensor:
    """The lowest rank's piece of a ``LocalTensor`` (for metadata every rank shares); ``tensor`` otherwise."""
    if is_local_tensor(tensor):
        pieces = tensor._local_tensors  # type: ignore[attr-defined]
        return pieces[min(pieces)]
    return tensor


def rank_of_piece(value: Any, rank: int) -> Any:
    """``value`` as rank ``rank`` sees it: its piece of a ``LocalTensor``, its int of a ``LocalIntNode``."""
    if isinstance(value, torch.Tensor):
        if is_local_tensor(value):
            return value._local_tensors[rank]  # type: ignore[attr-defined]
        return value
    if isinstance(value, torch.SymInt):
        local_ints = getattr(value.node, "_local_ints", None)
        if local_ints is not None:
            return local_ints[rank]
    return value


def join_rank_values(values: dict[int, Any]) -> Any:
    """One value from each rank's value: tensors -> ``LocalTensor``, ints -> :func:`per_rank_int`.

    Tuples and lists are joined element by element (every rank must give the same length);
    anything else must be equal on every rank.
    """
    first = next(iter(values.values()))
    if isinstance(first, torch.Tensor):
        module = sys.modules[_LOCAL_TENSOR_MODULE]
        return module.LocalTensor({rank: value for rank, value in values.items()})
    if isinstance(first, bool) or first is None:
        if any(value != first for value in values.values()):
            raise ValueError(f"simulated ranks disagree on a value that must be the same on every rank: {values}")
        return first
    if isinstance(first, int):
        return per_rank_int(values)
    if isinstance(first, (tuple, list)):
        lengths = {len(value) for value in values.values()}
        if len(lengths) != 1:
            raise ValueError(f"simulated ranks returned sequences of different lengths: {values}")
        joined = [join_rank_values({rank: value[index] for rank, value in values.items()}) for index in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*joined)
        return type(first)(joined)
    if any(value != first for value in values.values()):
        raise ValueError(f"simulated ranks disagree on a value that must be the same on every rank: {values}")
    return first


def run_for_each_simulated_rank(function: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
    """``function(*args, **kwargs)``, once per simulated rank when a ``LocalTensorMode`` is enabled.

    Without an enabled mode (or with a rank already pinned) it is a plain call. Under the mode
    each rank's call runs with the mode disabled and that rank pinned (meshes report its
    coordinate), on its own piece of every ``LocalTensor`` / ``LocalIntNode`` argument; the
    results are joined with :func:`join_rank_values`. ``function`` must not communicate.
    """
    if _pinned.rank is not None:
        return function(*args, **kwargs)
    ranks = simulated_ranks()
    if ranks is None:
        return function(*args, **kwargs)
    module = sys.modules[_LOCAL_TENSOR_MODULE]
    mode = module.enabled_local_tensor_mode()
    flat, spec = pytree.tree_flatten((args, kwargs))
    results: dict[int, Any] = {}
    with mode.disable():
        for rank in sorted(ranks):
            rank_args, rank_kwargs = pytree.tree_unflatten([rank_of_piece(value, rank) for value in flat], spec)
            with as_simulated_rank(rank):
                results[rank] = function(*rank_args, **rank_kwargs)
    joined: _R = join_rank_values(results)
    return joined
