"""``F.scaled_dot_product_attention`` as context-parallel attention: the call's checks, its ring, and the mode.

:class:`_ContextParallelAttentionMode` is the ``TorchFunctionMode`` that ``context_parallel``, the
``_ContextParallel`` style and the dispatcher hold open: it sees SDPA before any kernel is chosen and
runs it as ring attention (``_cp_ring``) or Ulysses (``_cp_ulysses``), on this rank's plain pieces or on
DTensors whose sequence dim is sharded.  Every check runs locally (the same verdict on every rank)
before any collective.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement, Shard

from .. import _collectives
from .._dtensor import DTensor
from ._cp_kernels import choose_kernel
from ._cp_layout import SequenceLayout, contiguous_layout, head_tail_layout
from ._cp_ring import RingSpec, ring_attention
from ._cp_settings import SDPA_SEQ_DIM, _cp_options, _layout_of_local_length, _ROTATE_METHOD_NAMES, _RotateMethod
from ._cp_ulysses import ulysses_attention

SdpaArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float, bool, "float | None", bool]


def _sdpa_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> SdpaArgs:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    bound = dict(defaults)
    bound.update(zip(names, args))
    unknown = set(kwargs) - set(names)
    if unknown:
        raise TypeError(f"scaled_dot_product_attention() got unexpected keyword arguments {sorted(unknown)}")
    bound.update(kwargs)
    missing = [name for name in names[:3] if name not in bound]
    if missing:
        raise TypeError(f"scaled_dot_product_attention() missing arguments {missing}")
    return (
        bound["query"],
        bound["key"],
        bound["value"],
        bound["attn_mask"],
        float(bound["dropout_p"]),
        bool(bound["is_causal"]),
        bound["scale"],
        bool(bound["enable_gqa"]),
    )


def _ring_spec(
    group_name: str,
    rank: int,
    world_size: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_layout: SequenceLayout,
    kv_layout: SequenceLayout,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> RingSpec:
    """Check one attention call (locally, the same verdict on every rank) and describe its ring."""
    where = "context parallel scaled_dot_product_attention"
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() != 4:
            raise ValueError(f"{where} takes (batch, heads, seq, head_dim) tensors; {name} has shape {tuple(tensor.shape)}")
    if attn_mask is not None:
        raise ValueError(
            f"{where}: attn_mask is not supported (a mask over the whole sequence cannot be cut per ring step); "
            "use is_causal=True for causal attention"
        )
    if dropout_p != 0.0:
        raise ValueError(f"{where}: dropout_p={dropout_p} is not supported (expected 0.0)")
    if query.shape[0] != key.shape[0] or key.shape[0] != value.shape[0]:
        raise ValueError(f"{where}: batch sizes differ: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise ValueError(f"{where}: key {tuple(key.shape)} and value {tuple(value.shape)} must agree in heads and sequence")
    if query.shape[3] != key.shape[3]:
        raise ValueError(f"{where}: query head dim {query.shape[3]} differs from key head dim {key.shape[3]}")
    query_heads, kv_heads = query.shape[1], key.shape[1]
    if query_heads != kv_heads and not (enable_gqa and kv_heads > 0 and query_heads % kv_heads == 0):
        raise ValueError(
            f"{where}: {query_heads} query heads against {kv_heads} key/value heads; expected equal heads, or "
            "enable_gqa=True with query heads a multiple of key/value heads"
        )
    if is_causal and query_layout.global_length != kv_layout.global_length:
        raise ValueError(
            f"{where}: is_causal=True needs as many queries as keys; the sequences have {query_layout.global_length} "
            f"queries and {kv_layout.global_length} keys (across {world_size} ranks)"
        )
    if is_causal and query_layout != kv_layout:
        raise ValueError(f"{where}: is_causal=True needs queries and keys laid out alike over the ranks")
    if _cp_options.rotate_method == _RotateMethod.ULYSSES:
        if query_heads % world_size or kv_heads % world_size:
            raise ValueError(
                f"{where} with set_rotate_method('ulysses'): {query_heads} query and {kv_heads} key/value heads must both "
                f"divide by the {world_size} context-parallel ranks (each rank attends heads / {world_size} heads); "
                "use 'alltoall' or 'allgather' otherwise"
            )
        if query_layout != kv_layout:
            raise ValueError(f"{where} with set_rotate_method('ulysses'): queries and keys must have the same length")
    resolved_scale = float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[3])
    return RingSpec(
        group_name=group_name,
        rank=rank,
        world_size=world_size,
        query_layout=query_layout,
        kv_layout=kv_layout,
        is_causal=is_causal,
        scale=resolved_scale,
        query_heads_per_kv_head=query_heads // kv_heads,
        kernel=choose_kernel(
            query, key, value, is_causal, resolved_scale, max(query_layout.local_lengths()), max(kv_layout.local_lengths())
        ),
        rotate_method=_ROTATE_METHOD_NAMES[_cp_options.rotate_method],
    )


def _plain_tensor_attention(mesh: DeviceMesh, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(args, kwargs)
    world_size = mesh.size()
    rank = mesh.get_local_rank(0)
    if query.dim() == 4 and key.dim() == 4:
        query_layout = _layout_of_local_length(query.shape[SDPA_SEQ_DIM], rank, world_size)
        kv_layout = (
            query_layout
            if key.shape[SDPA_SEQ_DIM] == query.shape[SDPA_SEQ_DIM]
            else _layout_of_local_length(key.shape[SDPA_SEQ_DIM], rank, world_size)
        )
    else:
        query_layout = kv_layout = contiguous_layout(0, world_size)  # _ring_spec refuses the shapes
    spec = _ring_spec(
        _collectives.mesh_dim_group_name(mesh, 0), rank, world_size, query, key, value,
        query_layout, kv_layout, attn_mask, dropout_p, is_causal, scale, enable_gqa,
    )  # fmt: skip
    return _attend(spec, query, key, value)


def _attend(spec: RingSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if spec.rotate_method == "ulysses":
        return ulysses_attention(
            spec.group_name, spec.rank, spec.world_size, spec.query_layout, query, key, value, spec.is_causal, spec.scale
        )
    return ring_attention(spec, query, key, value)


def _dtensor_layout(global_length: int, world_size: int) -> SequenceLayout:
    # A DTensor's Shard(2) is torch.chunk's layout of its (possibly head-tail permuted) sequence: the two
    # agree when 2W divides the length, which is when a permuted sequence is taken as head-tail balanced.
    if _cp_options.enable_load_balance and global_length % (2 * world_size) == 0:
        return head_tail_layout(global_length, world_size)
    return contiguous_layout(global_length, world_size)


def _check_inputs_laid_out_as_query(where: str, query: Any, key: Any, value: Any) -> None:
    """Context-parallel attention needs key and value laid out as the query, on its mesh, and nothing Partial."""
    mesh = query.device_mesh
    for name, tensor in (("key", key), ("value", value)):
        if tensor.device_mesh != mesh or tuple(tensor.placements) != tuple(query.placements):
            raise ValueError(
                f"{where}: {name} is laid out as {tuple(tensor.placements)} on {tensor.device_mesh}; expected the query's "
                f"{tuple(query.placements)} on {mesh}"
            )
    if any(placement.is_partial() for placement in query.placements):
        raise ValueError(f"{where}: Partial inputs {tuple(query.placements)} must be reduced first")


def _context_parallel_mesh_dim(placements: Sequence[Placement]) -> int | None:
    found = [dim for dim, placement in enumerate(placements) if isinstance(placement, Shard) and placement.dim % 4 == SDPA_SEQ_DIM]
    return found[0] if len(found) == 1 else None


def _dtensor_attention(args: tuple[Any, ...], kwargs: dict[str, Any], defer_to_dispatch: bool = False) -> torch.Tensor | None:
    """Ring attention over the mesh dim that shards the query's sequence; None when no mesh dim does.

    ``defer_to_dispatch`` (the dispatcher's mode): None also when SDPA itself would reach a kernel whose
    DTensor op the dispatcher takes (:func:`_dispatch_level_kernel`), so the forward takes the one way a
    recomputation (activation checkpointing, in the backward where this mode is off) takes too.
    """
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(args, kwargs)
    where = "context parallel scaled_dot_product_attention on DTensors"
    if not (isinstance(query, DTensor) and isinstance(key, DTensor) and isinstance(value, DTensor)):
        raise TypeError(f"{where}: query, key and value must all be DTensors or all plain tensors")
    if query.dim() != 4:
        raise ValueError(f"{where} takes (batch, heads, seq, head_dim) tensors; query has shape {tuple(query.shape)}")
    cp_dim = _context_parallel_mesh_dim(query.placements)
    if cp_dim is None:
        return None
    mesh = query.device_mesh
    _check_inputs_laid_out_as_query(where, query, key, value)
    world_size = mesh.size(cp_dim)
    query_layout = _dtensor_layout(query.shape[SDPA_SEQ_DIM], world_size)
    kv_layout = query_layout if key.shape[SDPA_SEQ_DIM] == query.shape[SDPA_SEQ_DIM] else _dtensor_layout(key.shape[SDPA_SEQ_DIM], world_size)
    if defer_to_dispatch and _dispatch_level_kernel(mesh, cp_dim, query, key, value, query_layout, kv_layout, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return None
    local_query, local_key, local_value = query.to_local(), key.to_local(), value.to_local()
    spec = _ring_spec(
        _collectives.mesh_dim_group_name(mesh, cp_dim), mesh.get_local_rank(cp_dim), world_size,
        local_query, local_key, local_value, query_layout, kv_layout, attn_mask, dropout_p, is_causal, scale, enable_gqa,
    )  # fmt: skip
    local_out = _attend(spec, local_query, local_key, local_value)
    global_shape = (*query.shape[:3], value.shape[3])
    return DTensor.from_local(
        local_out, mesh, query.placements, run_check=False, shape=global_shape,
        stride=torch.empty(global_shape, device="meta").stride(),
    )  # fmt: skip


class _ContextParallelAttentionMode(TorchFunctionMode):
    """Runs ``F.scaled_dot_product_attention`` as ring attention.

    With a mesh, plain tensors are this rank's pieces along the mesh's one dim; DTensors (with or
    without a mesh here) use the mesh dim that shards their sequence.  Everything else runs as usual.
    """

    def __init__(self, mesh: DeviceMesh | None) -> None:
        super().__init__()
        self._mesh = mesh

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            if any(isinstance(arg, DTensor) for arg in (*args, *kwargs.values())):
                result = _dtensor_attention(args, kwargs, defer_to_dispatch=self._mesh is None)
                if result is not None:
                    return result
            elif self._mesh is not None:
                return _plain_tensor_attention(self._mesh, args, kwargs)
        return func(*args, **kwargs)



def _dispatch_level_kernel(
    mesh: DeviceMesh,
    cp_dim: int,
    query: DTensor,
    key: DTensor,
    value: DTensor,
    query_layout: SequenceLayout,
    kv_layout: SequenceLayout,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> bool:
    """Whether this (checked) DTensor SDPA call reaches the CPU flash kernel, whose DTensor ops the dispatcher handles."""
    if query.device.type != "cpu" or _cp_options.rotate_method == _RotateMethod.ULYSSES:
        return False
    if attn_mask is not None or dropout_p != 0.0 or query.shape[1] != key.shape[1]:
        return False  # SDPA's decomposition or a refusal: the mode's own ring says which
    if not isinstance(mesh.get_local_rank(cp_dim), int):
        return False  # every rank simulated in one process (LocalTensorMode): the mode's ring runs per rank
    # Asked without the dispatch modes (activation checkpointing's among them): the recomputation asks nothing.
    with _disable_current_modes():
        spec = _ring_spec(
            _collectives.mesh_dim_group_name(mesh, cp_dim), mesh.get_local_rank(cp_dim), mesh.size(cp_dim),
            query._local_tensor, key._local_tensor, value._local_tensor, query_layout, kv_layout,
            attn_mask, dropout_p, is_causal, scale, enable_gqa,
        )  # fmt: skip
    return spec.kernel.name == "flash_cpu"
