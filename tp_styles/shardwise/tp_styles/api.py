"""``parallelize_module``: apply parallel styles to a module and its submodules by path.

Drop-in for ``torch.distributed.tensor.parallel.api`` (PyTorch 2.13), with
differences that only turn PyTorch's silent or confusing cases into working code
or clearer messages:

* an n-D mesh with a dim named ``"tp"`` is accepted: its ``"tp"`` sub-mesh is used
  (PyTorch requires a 1-D mesh);
* a plan path that matches no submodule is skipped with a ``UserWarning`` (as PyTorch's)
  that names the path, where matching stopped and the closest module paths; the path
  ``""`` is the module itself (as PyTorch's);
* the whole plan is resolved and every target module checked before any module is
  changed or any collective runs, so a bad plan leaves the model untouched.
"""

from __future__ import annotations

import difflib
import warnings
from fnmatch import fnmatchcase
from typing import Mapping, Union

import torch
import torch.nn as nn
from shardwise.mesh import DeviceMesh, MeshError, get_current_mesh

from .style import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = ["parallelize_module", "ParallelizePlan", "PlanPathNotFound", "TP_MESH_DIM_NAME"]

# The mesh dim parallelize_module takes from an n-D mesh.
TP_MESH_DIM_NAME = "tp"

ParallelizePlan = Union[ParallelStyle, Mapping[str, ParallelStyle]]


def _tensor_parallel_mesh(device_mesh: DeviceMesh | None) -> DeviceMesh:
    if device_mesh is None:
        try:
            device_mesh = get_current_mesh()
        except MeshError:
            raise RuntimeError(
                "parallelize_module: no device_mesh was given and no mesh is active; pass device_mesh=... "
                "(a 1-D mesh, or an n-D mesh with a dim named 'tp') or call it inside `with mesh:`"
            ) from None
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"parallelize_module: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.ndim == 1:
        return device_mesh
    names = device_mesh.mesh_dim_names
    if names is None or TP_MESH_DIM_NAME not in names:
        raise ValueError(
            f"Tensor Parallel only accepts a 1D DeviceMesh, but found {device_mesh.ndim}D! parallelize_module "
            f"takes the dim named {TP_MESH_DIM_NAME!r} of an n-D mesh, and this mesh's dims are named {names}; "
            f"pass the tensor-parallel sub-mesh (e.g. device_mesh['tp']) or name that dim {TP_MESH_DIM_NAME!r}"
        )
    return device_mesh[TP_MESH_DIM_NAME]


def _check_style(style: object, where: str) -> ParallelStyle:
    if not isinstance(style, ParallelStyle):
        raise TypeError(
            f"parallelize_module: {where} must be a ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...), "
            f"got {style!r} of type {type(style).__name__}"
        )
    return style


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class PlanPathNotFound(ValueError):
    """A plan path that matches no submodule (``parallelize_module`` warns and skips it, as PyTorch's)."""


def _unmatched_path_error(root: nn.Module, path: str, matched_prefixes: list[tuple[str, nn.Module]], depth: int) -> PlanPathNotFound:
    segments = path.split(".")
    all_paths = [name for name, _ in root.named_modules() if name]
    near = difflib.get_close_matches(path, all_paths, n=5, cutoff=0.6)
    parts = [f"parallelize_module: the plan path {path!r} matches no submodule of {type(root).__name__}"]
    if depth > 0:
        where = ", ".join(repr(prefix) for prefix, _ in matched_prefixes[:3])
        children = sorted({name for _, module in matched_prefixes for name, _ in module.named_children()})
        parts.append(
            f"; {'.'.join(segments[:depth])!r} matched ({where}{', ...' if len(matched_prefixes) > 3 else ''}) but "
            f"segment {segments[depth]!r} matches none of their children {children}"
        )
    else:
        parts.append(f"; its top-level children are {[name for name, _ in root.named_children()]}")
    if near:
        parts.append(f". Closest module paths: {near}")
    return PlanPathNotFound("".join(parts))


