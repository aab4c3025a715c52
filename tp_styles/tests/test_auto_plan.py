"""auto_plan / auto_parallelize: what the planner finds in a model, what it chooses under different costs and
budgets, the errors and warnings it gives, and (on 4 ranks) that the applied plan trains like one process with
the collectives it estimated."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from style_helpers import comm_counts, rank_and_world

from shardwise.dtensor_ops import DTensor, init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.placement import Shard
from shardwise.testing import Llama, LlamaArgs, MLPStacked, ModelArgs, Transformer, multi_rank
from shardwise.testing._fake_mesh import FakeMesh
from shardwise.tp_styles import auto_parallelize, auto_plan, loss_parallel
from shardwise.tp_styles._auto_cost import ComputeProfile
from shardwise.tp_styles._auto_structure import analyse_structure
from shardwise.tp_styles._auto_trace import trace_forward
from shardwise.tp_styles.auto_plan import PlanChoice, StyleSpec, price_plan_choice

# Compute so slow that every FLOP saved wins: the plan must cut every layer it can.
COMPUTE_BOUND = ComputeProfile(flops_per_second=1e6, plain_op_seconds=1e-6, dtensor_op_seconds=1e-6)


def transformer(layers: int = 2, dim: int = 32, vocab: int = 16) -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs(n_layers=layers, vocab_size=vocab, max_seq_len=16, dim=dim, n_heads=4, dropout_p=0.0)
    return Transformer(args).double()


def llama(layers: int = 2, heads: int = 4, kv_heads: int | None = None) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaArgs(dim=32, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, vocab_size=16, ffn_hidden_dim=48)).double()


def tokens(batch: int = 4, seq: int = 8, vocab: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def test_regions_are_found_by_dataflow_in_both_zoo_models() -> None:
    for model, inputs in ((transformer(), (tokens(),)), (llama(), (tokens(), torch.arange(8)))):
        structure = analyse_structure(model, trace_forward(model, inputs), 4)
        found = {(region.entries, region.exit) for region in structure.regions}
        ffn_entries = ("w1",) if isinstance(model, Transformer) else ("w1", "w3")
        for block in ("layers.0", "layers.1"):
            assert (tuple(f"{block}.attention.w{x}" for x in "qkv"), f"{block}.attention.wo") in found
            assert (tuple(f"{block}.feed_forward.{w}" for w in ffn_entries), f"{block}.feed_forward.w2") in found
        assert len(found) == 4
        assert structure.head == "output"
        assert structure.sequence_parallel_refused is None
        assert set(structure.stream_modules) == {"layers.0.attention_norm", "layers.0.ffn_norm", "layers.1.attention_norm", "layers.1.ffn_norm", "norm"}
        assert {block.kind for block in structure.blocks} and len({block.kind for block in structure.blocks}) == 1
    # The Transformer ties its head to the token embedding and builds positions itself (no context parallelism).
    structure = analyse_structure(transformer(), trace_forward(transformer(), (tokens(),)), 4)
    assert structure.tied == (("tok_embeddings.weight", "output.weight"),)
    assert structure.context_parallel_refused is not None and "arange" in structure.context_parallel_refused


def test_a_region_that_would_cut_a_head_or_mix_features_is_refused() -> None:
    # Two heads over four ranks: attention cannot be cut by heads; the feed-forward still can.
    model = llama(heads=2)
    structure = analyse_structure(model, trace_forward(model, (tokens(), torch.arange(8))), 4)
    assert {region.exit.rsplit(".", 1)[1] for region in structure.regions} == {"w2"}

    class SoftmaxBetween(nn.Module):  # a softmax over the cut features needs every feature on one rank
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(self.up(x).softmax(-1))

    mixed = nn.Sequential(SoftmaxBetween())
    structure = analyse_structure(mixed, trace_forward(mixed, (torch.randn(2, 4, 8),)), 4)
    assert structure.regions == ()


def test_compute_bound_costs_recover_the_megatron_plan() -> None:
    # Megatron's TP plan with loss parallel. (Sequence parallelism saves memory here, not FLOPs: the estimate
    # prices matmul FLOPs, and the memory objective chooses it, below.)
    plan = auto_plan(transformer(), FakeMesh((4,)), (tokens(),), loss_fn=F.cross_entropy, compute_profile=COMPUTE_BOUND)
    specs = plan.parallelize_plan_specs
    assert not plan.choice.sequence_parallel
    for name in ("wq", "wk", "wv"):
        assert specs[f"layers.*.attention.{name}"] == StyleSpec("ColwiseParallel")
    assert specs["layers.*.attention.wo"].name == "RowwiseParallel"
    assert specs["layers.*.feed_forward.w1"].name == "ColwiseParallel"
    assert specs["layers.*.feed_forward.w2"].name == "RowwiseParallel"
    assert specs["tok_embeddings"].name == "RowwiseParallel"  # by vocabulary, as the tied head
    assert specs["output"].name == "ColwiseParallel" and plan.loss_parallel
    assert plan.tied_parameters == (("tok_embeddings.weight", "output.weight"),)
    # One layout of each region's input at its parent: one backward reduction, not one per entry.
    assert specs["layers.*.attention"].name == "PrepareModuleInput"
    assert any(note.startswith("this is the standard Megatron / torchtitan plan") for note in plan.notes), plan.notes
    # Under the default (CPU, gloo) costs the planner leaves it, and says why in numbers.
    default = auto_plan(transformer(), FakeMesh((4,)), (tokens(),), loss_fn=F.cross_entropy)
    differs = [note for note in default.notes if note.startswith("differs from the standard Megatron")]
    assert len(differs) == 1 and "head replicated" in differs[0] and " ms with " in differs[0], default.notes


def test_memory_objective_cuts_the_stream_by_sequence() -> None:
    fast = auto_plan(transformer(), FakeMesh((4,)), (tokens(),), loss_fn=F.cross_entropy, compute_profile=COMPUTE_BOUND)
    small = auto_plan(transformer(), FakeMesh((4,)), (tokens(),), loss_fn=F.cross_entropy, objective="memory")
    assert small.choice.sequence_parallel
    assert small.estimate.peak_memory_bytes <= fast.estimate.peak_memory_bytes
    assert small.parallelize_plan_specs["layers.*.attention_norm"] == StyleSpec("SequenceParallel")
    assert small.parallelize_plan_specs["pos_embeddings"].kwargs[-1] == ("output_layouts", Shard(0))
    assert small.sequence_length_multiple == 4


def test_budgets_pick_fsdp_units_and_too_small_a_budget_names_the_smallest_plan() -> None:
    mesh = FakeMesh((2, 2), dim_names=("dp", "tp"))
    free = auto_plan(llama(layers=4), mesh, (tokens(), torch.arange(8)))
    blocks = auto_plan(llama(layers=4), mesh, (tokens(), torch.arange(8)), objective="memory")
    assert blocks.choice.fsdp_units == "blocks" and blocks.choice.reshard_after_forward
    assert blocks.fsdp_units == ("layers.0", "layers.1", "layers.2", "layers.3", "")
    budget = blocks.estimate.peak_memory_bytes
    within = auto_plan(llama(layers=4), mesh, (tokens(), torch.arange(8)), memory_budget_bytes=budget)
    assert within.estimate.peak_memory_bytes <= budget
    assert within.estimate.seconds >= free.estimate.seconds
    with pytest.raises(ValueError, match="smallest found needs") as raised:
        auto_plan(llama(layers=4), mesh, (tokens(), torch.arange(8)), memory_budget_bytes=budget / 10)
    assert "FSDP units: blocks" in str(raised.value)


def test_candidates_do_not_grow_with_depth() -> None:
    counts = {
        layers: auto_plan(transformer(layers), FakeMesh((2, 2), dim_names=("dp", "tp")), (tokens(),), loss_fn=F.cross_entropy).candidates_priced
        for layers in (2, 8)
    }
    assert counts[2] == counts[8] > 1


def test_plan_prints_as_python_that_compiles() -> None:
    plan = auto_plan(llama(), FakeMesh((2, 2), dim_names=("dp", "tp")), (tokens(), torch.arange(8)), compute_profile=COMPUTE_BOUND)
    text = str(plan)
    compile(text, "<auto plan>", "exec")
    assert "'layers.*.feed_forward.w2': RowwiseParallel()" in text
    assert 'parallelize_module(model, mesh["tp"], tp_plan)' in text
    assert "fully_shard(model, mesh=mesh[\"dp\"]" in text
    assert "# runner-up:" in text and "# estimated step per rank:" in text


def test_errors_and_warnings() -> None:
    with pytest.raises(ValueError, match="arange"):
        auto_plan(transformer(), FakeMesh((2, 2), dim_names=("cp", "tp")), (tokens(),))
    with pytest.raises(ValueError, match="name each dim"):
        auto_plan(transformer(), FakeMesh((2, 2), dim_names=("data", "tp")), (tokens(),))
    with pytest.raises(ValueError, match="objective"):
        auto_plan(transformer(), FakeMesh((4,)), (tokens(),), objective="bytes")
    with pytest.raises(TypeError, match="tuple"):
        auto_plan(transformer(), FakeMesh((4,)), tokens())  # type: ignore[arg-type]
    # FSDP units need shardwise.fsdp_ext's fully_shard (this package does not import it): refused before any change.
    fsdp_plan = auto_plan(transformer(), FakeMesh((2, 2), dim_names=("dp", "tp")), (tokens(),))
    untouched = transformer()
    with pytest.raises(ValueError, match="fully_shard=shardwise.fsdp_ext.fully_shard"):
        fsdp_plan.apply(untouched, FakeMesh((2, 2), dim_names=("dp", "tp")))
    assert all(not isinstance(parameter, DTensor) for parameter in untouched.parameters())

    class WithConv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(8, 8, 1)
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.conv(x.transpose(1, 2)).transpose(1, 2)
            return x + self.down(F.relu(self.up(x)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = auto_plan(WithConv(), FakeMesh((4,)), (torch.randn(2, 4, 8),), compute_profile=COMPUTE_BOUND)
    assert any("conv" in str(warning.message) for warning in caught)
    assert "conv" not in plan.parallelize_plan_specs and "up" in plan.parallelize_plan_specs


def _train_step(model: nn.Module, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, under_loss_parallel: bool) -> torch.Tensor:
    context = loss_parallel() if under_loss_parallel else _no_context()
    with context:
        logits = model(*inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    return loss


class _no_context:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@multi_rank
def test_auto_parallelized_models_match_one_process_with_the_estimated_collectives() -> None:
    """One forward and backward of each model, planned and applied on 4 ranks, against the same model in one
    process; the step issues exactly the collectives the planner priced (FSDP plans: the trainer's tests)."""
    _, world = rank_and_world()
    cases = [
        ("transformer tp=4", transformer, (world,), None, F.cross_entropy, COMPUTE_BOUND),
        ("transformer tp=4, default costs", transformer, (world,), None, F.cross_entropy, None),
        ("llama tp=4, grouped-query attention", lambda: llama(kv_heads=4, heads=8), (world,), None, None, COMPUTE_BOUND),
        ("llama tp=4, default costs", llama, (world,), None, None, None),
    ]
    for label, build, shape, names, loss_fn, compute in cases:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        reference, model = build(), build()
        inputs: tuple[torch.Tensor, ...] = (tokens(),) if isinstance(model, Transformer) else (tokens(), torch.arange(8))
        targets = tokens(vocab=16).roll(1, 1)
        plan = auto_parallelize(model, mesh, inputs, loss_fn=loss_fn, compute_profile=compute)
        with CommDebugMode() as mode:
            loss = _train_step(model, inputs, targets, plan.loss_parallel)
        expected_loss = _train_step(reference, inputs, targets, False)
        torch.testing.assert_close(_full(loss), expected_loss, rtol=1e-6, atol=1e-7, msg=label)
        got = comm_counts(mode)["total"]
        assert got == plan.estimate.collectives - plan.estimate.optimizer_collectives, (label, comm_counts(mode), plan.estimate.by_kind, str(plan))
        for name, parameter in reference.named_parameters():
            mine = model.get_parameter(name)
            assert mine.grad is not None, (label, name)
            # The Transformer's logits are float32 whatever its dtype: its gradients agree to float32's rounding.
            torch.testing.assert_close(_full(mine.grad), parameter.grad, rtol=1e-6, atol=1e-7, msg=f"{label}: {name}")


@multi_rank
def test_stacked_mlps_without_a_sequence_dim() -> None:
    """Plain (batch, features) MLPs: each MLP is one region with no parent to lay its input out at; no
    sequence parallelism (there is no sequence dim); the same forward and gradients as one process."""
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    reference = MLPStacked(None, n_layers=3).double()
    model = copy.deepcopy(reference)
    inputs = (torch.randn(6, 10, dtype=torch.float64),)
    plan = auto_parallelize(model, mesh, inputs, compute_profile=COMPUTE_BOUND)
    assert plan.parallelize_plan_specs == {
        "layers.*.net1": StyleSpec("ColwiseParallel"), "layers.*.net2": StyleSpec("RowwiseParallel"),
    }  # fmt: skip
    assert plan.choice.sequence_parallel is False
    with CommDebugMode() as mode:
        model(*inputs).sum().backward()
    reference(*inputs).sum().backward()
    # An all-reduce after each MLP; backward reduces the input gradients of the second and third MLPs only
    # (the first one's input is the model's, which takes no gradient).
    assert comm_counts(mode)["total"] == plan.estimate.collectives - plan.estimate.optimizer_collectives == 3 + 2
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(_full(model.get_parameter(name).grad), parameter.grad, msg=name)


@multi_rank
def test_the_estimate_counts_the_collectives_of_a_hand_written_plan() -> None:
    """The pricing is not tuned to the planner's own plans: the model zoo's hand plan (Megatron TP with sequence
    and loss parallelism, stated as a choice) issues exactly the collectives its estimate counts."""
    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (world,))
    model, inputs, targets = transformer(), (tokens(),), tokens().roll(1, 1)
    hand = PlanChoice(
        sequence_parallel=True,
        region_modes=(("layers.*.attention", "tensor_parallel"), ("layers.*.feed_forward", "tensor_parallel")),
        embedding_modes=(("tok_embeddings", "vocabulary"), ("pos_embeddings", "feature")),
        head_mode="loss_parallel",
    )
    estimate = price_plan_choice(model, mesh, inputs, hand, loss_fn=F.cross_entropy)
    Transformer.parallelize(model, mesh, True, loss_parallel=True)
    with CommDebugMode() as mode:
        _train_step(model, inputs, targets, True)
    assert comm_counts(mode)["total"] == estimate.collectives - estimate.optimizer_collectives, (comm_counts(mode), estimate.by_kind)


