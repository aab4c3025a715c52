"""The demo trainer's pieces that need no processes: flags, launcher arguments, data, plan, parity, report."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from shardwise.tools.train import CharCorpus, TrainConfig, compare_runs, load_default_corpus, parse_config
from shardwise.tools.train import _launch, _report
from shardwise.tools.train._config import ConfigError
from shardwise.tools.train._loop import StepRecord
from shardwise.tools.train._worker import PARITY_FAILED_EXIT_CODE


# -- flags -------------------------------------------------------------------------------------


def test_flags_survive_the_trip_to_the_workers() -> None:
    config = TrainConfig(
        dim=32, n_layers=3, n_heads=8, seq_len=16, batch_size=4, steps=7, lr=0.02, tp=2, seq_parallel=False,
        loss_parallel=False, optimizer="sgd", foreach=False, dtype="float32", nnodes=2, node_rank=1,
        rdzv_endpoint="10.0.0.1:29500", output_dir="/tmp/x", parity_atol=0.5, compile=True,
        compile_backend="aot_eager",
    )
    assert parse_config(config.to_argv()) == config


def test_compiled_steps_train_as_eager_ones() -> None:
    """--compile runs forward and loss as one compiled graph; the losses are the eager ones (one process)."""
    from shardwise.tools.train import build_model, model_args
    from shardwise.tools.train._loop import train_loop

    corpus = load_default_corpus()
    config = TrainConfig(dim=16, n_heads=2, n_layers=1, seq_len=8, batch_size=2, tp=1, steps=3)

    def losses(compile_backend: str | None) -> list[float]:
        torch._dynamo.reset()
        model = build_model(model_args(config, corpus.vocab_size), config.seed, torch.device("cpu"), torch.float64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        records = train_loop(
            model, optimizer, corpus, steps=config.steps, batch_size=config.batch_size, seq_len=config.seq_len,
            seed=config.seed, device=torch.device("cpu"), dtype=torch.float64, compile_backend=compile_backend,
        )
        return [record.loss for record in records]

    assert losses("eager") == pytest.approx(losses(None), rel=1e-12)


def test_default_tolerances_follow_the_dtype() -> None:
    strict, loose = TrainConfig(dtype="float64"), TrainConfig(dtype="float32")
    assert strict.atol < loose.atol and strict.rtol < loose.rtol
    assert TrainConfig(dtype="float32", parity_atol=0.25).atol == 0.25


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dp", "3"], "--batch-size 8 must be a multiple of --dp 3"),
        (["--tp", "3"], "--n-heads 4 must be a multiple of --tp 3"),
        (["--dim", "30", "--n-heads", "4"], "--dim 30 must be a multiple of --n-heads 4"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--nnodes", "3"], "--nnodes 3 must divide"),
        (["--seq-len", "30"], "--seq-len 30 must be a multiple of --tp 4 with --seq-parallel"),
        (["--nnodes", "2"], "--rdzv-endpoint"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank 2"),
        (["--compile-backend", "tvm"], "--compile-backend"),
        (["--backend", "nccl"], "--backend nccl needs --device cuda"),
        (["--device", "cuda", "--dtype", "float64"], "--device cuda takes --dtype float32 (or auto)"),
    ],
)
def test_bad_flags_exit_with_a_message_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_config(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_backend_follows_the_device_unless_named() -> None:
    assert TrainConfig().process_group_backend == "gloo" and not TrainConfig().shares_gpus
    assert TrainConfig(device="cuda").process_group_backend == "nccl"
    # dtype auto: float64 on cpu, float32 on cuda (the fused attention kernels); named, it is kept.
    assert TrainConfig().training_dtype == "float64" and TrainConfig(device="cuda").training_dtype == "float32"
    assert TrainConfig(dtype="float32").training_dtype == "float32"
    # gloo on cuda: CUDA tensors over gloo, ranks sharing the GPUs (one GPU runs every rank).
    shared = TrainConfig(device="cuda", dtype="float32", backend="gloo")
    assert shared.process_group_backend == "gloo" and shared.shares_gpus
    assert parse_config(shared.to_argv()) == shared


def test_output_dir_defaults_to_where_bazel_run_was_typed(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    assert TrainConfig().resolved_output_dir() == tmp_path / "shardwise_train_out"
    assert TrainConfig(output_dir="out").resolved_output_dir() == tmp_path / "out"
    monkeypatch.delenv("BUILD_WORKING_DIRECTORY")
    monkeypatch.chdir(tmp_path)
    assert TrainConfig().resolved_output_dir() == tmp_path / "shardwise_train_out"


# -- launcher ----------------------------------------------------------------------------------


def test_single_machine_launch_is_standalone_and_runs_this_module() -> None:
    argv = _launch.torchrun_argv(TrainConfig(tp=4, output_dir="/results"))
    parsed = torchrun.parse_args(argv)
    assert parsed.standalone and parsed.nproc_per_node == "4" and parsed.nnodes == "1"
    assert parsed.module and parsed.training_script == "shardwise.tools.train"
    assert parse_config(parsed.training_script_args) == TrainConfig(tp=4, output_dir="/results")


def test_two_machine_launch_uses_static_rendezvous_at_the_endpoint() -> None:
    config = TrainConfig(tp=4, nnodes=2, node_rank=1, rdzv_endpoint="node0.example:29400", output_dir="/r")
    parsed = torchrun.parse_args(_launch.torchrun_argv(config))
    assert not parsed.standalone
    assert (parsed.nproc_per_node, parsed.nnodes, parsed.node_rank) == ("2", "2", 1)
    assert (parsed.rdzv_backend, parsed.rdzv_endpoint) == ("static", "node0.example:29400")


def test_cuda_without_gpus_is_refused_before_launching(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--device cuda: CUDA is not available"):
        _launch.check_launch_environment(TrainConfig(device="cuda"))


def test_too_few_gpus_are_refused_before_launching(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="4 ranks on this machine need one GPU each, but only 2"):
        _launch.check_launch_environment(TrainConfig(device="cuda", tp=4))


def _failure(exitcode: int) -> ProcessFailure:
    return ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="")


@pytest.mark.parametrize(
    ("failures", "message"),
    [
        ({0: PARITY_FAILED_EXIT_CODE}, "parity check FAILED"),
        ({0: 1, 1: 1}, "training failed: rank 0 exit code 1, rank 1 exit code 1"),
    ],
)
def test_failed_workers_make_the_launcher_exit_non_zero(
    failures: dict[int, int], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    tmp_path: pathlib.Path,
) -> None:
    def fail(_: object) -> None:
        raise ChildFailedError("shardwise.tools.train", {rank: _failure(code) for rank, code in failures.items()})

    monkeypatch.setattr(torchrun, "run", fail)
    # launch() exports these for its workers: let monkeypatch restore them afterwards.
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _launch.launch(TrainConfig(output_dir=str(tmp_path))) == 1
    assert message in capsys.readouterr().err


# -- data --------------------------------------------------------------------------------------


def test_batches_are_a_pure_function_of_step_and_seed() -> None:
    corpus = CharCorpus("abcdefghij" * 5)
    first, again, other = corpus.batch(3, 4, 6, seed=1), corpus.batch(3, 4, 6, seed=1), corpus.batch(4, 4, 6, seed=1)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])
    inputs, targets = first
    assert inputs.shape == targets.shape == (4, 6)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next characters


def test_vocabulary_is_padded_for_the_tensor_parallel_split() -> None:
    corpus = CharCorpus("hello world", vocab_multiple=4)
    assert len(corpus.characters) == 8 and corpus.vocab_size == 8
    assert CharCorpus("hello", vocab_multiple=3).vocab_size == 6
    assert corpus.decode(corpus.encode("low")) == "low"
    with pytest.raises(ValueError, match="'z' is not in the corpus vocabulary"):
        corpus.encode("z")


def test_shipped_corpus_loads() -> None:
    corpus = load_default_corpus(vocab_multiple=4)
    assert len(corpus.text) > 4000 and corpus.vocab_size % 4 == 0
    assert "Shall I compare thee" in corpus.text


def test_too_long_sequences_are_refused() -> None:
    with pytest.raises(ValueError, match="seq_len=10 needs windows of 11 characters, but the corpus has 5"):
        CharCorpus("abcde").batch(1, 1, 10, seed=0)


# -- parity and report --------------------------------------------------------------------------


def _parameters(scale: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.ones(3, 2, dtype=torch.float64) + scale, "b": torch.zeros(2, dtype=torch.float64)}


def test_parity_passes_within_tolerance_and_names_the_worst_parameter() -> None:
    result = compare_runs([2.0, 1.5], [2.0, 1.5 + 1e-9], _parameters(1e-8), _parameters(), rtol=1e-6, atol=1e-8)
    assert result.passed and result.verdict == "PASS"
    assert result.worst_parameter == "w" and 0 < result.max_abs_param_diff < 1e-7
    assert result.max_abs_loss_diff == pytest.approx(1e-9, rel=1e-3)


def test_parity_fails_on_a_loss_or_parameter_difference() -> None:
    by_loss = compare_runs([2.0, 1.6], [2.0, 1.5], _parameters(), _parameters(), rtol=1e-6, atol=1e-8)
    assert not by_loss.passed and "loss differs at step 2" in by_loss.problems[0]
    by_parameter = compare_runs([2.0], [2.0], _parameters(1e-3), _parameters(), rtol=1e-6, atol=1e-8)
    assert by_parameter.verdict == "FAIL" and by_parameter.problems[0].startswith("w: max abs diff")


def test_parity_fails_on_missing_or_reshaped_parameters_and_nan() -> None:
    missing = compare_runs([1.0], [1.0], {"w": torch.ones(3, 2)}, _parameters(), rtol=0, atol=0)
    assert "missing from the tensor-parallel model: b" in missing.problems[0]
    reshaped = compare_runs([1.0], [1.0], {"w": torch.ones(2, 3), "b": torch.zeros(2)}, _parameters(), rtol=0, atol=0)
    assert "w: shape (2, 3)" in reshaped.problems[0]
    diverged = compare_runs([float("nan")], [1.0], _parameters(), _parameters(), rtol=0, atol=0)
    assert not diverged.passed


def test_throughput_leaves_out_the_first_and_the_counted_steps() -> None:
    counted = {"forward": {"all_reduce": 1}, "backward": {}, "optimizer": {}}
    records = [
        StepRecord(1, 3.0, 10.0, counted),
        StepRecord(2, 2.9, 1.0),
        StepRecord(3, 2.8, 3.0),
        StepRecord(4, 2.7, 5.0, counted),
    ]
    times = _report.throughput(records, tokens_per_step=100)
    assert times.timed_steps == 2 and times.median_step_seconds == 2.0
    assert times.tokens_per_second == pytest.approx(200 / 4.0)
    assert times.total_seconds == 19.0
    summary = _report.collectives_per_step(records)
    assert summary["total"] == 1 and summary["counted_steps"] == [1, 4] and summary["same_every_counted_step"]


def test_loss_plot_is_a_png(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "plot.png"
    _report.plot_losses(path, [3.0, 2.5, 2.0], [3.0, 2.5, 2.1], title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_json_round_trips(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "s" / "summary.json"
    _report.write_summary(path, {"steps": 3, "parity": {"verdict": "PASS"}})
    assert json.loads(path.read_text())["parity"]["verdict"] == "PASS"


def test_clipping_plain_gradients_matches_torch() -> None:
    from shardwise.tools.train._loop import clip_gradients

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(4, dtype=torch.float64)) for _ in range(3)]
    theirs = [torch.nn.Parameter(parameter.detach().clone()) for parameter in ours]
    for mine, other in zip(ours, theirs):
        mine.grad = torch.randn(4, dtype=torch.float64) * 3
        other.grad = mine.grad.clone()
    ours[1].grad = None  # parameters without a gradient are skipped, as torch does
    theirs[1].grad = None
    norm = clip_gradients(ours, max_norm=1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.0)
    assert float(norm) == pytest.approx(float(expected)) and float(norm) > 1.0
    for mine, other in zip(ours, theirs):
        if other.grad is not None:
            assert mine.grad is not None and torch.allclose(mine.grad, other.grad)
