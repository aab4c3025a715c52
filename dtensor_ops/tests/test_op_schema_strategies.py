"""PyTorch's op-strategy API (``_op_schema`` types, ``register_op_strategy``, ``propagate_op_sharding(OpSchema)``).

A custom op (torch.library) gets a strategy function written once against either implementation's
types; registered with shardwise's ``register_op_strategy`` and with PyTorch's, the same calls on
DTensors give the same placements and values (PyTorch's DTensor is the oracle).  Ranks are threads:
placements and deterministic values only.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

from shardwise.testing import run_on_threads

WORLD = 2

_LIB = torch.library.Library("swopschema", "DEF")
_LIB.define("row_scale(Tensor x, Tensor scale) -> Tensor")
_LIB.define("bad_count(Tensor x) -> Tensor")
_LIB.define("scale_all(Tensor x, Tensor[] others) -> Tensor")
_LIB.define("engine_owned(Tensor x) -> Tensor")


def _row_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * scale.unsqueeze(-1)


_LIB.impl("row_scale", _row_scale, "CPU")
_LIB.impl("row_scale", _row_scale, "Meta")
_LIB.impl("bad_count", lambda x: x.clone(), "CPU")
_LIB.impl("bad_count", lambda x: torch.empty_like(x), "Meta")

_LIB.impl("scale_all", lambda x, others: x * sum(o.sum() for o in others), "CPU")
_LIB.impl("scale_all", lambda x, others: torch.empty_like(x), "Meta")

_LIB.impl("engine_owned", lambda x: x.clone(), "CPU")
_LIB.impl("engine_owned", lambda x: torch.empty_like(x), "Meta")

ROW_SCALE = torch.ops.swopschema.row_scale.default
ENGINE_OWNED = torch.ops.swopschema.engine_owned.default
BAD_COUNT = torch.ops.swopschema.bad_count.default
SCALE_ALL = torch.ops.swopschema.scale_all.default


def _implementation(name: str) -> SimpleNamespace:
    """The types a strategy function needs, from shardwise or from PyTorch (the oracle)."""
    if name == "shardwise":
        import shardwise.dtensor_ops as api
        from shardwise.dtensor_ops import _op_schema as schema
        from shardwise.dtensor_ops._dtensor_spec import DTensorSpec
        from shardwise.dtensor_ops._ops.utils import generate_redistribute_costs as costs
        from shardwise.dtensor_ops._ops.utils import register_op_strategy as register
        from shardwise.dtensor_ops._sharding_prop import sharding_propagator
        from shardwise.mesh import init_device_mesh

        propagator = sharding_propagator
    else:
        import torch.distributed.tensor as api  # type: ignore[no-redef]
        from torch.distributed.device_mesh import init_device_mesh  # type: ignore[assignment]
        from torch.distributed.tensor import _op_schema as schema  # type: ignore[no-redef]
        from torch.distributed.tensor._dtensor_spec import DTensorSpec  # type: ignore[assignment]
        from torch.distributed.tensor._ops.utils import generate_redistribute_costs as costs  # type: ignore[assignment]
        from torch.distributed.tensor._ops.utils import register_op_strategy as register  # type: ignore[assignment]

        propagator = api.DTensor._op_dispatcher.sharding_propagator  # type: ignore[attr-defined]
    return SimpleNamespace(
        api=api, schema=schema, spec=DTensorSpec, costs=costs, register=register,
        init_device_mesh=init_device_mesh, propagator=propagator,
    )  # fmt: skip


def _row_scale_strategy(impl: SimpleNamespace) -> Callable[[Any], Any]:
    """x (n, m) * scale (n,) per row: both whole, both split by rows, or x split by columns."""
    Shard, Replicate = impl.api.Shard, impl.api.Replicate

    def strategy(op_schema: Any) -> Any:
        x_strategy, scale_strategy = op_schema.args_schema
        assert isinstance(x_strategy, impl.schema.OpStrategy) and isinstance(scale_strategy, impl.schema.OpStrategy)
        mesh = x_strategy.mesh
        x_meta, scale_meta = x_strategy.strategies[0].output_spec.tensor_meta, scale_strategy.strategies[0].output_spec.tensor_meta
        one_dim = ((Replicate(), Replicate(), Replicate()), (Shard(0), Shard(0), Shard(0)), (Shard(1), Shard(1), Replicate()))
        candidates = []
        # Over the whole mesh: every combination of the one-mesh-dim choices.
        for combination in itertools.product(one_dim, repeat=mesh.ndim):
            out, x_places, scale_places = (tuple(choice[index] for choice in combination) for index in range(3))
            x_spec = impl.spec(mesh, x_places, tensor_meta=x_meta)
            scale_spec = impl.spec(mesh, scale_places, tensor_meta=scale_meta)
            candidates.append(
                impl.schema.OpSpec(
                    output_specs=impl.spec(mesh, out),
                    input_specs=[x_spec, scale_spec],
                    redistribute_cost=[impl.costs(x_strategy, x_spec), impl.costs(scale_strategy, scale_spec)],
                )
            )
        return impl.schema.OpStrategy(candidates)

    return strategy


_LAYOUTS = {
    (WORLD,): [("S0", "R"), ("S1", "R"), ("R", "R"), ("R", "S0"), ("S0", "S0")],
    (2, 2): [("S0,S1", "S0,R"), ("S1,S0", "R,R"), ("R,S0", "R,S0"), ("S0,S0", "R,R"), ("R,R", "R,R"), ("S1,R", "S0,S0")],
}


# Where the candidates' costs rank differently from PyTorch's (none on these layouts since shardwise
# prices by time: x (4, 6) [S1, R] with scale (4,) [S0, S0] on 2x2 moves x's columns to rows by one
# all-to-all, as PyTorch does, where the fewest-bytes choice gathered the 4-element scale).
_CHEAPER_THAN_PYTORCH: dict[tuple[int, ...], dict[tuple[str, str], str]] = {}


def _placement(impl: SimpleNamespace, name: str) -> Any:
    return impl.api.Replicate() if name == "R" else impl.api.Shard(int(name[1:]))


def _custom_op_on_dtensors(name: str, mesh_shape: tuple[int, ...]) -> list[tuple[str, str, str, bool]]:
    impl = _implementation(name)
    mesh = impl.init_device_mesh("cpu", mesh_shape)
    x_full = torch.arange(24.0).reshape(4, 6)
    scale_full = torch.arange(1.0, 5.0)
    expected = _row_scale(x_full, scale_full)
    seen = []
    for x_name, scale_name in _LAYOUTS[mesh_shape]:
        x = impl.api.distribute_tensor(x_full, mesh, [_placement(impl, part) for part in x_name.split(",")])
        scale = impl.api.distribute_tensor(scale_full, mesh, [_placement(impl, part) for part in scale_name.split(",")])
        out = ROW_SCALE(x, scale)
        seen.append((x_name, scale_name, str(out.placements), torch.equal(out.full_tensor(), expected)))
    return seen


@pytest.mark.parametrize("mesh_shape", list(_LAYOUTS))
def test_a_registered_op_strategy_runs_with_the_placements_pytorch_chooses(mesh_shape: tuple[int, ...]) -> None:
    # Registries are process-wide: registered once, before the rank threads start.
    for name in ("shardwise", "torch"):
        impl = _implementation(name)
        impl.register(ROW_SCALE)(_row_scale_strategy(impl))
    world = math.prod(mesh_shape)
    ours = run_on_threads(_custom_op_on_dtensors, "shardwise", mesh_shape, world_size=world)
    theirs = run_on_threads(_custom_op_on_dtensors, "torch", mesh_shape, world_size=world)
    for rank_ours, rank_theirs in zip(ours, theirs):
        for mine, oracle in zip(rank_ours, rank_theirs):
            if mine[:2] in _CHEAPER_THAN_PYTORCH.get(mesh_shape, {}):
                assert mine[2] == _CHEAPER_THAN_PYTORCH[mesh_shape][mine[:2]] and oracle[3]
            else:
                assert mine == oracle
    for rank_results in ours:
        assert all(correct for *_, correct in rank_results)
        # Rows stay rows, columns stay columns: no data moved when a candidate fits as is.
        placements = {(x, scale): out for x, scale, out, _ in rank_results}
        if mesh_shape == (WORLD,):
            assert placements[("S0", "R")] == "(Shard(dim=0),)"
            assert placements[("S1", "R")] == "(Shard(dim=1),)"
        else:
            assert placements[("S0,S1", "S0,R")] == "(Shard(dim=0), Shard(dim=1))"


def _propagate_a_schema() -> dict[str, Any]:
    from shardwise.dtensor_ops import Replicate, Shard, distribute_tensor
    from shardwise.dtensor_ops._op_schema import OpInfo, OpSchema, OutputSharding
    from shardwise.dtensor_ops._sharding_prop import ShardingPropagator, sharding_propagator
    from shardwise.mesh import init_device_mesh
    from shardwise.placement import DTensorSpec

    mesh = init_device_mesh("cpu", (WORLD,))
    rows = distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)])._spec
    cols = distribute_tensor(torch.ones(4, 6), mesh, [Shard(1)])._spec
    weight = distribute_tensor(torch.ones(6, 3), mesh, [Replicate()])._spec
    mm = torch.ops.aten.mm.default
    stays = sharding_propagator.propagate_op_sharding(OpSchema(mm, (rows, weight), {}))
    moves = sharding_propagator.propagate_op_sharding(OpSchema(mm, (cols, weight), {}))
    fresh = ShardingPropagator().propagate_op_sharding_non_cached(OpSchema(mm, (cols, weight), {}))
    info = OpInfo(mesh, OpSchema(mm, (rows, weight), {}))
    sharding_propagator.propagate(info)
    decision = sharding_propagator.propagate_op_sharding(mm, (cols, weight), {})
    assert isinstance(stays, OutputSharding) and isinstance(moves, OutputSharding)
    assert moves.redistribute_schema is not None
    assert isinstance(stays.output_spec, DTensorSpec) and isinstance(moves.output_spec, DTensorSpec)
    return {
        "stays": (str(stays.output_spec.placements), stays.needs_redistribute, stays.redistribute_schema),
        "moves": (str(moves.output_spec.placements), moves.needs_redistribute),
        "moved_inputs": [str(spec.placements) for spec in moves.redistribute_schema.args_spec],
        "decision_inputs": [str(spec.placements) for spec in decision.input_specs],
        "fresh_same": fresh.output_spec == moves.output_spec,
        "info": info.output_sharding is not None and info.output_sharding.output_spec == stays.output_spec,
    }


def test_propagate_op_sharding_takes_an_op_schema_and_answers_an_output_sharding() -> None:
    for result in run_on_threads(_propagate_a_schema, world_size=WORLD):
        assert result["stays"] == ("(Shard(dim=0),)", False, None)
        assert result["moves"][1] is True
        assert result["moved_inputs"] == result["decision_inputs"]
        assert result["moved_inputs"] != ["(Shard(dim=1),)", "(Replicate(),)"]
        assert result["fresh_same"] and result["info"]


_BAD_STRATEGIES: list[Callable[[Any], Any]] = [
    lambda schema: _op_schema().OpStrategy(
        [_op_schema().OpSpec(schema.args_schema[0].strategies[0].output_spec, input_specs=[])]
    ),
    lambda schema: _op_schema().OpStrategy([]),
    lambda schema: _op_schema().TupleStrategy([]),
]


def _op_schema() -> Any:
    from shardwise.dtensor_ops import _op_schema as schema

    return schema


def _run_bad_count() -> str:
    from shardwise.dtensor_ops import Shard, distribute_tensor
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    x = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    with CommDebugMode() as comm, pytest.raises(RuntimeError) as raised:
        BAD_COUNT(x)
    assert comm.get_total_counts() == 0
    return str(raised.value)


def test_bad_strategies_and_registrations_get_clear_errors() -> None:
    messages = []
    for strategy in _BAD_STRATEGIES:
        _op_schema().register_op_strategy(BAD_COUNT)(strategy)  # process-wide: before the rank threads
        messages.append(set(run_on_threads(_run_bad_count, world_size=WORLD)))
    gave_no_inputs, empty, tuple_strategy = (message.pop() for message in messages)
    assert all(len(message) == 0 for message in messages)  # every rank raised the same error
    assert "swopschema.bad_count" in gave_no_inputs and "gave 0 input specs" in gave_no_inputs
    assert "1 DTensor inputs" in gave_no_inputs
    assert "no candidate OpSpecs" in empty
    assert "returned a TupleStrategy with no children" in tuple_strategy
    with pytest.raises(TypeError, match="expected an OpOverload .* got OpOverloadPacket"):
        _op_schema().register_op_strategy(torch.ops.swopschema.row_scale)


# -- PyTorch's einsum and matrix strategy vocabulary, the replicate fallback, unregistering ---------------

_EQUATIONS = ["mk,kn->mn", "bmk,bkn->bmn", "bmk,kn->bmn", "bmk,k->bm", "abcd,abcd->abcd", "bcd,abcd->abcd", "abd,bf->abfd"]


def _einsum_candidates(name: str, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """Candidate strings of gen_einsum_strategies and of mm/bmm/addmm's strategy functions, per implementation."""
    impl = _implementation(name)
    if name == "shardwise":
        from shardwise.dtensor_ops._dtensor_spec import TensorMeta
        from shardwise.dtensor_ops._ops._einsum_strategy import EinsumDims, gen_einsum_strategies
        from shardwise.dtensor_ops._ops._matrix_ops import addmm_strategy, bmm_strategy, mm_strategy
    else:
        from torch.distributed.tensor._dtensor_spec import TensorMeta  # type: ignore[assignment]
        from torch.distributed.tensor._ops._einsum_strategy import EinsumDims, gen_einsum_strategies  # type: ignore[no-redef]
        from torch.distributed.tensor._ops._matrix_ops import addmm_strategy, bmm_strategy, mm_strategy  # type: ignore[no-redef]
    mesh = impl.init_device_mesh("cpu", mesh_shape)
    result: dict[str, Any] = {}
    for equation in _EQUATIONS:
        for linearity in (False, True):
            result[f"{equation} linearity={linearity}"] = [str(spec) for spec in gen_einsum_strategies(equation, mesh, linearity=linearity).strategies]
        dims = EinsumDims.parse_dims(*EinsumDims.parse_equation(equation))
        result[f"{equation} dims"] = (dims.contracting_dims, dims.batch_dims, dims.lhs_out_only_dims, dims.rhs_out_only_dims)

    def strategy_of(shape: tuple[int, ...], placements: tuple[Any, ...]) -> Any:
        spec = impl.spec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), torch.empty(shape).stride(), torch.float32))
        return impl.schema.OpStrategy([impl.schema.OpSpec(spec)])

    replicated = tuple(impl.api.Replicate() for _ in mesh_shape)
    rows = tuple(impl.api.Shard(0) for _ in mesh_shape)
    calls = {
        "mm": (mm_strategy, torch.ops.aten.mm.default, [((6, 8), rows), ((8, 12), replicated)]),
        "bmm": (bmm_strategy, torch.ops.aten.bmm.default, [((4, 6, 8), rows), ((4, 8, 12), rows)]),
        "addmm": (addmm_strategy, torch.ops.aten.addmm.default, [((12,), replicated), ((6, 8), rows), ((8, 12), replicated)]),
    }
    for label, (function, op, operands) in calls.items():
        strategies = [strategy_of(shape, placements) for shape, placements in operands]
        chosen = function(impl.schema.OpSchema(op, tuple(strategies), {}))
        result[label] = sorted(str(spec) for spec in chosen.strategies)
        current = tuple(strategy.strategies[0].output_spec for strategy in strategies)
        result[f"{label} current costs"] = [spec.redistribute_cost for spec in chosen.strategies if tuple(spec.input_specs) == current]
    return result


