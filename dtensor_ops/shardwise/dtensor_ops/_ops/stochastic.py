"""Random ops: dropout, bernoulli, in-place and functional distribution fills, ``*_like`` random factories.

Where the values land is decided here; which values each rank draws (per shard,
equal on replicas, generators kept in step) is ``shardwise.dtensor_ops._shard_rng``'s
job, which dispatch runs for every op in its random-op set.

* Fills (``uniform_``, ``normal_``, ``bernoulli_(p)``, ``exponential_``, ...) never
  read ``self``'s values: ``self`` keeps whatever placement it has (in place,
  nothing moves).  On a Partial ``self`` the fill is drawn as if replicated along
  that mesh dim and stored in the Partial layout: ``Partial(sum)`` keeps it on the
  first rank of the mesh dim and zeros elsewhere, ``avg``/``max``/``min`` on every
  rank, so the reduced value is one draw (as for a replicated tensor).
* Functional fills (``uniform``, ``bernoulli(self, p)``, ...) and
  ``randint_like``/``rand_like(generator=)`` take the input's shards and are
  Replicate where the input is Partial (its values are not read).
* ``bernoulli(self)`` reads ``self`` as probabilities: Shard or Replicate only
  (a Partial input is reduced first); ``bernoulli_(self, p_tensor)`` reads ``p``,
  which follows ``self``'s shards like a broadcast operand.
* ``native_dropout`` is linear in its input for a fixed mask: Shard and Replicate
  pass through, and a ``Partial(sum/avg)`` input gives a Partial output with a
  Replicate mask (the mask is equal along that mesh dim, so the parts still add
  up to the dropout of the sum).  ``native_dropout_backward`` is the same
  product: the gradient may be Partial with a replicated mask.
* ``multinomial`` draws ``num_samples`` category indices per row of its probabilities: the
  categories of a row are read together (a row is normalised by its own sum), so only the
  rows of a 2-D input may be sharded (the samples of shard ``k`` come from shard ``k``'s
  stream); a 1-D input is one row and runs replicated.
* ``rrelu_with_noise`` (``F.rrelu`` in training) draws one slope per element into ``noise``
  (written) and scales the negative inputs by it: element-wise, ``self`` and ``noise`` share
  their shards and the slopes are drawn per shard.  Its backward is the same product with
  the incoming gradient, linear in that gradient (a Partial gradient stays Partial).
* ``_StridedShard`` (FSDP over TP: ``(_StridedShard(0, sf=tp), Shard(0))``): wherever a rule
  keeps or follows ``Shard(d)`` of its drawn tensor, it offers the same for each
  ``_StridedShard`` that tensor holds (on any mesh dim; where it holds something else that
  strategy would move it, so the cost model leaves it out).  Random rules get no strided
  variants from the engine, so they name them here; the draw then treats a strided mesh dim
  like a Shard one (its coordinate picks the shard's stream, ``_shard_rng``), with no
  communication.
"""

from __future__ import annotations

import dataclasses

from typing import Any, Callable, Mapping, Sequence

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta, _StridedShard

from ._shapes import input_meta, is_contiguous, same_as_input_meta
from .._rules import (
    RandomDraw,
    OneDimStrategy,
    OpCall,
    PlacementsPerTensor,
    ShardingRule,
    broadcast_input_placement,
    register_rule,
)
from .tensor_basics import LIKE_FACTORY_RULE

__all__ = [
    "BERNOULLI_PROBABILITIES_RULE",
    "BERNOULLI_TENSOR_P_RULE",
    "DROPOUT_BACKWARD_RULE",
    "DROPOUT_RULE",
    "FUNCTIONAL_FILL_RULE",
    "INPLACE_FILL_RULE",
    "MULTINOMIAL_RULE",
    "RRELU_BACKWARD_RULE",
    "RRELU_RULE",
]

aten = torch.ops.aten


def _strided_shards_of(call: OpCall, index: int = 0) -> list[_StridedShard]:
    """The ``_StridedShard`` placements input ``index`` holds on any mesh dim (dims normalised, in order)."""
    if index >= len(call.input_specs):
        return []
    ndim = len(call.input_shape(index))
    found: list[_StridedShard] = []
    for placement in call.input_specs[index].placements:
        if isinstance(placement, _StridedShard) and -ndim <= placement.dim < ndim:
            strided = _StridedShard(placement.dim % ndim, split_factor=placement.split_factor)
            if strided not in found:
                found.append(strided)
    return found


