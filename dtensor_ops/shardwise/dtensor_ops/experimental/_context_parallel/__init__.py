"""PyTorch's ``torch.distributed.tensor.experimental._context_parallel`` package, at the same path.

Its modules are no files: the alias table (``_torch_compat/pytorch_paths.py``) serves each with one of
shardwise's context-parallel modules: ``_attention`` is ``experimental._attention``, ``_load_balancer``
the balancers (``_cp_layout``), ``_cp_custom_ops`` the flex all-gather op (``_cp_flex``).
"""

from .._attention import (
    _CausalBehavior,
    _context_parallel_shard,
    _ContextParallel,
    _cp_options,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _is_causal_behavior,
    _RotateMethod,
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)
from .._cp_flex import flex_cp_allgather
from .._cp_layout import _HeadTailLoadBalancer, _LoadBalancer, _PerDocumentHeadTailLoadBalancer, _PTRRLoadBalancer

__all__ = [
    "_CausalBehavior",
    "_context_parallel_shard",
    "_ContextParallel",
    "_cp_options",
    "_disable_context_parallel_dispatcher",
    "_enable_context_parallel_dispatcher",
    "_is_causal_behavior",
    "_RotateMethod",
    "context_parallel",
    "context_parallel_unshard",
    "set_rotate_method",
    "flex_cp_allgather",
    "_HeadTailLoadBalancer",
    "_LoadBalancer",
    "_PerDocumentHeadTailLoadBalancer",
    "_PTRRLoadBalancer",
]
