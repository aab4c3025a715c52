"""parallelize_module on 4 ranks: plans with wildcards, meshes (1-D, n-D with a "tp" dim, the current
mesh), errors raised before anything changes, src_data_rank, and training parity of a tensor-parallel
MLP with the same MLP in one process."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from style_helpers import MLP, expect_counts, my_chunk, rank_and_world

from shardwise.dtensor_ops import DTensor, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.placement import Replicate, Shard
from shardwise.testing import multi_rank
from shardwise.tp_styles import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Elementwise mixing keeps each head-column on its own rank, as attention heads do.
        return self.wo(torch.tanh(self.wq(x) * self.wk(x)) + self.wv(x))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention = Attention(dim)
        self.feed_forward = MLP(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.feed_forward(x)


class Toy(nn.Module):
    def __init__(self, dim: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.output = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


TOY_PLAN = {
    "layers.*.attention.w[qkv]": ColwiseParallel(),
    "layers.*.attention.wo": RowwiseParallel(),
    "layers.*.feed_forward.net1": ColwiseParallel(),
    "layers.*.feed_forward.net2": RowwiseParallel(),
}


def _dtensor_parameter_names(model: nn.Module) -> set[str]:
    return {name for name, param in model.named_parameters() if isinstance(param, DTensor)}


@multi_rank
def test_wildcard_plan_parallelizes_every_match_and_keeps_the_function() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(10)
    model = Toy()
    reference = deepcopy(model)
    x = torch.rand(3, 8)

    mode = CommDebugMode()
    parallelize_module(model, mesh, TOY_PLAN)
    expected_names = {
        f"layers.{layer}.{path}.{kind}"
        for layer in range(2)
        for path in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.net1", "feed_forward.net2")
        for kind in ("weight", "bias")
    }
    assert _dtensor_parameter_names(model) == expected_names
    assert model.layers[1].attention.wk.weight.placements == (Shard(0),)
    assert model.layers[0].feed_forward.net2.weight.placements == (Shard(1),)
    assert not isinstance(model.output.weight, DTensor)

    with mode:
        out = model(x)
        # One all-reduce per row-wise linear (2 per block), nothing else.
        expect_counts(mode, "toy forward", 4, all_reduce=4)
    torch.testing.assert_close(out, reference(x).detach())

    # Training step gradients match too (checked on one sharded and one replicated parameter).
    out.sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(
        model.layers[0].attention.wq.weight.grad.full_tensor(), reference.layers[0].attention.wq.weight.grad
    )
    torch.testing.assert_close(
        model.layers[1].feed_forward.net2.bias.grad.full_tensor(), reference.layers[1].feed_forward.net2.bias.grad
    )


@multi_rank
def test_meshes_two_d_with_tp_dim_current_mesh_and_errors() -> None:
    _, world = rank_and_world()
    torch.manual_seed(11)
    model = nn.Linear(8, 8)
    x = torch.rand(2, 8)
    expected = model(x).detach()

    # An n-D mesh with a "tp" dim: its "tp" sub-mesh is used.
    mesh_2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    tp_model = parallelize_module(deepcopy(model), mesh_2d, ColwiseParallel(output_layouts=Replicate()))
    assert tp_model.weight.device_mesh == mesh_2d["tp"]
    assert tp_model.weight.to_local().shape == (8 // (world // 2), 8)
    torch.testing.assert_close(tp_model(x), expected)

    unnamed_2d = init_device_mesh("cpu", (2, world // 2))
    with pytest.raises(ValueError, match=r"only accepts a 1D DeviceMesh, but found 2D.*'tp'"):
        parallelize_module(deepcopy(model), unnamed_2d, ColwiseParallel())
    with pytest.raises(ValueError, match="1-D device mesh"):
        ColwiseParallel()._apply(deepcopy(model), mesh_2d)

    # No mesh given: the mesh entered with `with mesh:`, else an error.
    mesh = init_device_mesh("cpu", (world,))
    with mesh:
        current = parallelize_module(deepcopy(model), parallelize_plan=RowwiseParallel(input_layouts=Replicate()))
    assert current.weight.device_mesh == mesh and current.weight.placements == (Shard(1),)
    torch.testing.assert_close(current(x), expected)
    with pytest.raises(RuntimeError, match="no device_mesh was given and no mesh is active"):
        parallelize_module(deepcopy(model), parallelize_plan=ColwiseParallel())

    # No plan: a warning, nothing changed.
    untouched = deepcopy(model)
    with pytest.warns(UserWarning, match="No parallelize_plan is provided"):
        parallelize_module(untouched, mesh)
    assert not _dtensor_parameter_names(untouched)

    # A DTensor input on another mesh is refused before any collective.
    with pytest.raises(ValueError, match="is a DTensor on .* but the module is parallelized on"):
        tp_model(distribute_tensor(x, mesh, [Replicate()]))


class _WithConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 1)
        self.proj = nn.Linear(4, 4)


@multi_rank
def test_plan_errors_are_raised_before_any_module_changes() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    model = Toy()
    mode = CommDebugMode()

    with mode:
        # A path matching nothing is skipped with a warning, as PyTorch's; the warning says why.
        untouched = deepcopy(model)
        with pytest.warns(UserWarning) as unknown:
            parallelize_module(model, mesh, {"layers.*.atention.wo": RowwiseParallel()})
        message = str(unknown[0].message)
        assert "'layers.*.atention.wo' matches no submodule of Toy" in message and "skipped" in message
        assert "segment 'atention'" in message and "'attention'" in message and "'feed_forward'" in message
        with pytest.warns(UserWarning, match=r"Closest module paths: \['layers.0.attention.wo'"):
            parallelize_module(model, mesh, {"layers.0.atention.wo": RowwiseParallel()})
        with pytest.warns(UserWarning, match=r"'outptu' matches no submodule.*top-level children are \['layers', 'output'\]"):
            parallelize_module(model, mesh, {"outptu": ColwiseParallel()})
        assert all(type(p) is nn.Parameter for p in model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), untouched.state_dict().values()))

        with pytest.raises(NotImplementedError) as conv:
            parallelize_module(_WithConv(), mesh, {"proj": RowwiseParallel(), "conv": ColwiseParallel()})
        conv_message = str(conv.value)
        assert "module 'conv' is a torch.nn.modules.conv.Conv2d" in conv_message, conv_message
        assert "ColwiseParallel supports nn.Linear and nn.Embedding" in conv_message, conv_message
        with pytest.raises(NotImplementedError, match=r"RowwiseParallel .*, but the module is a .*Conv2d"):
            parallelize_module(nn.Conv2d(1, 2, 1), mesh, RowwiseParallel())

        with pytest.raises(ValueError, match="lays out the parameters of module 'layers.0.attention.wq'.* twice"):
            parallelize_module(model, mesh, {"layers.0.attention.wq": ColwiseParallel(), "layers.*.attention.w?": RowwiseParallel()})
        with pytest.raises(TypeError, match=r"the plan entry 'output' must be a ParallelStyle"):
            parallelize_module(model, mesh, {"output": "colwise"})  # type: ignore[dict-item]
        with pytest.raises(TypeError, match="parallelize_plan must be a ParallelStyle or a dict"):
            parallelize_module(model, mesh, [ColwiseParallel()])  # type: ignore[arg-type]
        with pytest.raises(NotImplementedError, match=r"ColwiseParallel .*, but the module is a .*Toy"):
            parallelize_module(model, mesh, {"": ColwiseParallel()})  # "" is the module itself, as PyTorch's
        with pytest.raises(ValueError, match=r"input_kwarg_layouts names \['mask'\].*takes \['x'\]"):
            parallelize_module(
                model,
                mesh,
                PrepareModuleInput(input_kwarg_layouts={"mask": Shard(0)}, desired_input_kwarg_layouts={"mask": Replicate()}),
            )
        with pytest.raises(ValueError, match="3 input_layouts for the module \\(Toy\\).*at most 1 positional"):
            parallelize_module(
                model, mesh, PrepareModuleInput(input_layouts=(None,) * 3, desired_input_layouts=(None,) * 3)
            )
        expect_counts(mode, "failed plans", 0)
    assert not _dtensor_parameter_names(model), "a failed plan must leave the model untouched"

    # A module is parallelized once; the second time is refused with the reason.
    parallelize_module(model, mesh, {"layers.0.attention.wq": ColwiseParallel()})
    with pytest.raises(RuntimeError, match=r"module 'layers.0.attention.wq' \(Linear\) already has DTensor parameters"):
        parallelize_module(model, mesh, {"layers.0.attention.wq": RowwiseParallel()})
    with pytest.raises(RuntimeError, match="already has DTensor parameters"):
        parallelize_module(model, mesh, {"layers.0": SequenceParallel()})

    # Style arguments are checked when the style is built.
    with pytest.raises(TypeError, match="input_layouts must be a Placement"):
        ColwiseParallel(input_layouts=[Shard(0)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"desired_input_layouts\[1\] must be a Placement .* or None"):
        PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), "R"))  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="input_kwarg_layouts and desired_input_kwarg_layouts should have same length!"):
        PrepareModuleInput(input_kwarg_layouts={"x": Shard(0)}, desired_input_kwarg_layouts={})
    with pytest.raises(AssertionError, match="output_layouts and desired_output_layouts should have same length!"):
        from shardwise.tp_styles import PrepareModuleOutput

        PrepareModuleOutput(output_layouts=(Shard(0), None), desired_output_layouts=Replicate())


@multi_rank
def test_inputs_by_keyword_dtensor_inputs_and_local_outputs() -> None:
    rank, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(12)
    model = nn.Linear(8, 8)
    x = torch.rand(2, 8)
    expected = model(x).detach()

    colwise = parallelize_module(deepcopy(model), mesh, ColwiseParallel())
    torch.testing.assert_close(colwise(input=x), my_chunk(expected, 1))
    with pytest.raises(TypeError, match=r"ColwiseParallel on the module \(Linear\) was called without an input tensor"):
        colwise()

    # use_local_output both ways, with a DTensor input sharded on the batch: gathered to Replicate.
    for use_local_output in (True, False):
        styled = parallelize_module(deepcopy(model), mesh, ColwiseParallel(use_local_output=use_local_output))
        out = styled(distribute_tensor(torch.cat([x] * world), mesh, [Shard(0)]))
        assert isinstance(out, DTensor) is not use_local_output
        local = out if use_local_output else out.to_local()
        torch.testing.assert_close(local, my_chunk(torch.cat([expected] * world), 1))

    # Inputs of the wrong kind are named.
    with pytest.raises(TypeError, match=r"input 0 must be a torch.Tensor or DTensor, got list"):
        colwise([1.0] * 8)
    del rank


def _parameter_values_after_parallelize(src_data_rank: int | None) -> tuple[torch.Tensor, dict[str, int]]:
    """This rank's weight shard and the collectives of parallelize_module (total, broadcast, all_to_all_single)."""
    rank, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Linear(4, 2 * world, bias=False)
    with torch.no_grad():
        model.weight.fill_(float(rank))  # every rank starts from different values
    mode = CommDebugMode()
    with mode:
        parallelize_module(model, mesh, ColwiseParallel(), src_data_rank=src_data_rank)
    counts = mode.get_comm_counts()
    functional = torch.ops.c10d_functional
    named = {"broadcast": counts[functional.broadcast], "scatter": counts[torch.ops.c10d.scatter_]}
    return model.weight.to_local(), dict(named, total=mode.get_total_counts())


