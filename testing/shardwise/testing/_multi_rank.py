"""``multi_rank`` and ``run_on_ranks``: run a test body on every rank of a pooled process group."""

from __future__ import annotations

import functools
import os
import pickle
import sys
from typing import Any, Callable, TypeVar, overload

from shardwise.testing import _protocol as protocol
from shardwise.testing import _timeouts
from shardwise.testing._rank_pool import get_pool, pickle_call
from shardwise.testing._rank_worker import RANK_BODY_ATTRIBUTE

WORLD_SIZE_ENV_VAR = "SHARDWISE_TEST_WORLD_SIZE"
BACKEND_ENV_VAR = "SHARDWISE_TEST_BACKEND"


def _default_world_size() -> int:
    # Bazel's sw_multi_rank_test states a target's world size in the environment.
    text = os.environ.get(WORLD_SIZE_ENV_VAR, "").strip()
    if not text:
        return 4
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"environment variable {WORLD_SIZE_ENV_VAR} must be a positive integer, got {text!r}")
    return int(text)


DEFAULT_WORLD_SIZE = _default_world_size()
SUPPORTED_BACKENDS = ("gloo", "nccl")
# A pool whose ranks share the visible GPUs round-robin over gloo (rank % GPU count); see _pool_backend_for.
SHARED_GPU_POOL = protocol.SHARED_GPU_POOL
SHARE_GPUS_ENV_VAR = "SHARDWISE_TEST_SHARE_GPUS"
# Every time limit lives in _timeouts (what a hang is, how limits scale); these names stay importable.
DEFAULT_TIMEOUT_S = _timeouts.DEFAULT_STALL_S
TIMEOUT_ENV_VAR = _timeouts.TIMEOUT_ENV_VAR

_R = TypeVar("_R")
_F = TypeVar("_F", bound=Callable[..., Any])


def resolve_timeout(timeout: float | None) -> float:
    """A task's no-progress window in seconds (see _timeouts): ``timeout``, $SHARDWISE_TEST_TIMEOUT or 120, scaled."""
    return _timeouts.stall_seconds(timeout)


def _validate_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")


def _resolve_backend(backend: str | None) -> str:
    # --config=gpu sets the environment's default backend to nccl for the gpu-tagged targets.
    resolved = backend if backend is not None else (os.environ.get(BACKEND_ENV_VAR) or "gloo")
    if resolved not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"backend must be one of {SUPPORTED_BACKENDS} or None (${BACKEND_ENV_VAR}, else gloo), got {resolved!r}"
        )
    return resolved


def _skip(reason: str) -> None:
    try:
        import pytest
    except ImportError:
        raise RuntimeError(f"cannot run this multi-rank test: {reason}") from None
    pytest.skip(reason)


def _pool_backend_for(backend: str, world_size: int) -> str:
    """The pool that runs a test asking for ``backend`` on ``world_size`` ranks (skips when none can).

    NCCL needs one GPU per rank. With fewer GPUs (at least one) the ranks share them over gloo, CUDA
    tensors and all (``SHARED_GPU_POOL``): the same CUDA kernels, gloo's transport, so a one-GPU
    machine runs the GPU tests. ``$SHARDWISE_TEST_SHARE_GPUS=0`` skips such tests instead.
    """
    if backend != "nccl":
        return backend
    import torch

    if not torch.cuda.is_available():
        _skip(f"backend 'nccl' needs CUDA, which is not available (world_size={world_size})")
    available = torch.cuda.device_count()
    if available >= world_size:
        return backend
    if os.environ.get(SHARE_GPUS_ENV_VAR, "1").strip() == "0":
        _skip(
            f"backend 'nccl' needs one GPU per rank: world_size={world_size} but {available} GPUs are visible "
            f"(${SHARE_GPUS_ENV_VAR}=0: not sharing them over gloo)"
        )
    return SHARED_GPU_POOL


def _module_name_for_ranks(module_name: str) -> str:
    if module_name != "__main__":
        return module_name
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return str(spec.name)  # started with ``python -m package.module``
    # A script run by path: the ranks load its file under a name other than __main__, so its
    # ``if __name__ == "__main__":`` block does not run there.
    return "__shardwise_main__"