def _placements_keeping_drawn_values_unread(call: OpCall) -> list[Placement]:
    """What an input whose values are not read may keep, its own ``_StridedShard`` layouts included."""
    keep = call.placements_keeping_values_unread(len(call.input_shape(0)))
    return [*keep, *_strided_shards_of(call)]


def _inplace_fill_strategies(call: OpCall) -> list[OneDimStrategy]:
    return [OneDimStrategy((placement,), (placement,)) for placement in _placements_keeping_drawn_values_unread(call)]


def _inplace_fill_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = same_as_input_meta(op, args, kwargs)
    if meta is None or not meta.dtype.is_floating_point:
        return None  # torch rejects some fills of integer tensors: let meta tensors give its error
    return meta


INPLACE_FILL_RULE = ShardingRule(
    family="random-fill_",
    random=RandomDraw.FILL_IGNORING_SELF,
    one_dim_strategies=_inplace_fill_strategies,
    scalar_values_matter=False,
    output_meta=_inplace_fill_output_meta,
)


def _functional_fill_strategies(call: OpCall) -> list[OneDimStrategy]:
    strategies = []
    for placement in _placements_keeping_drawn_values_unread(call):
        output: Placement = Replicate() if isinstance(placement, Partial) else placement
        strategies.append(OneDimStrategy((output,), (placement,)))
    return strategies


def _functional_fill_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    if meta is None or not is_contiguous(meta) or not meta.dtype.is_floating_point:
        # A non-contiguous input's layout is kept as torch chooses, and some draws reject integer
        # tensors: let meta tensors decide (and raise torch's error).
        return None
    return meta


FUNCTIONAL_FILL_RULE = ShardingRule(
    family="random-fill",
    random=RandomDraw.VALUES,
    one_dim_strategies=_functional_fill_strategies,
    scalar_values_matter=False,
    output_meta=_functional_fill_output_meta,
)


def _bernoulli_probabilities_strategies(call: OpCall) -> list[OneDimStrategy]:
    strategies = [OneDimStrategy((Shard(dim),), (Shard(dim),)) for dim in range(len(call.input_shape(0)))]
    strategies.append(OneDimStrategy((Replicate(),), (Replicate(),)))
    strategies += [OneDimStrategy((strided,), (strided,)) for strided in _strided_shards_of(call)]
    return strategies


BERNOULLI_PROBABILITIES_RULE = ShardingRule(
    family="bernoulli(probabilities)",
    random=RandomDraw.VALUES,
    one_dim_strategies=_bernoulli_probabilities_strategies,
    output_meta=_functional_fill_output_meta,
)


def _bernoulli_tensor_p_strategies(call: OpCall) -> list[OneDimStrategy]:
    """``bernoulli(_)(self, p)``: ``self``'s values are unread, ``p`` is read like a broadcast operand."""
    self_shape = call.input_shape(0)
    has_p = len(call.input_specs) > 1
    p_shape = call.input_shape(1) if has_p else torch.Size(())
    in_place = call.op is aten.bernoulli_.Tensor
    strategies = []
    for placement in _placements_keeping_drawn_values_unread(call):
        if isinstance(placement, Shard):
            p_placement = broadcast_input_placement(self_shape, p_shape, placement.dim)
        elif isinstance(placement, _StridedShard):
            # p holds the same strided indices where it has self's extent; broadcast from size 1 or
            # missing there, every piece reads all of it.
            broadcast = broadcast_input_placement(self_shape, p_shape, placement.dim)
            p_placement = (
                _StridedShard(broadcast.dim, split_factor=placement.split_factor)
                if isinstance(broadcast, Shard)
                else broadcast
            )
        else:
            p_placement = Replicate()
        output: Placement = placement
        if isinstance(placement, Partial) and not in_place:
            output = Replicate()
        inputs: tuple[Placement, ...] = (placement, p_placement) if has_p else (placement,)
        strategies.append(OneDimStrategy((output,), inputs))
    return strategies