@pytest.mark.parametrize("mesh_shape", [(WORLD,), (2, 2)])
def test_einsum_and_matrix_strategies_list_pytorchs_candidates(mesh_shape: tuple[int, ...]) -> None:
    # PyTorch's paths are served by the alias table's finder on first import; import them here, once,
    # rather than in each rank thread.
    import shardwise.dtensor_ops._ops._einsum_strategy  # noqa: F401
    import shardwise.dtensor_ops._ops._matrix_ops  # noqa: F401

    world = math.prod(mesh_shape)
    ours = run_on_threads(_einsum_candidates, "shardwise", mesh_shape, world_size=world)[0]
    theirs = run_on_threads(_einsum_candidates, "torch", mesh_shape, world_size=world)[0]
    assert ours.keys() == theirs.keys()
    for key in ours:
        if key.endswith("current costs"):
            # The input layout as it is costs nothing (the prices themselves are each model's own).
            assert ours[key] and all(cost == 0.0 for row in ours[key][0] for cost in row), (key, ours[key])
        else:
            assert ours[key] == theirs[key], key
    # mm: replicate, contract k, split m, split n on each mesh dim, in every combination.
    assert len(ours["mk,kn->mn linearity=False"]) == 4 ** len(mesh_shape)


def _scale_all_on_dtensors(mesh_shape: tuple[int, ...], registered: bool) -> dict[str, Any]:
    from shardwise.dtensor_ops import Shard, distribute_tensor
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    generator = torch.Generator().manual_seed(0)  # ranks are threads: the global generator is shared
    x_full, others_full = torch.randn(4, 6, generator=generator), [torch.randn(2, 4, generator=generator) for _ in range(3)]
    x = distribute_tensor(x_full, mesh, [Shard(0)] * len(mesh_shape))
    others = [distribute_tensor(o, mesh, [Shard(1)] * len(mesh_shape)) for o in others_full]
    if registered:
        out = SCALE_ALL(x, others)
        return {"placements": tuple(out.placements), "equal": torch.allclose(out.full_tensor(), SCALE_ALL(x_full, others_full))}
    with CommDebugMode() as comm, pytest.raises(NotImplementedError, match="does not have a sharding strategy registered"):
        SCALE_ALL(x, others)
    return {"collectives_when_refused": comm.get_total_counts()}


