"""``loss_parallel()``: cross-entropy on logits sharded on the class dim, without gathering them.

Drop-in for ``torch.distributed.tensor.parallel.loss_parallel`` (PyTorch 2.13).
Inside the context, DTensor dispatch hands four aten ops to the handlers below
(``F.cross_entropy`` decomposes into the first and third; autograd calls the
others in backward):

* ``_log_softmax``: local max -> all-reduce(max) -> local sum of exps ->
  all-reduce(sum) -> ``x - max - log(sum)``, still sharded on the class dim;
* ``nll_loss_forward``: each rank picks the log-probability of the targets that
  fall in its class range (zero elsewhere), one all-reduce(sum) completes them,
  then weights, ``ignore_index`` and the reduction are applied on every rank;
* ``nll_loss_backward``: the one-hot gradient, built locally on each shard;
* ``_log_softmax_backward_data``: ``g - softmax * rowsum(g)``; ``rowsum(g)``
  needs an all-reduce in general, but when ``g`` is the untouched output of
  ``nll_loss_backward`` its row sums are known (``-weight * grad`` at the
  target), so the backward of ``cross_entropy`` needs no collective at all.

So a forward costs 3 all-reduces of ``batch`` elements each and the backward
none; the ``batch x classes`` logits are never gathered.  Logits are laid out as
``F.cross_entropy`` takes them: ``(C,)``, ``(N, C)`` or ``(N, C, d1, ...)`` with the
classes on dim 1 (flatten ``(B, S, V)`` language-model logits to ``(B*S, V)``); on every mesh
dim they should be ``Shard(class dim)`` or ``Replicate()`` (other placements are
redistributed to ``Replicate()`` first: correct, not cheap).  Targets and
weights may be plain tensors (the same on every rank) or DTensors.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple, Sequence

import torch
from shardwise.dtensor_ops import DTensor
from shardwise.dtensor_ops._op_handlers import OpHandler, custom_op_handlers
from shardwise.mesh._simulation import run_for_each_simulated_rank
from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorMeta,
    contiguous_strides,
    normalize_dim,
)

__all__ = ["loss_parallel", "LOSS_PARALLEL_OPS"]

aten = torch.ops.aten

# Set on the gradient nll_loss_backward returns: (row sums of that gradient along the class dim, as a
# local replicated tensor; the gradient's version counter when they were computed).
_ROW_SUMS_ATTRIBUTE = "_shardwise_loss_parallel_row_sums"

# Reductions as aten numbers them.
_REDUCTION_NONE, _REDUCTION_MEAN, _REDUCTION_SUM = 0, 1, 2


# -- layout helpers ----------------------------------------------------------------------------


def _class_sharded_or_replicated(tensor: DTensor, class_dim: int) -> DTensor:
    """``tensor`` with every mesh dim ``Shard(class_dim)`` or ``Replicate()`` (others redistributed)."""
    placements = tensor.placements
    target = tuple(p if isinstance(p, Shard) and p.dim == class_dim else Replicate() for p in placements)
    if target == placements:
        return tensor
    return tensor.redistribute(placements=target)


def _class_mesh_dims(placements: Sequence[Placement], class_dim: int) -> tuple[int, ...]:
    return tuple(mesh_dim for mesh_dim, p in enumerate(placements) if isinstance(p, Shard) and p.dim == class_dim)


def _all_reduce_over(local: torch.Tensor, like: DTensor, mesh_dims: tuple[int, ...], reduce_op: str) -> torch.Tensor:
    """Reduce ``local`` (this rank's value of a tensor replicated on every other mesh dim) over ``mesh_dims``."""
    mesh = like.device_mesh
    placements = tuple(Partial(reduce_op) if mesh_dim in mesh_dims else Replicate() for mesh_dim in range(mesh.ndim))
    meta = TensorMeta(local.shape, local.stride(), local.dtype)
    partial = DTensor(local, DTensorSpec(mesh, placements, meta), requires_grad=False)
    return partial.redistribute(placements=(Replicate(),) * mesh.ndim)._local_tensor


def _wrap(local: torch.Tensor, like: DTensor, placements: tuple[Placement, ...], shape: Sequence[int]) -> DTensor:
    # Same global stride as ``like`` when the shape is its shape: autograd then accumulates a gradient
    # as it is instead of copying it into a tensor of the parameter's layout.
    stride = tuple(like.stride()) if tuple(shape) == tuple(like.shape) else contiguous_strides(shape)
    return DTensor(
        local, DTensorSpec(like.device_mesh, placements, TensorMeta(torch.Size(shape), stride, local.dtype)),
        requires_grad=False,
    )


def _replicated_local(value: Any, what: str) -> torch.Tensor | None:
    """The whole of a target/weight on this rank: a plain tensor as is, a DTensor replicated."""
    if value is None:
        return None
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        return value.redistribute(placements=(Replicate(),) * mesh.ndim)._local_tensor
    if isinstance(value, torch.Tensor):
        return value
    raise TypeError(f"loss_parallel: {what} must be a tensor, got {type(value).__name__}")


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any], names: Sequence[str]) -> list[Any]:
    values = list(args) + [None] * (len(names) - len(args))
    for index, name in enumerate(names):
        if name in kwargs:
            values[index] = kwargs[name]
    return values


