"""shardwise.torch_switch: run an unmodified program on shardwise by resolving torch's DTensor paths to it.

With ``SHARDWISE_AS_TORCH=1`` in the environment (torchrun's workers inherit it), the
``shardwise_torch_switch.pth`` file this wheel installs calls :func:`install_if_requested` at
interpreter start. From then on, every import of one of torch's DTensor-family module paths
(``ALIASES``) returns shardwise's module, so the program, the libraries it uses (torchtitan,
spmd-types) and torch's own code (functional collectives, DCP, dynamo, FSDP's package) all see one
``DTensor`` and one ``DeviceMesh``: ``import torch.distributed.tensor`` gives ``shardwise.dtensor_ops``.

Without the variable the ``.pth`` line does nothing else (this module imports neither torch nor
shardwise), and nothing of torch changes. :func:`install` does the same from code, if called before
anything imports ``torch``; :func:`is_active` tells whether the switch is on in this process.

How, and why this way: ``import torch`` itself imports ``torch.distributed.device_mesh``, and torch
is only usable once its ``__init__`` has run. So the switch waits for torch's import to finish (a
finder wraps torch's loader), then puts shardwise's mesh module in place of torch's (the module and
the ``DeviceMesh`` / ``init_device_mesh`` names ``torch.distributed`` re-exports). Every other path
is aliased when first imported: the finder answers for it with shardwise's module object itself, so
identity holds (``torch.distributed.tensor.DTensor is shardwise.dtensor_ops.DTensor``) and no module
runs twice under two names. A submodule under ``torch.distributed.tensor`` that shardwise does not have is
loaded from torch's own file (torch's helpers that work on any DTensor, e.g. DCP's), under torch's name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

ENVIRONMENT_VARIABLE = "SHARDWISE_AS_TORCH"

# torch's module path -> shardwise's module. A path's submodules map to the module's submodules
# (``torch.distributed.tensor._api`` -> ``shardwise.dtensor_ops._api``); the longest prefix wins. Where
# shardwise serves one of PyTorch's semi-private paths with another module (``._op_schema``, ``._ops.utils``,
# ...), importing the mapped path resolves it through dtensor_ops's alias table (``PYTORCH_PATHS`` of
# ``shardwise.dtensor_ops._torch_compat.pytorch_paths``): one list of those paths, kept there.
ALIASES: dict[str, str] = {
    "torch.distributed.device_mesh": "shardwise.mesh",
    "torch.distributed.tensor": "shardwise.dtensor_ops",
    "torch.distributed.tensor.placement_types": "shardwise.placement",
    "torch.distributed.tensor.parallel": "shardwise.tp_styles",
    "torch.distributed.tensor.parallel.fsdp": "shardwise.fsdp_ext",
    "torch.distributed._tensor": "shardwise.dtensor_ops",
    "torch.distributed._tensor.placement_types": "shardwise.placement",
    "torch.distributed.fsdp._fully_shard": "shardwise.fsdp_ext._fully_shard_compat",
    # FSDP2-based DDP; torch's pipelining imports it.
    "torch.distributed._composable.replicate_with_fsdp": "shardwise.fsdp_ext._replicate",
}

# Under these paths a submodule that shardwise lacks is torch's own file (helpers that work on any
# DTensor, such as DCP's); elsewhere (FSDP2's internals) it is missing, as torch's code expects of a
# module it probes for.
_TORCH_FILLS_GAPS = ("torch.distributed.tensor", "torch.distributed._tensor")

# Paths that ``import torch`` has already loaded when the switch takes over: replaced after it.
_LOADED_WITH_TORCH = ("torch.distributed.device_mesh",)
# Imported as soon as the switch takes over, before anything can import torch._dynamo: dynamo's own
# import reaches torch.distributed.tensor (through FSDP's package), and shardwise's compile support
# must be in place before that import starts to register itself right after it. torch's own FSDP2 imports
# torch.distributed._symmetric_memory, which defines the symm_mem ops inductor's lowerings name at import;
# shardwise's FSDP2 does not need it, so it is imported here, as torch's FSDP package would have.
_IMPORTED_AT_TAKE_OVER = ("torch.distributed.tensor", "torch.distributed._symmetric_memory")
# Names ``torch.distributed`` re-exports from its device_mesh module.
_REEXPORTED_BY_TORCH_DISTRIBUTED = ("DeviceMesh", "init_device_mesh")


class SwitchError(RuntimeError):
    """The switch cannot take over: torch's DTensor modules are already in use in this process."""


