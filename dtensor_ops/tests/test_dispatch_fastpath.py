"""The C++ fast path of dispatch's cache hit (``_fastpath_ext``) against the Python path it mirrors.

* Over a corpus of real calls (an OpInfo sweep of common ops on 1-D and 2x2 meshes, on rank
  threads), the C++ key of every call it keys equals the Python key builder's (equal and equally
  hashed, so both find the same decision), and it keys most of them.
* On 4 gloo ranks a tensor-parallel MLP step gives bit-identical results with the C++ hit and with
  the Python path, and the C++ hit really serves calls.
* Without the extension (absent, or ``SHARDWISE_DISPATCH_FASTPATH=python``) the package runs in
  pure Python; a bad switch value is refused with the variable's name.

Tests needing the compiled module are skipped where it is not built.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from typing import Any, Iterator

import pytest
import torch

import shardwise.dtensor_ops._dispatch as dispatch
from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops import _decision_cache
from shardwise.dtensor_ops._fastpath import ENV_VAR, extension
from shardwise.mesh import init_device_mesh
from shardwise.testing import multi_rank

_extension = extension()
needs_extension = pytest.mark.skipif(_extension is None, reason="the C++ extension _fastpath_ext is not built here")

_CORPUS_OPS = (
    "add", "sub", "mul", "div", "neg", "abs", "exp", "tanh", "sigmoid", "nn.functional.relu",
    "nn.functional.gelu", "nn.functional.silu", "clamp", "where", "pow", "rsqrt", "mm", "matmul",
    "bmm", "addmm", "nn.functional.linear", "sum", "mean", "amax", "softmax", "log_softmax", "view",
    "reshape", "t", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "expand", "cat",
    "split", "chunk", "narrow", "select", "zeros_like", "ones_like", "full_like", "fill", "masked_fill",
    "nn.functional.layer_norm", "nn.functional.embedding", "cumsum", "topk", "eq", "gt", "maximum",
)  # fmt: skip


class _KeyComparison:
    """Every DTensor dispatch call seen: how many the C++ keyed, and where its key differed."""

    def __init__(self) -> None:
        self.calls = 0
        self.keyed = 0
        self.mismatches: list[str] = []

    def check(self, func: Any, args: tuple[Any, ...]) -> None:
        assert _extension is not None
        self.calls += 1
        cpp_key = _extension.call_key(func, args)
        if cpp_key is None:
            return
        self.keyed += 1
        spec_args = [arg._spec if type(arg) is DTensor else arg for arg in args]
        python_key = _decision_cache.call_key(func, spec_args)
        if cpp_key != python_key or hash(cpp_key) != hash(python_key):
            self.mismatches.append(f"{func}: C++ {cpp_key!r} != Python {python_key!r}")


@contextlib.contextmanager
def comparing_keys() -> Iterator[_KeyComparison]:
    """Compare both key builders on every DTensor op called inside (any thread), before it runs."""
    comparison = _KeyComparison()
    original = DTensor.__dict__["__torch_dispatch__"]

    def recording(cls: type, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if not kwargs:
            comparison.check(func, args)
        return dispatch.torch_dispatch(cls, func, types, args, kwargs)

    DTensor.__torch_dispatch__ = classmethod(recording)  # type: ignore[assignment]
    try:
        yield comparison
    finally:
        DTensor.__torch_dispatch__ = original


@needs_extension
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_cpp_keys_equal_python_keys_over_an_op_sweep(mesh_shape: tuple[int, ...]) -> None:
    from shardwise.testing._opinfo_sweep import ShardwiseBackend, SweepConfig, plan_sweep, run_sweep

    config = SweepConfig(
        mesh_shape=mesh_shape, op_patterns=_CORPUS_OPS, samples_per_op=2, shardings_per_sample=3, candidate_samples=8
    )
    with comparing_keys() as comparison:
        report = run_sweep(ShardwiseBackend(), plan_sweep(config))
    assert report is not None
    assert not comparison.mismatches, "\n".join(comparison.mismatches[:10])
    # Not vacuous: a real corpus, most of it on the flat path the C++ keys.
    assert comparison.calls > 500, comparison.calls
    assert comparison.keyed > comparison.calls // 2, (comparison.keyed, comparison.calls)


@needs_extension
def test_cpp_keys_of_argument_kinds() -> None:
    assert _extension is not None
    add, view = torch.ops.aten.add.Tensor, torch.ops.aten.view.default
    # Not DTensors: only the argument kinds matter to the key.
    assert _extension.call_key(view, ("x", [2, 3])) == _decision_cache.call_key(view, ["x", [2, 3]])
    assert _extension.call_key(add, (True, None, 3)) == _decision_cache.call_key(add, [True, None, 3])
    # A list holding something other than exact ints, a plain tensor, a SymInt-like value: the Python path keys it.
    assert _extension.call_key(view, ("x", [2, True])) is None
    assert _extension.call_key(add, (torch.ones(()), 1)) is None
    assert _extension.call_key(add, (object(),)) is None


def _tp_mlp_step(use_cpp: bool) -> tuple[list[torch.Tensor], int]:
    """One forward/backward of a column- then row-sharded MLP; this rank's gradients and C++ hits served."""
    mesh = init_device_mesh("cpu", (4,))
    generator = torch.Generator().manual_seed(3)
    w1 = distribute_tensor(torch.randn(16, 8, generator=generator), mesh, [Shard(0)]).requires_grad_(True)
    w2 = distribute_tensor(torch.randn(8, 16, generator=generator), mesh, [Shard(1)]).requires_grad_(True)
    x = distribute_tensor(torch.randn(6, 8, generator=generator), mesh, [Replicate()])
    served = [0]
    cpp_hit = dispatch._cpp_hit

    def counting(func: Any, args: tuple[Any, ...]) -> Any:
        assert cpp_hit is not None
        result = cpp_hit(func, args)
        served[0] += result is not None
        return result

    dispatch._cpp_hit = counting if use_cpp else None
    try:
        for _ in range(3):  # the first step fills the caches; later ones hit them
            hidden = torch.nn.functional.linear(x, w1).relu() * 0.5
            partial_out = torch.nn.functional.linear(hidden, w2)
            assert isinstance(partial_out, DTensor)
            out = partial_out.redistribute(mesh, [Replicate()])
            (out.sin() + 1.0).sum().backward()
    finally:
        dispatch._cpp_hit = cpp_hit
    grads = [w1.grad.to_local().clone(), w2.grad.to_local().clone(), out.to_local().clone()]  # type: ignore[union-attr]
    return grads, served[0]


