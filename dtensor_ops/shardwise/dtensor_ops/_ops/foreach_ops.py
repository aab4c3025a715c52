"""Optimizer and training-utility ops: the ``_foreach_*`` family (SGD, Adam, AdamW, clip_grad_norm_).

A ``_foreach_*`` op applies one per-tensor op to every element of its tensor lists
(``_foreach_add_(params, grads, alpha=a)`` is ``params[i].add_(grads[i], alpha=a)``
for every ``i``), in one local kernel.  Its sharding decision is composed the same
way: each list element is decided by the engine as that per-tensor op on the
element's arguments (its own cached decision, with the per-tensor op's rule:
pointwise linearity in Partials, ``copy_``, ``zero_`` ...), and the foreach
decision places every element as its own decision says.  Elements are independent,
so the sum of the cheapest element decisions is the cheapest foreach decision, and
lists may mix placements (some parameters sharded, others replicated).  A tensor
argument shared by all elements (``_foreach_mul_(grads, clip_coef)``) must be
placed alike for all of them.

``_foreach_norm`` is an algorithm rather than a placement rule (a 2-norm of a
sharded tensor is not any reduction of the shards' 2-norms): it is an op handler,
``_handlers/foreach_norm.py``.  ``_foreach_powsum`` (its inner sum) is linear in the
shards and gets a rule here: ``Shard -> Partial(sum)``, no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence, cast

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta

from .._call_schema import schema_facts
from .._rules import (
    CombinedDecision,
    DecideFn,
    OpCall,
    ShardingPropagationError,
    ShardingRule,
    register_rule,
)

__all__ = [
    "ELEMENT_OPS",
    "ElementOp",
    "FOREACH_RULE",
    "FUSED_OPTIMIZER_RULE",
    "INPLACE_FOREACH_RULE",
    "POWSUM_RULE",
    "named_arguments",
]

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload


# ----------------------------------------------------------------------------------- the element table


@dataclass(frozen=True)
class ElementOp:
    """How each list element of one ``_foreach_*`` overload is decided: as ``op`` on that element.

    ``renamed`` maps a foreach argument name to the element op's (``scalars`` -> ``other``);
    names not listed are the same.  ``written_as_out``: the in-place foreach op has no
    in-place per-tensor counterpart (``_foreach_maximum_``), so its element is decided as the
    ``out=`` form writing into ``self`` (``maximum(self, other, out=self)``).  ``whole_tensor_args``
    are tensor arguments that the local kernel reads whole for every element (the 1-D
    ``scalars`` of ``_foreach_addcmul.Tensor``: one value per element); they are replicated, and
    the element op sees ``placeholders`` in their place (their values never change a decision).
    """

    op: OpOverload
    renamed: Mapping[str, str] = field(default_factory=dict)
    written_as_out: bool = False
    whole_tensor_args: tuple[str, ...] = ()
    placeholders: Mapping[str, object] = field(default_factory=dict)


ELEMENT_OPS: dict[OpOverload, ElementOp] = {}

# _foreach_<name>(self) / _foreach_<name>_(self) -> aten.<name> / aten.<name>_
_UNARY = (
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor", "frac",
    "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign",
    "sin", "sinh", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip


def _overload(name: str, overload: str) -> OpOverload:
    op: OpOverload = getattr(getattr(aten, name), overload)
    return op


def _add_pair(foreach_name: str, overload: str, element_name: str, element_overload: str, **options: Any) -> None:
    """Map ``_foreach_<foreach_name>.<overload>`` and its in-place form to ``aten.<element_name>.<element_overload>``
    and ``aten.<element_name>_.<element_overload>``.  ``inplace_overload`` / ``inplace_out`` adjust the in-place side.
    """
    inplace_overload = options.pop("inplace_overload", element_overload)
    inplace_out = options.pop("inplace_out", False)
    ELEMENT_OPS[_overload(f"_foreach_{foreach_name}", overload)] = ElementOp(
        _overload(element_name, element_overload), **options
    )
    if inplace_out:
        ELEMENT_OPS[_overload(f"_foreach_{foreach_name}_", overload)] = ElementOp(
            _overload(element_name, "out"), written_as_out=True, **options
        )
    else:
        ELEMENT_OPS[_overload(f"_foreach_{foreach_name}_", overload)] = ElementOp(
            _overload(element_name + "_", inplace_overload), **options
        )


for _name in _UNARY:
    _add_pair(_name, "default", _name, "default")

for _name in ("add", "sub"):
    _add_pair(_name, "List", _name, "Tensor")
    _add_pair(_name, "Scalar", _name, "Scalar", renamed={"scalar": "other"})
    _add_pair(_name, "ScalarList", _name, "Scalar", renamed={"scalars": "other"})
_add_pair("add", "Tensor", "add", "Tensor")

for _name in ("mul", "div"):
    _add_pair(_name, "List", _name, "Tensor")
    _add_pair(_name, "Tensor", _name, "Tensor")
    _add_pair(_name, "Scalar", _name, "Scalar", renamed={"scalar": "other"})
    _add_pair(_name, "ScalarList", _name, "Scalar", renamed={"scalars": "other"})

# maximum(x, scalar) is clamp_min(x, scalar); aten has no maximum_/minimum_, so their lists are out= forms.
for _name, _bound_name, _bound in (("maximum", "clamp_min", "min"), ("minimum", "clamp_max", "max")):
    _add_pair(_name, "List", _name, "default", inplace_out=True)
    _add_pair(_name, "Scalar", _bound_name, "default", renamed={"scalar": _bound})
    _add_pair(_name, "ScalarList", _bound_name, "default", renamed={"scalars": _bound})

for _name, _bound in (("clamp_min", "min"), ("clamp_max", "max")):
    _add_pair(_name, "List", _name, "Tensor", renamed={"other": _bound})
    _add_pair(_name, "Scalar", _name, "default", renamed={"scalar": _bound})
    _add_pair(_name, "ScalarList", _name, "default", renamed={"scalars": _bound})

_add_pair("pow", "List", "pow", "Tensor_Tensor", inplace_overload="Tensor")
_add_pair("pow", "Scalar", "pow", "Tensor_Scalar", inplace_overload="Scalar")
_add_pair("pow", "ScalarList", "pow", "Tensor_Scalar", inplace_overload="Scalar")
ELEMENT_OPS[aten._foreach_pow.ScalarAndTensor] = ElementOp(aten.pow.Scalar)

_add_pair("lerp", "List", "lerp", "Tensor", renamed={"tensors1": "end", "weights": "weight"})
_add_pair("lerp", "Scalar", "lerp", "Scalar", renamed={"tensors1": "end"})
_add_pair("lerp", "ScalarList", "lerp", "Scalar", renamed={"tensors1": "end"})

for _name in ("addcmul", "addcdiv"):
    _add_pair(_name, "Scalar", _name, "default")
    _add_pair(_name, "ScalarList", _name, "default", renamed={"scalars": "value"})
    _add_pair(_name, "Tensor", _name, "default", whole_tensor_args=("scalars",), placeholders={"value": 1.0})

# The functional _foreach_copy / _foreach_zero return new tensors laid out like self: decided as copy_ / zero_.
ELEMENT_OPS[aten._foreach_copy_.default] = ElementOp(aten.copy_.default)
ELEMENT_OPS[aten._foreach_copy.default] = ElementOp(aten.copy_.default)
ELEMENT_OPS[aten._foreach_zero_.default] = ElementOp(aten.zero_.default)
ELEMENT_OPS[aten._foreach_zero.default] = ElementOp(aten.zero_.default)
# New in torch 2.13 (the GPU image's torch 2.11 has neither): registered where this torch has them.
for _name, _element in (("_foreach_clone", aten.clone.default), ("_foreach_mm", aten.mm.default)):
    if hasattr(aten, _name):
        ELEMENT_OPS[getattr(aten, _name).default] = ElementOp(_element)
ELEMENT_OPS[aten._foreach_max.default] = ElementOp(aten.max.default)


# ----------------------------------------------------------------------------------- element decisions


def _returns_nothing(op: OpOverload) -> bool:
    return schema_facts(op).returns_nothing


def _is_list(argument: Any) -> bool:
    return isinstance(argument.type, torch.ListType)


def named_arguments(op: OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> dict[str, object]:
    """The call's arguments by schema name (those given; defaults are left to the element op)."""
    arguments = op._schema.arguments
    named: dict[str, object] = {}
    for index, value in enumerate(args):
        named[arguments[index].name] = value
    named.update(kwargs)
    return named


