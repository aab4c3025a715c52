"""Output metadata by shape rules must equal what the op gives on meta tensors.

Propagation computes the global shape/stride/dtype of outputs by shape rules
(fast, no meta tensors, no torch._dynamo import) and falls back to running the
op on meta tensors whenever a rule is unsure.  Here both are computed for many
calls; a rule may decline (None) but must never disagree.
"""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import pytest
import torch

from shardwise.dtensor_ops._ops import registered_ops, rule_for
from shardwise.dtensor_ops._propagation import run_on_meta as _run_on_meta
from shardwise.placement import DTensorSpec, Replicate, TensorMeta
from shardwise.testing import FakeMesh

aten = torch.ops.aten


MESH = FakeMesh((4,))


def t(*shape: int, dtype: torch.dtype = torch.float32, stride: Sequence[int] | None = None) -> DTensorSpec[Any]:
    strides = tuple(stride) if stride is not None else torch.empty(shape).stride()
    return DTensorSpec(MESH, (Replicate(),), TensorMeta(torch.Size(shape), strides, dtype))


TRANSPOSED_5x3 = t(5, 3, stride=(1, 5))  # a [3, 5] tensor seen through .t()
EXPANDED_5x3 = t(5, 3, stride=(0, 1))  # a [3] tensor expanded, as gradients of sum() are


@dataclass(frozen=True)
class Call:
    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    answered_by_shape_rule: bool = True  # False: the rule must decline (meta tensors decide)

    def __str__(self) -> str:
        return str(self.op)


