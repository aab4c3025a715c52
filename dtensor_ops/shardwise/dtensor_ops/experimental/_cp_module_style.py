"""PyTorch's ``_ContextParallel`` ParallelStyle (served at PyTorch's path by ``_attention``): context
parallelism inside one attention module's forward, SDPA's ring or flex attention's key/value gather.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
import torch.nn as nn

from shardwise.mesh import DeviceMesh

from .. import _collectives
from .._dtensor import DTensor
from ._cp_buffers import _check_cp_mesh
from ._cp_flex import gather_key_value
from ._cp_sdpa import _ContextParallelAttentionMode
from ._cp_settings import SDPA_SEQ_DIM, _rows_of_local_length

class _ContextParallel:
    """Context parallelism inside one attention module's forward (PyTorch's ``_ContextParallel`` ParallelStyle).

    Apply it with ``parallelize_module(module, cp_mesh, _ContextParallel(seq_dim=2, attention_type=...))``
    (``shardwise.tp_styles`` counts it as a ``ParallelStyle``):

    * ``AttentionType.SDPA``: during the module's forward, SDPA on plain tensors is ring attention over
      the mesh, with the layout of the last ``_context_parallel_shard``; DTensor inputs sharded on
      their sequence dim are ring-attended too.
    * ``AttentionType.FLEX``: the module is called as ``flex_attention`` is, ``(query, key, value, ...)``
      with this rank's pieces; before its forward, key and value become the whole sequence in layout
      order (one all-gather; one reduce-scatter of their gradients in backward), so the module's
      ``flex_attention`` with the ``BlockMask`` from ``_context_parallel_shard`` (or
      ``_create_cp_block_mask``) computes this rank's rows exactly.
    """

    class AttentionType(Enum):
        FLEX = "flex_attention"
        SDPA = "scaled_dot_product_attention"

    src_data_rank: int | None = 0

    def __init__(self, seq_dim: int, attention_type: _ContextParallel.AttentionType) -> None:
        if not isinstance(attention_type, self.AttentionType):
            raise ValueError(f"_ContextParallel: unknown attention type {attention_type!r}; expected one of {list(self.AttentionType)}")
        if seq_dim % 4 != SDPA_SEQ_DIM:
            raise ValueError(
                f"_ContextParallel: the sequence dim of (batch, heads, seq, head_dim) attention inputs is {SDPA_SEQ_DIM}; got {seq_dim}"
            )
        self.seq_dim = seq_dim
        self.attention_type = attention_type

    def _check_module(self, module: nn.Module, module_path: str | None) -> None:
        """Any module may hold attention calls: nothing to refuse."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_cp_mesh(device_mesh, "_ContextParallel")
        if self.attention_type is self.AttentionType.FLEX:
            module.register_forward_pre_hook(_FlexKeyValueGather(device_mesh, self.seq_dim % 4), with_kwargs=True)
            return module
        hooks = _RingAttentionDuringForward(device_mesh)
        module.register_forward_pre_hook(hooks.enter)
        module.register_forward_hook(hooks.leave, always_call=True)
        return module

    def _apply_at(self, module: nn.Module, device_mesh: DeviceMesh, module_path: str | None) -> nn.Module:
        """What ``shardwise.tp_styles.parallelize_module`` calls (it registers this class as a ParallelStyle)."""
        return self._apply(module, device_mesh)


class _FlexKeyValueGather:
    """A forward pre-hook: the module's ``key``/``value`` arguments become every rank's pieces in layout order."""

    ARGUMENT_NAMES = ("query", "key", "value")

    def __init__(self, mesh: DeviceMesh, seq_dim: int) -> None:
        self.mesh = mesh
        self.seq_dim = seq_dim

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        bound = dict(zip(self.ARGUMENT_NAMES, args))
        bound.update({name: kwargs[name] for name in self.ARGUMENT_NAMES if name in kwargs})
        missing = [name for name in self.ARGUMENT_NAMES if not isinstance(bound.get(name), torch.Tensor)]
        if missing:
            raise TypeError(
                f"_ContextParallel(FLEX) calls the module as flex_attention(query, key, value, ...); {missing} are not tensors "
                f"(got {type(module).__name__} called with {len(args)} positional and {sorted(kwargs)} keyword arguments)"
            )
        query, key, value = (bound[name] for name in self.ARGUMENT_NAMES)
        if isinstance(query, DTensor) or isinstance(key, DTensor) or isinstance(value, DTensor):
            raise TypeError("_ContextParallel(FLEX) takes this rank's pieces as plain tensors, not DTensors")
        world_size = self.mesh.size()
        rank = self.mesh.get_local_rank(0)
        key_layout = _rows_of_local_length(key.shape[self.seq_dim], rank, world_size)[0]
        gathered_key, gathered_value = gather_key_value(
            key, value, self.seq_dim, _collectives.mesh_dim_group_name(self.mesh, 0), key_layout.local_lengths()
        )
        replaced = {"key": gathered_key, "value": gathered_value}
        new_args = list(args)
        for index, name in enumerate(self.ARGUMENT_NAMES[: len(args)]):
            new_args[index] = replaced.get(name, new_args[index])
        new_kwargs = {name: replaced.get(name, arg) for name, arg in kwargs.items()}
        return tuple(new_args), new_kwargs


class _RingAttentionDuringForward:
    """Forward hooks that hold a ring-attention mode open for the module's forward (a class: modules stay deep-copyable)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.open_modes: list[_ContextParallelAttentionMode] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        mode = _ContextParallelAttentionMode(self.mesh)
        mode.__enter__()
        self.open_modes.append(mode)

    def leave(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.open_modes:
            self.open_modes.pop().__exit__(None, None, None)
        return output