@multi_rank
def test_src_data_rank() -> None:
    rank, _ = rank_and_world()
    from_rank_zero, collectives = _parameter_values_after_parallelize(0)
    # The scatter, after one small broadcast of the source's shape, stride and dtype (every rank
    # sizes the scatter from the source's tensor: ranks holding other shapes cannot corrupt it).
    assert torch.equal(from_rank_zero, torch.zeros(2, 4))
    assert collectives == {"scatter": 1, "broadcast": 1, "total": 2}, collectives
    own_values, collectives = _parameter_values_after_parallelize(None)
    assert torch.equal(own_values, torch.full((2, 4), float(rank))) and collectives["total"] == 0


# -- training parity -------------------------------------------------------------------------------


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor
) -> list[float]:
    losses = []
    for step in range(len(inputs)):
        optimizer.zero_grad()
        out = model(inputs[step])
        if isinstance(out, DTensor):
            out = out.full_tensor()
        loss = F.mse_loss(out, targets[step])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _assert_same_parameters(parallel: nn.Module, reference: nn.Module) -> None:
    for (name, param), (_, ref_param) in zip(parallel.named_parameters(), reference.named_parameters()):
        assert isinstance(param, DTensor), name
        torch.testing.assert_close(param.full_tensor(), ref_param.detach(), msg=lambda m: f"{name}: {m}")