def _list_length(op: OpOverload, named: Mapping[str, object]) -> int:
    lengths: dict[str, int] = {}
    for argument in op._schema.arguments:
        value = named.get(argument.name)
        if _is_list(argument) and isinstance(value, (list, tuple)):
            lengths[argument.name] = len(value)
    distinct = set(lengths.values())
    if len(distinct) != 1:
        raise ValueError(
            f"{op}: its list arguments must all have the same length, got "
            + ", ".join(f"{name}: {length}" for name, length in lengths.items())
        )
    (length,) = distinct
    if length == 0:
        raise ValueError(f"{op}: the tensor lists are empty; expected at least one tensor")
    return length


class _ElementDecision:
    """One element's decision: target placements per foreach argument name, and its output placements."""

    __slots__ = ("targets", "output")

    def __init__(self, targets: dict[str, tuple[Placement, ...]], output: DTensorSpec[Any] | None) -> None:
        self.targets = targets
        self.output = output


# How one slot of an element call is filled: from a list argument's element, from an argument all elements
# share, with a constant (placeholder or schema default), or with the element of ``self`` (the out= form).
_FROM_LIST, _SHARED, _CONSTANT, _SELF_ELEMENT = range(4)


class _CallTemplate(NamedTuple):
    """The element call of one foreach overload (for one set of given arguments), worked out once."""

    positional: tuple[tuple[int, str, object], ...]  # (kind, foreach argument name, constant)
    keyword: tuple[tuple[str, int, str, object], ...]  # (element argument name, kind, foreach name, constant)