CALLS: list[Call] = [
    Call(aten.add.Tensor, (t(5, 3), t(3)), {}),
    Call(aten.add.Tensor, (t(5, 1), t(1, 3)), {}),
    Call(aten.add.Tensor, (t(5, 3), 2.5), {}),
    Call(aten.add.Tensor, (t(5, 3, dtype=torch.int32), 2.5), {}),
    Call(aten.add.Tensor, (t(5, 3, dtype=torch.int32), t(dtype=torch.float64)), {}),
    Call(aten.add.Tensor, (t(5, 3, dtype=torch.float16), t(3, dtype=torch.float32)), {}),
    Call(aten.add.Tensor, (TRANSPOSED_5x3, t(5, 3)), {}, answered_by_shape_rule=False),  # layout: meta decides
    Call(aten.add.Tensor, (t(5, 3), t(4, 3)), {}, answered_by_shape_rule=False),  # does not broadcast
    Call(aten.add_.Tensor, (t(5, 3), t(3)), {}),
    Call(aten.div.Tensor, (t(5, 3, dtype=torch.int64), t(5, 3, dtype=torch.int64)), {}),
    Call(aten.div.Tensor_mode, (t(5, 3, dtype=torch.int64), 2), {"rounding_mode": "floor"}),
    Call(aten.eq.Tensor, (t(5, 3), t(5, 3)), {}),
    Call(aten.lt.Scalar, (t(5, 3), 0), {}),
    Call(aten.sigmoid.default, (t(5, 3, dtype=torch.int32),), {}),
    Call(aten.abs.default, (t(5, 3, dtype=torch.complex64),), {}),
    Call(aten.where.self, (t(5, 3, dtype=torch.bool), t(5, 3), t(3, dtype=torch.float64)), {}),
    Call(aten.add.out, (t(5, 3), t(5, 3)), {"out": t(5, 3)}),
    Call(aten.mm.default, (t(5, 4), t(4, 3)), {}),
    Call(aten.mm.default, (TRANSPOSED_5x3, t(3, 2)), {}),  # products are always fresh row-major tensors
    Call(aten.mm.default, (t(5, 4), t(3, 2)), {}, answered_by_shape_rule=False),  # inner sizes differ: decline
    Call(aten.addmm.default, (t(3), t(5, 4), t(4, 3)), {}),
    Call(aten.addmm.default, (t(5, 1), t(5, 4), t(4, 3)), {"beta": 0.5}),
    Call(aten.bmm.default, (t(2, 5, 4), t(2, 4, 3)), {}),
    Call(aten.baddbmm.default, (t(3), t(2, 5, 4), t(2, 4, 3)), {}),
    Call(aten.sum.default, (t(5, 3),), {}),
    Call(aten.sum.default, (t(5, 3, dtype=torch.bool),), {}),
    Call(aten.sum.dim_IntList, (t(2, 5, 3), [0, -1]), {}),
    Call(aten.sum.dim_IntList, (t(2, 5, 3), [1], True), {"dtype": torch.float64}),
    Call(aten.sum.dim_IntList, (t(2, 5, 3), []), {}),
    Call(aten.sum.dim_IntList, (TRANSPOSED_5x3, [0]), {}, answered_by_shape_rule=False),
    Call(aten.mean.dim, (t(4, 6), [1], True), {}),
    Call(aten.mean.default, (t(4, 6, dtype=torch.float64),), {}),
    Call(aten.view.default, (t(4, 3, 2), [12, -1]), {}),
    Call(aten.view.default, (t(4, 3, 2), [5, -1]), {}, answered_by_shape_rule=False),  # impossible: decline
    Call(aten._unsafe_view.default, (t(12, 6), [4, 3, 6]), {}),
    Call(aten.view.default, (TRANSPOSED_5x3, [15]), {}, answered_by_shape_rule=False),  # not viewable
    Call(aten.expand.default, (t(1, 3), [5, 3]), {}),
    Call(aten.expand.default, (t(3), [4, -1]), {}),
    Call(aten.expand.default, (t(), [2, 2]), {}),
    Call(aten.expand.default, (TRANSPOSED_5x3, [2, 5, 3]), {}),
    Call(aten.t.default, (t(5, 3),), {}),
    Call(aten.t.default, (t(5),), {}),
    Call(aten.transpose.int, (TRANSPOSED_5x3, 0, -1), {}),
    Call(aten.transpose.int, (t(2, 5, 3), 2, 0), {}),
    Call(aten.detach.default, (TRANSPOSED_5x3,), {}),
    Call(aten.clone.default, (t(5, 3),), {}),
    Call(aten.clone.default, (TRANSPOSED_5x3,), {}, answered_by_shape_rule=False),
    Call(aten._to_copy.default, (t(5, 3),), {"dtype": torch.float16}),
    Call(aten.ones_like.default, (t(5, 3),), {"dtype": torch.int8}),
    Call(aten.full_like.default, (t(5, 3, dtype=torch.int64), 2.5), {}),
    Call(aten.empty_like.default, (TRANSPOSED_5x3,), {}, answered_by_shape_rule=False),
    Call(aten.new_zeros.default, (t(5, 3), [2, 7]), {}),
    Call(aten.new_full.default, (t(5, 3, dtype=torch.int64), [4], 2.5), {}),
    Call(aten.new_ones.default, (t(5, 3), [4]), {"dtype": torch.float64}),
    Call(aten.copy_.default, (t(5, 3), t(3, dtype=torch.float64)), {}),
    Call(aten.fill_.Scalar, (t(5, 3), 1.0), {}),
    Call(aten.fill_.Tensor, (t(5, 3), t()), {}),
    Call(aten.zero_.default, (TRANSPOSED_5x3,), {}),  # in place: self's own metadata
    Call(aten.mul.Tensor, (EXPANDED_5x3, 2.0), {}),
    Call(aten.add.Tensor, (EXPANDED_5x3, t(5, 3)), {}),
    Call(aten.sum.dim_IntList, (EXPANDED_5x3, [0], True), {}),
    Call(aten.clone.default, (EXPANDED_5x3,), {}),
    Call(aten.view.default, (EXPANDED_5x3, [15]), {}, answered_by_shape_rule=False),  # meta decides (and raises)
    Call(aten.mul.Tensor, (t(5, 1, stride=(1, 7)), 2.0), {}, answered_by_shape_rule=False),  # odd size-1 stride
    Call(aten.cat.default, ([t(5, 3), t(2, 3, dtype=torch.float64)],), {}),
    Call(aten.cat.default, ([t(5, 3), EXPANDED_5x3], -1), {}),
    Call(aten.cat.default, ([t(5, 3), t(0)], 0), {}, answered_by_shape_rule=False),  # legacy empty input
    Call(aten.cat.default, ([t(5, 3), t(5, 2)], 0), {}, answered_by_shape_rule=False),  # sizes differ
]


