"""register_sharding, local_map, redistribute(forward_dtype=, backward_dtype=) and PyTorch's error phrases.

Each scenario runs on shardwise and on PyTorch's DTensor (the oracle) on the same 4 rank threads,
and both must agree on values, placements, dtypes and error types.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import shardwise.dtensor_ops as sw
from shardwise.dtensor_ops import experimental as sw_experimental
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import init_device_mesh as sw_init_device_mesh
from shardwise.testing import run_on_threads

WORLD = 4
funcol = torch.ops._c10d_functional


# A custom op with a fake kernel, unknown to both DTensor implementations until registered.
@torch.library.custom_op("shardwise_dropin::scaled_rows", mutates_args=())
def scaled_rows(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale + 1.0


@scaled_rows.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("shardwise_dropin::unregistered", mutates_args=())
def unregistered(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@unregistered.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def scaled_rows_sharding(x: Any, scale: float) -> list[tuple[list[Any], list[Any]]]:
    # Written once, used by both: it only reads x.ndim and builds placements of the given module.
    placements = _PLACEMENTS[0]
    choices: list[tuple[list[Any], list[Any]]] = [([placements.Replicate()], [placements.Replicate(), None])]
    for dim in range(x.ndim):
        choices.append(([placements.Shard(dim)], [placements.Shard(dim), None]))
    return choices


_PLACEMENTS: list[Any] = [sw]


def _torch_dtensor() -> Any:
    import torch.distributed.tensor as td

    return td


def _both(check: Callable[[Any, Callable[..., Any]], Any]) -> tuple[list[Any], list[Any]]:
    """``check(module, init_device_mesh)`` on shardwise, then on PyTorch's DTensor, on 4 rank threads."""
    td = _torch_dtensor()
    ours = run_on_threads(lambda: check(sw, sw_init_device_mesh), world_size=WORLD)
    theirs = run_on_threads(lambda: check(td, td.init_device_mesh), world_size=WORLD)
    return ours, theirs


@pytest.fixture(scope="module", autouse=True)
def register_custom_sharding() -> None:
    import torch.distributed.tensor.experimental as td_experimental

    _PLACEMENTS[0] = sw
    sw_experimental.register_sharding(torch.ops.shardwise_dropin.scaled_rows.default)(scaled_rows_sharding)

    def for_torch(x: Any, scale: float) -> Any:
        _PLACEMENTS[0] = _torch_dtensor()
        try:
            return scaled_rows_sharding(x, scale)
        finally:
            _PLACEMENTS[0] = sw

    td_experimental.register_sharding(torch.ops.shardwise_dropin.scaled_rows.default)(for_torch)


def _custom_op_keeps_the_registered_sharding(module: Any, init_mesh: Callable[..., Any]) -> tuple[Any, ...]:
    mesh = init_mesh("cpu", (WORLD,))
    full = torch.arange(32.0).reshape(8, 4)
    results = []
    for placement in (module.Shard(0), module.Shard(1), module.Replicate()):
        x = module.distribute_tensor(full, mesh, [placement])
        out = torch.ops.shardwise_dropin.scaled_rows(x, 2.0)
        results.append((str(out.placements), out.full_tensor()))
    # Partial has no registered sharding: redistributed to the cheapest one that has.
    partial = module.DTensor.from_local(full / WORLD, mesh, [module.Partial()])
    out = torch.ops.shardwise_dropin.scaled_rows(partial, 2.0)
    results.append((str(out.placements), out.full_tensor()))
    return tuple(results)


def test_register_sharding_on_a_custom_op_matches_pytorch() -> None:
    ours, theirs = _both(_custom_op_keeps_the_registered_sharding)
    full = torch.arange(32.0).reshape(8, 4)
    expected = full * 2.0 + 1.0
    for rank_result, oracle in zip(ours, theirs):
        for (placements, value), (oracle_placements, oracle_value) in zip(rank_result, oracle):
            torch.testing.assert_close(value, expected)
            torch.testing.assert_close(oracle_value, expected)
            assert _short(placements) == _short(oracle_placements)