_TEMPLATES: dict[tuple[OpOverload, frozenset[str]], _CallTemplate] = {}


def _call_template(op: OpOverload, element: ElementOp, given: frozenset[str]) -> _CallTemplate:
    key = (op, given)
    template = _TEMPLATES.get(key)
    if template is not None:
        return template
    list_arguments = {argument.name for argument in op._schema.arguments if _is_list(argument)}
    inverse = {element_name: foreach_name for foreach_name, element_name in element.renamed.items()}
    positional: list[tuple[int, str, object]] = []
    keyword: list[tuple[str, int, str, object]] = []
    skipped: list[Any] = []
    for argument in element.op._schema.arguments:
        foreach_name = inverse.get(argument.name, argument.name)
        slot: tuple[int, str, object]
        if element.written_as_out and argument.name == "out":
            slot = (_SELF_ELEMENT, "self", None)
        elif argument.name in element.placeholders:
            slot = (_CONSTANT, "", element.placeholders[argument.name])
        elif foreach_name in given and foreach_name not in element.whole_tensor_args:
            slot = (_FROM_LIST if foreach_name in list_arguments else _SHARED, foreach_name, None)
        else:
            if not argument.kwarg_only:
                skipped.append(argument)
            continue
        if argument.kwarg_only:
            keyword.append((argument.name, *slot))
        else:
            # A later positional argument is given: the skipped ones are spelled out with their defaults.
            positional.extend((_CONSTANT, "", missing.default_value) for missing in skipped)
            skipped.clear()
            positional.append(slot)
    template = _CallTemplate(tuple(positional), tuple(keyword))
    _TEMPLATES[key] = template
    return template


def _slot_value(kind: int, foreach_name: str, constant: object, named: Mapping[str, object], index: int) -> object:
    if kind == _CONSTANT:
        return constant
    value = named[foreach_name]
    if kind == _SHARED:
        return value
    assert isinstance(value, (list, tuple))
    return value[index]


def _element_call(
    template: _CallTemplate, named: Mapping[str, object], index: int
) -> tuple[tuple[object, ...], dict[str, object], list[str]]:
    """Arguments of element ``index``'s per-tensor call, and the foreach argument name of each spec in it.

    The names come in the engine's flattened order (positional, then keyword), which is the
    order of the element decision's ``input_specs``; the out= slot is named "out".
    """
    args: list[object] = []
    spec_names: list[str] = []
    for kind, foreach_name, constant in template.positional:
        value = _slot_value(kind, foreach_name, constant, named, index)
        args.append(value)
        if isinstance(value, DTensorSpec):
            spec_names.append(foreach_name)
    kwargs: dict[str, object] = {}
    for element_name, kind, foreach_name, constant in template.keyword:
        value = _slot_value(kind, foreach_name, constant, named, index)
        kwargs[element_name] = value
        if isinstance(value, DTensorSpec):
            spec_names.append("out" if kind == _SELF_ELEMENT else foreach_name)
    return tuple(args), kwargs, spec_names