@multi_rank
def test_mlp_training_matches_single_process() -> None:
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(13)
    steps = 3
    inputs = torch.rand(steps, 5, 8)
    targets = torch.rand(steps, 5, 8)

    reference = MLP(8, 16)
    parallel = deepcopy(reference)
    parallelize_module(parallel, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    reference_losses = _train(reference, _sgd(reference), inputs, targets)

    # One step's collectives: the row-wise output's all-reduce; the input needs no gradient.
    optimizer = _sgd(parallel)
    mode = CommDebugMode()
    with mode:
        parallel_losses = _train(parallel, optimizer, inputs[:1], targets[:1])
        expect_counts(mode, "one MLP training step", 1, all_reduce=1)
    parallel_losses += _train(parallel, optimizer, inputs[1:], targets[1:])
    torch.testing.assert_close(torch.tensor(parallel_losses), torch.tensor(reference_losses))
    _assert_same_parameters(parallel, reference)

    # Uneven hidden size (10 on 4 ranks: 3, 3, 3, 1): DTensors flow between the two styles, so the
    # row-wise linear knows the real layout of its input.
    reference = MLP(8, 10)
    parallel = deepcopy(reference)
    parallelize_module(
        parallel, mesh, {"net1": ColwiseParallel(use_local_output=False), "net2": RowwiseParallel(use_local_output=False)}
    )
    reference_losses = _train(reference, _sgd(reference), inputs, targets)
    parallel_losses = _train(parallel, _sgd(parallel), inputs, targets)
    torch.testing.assert_close(torch.tensor(parallel_losses), torch.tensor(reference_losses))
    _assert_same_parameters(parallel, reference)

    # The same uneven pair passing local tensors (the default use_local_output=True): a plain tensor
    # declared Shard(-1) is taken as an even shard, which 10 features on 4 ranks are not. Every rank
    # says so, with what to do, before any collective (not a bare matmul shape error).
    local_pair = deepcopy(reference)
    parallelize_module(local_pair, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    mode = CommDebugMode()
    with mode, pytest.raises(ValueError) as raised:
        local_pair(inputs[0])
    message = str(raised.value)
    assert "RowwiseParallel on module 'net2' (Linear)" in message and "input 0 is a plain local tensor" in message
    assert "10 input features do not divide over the 4 ranks" in message and "(3, 3, 3, 1" in message
    assert "use_local_output=False" in message
    assert mode.get_total_counts() == 0
    # Declared with a non-negative dim, the feature dim is refused alike; other dims are left alone.
    positive = RowwiseParallel(input_layouts=Shard(2))
    module_positive = parallelize_module(deepcopy(reference.net2), mesh, positive)
    with pytest.raises(ValueError, match="use_local_output=False"):
        module_positive(torch.rand(5, 1, 3))
    by_rows = parallelize_module(deepcopy(reference.net2), mesh, RowwiseParallel(input_layouts=Shard(0)))
    whole_rows = torch.rand(5 * 4, 10)
    torch.testing.assert_close(
        by_rows(my_chunk(whole_rows, 0)), reference.net2(whole_rows), msg="row-sharded input to an uneven rowwise"
    )


@multi_rank
def test_the_empty_plan_path_is_the_module_itself_beside_its_children() -> None:
    """``""`` lays out the root module's own inputs and outputs while its children get theirs (PyTorch's meaning)."""
    rank, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = MLP(dim=8, hidden=16)
    reference = deepcopy(model)
    parallelize_module(
        model,
        mesh,
        {
            "": PrepareModuleInputOutput(
                input_layouts=Replicate(), desired_input_layouts=Shard(0), output_layouts=Shard(0), desired_output_layouts=Replicate()
            ),
            "net1": ColwiseParallel(input_layouts=Shard(0)),
            "net2": RowwiseParallel(output_layouts=Shard(0)),
        },
    )
    x = torch.randn(4 * world, 8)
    out = model(x)
    assert isinstance(out, torch.Tensor) and not isinstance(out, DTensor)  # desired output: Replicate, back to local
    torch.testing.assert_close(out, reference(x))
