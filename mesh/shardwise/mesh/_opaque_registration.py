"""Registering ``DeviceMesh`` for torch.compile: PyTorch's entry point, run through hooks the layer above adds.

The registration itself lives in ``shardwise.compile_support``, which the mesh layer cannot import;
compile_support adds it here with ``_register_opaque_type_registration``.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["_register_distributed_opaque_types", "_register_opaque_type_registration"]


_opaque_type_registrations: list[Callable[[], None]] = []


def _register_opaque_type_registration(registration: Callable[[], None]) -> None:
    """Add what ``_register_distributed_opaque_types`` runs (shardwise.compile_support adds its registration)."""
    if registration not in _opaque_type_registrations:
        _opaque_type_registrations.append(registration)


def _register_distributed_opaque_types() -> None:
    """Register ``DeviceMesh`` (and what it holds) as opaque types for torch.compile, as PyTorch 2.13's function of that name.

    The registration lives above this layer (``shardwise.compile_support``, which also runs it when
    ``shardwise.dtensor_ops`` is imported); here it is run through the hooks that layer added. Idempotent.
    """
    for registration in list(_opaque_type_registrations):
        registration()