# An out= variant: a sharding function lists a placement for every argument, the written ones too.
_OUT_LIB = torch.library.Library("shardwise_dropin", "FRAGMENT")
_OUT_LIB.define("row_max(Tensor x, int dim, *, Tensor(a!) values, Tensor(b!) indices) -> (Tensor(a!), Tensor(b!))")


def _row_max(x: torch.Tensor, dim: int, *, values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    found = torch.max(x, dim=dim, keepdim=True)
    return values.copy_(found.values), indices.copy_(found.indices)


_OUT_LIB.impl("row_max", _row_max, "CPU")
_OUT_LIB.impl("row_max", lambda x, dim, *, values, indices: (values, indices), "Meta")


def row_max_sharding(x: Any, dim: int, *, values: Any, indices: Any) -> list[tuple[list[Any], list[Any]]]:
    placements = _PLACEMENTS[0]
    replicated = ([placements.Replicate()] * 2, [placements.Replicate(), None, placements.Replicate(), placements.Replicate()])
    rows = ([placements.Shard(0)] * 2, [placements.Shard(0), None, placements.Shard(0), placements.Shard(0)]) if dim != 0 else replicated
    return [replicated, rows]


def _writes_into_out_tensors(module: Any, init_mesh: Callable[..., Any]) -> tuple[str, str, bool]:
    mesh = init_mesh("cpu", (WORLD,))
    full = torch.arange(32.0).reshape(8, 4).flip(1)
    x = module.distribute_tensor(full, mesh, [module.Shard(0)])
    values = module.distribute_tensor(torch.zeros(8, 1), mesh, [module.Shard(0)])
    indices = module.distribute_tensor(torch.zeros(8, 1, dtype=torch.long), mesh, [module.Shard(0)])
    torch.ops.shardwise_dropin.row_max(x, 1, values=values, indices=indices)
    expected = torch.max(full, dim=1, keepdim=True)
    correct = torch.equal(values.full_tensor(), expected.values) and torch.equal(indices.full_tensor(), expected.indices)
    return str(values.placements), str(indices.placements), correct


def test_register_sharding_lists_out_tensors_among_the_arguments_as_pytorch() -> None:
    import torch.distributed.tensor.experimental as td_experimental

    _PLACEMENTS[0] = sw
    sw_experimental.register_sharding(torch.ops.shardwise_dropin.row_max.default)(row_max_sharding)

    def for_torch(*args: Any, **kwargs: Any) -> Any:
        _PLACEMENTS[0] = _torch_dtensor()
        try:
            return row_max_sharding(*args, **kwargs)
        finally:
            _PLACEMENTS[0] = sw

    td_experimental.register_sharding(torch.ops.shardwise_dropin.row_max.default)(for_torch)
    ours, theirs = _both(_writes_into_out_tensors)
    for (values, indices, correct), (oracle_values, oracle_indices, oracle_correct) in zip(ours, theirs):
        assert correct and oracle_correct
        assert (_short(values), _short(indices)) == (_short(oracle_values), _short(oracle_indices))
    # The info PyTorch derives for a register_sharding op (its first int argument is static).
    from shardwise.dtensor_ops import DTensor

    ours_info = DTensor._op_dispatcher.sharding_propagator.op_to_schema_info[torch.ops.shardwise_dropin.row_max.default]  # type: ignore[attr-defined]
    theirs_info = _torch_dtensor().DTensor._op_dispatcher.sharding_propagator.op_to_schema_info[torch.ops.shardwise_dropin.row_max.default]
    assert (ours_info.static_argnum, ours_info.static_kwargkey, ours_info.needs_pytree) == (
        theirs_info.static_argnum, theirs_info.static_kwargkey, theirs_info.needs_pytree,
    ) == (1, None, True)  # fmt: skip


def _short(placements: str) -> str:
    # Both print placements their own way: compare what they say.
    return (
        placements.replace("Shard(dim=", "S(").replace("Replicate()", "R").replace(" ", "").replace(",)", ")")
    )


def test_register_sharding_validates_before_running() -> None:
    with pytest.raises(TypeError, match="expects an OpOverload"):
        sw_experimental.register_sharding("aten.mul")  # type: ignore[arg-type]


def _op_without_a_rule(module: Any, init_mesh: Callable[..., Any]) -> tuple[str, str]:
    mesh = init_mesh("cpu", (WORLD,))
    x = module.distribute_tensor(torch.ones(8, 2), mesh, [module.Shard(0)])
    with pytest.raises(NotImplementedError) as raised:
        torch.ops.shardwise_dropin.unregistered(x)
    return type(raised.value).__name__, str(raised.value)


def test_an_op_without_a_rule_says_what_pytorch_says() -> None:
    ours, theirs = _both(_op_without_a_rule)
    phrase = "does not have a sharding strategy registered"
    assert all(kind == "NotImplementedError" and phrase in message for kind, message in ours + theirs), (ours, theirs)
    assert ours[0][1].startswith("shardwise has no sharding rule for shardwise_dropin.unregistered.default")


def _in_place_needing_a_move(module: Any, init_mesh: Callable[..., Any]) -> tuple[bool, str]:
    mesh = init_mesh("cpu", (WORLD,))
    partial = module.DTensor.from_local(torch.randn(4, 4), mesh, [module.Partial()])
    with pytest.raises(RuntimeError) as raised:
        partial.relu_()
    return isinstance(raised.value, RuntimeError), str(raised.value)


def test_an_in_place_op_needing_a_placement_change_says_what_pytorch_says() -> None:
    ours, theirs = _both(_in_place_needing_a_move)
    phrase = "in-place operations that require placement changes are not supported"
    assert all(phrase in message for _, message in ours + theirs), (ours, theirs)
    assert all(is_runtime_error for is_runtime_error, _ in ours + theirs), (ours, theirs)


# ----------------------------------------------------------------------------- local_map


def _local_map_scenarios(module: Any, init_mesh: Callable[..., Any]) -> dict[str, Any]:
    import torch.distributed.tensor.experimental as td_experimental

    local_map = sw_experimental.local_map if module is sw else td_experimental.local_map
    mesh = init_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    weight_full = torch.arange(32.0).reshape(4, 8) / 10
    input_full = torch.arange(16.0).reshape(8, 2) / 10
    dist.broadcast(weight_full, 0)

    def row_partial_matmul(device_mesh: Any, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        partial_sum = torch.mm(weight, x)
        return funcol.wait_tensor(funcol.all_reduce(partial_sum, "sum", dist.group.WORLD.group_name))

    mapped = local_map(
        row_partial_matmul,
        out_placements=[module.Replicate()],
        in_placements=(None, [module.Shard(1)], [module.Shard(0)]),
        device_mesh=mesh,
    )
    weight = module.distribute_tensor(weight_full, mesh, [module.Shard(1)]).requires_grad_()
    x = module.distribute_tensor(input_full, mesh, [module.Shard(0)])
    out = mapped(mesh, weight, x)
    out.to_local().sum().backward()
    results: dict[str, Any] = {
        "placements": _short(str(out.placements)),
        "value": out.full_tensor(),
        "grad": weight.grad.full_tensor(),
        "grad_placements": _short(str(weight.grad.placements)),
    }
    replicated_x = module.distribute_tensor(input_full, mesh, [module.Replicate()])
    with pytest.raises(ValueError) as raised:
        mapped(mesh, weight, replicated_x)
    results["mismatch"] = "mismatched placements" in str(raised.value)
    redistributing = local_map(
        row_partial_matmul,
        out_placements=[module.Replicate()],
        in_placements=(None, [module.Shard(1)], [module.Shard(0)]),
        redistribute_inputs=True,
    )
    results["redistributed"] = redistributing(mesh, weight.detach(), replicated_x).full_tensor()
    # No DTensor argument: the function's result as it is.
    results["plain"] = local_map(lambda t: t * 2, out_placements=[module.Replicate()])(torch.ones(2))
    return results


def test_local_map_matches_pytorch() -> None:
    ours, theirs = _both(_local_map_scenarios)
    expected = (torch.arange(32.0).reshape(4, 8) / 10) @ (torch.arange(16.0).reshape(8, 2) / 10)
    for mine, oracle in zip(ours, theirs):
        assert mine["placements"] == oracle["placements"] == "(R)"
        torch.testing.assert_close(mine["value"], expected)
        torch.testing.assert_close(mine["redistributed"], expected)
        torch.testing.assert_close(mine["grad"], oracle["grad"])
        assert mine["grad_placements"] == oracle["grad_placements"]
        assert mine["mismatch"] and oracle["mismatch"]
        torch.testing.assert_close(mine["plain"], torch.full((2,), 2.0))


# ----------------------------------------------------------------------------- forward_dtype / backward_dtype


def _redistribute_in_other_dtypes(module: Any, init_mesh: Callable[..., Any]) -> dict[str, Any]:
    mesh = init_mesh("cpu", (WORLD,))
    full = torch.linspace(-3, 3, 32).reshape(8, 4)
    x = module.distribute_tensor(full, mesh, [module.Shard(0)]).requires_grad_()
    gathered = x.redistribute(mesh, [module.Replicate()], forward_dtype=torch.bfloat16, backward_dtype=torch.float16)
    weight = torch.linspace(0.1, 3.3, 32).reshape(8, 4)
    (gathered.to_local().float() * weight).sum().backward()
    partial = module.DTensor.from_local(full / 3, mesh, [module.Partial()])
    reduced = partial.redistribute(mesh, [module.Replicate()], forward_dtype=torch.float64)
    same = x.redistribute(mesh, [module.Shard(0)], forward_dtype=torch.float16)
    return {
        "dtypes": (gathered.dtype, gathered.to_local().dtype, x.grad.dtype, reduced.dtype, same.dtype, same.to_local().dtype),
        "gathered": gathered.to_local(),
        "grad": x.grad.full_tensor(),
        "grad_placements": _short(str(x.grad.placements)),
        "reduced": reduced.to_local(),
    }


def test_redistribute_forward_and_backward_dtype_match_pytorch() -> None:
    ours, theirs = _both(_redistribute_in_other_dtypes)
    full = torch.linspace(-3, 3, 32).reshape(8, 4)
    weight = torch.linspace(0.1, 3.3, 32).reshape(8, 4)
    for mine, oracle in zip(ours, theirs):
        assert mine["dtypes"] == oracle["dtypes"] == (
            torch.bfloat16, torch.bfloat16, torch.float32, torch.float64, torch.float16, torch.float16
        )
        assert torch.equal(mine["gathered"], full.to(torch.bfloat16))
        # The gradient went through float16 before coming back as float32.
        assert torch.equal(mine["grad"], weight.to(torch.bfloat16).float().to(torch.float16).float())
        assert torch.equal(mine["grad"], oracle["grad"])
        assert mine["grad_placements"] == oracle["grad_placements"]
        torch.testing.assert_close(mine["reduced"], (full / 3).double() * WORLD)


def _bad_dtype(module: Any, init_mesh: Callable[..., Any]) -> int:
    mesh = init_mesh("cpu", (WORLD,))
    x = module.distribute_tensor(torch.ones(8), mesh, [module.Shard(0)])
    with CommDebugMode() as comm:
        with pytest.raises(TypeError, match="forward_dtype must be a torch.dtype"):
            x.redistribute(mesh, [module.Replicate()], forward_dtype="bfloat16")
        with pytest.raises(RuntimeError, match="placements is needed for redistribute"):
            x.redistribute(mesh)
    return comm.get_total_counts()


def test_bad_redistribute_arguments_fail_before_any_collective() -> None:
    assert run_on_threads(lambda: _bad_dtype(sw, sw_init_device_mesh), world_size=WORLD) == [0] * WORLD
