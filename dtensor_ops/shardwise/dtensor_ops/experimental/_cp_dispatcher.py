"""PyTorch's ``_enable_context_parallel_dispatcher`` / ``_disable_context_parallel_dispatcher`` (served at
PyTorch's path by ``_attention``), and the op handlers they register for the CPU flash kernel's DTensor ops.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch

from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement, Shard

from .. import _collectives
from .._dtensor import DTensor
from .._op_handlers import register_op_handler, unregister_op_handler
from ._cp_kernels import kernel_by_name
from ._cp_ring import RingSpec, ring_backward, ring_forward
from ._cp_sdpa import (
    _check_inputs_laid_out_as_query,
    _context_parallel_mesh_dim,
    _ContextParallelAttentionMode,
    _dtensor_layout,
    _ring_spec,
)
from ._cp_settings import SDPA_SEQ_DIM, _cp_options, _RotateMethod

_dispatcher_modes: list[_ContextParallelAttentionMode] = []


def _enable_context_parallel_dispatcher() -> None:
    """From now on SDPA on DTensors whose sequence dim is sharded runs as ring attention (until disabled).

    Two ways in, as one: a ``TorchFunctionMode`` takes ``F.scaled_dot_product_attention`` calls, and, like
    PyTorch's dispatcher, handlers of the CPU flash kernel's DTensor ops (forward and backward) take the
    kernel calls.  The handlers are what a call reaches where the mode is off: a ``TorchFunctionMode`` is
    off while it handles a call, so inside ``loss.backward()`` (which the mode sees) an activation-
    checkpointed block is recomputed without it.  The mode hands such calls to the handlers in the forward
    too, so the forward and its recomputation record the same autograd graph.
    """
    mode = _ContextParallelAttentionMode(None)
    mode.__enter__()
    _dispatcher_modes.append(mode)
    register_op_handler(_FLASH_CPU, _ring_flash_cpu_forward)
    register_op_handler(_FLASH_CPU_BACKWARD, _ring_flash_cpu_backward)


def _disable_context_parallel_dispatcher() -> None:
    """Undo the most recent :func:`_enable_context_parallel_dispatcher` (nothing if none is on)."""
    if _dispatcher_modes:
        _dispatcher_modes.pop().__exit__(None, None, None)
        unregister_op_handler(_FLASH_CPU, _ring_flash_cpu_forward)
        unregister_op_handler(_FLASH_CPU_BACKWARD, _ring_flash_cpu_backward)


# -- the dispatcher at the DTensor op level: the CPU flash kernel's forward and backward ----------------------

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default





def _sequence_sharded(query: Any, key: Any, value: Any) -> tuple[DeviceMesh, int] | None:
    """The mesh and mesh dim sharding these DTensors' sequence dim, or None when the call is not the ring's."""
    if not all(isinstance(tensor, DTensor) for tensor in (query, key, value)) or query.dim() != 4:
        return None
    cp_dim = _context_parallel_mesh_dim(query.placements)
    if cp_dim is None:
        return None
    mesh = query.device_mesh
    where = "context parallel scaled_dot_product_attention on DTensors"
    _check_inputs_laid_out_as_query(where, query, key, value)
    if any(isinstance(placement, Shard) and placement.dim % 4 == 3 for placement in query.placements):
        return None  # a cut head dim: the kernel's sharding rule decides
    return mesh, cp_dim


def _op_ring_spec(
    mesh: DeviceMesh, cp_dim: int, query: DTensor, key: DTensor, value: DTensor, is_causal: bool, scale: float | None
) -> RingSpec:
    world_size = mesh.size(cp_dim)
    query_layout = _dtensor_layout(query.shape[SDPA_SEQ_DIM], world_size)
    kv_layout = query_layout if key.shape[SDPA_SEQ_DIM] == query.shape[SDPA_SEQ_DIM] else _dtensor_layout(key.shape[SDPA_SEQ_DIM], world_size)
    if _cp_options.rotate_method == _RotateMethod.ULYSSES:
        raise NotImplementedError(
            "context parallel dispatcher: set_rotate_method('ulysses') runs through F.scaled_dot_product_attention "
            "inside the dispatcher's mode only; its CPU flash kernel ops (reached in a backward-time recomputation) "
            "take 'allgather' or 'alltoall'"
        )
    spec = _ring_spec(
        _collectives.mesh_dim_group_name(mesh, cp_dim), mesh.get_local_rank(cp_dim), world_size,
        query._local_tensor, key._local_tensor, value._local_tensor, query_layout, kv_layout,
        None, 0.0, is_causal, scale, query.shape[1] != key.shape[1],
    )  # fmt: skip
    # The kernel is the op's: the local tensors' own choice may differ (they do not require grad here).
    return replace(spec, kernel=kernel_by_name("flash_cpu"))


def _like(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]) -> DTensor:
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=tuple(shape), stride=torch.empty(tuple(shape), device="meta").stride()
    )


def _in_layout(tensor: DTensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    if tuple(tensor.placements) != tuple(placements):
        tensor = tensor.redistribute(mesh, placements)
    return tensor._local_tensor


def _flash_cpu_arguments(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    bound: dict[str, Any] = {"dropout_p": 0.0, "is_causal": False, "attn_mask": None, "scale": None}
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def _ring_flash_cpu_forward(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_scaled_dot_product_flash_attention_for_cpu`` on sequence-sharded DTensors: the ring's output and log-sum-exp."""
    bound = _flash_cpu_arguments(args, kwargs, ("query", "key", "value", "dropout_p", "is_causal"))
    query, key, value = bound["query"], bound["key"], bound["value"]
    found = _sequence_sharded(query, key, value)
    if found is None or bound["attn_mask"] is not None or float(bound["dropout_p"]) != 0.0:
        return NotImplemented
    mesh, cp_dim = found
    spec = _op_ring_spec(mesh, cp_dim, query, key, value, bool(bound["is_causal"]), bound["scale"])
    local_out, local_lse = ring_forward(spec, query._local_tensor, key._local_tensor, value._local_tensor)
    batch, heads, q_len = query.shape[:3]
    placements = tuple(query.placements)
    return (
        _like(local_out, mesh, placements, (batch, heads, q_len, value.shape[3])),
        _like(local_lse, mesh, placements, (batch, heads, q_len)),
    )


def _ring_flash_cpu_backward(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_scaled_dot_product_flash_attention_for_cpu_backward`` on sequence-sharded DTensors: the ring's gradients."""
    names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
    bound = _flash_cpu_arguments(args, kwargs, names)
    query, key, value = bound["query"], bound["key"], bound["value"]
    found = _sequence_sharded(query, key, value)
    if found is None or bound["attn_mask"] is not None or float(bound["dropout_p"]) != 0.0:
        return NotImplemented
    if not all(isinstance(bound[name], DTensor) for name in ("grad_out", "out", "logsumexp")):
        return NotImplemented
    mesh, cp_dim = found
    placements = tuple(query.placements)
    spec = _op_ring_spec(mesh, cp_dim, query, key, value, bool(bound["is_causal"]), bound["scale"])
    grad_query, grad_key, grad_value = ring_backward(
        spec,
        _in_layout(bound["grad_out"], mesh, placements),
        query._local_tensor,
        key._local_tensor,
        value._local_tensor,
        _in_layout(bound["out"], mesh, placements),
        _in_layout(bound["logsumexp"], mesh, placements),
    )
    return (
        _like(grad_query, mesh, placements, query.shape),
        _like(grad_key, mesh, placements, key.shape),
        _like(grad_value, mesh, placements, value.shape),
    )
