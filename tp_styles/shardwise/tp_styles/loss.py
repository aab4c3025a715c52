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
from typing import Any, Iterator, Sequence

import torch
from shardwise.dtensor_ops import DTensor
from shardwise.dtensor_ops._op_handlers import OpHandler, custom_op_handlers
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
        if local.shape[dim] == 0:
            # An empty class shard (more ranks than classes) contributes nothing to max or sum.
            local_max = local.new_full((*local.shape[:dim], 1, *local.shape[dim + 1 :]), float("-inf"))
        else:
            local_max = local.amax(dim, keepdim=True)
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


class _NllProblem:
    """An nll_loss call as every rank sees it, in rows: one row of classes per target.

    A ``(C,)`` input is one row; ``(N, C)`` is N rows; ``(N, C, d1, ...)`` (aten's
    nll_loss2d, which ``F.cross_entropy`` reaches for inputs with more than 2 dims)
    is ``N * d1 * ...`` rows with the class dim moved last.
    """

    def __init__(self, op: torch._ops.OpOverload, value: Any, target: Any, weight: Any, ignore_index: int) -> None:
        x = _require_dtensor(value, op, "its input (log-probabilities)")
        if x.ndim == 0:
            raise ValueError(f"loss_parallel: {op} needs an input with a class dim, got a 0-dim tensor")
        self.class_dim = 0 if x.ndim == 1 else 1
        self.x = _class_sharded_or_replicated(x, self.class_dim)
        self.num_classes = int(x.shape[self.class_dim])
        self.mesh_dims = _class_mesh_dims(self.x.placements, self.class_dim)
        local_shape, offset = self.x._spec.local_shape_and_offset()
        self.class_offset = int(offset[self.class_dim])
        self.local_classes = int(local_shape[self.class_dim])
        local = self.x._local_tensor
        # Target shape: the input's shape without its class dim.
        self.target_shape = tuple(int(size) for dim, size in enumerate(x.shape) if dim != self.class_dim)
        row_count = 1
        for size in self.target_shape:
            row_count *= size
        self.local_rows = local.movedim(self.class_dim, -1).reshape(row_count, self.local_classes)

        target_local = _replicated_local(target, "target")
        assert target_local is not None
        if tuple(target_local.shape) != self.target_shape:
            raise ValueError(
                f"loss_parallel: target of shape {tuple(target_local.shape)} does not match input of shape "
                f"{tuple(x.shape)}; expected target shape {self.target_shape}"
            )
        self.target_rows = target_local.to(device=local.device).reshape(row_count)
        self.valid = self.target_rows != ignore_index
        out_of_bounds = self.valid & ((self.target_rows < 0) | (self.target_rows >= self.num_classes))
        if type(out_of_bounds) is torch.Tensor:
            if bool(out_of_bounds.any()):
                bad = int(self.target_rows[out_of_bounds][0])
                raise IndexError(f"Target {bad} is out of bounds (input has {self.num_classes} classes).")
        else:
            # Traced (torch.compile): the answer is not on the host; the graph asserts when it runs.
            torch._assert_async(
                ~out_of_bounds.any(), f"loss_parallel: a target is out of bounds (input has {self.num_classes} classes)"
            )
        safe_target = torch.where(self.valid, self.target_rows, torch.zeros_like(self.target_rows))

        weight_local = _replicated_local(weight, "weight")
        if weight_local is None:
            sample_weight = torch.ones(row_count, dtype=local.dtype, device=local.device)
        else:
            if tuple(weight_local.shape) != (self.num_classes,):
                raise ValueError(
                    f"loss_parallel: weight of shape {tuple(weight_local.shape)} must have one entry per class "
                    f"({self.num_classes})"
                )
            sample_weight = weight_local.to(dtype=local.dtype, device=local.device)[safe_target]
        self.sample_weight = torch.where(self.valid, sample_weight, torch.zeros_like(sample_weight))
        local_target = safe_target - self.class_offset
        self.in_shard = self.valid & (local_target >= 0) & (local_target < self.local_classes)
        self.local_index = torch.where(self.in_shard, local_target, torch.zeros_like(local_target))

    def rows_to_local(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows (one per target, classes last) back to the local input's layout."""
        shaped = rows.reshape(*self.target_shape, self.local_classes)
        return shaped.movedim(-1, self.class_dim).contiguous()


def _nll_loss_forward_handler(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    value, target, weight, reduction, ignore_index = _arguments(
        args, kwargs, ("self", "target", "weight", "reduction", "ignore_index")
    )
    problem = _NllProblem(op, value, target, weight, int(ignore_index))
    rows = problem.local_rows
    if problem.local_classes == 0:
        picked = rows.new_zeros(problem.target_rows.shape)
    else:
        picked = rows.gather(1, problem.local_index.unsqueeze(1)).squeeze(1)
        picked = torch.where(problem.in_shard, picked, torch.zeros_like(picked))
    if problem.mesh_dims:
        picked = _all_reduce_over(picked, problem.x, problem.mesh_dims, "sum")
    losses = -problem.sample_weight * picked
    total_weight = problem.sample_weight.sum()
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
    grad_output = grad_output.to(problem.sample_weight.dtype)
    # d loss / d logp[row, target of row] for each row (0 for ignored rows).
    if reduction == _REDUCTION_NONE:
        coefficient = -problem.sample_weight * grad_output.reshape(-1)
    else:
        coefficient = -problem.sample_weight * grad_output.reshape(())
        if reduction == _REDUCTION_MEAN:
            total = _replicated_local(total_weight, "total_weight")
            assert total is not None
            coefficient = coefficient / total
    rows = problem.local_rows
    grad_rows = torch.zeros_like(rows)
    if problem.local_classes > 0:
        grad_rows.scatter_(
            1,
            problem.local_index.unsqueeze(1),
            torch.where(problem.in_shard, coefficient, torch.zeros_like(coefficient)).unsqueeze(1),
        )
    result = _wrap(problem.rows_to_local(grad_rows), problem.x, problem.x.placements, problem.x.shape)
    # Each row holds one non-zero entry, so its sum over classes is that entry: known on every rank.
    row_sums = coefficient.reshape(*problem.target_shape, 1).movedim(-1, problem.class_dim)
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