def function_ref(fn: Callable[..., Any]) -> protocol.FunctionRef:
    """How the ranks find ``fn``: it must be reachable by module and qualified name."""
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        raise TypeError(f"run_on_ranks needs a module-level function, got {fn!r}")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"{module_name}.{qualname} is not defined at module level: the rank processes find the function "
            "to run by its module and name, so define it at the top level of a module"
        )
    module = sys.modules.get(module_name)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
    while target is not fn and hasattr(target, RANK_BODY_ATTRIBUTE):
        target = getattr(target, RANK_BODY_ATTRIBUTE)
    if target is not fn:
        raise TypeError(
            f"{module_name}.{qualname} does not name the function given to run_on_ranks "
            f"({fn!r}): the rank processes would run something else"
        )
    module_file = getattr(module, "__file__", None)
    loader_type = type(getattr(module, "__loader__", None))
    return protocol.FunctionRef(
        module_name=_module_name_for_ranks(module_name),
        qualname=qualname,
        file=os.path.realpath(module_file) if isinstance(module_file, str) else None,
        assert_rewrite=loader_type.__name__ == "AssertionRewritingHook",
    )


def run_on_ranks(
    fn: Callable[..., _R],
    *args: Any,
    world_size: int = DEFAULT_WORLD_SIZE,
    backend: str | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> list[_R]:
    """Run the module-level ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    Every rank has a fresh default process group (``backend`` "gloo" on CPU when None, or "nccl"
    with one GPU per rank; with fewer GPUs than ranks, gloo with the ranks sharing the GPUs) for the
    duration of the call. Raises ``MultiRankError`` naming the
    ranks that raised (with the first one's traceback), died, or made no progress (no CPU used by
    any rank or a process it started) for ``timeout`` seconds (default: $SHARDWISE_TEST_TIMEOUT,
    else 120 s; both times $SHARDWISE_TEST_TIMEOUT_SCALE); see ``shardwise.testing._timeouts``.
    """
    __tracebackhide__ = True  # pytest: the failure is the ranks', not this frame's
    _validate_world_size(world_size)
    resolved_backend = _resolve_backend(backend)
    timeout_s = resolve_timeout(timeout)
    reference = function_ref(fn)
    payload = pickle_call(args, kwargs, reference.describe())
    pool = get_pool(world_size, _pool_backend_for(resolved_backend, world_size), _timeouts.startup_seconds(timeout_s))
    results = pool.run(reference, payload, timeout_s=timeout_s, description=reference.describe())
    skip_reasons = {result.skip_reason for result in results if result.skip_reason is not None}
    if skip_reasons:
        _skip("; ".join(sorted(skip_reasons)))
    values: list[_R] = []
    for result in results:
        assert result.pickled_value is not None
        values.append(pickle.loads(result.pickled_value))
    return values


@overload
def multi_rank(fn: _F, /) -> _F: ...


@overload
def multi_rank(
    *, world_size: int = DEFAULT_WORLD_SIZE, backend: str | None = None, timeout: float | None = None
) -> Callable[[_F], _F]: ...


def multi_rank(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    world_size: int = DEFAULT_WORLD_SIZE,
    backend: str | None = None,
    timeout: float | None = None,
) -> Any:
    """Decorate a module-level test function so that pytest runs its body on every rank.

    Usable as ``@multi_rank`` or ``@multi_rank(world_size=2, backend="nccl", timeout=30)``; the
    test's parameters (``pytest.mark.parametrize`` above it, fixtures) are pickled to the ranks.
    """
    _validate_world_size(world_size)
    _resolve_backend(backend)
    if timeout is not None:
        resolve_timeout(timeout)

    def decorate(body: _F) -> _F:
        if not callable(body):
            raise TypeError(f"multi_rank decorates a test function, got {body!r}")

        @functools.wraps(body)
        def run_test_on_ranks(*args: Any, **kwargs: Any) -> None:
            __tracebackhide__ = True
            run_on_ranks(body, *args, world_size=world_size, backend=backend, timeout=timeout, **kwargs)

        setattr(run_test_on_ranks, RANK_BODY_ATTRIBUTE, body)
        wrapped: _F = run_test_on_ranks  # type: ignore[assignment]
        return wrapped

    if fn is not None:
        return decorate(fn)
    return decorate
