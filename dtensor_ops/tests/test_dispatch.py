"""DTensor dispatch: key -> cached decision -> redistribute, local op, wrap.

The first tests script the sharding decisions (the rule engine is replaced for
the duration of the test) so that every dispatch path is checked on its own:
redistribution of inputs, caching, in-place, out=, tuple and non-tensor results,
local argument overrides and the errors.  The last ones run real ops through
the real sharding rules against plain torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise.dtensor_ops._op_runner as dispatch
import shardwise.dtensor_ops._decision_pipeline as pipeline
from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops._caches import clear_all_caches
from shardwise.dtensor_ops._decision_pipeline import call_key, decision_cache_size
from shardwise.dtensor_ops._decision import OpDecision
from shardwise.mesh import DeviceMesh
from shardwise.placement import DTensorSpec, Placement, TensorMeta
from shardwise.testing import multi_rank

aten = torch.ops.aten
Rule = Callable[[tuple[Any, ...], dict[str, Any]], OpDecision]


def as_dtensor(value: object) -> DTensor:
    """``value``, checked to be a DTensor (ops on DTensors are typed as returning torch.Tensor)."""
    assert isinstance(value, DTensor), type(value)
    return value


@contextlib.contextmanager
def scripted_rules(rules: dict[Any, Rule], calls: list[Any]) -> Iterator[None]:
    """Replace the rule decider: ``rules[op](spec_args, spec_kwargs)`` decides; every call is recorded."""
    real = pipeline.DECIDERS
    rule_index = [decider.name for decider in real].index("the op's rule")

    def scripted(call: Any) -> Any:
        args, kwargs = tuple(call.spec_args), dict(call.spec_kwargs)
        calls.append((call.op, args, kwargs))
        if call.op in rules:
            return rules[call.op](args, kwargs)
        return real[rule_index].decide(call)

    clear_all_caches()
    table = list(real)
    table[rule_index] = dataclasses.replace(real[rule_index], decide=scripted)
    pipeline.DECIDERS = tuple(table)  # type: ignore[misc]
    try:
        yield
    finally:
        pipeline.DECIDERS = real  # type: ignore[misc]
        clear_all_caches()


def spec_of(mesh: DeviceMesh, placements: tuple[Placement, ...], shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> DTensorSpec[DeviceMesh]:
    stride = torch.empty(shape).stride()
    return DTensorSpec(mesh, placements, TensorMeta(torch.Size(shape), stride, dtype))


@multi_rank
def test_scripted_redistribution_cache_and_overrides() -> None:
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    a_full, b_full = torch.randn(8, 4), torch.randn(4, 4)
    a = distribute_tensor(a_full, mesh, [Shard(0)])
    b = distribute_tensor(b_full, mesh, [Shard(0)])
    out_spec = spec_of(mesh, (Shard(0),), (8, 4))
    replicated_b = spec_of(mesh, (Replicate(),), (4, 4))

    def mm_rule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpDecision:
        assert args == (a._spec, b._spec) and kwargs == {}
        return OpDecision(output_specs=out_spec, input_specs=(a._spec, replicated_b), needs_redistribute=True)

    def pow_rule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpDecision:
        return OpDecision(output_specs=spec_of(mesh, (Shard(0),), (8, 4)), input_specs=(args[0],), needs_redistribute=False)

    def view_rule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpDecision:
        assert args[1] == [4, 8]
        # The local view of a (2, 4) shard as 2 rows of the (4, 8) global view: (1, 8).
        return OpDecision(
            output_specs=spec_of(mesh, (Shard(0),), (4, 8)),
            input_specs=(args[0],),
            needs_redistribute=False,
            local_arg_overrides=((1, [1, 8]),),
        )

    calls: list[Any] = []
    with scripted_rules({aten.mm.default: mm_rule, aten.pow.Tensor_Scalar: pow_rule, aten.view.default: view_rule}, calls):
        result = as_dtensor(torch.mm(a, b))
        # The second input was all-gathered before the local op ran.
        assert isinstance(result, DTensor) and result._spec is out_spec
        assert torch.allclose(result.to_local(), a.to_local() @ b_full)
        assert result.shape == (8, 4) and result.stride() == (4, 1)
        # Same specs again: a cache hit, the rule engine is not asked twice.
        again = as_dtensor(torch.mm(a, b))
        assert torch.allclose(again.to_local(), result.to_local())
        assert sum(1 for call in calls if call[0] is aten.mm.default) == 1

        # 2 and 2.0 are different keys (they can give different dtypes); 2 and 2 are the same.
        a.pow(2)
        a.pow(2)
        a.pow(2.0)
        pow_calls = [call for call in calls if call[0] is aten.pow.Tensor_Scalar]
        assert len(pow_calls) == 2 and type(pow_calls[0][1][1]) is int and type(pow_calls[1][1][1]) is float

        viewed = as_dtensor(a.view(4, 8))
        assert viewed.shape == (4, 8) and viewed.to_local().shape == (1, 8)
        assert torch.equal(viewed.to_local(), a.to_local().reshape(1, 8))
    assert decision_cache_size() == 0


@multi_rank
def test_a_miss_builds_its_key_once_and_propagation_gets_the_same_key() -> None:
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    built: list[Any] = []
    handed: list[Any] = []
    real_call_key = pipeline.call_key
    real_decide = dispatch.decide

    def counting_call_key(*args: Any, **kwargs: Any) -> Any:
        key = real_call_key(*args, **kwargs)
        built.append(key)
        return key

    def recording(call: Any) -> Any:
        handed.append(call._key)
        return real_decide(call)

    clear_all_caches()
    pipeline.call_key = counting_call_key  # type: ignore[assignment]
    dispatch.decide = recording  # type: ignore[assignment]
    try:
        flat = as_dtensor(x * 3.0)  # the flat reader
        general = as_dtensor(torch.add(x, x, alpha=2))  # kwargs: the nested reader
    finally:
        pipeline.call_key = real_call_key  # type: ignore[assignment]
        dispatch.decide = real_decide
    # Two misses: each handed its own key on, and the pipeline built none.
    assert built == []
    assert handed == [
        call_key(aten.mul.Tensor, (x._spec, 3.0)),
        call_key(aten.add.Tensor, (x._spec, x._spec), {"alpha": 2}),
    ]
    torch.testing.assert_close(flat.full_tensor(), x.full_tensor() * 3.0)
    torch.testing.assert_close(general.full_tensor(), x.full_tensor() * 3)
    clear_all_caches()


@multi_rank
def test_scripted_inplace_out_and_tuple_results() -> None:
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(1)
    x_full, y_full = torch.randn(8, 3), torch.randn(8, 3)
    x = distribute_tensor(x_full, mesh, [Shard(0)])
    y = distribute_tensor(y_full, mesh, [Shard(0)])
    z = distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)])
    same = x._spec

    def unchanged(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpDecision:
        specs = tuple(value for value in (*args, *kwargs.values()) if isinstance(value, DTensorSpec))
        return OpDecision(output_specs=same, input_specs=specs, needs_redistribute=False)

    def max_dim(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpDecision:
        values = spec_of(mesh, (Shard(0),), (8,))
        indices = spec_of(mesh, (Shard(0),), (8,), torch.int64)
        return OpDecision(output_specs=(values, indices), input_specs=(args[0],), needs_redistribute=False)

    def no_output(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpDecision:
        return OpDecision(output_specs=None, input_specs=(args[0], args[1]), needs_redistribute=False)

    calls: list[Any] = []
    rules: dict[Any, Rule] = {
        aten.add_.Tensor: unchanged,
        aten.add.out: unchanged,
        aten.max.dim: max_dim,
        aten.is_same_size.default: no_output,
    }
    with scripted_rules(rules, calls):
        before = x.to_local().clone()
        returned = x.add_(y)
        assert returned is x and x._spec is same
        assert torch.equal(x.to_local(), before + y.to_local())

        out = torch.add(x, y, out=z)
        assert out is z and torch.equal(z.to_local(), x.to_local() + y.to_local())
        out_call = [call for call in calls if call[0] is aten.add.out][0]
        assert out_call[2]["out"] == z._spec  # out tensors reach the rules as specs, in kwargs

        values, indices = (as_dtensor(v) for v in torch.max(x, dim=1))
        assert values.shape == (8,) and indices.dtype == torch.int64
        local_values, local_indices = torch.max(x.to_local(), dim=1)
        assert torch.equal(values.to_local(), local_values) and torch.equal(indices.to_local(), local_indices)

        assert x.is_same_size(y) is True


@multi_rank
def test_scripted_errors() -> None:
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)])
    y = distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)])
    replicated = spec_of(mesh, (Replicate(),), (8, 3))

    def move_self(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpDecision:
        return OpDecision(output_specs=replicated, input_specs=(replicated, replicated), needs_redistribute=True)

    def wrong_count(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpDecision:
        return OpDecision(output_specs=replicated, input_specs=(replicated,), needs_redistribute=True)

    def no_spec_for_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpDecision:
        return OpDecision(output_specs=None, input_specs=(args[0], args[1]), needs_redistribute=False)

    calls: list[Any] = []
    rules: dict[Any, Rule] = {aten.mul_.Tensor: move_self, aten.sub.Tensor: wrong_count, aten.mul.Tensor: no_spec_for_tensor}
    if dist.get_rank() == 0:
        # All raised before any collective: only rank 0 runs them.
        with scripted_rules(rules, calls):
            with pytest.raises(RuntimeError, match=r"aten\.mul_\.Tensor.*in-place or out="):
                x.mul_(y)
            with pytest.raises(RuntimeError, match="1 target input specs for 2 tensor arguments"):
                x - y
            with pytest.raises(RuntimeError, match="no output spec"):
                x * y
    dist.barrier()


# -- real sharding rules -----------------------------------------------------------------------


@multi_rank
def test_ops_against_plain_torch() -> None:
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(2)
    a_full, b_full, w_full, bias_full = torch.randn(8, 4), torch.randn(8, 4), torch.randn(6, 4), torch.randn(6)
    a = distribute_tensor(a_full, mesh, [Shard(0)])
    b = distribute_tensor(b_full, mesh, [Shard(0)])
    w = distribute_tensor(w_full, mesh, [Replicate()])
    bias = distribute_tensor(bias_full, mesh, [Replicate()])

    assert torch.allclose(as_dtensor(a + b).full_tensor(), a_full + b_full)
    assert torch.allclose(as_dtensor(torch.mm(a, w.t())).full_tensor(), a_full @ w_full.t())
    assert torch.allclose(as_dtensor(F.linear(a, w, bias)).full_tensor(), F.linear(a_full, w_full, bias_full))
    assert torch.allclose(as_dtensor(a.view(4, 8)).full_tensor(), a_full.view(4, 8))
    assert torch.allclose(as_dtensor(a.sum()).full_tensor(), a_full.sum())

    # In-place returns the same object with the same spec; out= writes into the given DTensor.
    c = distribute_tensor(a_full.clone(), mesh, [Shard(0)])
    spec_before = c._spec
    assert c.add_(b) is c and c._spec == spec_before
    assert torch.allclose(c.full_tensor(), a_full + b_full)
    out = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
    assert torch.add(a, b, out=out) is out
    assert torch.allclose(out.full_tensor(), a_full + b_full)

    # detach / to(dtype) keep the layout.
    detached = as_dtensor(a.detach())
    assert type(detached) is DTensor and detached.placements == a.placements and not detached.requires_grad
    half = as_dtensor(a.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16 and half._local_tensor.dtype == torch.bfloat16 and half.placements == a.placements

    # Autocast: the ops run in the autocast dtype.
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        mixed = as_dtensor(torch.mm(a, w.t()))
    assert mixed.dtype == torch.bfloat16 and mixed._local_tensor.dtype == torch.bfloat16
    assert torch.allclose(mixed.full_tensor().float(), a_full @ w_full.t(), atol=0.1, rtol=0.05)

    # A Partial input is reduced when the op needs it.
    partial = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()])
    assert torch.equal(as_dtensor(torch.relu(partial)).full_tensor(), torch.full((2, 2), 4.0))


@multi_rank
def test_list_tuple_and_scalar_results_against_plain_torch() -> None:
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(4)
    a_full, b_full = torch.randn(8, 4), torch.randn(8, 4)
    a = distribute_tensor(a_full, mesh, [Shard(0)])
    b = distribute_tensor(b_full, mesh, [Shard(0)])
    # Tensor[] in (list of DTensors -> general path) and out (one spec per element).
    assert torch.equal(as_dtensor(torch.cat([a, b], dim=1)).full_tensor(), torch.cat([a_full, b_full], dim=1))
    pieces = [as_dtensor(p) for p in torch.split(a, 2, dim=1)]
    assert len(pieces) == 2
    assert torch.equal(pieces[1].full_tensor(), a_full[:, 2:])
    # A tuple of tensors.
    values, indices = (as_dtensor(v) for v in torch.max(a, dim=1))
    expected_values, expected_indices = torch.max(a_full, dim=1)
    assert torch.equal(values.full_tensor(), expected_values) and torch.equal(indices.full_tensor(), expected_indices)
    # A Python scalar: the global value, not this rank's partial sum.
    assert abs(a.sum().item() - a_full.sum().item()) < 1e-4


@multi_rank
def test_training_step_gradients_against_plain_torch() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(3)
    x_full = torch.randn(8, 4)
    reference = torch.nn.Linear(4, 3)
    weight = distribute_tensor(reference.weight.detach(), mesh, [Replicate(), Replicate()])
    weight.requires_grad_(True)
    bias = distribute_tensor(reference.bias.detach(), mesh, [Replicate(), Replicate()])
    bias.requires_grad_(True)
    x = distribute_tensor(x_full, mesh, [Shard(0), Replicate()])
    loss = as_dtensor(F.linear(x, weight, bias).relu().sum())
    loss.backward()
    expected = reference(x_full).relu().sum()
    expected.backward()
    assert torch.allclose(loss.full_tensor(), expected)
    assert reference.weight.grad is not None and reference.bias.grad is not None
    assert torch.allclose(as_dtensor(weight.grad).full_tensor(), reference.weight.grad)
    assert torch.allclose(as_dtensor(bias.grad).full_tensor(), reference.bias.grad)


@multi_rank
def test_an_in_place_write_into_a_view_of_a_redistributed_input_raises_instead_of_being_lost() -> None:
    mesh = init_device_mesh("cpu", (4,))
    full = torch.arange(16.0).reshape(4, 4)
    d = distribute_tensor(full, mesh, [Shard(0)])
    # (4, 4) rows over 4 ranks viewed as (2, 8): no rank's rows form a row of the view, so the view op
    # redistributes its input and returns a view of that copy.
    merged = d.view(2, 8)
    assert torch.equal(merged.full_tensor(), full.view(2, 8))
    with pytest.raises(RuntimeError, match="view op had to redistribute its input"):
        merged.fill_(-1.0)
    with pytest.raises(RuntimeError, match="view op had to redistribute its input"):
        merged[0].add_(1.0)  # a view of that view: same copy
    assert torch.equal(d.full_tensor(), full)
    # A view that keeps the shards aliases the DTensor: the write reaches it.
    d.view(16).mul_(2.0)
    assert torch.equal(d.full_tensor(), full * 2)


@multi_rank
def test_the_moved_view_checks_stop_once_the_marked_views_are_freed() -> None:
    import gc

    mesh = init_device_mesh("cpu", (4,))
    d = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    gc.collect()
    before = dispatch._moved_view_copies
    merged = d.view(2, 8)  # a view of a redistributed copy: marked, and views of it too
    row = merged[0]
    assert dispatch._moved_view_copies == before + 2
    del merged, row
    gc.collect()
    # Counted while alive only, so dispatch's C++ hit (off while any marked view lives) comes back.
    assert dispatch._moved_view_copies == before
