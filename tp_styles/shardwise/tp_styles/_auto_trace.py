"""One forward of a model on fake tensors, recorded: every aten op, every module call, the dataflow between them.

What the automatic planner reads about a model. Nothing is computed and nothing communicates: the
forward runs under ``FakeTensorMode`` (parameters are converted on the fly, so the model is not
copied), in ``no_grad`` (no gradient is ever written to the real parameters), with module hooks
that note which module call each op belongs to. Tensors are named by small integers (``TensorId``)
in the order they are first seen; the trace keeps every shape, who produced each tensor and who
reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]  # public class, not in its __all__
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ._auto_errors import (
    AutoPlanError,
    DataDependentControlFlowError,
    ExampleInputMismatchError,
    UnsupportedModelError,
    describe_inputs,
    failure_site,
)

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
    kwarg_names: tuple[str, ...] = ()  # the last len(kwarg_names) entries of ``args`` are these keyword arguments

    def call_arguments(self, value_of: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The op's positional and keyword arguments with each tensor ``("tensor", id)`` replaced by ``value_of(id)``."""

        def replace(value: Any) -> Any:
            if isinstance(value, tuple) and len(value) == 2 and value[0] == "tensor" and isinstance(value[1], int):
                return value_of(value[1])
            if isinstance(value, (list, tuple)):
                return type(value)(replace(item) for item in value)
            return value

        split = len(self.args) - len(self.kwarg_names)
        positional = tuple(replace(arg) for arg in self.args[:split])
        return positional, {name: replace(arg) for name, arg in zip(self.kwarg_names, self.args[split:])}


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
    dtypes: dict[TensorId, torch.dtype] = dataclasses.field(default_factory=dict)
    strides: dict[TensorId, tuple[int, ...]] = dataclasses.field(default_factory=dict)

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
        self.dtypes: dict[TensorId, torch.dtype] = {}
        self.strides: dict[TensorId, tuple[int, ...]] = {}
        self.parameter_names: dict[TensorId, str] = {}
        self.parameter_requires_grad: dict[TensorId, bool] = {}
        self.names = names
        self.ops: list[TracedOp] = []
        self.call_stack: list[int] = []
        # Where a tensor's values come from, for errors: the example inputs it was computed from, and the
        # first parameter it was computed from.
        self.from_inputs: dict[TensorId, frozenset[int]] = {}
        self.from_parameter: dict[TensorId, str] = {}

    def tensor_id(self, tensor: torch.Tensor) -> TensorId:
        found = self.ids.get(id(tensor))
        if found is not None:
            return found
        new = len(self.ids)
        self.ids[id(tensor)] = new
        self.alive.append(tensor)
        self.shapes[new] = tuple(int(size) for size in tensor.shape)
        self.itemsize[new] = tensor.element_size()
        self.dtypes[new] = tensor.dtype
        self.strides[new] = tuple(int(step) for step in tensor.stride())
        name = self.names.get(id(tensor))
        if name is not None:
            self.parameter_names[new] = name
            self.parameter_requires_grad[new] = bool(tensor.requires_grad)
            self.from_parameter[new] = name
        return new

    def _replace(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", self.tensor_id(value))
        if isinstance(value, (list, tuple)):
            return type(value)(self._replace(item) for item in value)
        return value

    def origin(self, tensor: TensorId) -> str:
        inputs = sorted(self.from_inputs.get(tensor, ()))
        parameter = self.from_parameter.get(tensor)
        parts = [f"example input [{index}]" for index in inputs]
        if parameter is not None:
            parts.append(f"parameter {parameter!r}")
        return " and ".join(parts) if parts else "a tensor made in the forward"

    def check_operands(self, func: Any, flat_in: list[torch.Tensor]) -> None:
        """Refuses what the real kernel would refuse but the fake one lets through: fake matmuls accept operands
        of different dtypes (a float32 batch into a float64 model), and a real CPU matmul raises."""
        operands = [tensor for tensor in flat_in if tensor.dim() > 0]
        devices = {tensor.device for tensor in operands}
        if len(devices) > 1:
            raise _OperandMismatch(func, "device", [(self.origin(self.tensor_id(t)), str(t.device)) for t in operands],
                                   self._input_index(operands))
        if func._overloadpacket in _SAME_DTYPE_OPS:
            dtypes = {tensor.dtype for tensor in operands}
            if len(dtypes) > 1:
                described = [(self.origin(self.tensor_id(t)), str(t.dtype).removeprefix("torch.")) for t in operands]
                raise _OperandMismatch(func, "dtype", described, self._input_index(operands))

    def _input_index(self, operands: list[torch.Tensor]) -> int | None:
        for tensor in operands:
            inputs = self.from_inputs.get(self.tensor_id(tensor))
            if inputs and len(inputs) == 1:
                return next(iter(inputs))
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat_in = [value for value in tree_flatten((args, kwargs))[0] if isinstance(value, torch.Tensor)]
        self.check_operands(func, flat_in)
        out = func(*args, **kwargs)
        flat_out = [value for value in tree_flatten(out)[0] if isinstance(value, torch.Tensor)]
        input_ids = [self.tensor_id(value) for value in flat_in]
        reached_inputs = frozenset().union(*(self.from_inputs.get(tensor, frozenset()) for tensor in input_ids))
        parameter = next((self.from_parameter[t] for t in input_ids if t in self.from_parameter), None)
        for value in flat_out:
            written = self.tensor_id(value)
            if reached_inputs:
                self.from_inputs[written] = self.from_inputs.get(written, frozenset()) | reached_inputs
            if parameter is not None:
                self.from_parameter.setdefault(written, parameter)
        flops = 0
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            flops = int(counter(*args, **kwargs, out_val=out))
        self.ops.append(
            TracedOp(
                index=len(self.ops),
                func=func,
                inputs=tuple(input_ids),
                outputs=tuple(self.tensor_id(value) for value in flat_out),
                args=tuple(self._replace(arg) for arg in args) + tuple(self._replace(v) for v in kwargs.values()),
                call=self.call_stack[-1] if self.call_stack else None,
                flops=flops,
                kwarg_names=tuple(kwargs),
            )
        )
        return out


def trace_forward(model: nn.Module, example_inputs: tuple[Any, ...]) -> ModelTrace:
    """Runs ``model(*example_inputs)`` once on fake tensors and returns what it did (see the module doc).

    A forward that cannot be traced raises an ``AutoPlanError`` naming the module, the example inputs and
    the line of the forward (``_auto_errors``); the model is left as it was (hooks removed, nothing written).
    """
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple of the forward's positional arguments, got {type(example_inputs).__name__}"
        )
    check_model_is_traceable(model)
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
                for index, value in enumerate(fake_inputs):
                    if isinstance(value, torch.Tensor):
                        recorder.from_inputs[recorder.tensor_id(value)] = frozenset({index})
                with _quiet_fake_kernel_failures():
                    model(*fake_inputs)
    except AutoPlanError:
        raise
    except Exception as failure:
        raise _explained(failure, model, example_inputs, fqn_of) from failure
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
        dtypes=recorder.dtypes,
        strides=recorder.strides,
    )