BERNOULLI_TENSOR_P_RULE = ShardingRule(
    family="bernoulli(p tensor)",
    random=RandomDraw.VALUES,
    one_dim_strategies=_bernoulli_tensor_p_strategies,
)


def _dropout_strategies(call: OpCall) -> list[OneDimStrategy]:
    strategies = [
        OneDimStrategy((Shard(dim), Shard(dim)), (Shard(dim),)) for dim in range(len(call.input_shape(0)))
    ]
    strategies.append(OneDimStrategy((Replicate(), Replicate()), (Replicate(),)))
    for reduce_op in call.linear_reduce_ops():
        strategies.append(OneDimStrategy((Partial(reduce_op), Replicate()), (Partial(reduce_op),)))
    strategies += [OneDimStrategy((strided, strided), (strided,)) for strided in _strided_shards_of(call)]
    return strategies


def _native_dropout_with_bool_mask(
    input: torch.Tensor, p: float, train: bool | None
) -> tuple[torch.Tensor, torch.Tensor]:
    output, mask = aten.native_dropout.default(input, p, train)
    if mask.dtype != torch.bool:
        # torch's CPU kernel returns a mask of the input's dtype for an empty input: an empty shard must still
        # hold the bool mask every other rank holds, or its collectives would not match theirs.
        mask = mask.to(torch.bool)
    return output, mask


def _dropout_local_kernel(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[DTensorSpec[Any] | None, ...]
) -> Callable[..., Any]:
    return _native_dropout_with_bool_mask


DROPOUT_RULE = ShardingRule(
    family="dropout",
    random=RandomDraw.VALUES,
    one_dim_strategies=_dropout_strategies,
    local_kernel=_dropout_local_kernel,
)


def _dropout_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    strategies = [
        OneDimStrategy((Shard(dim),), (Shard(dim), Shard(dim))) for dim in range(len(call.input_shape(0)))
    ]
    strategies.append(OneDimStrategy((Replicate(),), (Replicate(), Replicate())))
    for reduce_op in call.linear_reduce_ops():
        strategies.append(OneDimStrategy((Partial(reduce_op),), (Partial(reduce_op), Replicate())))
    return strategies


def _dropout_backward_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    grad = input_meta(args[0]) if args else None
    mask = input_meta(args[1]) if len(args) > 1 else None
    if grad is None or mask is None or grad.shape != mask.shape or not grad.dtype.is_floating_point:
        return None
    if not is_contiguous(grad):
        return None
    return grad


DROPOUT_BACKWARD_RULE = ShardingRule(
    family="dropout-backward",
    one_dim_strategies=_dropout_backward_strategies,
    scalar_values_matter=False,
    output_meta=_dropout_backward_output_meta,
)

def _multinomial_strategies(call: OpCall) -> list[OneDimStrategy]:
    strategies = [OneDimStrategy((Replicate(),), (Replicate(),))]
    if len(call.input_shape(0)) == 2:
        strategies.insert(0, OneDimStrategy((Shard(0),), (Shard(0),)))
        strategies += [OneDimStrategy((s,), (s,)) for s in _strided_shards_of(call) if s.dim == 0]
    return strategies


MULTINOMIAL_RULE = ShardingRule(
    family="multinomial", random=RandomDraw.VALUES, one_dim_strategies=_multinomial_strategies
)


def _same_shape_inputs(call: OpCall, count: int) -> bool:
    return all(call.input_shape(index) == call.input_shape(0) for index in range(1, count))


def _rrelu_strategies(call: OpCall) -> list[OneDimStrategy]:
    """``(self, noise)`` read and written element by element; outputs: the result (and the functional noise)."""
    num_outputs = len(call.output_metas)
    strategies = []
    if len(call.input_specs) == 2 and _same_shape_inputs(call, 2):
        strategies = [
            OneDimStrategy((Shard(dim),) * num_outputs, (Shard(dim), Shard(dim)))
            for dim in range(len(call.input_shape(0)))
        ]
        strategies += [
            OneDimStrategy((strided,) * num_outputs, (strided, strided))
            for strided in [*_strided_shards_of(call, 0), *_strided_shards_of(call, 1)]
        ]
    strategies.append(OneDimStrategy((Replicate(),) * num_outputs, (Replicate(),) * len(call.input_specs)))
    return strategies


