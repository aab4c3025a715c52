"""torch.optim SGD / Adam / AdamW on a small model whose parameters are DTensors.

The same model runs twice per rank: once with plain parameters, once with DTensor
parameters laid out by a plan (replicated, Shard(0), Shard(1), mixed like tensor
parallelism, and a 2x2 mesh); after a few forward/backward/step rounds the DTensor
parameters must equal the plain ones, for foreach=True and foreach=False.  A step
whose gradients are sharded like their parameters must not communicate at all.
Ranks run as threads (test_ops_training_utils.py runs a full step on gloo processes).
"""

from __future__ import annotations

from typing import Any, Mapping

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, Placement, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.testing import run_on_threads

R, S0, S1 = Replicate(), Shard(0), Shard(1)
Plan = Mapping[str, tuple[Placement, ...]]

# name -> (optimizer class, keyword arguments); each runs with foreach=True and foreach=False.
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd-momentum-nesterov-wd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "sgd-dampening-maximize": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.8, "dampening": 0.1, "maximize": True}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adam-amsgrad-maximize-wd": (
        torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "maximize": True, "weight_decay": 0.05},
    ),
    "adamw": (torch.optim.AdamW, {"lr": 0.01}),
    "adamw-amsgrad-maximize-wd": (
        torch.optim.AdamW, {"lr": 0.01, "amsgrad": True, "maximize": True, "weight_decay": 0.1},
    ),
}


