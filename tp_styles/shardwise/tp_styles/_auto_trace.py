"""One forward of a model on fake tensors, recorded: every aten op, every module call, the dataflow between them.

What the automatic planner reads about a model. Nothing is computed and nothing communicates: the
forward runs under ``FakeTensorMode`` (parameters are converted on the fly, so the model is not
copied), in ``no_grad`` (no gradient is ever written to the real parameters), with module hooks
that note which module call each op belongs to. Tensors are named by small integers (``TensorId``)
in the order they are first seen; the trace keeps every shape, who produced each tensor and who
reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ["ModelTrace", "TracedCall", "TracedOp", "TensorId", "trace_forward"]

TensorId = int


@dataclasses.dataclass(frozen=True)
class TracedOp:
    """One aten op: its tensor inputs (flattened argument order, lists included) and outputs."""

    index: int
    func: torch._ops.OpOverload
    inputs: tuple[TensorId, ...]
    outputs: tuple[TensorId, ...]
    args: tuple[Any, ...]  # the arguments with every tensor replaced by its TensorId (dims, sizes, ...)
    call: int | None  # index of the innermost module call running it (None: the root's own forward)
    flops: int


@dataclasses.dataclass(frozen=True)
class TracedCall:
    """One module call: the ops ``first_op <= index < end_op`` ran inside it (its sub-calls' included)."""

    index: int
    fqn: str
    module: nn.Module
    inputs: tuple[TensorId, ...]
    outputs: tuple[TensorId, ...]
    first_op: int
    end_op: int
    parent: int | None


@dataclasses.dataclass
class ModelTrace:
    ops: list[TracedOp]
    calls: list[TracedCall]
    shapes: dict[TensorId, tuple[int, ...]]
    itemsize: dict[TensorId, int]
    parameter_names: dict[TensorId, str]  # parameters (and buffers) read, by their first FQN
    parameter_requires_grad: dict[TensorId, bool]  # of those, which take gradients (buffers do not)
    model_inputs: tuple[TensorId, ...]
    producer: dict[TensorId, int]  # op index
    consumers: dict[TensorId, list[int]]  # op indices

    def nbytes(self, tensor: TensorId) -> int:
        numel = 1
        for size in self.shapes[tensor]:
            numel *= size
        return numel * self.itemsize[tensor]

    def carries_gradient(self) -> set[TensorId]:
        """Tensors computed from a parameter: backward reaches them (inputs and constants it does not)."""
        carrying = {tensor for tensor in self.parameter_names if self.parameter_requires_grad.get(tensor, True)}
        for op in self.ops:
            if any(tensor in carrying for tensor in op.inputs):
                carrying.update(op.outputs)
        return carrying

    def calls_of(self, fqn: str) -> list[TracedCall]:
        return [call for call in self.calls if call.fqn == fqn]

    def flops_within(self, call: TracedCall) -> int:
        return sum(op.flops for op in self.ops[call.first_op : call.end_op])

    def ops_within(self, call: TracedCall) -> list[TracedOp]:
        return self.ops[call.first_op : call.end_op]


class _Recorder(TorchDispatchMode):
    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.ids: dict[int, TensorId] = {}
        self.alive: list[torch.Tensor] = []  # ids of live objects stay unique
        self.shapes: dict[TensorId, tuple[int, ...]] = {}
        self.itemsize: dict[TensorId, int] = {}
        self.parameter_names: dict[TensorId, str] = {}
        self.parameter_requires_grad: dict[TensorId, bool] = {}
        self.names = names
        self.ops: list[TracedOp] = []
        self.call_stack: list[int] = []

    def tensor_id(self, tensor: torch.Tensor) -> TensorId:
        found = self.ids.get(id(tensor))
        if found is not None:
            return found
        new = len(self.ids)
        self.ids[id(tensor)] = new
        self.alive.append(tensor)
        self.shapes[new] = tuple(int(size) for size in tensor.shape)
        self.itemsize[new] = tensor.element_size()
        name = self.names.get(id(tensor))
        if name is not None:
            self.parameter_names[new] = name
            self.parameter_requires_grad[new] = bool(tensor.requires_grad)
        return new

    def _replace(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", self.tensor_id(value))
        if isinstance(value, (list, tuple)):
            return type(value)(self._replace(item) for item in value)
        return value

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in = [value for value in tree_flatten((args, kwargs))[0] if isinstance(value, torch.Tensor)]
        flat_out = [value for value in tree_flatten(out)[0] if isinstance(value, torch.Tensor)]
        flops = 0
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            flops = int(counter(*args, **kwargs, out_val=out))
        self.ops.append(
            TracedOp(
                index=len(self.ops),
                func=func,
                inputs=tuple(self.tensor_id(value) for value in flat_in),
                outputs=tuple(self.tensor_id(value) for value in flat_out),
                args=tuple(self._replace(arg) for arg in args) + tuple(self._replace(v) for v in kwargs.values()),
                call=self.call_stack[-1] if self.call_stack else None,
                flops=flops,
            )
        )
        return out


def trace_forward(model: nn.Module, example_inputs: tuple[Any, ...]) -> ModelTrace:
    """Runs ``model(*example_inputs)`` once on fake tensors and returns what it did (see the module doc)."""
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple of the forward's positional arguments, got {type(example_inputs).__name__}"
        )
    names: dict[int, str] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), name)
    fqn_of = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    recorder = _Recorder(names)
    open_calls: list[dict[str, Any]] = []
    finished: dict[int, dict[str, Any]] = {}

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        index = len(open_calls) + len(finished)
        flat = [value for value in tree_flatten((args, kwargs))[0] if isinstance(value, torch.Tensor)]
        open_calls.append(
            {
                "index": index,
                "fqn": fqn_of.get(id(module), type(module).__name__),
                "module": module,
                "inputs": tuple(recorder.tensor_id(value) for value in flat),
                "first_op": len(recorder.ops),
                "parent": recorder.call_stack[-1] if recorder.call_stack else None,
            }
        )
        recorder.call_stack.append(index)

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        entry = open_calls.pop()
        recorder.call_stack.pop()
        flat = [value for value in tree_flatten(output)[0] if isinstance(value, torch.Tensor)]
        entry["outputs"] = tuple(recorder.tensor_id(value) for value in flat)
        entry["end_op"] = len(recorder.ops)
        finished[entry["index"]] = entry

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True, always_call=True))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with fake_mode, torch.no_grad():
            fake_inputs = tuple(fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value for value in example_inputs)
            with recorder:
                model_inputs = tuple(recorder.tensor_id(value) for value in fake_inputs if isinstance(value, torch.Tensor))
                model(*fake_inputs)
    finally:
        for handle in handles:
            handle.remove()
    calls = [TracedCall(**finished[index]) for index in sorted(finished)]
    producer: dict[TensorId, int] = {}
    consumers: dict[TensorId, list[int]] = {}
    for op in recorder.ops:
        for read in op.inputs:
            consumers.setdefault(read, []).append(op.index)
        for written in op.outputs:
            producer.setdefault(written, op.index)
    return ModelTrace(
        ops=recorder.ops,
        calls=calls,
        shapes=recorder.shapes,
        itemsize=recorder.itemsize,
        parameter_names=recorder.parameter_names,
        parameter_requires_grad=recorder.parameter_requires_grad,
        model_inputs=model_inputs,
        producer=producer,
        consumers=consumers,
    )
