"""Error types of ``shardwise.mesh``.

PyTorch's ``DeviceMesh`` raises a mix of ``RuntimeError``, ``ValueError``, ``KeyError`` and bare
``AssertionError`` for bad input. Our errors carry a message that names the problem and what was
expected, and they are instances of every class PyTorch used for the same mistake, so code that
catches PyTorch's exception types keeps working after switching imports.
"""

from __future__ import annotations

__all__ = ["MeshError", "MeshDimError"]


class MeshError(ValueError, RuntimeError):
    """Invalid mesh construction or use: a ``ValueError`` that is also a ``RuntimeError``."""


class MeshDimError(MeshError, KeyError):
    """An unknown, repeated or out-of-order mesh dimension (by name or index).

    Also a ``KeyError``, which is what PyTorch raises when slicing by an unknown dim name.
    """

    def __str__(self) -> str:
        # KeyError would show the repr of the message, quotes and escaped newlines included.
        return str(self.args[0]) if self.args else ""