RRELU_RULE = ShardingRule(family="rrelu", random=RandomDraw.VALUES, one_dim_strategies=_rrelu_strategies)


def _rrelu_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    """``(grad_output, self, noise)``: element-wise, linear in ``grad_output``."""
    count = len(call.input_specs)
    strategies = [OneDimStrategy((Replicate(),), (Replicate(),) * count)]
    if count == 3 and _same_shape_inputs(call, 3):
        strategies += [
            OneDimStrategy((Shard(dim),), (Shard(dim),) * 3) for dim in range(len(call.input_shape(0)))
        ]
        strategies += [
            OneDimStrategy((Partial(reduce_op),), (Partial(reduce_op), Replicate(), Replicate()))
            for reduce_op in call.linear_reduce_ops()
        ]
    return strategies


RRELU_BACKWARD_RULE = ShardingRule(family="rrelu-backward", one_dim_strategies=_rrelu_backward_strategies)

register_rule((aten.multinomial.default, aten.multinomial.out), MULTINOMIAL_RULE)
register_rule(
    (
        aten.rrelu_with_noise.default,
        aten.rrelu_with_noise.out,
        aten.rrelu_with_noise_.default,
        aten.rrelu_with_noise_functional.default,
    ),
    RRELU_RULE,
)
register_rule((aten.rrelu_with_noise_backward.default, aten.rrelu_with_noise_backward.out), RRELU_BACKWARD_RULE)
register_rule(
    (
        aten.uniform_.default,
        aten.normal_.default,
        aten.bernoulli_.float,
        aten.exponential_.default,
        aten.log_normal_.default,
        aten.geometric_.default,
        aten.cauchy_.default,
        getattr(aten.random_, "default"),
        getattr(aten.random_, "from"),
        getattr(aten.random_, "to"),
    ),
    INPLACE_FILL_RULE,
)
register_rule(
    (
        aten.uniform.default,
        aten.bernoulli.p,
        aten.exponential.default,
        aten.log_normal.default,
        aten.geometric.default,
        aten.cauchy.default,
    ),
    FUNCTIONAL_FILL_RULE,
)
register_rule((aten.bernoulli.default,), BERNOULLI_PROBABILITIES_RULE)
register_rule((aten.bernoulli.Tensor,), BERNOULLI_TENSOR_P_RULE)
# In place, the draw ignores self's old values: a Partial(sum) self keeps one draw on one rank.
register_rule(
    (aten.bernoulli_.Tensor,),
    dataclasses.replace(BERNOULLI_TENSOR_P_RULE, family="bernoulli_(p tensor)", random=RandomDraw.FILL_IGNORING_SELF),
)
register_rule((aten.native_dropout.default,), DROPOUT_RULE)
register_rule((aten.native_dropout_backward.default,), DROPOUT_BACKWARD_RULE)
def _random_like_factory_strategies(call: OpCall) -> list[OneDimStrategy]:
    """The like-factory's strategies, and the template's own ``_StridedShard`` layouts kept (values unread)."""
    assert LIKE_FACTORY_RULE.one_dim_strategies is not None
    strategies = list(LIKE_FACTORY_RULE.one_dim_strategies(call))
    strategies += [OneDimStrategy((strided,), (strided,)) for strided in _strided_shards_of(call)]
    return strategies


# The like-factory rule of tensor_basics, drawing values: every overload of the random *_like factories.
RANDOM_LIKE_FACTORY_RULE = dataclasses.replace(
    LIKE_FACTORY_RULE,
    family="random like-factory",
    random=RandomDraw.VALUES,
    one_dim_strategies=_random_like_factory_strategies,
)
register_rule(
    (
        aten.rand_like.default,
        aten.rand_like.out,
        aten.randn_like.default,
        aten.randn_like.out,
        aten.rand_like.generator,
        aten.randn_like.generator,
        aten.randint_like.default,
        aten.randint_like.low_dtype,
        aten.randint_like.generator,
        aten.randint_like.low_generator_dtype,
    ),
    RANDOM_LIKE_FACTORY_RULE,
)
