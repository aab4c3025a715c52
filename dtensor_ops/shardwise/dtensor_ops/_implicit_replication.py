"""Whether plain tensors mixed with DTensors count as replicated.

Two cases: inside ``experimental.implicit_replication()`` (the user vouches that every rank holds
the same value), and inside one of torch's built-in backward formulas. A built-in formula sees
only DTensors from the user (saved inputs, incoming gradients) and makes its plain tensors itself,
from global sizes and constants (``zeros``, ``ones``, ``arange``, index tensors...), identical on
every rank: replicated by construction. A custom ``autograd.Function``'s backward is user code
that could build rank-local plain tensors, so it gets the usual error.

Two scopes. The user's ``implicit_replication()`` is process-wide, as PyTorch's is: it must reach autograd's
device threads (on CUDA a backward runs there) and every rank thread of the threaded test world. The
decision pipeline's own entry around a decomposition (``replicated_within_this_thread``) is per thread: it
vouches only for the plain tensors that decomposition makes, and must not open the context for another
thread's unrelated ops.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["implicit_replication", "is_implicit_replication_enabled", "replicated_within_this_thread"]

_user_depth = 0  # open implicit_replication() contexts, process-wide
_THREAD = threading.local()  # .depth: open replicated_within_this_thread() contexts on this thread
_current_autograd_node = torch._C._current_autograd_node
# Nodes of custom autograd.Functions are instances of this Python class; built-in nodes are not.
_CustomFunctionNode: type = torch.autograd.function.BackwardCFunction


def is_implicit_replication_enabled() -> bool:
    return _user_depth > 0 or getattr(_THREAD, "depth", 0) > 0 or _in_builtin_backward_formula()


def _in_builtin_backward_formula() -> bool:
    node = _current_autograd_node()
    return node is not None and not isinstance(node, _CustomFunctionNode)


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside this context a plain ``torch.Tensor`` used with DTensors counts as replicated.

    Every rank must hold the same value for that tensor; nothing checks it.
    """
    global _user_depth
    _user_depth += 1
    try:
        yield
    finally:
        _user_depth -= 1


@contextlib.contextmanager
def replicated_within_this_thread() -> Iterator[None]:
    """``implicit_replication`` for this thread only: the decision pipeline's, around a decomposition."""
    depth = getattr(_THREAD, "depth", 0)
    _THREAD.depth = depth + 1
    try:
        yield
    finally:
        _THREAD.depth = depth