def _decide_element(
    op: OpOverload,
    element: ElementOp,
    template: _CallTemplate,
    named: Mapping[str, object],
    index: int,
    decide: DecideFn,
) -> _ElementDecision:
    args, kwargs, spec_names = _element_call(template, named, index)
    try:
        decision = decide(element.op, args, kwargs)
    except NotImplementedError as error:
        raise NotImplementedError(
            f"shardwise has no sharding rule for {op}: each list element is decided as {element.op}, and "
            f"element {index} failed: {error}"
        ) from error
    except ShardingPropagationError as error:
        raise ShardingPropagationError(f"{op}: list element {index} (decided as {element.op}): {error}") from error
    targets = {
        name: spec.placements for name, spec in zip(spec_names, decision.input_specs) if name != "out"
    }
    output = decision.output_specs
    if output is not None and not isinstance(output, DTensorSpec):
        raise AssertionError(f"{element.op} gave several outputs; a foreach element has one")
    return _ElementDecision(targets, output)


def _element_decisions(call: OpCall) -> list[_ElementDecision]:
    """Each list element decided by the engine (through its one cache) as the element op on that element."""
    if call.decide is None:
        raise AssertionError(f"{call.op}: a foreach decision needs the engine's decide function on the call")
    op = call.op
    element = ELEMENT_OPS[op]
    named = named_arguments(op, call.args, call.kwargs)
    template = _call_template(op, element, frozenset(named))
    return [
        _decide_element(op, element, template, named, index, call.decide) for index in range(_list_length(op, named))
    ]


def _rule_input_slots(call: OpCall) -> list[tuple[str, int | None]]:
    """(foreach argument name, list index or None) of every rule input, in the engine's flattened order."""
    arguments = call.op._schema.arguments
    slots: list[tuple[str, int | None]] = []

    def visit(name: str, value: object) -> None:
        if isinstance(value, DTensorSpec):
            slots.append((name, None))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                if isinstance(item, DTensorSpec):
                    slots.append((name, index))
                elif isinstance(item, torch.Tensor):
                    raise TypeError(f"{call.op}: element {index} of {name!r} is a plain tensor among DTensors")

    for position, value in enumerate(call.args):
        visit(arguments[position].name, value)
    for name, value in call.kwargs.items():
        visit(name, value)
    return slots


def _foreach_combined_decision(call: OpCall) -> CombinedDecision:
    element = ELEMENT_OPS[call.op]
    decisions = _element_decisions(call)
    mesh_ndim = len(call.input_specs[0].placements)
    inputs: list[tuple[Placement, ...]] = []
    for (name, index), spec in zip(_rule_input_slots(call), call.input_specs):
        if name in element.whole_tensor_args:
            inputs.append((Replicate(),) * mesh_ndim)
        elif index is not None:
            inputs.append(decisions[index].targets[name])
        else:
            wanted = {decision.targets[name] for decision in decisions}
            if len(wanted) != 1:
                raise ShardingPropagationError(
                    f"{call.op}: the shared tensor argument {name!r} (placements {spec.placements}) would have to be "
                    f"placed differently for different list elements ({sorted(map(str, wanted))}); split the lists "
                    "by placement or redistribute that argument first"
                )
            inputs.append(wanted.pop())
    if _returns_nothing(call.op):
        return CombinedDecision(tuple(inputs), ())
    # Each output is its element's output (its metadata too: no meta-tensor run of the whole list).
    outputs: list[tuple[Placement, ...] | None] = []
    metas: list[TensorMeta | None] = []
    for index, decision in enumerate(decisions):
        if decision.output is None or decision.output.tensor_meta is None:
            raise AssertionError(f"{call.op}: list element {index} (decided as {element.op}) gave no tensor output")
        outputs.append(decision.output.placements)
        metas.append(decision.output.tensor_meta)
    return CombinedDecision(tuple(inputs), tuple(outputs), tuple(metas))


# Out-of-place overloads return one tensor per element; in-place ones return nothing (no output metadata).
# Scalars (alpha, a Scalar, a ScalarList: Adam's step sizes change every step) never change where an element
# runs, only their types can change a result dtype: the decision is cached by type.
FOREACH_RULE = ShardingRule(
    family="foreach",
    combined_decision=_foreach_combined_decision,
    scalar_values_matter=False,
)
INPLACE_FOREACH_RULE = ShardingRule(
    family="foreach (in place)",
    combined_decision=_foreach_combined_decision,
    tensor_outputs=False,
    scalar_values_matter=False,
)


