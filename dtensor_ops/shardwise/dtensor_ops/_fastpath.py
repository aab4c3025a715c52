"""The optional C++ fast path of dispatch's cache hit, and the switch that selects it.

``_fastpath_ext`` (built from ``dtensor_ops/csrc/fastpath.cpp``) computes the decision-cache key of
the flat fast path, looks the decision up and, for a *simple* decision (nothing to move, override
or draw), runs the local op and builds the wrapper.  Anything else it hands back (``None``) and the
Python path runs: the Python key builder (``_decision_cache``) stays the reference and the fallback.

``SHARDWISE_DISPATCH_FASTPATH`` selects the path, read once at import: ``cpp`` (the default) uses
the extension where it is installed, ``python`` never does.  Where the extension is absent (a
source checkout without the build, another platform) the package works the same in pure Python.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Callable

import torch

from . import _decision_cache

__all__ = [
    "ENV_VAR",
    "INTERFACE_VERSION",
    "PATH_ENV_VAR",
    "FastHit",
    "cpp_hit_count",
    "extension",
    "fast_hit",
    "reset_cpp_hit_count",
    "selected_path",
]

ENV_VAR = "SHARDWISE_DISPATCH_FASTPATH"
PATH_ENV_VAR = "SHARDWISE_FASTPATH_EXT"
# The version of fastpath.cpp's interface this module configures (its INTERFACE_VERSION).
INTERFACE_VERSION = 3
_PATHS = ("cpp", "python")

FastHit = Callable[[Any, tuple[Any, ...]], Any]

# The extension fast_hit configured (None while dispatch runs in pure Python): its hit counter is
# the C++ share of debug._get_fast_path_sharding_prop_cache_stats().
_configured: ModuleType | None = None


def selected_path() -> str:
    """``"cpp"`` or ``"python"``, from ``SHARDWISE_DISPATCH_FASTPATH`` (default ``cpp``)."""
    value = os.environ.get(ENV_VAR, "cpp").strip().lower() or "cpp"
    if value not in _PATHS:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {_PATHS} (unset means 'cpp')")
    return value


def extension() -> ModuleType | None:
    """The compiled ``_fastpath_ext`` module, or None where it is not installed.

    ``SHARDWISE_FASTPATH_EXT=<path of a built .so>`` loads it from there instead (a Bazel build
    output, which does not sit inside the package).
    """
    name = __package__ + "._fastpath_ext"
    path = os.environ.get(PATH_ENV_VAR)
    try:
        if path and name not in sys.modules:
            loader = importlib.machinery.ExtensionFileLoader(name, path)
            spec = importlib.util.spec_from_file_location(name, path, loader=loader)
            if spec is None:
                return None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            sys.modules[name] = module
            return module
        # By name: the extension is a leaf (it imports nothing of the package).
        return importlib.import_module(name)
    except ImportError:
        return None


def fast_hit(dtensor_type: type) -> FastHit | None:
    """``try_hit(op, args)`` of the extension, set up for ``dtensor_type``; None for the Python path.

    ``try_hit`` returns the wrapped result of a cache hit whose decision is simple, else None.
    """
    if selected_path() != "cpp":
        return None
    module = extension()
    if module is None or getattr(module, "INTERFACE_VERSION", None) != INTERFACE_VERSION:
        return None  # not built, or built from another version of fastpath.cpp: pure Python
    module.configure(
        dtensor_type,
        _decision_cache,
        _decision_cache.SELF_KEYED_TYPES,
        _decision_cache._FLOAT_VALUES_MATTER,
        torch.Tensor._make_wrapper_subclass,
        torch._ops.OpOverload,
    )
    global _configured
    _configured = module
    hit: FastHit = module.try_hit
    return hit


def cpp_hit_count() -> int:
    """Cache hits the C++ fast path served since the last :func:`reset_cpp_hit_count` (0 in pure Python)."""
    return 0 if _configured is None else int(_configured.hit_count())


def reset_cpp_hit_count() -> None:
    if _configured is not None:
        _configured.reset_hit_count()