class TinyNet(nn.Module):
    """Odd sizes so that 4-way shards are uneven: 10 rows -> 3, 3, 3, 1; 3 rows -> 1, 1, 1, 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x))) * self.scale


PLANS_1D: dict[str, Plan] = {
    "replicated": {name: (R,) for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale")},
    "shard0": {name: (S0,) for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale")},
    "shard1": {"fc1.weight": (S1,), "fc1.bias": (S0,), "fc2.weight": (S1,), "fc2.bias": (R,), "scale": (S0,)},
    # Column-wise fc1, row-wise fc2, replicated rest: what a tensor-parallel plan produces.
    "mixed": {"fc1.weight": (S0,), "fc1.bias": (S0,), "fc2.weight": (S1,), "fc2.bias": (R,), "scale": (R,)},
}
PLAN_2X2: Plan = {
    "fc1.weight": (S0, S1),
    "fc1.bias": (R, S0),
    "fc2.weight": (S1, R),
    "fc2.bias": (R, R),
    "scale": (S0, S0),
}


def _initial_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)  # rank threads share torch's default generator: avoid it
    model = TinyNet()
    return {
        name: torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.5 for name, p in model.named_parameters()
    }


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(1000 + step), dtype=torch.float64)


def _plain_model(state: Mapping[str, torch.Tensor]) -> TinyNet:
    model = TinyNet().double()  # float64: sharded matmuls sum in another order than the plain ones
    model.load_state_dict(state)
    return model


def _distributed_model(state: Mapping[str, torch.Tensor], mesh: Any, plan: Plan) -> TinyNet:
    model = TinyNet().double()
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            fqn = f"{module_name}.{name}" if module_name else name
            laid_out = distribute_tensor(state[fqn].clone(), mesh, plan[fqn])
            module.register_parameter(name, nn.Parameter(laid_out))
    return model


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) ** 2).sum()


def _compare(plain: nn.Module, distributed: nn.Module, where: str) -> None:
    for (name, expected), (_, actual) in zip(plain.named_parameters(), distributed.named_parameters()):
        assert isinstance(actual, DTensor), f"{where}: {name} is no longer a DTensor"
        torch.testing.assert_close(actual.full_tensor(), expected.detach(), rtol=1e-9, atol=1e-10,
                                   msg=lambda m: f"{where}, {name}: {m}")


def _train_both(mesh: Any, plan: Plan, optimizer_name: str, foreach: bool, steps: int = 3) -> None:
    optimizer_class, options = OPTIMIZERS[optimizer_name]
    state = _initial_state(seed=sum(map(ord, optimizer_name)))
    plain = _plain_model(state)
    distributed = _distributed_model(state, mesh, plan)
    plain_optimizer = optimizer_class(plain.parameters(), foreach=foreach, **options)
    distributed_optimizer = optimizer_class(distributed.parameters(), foreach=foreach, **options)
    for step in range(steps):
        x = _inputs(step)
        _loss(plain, x).backward()
        _loss(distributed, distribute_tensor(x, mesh, [R] * mesh.ndim)).backward()
        plain_optimizer.step()
        distributed_optimizer.step()
        # set_to_none=False keeps zeroed DTensor grads (_foreach_zero_ / zero_) for the next round.
        plain_optimizer.zero_grad(set_to_none=step % 2 == 0)
        distributed_optimizer.zero_grad(set_to_none=step % 2 == 0)
        _compare(plain, distributed, f"{optimizer_name} foreach={foreach} step {step}")


def _train_all_optimizers(mesh_shape: tuple[int, ...], plans: Mapping[str, Plan]) -> None:
    mesh = init_device_mesh("cpu", mesh_shape)
    for plan in plans.values():
        for optimizer_name in OPTIMIZERS:
            for foreach in (True, False):
                _train_both(mesh, plan, optimizer_name, foreach)


@pytest.mark.parametrize("plan_name", sorted(PLANS_1D))
def test_optimizers_match_plain_torch_on_1d_mesh(plan_name: str) -> None:
    run_on_threads(_train_all_optimizers, (4,), {plan_name: PLANS_1D[plan_name]}, world_size=4)


def test_optimizers_match_plain_torch_on_2x2_mesh() -> None:
    run_on_threads(_train_all_optimizers, (2, 2), {"2x2": PLAN_2X2}, world_size=4)


OptimizerConfigs = Mapping[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]]


def _foreach_configs() -> OptimizerConfigs:
    return {
        f"{name} foreach={foreach}": (optimizer_class, {**options, "foreach": foreach})
        for name, (optimizer_class, options) in OPTIMIZERS.items()
        for foreach in (True, False)
    }


def _step_with_grads_laid_out_like_params(
    mesh_shape: tuple[int, ...], plan: Plan, configs: OptimizerConfigs | None = None
) -> dict[str, int]:
    """Counts of collectives per optimizer config for a step whose grads sit exactly like their params."""
    mesh = init_device_mesh("cpu", mesh_shape)
    counts: dict[str, int] = {}
    for label, (optimizer_class, options) in (configs or _foreach_configs()).items():
        state = _initial_state(seed=3)
        model = _distributed_model(state, mesh, plan)
        plain = _plain_model(state)
        optimizer = optimizer_class(model.parameters(), **options)
        plain_optimizer = optimizer_class(plain.parameters(), **options)
        generator = torch.Generator().manual_seed(11)
        for step in range(2):
            for param, plain_param in zip(model.parameters(), plain.parameters()):
                grad = torch.randn(param.shape, generator=generator, dtype=torch.float64)
                assert isinstance(param, DTensor)
                param.grad = distribute_tensor(grad, mesh, param.placements)
                plain_param.grad = grad
            with CommDebugMode() as mode:
                optimizer.step()
            plain_optimizer.step()
            counts[f"{label} step {step}"] = int(mode.get_total_counts())
            _compare(plain, model, f"{label} step {step} with grads placed like params")
    return counts


@pytest.mark.parametrize("mesh_shape, plan", [((4,), PLANS_1D["mixed"]), ((4,), PLANS_1D["shard1"]), ((2, 2), PLAN_2X2)])
def test_step_with_sharded_grads_issues_no_collectives(mesh_shape: tuple[int, ...], plan: Plan) -> None:
    for counts in run_on_threads(_step_with_grads_laid_out_like_params, mesh_shape, plan, world_size=4):
        assert counts and all(count == 0 for count in counts.values()), counts


def _tensor_lr_and_redistributed_grads() -> None:
    """AdamW with a 0-dim tensor lr (foreach=False: mul_ by a plain 0-dim tensor) and grads placed unlike params."""
    mesh = init_device_mesh("cpu", (4,))
    state = _initial_state(seed=5)
    plain = _plain_model(state)
    model = _distributed_model(state, mesh, PLANS_1D["mixed"])
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=torch.tensor(0.02), foreach=False, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.02), foreach=False, weight_decay=0.1)
    sgd_plain = torch.optim.SGD(plain.parameters(), lr=torch.tensor(0.1), foreach=True)
    sgd = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), foreach=True)
    generator = torch.Generator().manual_seed(12)
    for step in range(2):
        for param, plain_param in zip(model.parameters(), plain.parameters()):
            grad = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            assert isinstance(param, DTensor)
            # Replicated grads for sharded params and the reverse: the grad moves, the param never does.
            flipped = tuple(R if isinstance(p, Shard) else S0 for p in param.placements)
            param.grad = distribute_tensor(grad, mesh, flipped)
            plain_param.grad = grad
        optimizer.step()
        plain_optimizer.step()
        sgd.step()
        sgd_plain.step()
        for param in model.parameters():
            assert isinstance(param, DTensor)
            assert param.placements == PLANS_1D["mixed"][_name_of(model, param)]
    _compare(plain, model, "tensor lr, redistributed grads")


def _name_of(model: nn.Module, target: torch.Tensor) -> str:
    return next(name for name, param in model.named_parameters() if param is target)


def test_tensor_lr_and_grads_placed_unlike_params() -> None:
    run_on_threads(_tensor_lr_and_redistributed_grads, world_size=4)


# torch's fused kernels (one aten._fused_*_ call per step for every parameter): each parameter's shard
# updates from the same shards of its gradient and state.
FUSED: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adam-amsgrad-maximize-wd": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "maximize": True, "weight_decay": 0.05}),
    "adam-tensor-lr": (torch.optim.Adam, {"lr": torch.tensor(0.01)}),
    "adam-one-element-lr": (torch.optim.Adam, {"lr": torch.tensor([0.01]), "amsgrad": True}),
    "adamw-wd": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adamw-tensor-lr": (torch.optim.AdamW, {"lr": torch.tensor(0.02), "weight_decay": 0.1}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
}


@pytest.mark.parametrize("mesh_shape, plan", [((4,), PLANS_1D["mixed"]), ((4,), PLANS_1D["shard1"]), ((2, 2), PLAN_2X2)])
def test_fused_optimizers_match_plain_torch_without_communicating(mesh_shape: tuple[int, ...], plan: Plan) -> None:
    # The kernel writes into the gradients too (schema: Tensor(b!)[] grads), so they must already be laid out
    # like their parameters (an in-place op cannot move what it writes; see the next test).
    fused = {f"fused {name}": (optimizer_class, {**options, "fused": True}) for name, (optimizer_class, options) in FUSED.items()}
    for counts in run_on_threads(_step_with_grads_laid_out_like_params, mesh_shape, plan, fused, world_size=4):
        assert counts and all(count == 0 for count in counts.values()), counts


def _fused_step_with_partial_gradients() -> str:
    mesh = init_device_mesh("cpu", (2, 2))
    state = _initial_state(seed=7)
    model = _distributed_model(state, mesh, PLAN_2X2)
    _loss(model, distribute_tensor(_inputs(0), mesh, [R, R])).backward()
    assert any(grad.placements != param.placements for param in model.parameters() if (grad := param.grad) is not None)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    with CommDebugMode() as mode, pytest.raises(RuntimeError, match="in-place operations that require placement") as refused:
        optimizer.step()
    assert mode.get_total_counts() == 0
    return str(refused.value)


def test_a_fused_step_needs_gradients_laid_out_like_their_parameters() -> None:
    # Backward leaves some gradients Partial here; the fused kernel writes them, so they cannot be moved for it:
    # a clear error before any collective (foreach=True / fused=False moves them instead).
    assert all("redistribute that DTensor" in message for message in run_on_threads(_fused_step_with_partial_gradients, world_size=4))


def _fused_step_on_a_partial_parameter() -> str:
    from shardwise.dtensor_ops import Partial

    mesh = init_device_mesh("cpu", (4,))
    param = nn.Parameter(DTensor.from_local(torch.ones(3, dtype=torch.float64), mesh, [Partial()]))
    param.grad = DTensor.from_local(torch.ones(3, dtype=torch.float64), mesh, [Partial()])
    optimizer = torch.optim.Adam([param], lr=0.1, fused=True)
    with CommDebugMode() as mode, pytest.raises(RuntimeError, match="parameter 0 is Partial") as refused:
        optimizer.step()
    assert mode.get_total_counts() == 0
    return str(refused.value)


def test_a_fused_step_on_a_partial_parameter_is_refused_before_any_collective() -> None:
    assert all("_fused_adam_" in message for message in run_on_threads(_fused_step_on_a_partial_parameter, world_size=4))
