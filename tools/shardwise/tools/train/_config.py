"""Command-line flags of the trainer and their validation (done before any process or collective starts)."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from dataclasses import asdict, dataclass
from typing import Any, Sequence

__all__ = ["TrainConfig", "ConfigError", "build_parser", "parse_config", "default_output_dir"]

DEFAULT_OUTPUT_FOLDER = "shardwise_train_out"
OPTIMIZERS = ("adamw", "sgd")
DEVICES = ("cpu", "cuda")
# "auto": gloo on cpu, NCCL on cuda (one GPU per rank); "gloo" on cuda: ranks share the GPUs round-robin.
BACKENDS = ("auto", "nccl", "gloo")
# "auto": float64 on cpu (strict parity), float32 on cuda (no fused CUDA attention kernel takes float64).
DTYPES = ("auto", "float64", "float32")
MODELS = ("transformer", "llama")
PLANS = ("manual", "auto")
DEFAULT_WORLD_SIZE = 4
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")

# Default parity tolerances per training dtype.  The two runs reduce in different orders, so
# they differ by round-off, and AdamW amplifies round-off: at initialisation the attention
# query/key gradients are so small that their rounding error is a sizeable part of them, and
# Adam's normalised update turns that into a fraction of the learning rate.  Measured (defaults,
# 4 ranks): in float64 the largest parameter difference is ~1e-13 after 40 steps and ~6e-9 after
# 150; in float32 ~2e-4 after 40 steps and ~2.5e-3 after 150 (two single-process float32 runs
# that differ only in the attention kernel already differ by ~1e-4 after 40 steps).  A real
# layout or gradient bug moves losses and parameters by 1e-3 or more within a few steps, which
# float64's tolerances catch with a wide margin; float32's can only catch gross errors.
PARITY_TOLERANCES = {"float64": (1e-5, 1e-6), "float32": (2e-2, 1e-2)}


class ConfigError(ValueError):
    """A flag value the trainer cannot run with; the message names the flag and what it accepts."""


def default_output_dir() -> pathlib.Path:
    # `bazel run` starts the program in its runfiles tree; BUILD_WORKING_DIRECTORY is where the
    # user typed the command, which is where they will look for the results.
    base = os.environ.get("BUILD_WORKING_DIRECTORY") or os.getcwd()
    return pathlib.Path(base) / DEFAULT_OUTPUT_FOLDER


@dataclass(frozen=True)
class TrainConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 8
    steps: int = 40
    lr: float = 3e-3
    seed: int = 0
    tp: int = 4
    dp: int = 1
    cp: int = 1  # context parallel: each sequence sharded over cp ranks, ring attention (--model llama)
    model: str = "transformer"  # "transformer" (the toy Transformer) or "llama" (the model zoo's Llama)
    n_kv_heads: int = 0  # --model llama: key/value heads (0: as many as --n-heads)
    plan: str = "manual"  # "manual": the model zoo's hand plan (with the flags below); "auto": shardwise.tp_styles.auto_parallelize
    memory_budget_mb: float = 0.0  # --plan auto: the estimated peak memory per rank the plan must fit (0: no budget)
    seq_parallel: bool = True
    loss_parallel: bool = True
    optimizer: str = "adamw"
    foreach: bool = True
    clip_grad_norm: float = 1.0
    device: str = "cpu"
    backend: str = "auto"  # the process group's backend; see BACKENDS
    dtype: str = "auto"  # see DTYPES; training_dtype resolves it
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    output_dir: str = ""
    checkpoint_dir: str = ""
    resume: bool = False
    log_every: int = 1
    parity_rtol: float | None = None  # None: PARITY_TOLERANCES[dtype]
    parity_atol: float | None = None
    compile: bool = False  # forward and loss under torch.compile(fullgraph=True)
    compile_backend: str = "inductor"
    fail_at_step: int = 0  # fault injection: --fail-rank raises in this step, after the forward (0: never)
    fail_rank: int = 0

    @property
    def training_dtype(self) -> str:
        """The dtype the run trains in: ``--dtype``, or for "auto" float64 on cpu and float32 on cuda."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cuda" else "float64"

    @property
    def process_group_backend(self) -> str:
        """The c10d backend the ranks start: "auto" resolved by device."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def shares_gpus(self) -> bool:
        """Whether ranks may share a GPU (gloo moves CUDA tensors from a shared device; NCCL needs one each)."""
        return self.device == "cuda" and self.process_group_backend == "gloo"

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.cp

    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """The device mesh's dims, outermost first: dp and cp where used, tp always."""
        dims = [("dp", self.dp)] if self.dp > 1 else []
        dims += [("cp", self.cp)] if self.cp > 1 else []
        return (*dims, ("tp", self.tp))

    @property
    def uses_seq_parallel(self) -> bool:
        # Llama's plan keeps activations replicated between its tensor-parallel layers; --plan auto decides itself.
        return self.seq_parallel and self.model == "transformer" and self.plan == "manual"

    @property
    def uses_loss_parallel(self) -> bool:
        """Loss parallel in the hand plan; under --plan auto, whether the planner may choose it."""
        return self.loss_parallel and self.model == "transformer"

    @property
    def nproc_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def rtol(self) -> float:
        return PARITY_TOLERANCES[self.training_dtype][0] if self.parity_rtol is None else self.parity_rtol

    @property
    def atol(self) -> float:
        return PARITY_TOLERANCES[self.training_dtype][1] if self.parity_atol is None else self.parity_atol

    def resolved_checkpoint_dir(self) -> pathlib.Path:
        path = pathlib.Path(self.checkpoint_dir).expanduser()
        if not path.is_absolute():
            base = os.environ.get("BUILD_WORKING_DIRECTORY") or os.getcwd()
            path = pathlib.Path(base) / path
        return path

    def resolved_output_dir(self) -> pathlib.Path:
        if not self.output_dir:
            return default_output_dir()
        path = pathlib.Path(self.output_dir).expanduser()
        if not path.is_absolute():
            base = os.environ.get("BUILD_WORKING_DIRECTORY") or os.getcwd()
            path = pathlib.Path(base) / path
        return path

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_argv(self) -> list[str]:
        """Flags that parse back to this config (how the launcher hands it to every worker)."""
        argv: list[str] = []
        for key, value in asdict(self).items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + key.replace("_", "-"))
            elif value is None or (key == "rdzv_endpoint" and not value):
                continue
            else:
                argv += [flag, str(value)]
        return argv

    def validate(self) -> None:
        positive = {
            "--dim": self.dim,
            "--n-layers": self.n_layers,
            "--n-heads": self.n_heads,
            "--seq-len": self.seq_len,
            "--batch-size": self.batch_size,
            "--steps": self.steps,
            "--tp": self.tp,
            "--dp": self.dp,
            "--cp": self.cp,
            "--nnodes": self.nnodes,
            "--log-every": self.log_every,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        if self.batch_size % self.dp != 0:
            raise ConfigError(
                f"--batch-size {self.batch_size} must be a multiple of --dp {self.dp}: each data-parallel rank "
                "trains on an equal share of every batch"
            )
        if self.fail_at_step < 0 or not 0 <= self.fail_rank < self.world_size:
            raise ConfigError(
                f"--fail-at-step {self.fail_at_step} --fail-rank {self.fail_rank}: expected a step >= 0 (0: no fault) and "
                f"a rank in [0, {self.world_size})"
            )
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir DIR, the checkpoint to continue from")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if self.clip_grad_norm < 0:
            raise ConfigError(f"--clip-grad-norm must be >= 0 (0: no clipping), got {self.clip_grad_norm}")
        if self.plan not in PLANS:
            raise ConfigError(f"--plan {self.plan!r}: expected one of {', '.join(PLANS)}")
        if self.memory_budget_mb < 0 or (self.memory_budget_mb and self.plan != "auto"):
            raise ConfigError(
                f"--memory-budget-mb {self.memory_budget_mb:g}: a budget >= 0 for --plan auto's planner (0: none); "
                "the hand plan (--plan manual) takes none"
            )
        if self.model not in MODELS:
            raise ConfigError(f"--model {self.model!r}: expected one of {', '.join(MODELS)}")
        if self.cp > 1 and self.model != "llama":
            raise ConfigError(
                f"--cp {self.cp} needs --model llama: context parallelism shards each sequence and runs causal "
                "F.scaled_dot_product_attention as ring attention, which the Llama model uses (the toy Transformer "
                "attends with an explicit mask)"
            )
        if self.n_kv_heads < 0 or (self.n_kv_heads and self.n_heads % self.n_kv_heads):
            raise ConfigError(f"--n-kv-heads {self.n_kv_heads} must divide --n-heads {self.n_heads} (0: as many as --n-heads)")
        if self.model == "llama" and (self.n_kv_heads or self.n_heads) % self.tp:
            raise ConfigError(
                f"--n-kv-heads {self.n_kv_heads or self.n_heads} must be a multiple of --tp {self.tp}: tensor parallelism "
                "gives each rank whole key/value heads"
            )
        if self.model == "llama" and (self.dim // self.n_heads) % 2:
            raise ConfigError(f"--model llama: the head dim --dim / --n-heads = {self.dim // self.n_heads} must be even (rotary pairs)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.rtol < 0 or self.atol < 0:
            raise ConfigError(f"--parity-rtol and --parity-atol must be >= 0, got {self.rtol} and {self.atol}")
        if self.dim % self.n_heads != 0:
            raise ConfigError(
                f"--dim {self.dim} must be a multiple of --n-heads {self.n_heads} (each head gets dim / n_heads)"
            )
        if self.n_heads % self.tp != 0:
            raise ConfigError(
                f"--n-heads {self.n_heads} must be a multiple of --tp {self.tp}: tensor parallelism gives each rank "
                "whole attention heads"
            )
        if self.uses_seq_parallel and self.seq_len % self.tp != 0:
            raise ConfigError(
                f"--seq-len {self.seq_len} must be a multiple of --tp {self.tp} with --seq-parallel: each rank holds "
                "an equal piece of the sequence (or use --no-seq-parallel)"
            )
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ConfigError(
                f"--compile-backend {self.compile_backend!r}: expected one of {', '.join(COMPILE_BACKENDS)}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer {self.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
        if self.device not in DEVICES:
            raise ConfigError(f"--device {self.device!r}: expected one of {', '.join(DEVICES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ConfigError("--backend nccl needs --device cuda (NCCL moves CUDA tensors only)")
        if self.device == "cuda" and self.dtype == "float64":
            # No fused CUDA attention kernel takes float64: torch runs its composite math attention, whose
            # causal mask is a plain tensor made inside the op, and DTensor refuses mixing it (PyTorch's too).
            raise ConfigError(
                "--device cuda takes --dtype float32 (or auto): float64 attention on CUDA runs torch's math fallback, "
                "whose causal mask is a plain tensor that DTensors cannot mix with (the fused kernels take float32)"
            )
        if self.world_size % self.nnodes != 0:
            raise ConfigError(
                f"--nnodes {self.nnodes} must divide the world size --tp x --dp x --cp = {self.world_size}: "
                "every machine runs the same number of ranks"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, the address of the machine with "
                "--node-rank 0, given identically on every machine"
            )


CONSOLE_SCRIPT = "shardwise-train"


def build_parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    # Started as the console script of the shardwise-tools wheel, or as a module.
    started_as_script = os.path.basename(sys.argv[0]) == CONSOLE_SCRIPT if sys.argv else False
    parser = argparse.ArgumentParser(
        prog=CONSOLE_SCRIPT if started_as_script else "python -m shardwise.tools.train",
        description=(
            "Train a small character-level Transformer with shardwise tensor (and sequence) parallelism on "
            "local ranks started by PyTorch's elastic launcher, then train the same model in one process "
            "without DTensor and compare losses and parameters."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = parser.add_argument_group("model and data (the vocabulary is the corpus' characters)")
    model.add_argument(
        "--model", choices=MODELS, default=defaults.model,
        help="transformer: the toy Transformer (learned positions); llama: the model zoo's Llama (rotary "
        "embeddings, grouped-query attention, SwiGLU, RMSNorm; feed-forward 3 x --dim), needed by --cp",
    )
    model.add_argument("--dim", type=int, default=defaults.dim, help="model width")
    model.add_argument("--n-layers", type=int, default=defaults.n_layers, help="Transformer blocks")
    model.add_argument("--n-heads", type=int, default=defaults.n_heads, help="attention heads (a multiple of --tp)")
    model.add_argument(
        "--n-kv-heads", type=int, default=defaults.n_kv_heads,
        help="--model llama: key/value heads, grouped-query attention (0: as many as --n-heads)",
    )
    model.add_argument("--seq-len", type=int, default=defaults.seq_len, help="characters per sequence (any length with --cp)")
    model.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per step")
    model.add_argument("--seed", type=int, default=defaults.seed, help="initialisation and data seed")

    training = parser.add_argument_group("training")
    training.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    training.add_argument("--lr", type=float, default=defaults.lr, help="learning rate")
    training.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer)
    training.add_argument(
        "--foreach", action=argparse.BooleanOptionalAction, default=defaults.foreach,
        help="use the optimizer's multi-tensor (_foreach_*) implementation",
    )
    training.add_argument(
        "--clip-grad-norm", type=float, default=defaults.clip_grad_norm,
        help="clip the gradients' global 2-norm to this before each step (0: no clipping)",
    )
    training.add_argument("--log-every", type=int, default=defaults.log_every, help="print progress every N steps")

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument(
        "--tp", type=int, default=None,
        help=f"tensor-parallel ranks (mesh dim 'tp'); default {defaults.tp}, or with --cp what fills "
        f"{DEFAULT_WORLD_SIZE} ranks (--dp 2 --cp 2: 1)",
    )
    parallel.add_argument("--dp", type=int, default=defaults.dp, help="data-parallel ranks: FSDP (shardwise.fsdp_ext) over a (dp, tp) mesh")
    parallel.add_argument(
        "--cp", type=int, default=defaults.cp,
        help="context-parallel ranks (mesh dim 'cp', needs --model llama): every sequence is sharded over them "
        "(head-tail load balanced, rotary positions permuted alike) and attention runs as ring attention; "
        "the loss is each rank's tokens' share, summed over cp once",
    )
    parallel.add_argument(
        "--plan", choices=PLANS, default=defaults.plan,
        help="manual: the model zoo's hand-written plan (Megatron-style TP, the flags below, FSDP per block); auto: "
        "shardwise.tp_styles.auto_parallelize chooses TP, sequence and loss parallelism, FSDP units and CP from a "
        "fake trace and the cost model, and rank 0 prints the plan (--seq-parallel is then ignored; "
        "--no-loss-parallel keeps the logits whole)",
    )
    parallel.add_argument(
        "--memory-budget-mb", type=float, default=defaults.memory_budget_mb,
        help="--plan auto: the plan's estimated peak memory per rank (parameters, gradients, AdamW state, "
        "activations, FSDP's unsharded units) must fit this many MB; 0: no budget",
    )
    parallel.add_argument(
        "--seq-parallel", action=argparse.BooleanOptionalAction, default=defaults.seq_parallel,
        help="shard norms and residuals on the sequence dim between the tensor-parallel layers",
    )
    parallel.add_argument(
        "--loss-parallel", action=argparse.BooleanOptionalAction, default=defaults.loss_parallel,
        help="compute cross-entropy on vocabulary-sharded logits without gathering them",
    )
    parallel.add_argument(
        "--device", choices=DEVICES, default=defaults.device,
        help="cpu: gloo; cuda: NCCL, one GPU per rank (or --backend gloo to share fewer GPUs)",
    )
    parallel.add_argument(
        "--backend", choices=BACKENDS, default=defaults.backend,
        help="the process group's backend. auto: gloo on cpu, nccl on cuda; gloo with --device cuda: CUDA tensors "
        "over gloo, the ranks sharing this machine's GPUs round-robin (local rank %% GPU count), so a machine with "
        "one GPU runs any number of ranks",
    )
    training.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=defaults.compile,
        help="run each step's forward and loss as one torch.compile(fullgraph=True) graph (the parallel run, "
        "also with --dp: fully_shard's all-gathers and reduce-scatters are then graph ops; the single-process "
        "reference stays eager); backward runs the compiled backward graph",
    )
    training.add_argument(
        "--compile-backend", choices=COMPILE_BACKENDS, default=defaults.compile_backend,
        help="torch.compile backend for --compile",
    )
    training.add_argument(
        "--dtype", choices=DTYPES, default=defaults.dtype,
        help="parameter, activation and loss dtype; auto: float64 on cpu (the parity check is then strict), "
        "float32 on cuda (needs loose tolerances with AdamW; the fused CUDA attention kernels take no float64)",
    )

    faults = parser.add_argument_group("fault injection (how a failed rank ends the job)")
    faults.add_argument(
        "--fail-at-step", type=int, default=defaults.fail_at_step,
        help="rank --fail-rank raises an InjectedFault in this step, between its forward and its backward, while "
        "the other ranks go on into the backward's collectives; the job must end promptly with that traceback "
        "first and exit status 1 (0: no fault)",
    )
    faults.add_argument("--fail-rank", type=int, default=defaults.fail_rank, help="the rank that raises with --fail-at-step")

    launch = parser.add_argument_group("launcher (passed to torch.distributed.run)")
    launch.add_argument("--nnodes", type=int, default=defaults.nnodes, help="machines taking part")
    launch.add_argument("--node-rank", type=int, default=defaults.node_rank, help="this machine's index")
    launch.add_argument(
        "--rdzv-endpoint", default=defaults.rdzv_endpoint,
        help="HOST:PORT of the machine with --node-rank 0 (needed with --nnodes > 1)",
    )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--output-dir", default=defaults.output_dir,
        help=f"where the loss plot and summary.json go (default: ./{DEFAULT_OUTPUT_FOLDER}; "
        "under `bazel run`, relative to the directory the command was typed in)",
    )
    output.add_argument(
        "--checkpoint-dir", default=defaults.checkpoint_dir,
        help="write a distributed checkpoint (torch.distributed.checkpoint: model and optimizer state, step) "
        "here at the end; with --resume, first load it (written with any --dp/--tp) and continue after its step",
    )
    output.add_argument(
        "--resume", action=argparse.BooleanOptionalAction, default=defaults.resume,
        help="continue from the checkpoint in --checkpoint-dir up to --steps in total",
    )
    output.add_argument(
        "--parity-rtol", type=float, default=defaults.parity_rtol,
        help="relative tolerance of the parity check (losses and parameters); default "
        + ", ".join(f"{dtype}: {tolerances[0]:g}" for dtype, tolerances in PARITY_TOLERANCES.items()),
    )
    output.add_argument(
        "--parity-atol", type=float, default=defaults.parity_atol,
        help="absolute tolerance of the parity check (losses and parameters); default "
        + ", ".join(f"{dtype}: {tolerances[1]:g}" for dtype, tolerances in PARITY_TOLERANCES.items()),
    )
    return parser


def _default_tp(dp: int, cp: int) -> int:
    """4 without --cp (as before); with --cp, what fills 4 ranks together with --dp and --cp (at least 1)."""
    if cp <= 1:
        return TrainConfig.tp
    return max(1, DEFAULT_WORLD_SIZE // max(1, dp * cp))


def parse_config(argv: Sequence[str] | None) -> TrainConfig:
    """Parses and validates; bad values exit through argparse with status 2 and a message naming the flag."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    if namespace.tp is None:
        namespace.tp = _default_tp(namespace.dp, namespace.cp)
    config = TrainConfig(**vars(namespace))
    try:
        config.validate()
    except ConfigError as error:
        parser.error(str(error))
    return config