def resolve_plan_path(root: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """Every submodule of ``root`` whose path matches ``path`` segment by segment (fnmatch wildcards
    ``*``, ``?``, ``[...]`` within a segment), in ``named_children`` order (``""``: ``root`` itself);
    raises :class:`PlanPathNotFound` if none does."""
    if not isinstance(path, str):
        raise TypeError(f"parallelize_module: plan keys must be module paths (str), got {path!r}")
    if path == "":
        return [("", root)]
    segments = path.split(".")
    if any(segment == "" for segment in segments):
        raise ValueError(f"parallelize_module: the plan path {path!r} has an empty segment")
    current: list[tuple[str, nn.Module]] = [("", root)]
    for depth, segment in enumerate(segments):
        following = [
            (_join(prefix, name), child)
            for prefix, module in current
            for name, child in module.named_children()
            if fnmatchcase(name, segment)
        ]
        if not following:
            raise _unmatched_path_error(root, path, current, depth)
        current = following
    return current


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelizePlan | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Apply tensor parallelism to ``module`` in place and return it.

    ``parallelize_plan`` is a :class:`ParallelStyle` applied to ``module`` itself, or a
    dict from submodule paths to styles.  A path is dotted module names, each segment
    an fnmatch pattern (``"layers.*.attention.wq"``); every matching submodule gets the
    style, entries are applied in dict order.  ``device_mesh`` is a 1-D mesh, or an
    n-D mesh with a dim named ``"tp"`` (its sub-mesh is used); default: the mesh
    entered with ``with mesh:``.  ``src_data_rank`` is the mesh index whose parameter
    values are distributed (``None``: every rank keeps its own values, no communication).
    """
    torch._C._log_api_usage_once("shardwise.tp_styles.parallelize_module")
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize_module expects an nn.Module, got {type(module).__name__}")
    mesh = _tensor_parallel_mesh(device_mesh)
    if parallelize_plan is None:
        warnings.warn(
            "No parallelize_plan is provided and auto-parallel is not supported at the moment, so this "
            "parallelize_module call will do nothing.",
            stacklevel=2,
        )
        return module

    targets: list[tuple[str | None, nn.Module, ParallelStyle]] = []
    if isinstance(parallelize_plan, ParallelStyle):
        targets.append((None, module, parallelize_plan))
    elif isinstance(parallelize_plan, Mapping):
        for path, style in parallelize_plan.items():
            checked = _check_style(style, f"the plan entry {path!r}")
            try:
                matches = resolve_plan_path(module, path)
            except PlanPathNotFound as not_found:
                warnings.warn(f"{not_found}; the entry is skipped", UserWarning, stacklevel=2)
                continue
            for matched_path, submodule in matches:
                targets.append((matched_path, submodule, checked))
    else:
        raise TypeError(
            "parallelize_module: parallelize_plan must be a ParallelStyle or a dict from module paths to "
            f"ParallelStyle, got {type(parallelize_plan).__name__}"
        )

    _check_targets(targets)
    for target_path, target, style in targets:
        style.src_data_rank = src_data_rank
        style._apply_at(target, mesh, target_path)
    return module


def _check_targets(targets: list[tuple[str | None, nn.Module, ParallelStyle]]) -> None:
    """Every check that can fail, for every target, before the first module is changed."""
    distributing: dict[int, tuple[str | None, ParallelStyle]] = {}
    for module_path, submodule, style in targets:
        style._check_module(submodule, module_path)
        if not _distributes_parameters(style):
            continue
        previous = distributing.get(id(submodule))
        if previous is not None:
            raise ValueError(
                f"parallelize_module: the plan lays out the parameters of module {module_path!r} "
                f"({type(submodule).__name__}) twice, with {previous[1]!r} and {style!r}; a module's parameters "
                "can be laid out by one style only"
            )
        distributing[id(submodule)] = (module_path, style)


def _distributes_parameters(style: ParallelStyle) -> bool:
    return isinstance(style, (ColwiseParallel, RowwiseParallel, SequenceParallel))