def _require_dtensor(value: Any, op: torch._ops.OpOverload, what: str) -> DTensor:
    if not isinstance(value, DTensor):
        raise TypeError(f"loss_parallel: {op} expects {what} as a DTensor, got {type(value).__name__}")
    return value


# -- log_softmax --------------------------------------------------------------------------------


def _shard_max(local: torch.Tensor, dim: int) -> torch.Tensor:
    """Max of this rank's class shard along ``dim`` (keepdim); -inf for an empty shard."""
    if local.shape[dim] == 0:
        # An empty class shard (more ranks than classes) contributes nothing to max or sum.
        return local.new_full((*local.shape[:dim], 1, *local.shape[dim + 1 :]), float("-inf"))
    return local.amax(dim, keepdim=True)


def _log_softmax_handler(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    value, dim, half_to_float = _arguments(args, kwargs, ("self", "dim", "half_to_float"))
    x = _require_dtensor(value, op, "its input")
    dim = normalize_dim(int(dim), max(x.ndim, 1))
    x = _class_sharded_or_replicated(x, dim)
    local = x._local_tensor
    if half_to_float:
        local = local.float()
    mesh_dims = _class_mesh_dims(x.placements, dim)
    if not mesh_dims:
        result = torch._log_softmax(local, dim, False)
    else:
        # Per simulated rank under torch's LocalTensorMode (shard sizes differ by rank); a plain call otherwise.
        local_max = run_for_each_simulated_rank(_shard_max, local, dim)
        global_max = _all_reduce_over(local_max, x, mesh_dims, "max")
        # A row whose max is -inf (all -inf) would give nan from (-inf) - (-inf); torch gives nan there too.
        shifted = local - global_max
        sum_exp = _all_reduce_over(shifted.exp().sum(dim, keepdim=True), x, mesh_dims, "sum")
        result = shifted - sum_exp.log()
    return _wrap(result, x, x.placements, x.shape)


def _log_softmax_backward_handler(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> object:
    grad_value, output_value, dim, input_dtype = _arguments(args, kwargs, ("grad_output", "output", "dim", "input_dtype"))
    grad = _require_dtensor(grad_value, op, "grad_output")
    output = _require_dtensor(output_value, op, "output")
    dim = normalize_dim(int(dim), max(output.ndim, 1))
    if grad.placements != output.placements:
        grad = grad.redistribute(placements=output.placements)
    grad_local = grad._local_tensor
    output_local = output._local_tensor
    row_sums = _known_row_sums(grad_value, grad)
    if row_sums is None:
        row_sums = grad_local.sum(dim, keepdim=True)
        mesh_dims = _class_mesh_dims(output.placements, dim)
        if mesh_dims:
            row_sums = _all_reduce_over(row_sums, output, mesh_dims, "sum")
    result = (grad_local - output_local.exp() * row_sums).to(input_dtype)
    return _wrap(result, output, output.placements, output.shape)


def _known_row_sums(original: DTensor, prepared: DTensor) -> torch.Tensor | None:
    """Row sums recorded by nll_loss_backward, if ``original`` is that very gradient, unmodified."""
    if prepared is not original:
        return None
    recorded = getattr(original, _ROW_SUMS_ATTRIBUTE, None)
    if recorded is None:
        return None
    row_sums, version = recorded
    if version != original._version:
        return None  # written in place since (a hook, say): the recorded sums no longer hold
    return row_sums


# -- nll_loss -----------------------------------------------------------------------------------


class _RankRows(NamedTuple):
    """One rank's rows of an nll_loss call: its class shard, its targets in it, the sample weights."""

    local_rows: torch.Tensor  # (rows, local_classes): this rank's log-probabilities, classes last
    local_classes: int
    sample_weight: torch.Tensor  # (rows,): the target's class weight, 0 for ignored rows
    in_shard: torch.Tensor  # (rows,): whether the row's target class lives on this rank
    local_index: torch.Tensor  # (rows,): the target's index within this rank's shard (0 elsewhere)


class _NllProblem:
    """An nll_loss call as every rank sees it, in rows: one row of classes per target.

    A ``(C,)`` input is one row; ``(N, C)`` is N rows; ``(N, C, d1, ...)`` (aten's
    nll_loss2d, which ``F.cross_entropy`` reaches for inputs with more than 2 dims)
    is ``N * d1 * ...`` rows with the class dim moved last.

    Construction does the DTensor-level work (layouts, replicating targets and weights: maybe
    collectives); :meth:`rank_rows` does the rank-dependent math on local tensors, no collective,
    so under torch's ``LocalTensorMode`` it runs once per simulated rank
    (``run_for_each_simulated_rank``) between collectives issued once for every rank.
    """

    def __init__(self, op: torch._ops.OpOverload, value: Any, target: Any, weight: Any, ignore_index: int) -> None:
        x = _require_dtensor(value, op, "its input (log-probabilities)")
        if x.ndim == 0:
            raise ValueError(f"loss_parallel: {op} needs an input with a class dim, got a 0-dim tensor")
        self.class_dim = 0 if x.ndim == 1 else 1
        self.x = _class_sharded_or_replicated(x, self.class_dim)
        self.num_classes = int(x.shape[self.class_dim])
        self.mesh_dims = _class_mesh_dims(self.x.placements, self.class_dim)
        self.ignore_index = ignore_index
        # Target shape: the input's shape without its class dim.
        self.target_shape = tuple(int(size) for dim, size in enumerate(x.shape) if dim != self.class_dim)
        self.row_count = 1
        for size in self.target_shape:
            self.row_count *= size

        target_local = _replicated_local(target, "target")
        assert target_local is not None
        if tuple(target_local.shape) != self.target_shape:
            raise ValueError(
                f"loss_parallel: target of shape {tuple(target_local.shape)} does not match input of shape "
                f"{tuple(x.shape)}; expected target shape {self.target_shape}"
            )
        self.target_local = target_local
        self.weight_local = _replicated_local(weight, "weight")
        if self.weight_local is not None and tuple(self.weight_local.shape) != (self.num_classes,):
            raise ValueError(
                f"loss_parallel: weight of shape {tuple(self.weight_local.shape)} must have one entry per class "
                f"({self.num_classes})"
            )

    def rank_rows(
        self, x_local: torch.Tensor, target_local: torch.Tensor, weight_local: torch.Tensor | None
    ) -> _RankRows:
        """This rank's rows, from its own local tensors (plain ones, one rank's, under the mode)."""
        local_shape, offset = self.x._spec.local_shape_and_offset()
        class_offset = int(offset[self.class_dim])
        local_classes = int(local_shape[self.class_dim])
        local_rows = x_local.movedim(self.class_dim, -1).reshape(self.row_count, local_classes)
        target_rows = target_local.to(device=x_local.device).reshape(self.row_count)
        valid = target_rows != self.ignore_index
        out_of_bounds = valid & ((target_rows < 0) | (target_rows >= self.num_classes))
        if type(out_of_bounds) is torch.Tensor:
            if bool(out_of_bounds.any()):
                bad = int(target_rows[out_of_bounds][0])
                raise IndexError(f"Target {bad} is out of bounds (input has {self.num_classes} classes).")
        else:
            # Traced (torch.compile): the answer is not on the host; the graph asserts when it runs.
            torch._assert_async(
                ~out_of_bounds.any(), f"loss_parallel: a target is out of bounds (input has {self.num_classes} classes)"
            )
        safe_target = torch.where(valid, target_rows, torch.zeros_like(target_rows))
        if weight_local is None:
            sample_weight = torch.ones(self.row_count, dtype=x_local.dtype, device=x_local.device)
        else:
            sample_weight = weight_local.to(dtype=x_local.dtype, device=x_local.device)[safe_target]
        sample_weight = torch.where(valid, sample_weight, torch.zeros_like(sample_weight))
        local_target = safe_target - class_offset
        in_shard = valid & (local_target >= 0) & (local_target < local_classes)
        local_index = torch.where(in_shard, local_target, torch.zeros_like(local_target))
        return _RankRows(local_rows, local_classes, sample_weight, in_shard, local_index)

    def rows_to_local(self, rows: torch.Tensor, local_classes: int) -> torch.Tensor:
        """Rows (one per target, classes last) back to the local input's layout."""
        shaped = rows.reshape(*self.target_shape, local_classes)
        return shaped.movedim(-1, self.class_dim).contiguous()


def _nll_loss_forward_handler(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    value, target, weight, reduction, ignore_index = _arguments(
        args, kwargs, ("self", "target", "weight", "reduction", "ignore_index")
    )
    problem = _NllProblem(op, value, target, weight, int(ignore_index))

    def picked_and_weights(
        x_local: torch.Tensor, target_local: torch.Tensor, weight_local: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's log-probability of each row's target (0 where another rank holds it)."""
        rows = problem.rank_rows(x_local, target_local, weight_local)
        if rows.local_classes == 0:
            return rows.local_rows.new_zeros((problem.row_count,)), rows.sample_weight
        picked = rows.local_rows.gather(1, rows.local_index.unsqueeze(1)).squeeze(1)
        return torch.where(rows.in_shard, picked, torch.zeros_like(picked)), rows.sample_weight

    # Per simulated rank under torch's LocalTensorMode; a plain call otherwise.
    picked, sample_weight = run_for_each_simulated_rank(
        picked_and_weights, problem.x._local_tensor, problem.target_local, problem.weight_local
    )
    if problem.mesh_dims:
        picked = _all_reduce_over(picked, problem.x, problem.mesh_dims, "sum")
    losses = -sample_weight * picked
    total_weight = sample_weight.sum()
    if reduction == _REDUCTION_NONE:
        output = losses.reshape(problem.target_shape)
        # aten reports the target's weight for one sample, 0 for a batch, when nothing is reduced.
        if problem.target_shape:
            total_weight = total_weight.new_zeros(())
    elif reduction == _REDUCTION_MEAN:
        output = losses.sum() / total_weight
    elif reduction == _REDUCTION_SUM:
        output = losses.sum()
    else:
        raise ValueError(f"loss_parallel: unknown reduction {reduction!r} for {op}")
    replicated = (Replicate(),) * problem.x.device_mesh.ndim
    return (
        _wrap(output, problem.x, replicated, output.shape),
        _wrap(total_weight, problem.x, replicated, ()),
    )


def _nll_loss_backward_handler(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    grad_value, value, target, weight, reduction, ignore_index, total_weight = _arguments(
        args, kwargs, ("grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight")
    )
    problem = _NllProblem(op, value, target, weight, int(ignore_index))
    grad_output = _replicated_local(grad_value, "grad_output")
    assert grad_output is not None
    total = None
    if reduction == _REDUCTION_MEAN:
        total = _replicated_local(total_weight, "total_weight")
        assert total is not None

    def gradient_and_row_sums(
        x_local: torch.Tensor,
        target_local: torch.Tensor,
        weight_local: torch.Tensor | None,
        grad_local: torch.Tensor,
        total_local: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard of the one-hot gradient, and the row sums of the whole gradient."""
        rows = problem.rank_rows(x_local, target_local, weight_local)
        grad_out = grad_local.to(rows.sample_weight.dtype)
        # d loss / d logp[row, target of row] for each row (0 for ignored rows).
        if reduction == _REDUCTION_NONE:
            coefficient = -rows.sample_weight * grad_out.reshape(-1)
        else:
            coefficient = -rows.sample_weight * grad_out.reshape(())
            if total_local is not None:
                coefficient = coefficient / total_local
        grad_rows = torch.zeros_like(rows.local_rows)
        if rows.local_classes > 0:
            grad_rows.scatter_(
                1,
                rows.local_index.unsqueeze(1),
                torch.where(rows.in_shard, coefficient, torch.zeros_like(coefficient)).unsqueeze(1),
            )
        # Each row holds one non-zero entry, so its sum over classes is that entry: known on every rank.
        row_sums = coefficient.reshape(*problem.target_shape, 1).movedim(-1, problem.class_dim)
        return problem.rows_to_local(grad_rows, rows.local_classes), row_sums

    # Per simulated rank under torch's LocalTensorMode; a plain call otherwise.
    grad_local, row_sums = run_for_each_simulated_rank(
        gradient_and_row_sums, problem.x._local_tensor, problem.target_local, problem.weight_local, grad_output, total
    )
    result = _wrap(grad_local, problem.x, problem.x.placements, problem.x.shape)
    setattr(result, _ROW_SUMS_ATTRIBUTE, (row_sums, result._version))
    return result


# -- the context manager ---------------------------------------------------------------------------

LOSS_PARALLEL_OPS: dict[torch._ops.OpOverload, OpHandler] = {
    aten._log_softmax.default: _log_softmax_handler,
    aten._log_softmax_backward_data.default: _log_softmax_backward_handler,
    aten.nll_loss_forward.default: _nll_loss_forward_handler,
    aten.nll_loss_backward.default: _nll_loss_backward_handler,
    aten.nll_loss2d_forward.default: _nll_loss_forward_handler,
    aten.nll_loss2d_backward.default: _nll_loss_backward_handler,
}


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Within this context, ``F.cross_entropy`` (and ``F.log_softmax`` + ``F.nll_loss``) on DTensor
    logits sharded on the class dim compute the loss and its gradient without gathering the logits.

    Run the backward inside the context too::

        with loss_parallel():
            loss = F.cross_entropy(logits, target)   # logits: DTensor, Shard(1) of (N, C)
            loss.backward()

    The loss is a replicated DTensor.  Targets and weights may be plain tensors
    (identical on every rank) or DTensors.
    """
    with custom_op_handlers(LOSS_PARALLEL_OPS):
        yield
