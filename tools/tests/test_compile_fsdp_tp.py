"""FSDP x TP (shardwise.fsdp_ext over shardwise.tp_styles) with torch.compile, on a (dp=2, tp=2) mesh of 4 ranks.

The whole model compiles as one frame (fullgraph=True): while dynamo traces, fully_shard's hooks build each
unsharded parameter from the sharded one with traceable DTensor ops (all-gather over dp in the forward graph;
its backward, the reduce-scatter, in the backward graph; see fsdp_ext's README). Checked against eager
fully_shard (losses, gradients and their placements) and against one process training the plain model.  Also:
mixed precision compiled, HSDP / Shard(1) / sum reduction / list units on a small MLP, an option a graph cannot
honour refused at trace time, and each block compiled alone with fully_shard's eager hooks around it.  (In tools/tests: compile_support's own tests may not import fsdp_ext,
a sibling package.)
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from shardwise.dtensor_ops import DTensor
from shardwise.fsdp_ext import MixedPrecisionPolicy, fully_shard
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import Shard
from shardwise.testing import ModelArgs, Transformer, multi_rank

VOCAB = 8
STEPS = 5
ARGS = ModelArgs(n_layers=2, vocab_size=VOCAB, max_seq_len=8, dim=8, n_heads=2, dropout_p=0.0)

Step = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=generator)
    targets = torch.randint(0, VOCAB, (2, 8), generator=generator)
    return tokens, targets


def _transformer_setup() -> tuple[DeviceMesh, Transformer, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 2x2 mesh, the seeded base Transformer, the whole batch and this dp rank's row of it."""
    mesh = _mesh()
    torch.manual_seed(0)
    base = Transformer(ARGS)
    tokens, targets = _data()
    dp_rank = mesh["dp"].get_local_rank()
    return mesh, base, tokens, targets, tokens[dp_rank : dp_rank + 1], targets[dp_rank : dp_rank + 1]


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def _fsdp_tp(base: nn.Module, mesh: DeviceMesh, sequence_parallel: bool, **fsdp_kwargs: Any) -> nn.Module:
    model = Transformer.parallelize(copy.deepcopy(base), mesh["tp"], sequence_parallel)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], **fsdp_kwargs)
    fully_shard(model, mesh=mesh["dp"], **fsdp_kwargs)
    return model


