"""The Bazel-built ``_fastpath_ext`` (SHARDWISE_FASTPATH_EXT) loads, and keys calls as the Python path does.

Ranks are threads: a tensor-parallel MLP's forward and backward on a 1-D and a 2x2 mesh, every
DTensor op's key built by both key builders before it runs.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import shardwise.dtensor_ops._dispatch as dispatch
from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops import _decision_cache
from shardwise.dtensor_ops._fastpath import INTERFACE_VERSION, PATH_ENV_VAR, extension
from shardwise.mesh import init_device_mesh
from shardwise.testing import run_on_threads


def test_the_built_module_is_the_one_dispatch_uses() -> None:
    assert os.environ.get(PATH_ENV_VAR), f"{PATH_ENV_VAR} should name the Bazel-built module"
    module = extension()
    assert module is not None and module.INTERFACE_VERSION == INTERFACE_VERSION
    assert module.__file__ is not None and os.path.samefile(module.__file__, os.environ[PATH_ENV_VAR])
    assert dispatch._cpp_hit is not None


class _Comparison:
    """Both key builders on every DTensor op called (from any rank thread) while installed."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.keyed: list[int] = []
        self.mismatches: list[str] = []

    def __call__(self, cls: type, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        module = extension()
        assert module is not None
        if not kwargs:
            self.seen.append(1)
            cpp_key = module.call_key(func, args)
            if cpp_key is not None:
                self.keyed.append(1)
                python_key = _decision_cache.call_key(func, [a._spec if type(a) is DTensor else a for a in args])
                if cpp_key != python_key or hash(cpp_key) != hash(python_key):
                    self.mismatches.append(f"{func}: {cpp_key!r} != {python_key!r}")
        return dispatch.torch_dispatch(cls, func, types, args, kwargs)


def _mlp_on_meshes() -> None:
    for mesh_shape in [(4,), (2, 2)]:
        mesh = init_device_mesh("cpu", mesh_shape)
        inner = [Shard(0)] if len(mesh_shape) == 1 else [Replicate(), Shard(0)]
        outer = [Shard(1)] if len(mesh_shape) == 1 else [Replicate(), Shard(1)]
        replicated = [Replicate()] * len(mesh_shape)
        generator = torch.Generator().manual_seed(5)
        w1 = distribute_tensor(torch.randn(16, 8, generator=generator), mesh, inner).requires_grad_(True)
        w2 = distribute_tensor(torch.randn(8, 16, generator=generator), mesh, outer).requires_grad_(True)
        x = distribute_tensor(torch.randn(6, 8, generator=generator), mesh, replicated)
        for _ in range(2):
            hidden = torch.nn.functional.linear(x, w1).relu() * 0.5
            out = torch.nn.functional.linear(hidden, w2).view(2, 3, 8).sum(1)
            (out.sin() + 1.0).sum().backward()


def test_cpp_keys_equal_python_keys_on_a_tp_mlp() -> None:
    comparison = _Comparison()
    original = DTensor.__dict__["__torch_dispatch__"]
    DTensor.__torch_dispatch__ = classmethod(comparison)  # type: ignore[assignment]
    try:
        run_on_threads(_mlp_on_meshes, world_size=4)
    finally:
        DTensor.__torch_dispatch__ = original
    assert not comparison.mismatches, "\n".join(comparison.mismatches[:10])
    seen, keyed = len(comparison.seen), len(comparison.keyed)
    assert seen > 100 and keyed > seen // 2, (seen, keyed)