def test_replicate_op_strategy_serves_a_list_input_op_and_deleting_it_unregisters() -> None:
    from shardwise.dtensor_ops import DTensor, Replicate
    from shardwise.dtensor_ops._op_schema import RuntimeSchemaInfo
    from shardwise.dtensor_ops._ops.utils import register_op_strategy, replicate_op_strategy

    # Registries are process-wide: registered and deleted between the rank-thread runs.
    propagator = DTensor._op_dispatcher.sharding_propagator  # type: ignore[attr-defined]
    for mesh_shape in ((WORLD,), (2, 2)):
        world = math.prod(mesh_shape)
        register_op_strategy(SCALE_ALL, schema_info=RuntimeSchemaInfo(needs_pytree=True))(replicate_op_strategy)
        for result in run_on_threads(_scale_all_on_dtensors, mesh_shape, True, world_size=world):
            assert result["placements"] == tuple(Replicate() for _ in mesh_shape) and result["equal"]
        del propagator.op_strategy_funcs[SCALE_ALL]
        assert SCALE_ALL not in propagator.op_strategy_funcs
        for result in run_on_threads(_scale_all_on_dtensors, mesh_shape, False, world_size=world):
            assert result["collectives_when_refused"] == 0


def _compact_op_spec() -> str:
    from shardwise.dtensor_ops import Partial, Replicate, Shard
    from shardwise.dtensor_ops._op_schema import OpSpec
    from shardwise.mesh import init_device_mesh
    from shardwise.placement import DTensorSpec

    mesh = init_device_mesh("cpu", (WORLD,))
    spec = OpSpec(DTensorSpec(mesh, (Shard(1),)), input_specs=[DTensorSpec(mesh, (Partial(),)), DTensorSpec(mesh, (Replicate(),))])
    return str(spec)


