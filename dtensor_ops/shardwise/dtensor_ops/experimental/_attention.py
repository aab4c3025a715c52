"""Context parallelism (mirrors ``torch.distributed.tensor.experimental._attention``).

``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` shards the given buffers in place along
their sequence dims and, while it is open, runs ``F.scaled_dot_product_attention`` as ring attention
over the mesh (``_cp_ring``).  How SDPA is intercepted: a ``TorchFunctionMode`` pushed for the
duration of the context sees the call before any kernel is chosen, so the CPU flash kernel, the math
path and the CUDA kernels all take the same way, and autograd sees one differentiable ring call.

Which positions each rank holds is one :class:`~._cp_layout.SequenceLayout`, chosen when the buffers
are sharded (head-tail balanced by default, any length) and read again by the attention inside the
context and by :func:`context_parallel_unshard`.  Plain tensors seen by SDPA in the context are
this rank's pieces of that layout (a length that is not this rank's share of it is taken as an even
share of ``local length * W``).  DTensors whose query is ``Shard(2)`` on one mesh dim are ring-
attended over that mesh dim, so context parallelism composes with tensor parallelism on a 2-D mesh.

Errors about the arguments are raised on every rank before any collective, and the buffers are put
back as they were.

Under torch's ``LocalTensorMode`` (every rank simulated in one process) the buffers are
``LocalTensor``s and the mesh answers every rank's coordinate at once: what depends on the rank
(the piece a rank keeps, the layout its local length stands for) runs once per simulated rank
(``_cp_ring.on_each_rank``).

The pieces live in modules of their own, all served here under PyTorch's names (torch's code and tests
import them from this path): the options and the layout they choose (``_cp_settings``), sharding and
unsharding buffers (``_cp_buffers``), SDPA's checks and the mode (``_cp_sdpa``), the DTensor dispatcher
(``_cp_dispatcher``) and the ``_ContextParallel`` style (``_cp_module_style``).  This module keeps
``context_parallel`` itself.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
# Beyond what context_parallel uses, every name this module held before it was split stays importable
# from it: code written for PyTorch imports names, private ones included, from this path.
from torch.nn.attention.flex_attention import BlockMask

from shardwise.mesh import DeviceMesh
from shardwise.placement import Shard

from .._dtensor import DTensor
from ._cp_buffers import (
    _check_balancer_share,
    _check_cp_mesh,
    _context_parallel_shard,
    _cp_block_mask_of,
    _create_cp_block_mask,
    _normalized_seq_dims,
    _padded_front,
    _piece_of_rank,
    _rank_positions,
    _restore_index,
    _rows_for_balancer,
    _shard,
    _shard_rows,
    _unshard,
    context_parallel_unshard,
)
from ._cp_dispatcher import (
    _FLASH_CPU,
    _FLASH_CPU_BACKWARD,
    _disable_context_parallel_dispatcher,
    _dispatcher_modes,
    _enable_context_parallel_dispatcher,
    _flash_cpu_arguments,
    _in_layout,
    _like,
    _op_ring_spec,
    _ring_flash_cpu_backward,
    _ring_flash_cpu_forward,
    _sequence_sharded,
)
from ._cp_flex import flex_cp_allgather
from ._cp_layout import _HeadTailLoadBalancer, _LoadBalancer, _PerDocumentHeadTailLoadBalancer, _PTRRLoadBalancer
from ._cp_module_style import _ContextParallel, _FlexKeyValueGather, _RingAttentionDuringForward
from ._cp_sdpa import (
    SdpaArgs,
    _attend,
    _check_inputs_laid_out_as_query,
    _context_parallel_mesh_dim,
    _ContextParallelAttentionMode,
    _dispatch_level_kernel,
    _dtensor_attention,
    _dtensor_layout,
    _plain_tensor_attention,
    _ring_spec,
    _sdpa_arguments,
)
from ._cp_settings import (
    _ROTATE_METHOD_NAMES,
    SDPA_SEQ_DIM,
    _CausalBehavior,
    _ContextParallelOptions,
    _cp_options,
    _create_default_load_balancer,
    _default_layout,
    _is_causal_behavior,
    _layout_of_local_length,
    _record_layouts,
    _RotateMethod,
    _rows_of_local_length,
    _rows_of_rank_length,
    set_rotate_method,
)


__all__ = [
    "_CausalBehavior",
    "_context_parallel_shard",
    "_ContextParallel",
    "_cp_options",
    "_create_cp_block_mask",
    "_create_default_load_balancer",
    "_disable_context_parallel_dispatcher",
    "_enable_context_parallel_dispatcher",
    "_is_causal_behavior",
    "_RotateMethod",
    "_HeadTailLoadBalancer",
    "_LoadBalancer",
    "_PerDocumentHeadTailLoadBalancer",
    "_PTRRLoadBalancer",
    "context_parallel",
    "context_parallel_unshard",
    "set_rotate_method",
    # PyTorch's _context_parallel._attention (this module, at that path too) imports it for flex attention.
    "flex_cp_allgather",
]


_active_context: list[DeviceMesh] = []


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh,
    *,
    buffers: Sequence[torch.Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
) -> Iterator[None]:
    """Shard ``buffers`` in place along ``buffer_seq_dims`` over the 1-D ``mesh`` and run SDPA as ring attention.

    The buffers are rearranged by the default load balancer (head-tail while
    ``_cp_options.enable_load_balance``, the default; any length) and each rank keeps its share.
    On exit every buffer not in ``no_restore_buffers`` gets its original shape and values back,
    also when the block raised.  Buffers must not require grad while they are resized (set
    ``requires_grad`` inside the context).  Contexts do not nest.
    """
    buffer_list = list(buffers) if buffers is not None else []
    seq_dims = list(buffer_seq_dims) if buffer_seq_dims is not None else []
    not_restored = list(no_restore_buffers) if no_restore_buffers is not None else []
    _check_cp_mesh(mesh, "context_parallel")
    if _active_context:
        raise RuntimeError(
            f"context_parallel contexts cannot be nested: one is already open on {_active_context[-1]}; "
            "close it before opening another"
        )
    normalized = _normalized_seq_dims(buffer_list, seq_dims, "context_parallel")
    for buffer in not_restored:
        if not any(buffer is candidate for candidate in buffer_list):
            raise ValueError("`no_restore_buffers` must be a subset of `buffers`.")
    for index, buffer in enumerate(buffer_list):
        if buffer.requires_grad:
            raise ValueError(
                f"context_parallel: buffer {index} {tuple(buffer.shape)} requires grad and cannot be resized in place; "
                "pass it with requires_grad=False and set requires_grad inside the context"
            )
        if any(other is buffer for other in buffer_list[:index]):
            raise ValueError(f"context_parallel: buffer {index} is given twice")
    world_size = mesh.size()
    rank = mesh.get_local_rank(0)
    layout = _default_layout(buffer_list[0].shape[normalized[0]], world_size) if buffer_list else None
    originals = [None if any(buffer is kept for kept in not_restored) else buffer.clone() for buffer in buffer_list]
    mode = _ContextParallelAttentionMode(mesh)
    _active_context.append(mesh)
    try:
        if layout is not None:
            with torch.no_grad():
                for buffer, dim in zip(buffer_list, normalized):
                    piece = _shard(buffer, dim, layout, rank)
                    buffer.resize_(piece.shape)
                    buffer.copy_(piece)
            _record_layouts((layout,))
        with mode:
            yield
    finally:
        _active_context.pop()
        with torch.no_grad():
            for buffer, original in zip(buffer_list, originals):
                if original is not None:
                    # A buffer made to require grad inside the context is a leaf (it had no history at
                    # entry): resize it with the flag off and put the flag back.  Its .grad is left as is.
                    wanted_grad = buffer.requires_grad
                    buffer.requires_grad_(False)
                    buffer.resize_(original.shape)
                    buffer.copy_(original)
                    buffer.requires_grad_(wanted_grad)

