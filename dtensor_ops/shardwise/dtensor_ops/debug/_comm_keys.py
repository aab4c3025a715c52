"""Which dispatcher ops are communication, and the keys their counts are kept under.

Collectives reach a dispatch mode under several namespaces:

* ``_c10d_functional``: the functional collectives shardwise (and PyTorch) issue;
* ``c10d_functional``: the legacy spelling of the same ops, which PyTorch's own
  ``CommDebugMode`` uses as count keys and which user code still names;
* ``_c10d_functional_autograd``: differentiable wrappers around the same ops;
* ``c10d``: what ``torch.distributed.all_reduce`` and friends trace to.

One collective is counted under one key: a functional collective under its
legacy ``c10d_functional`` packet when that spelling exists (the key PyTorch
reports), otherwise under its ``_c10d_functional`` packet.  :class:`CommCounts`
accepts either spelling (or an overload such as ``...all_reduce.default``) when
read, so callers never need to know which one is stored.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

# Importing this module registers the legacy ``c10d_functional`` namespace; without it
# ``torch.ops.c10d_functional.all_reduce`` does not exist and could not be a key.
import torch.distributed._functional_collectives  # noqa: F401
from torch._ops import OpOverload, OpOverloadPacket

__all__ = ["CommCounts", "canonical_comm_key", "comm_key_for_op"]

_FUNCTIONAL_NAMESPACE = "_c10d_functional"
_LEGACY_FUNCTIONAL_NAMESPACE = "c10d_functional"
_AUTOGRAD_FUNCTIONAL_NAMESPACE = "_c10d_functional_autograd"
_FUNCTIONAL_NAMESPACES = frozenset(
    {_FUNCTIONAL_NAMESPACE, _LEGACY_FUNCTIONAL_NAMESPACE, _AUTOGRAD_FUNCTIONAL_NAMESPACE}
)
_C10D_NAMESPACE = "c10d"

# Allow-lists rather than "everything in the namespace": those namespaces also hold
# helpers that move no data (wait_tensor, barrier, _wrap_tensor_autograd, ...).
_FUNCTIONAL_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_",
        "all_reduce_coalesced",
        "all_reduce_coalesced_",
        "all_gather_into_tensor",
        "all_gather_into_tensor_out",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_out",
        "reduce_scatter_tensor_coalesced",
        "all_to_all_single",
        "broadcast",
        "broadcast_",
        "isend",
        "irecv",
        "batch_p2p_ops",
    }
)
_C10D_COLLECTIVES = frozenset(
    {
        "allreduce_",
        "allreduce_coalesced_",
        "allgather_",
        "_allgather_base_",
        "allgather_coalesced_",
        "allgather_into_tensor_coalesced_",
        "reduce_scatter_",
        "_reduce_scatter_base_",
        "reduce_scatter_tensor_coalesced_",
        "broadcast_",
        "alltoall_",
        "alltoall_base_",
        "gather_",
        "scatter_",
        "reduce_",
        "send",
        "recv_",
        "recv_any_source_",
    }
)

_KEY_FOR_OP: dict[OpOverload, OpOverloadPacket | None] = {}
_CANONICAL_PACKET: dict[OpOverloadPacket, OpOverloadPacket] = {}


def _split_qualified_name(packet: OpOverloadPacket) -> tuple[str, str]:
    namespace, _, name = packet._qualified_op_name.partition("::")
    return namespace, name


def _packet_or_none(namespace: str, name: str) -> OpOverloadPacket | None:
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except AttributeError:
        return None
    return packet if isinstance(packet, OpOverloadPacket) else None


def _canonical_packet(packet: OpOverloadPacket) -> OpOverloadPacket:
    canonical = _CANONICAL_PACKET.get(packet)
    if canonical is not None:
        return canonical
    canonical = packet
    namespace, name = _split_qualified_name(packet)
    if namespace in _FUNCTIONAL_NAMESPACES:
        legacy = _packet_or_none(_LEGACY_FUNCTIONAL_NAMESPACE, name)
        plain = _packet_or_none(_FUNCTIONAL_NAMESPACE, name)
        if legacy is not None:
            canonical = legacy
        elif plain is not None:
            canonical = plain
    _CANONICAL_PACKET[packet] = canonical
    return canonical


def canonical_comm_key(key: object) -> OpOverloadPacket:
    """The packet a count for ``key`` is stored under.

    ``key`` is an op packet or overload in any of the collective namespaces, e.g.
    ``torch.ops._c10d_functional.all_reduce``, ``torch.ops.c10d_functional.all_reduce``
    or ``torch.ops._c10d_functional.all_reduce.default`` (all three give the same key).
    """
    if isinstance(key, OpOverload):
        key = key.overloadpacket
    if not isinstance(key, OpOverloadPacket):
        raise KeyError(
            f"communication counts are keyed by op packets such as torch.ops._c10d_functional.all_reduce "
            f"or torch.ops.c10d_functional.all_reduce; got {key!r} of type {type(key).__name__}"
        )
    return _canonical_packet(key)


def comm_key_for_op(op: OpOverload) -> OpOverloadPacket | None:
    """The count key of ``op`` if it communicates between ranks, else ``None`` (cached per op)."""
    try:
        return _KEY_FOR_OP[op]
    except KeyError:
        pass
    namespace, name = _split_qualified_name(op.overloadpacket)
    key: OpOverloadPacket | None = None
    if (namespace in _FUNCTIONAL_NAMESPACES and name in _FUNCTIONAL_COLLECTIVES) or (
        namespace == _C10D_NAMESPACE and name in _C10D_COLLECTIVES
    ):
        key = _canonical_packet(op.overloadpacket)
    _KEY_FOR_OP[op] = key
    return key


class CommCounts(dict[OpOverloadPacket, int]):
    """Collective counts keyed by op packet, readable under either functional namespace.

    ``counts[torch.ops._c10d_functional.all_reduce]`` and
    ``counts[torch.ops.c10d_functional.all_reduce]`` read the same entry; iteration,
    ``len`` and ``items`` show each collective once (under its canonical key, see
    :func:`canonical_comm_key`).  Reading a collective that never ran gives 0 without
    adding it, like a ``defaultdict(int)`` that is only read.  Comparing with another
    mapping normalises that mapping's keys first.
    """

    def __init__(self, counts: Mapping[Any, int] | Iterable[tuple[Any, int]] = ()) -> None:
        super().__init__()
        pairs = counts.items() if isinstance(counts, Mapping) else counts
        for key, count in pairs:
            self.add(key, count)

    def add(self, key: object, count: int = 1) -> None:
        """Add ``count`` occurrences of the collective ``key``."""
        canonical = canonical_comm_key(key)
        super().__setitem__(canonical, super().get(canonical, 0) + count)

    def __getitem__(self, key: object) -> int:
        return super().get(canonical_comm_key(key), 0)

    def __setitem__(self, key: object, count: int) -> None:
        super().__setitem__(canonical_comm_key(key), count)

    def __delitem__(self, key: object) -> None:
        super().__delitem__(canonical_comm_key(key))

    def __contains__(self, key: object) -> bool:
        try:
            canonical = canonical_comm_key(key)
        except KeyError:
            return False
        return super().__contains__(canonical)

    def get(self, key: object, default: int | None = None) -> int | None:  # type: ignore[override]
        canonical = canonical_comm_key(key)
        return super().get(canonical, default)

    def pop(self, key: object, *default: int) -> int:  # type: ignore[override]
        return super().pop(canonical_comm_key(key), *default)

    def copy(self) -> CommCounts:
        return CommCounts(self)

    def total(self) -> int:
        """Number of collectives counted, all ops together."""
        return sum(self.values())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CommCounts):
            return dict.__eq__(self, other)
        if isinstance(other, Mapping):
            try:
                normalised = CommCounts(other)
            except KeyError:
                return False
            return dict.__eq__(self, normalised)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None

    def __repr__(self) -> str:
        inner = ", ".join(f"{key}: {count}" for key, count in self.items())
        return f"CommCounts({{{inner}}})"