def _train(model: nn.Module, step: Step, tokens: torch.Tensor, targets: torch.Tensor, steps: int) -> tuple[list[float], list[tuple[Any, torch.Tensor]]]:
    """Per-step losses, and the last step's gradients (placements, local values) before the optimizer used them."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses: list[float] = []
    grads: list[tuple[Any, torch.Tensor]] = []
    for _ in range(steps):
        loss = step(model, tokens, targets)
        loss.backward()
        grads = [
            (p.grad.placements, p.grad.to_local().clone()) if isinstance(p.grad, DTensor) else (None, p.grad.clone())
            for p in model.parameters()
        ]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _recording_aot_backend() -> tuple[Any, list[torch.fx.GraphModule], list[torch.fx.GraphModule]]:
    """aot_eager that keeps the forward and backward graphs, with inductor's partitioner (the min-cut one,
    which honours activation-checkpointing tags; aot_eager's default one saves every activation)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    forward_graphs: list[torch.fx.GraphModule] = []
    backward_graphs: list[torch.fx.GraphModule] = []

    def record(into: list[torch.fx.GraphModule]) -> Any:
        def compiler(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
            into.append(graph)
            return make_boxed_func(graph.forward)

        return compiler

    from torch._functorch.partitioners import min_cut_rematerialization_partition

    backend = aot_autograd(
        fw_compiler=record(forward_graphs), bw_compiler=record(backward_graphs), partition_fn=min_cut_rematerialization_partition
    )
    return backend, forward_graphs, backward_graphs


def _collective_groups(graph: torch.fx.GraphModule, op_name: str) -> list[str]:
    """The process-group name (the last argument) of every ``_c10d_functional.<op_name>`` call in ``graph``."""
    target = f"_c10d_functional.{op_name}.default"
    return [str(node.args[-1]) for node in graph.graph.nodes if node.op == "call_function" and str(node.target) == target]


def _assert_same_gradients(compiled: list[tuple[Any, torch.Tensor]], eager: list[tuple[Any, torch.Tensor]]) -> None:
    assert len(compiled) == len(eager)
    for (compiled_placements, compiled_local), (eager_placements, eager_local) in zip(compiled, eager):
        assert compiled_placements == eager_placements
        torch.testing.assert_close(compiled_local, eager_local, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
@multi_rank(world_size=4, timeout=300)
def test_fsdp_x_tp_model_compiles_as_one_frame_and_trains_like_eager_and_one_process(compile_backend: str) -> None:
    mesh, base, tokens, targets, my_tokens, my_targets = _transformer_setup()

    eager_losses, eager_grads = _train(_fsdp_tp(base, mesh, True), _loss, my_tokens, my_targets, STEPS)
    torch._dynamo.reset()
    recording, forward_graphs, backward_graphs = _recording_aot_backend()
    counter = CompileCounterWithBackend(recording if compile_backend == "aot_eager" else compile_backend)
    model = _fsdp_tp(base, mesh, True)
    compiled_losses, compiled_grads = _train(
        model, torch.compile(_loss, backend=counter, fullgraph=True), my_tokens, my_targets, STEPS
    )

    assert counter.frame_count == 1
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-6, abs=1e-7)
    _assert_same_gradients(compiled_grads, eager_grads)

    # One process, the whole batch: FSDP averages the dp ranks' gradients of their halves.
    reference = copy.deepcopy(base)
    reference_losses, _ = _train(reference, _loss, tokens, targets, STEPS)
    mean_losses = torch.tensor(compiled_losses)
    dist.all_reduce(mean_losses, group=mesh.get_group("dp"))
    assert (mean_losses / 2).tolist() == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(param, DTensor), name
        torch.testing.assert_close(param.full_tensor(), expected.detach(), rtol=1e-5, atol=1e-6, msg=name)

    if compile_backend == "aot_eager":
        # Eager fully_shard's collectives over dp, now graph ops: forward, one all-gather per unit (the blocks
        # and the root); backward, one reduce-scatter per unit and the blocks' gathers again
        # (reshard_after_forward, recomputed by the partitioner; the root keeps its parameters).
        # The other collectives are tensor parallelism's, over tp.
        dp_group = mesh.get_group("dp").group_name
        units = len(model.layers) + 1
        assert len(forward_graphs) == 1 and len(backward_graphs) == 1
        assert _collective_groups(forward_graphs[0], "all_gather_into_tensor").count(dp_group) == units
        assert dp_group not in _collective_groups(forward_graphs[0], "reduce_scatter_tensor")
        assert _collective_groups(backward_graphs[0], "reduce_scatter_tensor").count(dp_group) == units
        assert _collective_groups(backward_graphs[0], "all_gather_into_tensor").count(dp_group) == len(model.layers)


@multi_rank(world_size=4, timeout=300)
def test_mixed_precision_without_reshard_compiled_matches_eager_fully_shard() -> None:
    mesh, base, _, _, tokens, targets = _transformer_setup()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    options: dict[str, Any] = {"mp_policy": policy, "reshard_after_forward": False}
    eager_losses, eager_grads = _train(_fsdp_tp(base, mesh, False, **options), _loss, tokens, targets, 2)
    torch._dynamo.reset()
    recording, forward_graphs, backward_graphs = _recording_aot_backend()
    counter = CompileCounterWithBackend(recording)
    compiled_losses, compiled_grads = _train(
        _fsdp_tp(base, mesh, False, **options), torch.compile(_loss, backend=counter, fullgraph=True), tokens, targets, 2
    )
    assert counter.frame_count == 1
    # Not resharded after forward: backward gathers nothing again over dp.
    dp_group = mesh.get_group("dp").group_name
    assert _collective_groups(forward_graphs[0], "all_gather_into_tensor").count(dp_group) == ARGS.n_layers + 1
    assert dp_group not in _collective_groups(backward_graphs[0], "all_gather_into_tensor")
    assert _collective_groups(backward_graphs[0], "reduce_scatter_tensor").count(dp_group) == ARGS.n_layers + 1
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-3)
    assert all(grad.dtype == torch.float32 for _, grad in compiled_grads)
    for (compiled_placements, compiled_local), (eager_placements, eager_local) in zip(compiled_grads, eager_grads):
        assert compiled_placements == eager_placements
        # bf16 compute: the graph may order bf16 ops differently from eager.
        torch.testing.assert_close(compiled_local, eager_local, rtol=2e-2, atol=2e-3)