def test_op_spec_prints_pytorchs_compact_form() -> None:
    assert run_on_threads(_compact_op_spec, world_size=WORLD) == ["(P(sum), R) -> S(1)"] * WORLD


def _strategy_keeping(sharded: bool) -> Callable[[Any], Any]:
    """An op strategy with one candidate: the input and the output sharded on dim 0 (or replicated) on every mesh dim."""

    def strategy(op_schema: Any) -> Any:
        from shardwise.dtensor_ops import Replicate, Shard
        from shardwise.dtensor_ops._op_schema import OpSpec, OpStrategy
        from shardwise.placement import DTensorSpec

        (current,) = (strategy.strategies[0].output_spec for strategy in op_schema.args_strategy)
        placements = tuple(Shard(0) if sharded else Replicate() for _ in range(current.mesh.ndim))
        spec = DTensorSpec(current.mesh, placements, tensor_meta=current.tensor_meta)
        return OpStrategy([OpSpec(spec, input_specs=[spec])])

    return strategy


def _registration_changes_reach_the_engine() -> dict[str, Any]:
    from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
    from shardwise.dtensor_ops._engine import ENGINE
    from shardwise.dtensor_ops._op_schema import RuntimeSchemaInfo
    from shardwise.dtensor_ops._ops.utils import register_op_strategy
    from shardwise.dtensor_ops._rules import rule_for
    from shardwise.mesh import init_device_mesh

    propagator = DTensor._op_dispatcher.sharding_propagator  # type: ignore[attr-defined]
    x = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
    rule_before = rule_for(ENGINE_OWNED)
    seen: dict[str, Any] = {"registries_are_the_engines": propagator.op_strategy_funcs is ENGINE.registrations.strategy_funcs}
    try:
        generation = ENGINE.generation
        register_op_strategy(ENGINE_OWNED)(_strategy_keeping(sharded=False))
        seen["registered"] = (ENGINE.generation > generation, ENGINE_OWNED(x).placements == (Replicate(),))
        # PyTorch's map assigned directly: the engine installs the rule and the decision cached above is not reused.
        generation = ENGINE.generation
        propagator.op_strategy_funcs[ENGINE_OWNED] = _strategy_keeping(sharded=True)
        seen["assigned"] = (ENGINE.generation > generation, ENGINE_OWNED(x).placements == (Shard(0),))
        generation = ENGINE.generation
        propagator.op_to_schema_info[ENGINE_OWNED] = RuntimeSchemaInfo(static_argnum=1)
        seen["schema_info"] = ENGINE.generation > generation
        generation = ENGINE.generation
        del propagator.op_strategy_funcs[ENGINE_OWNED]
        seen["unregistered"] = (ENGINE.generation > generation, rule_for(ENGINE_OWNED) is rule_before)
    finally:
        propagator.op_strategy_funcs.pop(ENGINE_OWNED, None)
        propagator.op_to_schema_info.pop(ENGINE_OWNED, None)
    return seen


def test_registering_through_pytorchs_api_changes_the_engine_and_forgets_cached_decisions() -> None:
    # One rank thread: the registration and the decisions it must change happen in the thread whose caches hold them.
    (seen,) = run_on_threads(_registration_changes_reach_the_engine, world_size=1)
    assert seen == {
        "registries_are_the_engines": True,
        "registered": (True, True),
        "assigned": (True, True),
        "schema_info": True,
        "unregistered": (True, True),
    }
