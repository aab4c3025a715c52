"""More reductions and ops along dims: nansum, count_nonzero, cummax/cummin/logcumsumexp,
kthvalue/median/nanmedian/mode over a dim, renorm, and the FFT kernels.

On one mesh dim:

* ``nansum`` and ``count_nonzero`` over a sharded dim give ``Partial(sum)`` (NaNs are skipped and
  non-zeros counted per piece; empty pieces give 0); kept dims stay sharded.  A Partial input is
  reduced first (``nansum`` of parts is not the ``nansum`` of their sum);
* ``cummax``/``cummin``/``logcumsumexp`` keep shards of every dim but the one they scan;
* ``kthvalue``/``median``/``nanmedian``/``mode`` over a dim keep the other dims sharded (the values
  and global indices need the whole dim);
* ``renorm(self, p, dim, maxnorm)`` rescales each slice along ``dim`` by the norm of that slice:
  only ``dim`` may stay sharded;
* ``_fft_r2c``/``_fft_c2c``/``_fft_c2r`` keep shards of the dims they do not transform (MKL rejects
  an empty piece, so a rank holding one makes its empty output itself);
* ``histc`` with a given range (``min != max``) counts each piece's elements into the same bins:
  any sharded dim gives ``Partial(sum)`` counts (as PyTorch).  Without a range the bins come from the
  data's own minimum and maximum, which no rank knows alone: the input is made whole first.
"""

from __future__ import annotations

import torch

from shardwise.placement import Partial, Replicate, Shard, normalize_dim

from .._rules import OneDimStrategy, OpCall, ShardingRule, register_rule
from ._aligned import empty_piece_kernel, free_dim_strategies
from .reduction import kept_dim_strategies, reduced_dims, reduction_output_meta

__all__ = ["ALONG_DIM_RULE", "FFT_RULE", "HISTC_RULE", "RENORM_RULE", "SUM_LIKE_RULE", "VALUES_AT_DIM_RULE"]

aten = torch.ops.aten


def _sum_like_strategies(call: OpCall) -> list[OneDimStrategy]:
    reduced, keepdim = reduced_dims(call)
    return kept_dim_strategies(len(call.input_shape(0)), reduced, keepdim, 1, (Partial("sum"),))


SUM_LIKE_RULE = ShardingRule(
    family="nansum/count_nonzero", one_dim_strategies=_sum_like_strategies, output_meta=reduction_output_meta
)


def _scan_dim(call: OpCall, position: int, default: int | None) -> int | None:
    ndim = len(call.input_shape(0))
    dim = call.arg(position, "dim", default)
    if not isinstance(dim, int):
        raise TypeError(f"{call.op}: dim must be an int, got {dim!r}")
    return normalize_dim(dim, ndim) if ndim else None


def _along_dim_strategies(call: OpCall) -> list[OneDimStrategy]:
    along = _scan_dim(call, 1, None)
    return free_dim_strategies(call, [dim for dim in range(len(call.input_shape(0))) if dim != along])


ALONG_DIM_RULE = ShardingRule(family="scan along a dim", one_dim_strategies=_along_dim_strategies)


def _values_at_dim_strategies(call: OpCall) -> list[OneDimStrategy]:
    """(values, indices) over one dim: kthvalue(self, k, dim=-1, keepdim), mode(self, dim=-1, keepdim),
    median/nanmedian(self, dim, keepdim)."""
    is_kthvalue = call.op._schema.name == "aten::kthvalue"
    dim_position = 2 if is_kthvalue else 1
    along = _scan_dim(call, dim_position, -1)
    keepdim = bool(call.arg(dim_position + 1, "keepdim", False))
    reduced = frozenset() if along is None else frozenset([along])
    return kept_dim_strategies(len(call.input_shape(0)), reduced, keepdim, 2)


VALUES_AT_DIM_RULE = ShardingRule(family="values at a dim", one_dim_strategies=_values_at_dim_strategies)


def _renorm_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    dim = call.arg(2, "dim")
    assert isinstance(dim, int)
    return free_dim_strategies(call, [normalize_dim(dim, ndim)] if ndim else [])


RENORM_RULE = ShardingRule(family="renorm", one_dim_strategies=_renorm_strategies)


def _fft_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    dims = call.arg(1, "dim")
    assert isinstance(dims, (list, tuple))
    transformed = {normalize_dim(int(dim), ndim) for dim in dims}
    return free_dim_strategies(call, [dim for dim in range(ndim) if dim not in transformed])


FFT_RULE = ShardingRule(family="fft", one_dim_strategies=_fft_strategies, local_kernel=empty_piece_kernel)

def _histc_strategies(call: OpCall) -> list[OneDimStrategy]:
    strategies = [OneDimStrategy((Replicate(),), (Replicate(),))]
    low, high = call.arg(2, "min", 0), call.arg(3, "max", 0)
    if low != high:  # torch takes the data's own range when they are equal
        strategies.extend(
            OneDimStrategy((Partial("sum"),), (Shard(dim),)) for dim in range(len(call.input_shape(0)))
        )
    return strategies


HISTC_RULE = ShardingRule(family="histc", one_dim_strategies=_histc_strategies)

register_rule((aten.histc.default, aten.histc.out), HISTC_RULE)
register_rule(
    (aten.nansum.default, aten.nansum.out, aten.count_nonzero.default, aten.count_nonzero.out,
     aten.count_nonzero.dim_IntList, aten.count_nonzero.dim_IntList_out),
    SUM_LIKE_RULE,
)  # fmt: skip
register_rule(
    (aten.cummax.default, aten.cummax.out, aten.cummin.default, aten.cummin.out, aten.logcumsumexp.default,
     aten.logcumsumexp.out),
    ALONG_DIM_RULE,
)  # fmt: skip
register_rule(
    (aten.kthvalue.default, aten.kthvalue.values, aten.mode.default, aten.mode.values, aten.median.dim,
     aten.median.dim_values, aten.nanmedian.dim, aten.nanmedian.dim_values),
    VALUES_AT_DIM_RULE,
)  # fmt: skip
register_rule((aten.renorm.default, aten.renorm.out), RENORM_RULE)
register_rule(
    (aten._fft_r2c.default, aten._fft_r2c.out, aten._fft_c2c.default, aten._fft_c2c.out, aten._fft_c2r.default,
     aten._fft_c2r.out),
    FFT_RULE,
)  # fmt: skip

