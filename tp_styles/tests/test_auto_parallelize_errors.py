"""auto_parallelize's errors for models it cannot trace and example inputs that do not fit the model.

Each error names the module (path and type), the example inputs and the line of the user's forward,
is of the planner's own type (a ValueError for inputs, a TypeError for models), and comes before the
model changes: after the error the model has the same modules, parameter objects, values and hooks.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

from shardwise.dtensor_ops import DTensor, distribute_tensor, init_device_mesh
from shardwise.placement import Replicate
from shardwise.testing import multi_rank
from shardwise.testing._fake_mesh import FakeMesh
from shardwise.tp_styles import (
    AutoPlanError,
    DataDependentControlFlowError,
    ExampleInputMismatchError,
    UnsupportedModelError,
    auto_parallelize,
    auto_plan,
)
from shardwise.tp_styles._auto_cost import ComputeProfile

# Compute so slow that every FLOP saved wins: the planner cuts every layer it can.
COMPUTE_BOUND = ComputeProfile(flops_per_second=1e6, plain_op_seconds=1e-6, dtensor_op_seconds=1e-6)


def line_of(function: Any, text: str) -> str:
    """``file:line`` of the line of ``function`` containing ``text``, as the errors report it."""
    lines, first = inspect.getsourcelines(function)
    for offset, line in enumerate(lines):
        if text in line:
            return f"{inspect.getsourcefile(function)}:{first + offset}"
    raise AssertionError(f"{text!r} not in {function}")


class Block(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.norm(x)


class BranchesOnData(Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        if x.mean() > 0:  # data-dependent control flow
            x = self.layers[1](x)
        return self.norm(x)


class GatedBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.up(x)
        scale = hidden.abs().max().item()  # a value read inside a submodule
        return self.down(hidden / scale)


class StackWithGatedBlock(Stack):
    def __init__(self) -> None:
        super().__init__()
        self.layers[1] = GatedBlock()


class SelectsNonZeroRows(Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = x[x.sum(-1).nonzero()[:, 0]]  # a shape that depends on values
        return self.norm(self.layers[0](kept))


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything auto_parallelize would change: modules, parameter objects and their values, hooks."""
    return {
        "modules": [(name, type(module)) for name, module in model.named_modules()],
        "tensors": [(name, id(tensor), type(tensor), tensor.detach().clone()) for name, tensor in model.state_dict(keep_vars=True).items()],
        "hooks": [
            (name, len(module._forward_hooks), len(module._forward_pre_hooks)) for name, module in model.named_modules()
        ],
    }


