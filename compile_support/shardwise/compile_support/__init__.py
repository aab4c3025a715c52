"""shardwise.compile_support: DTensor, DeviceMesh and placements under ``torch.compile``.

Nothing to call: when this package is installed, ``import shardwise.dtensor_ops`` finds it and runs
its hook (``dtensor_ops._extensions``), which registers placements and meshes as opaque value types
and marks ``DTensor.from_local`` for the graph once dynamo is imported.  ``is_active()`` says whether
the hook ran; ``install()`` runs it by hand (idempotent).
"""

from __future__ import annotations

from shardwise.dtensor_ops._extensions import installed_extensions

from ._dtensor_ops_extension import install
from ._registration import compile_refusal

__all__ = ["compile_refusal", "install", "is_active"]


def is_active() -> bool:
    """Whether dtensor_ops found and ran this package's hook."""
    return "compile_support" in installed_extensions()