def _mlp_units(layout: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (4,))
    options: dict[str, Any] = {"mesh": mesh}
    if layout == "dim1":
        options["shard_placement_fn"] = lambda param: Shard(param.dim() - 1)
    if layout == "list":
        fully_shard([model[0], model[2]], **options)
    else:
        fully_shard(model[0], **options)
        fully_shard(model[2], **options)
    fully_shard(model, **options)
    if layout == "sum":
        model.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    if layout == "divide_without_fullgraph":
        model.set_gradient_divide_factor(3.0)  # type: ignore[operator]
    return model


@pytest.mark.parametrize("layout", ["hsdp", "dim1", "sum", "list", "divide_without_fullgraph"])
@multi_rank(world_size=4, timeout=300)
def test_fsdp_layouts_and_options_compiled_match_eager(layout: str) -> None:
    """HSDP on (2, 2), Shard(1) by shard_placement_fn, sum reduction, a list of modules as one unit; uneven
    rows over 4 ranks (3, 5 and 6 rows: empty pieces too).  A gradient divide factor, which a graph cannot
    honour, without fullgraph: dynamo falls back to eager fully_shard for the hooks, consistently."""
    inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step(model: nn.Module, x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return (model(x) ** 2).sum()

    eager_losses, eager_grads = _train(_mlp_units(layout), step, inputs, inputs, 2)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fullgraph = layout != "divide_without_fullgraph"
    compiled_losses, compiled_grads = _train(
        _mlp_units(layout), torch.compile(step, backend=counter, fullgraph=fullgraph), inputs, inputs, 2
    )
    assert counter.frame_count == 1 if fullgraph else counter.frame_count >= 1
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-6, abs=1e-7)
    _assert_same_gradients(compiled_grads, eager_grads)


@multi_rank(world_size=4, timeout=300)
def test_option_a_graph_cannot_honour_is_refused_at_trace_time() -> None:
    mesh = _mesh()
    torch.manual_seed(0)
    model = _fsdp_tp(Transformer(ARGS), mesh, False)
    model.set_gradient_divide_factor(3.0)
    tokens, targets = _data()
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"fully_shard under torch.compile: .*set_gradient_divide_factor\(3.0\)"):
        torch.compile(_loss, backend="aot_eager", fullgraph=True)(model, tokens[:1], targets[:1])


@multi_rank(world_size=4, timeout=300)
def test_fsdp_x_tp_with_compiled_blocks_trains_with_eager_losses() -> None:
    """Each block's forward compiled alone (fullgraph): fully_shard's eager hooks run around it."""
    mesh, base, _, _, tokens, targets = _transformer_setup()

    def train(counter: CompileCounterWithBackend | None) -> list[float]:
        model = _fsdp_tp(base, mesh, False)
        if counter is not None:
            for block in model.layers:
                block.forward = torch.compile(block.forward, backend=counter, fullgraph=True)  # type: ignore[method-assign]
        return _train(model, _loss, tokens, targets, 3)[0]

    eager = train(None)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = train(counter)
    # At most one graph per block (dynamo may share one between blocks of the same code and layouts).
    assert 1 <= counter.frame_count <= 2
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
