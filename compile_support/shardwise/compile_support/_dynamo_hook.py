"""Run a callback once ``torch._dynamo`` is imported, without importing it ourselves.

``torch.compiler.allow_in_graph`` imports ``torch._dynamo`` (about a second on a CPU machine), which a
user who never compiles should not pay at ``import shardwise.dtensor_ops``.  Dynamo is imported by the
first ``torch.compile`` call, before anything is traced, so registering right after its import is in time.
The hook is a standard ``sys.meta_path`` finder that wraps the loader of ``torch._dynamo`` and removes
itself; it touches nothing of dynamo but its public ``allow_in_graph``, called by the callback.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Callable, Sequence

__all__ = ["after_dynamo_import"]

_DYNAMO = "torch._dynamo"
_callbacks: list[Callable[[], None]] = []
_lock = threading.Lock()


def _run_callbacks() -> None:
    with _lock:
        pending = list(_callbacks)
        _callbacks.clear()
    for callback in pending:
        callback()


class _RunAfterExec(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run_callbacks()


class _DynamoImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO:
            return None
        _remove_finder()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RunAfterExec(spec.loader)
        return spec


_finder: _DynamoImportFinder | None = None


def _remove_finder() -> None:
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None


def after_dynamo_import(callback: Callable[[], None]) -> None:
    """Call ``callback`` now if ``torch._dynamo`` is imported, else right after its import."""
    global _finder
    if _DYNAMO in sys.modules:
        callback()
        return
    with _lock:
        _callbacks.append(callback)
        if _finder is None:
            _finder = _DynamoImportFinder()
            sys.meta_path.insert(0, _finder)
