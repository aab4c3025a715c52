"""The error type of ``shardwise.fsdp_ext``.

Where PyTorch's FSDP2 raises ``RuntimeError`` (or ``AssertionError``/``ValueError``) for a mistake,
shardwise raises :class:`FSDPError`, which is both a ``ValueError`` and a ``RuntimeError``: code that
catches either keeps working after switching imports (``shardwise.mesh.MeshError`` does the same for
meshes).
"""

from __future__ import annotations

__all__ = ["FSDPError"]


class FSDPError(ValueError, RuntimeError):
    """Invalid use of ``fully_shard`` or an ``FSDPModule``: a ``ValueError`` that is also a ``RuntimeError``."""
