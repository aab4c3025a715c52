"""DTensor under torch.compile on 2 gloo ranks: fullgraph, one frame, values and gradients equal to eager.

Each test resets dynamo, compiles with a counting backend (``eager`` or ``aot_eager``: inductor is
exercised by the Transformer test and the benchmark) and compares against the same function run eagerly.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.testing import multi_rank

WORLD = 2


def _compile(fn: Callable[..., Any], backend: str | Any = "eager", **options: Any) -> tuple[Callable[..., Any], Any]:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend) if isinstance(backend, str) else backend
    return torch.compile(fn, backend=counter, fullgraph=True, **options), counter


def _mesh() -> Any:
    return init_device_mesh("cpu", (WORLD,))


@multi_rank(world_size=WORLD)
def test_ops_on_dtensors_compile_into_one_frame() -> None:
    mesh = _mesh()
    torch.manual_seed(0)
    full = torch.randn(6, 4)
    x = distribute_tensor(full, mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(4, 3), mesh, [Replicate()])

    def fn(a: DTensor, b: DTensor) -> torch.Tensor:
        return torch.relu(a @ b * 2 + 1).sum(0)

    compiled, counter = _compile(fn)
    out = compiled(x, w)
    assert counter.frame_count == 1
    assert isinstance(out, DTensor) and out.placements == (Partial(),)
    torch.testing.assert_close(out.full_tensor(), fn(x, w).full_tensor())
    torch.testing.assert_close(out.full_tensor(), torch.relu(full @ w.full_tensor() * 2 + 1).sum(0))


@multi_rank(world_size=WORLD)
def test_new_shapes_do_not_crash_or_recompile_every_time() -> None:
    mesh = _mesh()

    def fn(a: DTensor) -> DTensor:
        return (a * 2 + 1).sum(0)

    compiled, counter = _compile(fn)
    for rows in (4, 6, 8, 10):
        full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
        out = compiled(distribute_tensor(full, mesh, [Shard(0)]))
        torch.testing.assert_close(out.full_tensor(), (full * 2 + 1).sum(0))
    # The first shape, then one dynamic graph for every later shape (automatic dynamic shapes).
    assert counter.frame_count == 2


@multi_rank(world_size=WORLD)
def test_conversions_inside_the_graph() -> None:
    mesh = _mesh()
    rank = dist.get_rank()

    def fn(local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DTensor]:
        dt = DTensor.from_local(local, mesh, [Shard(0)])
        doubled = dt * 2
        whole = doubled.redistribute(mesh, [Replicate()])
        return doubled.to_local(), whole.full_tensor(), whole

    compiled, counter = _compile(fn)
    local = torch.full((2, 3), float(rank))
    piece, whole, built = compiled(local)
    assert counter.frame_count == 1
    expected = torch.cat([torch.full((2, 3), float(r)) for r in range(WORLD)]) * 2
    torch.testing.assert_close(piece, local * 2)
    torch.testing.assert_close(whole, expected)
    assert isinstance(built, DTensor) and built.placements == (Replicate(),) and built.shape == (4, 3)


@multi_rank(world_size=WORLD)
def test_placements_and_mesh_are_usable_inside_the_graph() -> None:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))

    def fn(a: DTensor) -> DTensor:
        tmp = a + 1
        placement = tmp.placements[0]
        m = tmp.device_mesh
        scale = m.size() * 10 + m.get_local_rank() + m.ndim + len(m.device_type)
        coordinate = m.get_coordinate()
        assert coordinate is not None
        scale = scale + coordinate[0] + m["tp"].size(0)
        if placement.is_shard() and isinstance(placement, Shard) and placement.dim == 0:
            return tmp * scale
        return tmp

    x = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    compiled, counter = _compile(fn)
    out = compiled(x)
    assert counter.frame_count == 1
    torch.testing.assert_close(out.to_local(), fn(x).to_local())


@multi_rank(world_size=WORLD)
def test_a_mesh_group_read_inside_the_graph_is_the_live_group_and_runs_collectives() -> None:
    import torch.distributed._functional_collectives as funcol

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))

    def fn(m: Any, local: torch.Tensor) -> tuple[Any, torch.Tensor]:
        group = m.get_group()
        return group, funcol.all_reduce(local, "sum", group=m.get_group("tp"))

    compiled, counter = _compile(fn, backend="aot_eager")
    local = torch.full((3,), float(dist.get_rank() + 1))
    group, summed = compiled(mesh, local)
    assert counter.frame_count == 1
    # The graph hands back the group object itself (lifted as an input), not a copy or a name.
    assert group is mesh.get_group()
    torch.testing.assert_close(summed, torch.full((3,), float(sum(range(1, WORLD + 1)))))


@multi_rank(world_size=WORLD)
def test_gradients_through_a_compiled_function_equal_eager() -> None:
    mesh = _mesh()
    torch.manual_seed(1)
    full_x, full_w = torch.randn(4, 6), torch.randn(6, 5)

    def fn(x: DTensor, w: DTensor) -> torch.Tensor:
        y = torch.nn.functional.gelu(x @ w)
        return y.redistribute(mesh, [Replicate()]).to_local().pow(2).sum()

    def leaves() -> tuple[DTensor, DTensor]:
        x = distribute_tensor(full_x, mesh, [Shard(1)]).requires_grad_()
        w = distribute_tensor(full_w, mesh, [Shard(0)]).requires_grad_()
        return x, w

    eager_x, eager_w = leaves()
    fn(eager_x, eager_w).backward()
    compiled, counter = _compile(fn, "aot_eager")
    x, w = leaves()
    loss = compiled(x, w)
    loss.backward()
    assert counter.frame_count == 1
    assert x.grad is not None and w.grad is not None and eager_x.grad is not None and eager_w.grad is not None
    assert x.grad.placements == eager_x.grad.placements
    torch.testing.assert_close(x.grad.full_tensor(), eager_x.grad.full_tensor())
    torch.testing.assert_close(w.grad.full_tensor(), eager_w.grad.full_tensor())


def _recording_aot_backend() -> tuple[Any, list[torch.fx.GraphModule], list[torch.fx.GraphModule]]:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    forward_graphs: list[torch.fx.GraphModule] = []
    backward_graphs: list[torch.fx.GraphModule] = []

    def record(into: list[torch.fx.GraphModule]) -> Any:
        def compiler(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
            into.append(graph)
            return make_boxed_func(graph.forward)

        return compiler

    backend = aot_autograd(fw_compiler=record(forward_graphs), bw_compiler=record(backward_graphs))
    return backend, forward_graphs, backward_graphs


def _targets(graph: torch.fx.GraphModule) -> list[str]:
    return [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]


@multi_rank(world_size=WORLD)
def test_aot_graphs_hold_functional_collectives_and_their_waits() -> None:
    mesh = _mesh()

    def fn(x: DTensor) -> torch.Tensor:
        return (x.redistribute(mesh, [Replicate()]) * 3).to_local().sum()

    backend, forward_graphs, backward_graphs = _recording_aot_backend()
    compiled, counter = _compile(fn, CompileCounterWithBackend(backend))
    x = distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)]).requires_grad_()
    compiled(x).backward()
    assert counter.frame_count == 1
    forward = _targets(forward_graphs[0])
    assert forward.count("_c10d_functional.all_gather_into_tensor.default") == 1
    assert forward.count("_c10d_functional.wait_tensor.default") >= 1
    # The gradient of an all-gather from Shard(0) goes back Shard(0) locally: no collective in backward.
    backward = _targets(backward_graphs[0])
    assert not [t for t in backward if t.startswith("_c10d_functional.") and "wait" not in t]

    def partial_to_replicate(x: DTensor) -> torch.Tensor:
        return (x @ x.t()).redistribute(mesh, [Replicate()]).to_local().sum()

    backend, forward_graphs, backward_graphs = _recording_aot_backend()
    compiled, counter = _compile(partial_to_replicate, CompileCounterWithBackend(backend))
    y = distribute_tensor(torch.randn(3, 4), mesh, [Shard(1)]).requires_grad_()
    compiled(y).backward()
    forward = _targets(forward_graphs[0])
    assert forward.count("_c10d_functional.all_reduce.default") == 1
    assert forward.count("_c10d_functional.wait_tensor.default") >= 1
    assert y.grad is not None and y.grad.placements == (Shard(1),)


@multi_rank(world_size=WORLD)
def test_async_redistribution_compiles_and_waits_before_use() -> None:
    mesh = _mesh()

    def fn(x: DTensor) -> torch.Tensor:
        gathered = x.redistribute(mesh, [Replicate()], async_op=True)
        return gathered.to_local() + 1

    backend, forward_graphs, _ = _recording_aot_backend()
    compiled, counter = _compile(fn, CompileCounterWithBackend(backend))
    full = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    out = compiled(distribute_tensor(full, mesh, [Shard(0)]))
    assert counter.frame_count == 1
    torch.testing.assert_close(out, full + 1)
    targets = _targets(forward_graphs[0])
    assert targets.index("_c10d_functional.all_gather_into_tensor.default") < targets.index(
        "_c10d_functional.wait_tensor.default"
    )


@multi_rank(world_size=WORLD)
def test_async_redistribution_with_work_left_after_the_collective_traces_forward_and_backward() -> None:
    # Uneven rows: eagerly, shardwise's pending tensor trims the padding on first use; traced, the graph
    # holds the collective and its wait (a pending tensor of functional tensors cannot be waited there).
    mesh = _mesh()

    def fn(x: DTensor) -> torch.Tensor:
        gathered = x.redistribute(mesh, [Replicate()], async_op=True)
        return (gathered.to_local() * 2).sum()

    compiled, counter = _compile(fn, CompileCounterWithBackend("aot_eager"))
    full = torch.arange(14, dtype=torch.float32).reshape(7, 2)
    eager_x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
    expected = fn(eager_x)
    expected.backward()
    x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
    out = compiled(x)
    out.backward()
    assert counter.frame_count == 1
    torch.testing.assert_close(out, (full * 2).sum())
    torch.testing.assert_close(out, expected)
    assert x.grad is not None and eager_x.grad is not None
    torch.testing.assert_close(x.grad.full_tensor(), eager_x.grad.full_tensor())


@multi_rank(world_size=WORLD)
def test_a_mesh_rebuilt_over_new_groups_does_not_reuse_the_graph_of_the_old_ones() -> None:
    mesh = _mesh()

    def fn(a: DTensor) -> DTensor:
        return a.redistribute(a.device_mesh, [Replicate()]) * 2

    compiled, counter = _compile(fn)
    full = torch.arange(4, dtype=torch.float32).reshape(4, 1)
    compiled(distribute_tensor(full, mesh, [Shard(0)]))
    first_groups = mesh._dim_group_names
    # New groups for the same ranks: an equal mesh (same ranks, dims, names) over other communicators.
    rebuilt = init_device_mesh("cpu", (WORLD,))
    if rebuilt._dim_group_names == first_groups:
        # Group creation is cached per rank set; ask for a fresh group explicitly.
        rebuilt = type(mesh).from_group(dist.new_group(list(range(WORLD))), "cpu")
    assert rebuilt == mesh and rebuilt._dim_group_names != first_groups
    out = compiled(distribute_tensor(full, rebuilt, [Shard(0)]))
    torch.testing.assert_close(out.to_local(), full * 2)
    assert counter.frame_count == 2
@multi_rank(world_size=WORLD)
def test_mark_dynamic_compiles_one_graph_per_kind_of_split() -> None:
    mesh = _mesh()

    def fn(a: DTensor) -> DTensor:
        return torch.tanh(a).redistribute(mesh, [Replicate()]) + 1

    compiled, counter = _compile(fn)

    def check(rows: int) -> None:
        full = torch.randn(rows, 2)
        x = distribute_tensor(full, mesh, [Shard(0)])
        torch._dynamo.mark_dynamic(x, 0)
        out = compiled(x)
        assert out.placements == (Replicate(),)
        torch.testing.assert_close(out.to_local(), torch.tanh(full) + 1)

    # Uneven splits (the last rank's shard is shorter: the all-gather pads and trims) share one graph (shards of
    # one row are left out: dynamo specialises sizes 0 and 1) ...
    for rows in (5, 7, 9):
        check(rows)
    assert counter.frame_count == 1
    # ... even splits (no padding) get a second one, and no more.
    for rows in (8, 4, 6):
        check(rows)
    assert counter.frame_count == 2


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@multi_rank(world_size=WORLD)
def test_dropout_on_a_sharded_activation_matches_eager(compiler: str) -> None:
    mesh = _mesh()
    full = torch.arange(1.0, 25.0).reshape(4, 6)

    def fn(a: DTensor) -> DTensor:
        return torch.nn.functional.dropout(a * 2, p=0.5, training=True)

    def run(call: Callable[[DTensor], DTensor]) -> tuple[DTensor, torch.Tensor]:
        x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        torch.manual_seed(123)
        out = call(x)
        out.sum().backward()
        assert x.grad is not None
        return out, x.grad.to_local()

    eager, eager_grad = run(fn)
    compiled, counter = _compile(fn, compiler)
    out, grad = run(compiled)
    assert counter.frame_count == 1
    assert out.placements == eager.placements == (Shard(0),)
    torch.testing.assert_close(out.to_local(), eager.to_local())
    torch.testing.assert_close(grad, eager_grad)
    # A different seed gives a different mask (the graph does not hold a fixed one).
    torch.manual_seed(7)
    again = compiled(distribute_tensor(full, mesh, [Shard(0)]))
    assert not torch.equal(again.to_local(), out.to_local())


@multi_rank(world_size=WORLD)
def test_a_graph_with_sharded_dropout_runs_in_a_process_that_never_traced_it() -> None:
    """The graph names its random op's recipe by the recipe's encoding, so it runs where nothing was recorded:
    a process that loads it from inductor's or AOTAutograd's on-disk cache (simulated by forgetting every
    recorded recipe)."""
    from shardwise.compile_support import _random_in_graph

    mesh = _mesh()
    full = torch.arange(1.0, 25.0).reshape(4, 6)

    def fn(a: DTensor) -> torch.Tensor:
        return torch.nn.functional.dropout(a * 2, p=0.5, training=True).to_local()

    compiled, counter = _compile(fn, "aot_eager")
    torch.manual_seed(11)
    first = compiled(distribute_tensor(full, mesh, [Shard(0)]))
    assert _random_in_graph.recipe_count() > 0
    _random_in_graph._RECIPES.clear()
    torch.manual_seed(11)
    again = compiled(distribute_tensor(full, mesh, [Shard(0)]))
    torch.manual_seed(11)
    eager = fn(distribute_tensor(full, mesh, [Shard(0)]))
    assert counter.frame_count == 1
    torch.testing.assert_close(again, eager)
    torch.testing.assert_close(first, eager)


@multi_rank(world_size=WORLD)
def test_inductor_compiles_a_sharded_layer_forward_and_backward() -> None:
    mesh = _mesh()
    torch.manual_seed(2)
    full_x, full_w = torch.randn(4, 6), torch.randn(6, 4)

    def fn(x: DTensor, w: DTensor) -> torch.Tensor:
        return torch.relu(x @ w).redistribute(mesh, [Replicate()]).to_local().sum()

    def leaves() -> tuple[DTensor, DTensor]:
        return (
            distribute_tensor(full_x, mesh, [Shard(0)]).requires_grad_(),
            distribute_tensor(full_w, mesh, [Replicate()]).requires_grad_(),
        )

    eager_x, eager_w = leaves()
    eager_loss = fn(eager_x, eager_w)
    eager_loss.backward()
    compiled, counter = _compile(fn, "inductor")
    x, w = leaves()
    loss = compiled(x, w)
    loss.backward()
    assert counter.frame_count == 1
    torch.testing.assert_close(loss, eager_loss)
    assert x.grad is not None and w.grad is not None and eager_x.grad is not None and eager_w.grad is not None
    torch.testing.assert_close(x.grad.full_tensor(), eager_x.grad.full_tensor())
    torch.testing.assert_close(w.grad.full_tensor(), eager_w.grad.full_tensor())
@multi_rank(world_size=WORLD)
def test_graph_breaks_between_dtensor_code_leave_whole_dtensors() -> None:
    mesh = _mesh()
    rank = dist.get_rank()

    def fn(local: torch.Tensor) -> DTensor:
        dt = DTensor.from_local(local, mesh, [Shard(0)])
        doubled = dt * 2
        torch._dynamo.graph_break()
        # After the break, the DTensor built in the first graph crosses into Python and the next graph.
        assert isinstance(doubled, DTensor) and doubled.placements == (Shard(0),)
        return doubled.redistribute(mesh, [Replicate()]) + doubled._local_tensor.sum()

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(fn, backend=counter)
    local = torch.full((2, 2), float(rank + 1))
    out = compiled(local)
    expected = fn(local)
    assert counter.frame_count == 2
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    assert out._spec == expected._spec
    torch.testing.assert_close(out.to_local(), expected.to_local())
_MESH_HOLDER: dict[str, Any] = {}


def _from_local_on_held_mesh(local: torch.Tensor) -> torch.Tensor:
    mesh = _MESH_HOLDER["mesh"]
    return DTensor.from_local(local, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()


@multi_rank(world_size=WORLD)
def test_a_global_mesh_rebuilt_over_new_groups_recompiles() -> None:
    """A mesh reached as a global (not through a DTensor input) is a graph input guarded on its layout, rank
    and process-group names (an opaque reference type): a mesh rebuilt over new groups, equal to the old one
    by ``==``, recompiles and runs its collectives on the new groups (before, the graph was reused and
    named the destroyed group)."""
    from shardwise.mesh import DeviceMesh

    old_group = dist.new_group(list(range(WORLD)))
    _MESH_HOLDER["mesh"] = DeviceMesh.from_group(old_group, "cpu")
    compiled, counter = _compile(_from_local_on_held_mesh, "aot_eager")
    local = torch.full((1, 2), float(dist.get_rank()))
    expected = torch.cat([torch.full((1, 2), float(r)) for r in range(WORLD)])
    torch.testing.assert_close(compiled(local), expected)

    _MESH_HOLDER["mesh"] = DeviceMesh.from_group(dist.new_group(list(range(WORLD))), "cpu")
    dist.destroy_process_group(old_group)
    torch.testing.assert_close(compiled(local), expected)
    assert counter.frame_count == 2