def shardwise_path_for(torch_path: str) -> str | None:
    """shardwise's module for one of torch's module paths, or None when the switch leaves it to torch."""
    prefixes = [p for p in ALIASES if torch_path == p or torch_path.startswith(p + ".")]
    if not prefixes:
        return None
    best = max(prefixes, key=len)
    return ALIASES[best] + torch_path[len(best):]


def _alias_root(torch_path: str) -> str:
    """The shardwise module that the longest alias prefix of ``torch_path`` names."""
    prefix = max((p for p in ALIASES if torch_path == p or torch_path.startswith(p + ".")), key=len)
    return ALIASES[prefix]


class _AliasLoader(importlib.abc.Loader):
    """Hands the import system an already imported shardwise module under torch's name."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module
        self._own_spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self._module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped torch's spec on the module; it stays shardwise's own module.
        module.__spec__ = self._own_spec


class _TorchThenSwitchLoader(importlib.abc.Loader):
    """torch's own loader for ``torch``; once torch's ``__init__`` has run, the switch takes over."""

    def __init__(self, loader: importlib.abc.Loader, finder: _SwitchFinder) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._finder.take_over_from_torch()


class _SwitchFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.active = False
        self._torch_dir: str | None = None

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torch" and not self.active:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return None
            spec.loader = _TorchThenSwitchLoader(spec.loader, self)
            return spec
        if not self.active:
            return None
        shardwise_path = shardwise_path_for(fullname)
        if shardwise_path is None:
            return None
        try:
            module = importlib.import_module(shardwise_path)
        except ModuleNotFoundError as missing:
            alias_root = _alias_root(fullname)
            if missing.name == alias_root:
                raise ModuleNotFoundError(
                    f"{fullname} resolves to {alias_root} under shardwise's switch ({ENVIRONMENT_VARIABLE}), "
                    f"but {alias_root} is not installed: install its wheel beside the others",
                    name=fullname,
                ) from missing
            if missing.name is None or not (shardwise_path + ".").startswith(missing.name + "."):
                raise  # something shardwise's module itself imports is missing
            if not any(fullname.startswith(prefix + ".") for prefix in _TORCH_FILLS_GAPS):
                raise ModuleNotFoundError(
                    f"{fullname} has no counterpart in shardwise ({shardwise_path}) under the switch",
                    name=fullname,
                ) from missing
            return self._torch_own_spec(fullname)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module))

    def _torch_own_spec(self, fullname: str) -> importlib.machinery.ModuleSpec | None:
        """torch's own file for a path shardwise has no module for, loaded under torch's name."""
        assert self._torch_dir is not None
        parent, _, _ = fullname.rpartition(".")
        folder = os.path.join(self._torch_dir, *parent.split(".")[1:])
        return importlib.machinery.PathFinder.find_spec(fullname, [folder])

    def take_over_from_torch(self) -> None:
        torch = sys.modules["torch"]
        self._torch_dir = os.path.dirname(os.path.abspath(torch.__file__ or ""))
        if not torch.distributed.is_available():
            return  # a torch built without distributed has no DTensor family to replace
        in_use = sorted(
            name
            for name in sys.modules
            if shardwise_path_for(name) is not None and name not in _LOADED_WITH_TORCH
        )
        if in_use:
            raise SwitchError(
                "shardwise's switch must take over before torch's DTensor modules are imported, but "
                f"these are already loaded: {', '.join(in_use)}. Set {ENVIRONMENT_VARIABLE}=1 in the "
                "environment (honoured at interpreter start) or call shardwise.torch_switch.install() "
                "before importing torch."
            )
        _keep_torch_dtensor_fast_path_to_itself()
        self.active = True
        for torch_path in _LOADED_WITH_TORCH:
            shardwise_path = shardwise_path_for(torch_path)
            assert shardwise_path is not None
            replacement = importlib.import_module(shardwise_path)
            sys.modules[torch_path] = replacement
            parent, _, child = torch_path.rpartition(".")
            setattr(sys.modules[parent], child, replacement)
        mesh_module = sys.modules["torch.distributed.device_mesh"]
        for name in _REEXPORTED_BY_TORCH_DISTRIBUTED:
            setattr(torch.distributed, name, getattr(mesh_module, name))
        for torch_path in _IMPORTED_AT_TAKE_OVER:
            importlib.import_module(torch_path)


def _keep_torch_dtensor_fast_path_to_itself() -> None:
    """Hand torch's C++ dispatcher a DTensor class that no tensor is, before the paths are aliased.

    torch's C++ dispatch has a fast path for its own DTensor: the first time any tensor subclass
    dispatches an op, it imports ``torch.distributed.tensor``, keeps that module's ``DTensor`` class for
    the life of the process, and sends instances of it to torch's Python dispatcher internals. Under the
    switch that class would be shardwise's, whose dispatcher is not torch's. So that first lookup is made
    here, on a stand-in module whose ``DTensor`` is never instantiated: shardwise's DTensor then
    dispatches through its own ``__torch_dispatch__``, as every other subclass does.
    """
    import torch

    class NeverInstantiated(torch.Tensor):
        pass

    class Throwaway(torch.Tensor):
        @staticmethod
        def __new__(cls, data: torch.Tensor) -> Throwaway:
            made: Throwaway = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype)
            return made

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
            return func(*[torch.zeros(a.shape) if isinstance(a, Throwaway) else a for a in args], **(kwargs or {}))

    name = "torch.distributed.tensor"
    stand_in = types.ModuleType(name)
    stand_in.DTensor = NeverInstantiated  # type: ignore[attr-defined]
    sys.modules[name] = stand_in
    try:
        Throwaway(torch.zeros(1)).add(1)  # the first subclass dispatch: C++ looks the class up now
    finally:
        del sys.modules[name]


_FINDER: _SwitchFinder | None = None


def install() -> None:
    """Turn the switch on in this process: call it before anything imports torch (idempotent)."""
    global _FINDER
    if _FINDER is not None:
        return
    _FINDER = _SwitchFinder()
    sys.meta_path.insert(0, _FINDER)
    if "torch" in sys.modules:
        _FINDER.take_over_from_torch()


def install_if_requested() -> None:
    """What the ``.pth`` file runs at interpreter start: :func:`install` when the variable says so."""
    if os.environ.get(ENVIRONMENT_VARIABLE, "") not in ("", "0"):
        install()


PTH_FILE_NAME = "shardwise_torch_switch.pth"


def pth_file() -> str:
    """The ``.pth`` file that turns the switch on at interpreter start: next to the ``shardwise`` folder this
    package lies in, in site-packages as the wheel installs it and in a source or Bazel tree alike."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), PTH_FILE_NAME)


def switched_environment(root: str) -> str:
    """A virtual environment at ``root`` over this interpreter's packages, with the switch's ``.pth`` installed
    in its site-packages (as installing the wheel would); returns its python. Its interpreters honour
    ``SHARDWISE_AS_TORCH`` at start: a way to try an unmodified program (or test one) without installing wheels,
    with shardwise importable through ``PYTHONPATH``."""
    import shutil
    import subprocess

    source = pth_file()
    if not os.path.isfile(source):
        raise FileNotFoundError(f"the switch's {PTH_FILE_NAME} is not beside its package: {source}")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", root], check=True)
    python = os.path.join(root, "bin", "python")
    site_packages = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    shutil.copy(source, os.path.join(site_packages, PTH_FILE_NAME))
    return python


def is_active() -> bool:
    """Whether torch's DTensor paths resolve to shardwise in this process."""
    return _FINDER is not None and _FINDER.active


__all__ = [
    "ALIASES",
    "ENVIRONMENT_VARIABLE",
    "PTH_FILE_NAME",
    "SwitchError",
    "install",
    "install_if_requested",
    "is_active",
    "pth_file",
    "shardwise_path_for",
    "switched_environment",
]