def _cpu_tensor(value: Any) -> Any:
    if isinstance(value, DTensorSpec):
        meta = value.tensor_meta
        assert meta is not None
        tensor = torch.empty_strided(tuple(meta.shape), tuple(meta.stride), dtype=meta.dtype)
        if meta.dtype.is_floating_point:
            tensor.copy_(torch.rand(tuple(meta.shape), dtype=meta.dtype))
        else:
            tensor.zero_()
        return tensor
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_tensor(item) for item in value)
    return value


def _run_on_cpu(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[TensorMeta | None, ...] | None:
    """Output metadata from running the op on real CPU tensors of the inputs' layouts; None if torch rejects."""
    try:
        result = op(*[_cpu_tensor(arg) for arg in args], **{name: _cpu_tensor(value) for name, value in kwargs.items()})
    except Exception:
        return None
    results = result if isinstance(result, (list, tuple)) else (result,)
    return tuple(
        TensorMeta(item.shape, tuple(item.stride()), item.dtype) if isinstance(item, torch.Tensor) else None
        for item in results
    )


def _assert_agrees(call: Call) -> bool:
    """Whether the shape rule answered; fails if it answered differently from meta tensors."""
    op, args, kwargs = call.op, call.args, call.kwargs
    rule = rule_for(op)
    assert rule is not None and rule.output_meta is not None, op
    try:
        computed = rule.output_meta(op, args, kwargs)
    except Exception:
        # A rule for an op without a meta kernel runs it on real tensors and lets torch's own error through:
        # then torch must reject the call on real tensors too.
        assert _run_on_cpu(op, args, kwargs) is None, f"{op}{args}: the shape rule raised for a call torch accepts"
        return False
    try:
        _, metas = _run_on_meta(op, args, kwargs)
    except NotImplementedError as error:
        if "Meta kernel" not in str(error):
            raise
        metas = _run_on_cpu(op, args, kwargs)  # no meta kernel (geqrf, histogram): real tensors are the oracle
        if metas is None:
            assert computed is None, f"{op}: the shape rule gave {computed} for a call torch rejects"
            return False
    except Exception:
        assert computed is None, f"{op}: the shape rule gave {computed} for a call torch rejects"
        return False
    if computed is None:
        return False
    # A rule answers one TensorMeta, or a tuple of them for an op with several outputs.
    expected = (computed,) if isinstance(computed, TensorMeta) else computed
    assert metas == expected, f"{op}{args}: shape rule {computed}, meta tensors {metas}"
    return True


@pytest.mark.parametrize("call", CALLS, ids=str)
def test_shape_rules_agree_with_meta_tensors(call: Call) -> None:
    assert _assert_agrees(call) == call.answered_by_shape_rule


def _random_layout(generator: random.Random) -> DTensorSpec[Any]:
    """A spec with the layout of a contiguous, expanded, sliced, transposed or unsqueezed tensor."""
    shape = [generator.choice([1, 2, 3, 4]) for _ in range(generator.randint(1, 3))]
    base = torch.empty(shape, device="meta")
    kind = generator.choice(["contiguous", "expanded", "sliced", "strided", "transposed", "unsqueezed"])
    if kind == "expanded":
        base = base.expand([size if size != 1 else generator.choice([1, 3]) for size in shape])
    elif kind == "sliced":
        dim = generator.randrange(len(shape))
        base = base.narrow(dim, 0, max(shape[dim] - 1, 1))
    elif kind == "strided":
        base = torch.empty([2 * size for size in shape], device="meta")[tuple(slice(0, None, 2) for _ in shape)]
    elif kind == "transposed" and len(shape) > 1:
        base = base.transpose(0, -1)
    elif kind == "unsqueezed":
        base = base.unsqueeze(generator.randint(0, len(shape)))
    return t(*base.shape, stride=base.stride())


def test_layout_rules_agree_with_meta_tensors_on_random_layouts() -> None:
    generator = random.Random(7)
    answered = 0
    for _ in range(400):
        x, y = _random_layout(generator), _random_layout(generator)
        dims = list(range(len(x.shape)))
        calls = [
            Call(aten.relu.default, (x,), {}),
            Call(aten.mul.Tensor, (x, 2.0), {}),
            Call(aten.add.Tensor, (x, y), {}),
            Call(aten.where.self, (t(*x.shape, dtype=torch.bool), x, y), {}),
            Call(aten.sum.dim_IntList, (x, [generator.choice(dims)], generator.random() < 0.5), {}),
            Call(aten.mean.dim, (x, [dims[-1]]), {}),
            Call(aten.clone.default, (x,), {}),
            Call(aten._to_copy.default, (x,), {"dtype": torch.float64}),
            Call(aten.empty_like.default, (x,), {}),
            Call(aten.ones_like.default, (x,), {"memory_format": torch.preserve_format}),
            Call(aten.view.default, (x, [-1]), {}),
            Call(aten.expand.default, (x, [2, *x.shape]), {}),
            Call(aten.transpose.int, (x, 0, -1), {}),
        ]
        answered += sum(_assert_agrees(call) for call in calls)
    assert answered > 2000  # most of them do not need meta tensors


def _simple_tensor_overloads() -> list[torch._ops.OpOverload]:
    """Registered overloads whose required arguments are all tensors (unary and binary pointwise, mm, ...)."""
    simple = []
    for op in sorted(registered_ops(), key=str):
        rule = rule_for(op)
        if rule is None or rule.output_meta is None or not rule.tensor_outputs:
            continue  # decided by meta tensors (or no tensor output): nothing to compare
        required = [a for a in op._schema.arguments if not a.kwarg_only and not a.has_default_value()]
        if required and all(isinstance(a.type, torch.TensorType) for a in required) and len(required) <= 2:
            if not any(a.kwarg_only and a.alias_info is not None for a in op._schema.arguments):
                simple.append(op)
    return simple


@pytest.mark.parametrize("op", _simple_tensor_overloads(), ids=str)
def test_every_simple_registered_op_agrees_with_meta_tensors(op: torch._ops.OpOverload) -> None:
    count = len([a for a in op._schema.arguments if not a.kwarg_only and not a.has_default_value()])
    shapes: list[tuple[int, ...]] = [(4, 4), (4,)][:count]
    if op._schema.name == "aten::mm":
        shapes = [(4, 4), (4, 4)]
    elif op._schema.name == "aten::bmm":
        shapes = [(2, 4, 4), (2, 4, 4)]
    for dtype in (torch.float32, torch.int64, torch.bool):
        args = tuple(t(*shape, dtype=dtype) for shape in shapes)
        _assert_agrees(Call(op, args, {}))


def test_propagating_the_linear_ops_does_not_import_dynamo_or_sympy() -> None:
    script = """
import sys, torch
from shardwise.dtensor_ops._decision_pipeline import propagate_op_sharding
from shardwise.placement import DTensorSpec, Replicate, Shard, Partial, TensorMeta
from dataclasses import dataclass
@dataclass(frozen=True)
class M:
    shape: tuple = (4,)
    ndim: int = 1
    def get_coordinate(self): return [1]
def s(p, *shape):
    return DTensorSpec(M(), (p,), TensorMeta(torch.Size(shape), torch.empty(shape).stride(), torch.float32))
a = torch.ops.aten
x, w, b = s(Shard(0), 4, 3, 6), s(Shard(0), 8, 6), s(Shard(0), 8)
flat = propagate_op_sharding(a.view.default, (x, [-1, 6]), {}).output_specs
wt = propagate_op_sharding(a.t.default, (w,), {}).output_specs
out = propagate_op_sharding(a.addmm.default, (b, flat, wt), {}).output_specs
out3 = propagate_op_sharding(a._unsafe_view.default, (out, [4, 3, 8]), {}).output_specs
loss = propagate_op_sharding(a.sum.default, (out3,), {}).output_specs
like_kwargs = {"pin_memory": False, "memory_format": torch.preserve_format}
grad = propagate_op_sharding(a.ones_like.default, (loss,), like_kwargs).output_specs
g = propagate_op_sharding(a.expand.default, (grad, [4, 3, 8]), {}).output_specs
g2 = propagate_op_sharding(a.view.default, (g, [12, 8]), {}).output_specs
propagate_op_sharding(a.mm.default, (g2, w), {})
propagate_op_sharding(a.sum.dim_IntList, (g2, [0], True), {})
propagate_op_sharding(a.mul.Tensor, (g2, 2.0), {})
propagate_op_sharding(a.add.Tensor, (g2, g2), {})
propagate_op_sharding(a.detach.default, (w,), {})
assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
assert "sympy" not in sys.modules, "sympy was imported"
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