def test_the_planner_names_no_collective_and_prices_through_the_engine() -> None:
    """The automatic planner states layouts; which collectives move them, and at what price, is dtensor_ops'
    answer (its planner and decisions), so the two cannot disagree. No collective is named in its modules."""
    import pathlib
    import re

    import shardwise.tp_styles as package
    from shardwise.dtensor_ops import _pricing

    folder = pathlib.Path(package.__file__).parent
    planner_modules = sorted([folder / "auto_plan.py", *folder.glob("_auto_*.py")])  # every module of the planner
    assert {"_auto_candidates.py", "_auto_cost.py", "_auto_price_choice.py", "_auto_result.py"} <= {m.name for m in planner_modules}
    for module in planner_modules:
        name, source = module.name, module.read_text()
        named = re.findall(r"all[_ -](?:reduce|gather|to[_ -]all)|reduce[_ -]scatter|allreduce|allgather", source, flags=re.IGNORECASE)
        assert not named, (name, named)
    # Every move an estimate counts is one the engine priced: make it price each move twice as dear, and the
    # estimate's communication doubles with it.
    choice = PlanChoice(
        sequence_parallel=True,
        region_modes=(("layers.*.attention", "tensor_parallel"), ("layers.*.feed_forward", "tensor_parallel")),
        embedding_modes=(("tok_embeddings", "vocabulary"), ("pos_embeddings", "feature")),
        head_mode="loss_parallel",
    )
    mesh = FakeMesh((4,))
    plain = price_plan_choice(transformer(), mesh, (tokens(),), choice, loss_fn=F.cross_entropy)
    original = _pricing.price_redistribution

    def dearer(*args: object, **kwargs: object) -> _pricing.Movement:
        moved = original(*args, **kwargs)  # type: ignore[arg-type]
        return _pricing.Movement(2 * moved.seconds, moved.bytes_received, moved.collectives, moved.kinds)

    _pricing.price_redistribution = dearer  # type: ignore[assignment]
    try:
        doubled = price_plan_choice(transformer(), mesh, (tokens(),), choice, loss_fn=F.cross_entropy)
    finally:
        _pricing.price_redistribution = original  # type: ignore[assignment]
    assert plain.collectives == doubled.collectives > 0
    assert doubled.communication_seconds == pytest.approx(2 * plain.communication_seconds)
