"""PyTorch's module paths under ``shardwise.dtensor_ops``: the one table of them, and the import finder that serves it.

Code written for ``torch.distributed.tensor`` imports its semi-private modules by path
(``torch.distributed.tensor._op_schema``, ``._ops.utils``, ``.experimental._context_parallel._attention``, ...);
with the imports swapped, or through ``shardwise.torch_switch`` (torch's path -> the same path here), those
paths are asked of ``shardwise.dtensor_ops``.  No file sits at them: ``PYTORCH_PATHS`` names the module that
serves each one, and the finder (installed by the package's ``__init__``) answers an import of the path with
that module object itself.  So ``shardwise.dtensor_ops._op_schema is shardwise.dtensor_ops._torch_compat.op_schema``:
one module under two names, its attributes, identity and monkeypatching those of the module that holds the
names; ``import ... as``, ``from ... import``, ``importlib.import_module``, pickle and the parent package's
attribute (``shardwise.dtensor_ops._ops.utils``, bound by the import) all see it.

This module imports nothing of shardwise: the table is plain data (``shardwise.tools.layers`` reads it from the
source to count an import of a path as one of the module serving it), and a serving module is imported only
when its path is first imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

__all__ = ["PYTORCH_PATHS", "install_finder"]

# PyTorch-shaped path -> the module that serves it (the module object bound under both names).
PYTORCH_PATHS: dict[str, str] = {
    "shardwise.dtensor_ops._op_schema": "shardwise.dtensor_ops._torch_compat.op_schema",
    "shardwise.dtensor_ops._sharding_prop": "shardwise.dtensor_ops._torch_compat.sharding_prop",
    "shardwise.dtensor_ops._redistribute": "shardwise.dtensor_ops._torch_compat.redistribute",
    "shardwise.dtensor_ops._collective_utils": "shardwise.dtensor_ops._torch_compat.collective_utils",
    "shardwise.dtensor_ops._utils": "shardwise.dtensor_ops._torch_compat.utils",
    "shardwise.dtensor_ops._dtensor_spec": "shardwise.dtensor_ops._torch_compat.dtensor_spec",
    "shardwise.dtensor_ops._random": "shardwise.dtensor_ops._torch_compat.random",
    "shardwise.dtensor_ops._dispatch": "shardwise.dtensor_ops._torch_compat.op_dispatch",
    # torch.distributed._tensor.device_mesh, after the mechanical swap of torch.distributed._tensor.
    "shardwise.dtensor_ops.device_mesh": "shardwise.dtensor_ops._torch_compat.device_mesh",
    "shardwise.dtensor_ops.placement_types": "shardwise.placement",
    "shardwise.dtensor_ops._ops.utils": "shardwise.dtensor_ops._torch_compat.ops_utils",
    "shardwise.dtensor_ops._ops.single_dim_strategy": "shardwise.dtensor_ops._torch_compat.single_dim_strategy",
    "shardwise.dtensor_ops._ops._view_ops": "shardwise.dtensor_ops._torch_compat.view_ops",
    "shardwise.dtensor_ops._ops._pointwise_ops": "shardwise.dtensor_ops._torch_compat.pointwise_ops",
    "shardwise.dtensor_ops._ops._embedding_ops": "shardwise.dtensor_ops._torch_compat.embedding_ops",
    "shardwise.dtensor_ops._ops._matrix_ops": "shardwise.dtensor_ops._torch_compat.matrix_ops",
    "shardwise.dtensor_ops._ops._einsum_strategy": "shardwise.dtensor_ops._torch_compat.einsum_strategy",
    # PyTorch's context-parallel package: its modules are shardwise's context-parallel modules.
    "shardwise.dtensor_ops.experimental._context_parallel._attention": "shardwise.dtensor_ops.experimental._attention",
    "shardwise.dtensor_ops.experimental._context_parallel._load_balancer": "shardwise.dtensor_ops.experimental._cp_layout",
    "shardwise.dtensor_ops.experimental._context_parallel._cp_custom_ops": "shardwise.dtensor_ops.experimental._cp_flex",
}


class _ServingModuleLoader(importlib.abc.Loader):
    """Hands the import system the serving module itself, under the PyTorch path's name."""

    def __init__(self, served_by: str) -> None:
        self._served_by = served_by
        self._own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self._served_by)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the path's spec on the module; it stays the serving module's own.
        module.__spec__ = self._own_spec


class _PytorchPathFinder(importlib.abc.MetaPathFinder):
    """Answers the paths of ``PYTORCH_PATHS`` and no other."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        served_by = PYTORCH_PATHS.get(fullname)
        if served_by is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _ServingModuleLoader(served_by))


def install_finder() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process, also if this module is imported anew)."""
    if not any(type(finder).__name__ == _PytorchPathFinder.__name__ and type(finder).__module__ == __name__
               for finder in sys.meta_path):
        sys.meta_path.insert(0, _PytorchPathFinder())