@needs_extension
@multi_rank(world_size=4)
def test_a_tp_step_is_identical_with_and_without_the_cpp_hit() -> None:
    assert dispatch._cpp_hit is not None
    with_cpp, served = _tp_mlp_step(use_cpp=True)
    python_only, served_by_python = _tp_mlp_step(use_cpp=False)
    assert served > 10 and served_by_python == 0
    for a, b in zip(with_cpp, python_only):
        assert torch.equal(a, b)


_PURE_PYTHON_SCRIPT = textwrap.dedent(
    """
    import os, sys
    if sys.argv[1] == "absent":
        sys.modules["shardwise.dtensor_ops._fastpath_ext"] = None  # import of it raises ImportError
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
    import shardwise.dtensor_ops._dispatch as dispatch
    from shardwise.dtensor_ops import Replicate, Shard, distribute_tensor
    from shardwise.mesh import init_device_mesh
    assert dispatch._cpp_hit is None, dispatch._cpp_hit
    mesh = init_device_mesh("cpu", (1,))
    a = distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Shard(0)])
    for _ in range(2):
        b = (a * 2.0 + a).view(3, 2).sum(0)
    assert torch.equal(b.full_tensor(), (torch.arange(6.0).reshape(2, 3) * 3.0).view(3, 2).sum(0))
    dist.destroy_process_group()
    print("pure python ok")
    """
)


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.parametrize("how", ["absent", "switched_off"])
def test_the_package_runs_in_pure_python_without_the_extension(how: str) -> None:
    env = dict(os.environ)
    env[ENV_VAR] = "python" if how == "switched_off" else "cpp"
    done = subprocess.run(
        [sys.executable, "-c", _PURE_PYTHON_SCRIPT, how, _free_port()],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "pure python ok" in done.stdout, done.stderr[-3000:]


def test_a_bad_switch_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.dtensor_ops._fastpath import fast_hit, selected_path

    monkeypatch.setenv(ENV_VAR, "rust")
    with pytest.raises(ValueError, match=f"{ENV_VAR}='rust': expected one of"):
        selected_path()
    monkeypatch.setenv(ENV_VAR, "python")
    assert fast_hit(DTensor) is None
