"""Errors of ``auto_plan`` / ``auto_parallelize`` about the model and its example inputs.

All of them are raised while planning, before ``auto_parallelize`` changes the model, and name what
was wrong: the module (its path in the model and its type), the example input, and the line of the
user's ``forward`` that was running (``file:line``), so that a model the planner cannot trace is
explained in the model's own terms, not by the fake-tensor op that happened to fail.
"""

from __future__ import annotations

import linecache
import os
import types
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "AutoPlanError",
    "DataDependentControlFlowError",
    "ExampleInputMismatchError",
    "UnsupportedModelError",
    "describe_inputs",
    "failure_site",
]


class AutoPlanError(Exception):
    """Base of the planner's model errors: ``module`` (path, ``""`` for the root), ``module_type``, ``location``."""

    def __init__(self, message: str, *, module: str | None = None, module_type: str | None = None, location: str | None = None) -> None:
        super().__init__(message)
        self.module = module
        self.module_type = module_type
        self.location = location


class ExampleInputMismatchError(AutoPlanError, ValueError):
    """The example inputs do not fit the model: a dtype, shape or device its forward rejects (``input_index``
    is the offending positional input when it is known)."""

    def __init__(self, message: str, *, input_index: int | None = None, **where: Any) -> None:
        super().__init__(message, **where)
        self.input_index = input_index


class UnsupportedModelError(AutoPlanError, TypeError):
    """The model (or one of its modules) is of a kind the planner cannot trace or lay out."""


class DataDependentControlFlowError(UnsupportedModelError):
    """The forward reads tensor values in Python (``if x.mean() > 0:``, ``.item()``) or makes a tensor whose
    shape depends on values (``nonzero``): the planner traces shapes only, so it cannot know the path taken."""


# Frames in these directories are torch's machinery or the planner's own, never the user's forward.
_TORCH_DIRECTORY = os.path.dirname(torch.__file__) + os.sep
_PLANNER_DIRECTORY = os.path.dirname(__file__) + os.sep


def _is_library_frame(filename: str) -> bool:
    return filename.startswith(_TORCH_DIRECTORY) or filename.startswith(_PLANNER_DIRECTORY)


def failure_site(
    traceback: types.TracebackType | None, module_paths: dict[int, str]
) -> tuple[str | None, str | None, str | None, str]:
    """(module path, module type, ``file:line``, that line's source) of the failure a traceback ends in.

    The module is the innermost ``forward`` on the stack whose ``self`` is a module of the model
    (``module_paths``: ``id(module) -> path``); the location is the innermost frame outside torch and
    this package, which is the line of the user's code that was running (in a leaf such as
    ``nn.Linear``, the caller's line that called it).
    """
    module_path: str | None = None
    module_type: str | None = None
    location: str | None = None
    source = ""
    frame_traceback = traceback
    while frame_traceback is not None:
        frame = frame_traceback.tb_frame
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in module_paths and frame.f_code.co_name == "forward":
            module_path, module_type = module_paths[id(owner)], type(owner).__name__
        filename = frame.f_code.co_filename
        if not _is_library_frame(filename):
            location = f"{filename}:{frame_traceback.tb_lineno}"
            source = linecache.getline(filename, frame_traceback.tb_lineno).strip()
        frame_traceback = frame_traceback.tb_next
    return module_path, module_type, location, source


def describe_inputs(example_inputs: tuple[Any, ...]) -> str:
    """The example inputs as the errors show them: ``[0] float32 (2, 8) on cpu, [1] int 3``."""
    parts = []
    for index, value in enumerate(example_inputs):
        if isinstance(value, torch.Tensor):
            parts.append(f"[{index}] {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)} on {value.device}")
        else:
            parts.append(f"[{index}] {type(value).__name__}")
    return ", ".join(parts) if parts else "none"

