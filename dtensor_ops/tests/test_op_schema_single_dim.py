"""One-mesh-dim strategies (``register_single_dim_strategy``) and strategies answering a ``TupleStrategy``.

Custom torch.library ops get their sharding written once against either implementation's types and
registered on shardwise and on PyTorch's DTensor (the oracle): the same calls on DTensors, on a 1-D
mesh of 4 and a 2x2 mesh, give the same output placements, and values equal to plain torch on the
full tensors.  Ranks are threads: placements and deterministic values only.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

from shardwise.testing import run_on_threads

# The oracle, imported whole here: imported first inside the rank threads, its modules would be seen
# half-initialized by the other threads.
import torch.distributed.tensor  # noqa: E402,F401
import torch.distributed.tensor.debug  # noqa: E402,F401

WORLD = 4
MESH_SHAPES = [(4,), (2, 2)]

_LIB = torch.library.Library("swsingledim", "DEF")
# x (n, m) scaled column by column by w (m,)
_LIB.define("col_scale(Tensor x, Tensor w) -> Tensor")
_LIB.define("col_scale_expanded(Tensor x, Tensor w) -> Tensor")
# the sum and the largest value of each row of x, in one op (two outputs)
_LIB.define("row_sum_max(Tensor x) -> (Tensor, Tensor)")
_LIB.define("row_sum_max_tuple(Tensor x) -> (Tensor, Tensor)")
# every tensor of xs times s: list in, list out
_LIB.define("scale_each(Tensor[] xs, Tensor s) -> Tensor[]")
_LIB.define("wrong_rows(Tensor x) -> Tensor")
_LIB.define("both_ways(Tensor x) -> Tensor")


def _col_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


def _row_sum_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.sum(-1), x.amax(-1)


def _scale_each(xs: list[torch.Tensor], s: torch.Tensor) -> list[torch.Tensor]:
    return [x * s for x in xs]


for _name, _kernel, _meta in [
    ("col_scale", _col_scale, lambda x, w: torch.empty_like(x)),
    ("col_scale_expanded", _col_scale, lambda x, w: torch.empty_like(x)),
    ("row_sum_max", _row_sum_max, lambda x: (x.new_empty(x.shape[:-1]), x.new_empty(x.shape[:-1]))),
    ("row_sum_max_tuple", _row_sum_max, lambda x: (x.new_empty(x.shape[:-1]), x.new_empty(x.shape[:-1]))),
    ("scale_each", _scale_each, lambda xs, s: [torch.empty_like(x) for x in xs]),
    ("wrong_rows", lambda x: x.clone(), lambda x: torch.empty_like(x)),
    ("both_ways", lambda x: x.clone(), lambda x: torch.empty_like(x)),
]:
    _LIB.impl(_name, _kernel, "CPU")
    _LIB.impl(_name, _meta, "Meta")

OPS = torch.ops.swsingledim


def _implementation(name: str) -> SimpleNamespace:
    """What the strategies and the calls need, from shardwise or from PyTorch (the oracle)."""
    if name == "shardwise":
        import shardwise.dtensor_ops as api
        from shardwise.dtensor_ops import _op_schema as schema
        from shardwise.dtensor_ops._dtensor_spec import DTensorSpec
        from shardwise.dtensor_ops._ops.single_dim_strategy import _ShardingPlaceholder, register_single_dim_strategy
        from shardwise.dtensor_ops._ops.utils import (
            expand_to_full_mesh_op_strategy,
            generate_redistribute_costs,
            register_op_strategy,
        )
        from shardwise.mesh import init_device_mesh
    else:
        import torch.distributed.tensor as api  # type: ignore[no-redef]
        from torch.distributed.device_mesh import init_device_mesh  # type: ignore[assignment]
        from torch.distributed.tensor import _op_schema as schema  # type: ignore[no-redef]
        from torch.distributed.tensor._dtensor_spec import DTensorSpec  # type: ignore[assignment]
        from torch.distributed.tensor._ops.single_dim_strategy import (  # type: ignore[assignment]
            _ShardingPlaceholder,
            register_single_dim_strategy,
        )
        from torch.distributed.tensor._ops.utils import (  # type: ignore[assignment]
            expand_to_full_mesh_op_strategy,
            generate_redistribute_costs,
            register_op_strategy,
        )
    return SimpleNamespace(
        api=api, schema=schema, spec=DTensorSpec, costs=generate_redistribute_costs, placeholder=_ShardingPlaceholder,
        single_dim=register_single_dim_strategy, op_strategy=register_op_strategy, init_device_mesh=init_device_mesh,
        expand=expand_to_full_mesh_op_strategy,
    )  # fmt: skip


def _register_everything(impl: SimpleNamespace) -> None:
    R, S, P, Partial = impl.api.Replicate, impl.api.Shard, impl.placeholder, impl.api.Partial

    @impl.single_dim(OPS.col_scale.default)
    def col_scale_rows(op: Any, args: Any, kwargs: Any) -> list[list[Any]]:
        x_meta, w_meta = args
        assert len(x_meta.shape) == 2 and len(w_meta.shape) == 1  # tensors arrive as their TensorMeta
        # rows of x alone; columns of x with w; a pending sum of x scales as a sum
        return [[P(0), P(0), R()], [P(1), P(1), P(0)], [Partial(), Partial(), R()]]

    @impl.single_dim(OPS.row_sum_max.default)
    def row_sum_max_rows(op: Any, args: Any, kwargs: Any) -> list[list[Any]]:
        # rows stay rows; split columns leave a pending sum and a pending max
        return [[P(0), P(0), P(0)], [Partial("sum"), Partial("max"), P(1)]]

    @impl.op_strategy(OPS.col_scale_expanded.default)
    def col_scale_expanded(op_schema: Any) -> Any:
        # The same rows with concrete placements, expanded over the mesh by the library helper.
        rows = [[R(), R(), R()], [S(0), S(0), R()], [S(1), S(1), S(0)], [Partial(), Partial(), R()]]
        return impl.expand(op_schema.get_mesh_from_args(), op_schema, rows, input_index=1)

    impl.op_strategy(OPS.row_sum_max_tuple.default)(_row_sum_max_tuple_strategy(impl))
    impl.op_strategy(OPS.scale_each.default)(_scale_each_strategy(impl))


def _each_mesh_dim(mesh: Any, one_dim: list[tuple[Any, ...]]) -> list[tuple[tuple[Any, ...], ...]]:
    """Every combination of one-mesh-dim choices: per choice, the placements of each of its tensors."""
    return [
        tuple(tuple(choice[index] for choice in combination) for index in range(len(one_dim[0])))
        for combination in itertools.product(one_dim, repeat=mesh.ndim)
    ]


def _row_sum_max_tuple_strategy(impl: SimpleNamespace) -> Callable[[Any], Any]:
    """One child OpStrategy per output; the input goes where child 0 wants it."""
    R, S, Partial = impl.api.Replicate, impl.api.Shard, impl.api.Partial

    def strategy(op_schema: Any) -> Any:
        (x_strategy,) = op_schema.args_schema
        mesh, meta = x_strategy.mesh, x_strategy.strategies[0].output_spec.tensor_meta
        children = []
        for reduce_op in ("sum", "max"):
            one_dim = [(R(), R()), (S(0), S(0)), (Partial(reduce_op), S(1))]
            candidates = []
            for out, x_places in _each_mesh_dim(mesh, one_dim):
                x_spec = impl.spec(mesh, x_places, tensor_meta=meta)
                candidates.append(
                    impl.schema.OpSpec(impl.spec(mesh, out), [x_spec], redistribute_cost=[impl.costs(x_strategy, x_spec)])
                )
            children.append(impl.schema.OpStrategy(candidates))
        return impl.schema.TupleStrategy(children)

    return strategy


def _scale_each_strategy(impl: SimpleNamespace) -> Callable[[Any], Any]:
    """One child per list element: each x rows-split with s whole, columns-split with s split alike, or whole."""
    R, S = impl.api.Replicate, impl.api.Shard

    def strategy(op_schema: Any) -> Any:
        xs_strategy, s_strategy = op_schema.args_schema
        assert isinstance(xs_strategy, impl.schema.TupleStrategy)
        one_dim = [(R(), R(), R()), (S(0), S(0), R()), (S(1), S(1), S(0))]
        children = []
        for x_strategy in xs_strategy.children:
            mesh = x_strategy.mesh
            candidates = []
            for out, x_places, s_places in _each_mesh_dim(mesh, one_dim):
                x_spec = impl.spec(mesh, x_places, tensor_meta=x_strategy.strategies[0].output_spec.tensor_meta)
                s_spec = impl.spec(mesh, s_places, tensor_meta=s_strategy.strategies[0].output_spec.tensor_meta)
                candidates.append(
                    impl.schema.OpSpec(
                        impl.spec(mesh, out),
                        [x_spec, s_spec],
                        redistribute_cost=[impl.costs(x_strategy, x_spec), impl.costs(s_strategy, s_spec)],
                    )
                )
            children.append(impl.schema.OpStrategy(candidates))
        return impl.schema.TupleStrategy(children)

    return strategy


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    # Registries are process-wide: registered once, before any rank threads start.
    for name in ("shardwise", "torch"):
        _register_everything(_implementation(name))


def _placement(impl: SimpleNamespace, name: str) -> Any:
    if name == "R":
        return impl.api.Replicate()
    return impl.api.Shard(int(name[1:]))


def _normalized(placements: Any) -> str:
    """Placements in one spelling for both implementations (their Partial reprs differ)."""
    return ",".join(
        f"P({p.reduce_op})" if p.is_partial() else ("R" if p.is_replicate() else f"S{p.dim}") for p in placements
    )


# Layouts of (x, w) per mesh shape; x is (8, 6) or the small (2, 8), whose dim 0 has fewer rows than
# 4 ranks (not shardable there: both implementations move it).
_COL_SCALE_LAYOUTS = {
    (4,): [("S0", "R"), ("S1", "S0"), ("S1", "R"), ("R", "S0"), ("R", "R"), ("S0", "S0"), ("small:S1", "R")],
    (2, 2): [("S0,S1", "R,S0"), ("S1,S0", "S0,R"), ("R,R", "S0,S0"), ("S0,S0", "R,R"), ("S1,S1", "R,R"), ("R,S1", "R,R")],
}


# Where shardwise's time model ranks the candidates otherwise: x (8, 6) [S0] with w (6,) [S0] on 4 ranks.
# PyTorch gathers w (an all-gather); shardwise moves x's rows to columns with one all-to-all, which
# gloo's profile prices at 0.31 ms against the all-gather's 0.49 ms (``mesh/_cost_profile.py``).
_FASTER_THAN_PYTORCH: dict[tuple[int, ...], dict[tuple[str, str], str]] = {(4,): {("S0", "S0"): "S1"}}


def _distribute(impl: SimpleNamespace, mesh: Any, full: torch.Tensor, layout: str) -> Any:
    return impl.api.distribute_tensor(full, mesh, [_placement(impl, part) for part in layout.split(",")])


def _col_scale_on(name: str, mesh_shape: tuple[int, ...], op_name: str) -> list[tuple[str, str, str, bool]]:
    op = getattr(OPS, op_name).default
    impl = _implementation(name)
    mesh = impl.init_device_mesh("cpu", mesh_shape)
    seen = []
    for x_layout, w_layout in _COL_SCALE_LAYOUTS[mesh_shape]:
        small = x_layout.startswith("small:")
        x_full = torch.arange(16.0).reshape(2, 8) if small else torch.arange(48.0).reshape(8, 6)
        w_full = torch.arange(1.0, x_full.shape[1] + 1)
        x = _distribute(impl, mesh, x_full, x_layout.removeprefix("small:"))
        w = _distribute(impl, mesh, w_full, w_layout)
        out = op(x, w)
        seen.append((x_layout, w_layout, _normalized(out.placements), torch.equal(out.full_tensor(), x_full * w_full)))
    # A pending sum of x stays pending through the scaling (the Partial row), on every mesh dim.
    partial_x = impl.api.DTensor.from_local(torch.ones(8, 6), mesh, [impl.api.Partial()] * mesh.ndim)
    out = op(partial_x, _distribute(impl, mesh, torch.arange(6.0), ",".join(["R"] * mesh.ndim)))
    expected = torch.ones(8, 6) * mesh.size() * torch.arange(6.0)
    seen.append(("P", "R", _normalized(out.placements), torch.equal(out.full_tensor(), expected)))
    return seen


@pytest.mark.parametrize("op_name", ["col_scale", "col_scale_expanded"])
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_a_single_dim_strategy_gives_the_placements_pytorch_gives(mesh_shape: tuple[int, ...], op_name: str) -> None:
    """Registered with register_single_dim_strategy, and as an op strategy built by expand_to_full_mesh_op_strategy."""
    ours = run_on_threads(_col_scale_on, "shardwise", mesh_shape, op_name, world_size=WORLD)
    theirs = run_on_threads(_col_scale_on, "torch", mesh_shape, op_name, world_size=WORLD)
    for rank_ours, rank_theirs in zip(ours, theirs):
        for mine, oracle in zip(rank_ours, rank_theirs):
            faster = _FASTER_THAN_PYTORCH.get(mesh_shape, {}).get(mine[:2])
            assert (mine[2] == faster and oracle[3]) if faster is not None else mine == oracle
    assert all(correct for rank in ours for *_, correct in rank)
    placements = {(x, w): out for x, w, out, _ in ours[0]}
    if mesh_shape == (4,):
        assert placements[("S1", "S0")] == "S1"  # the column row, no data moved
        assert placements[("R", "S0")] == "S1"  # x cut locally to meet w's columns
        assert placements[("P", "R")] == "P(sum)"
        assert placements[("small:S1", "R")] == "S1"
    else:
        assert placements[("S0,S1", "R,S0")] == "S0,S1"


def _row_sum_max_on(name: str, mesh_shape: tuple[int, ...], op_name: str) -> list[tuple[str, str, str, bool]]:
    impl = _implementation(name)
    mesh = impl.init_device_mesh("cpu", mesh_shape)
    x_full = torch.arange(64.0).reshape(8, 8) % 7
    layouts = ["S0", "S1", "R"] if mesh_shape == (4,) else ["S0,S1", "S1,S0", "S1,S1", "R,S1", "S0,S0"]
    seen = []
    for layout in layouts:
        total, largest = getattr(OPS, op_name).default(_distribute(impl, mesh, x_full, layout))
        correct = torch.equal(total.full_tensor(), x_full.sum(-1)) and torch.equal(largest.full_tensor(), x_full.amax(-1))
        seen.append((layout, _normalized(total.placements), _normalized(largest.placements), correct))
    return seen


@pytest.mark.parametrize("op_name", ["row_sum_max", "row_sum_max_tuple"])
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_an_op_with_two_outputs_gets_pytorchs_placements(mesh_shape: tuple[int, ...], op_name: str) -> None:
    """Registered as a single-dim strategy (rows name both outputs) and as an op strategy answering a
    TupleStrategy (one child per output)."""
    ours = run_on_threads(_row_sum_max_on, "shardwise", mesh_shape, op_name, world_size=WORLD)
    theirs = run_on_threads(_row_sum_max_on, "torch", mesh_shape, op_name, world_size=WORLD)
    assert ours == theirs
    assert all(correct for rank in ours for *_, correct in rank)
    outputs = {layout: (total, largest) for layout, total, largest, _ in ours[0]}
    if mesh_shape == (4,):
        assert outputs["S1"] == ("P(sum)", "P(max)")  # split columns reduce locally, the reduction stays pending
        assert outputs["S0"] == ("S0", "S0")


def _scale_each_on(name: str, mesh_shape: tuple[int, ...], case: str) -> list[tuple[str, str, tuple[str, ...], bool]]:
    impl = _implementation(name)
    mesh = impl.init_device_mesh("cpu", mesh_shape)
    s_full = torch.arange(1.0, 9.0)
    xs_full = [torch.arange(64.0).reshape(8, 8) + index for index in range(3)]
    cases = _SCALE_EACH_CASES[case][mesh_shape]
    seen = []
    for layouts, s_layout in cases:
        xs = [_distribute(impl, mesh, full, layout) for full, layout in zip(xs_full, layouts)]
        outs = OPS.scale_each.default(xs, _distribute(impl, mesh, s_full, s_layout))
        correct = all(torch.equal(out.full_tensor(), full * s_full) for out, full in zip(outs, xs_full))
        seen.append(("|".join(layouts), s_layout, tuple(_normalized(out.placements) for out in outs), correct))
    return seen


# Layouts of the three xs and of s.  "agreeing": every child can read s where child 0 wants it.
# "disagreeing": the cheapest candidate of a later child wants s elsewhere; PyTorch 2.13 takes s from
# child 0 and runs that child on mismatched pieces (the kernel fails on shapes), shardwise restricts
# the later children to child 0's s.
_SCALE_EACH_CASES = {
    "agreeing": {
        (4,): [(("S0", "S0", "R"), "R"), (("S1", "S1", "R"), "S0"), (("R", "R", "R"), "R")],
        (2, 2): [(("S0,S0", "S0,R", "R,R"), "R,R"), (("S1,S1", "S1,S1", "R,R"), "S0,S0")],
    },
    "disagreeing": {
        (4,): [(("S0", "S1", "R"), "R"), (("R", "S1", "S0"), "S0")],
        (2, 2): [(("S0,S1", "S1,S0", "R,R"), "R,R")],
    },
}


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_a_tuple_strategy_over_a_list_argument_places_each_element_as_pytorch(mesh_shape: tuple[int, ...]) -> None:
    ours = run_on_threads(_scale_each_on, "shardwise", mesh_shape, "agreeing", world_size=WORLD)
    theirs = run_on_threads(_scale_each_on, "torch", mesh_shape, "agreeing", world_size=WORLD)
    assert ours == theirs
    assert all(correct for rank in ours for *_, correct in rank)
    if mesh_shape == (4,):
        # Each element keeps its rows or columns where s allows it; a whole x is cut to meet s's columns.
        assert [out for *_, out, _ in ours[0]] == [("S0", "S0", "R"), ("S1", "S1", "S1"), ("R", "R", "R")]


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_tuple_strategy_children_read_shared_arguments_where_child_0_puts_them(mesh_shape: tuple[int, ...]) -> None:
    ours = run_on_threads(_scale_each_on, "shardwise", mesh_shape, "disagreeing", world_size=WORLD)
    assert all(correct for rank in ours for *_, correct in rank)
    if mesh_shape == (4,):
        # s stays whole (child 0's choice), so the column-split x moves to rows: one all-to-all, not a gather.
        assert ours[0][0][2] == ("S0", "S0", "R")


def _run_wrong_rows() -> str:
    from shardwise.dtensor_ops import Shard, distribute_tensor
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.mesh import init_device_mesh

    x = distribute_tensor(torch.ones(8, 2), init_device_mesh("cpu", (WORLD,)), [Shard(0)])
    with CommDebugMode() as comm, pytest.raises(ValueError) as raised:
        OPS.wrong_rows.default(x)
    assert comm.get_total_counts() == 0
    return str(raised.value)


def test_bad_single_dim_strategies_and_registrations_get_clear_errors() -> None:
    from shardwise.dtensor_ops._op_schema import _SingleDimStrategyInfo
    from shardwise.dtensor_ops._ops.single_dim_strategy import register_single_dim_strategy
    from shardwise.dtensor_ops._sharding_prop import sharding_propagator
    from shardwise.placement import Shard

    register_single_dim_strategy(OPS.wrong_rows.default)(lambda op, args, kwargs: [[Shard(0)]])
    (message,) = set(run_on_threads(_run_wrong_rows, world_size=WORLD))
    assert "swsingledim.wrong_rows" in message and "row of 1 placements" in message and "expected 2" in message
    with pytest.raises(NotImplementedError, match="different_mesh_args=\\[1\\]"):
        sharding_propagator.register_single_dim_op_strategy(
            OPS.wrong_rows.default, _SingleDimStrategyInfo(lambda op, args, kwargs: [], different_mesh_args=[1])
        )
    with pytest.raises(TypeError, match="expected an OpOverload .* got OpOverloadPacket"):
        register_single_dim_strategy(OPS.wrong_rows)


def _both_ways_placements() -> str:
    from shardwise.dtensor_ops import Shard, distribute_tensor
    from shardwise.mesh import init_device_mesh

    x = distribute_tensor(torch.ones(8, 4), init_device_mesh("cpu", (WORLD,)), [Shard(1)])
    return _normalized(OPS.both_ways.default(x).placements)


def test_a_single_dim_strategy_wins_over_an_op_strategy_registered_later() -> None:
    """PyTorch's precedence: single-dim strategy, then op strategy, then sharding-prop rule."""
    from shardwise.dtensor_ops._op_schema import OpSpec, OpStrategy, register_op_strategy
    from shardwise.dtensor_ops._sharding_prop import sharding_propagator
    from shardwise.placement import DTensorSpec, Replicate, Shard

    op = OPS.both_ways.default
    # A bare function works too (PyTorch's propagator takes either).
    sharding_propagator.register_single_dim_op_strategy(op, lambda op, args, kwargs: [[Shard(1), Shard(1)]])

    def replicate_only(schema: Any) -> OpStrategy:
        mesh = schema.get_mesh_from_args()
        replicated = DTensorSpec(mesh, (Replicate(),))
        return OpStrategy([OpSpec(replicated, [replicated])])

    register_op_strategy(op)(replicate_only)
    assert sharding_propagator.op_strategy_funcs[op] is replicate_only
    assert set(run_on_threads(_both_ways_placements, world_size=WORLD)) == {"S1"}
    sharding_propagator.op_single_dim_strategy_funcs.pop(op)
    register_op_strategy(op)(replicate_only)  # now the highest registration left
    assert set(run_on_threads(_both_ways_placements, world_size=WORLD)) == {"R"}
