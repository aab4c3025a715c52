"""Starting the default process group from the torchrun environment and picking the device."""

from __future__ import annotations

import itertools
import os
import warnings
import weakref
from typing import Mapping, Protocol

import torch
import torch.distributed as dist

from shardwise.mesh._errors import MeshError

__all__ = [
    "TORCHRUN_ENV_VARS",
    "default_backend_for",
    "ensure_default_process_group",
    "select_device",
    "world_generation",
    "world_size_for_validation",
]

TORCHRUN_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_generation_by_world: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()
_generations = itertools.count(1)


def world_generation() -> int:
    """A number naming the current default process group, new after each ``init_process_group``.

    Two meshes over the same ranks built in different worlds (a ``destroy_process_group`` and a new
    ``init_process_group`` between them) have different communicators: the number tells them apart.
    """
    world = dist.distributed_c10d._get_default_group()
    generation = _generation_by_world.get(world)
    if generation is None:
        generation = _generation_by_world[world] = next(_generations)
    return generation


class DeviceHandle(Protocol):
    """The part of ``torch.cuda`` (or ``torch.xpu``, ...) used to pick this process's device."""

    def is_initialized(self) -> bool: ...

    def device_count(self) -> int: ...

    def set_device(self, device: int) -> None: ...


def default_backend_for(device_type: str) -> str | None:
    """The backend a mesh of ``device_type`` needs when we start the default group ourselves.

    CUDA gets NCCL for its tensors and gloo for CPU tensors (object collectives, CPU buffers).
    Other accelerators get torch's default for the machine (None).
    """
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "cpu:gloo,cuda:nccl"
    return None


def _int_env(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise MeshError(f"environment variable {name}={raw!r} is not an integer") from None


def world_size_for_validation(environ: Mapping[str, str] | None = None) -> int:
    """The world size a new mesh will live in, known before any rendezvous.

    From the default process group when there is one, else from the torchrun environment that
    ``ensure_default_process_group`` will use.
    """
    if dist.is_initialized():
        return dist.get_world_size()
    env = os.environ if environ is None else environ
    missing = [name for name in TORCHRUN_ENV_VARS if name not in env]
    if missing:
        raise MeshError(
            "no default process group is initialized and the torchrun environment is incomplete "
            f"(missing {', '.join(missing)}); launch with torchrun or call torch.distributed.init_process_group() "
            "before creating a DeviceMesh"
        )
    world_size = _int_env(env, "WORLD_SIZE")
    rank = _int_env(env, "RANK")
    if world_size < 1 or not 0 <= rank < world_size:
        raise MeshError(f"torchrun environment is inconsistent: RANK={rank}, WORLD_SIZE={world_size}")
    return world_size


def _device_handle(device_type: str) -> DeviceHandle | None:
    handle = getattr(torch, device_type, None)
    needed = ("is_initialized", "device_count", "set_device")
    if device_type == "cpu" or handle is None or not all(callable(getattr(handle, name, None)) for name in needed):
        return None
    return handle


def select_device(
    device_type: str,
    *,
    handle: DeviceHandle | None = None,
    environ: Mapping[str, str] | None = None,
    rank: int | None = None,
) -> int | None:
    """Set this process's accelerator unless the user already did; return the index set, if any.

    LOCAL_RANK (set by torchrun) wins; without it, ``rank % device_count`` assumes every host has
    the same number of devices, and says so.
    """
    device = handle if handle is not None else _device_handle(device_type)
    if device is None or device.is_initialized():
        return None
    env = os.environ if environ is None else environ
    count = device.device_count()
    if count == 0:
        return None
    if "LOCAL_RANK" in env:
        index = _int_env(env, "LOCAL_RANK")
        if not 0 <= index < count:
            raise MeshError(
                f"LOCAL_RANK={index} but this host has {count} {device_type} devices (valid: 0..{count - 1})"
            )
    else:
        if rank is None:
            return None
        warnings.warn(
            f"no {device_type} device was selected before creating the DeviceMesh and LOCAL_RANK is not set; "
            f"using device rank % {count} = {rank % count}, which assumes every host has {count} devices. "
            f"Call torch.{device_type}.set_device() first or launch with torchrun.",
            stacklevel=3,
        )
        index = rank % count
    device.set_device(index)
    return index


def ensure_default_process_group(device_type: str) -> None:
    """Start the default process group from env:// when none exists, and pick the device."""
    if not dist.is_initialized():
        world_size_for_validation()
        # Before the rendezvous, so that NCCL starts on the right device.
        select_device(device_type)
        dist.init_process_group(backend=default_backend_for(device_type), init_method="env://")
    select_device(device_type, rank=dist.get_rank())
