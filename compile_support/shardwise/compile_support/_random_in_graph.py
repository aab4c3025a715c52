"""Sharded random ops inside compiled graphs, with the values eager gives.

A sharded random op runs in its shard's stream (dtensor_ops ``_random``): on CPU one 32-bit draw from
the generator, a reseed by (draw, shard index), the op, the generator's state restored.  Moving generator
state on the host cannot be written as graph ops, so while tracing, dispatch hands the op to
``run_sharded_random_in_graph``: it records the op with its non-tensor arguments as a *recipe* and puts one
opaque custom op, ``shardwise_compile::sharded_random(tensors, recipe)``, into the graph.  When the graph
runs, that op runs the recipe exactly as eager dispatch would, on copies of its inputs (a custom op must not
write into them); an in-place random op (``bernoulli_``, the CPU dropout) is completed in the graph by a
``copy_`` into the traced input.

The recipe's name in the graph is the recipe itself, encoded (``recipe:<base64 pickle>`` of the op (an
``OpOverload`` by name, a module-level function by reference), the plan and the non-tensor arguments), so a graph loaded from inductor's or AOTAutograd's on-disk caches
by another process (which never traced it, so never recorded the recipe) runs it the same way, and
graphs of different recipes never share a cache key.  A recipe that cannot be encoded (a local function, an
explicit ``torch.Generator`` argument: a copy of it would not advance the caller's)
keeps a process-local name (``random<n>``): such graphs cannot move between processes.
"""

from __future__ import annotations

import base64
import itertools
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardwise.dtensor_ops._shard_rng import RandomPlan, run_random_op

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


_ENCODED_PREFIX = "recipe:"


def _contains_generator(value: Any) -> bool:
    if isinstance(value, torch.Generator):
        return True
    if isinstance(value, (list, tuple)):
        return any(_contains_generator(item) for item in value)
    if isinstance(value, dict):
        return any(_contains_generator(item) for item in value.values())
    return False


def _encoded_name(recipe: _Recipe) -> str | None:
    """``recipe:<base64 pickle>`` of everything the recipe needs, or None when it cannot be encoded."""
    if _contains_generator((recipe.args, recipe.kwargs)):
        return None
    # An OpOverload by its name (it does not pickle); a module-level function by reference (pickle's way).
    call: Any = ("op", recipe.call.name()) if isinstance(recipe.call, torch._ops.OpOverload) else ("function", recipe.call)
    try:
        payload = pickle.dumps((call, recipe.plan, recipe.args, recipe.kwargs))
    except Exception:  # a local function, an argument pickle cannot write: the recipe stays process-local
        return None
    return _ENCODED_PREFIX + base64.b64encode(payload).decode("ascii")


def _decoded(name: str) -> _Recipe | None:
    """The recipe an encoded name holds (None for a process-local name)."""
    if not name.startswith(_ENCODED_PREFIX):
        return None
    (kind, call), plan, args, kwargs = pickle.loads(base64.b64decode(name[len(_ENCODED_PREFIX) :]))
    if kind == "op":
        namespace, _, qualified = call.partition("::")
        op_packet, _, overload = qualified.partition(".")
        call = getattr(getattr(getattr(torch.ops, namespace), op_packet), overload or "default")
    return _Recipe(plan, call, args, kwargs)


def _recipe(name: str) -> _Recipe:
    found = _RECIPES.get(name)
    if found is None:
        found = _decoded(name)
        if found is None:
            raise RuntimeError(
                f"shardwise_compile::sharded_random: unknown recipe {name!r}; expected one recorded while this "
                "process traced the graph (a graph holding a random op with an explicit generator cannot move "
                "between processes)"
            )
        with _lock:
            _RECIPES[name] = found
    return found


def _run(tensors: list[torch.Tensor], recipe: str, *, in_shard_stream: bool) -> list[torch.Tensor]:
    found = _recipe(recipe)
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
    recipe = _Recipe(plan, call, args, kwargs)
    with _lock:
        key = _encoded_name(recipe) or f"random{next(_keys)}"
        _RECIPES[key] = recipe
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
