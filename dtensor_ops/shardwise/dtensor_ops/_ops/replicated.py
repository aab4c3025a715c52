"""Ops that sharding cannot help: every input replicated, every output replicated.

Most of linalg (factorisations, solves, inverses, eigen- and singular value decompositions:
every output element depends on the whole matrix), histograms, ``block_diag``, ``_trilinear``,
``pdist``, the margin losses with per-sample class lists, CTC, segment reductions and similar.
A sharded input is gathered (the planner's cheapest way to replicate it, a Partial one reduced)
and every rank runs the plain op on the whole tensors, so the result is the plain op's result,
replicated.  This is a real rule, not a fallback: these ops are only defined on the whole
operands, and the cost is stated (the redistribution of the inputs shows in ``CommDebugMode``).

Only deterministic ops whose output shapes follow from the input shapes belong here (the
decision is cached per input layout); ops whose output size depends on the values
(``nonzero``, ``unique``, ``masked_select``) cannot have a cached decision: they run on the whole
tensors in the op handler ``_handlers/value_sized.py``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from shardwise.placement import TensorMeta

from .._rules import OneDimStrategy, OpCall, ShardingRule, aten_overloads, register_rule
from ._aligned import outputs_on, replicated_strategy

__all__ = ["REPLICATED_RULE", "REPLICATED_OPS"]

aten = torch.ops.aten


def _replicated_strategies(call: OpCall) -> list[OneDimStrategy]:
    return [replicated_strategy(call)]


# No meta kernel in torch, and output shapes that follow from the input shapes alone: their output
# metadata comes from one run on zeros of the global shapes (these ops run on the whole tensors anyway).
_NO_META_KERNEL = frozenset(
    {"aten::geqrf", "aten::histogram", "aten::_histogramdd_from_bin_tensors", "aten::_histogramdd_bin_edges",
     "aten::_histogramdd_from_bin_cts", "aten::_ctc_loss", "aten::_ctc_loss_backward", "aten::multi_margin_loss_backward",
     "aten::multilabel_margin_loss_backward"}
)  # fmt: skip


def _replicated_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | tuple[TensorMeta | None, ...] | None:
    if op._schema.name not in _NO_META_KERNEL:
        return None  # the engine's meta run (which raises torch's errors for bad calls)
    return outputs_on(op, args, kwargs, "cpu")


REPLICATED_RULE = ShardingRule(
    family="replicated inputs", one_dim_strategies=_replicated_strategies, output_meta=_replicated_output_meta
)

_NAMES = (
    # linalg
    "linalg_cholesky_ex", "cholesky", "cholesky_inverse", "cholesky_solve", "_linalg_svd", "_linalg_det",
    "linalg_eig", "_linalg_eigh", "linalg_householder_product", "linalg_inv_ex", "linalg_ldl_factor_ex",
    "linalg_ldl_solve", "linalg_lu", "linalg_lu_factor_ex", "linalg_lu_solve", "linalg_pinv",
    "linalg_qr", "_linalg_slogdet", "_linalg_solve_ex", "linalg_solve_triangular", "linalg_matrix_exp", "geqrf",
    "ormqr", "triangular_solve", "lu_unpack", "_linalg_check_errors", "linalg_eigvals", "linalg_matrix_power",
    # whole-tensor ops
    "block_diag", "_trilinear", "histogram", "_histogramdd_bin_edges", "_histogramdd_from_bin_tensors",
    "_histogramdd_from_bin_cts", "_pdist_forward", "_pdist_backward", "hash_tensor", "segment_reduce",
    "_chunk_cat", "_embedding_bag_forward_only", "_embedding_bag", "_ctc_loss", "_unsafe_masked_index",
    "_unsafe_masked_index_put_accumulate", "multi_margin_loss", "multilabel_margin_loss_forward", "nonzero_static",
    "put", "linspace", "logspace", "masked_scatter", "masked_scatter_backward",
    # backward kernels of ops whose forward runs on replicated inputs (or reads whole rows/planes)
    "_prelu_kernel_backward", "grid_sampler_2d_backward", "grid_sampler_3d_backward", "multi_margin_loss_backward",
    "multilabel_margin_loss_backward", "_segment_reduce_backward", "_cdist_backward", "_ctc_loss_backward",
    "_embedding_bag_per_sample_weights_backward", "unfold_backward",
)  # fmt: skip

REPLICATED_OPS = [
    op
    for op in aten_overloads(_NAMES, with_inplace=False)
    # linspace/logspace on Python numbers only are factories (no tensor argument to carry the mesh).
    if any(isinstance(argument.type, torch.TensorType) for argument in op._schema.arguments)
] + [aten.median.default, aten.nanmedian.default, aten.median.out, aten.nanmedian.out]
# aten_overloads keeps ops taking and returning plain tensors; these return nothing (the check raises on a
# bad info tensor), take only tensor lists, or return one.
REPLICATED_OPS += [
    aten._linalg_check_errors.default, aten.block_diag.default, aten.block_diag.out, aten._chunk_cat.default,
    aten._chunk_cat.out, aten._histogramdd_bin_edges.default, aten.addbmm.default, aten.addbmm.out,
    aten.dist.out,  # (dist.default: along_dim's DIST_RULE)
]  # fmt: skip

register_rule(REPLICATED_OPS, REPLICATED_RULE)
