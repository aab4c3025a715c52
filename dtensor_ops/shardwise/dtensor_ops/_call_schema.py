"""What an op's schema says about its arguments and results: the one schema analysis of dtensor_ops.

Propagation needs it to keep written tensors where they are, dispatch to know what to return
(the written tensor, the ``out=`` tensors, nothing, new DTensors) and random ops to find their
``generator`` argument. Computed once per overload and cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._caches import SHARED_CACHES

__all__ = ["SchemaFacts", "schema_facts"]


@dataclass(frozen=True, slots=True)
class SchemaFacts:
    """``writes_first_argument``: positional argument 0 is written (``add_``, ``_foreach_add_``).
    ``returns_written_first_argument``: ... and it is the single result (``add_`` yes, ``_foreach_add_`` no).
    ``out_names``: keyword-only written arguments (``out=``), in output order.
    ``written``: every written argument, by position and by name.
    ``returns_nothing``: the schema has no result.
    ``generator_argument``: where a ``generator`` is taken (position, or name when keyword-only).
    ``takes_tensor_list``: some argument is a list of tensors (``_foreach_*``, ``cat``).
    ``returns_view_of_first_argument``: the first result aliases argument 0 without writing it (``view``,
    ``diagonal``, ``select``, ``t``...).
    """

    writes_first_argument: bool
    returns_written_first_argument: bool
    out_names: tuple[str, ...]
    written: frozenset[int | str]
    returns_nothing: bool
    generator_argument: int | str | None
    takes_tensor_list: bool
    returns_view_of_first_argument: bool




def schema_facts(op: torch._ops.OpOverload) -> SchemaFacts:
    facts: SchemaFacts | None = SHARED_CACHES.schema_facts.get(op)
    if facts is None:
        facts = _analyse(op)
        SHARED_CACHES.schema_facts[op] = facts
    return facts


def _analyse(op: torch._ops.OpOverload) -> SchemaFacts:
    schema = op._schema
    arguments = schema.arguments
    returns = schema.returns
    out_names: list[str] = []
    written: set[int | str] = set()
    generator_argument: int | str | None = None
    takes_tensor_list = False
    for position, argument in enumerate(arguments):
        alias = argument.alias_info
        is_written = alias is not None and alias.is_write
        if argument.kwarg_only and is_written:
            out_names.append(argument.name)
        if is_written:
            written.add(argument.name)
            if not argument.kwarg_only:
                written.add(position)
        if argument.name == "generator":
            generator_argument = argument.name if argument.kwarg_only else position
        argument_type = argument.type
        if isinstance(argument_type, torch.ListType) and isinstance(argument_type.getElementType(), torch.TensorType):
            takes_tensor_list = True
    first = arguments[0] if arguments else None
    writes_first = (
        not out_names
        and first is not None
        and not first.kwarg_only
        and first.alias_info is not None
        and first.alias_info.is_write
    )
    returns_written_first = (
        writes_first
        and len(returns) == 1
        and returns[0].alias_info is not None
        and returns[0].alias_info.is_write
    )
    first_alias = first.alias_info if first is not None else None
    first_return_alias = returns[0].alias_info if returns else None
    returns_view_of_first = (
        first_alias is not None
        and first_return_alias is not None
        and not first_return_alias.is_write
        and bool(set(first_alias.before_set) & set(first_return_alias.before_set))
    )
    return SchemaFacts(
        writes_first_argument=bool(writes_first),
        returns_written_first_argument=bool(returns_written_first),
        out_names=tuple(out_names),
        written=frozenset(written),
        returns_nothing=not returns,
        generator_argument=generator_argument,
        takes_tensor_list=takes_tensor_list,
        returns_view_of_first_argument=returns_view_of_first,
    )