def assert_untouched(model: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert after["modules"] == before["modules"]
    assert after["hooks"] == before["hooks"]
    assert len(after["tensors"]) == len(before["tensors"])
    for (name, identity, kind, value), (name_then, identity_then, kind_then, value_then) in zip(after["tensors"], before["tensors"]):
        assert (name, identity, kind) == (name_then, identity_then, kind_then)
        assert torch.equal(value, value_then), name


def plan_quietly(model: nn.Module, example_inputs: tuple[Any, ...]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto_plan(model, FakeMesh((4,)), example_inputs)


def test_data_dependent_branch_names_the_line_of_the_forward() -> None:
    model = BranchesOnData().double()
    before = snapshot(model)
    with pytest.raises(DataDependentControlFlowError) as raised:
        plan_quietly(model, (torch.randn(4, 8, dtype=torch.float64),))
    error = raised.value
    where = line_of(BranchesOnData.forward, "if x.mean() > 0:")
    assert error.location == where
    assert isinstance(error, TypeError) and isinstance(error, AutoPlanError)
    message = str(error)
    assert "data-dependent control flow" in message
    assert f"{where} (`if x.mean() > 0:  # data-dependent control flow`)" in message
    assert "BranchesOnData" in message
    assert "_local_scalar_dense" not in message  # the fake-tensor op is in the chained cause, not the explanation
    assert error.__cause__ is not None
    assert_untouched(model, before)


def test_a_value_read_in_a_submodule_names_that_module() -> None:
    model = StackWithGatedBlock()
    with pytest.raises(DataDependentControlFlowError, match=r"module 'layers\.1' \(GatedBlock\)") as raised:
        plan_quietly(model, (torch.randn(4, 8),))
    assert raised.value.module == "layers.1"
    assert raised.value.location == line_of(GatedBlock.forward, ".item()")


def test_a_value_dependent_shape_is_refused_with_its_line() -> None:
    model = SelectsNonZeroRows()
    with pytest.raises(DataDependentControlFlowError, match="aten.nonzero") as raised:
        plan_quietly(model, (torch.randn(4, 8),))
    assert raised.value.location == line_of(SelectsNonZeroRows.forward, "nonzero()")


@pytest.mark.parametrize(
    "example, expected",
    [
        (torch.randn(4, 8, dtype=torch.float32), "different dtypes.*example input \\[0\\]: float32"),
        (torch.ones(4, 8, dtype=torch.int64), "different dtypes.*example input \\[0\\]: int64"),
        (torch.randn(4, 8, dtype=torch.float64, device="meta"), "different devices.*example input \\[0\\]: meta"),
    ],
    ids=["float32-into-float64", "int64-into-float64", "meta-into-cpu"],
)
def test_inputs_the_model_would_refuse_are_refused(example: torch.Tensor, expected: str) -> None:
    model = Stack().double()
    before = snapshot(model)
    with pytest.raises(ExampleInputMismatchError, match=expected) as raised:
        plan_quietly(model, (example,))
    error = raised.value
    assert isinstance(error, ValueError)
    assert error.input_index == 0
    assert error.module == "layers.0.up" and error.module_type == "Linear"
    assert error.location == line_of(Block.forward, "self.up(x)")  # the innermost line of user code
    assert "parameter 'layers.0.up.weight': float64" in str(error) or "different devices" in str(error)
    assert_untouched(model, before)


def test_the_model_really_refuses_what_the_planner_refuses() -> None:
    """The dtype check is not stricter than the model: the same float32 batch fails the real forward."""
    with pytest.raises(RuntimeError):
        Stack().double()(torch.randn(4, 8, dtype=torch.float32))
    Stack().double()(torch.randn(4, 8, dtype=torch.float64))  # and the fitting batch runs
    plan_quietly(Stack().double(), (torch.randn(4, 8, dtype=torch.float64),))


class MaskedAttention(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        keep = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(attended.transpose(1, 2).flatten(2))


def test_operands_of_different_dtypes_that_the_model_accepts_are_not_refused() -> None:
    """A boolean attention mask beside float64 queries, an int64 index beside float64 values: valid."""
    model = MaskedAttention().double()
    model(torch.randn(2, 4, 8, dtype=torch.float64))  # the real forward accepts it
    plan_quietly(model, (torch.randn(2, 4, 8, dtype=torch.float64),))
    embedding = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8)).double()
    plan_quietly(embedding, (torch.randint(0, 16, (2, 4)),))


def test_a_wrong_shape_names_the_module_and_the_input_shapes() -> None:
    model = Stack()
    with pytest.raises(ExampleInputMismatchError, match=r"\[0\] float32 \(4, 7\) on cpu.*module 'layers\.0\.up' \(Linear\)") as raised:
        plan_quietly(model, (torch.randn(4, 7),))
    assert "same reduction dim" in str(raised.value)  # the model's own complaint, kept


def test_models_the_planner_cannot_trace_are_named() -> None:
    lazy = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(UnsupportedModelError, match=r"'0\.weight' of module '0' \(LazyLinear\) is not initialised"):
        plan_quietly(lazy, (torch.randn(4, 8),))
    compiled = torch.compile(Stack())
    with pytest.raises(UnsupportedModelError, match=r"torch.compile wrapper .* of Stack.*model\._orig_mod"):
        plan_quietly(compiled, (torch.randn(4, 8),))
    with pytest.raises(UnsupportedModelError, match="must be an nn.Module"):
        plan_quietly(lambda x: x, (torch.randn(4, 8),))  # type: ignore[arg-type]


def test_a_plan_applied_to_another_model_changes_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = auto_plan(Stack(), FakeMesh((4,)), (torch.randn(4, 8),), compute_profile=COMPUTE_BOUND)
    assert plan.parallelize_plan_specs  # compute-bound: the blocks are cut
    other = nn.Sequential(nn.Linear(8, 8))
    before = snapshot(other)
    with pytest.raises(ValueError, match=r"the plan was made for Stack, and Sequential has no module path 'layers"):
        plan.apply(other, FakeMesh((4,)))  # type: ignore[arg-type]
    assert_untouched(other, before)


@multi_rank(world_size=4)
def test_auto_parallelize_on_four_ranks_refuses_before_changing_the_model() -> None:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    cases: list[tuple[nn.Module, tuple[Any, ...], type[Exception]]] = [
        (BranchesOnData().double(), (torch.randn(4, 8, dtype=torch.float64),), DataDependentControlFlowError),
        (Stack().double(), (torch.randn(4, 8, dtype=torch.float32),), ExampleInputMismatchError),
        (Stack(), (torch.randn(4, 9),), ExampleInputMismatchError),
    ]
    for model, example_inputs, error_type in cases:
        before = snapshot(model)
        with pytest.raises(error_type):
            auto_parallelize(model, mesh, example_inputs)
        assert_untouched(model, before)
    # An already distributed model is refused, naming the parameter, and stays as it was.
    distributed = Stack()
    distributed.norm.weight = nn.Parameter(distribute_tensor(distributed.norm.weight.detach(), mesh, [Replicate()]))
    before = snapshot(distributed)
    with pytest.raises(UnsupportedModelError, match=r"'norm\.weight' of module 'norm' \(LayerNorm\) is a DTensor"):
        auto_parallelize(distributed, mesh, (torch.randn(4, 8),))
    assert_untouched(distributed, before)
    # The model refused for its float32 batch is still usable: with a float64 batch it is parallelized.
    refused_for_dtype = cases[1][0]
    expected = refused_for_dtype(torch.ones(4, 8, dtype=torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto_parallelize(refused_for_dtype, mesh, (torch.randn(4, 8, dtype=torch.float64),))
    torch.testing.assert_close(refused_for_dtype(torch.ones(4, 8, dtype=torch.float64)), expected)
    assert all(not isinstance(p, DTensor) or p.device_mesh == mesh for p in refused_for_dtype.parameters())
