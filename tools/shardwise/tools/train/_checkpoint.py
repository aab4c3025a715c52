"""The trainer's checkpoints: model and optimizer state and the step, with torch.distributed.checkpoint.

Written by every rank with ``dcp.save`` from the (sharded) state itself, so a checkpoint written
with one ``--dp``/``--tp`` loads onto any other: DCP reads the saved pieces that overlap what each
rank holds (``shardwise.dtensor_ops`` describes each DTensor's pieces to it).  The optimizer's
per-parameter tensors are keyed by parameter name, so they do not depend on the parameter order.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

__all__ = ["OPTIMIZER_STATE_KEYS", "save_checkpoint", "load_checkpoint"]

# What each optimizer keeps per parameter (AdamW: its step count and both moments).
OPTIMIZER_STATE_KEYS = {"adamw": ("step", "exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_name: str, step: torch.Tensor) -> dict[str, Any]:
    optimizer_state: dict[str, torch.Tensor] = {}
    for name, parameter in model.named_parameters():
        per_parameter = optimizer.state[parameter]
        for key in OPTIMIZER_STATE_KEYS[optimizer_name]:
            optimizer_state[f"{name}.{key}"] = per_parameter[key]
    return {"model": model.state_dict(), "optimizer": optimizer_state, "trainer": {"step": step}}


def save_checkpoint(
    path: pathlib.Path, model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_name: str, step: int
) -> None:
    dcp.save(_state(model, optimizer, optimizer_name, torch.tensor(step)), checkpoint_id=str(path))


def load_checkpoint(
    path: pathlib.Path, model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_name: str
) -> int:
    """Loads model and optimizer state in place (whatever layout wrote them); returns the checkpoint's step."""
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"--resume: {path} holds no checkpoint (no .metadata); expected a --checkpoint-dir "
                                "written by an earlier run")
    with torch.no_grad():
        for parameter in model.parameters():
            # The state an optimizer step would create, in each parameter's layout, to load into.
            state = optimizer.state[parameter]
            for key in OPTIMIZER_STATE_KEYS[optimizer_name]:
                if key == "step":
                    state[key] = torch.tensor(0.0)
                else:
                    state[key] = torch.zeros_like(parameter)
    step = torch.tensor(0)
    state = _state(model, optimizer, optimizer_name, step)
    dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["model"])
    return int(state["trainer"]["step"])