# Ops whose real CPU kernels require every operand in one dtype, while their fake (meta) kernels do not check.
_SAME_DTYPE_OPS = frozenset(
    {
        torch.ops.aten.mm,
        torch.ops.aten.addmm,
        torch.ops.aten.bmm,
        torch.ops.aten.baddbmm,
        torch.ops.aten.mv,
        torch.ops.aten.addmv,
        torch.ops.aten.dot,
        torch.ops.aten.matmul,
        torch.ops.aten.linear,
        torch.ops.aten.convolution,
    }
)  # not the attention kernels: they take boolean masks beside floating queries


class _OperandMismatch(RuntimeError):
    """Raised inside the traced forward (an op's operands disagree); ``trace_forward`` turns it into the user's error."""

    def __init__(self, func: Any, what: str, operands: list[tuple[str, str]], input_index: int | None) -> None:
        described = ", ".join(f"{origin}: {value}" for origin, value in operands)
        super().__init__(f"{func} got operands of different {what}s ({described})")
        self.what = what
        self.input_index = input_index


@contextlib.contextmanager
def _quiet_fake_kernel_failures() -> Iterator[None]:
    """Fake tensors log every failing meta kernel with its whole stack; the planner re-raises the failure
    explained (module, input, line), so the log would only bury that explanation."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_model_is_traceable(model: nn.Module) -> None:
    """Refuses, before anything runs, the models the planner cannot trace or lay out."""
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"auto_plan: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise UnsupportedModelError(
            f"auto_plan: {type(model).__name__} is a TorchScript module, which forward hooks and fake tensors cannot "
            "trace; pass the eager nn.Module it was scripted from",
            module="", module_type=type(model).__name__,
        )
    original = getattr(model, "_orig_mod", None)
    if isinstance(original, nn.Module):
        raise UnsupportedModelError(
            f"auto_plan: the model is a torch.compile wrapper ({type(model).__name__}) of {type(original).__name__}; plan "
            "and parallelize the eager module (model._orig_mod) and compile after auto_parallelize",
            module="", module_type=type(model).__name__,
        )
    for module_path, module in model.named_modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if type(tensor) in (torch.Tensor, nn.Parameter):
                continue
            full_name = f"{module_path}.{name}" if module_path else name
            owner = f"{full_name!r} of module {module_path or '<root>'!r} ({type(module).__name__})"
            if isinstance(tensor, UninitializedTensorMixin):
                reason = "not initialised yet (a lazy module): run one forward on a real batch first, then plan"
            elif hasattr(tensor, "device_mesh") or hasattr(tensor, "_spec"):
                reason = (
                    f"a {type(tensor).__name__}: the model is already distributed (parallelize_module, fully_shard or "
                    "distribute_module ran on it). auto_plan plans a model whose parameters are plain tensors, before "
                    "any parallelization"
                )
            else:
                reason = f"a {type(tensor).__name__} (a tensor subclass), which the planner does not trace or lay out"
            raise UnsupportedModelError(
                f"auto_plan: {owner} is {reason}", module=module_path, module_type=type(module).__name__
            )


def _explained(failure: Exception, model: nn.Module, example_inputs: tuple[Any, ...], fqn_of: dict[int, str]) -> AutoPlanError:
    module_path, module_type, location, source = failure_site(failure.__traceback__, fqn_of)
    where_in = f"module {module_path or '<root>'!r} ({module_type})" if module_type else type(model).__name__
    at = (f" at {location}" + (f" (`{source}`)" if source else "")) if location else ""
    reason = str(failure).strip().rstrip(".")
    where: dict[str, Any] = {"module": module_path, "module_type": module_type, "location": location}
    inputs = describe_inputs(example_inputs)
    model_name = type(model).__name__
    if isinstance(failure, DataDependentOutputException):
        return DataDependentControlFlowError(
            f"auto_plan: the forward of {model_name} reads a tensor's value in Python (data-dependent control flow "
            f"such as `if x.mean() > 0:`, or .item()/.tolist()/bool(tensor)) in {where_in}{at}. The planner runs the "
            "forward once on fake tensors, which have shapes but no values, so it cannot know which path a batch "
            "takes. Make the path independent of values (torch.where, masks, or a flag passed to the module), or "
            "write the plan by hand with parallelize_module",
            **where,
        )
    if isinstance(failure, DynamicOutputShapeException):
        return DataDependentControlFlowError(
            f"auto_plan: the forward of {model_name} makes a tensor whose shape depends on tensor values "
            f"({failure.func}) in {where_in}{at}; the planner traces shapes only, on fake tensors without values. "
            "Keep shapes independent of values (masks instead of nonzero/masked_select), or write the plan by hand "
            "with parallelize_module",
            **where,
        )
    if isinstance(failure, UnsupportedOperatorException):
        return UnsupportedModelError(
            f"auto_plan: {where_in}{at} of {model_name} calls {failure.func}, which has no fake-tensor (meta) kernel, "
            "so the planner cannot trace it; write the plan by hand with parallelize_module",
            **where,
        )
    if isinstance(failure, _OperandMismatch):
        return ExampleInputMismatchError(
            f"auto_plan: the example inputs ({inputs}) do not fit {model_name}: in {where_in}{at}, {failure}; the "
            f"model itself would refuse them. Pass example inputs as a real batch would come (same {failure.what} as "
            "the model)",
            input_index=failure.input_index,
            **where,
        )
    return ExampleInputMismatchError(
        f"auto_plan: the forward of {model_name} failed on the example inputs ({inputs}) in {where_in}{at}: "
        f"{type(failure).__name__}: {reason}. The planner runs the forward once on fake tensors of these shapes "
        "and dtypes; pass example inputs that the model accepts (a real batch's shapes, dtypes and device)",
        **where,
    )
