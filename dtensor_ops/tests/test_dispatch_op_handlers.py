"""Custom op handlers: an op can be taken over whole (loss_parallel's cross-entropy does this)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops._op_handlers import custom_op_handlers, handlers_for, register_op_handler, unregister_op_handler
from shardwise.testing import multi_rank

aten = torch.ops.aten


def _add_then_ten(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    left, right = args[0], args[1]
    local = left.to_local() + right.to_local() + 10
    return DTensor.from_local(local, left.device_mesh, left.placements)


def _decline(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return NotImplemented


@multi_rank(world_size=2)
def test_handler_replaces_sharding_propagation_for_its_op_only() -> None:
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(8.0).reshape(4, 2)
    a = distribute_tensor(full, mesh, [Shard(0)])
    with custom_op_handlers({aten.add.Tensor: _add_then_ten}):
        assert torch.equal((a + a).full_tensor(), full + full + 10)
        # Other ops keep the normal path.
        assert torch.equal((a * a).full_tensor(), full * full)
    assert torch.equal((a + a).full_tensor(), full + full)


@multi_rank(world_size=2)
def test_handler_returning_not_implemented_falls_through() -> None:
    mesh = init_device_mesh("cpu", (2,))
    a = distribute_tensor(torch.ones(2, 2), mesh, [Replicate()])
    with custom_op_handlers({aten.add.Tensor: _decline}):
        assert torch.equal((a + a).full_tensor(), torch.full((2, 2), 2.0))


def test_registrations_stack_and_restore() -> None:
    register_op_handler(aten.sub.Tensor, _decline)
    try:
        with custom_op_handlers({aten.sub.Tensor: _add_then_ten}):
            # The most recent handler is asked first; the earlier one stays behind it.
            assert handlers_for(aten.sub.Tensor) == (_add_then_ten, _decline)
            with custom_op_handlers({aten.sub.Tensor: _add_then_ten}):  # nested: registered twice, removed once
                assert handlers_for(aten.sub.Tensor) == (_add_then_ten, _add_then_ten, _decline)
            assert handlers_for(aten.sub.Tensor) == (_add_then_ten, _decline)
        assert handlers_for(aten.sub.Tensor) == (_decline,)
        with pytest.raises(TypeError, match="OpOverload"):
            register_op_handler(aten.sub, _decline)  # type: ignore[arg-type]
    finally:
        unregister_op_handler(aten.sub.Tensor, _decline)
    assert handlers_for(aten.sub.Tensor) == ()
    unregister_op_handler(aten.sub.Tensor)  # absent: no error


@multi_rank(world_size=2)
def test_float_arguments_of_value_blind_ops_share_one_cached_decision() -> None:
    from shardwise.dtensor_ops._decision_pipeline import decision_cache_size as dispatch_cache_size

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(8.0).reshape(4, 2)
    a = distribute_tensor(full, mesh, [Shard(0)])
    b = distribute_tensor(full, mesh, [Shard(0)])
    (a * 0.5).add_(b, alpha=0.25)
    before = dispatch_cache_size()
    for step in range(1, 6):
        scaled = a * (0.5 / step)
        scaled.add_(b, alpha=0.25 / step)
        torch.testing.assert_close(scaled.full_tensor(), full * (0.5 / step) + full * (0.25 / step))
    # A learning-rate-like float that changes every step must not add cache entries.
    assert dispatch_cache_size() == before
