"""Sharded random ops inside compiled graphs, with the values eager gives.

A sharded random op runs in its shard's stream (dtensor_ops ``_random``): on CPU one 32-bit draw from
the generator, a reseed by (draw, shard index), the op, the generator's state restored.  Moving generator
state on the host cannot be written as graph ops, so while tracing, dispatch hands the op to
``run_sharded_random_in_graph``: it records the op with its non-tensor arguments as a *recipe* and puts one
opaque custom op, ``shardwise_compile::sharded_random(tensors, recipe)``, into the graph.  When the graph
runs, that op runs the recipe exactly as eager dispatch would, on copies of its inputs (a custom op must not
write into them); an in-place random op (``bernoulli_``, the CPU dropout) is completed in the graph by a
``copy_`` into the traced input.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardwise.dtensor_ops._random import RandomPlan, run_random_op

__all__ = ["run_sharded_random_in_graph", "recipe_count"]


@dataclass(frozen=True)
class _Slot:
    """Where the ``index``-th tensor input goes in a recipe's arguments."""

    index: int


@dataclass(frozen=True)
class _Recipe:
    plan: RandomPlan
    call: Callable[..., Any]
    args: list[Any]
    kwargs: dict[str, Any]


# Recipes live as long as the process: a compiled graph names them by key and may run at any time.
# One entry per traced random op (per compilation), a few hundred bytes each.
_RECIPES: dict[str, _Recipe] = {}
_keys = itertools.count()
_lock = threading.Lock()


def recipe_count() -> int:
    return len(_RECIPES)


def _to_template(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if isinstance(value, (list, tuple)):
        items = [_to_template(item, tensors) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, (list, tuple)):
        items = [_fill(item, tensors) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _as_list(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)) and all(isinstance(item, torch.Tensor) for item in result):
        return list(result)
    raise TypeError(
        f"a sharded random op inside a compiled graph returned {type(result).__name__}; expected a tensor or a "
        "tuple of tensors"
    )


def _run(tensors: list[torch.Tensor], recipe: str, *, in_shard_stream: bool) -> list[torch.Tensor]:
    found = _RECIPES.get(recipe)
    if found is None:
        raise RuntimeError(
            f"shardwise_compile::sharded_random: unknown recipe {recipe!r}; expected one recorded while this "
            "process traced the graph (compiled graphs holding sharded random ops cannot move between processes)"
        )
    copies = [tensor.clone() for tensor in tensors]
    args = _fill(found.args, copies)
    kwargs = {name: _fill(value, copies) for name, value in found.kwargs.items()}
    if in_shard_stream:
        result = run_random_op(found.plan, found.call, args, kwargs)
    else:
        result = found.call(*args, **kwargs)
    return [out if all(out is not t for t in tensors) else out.clone() for out in _as_list(result)]


@torch.library.custom_op("shardwise_compile::sharded_random", mutates_args=())
def sharded_random(tensors: list[torch.Tensor], recipe: str) -> list[torch.Tensor]:
    """Run recorded sharded random op ``recipe`` on ``tensors`` as eager dispatch would (new output tensors)."""
    return _run(tensors, recipe, in_shard_stream=True)


@sharded_random.register_fake
def _sharded_random_fake(tensors: list[torch.Tensor], recipe: str) -> list[torch.Tensor]:
    return _run(tensors, recipe, in_shard_stream=False)


def run_sharded_random_in_graph(
    plan: RandomPlan, call: Callable[..., Any], local_args: list[Any], local_kwargs: dict[str, Any]
) -> Any:
    """dtensor_ops' traced random runner: the op as one ``sharded_random`` call (see the module docstring)."""
    tensors: list[torch.Tensor] = []
    args = _to_template(local_args, tensors)
    kwargs = {name: _to_template(value, tensors) for name, value in local_kwargs.items()}
    with _lock:
        key = f"random{next(_keys)}"
        _RECIPES[key] = _Recipe(plan, call, args, kwargs)
    # The result's structure, and whether the op wrote into one of its inputs, from the traced op itself.
    probe_inputs = [tensor.clone() for tensor in tensors]
    probe = call(*_fill(args, probe_inputs), **{name: _fill(value, probe_inputs) for name, value in kwargs.items()})
    outputs = torch.ops.shardwise_compile.sharded_random(tensors, key)
    if isinstance(probe, torch.Tensor):
        written = next((index for index, t in enumerate(probe_inputs) if probe is t), None)
        if written is not None:
            return tensors[written].copy_(outputs[0])
        return outputs[0]
    return tuple(outputs)