register_rule([op for op in ELEMENT_OPS if not _returns_nothing(op)], FOREACH_RULE)
register_rule([op for op in ELEMENT_OPS if _returns_nothing(op)], INPLACE_FOREACH_RULE)


# ----------------------------------------------------------------------------------- _foreach_powsum


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


def _powsum_combined_decision(call: OpCall) -> CombinedDecision:
    """sum |x|^p adds up over shards (Shard -> Partial(sum)); it is not linear in a Partial's parts (-> reduce)."""
    inputs: list[tuple[Placement, ...]] = []
    outputs: list[tuple[Placement, ...] | None] = []
    for spec in call.input_specs:
        target: list[Placement] = []
        result: list[Placement] = []
        for placement in spec.placements:
            if isinstance(placement, Shard):
                target.append(placement)
                result.append(Partial("sum"))
            else:
                target.append(Replicate())
                result.append(Replicate())
        inputs.append(tuple(target))
        outputs.append(tuple(result))
    return CombinedDecision(tuple(inputs), tuple(outputs))


def _powsum_output_metas(
    op: OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[TensorMeta | None, ...] | None:
    named = named_arguments(op, args, kwargs)
    tensors = named.get("self")
    dtype = named.get("dtype")
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(item, DTensorSpec) for item in tensors):
        return None
    metas: list[TensorMeta | None] = []
    for spec in tensors:
        assert isinstance(spec, DTensorSpec) and spec.tensor_meta is not None
        result_dtype = dtype if isinstance(dtype, torch.dtype) else _real_dtype(spec.tensor_meta.dtype)
        metas.append(TensorMeta(torch.Size(()), (), result_dtype))
    return tuple(metas)


POWSUM_RULE = ShardingRule(
    family="foreach powsum", combined_decision=_powsum_combined_decision, output_meta=_powsum_output_metas
)
register_rule((aten._foreach_powsum.Scalar,), POWSUM_RULE)


# ----------------------------------------------------------------------------------- fused optimizers

# torch's fused optimizer kernels (``Adam(fused=True)``, AdamW, SGD, Adagrad): one call updates every
# parameter from its gradient and state, element by element, with the step counts and hyperparameters
# shared. So each parameter's shard updates from the same shards of its gradient and state: every list
# aligned with ``self`` is placed as ``self[i]`` is (the state was made like the parameter; a gradient in
# another layout is moved there first), and the per-parameter step counts, a tensor ``lr``, ``grad_scale``
# and ``found_inf`` are replicated (plain scalar tensors count as replicated). A Partial parameter has no
# values to update: refused.
_FUSED_STEP_COUNTS = "state_steps"


def _fused_optimizer_combined_decision(call: OpCall) -> CombinedDecision:
    named = named_arguments(call.op, call.args, call.kwargs)
    params = named.get("self")
    assert isinstance(params, (list, tuple))
    inputs: list[tuple[Placement, ...]] = []
    for (name, index), spec in zip(_rule_input_slots(call), call.input_specs):
        if index is None or name == _FUSED_STEP_COUNTS:
            inputs.append((Replicate(),) * len(spec.placements))
            continue
        param = params[index]
        if not isinstance(param, DTensorSpec):
            raise ShardingPropagationError(f"{call.op}: {name}[{index}] is a DTensor but self[{index}] is not")
        if param.has_partial():
            raise ShardingPropagationError(
                f"{call.op}: parameter {index} is Partial ({param.placements}); an optimizer step needs its values: "
                "redistribute it (or its gradient's source) to Shard/Replicate first"
            )
        inputs.append(param.placements)
    return CombinedDecision(tuple(inputs), ())


FUSED_OPTIMIZER_RULE = ShardingRule(
    family="fused optimizer",
    combined_decision=_fused_optimizer_combined_decision,
    tensor_outputs=False,
    scalar_values_matter=False,
)
register_rule(
    [
        getattr(getattr(aten, name), overload)
        for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
        if hasattr(aten, name)
        for overload in ("default", "tensor_lr")
        if hasattr(getattr(aten, name), overload)
    ],
    FUSED_OPTIMIZER_RULE,
)
