"""Layout math on per-rank ints: torch's LocalTensorMode simulates every rank in one process.

Under ``torch.distributed._local_tensor.LocalTensorMode`` a mesh coordinate or a rank is a
``SymInt`` whose node holds one int per simulated rank (torch's ``LocalIntNode``, with its
``_local_ints``). The layout rules compare sizes, which such a SymInt allows only when every rank
agrees; so a layout function given one runs once per simulated rank on plain ints and returns, per
result entry, a plain int where the ranks agree and a per-rank SymInt of the same node type where
they differ. Placement is pure layout code (no ``torch.distributed`` import): the node is
recognised by its per-rank ints, and a new one is made by its own type.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["any_per_rank_int", "for_each_simulated_rank"]


def _per_rank_ints(value: object) -> dict[int, int] | None:
    if type(value) is not torch.SymInt:
        return None
    local_ints = getattr(value.node, "_local_ints", None)
    return local_ints if isinstance(local_ints, dict) else None


def any_per_rank_int(values: Sequence[object]) -> bool:
    """Whether any of ``values`` is a per-rank ``SymInt`` (LocalTensorMode's ``LocalIntNode``)."""
    return any(_per_rank_ints(value) is not None for value in values)


def _on_rank(value: Any, rank: int) -> Any:
    per_rank = _per_rank_ints(value)
    if per_rank is not None:
        return per_rank[rank]
    if isinstance(value, (tuple, list)):
        return type(value)(_on_rank(item, rank) for item in value)
    return value


def for_each_simulated_rank(function: Callable[..., tuple[int, ...]], *args: Any) -> tuple[int | torch.SymInt, ...]:
    """``function(*args)`` (a flat tuple of ints) once per simulated rank of the per-rank ints in ``args``.

    Entries on which the ranks agree are plain ints; the others per-rank SymInts.
    """
    flat_args = [item for arg in args for item in (arg if isinstance(arg, (tuple, list)) else (arg,))]
    per_rank_args = [item for item in flat_args if _per_rank_ints(item) is not None]
    if not per_rank_args:
        return function(*args)
    node_type = type(per_rank_args[0].node)
    ranks = sorted(_per_rank_ints(per_rank_args[0]) or {})
    results = {rank: function(*(_on_rank(arg, rank) for arg in args)) for rank in ranks}
    joined: list[int | torch.SymInt] = []
    for index in range(len(results[ranks[0]])):
        values = {rank: result[index] for rank, result in results.items()}
        first = values[ranks[0]]
        joined.append(first if all(value == first for value in values.values()) else torch.SymInt(node_type(values)))
    return tuple(joined)
