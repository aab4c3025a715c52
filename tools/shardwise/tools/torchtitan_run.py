"""torchtitan 0.3.0's own trainer on CPU ranks: what the torchtitan test and benchmark launch under torchrun.

``python -m shardwise.tools.torchtitan_run OUT_JSON BACKEND CONFIG [CONFIG ...]`` (under torchrun) trains torchtitan's Llama 3 debug model (shrunk to
2 layers, float32; the ``moe_*`` configurations: its deepseek_v3 debug MoE, one dense and one MoE layer) through torchtitan's ``Trainer`` (its ``ParallelDims``, parallelize code and
``train_step``) once per named configuration, in this one process per rank, and rank 0 writes the losses
per configuration to OUT_JSON. With ``SHARDWISE_AS_TORCH=1`` (and the switch's .pth installed), every
DTensor, mesh and FSDP2 object torchtitan touches is shardwise's; without it, PyTorch's own.

What is adapted to CPU, and nothing of torchtitan's parallelism code: torchtitan picks "cuda" when no
accelerator is present (set to "cpu" here), and its tokenizer and Hugging Face dataloader need files and
packages a training step never uses, so a tokenizer and a dataloader of fixed random token batches (the
same on every run) stand in for them through torchtitan's own ``Configurable`` interfaces. Modules its
import chain reaches but a CPU step never calls (triton kernels, tensorboard, tokenizers, datasets) are
stubbed when not installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    # name: ParallelismConfig fields (and "compile": True for per-block compile)
    "seed": {},  # one process: writes the seed checkpoint every other configuration starts from
    "moe_seed": {"model": "deepseek_v3"},
    # One process on the global batch of 1, 2 or 4 data-parallel ranks: the references.
    "single": {},
    "single_x2": {"batch_multiplier": 2},
    "single_x4": {"batch_multiplier": 4},
    "tp4": {"tensor_parallel_degree": 4, "enable_sequence_parallel": True},
    "fsdp2_tp2": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
    "hsdp2x2": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2},
    "cp2_tp2": {"context_parallel_degree": 2, "tensor_parallel_degree": 2},
    "tp4_compile": {"tensor_parallel_degree": 4, "compile": True},
    # deepseek_v3's debug MoE (2 layers: one dense, one MoE), expert parallel over 2 ranks inside FSDP over 4.
    "moe_single_x4": {"model": "deepseek_v3", "batch_multiplier": 4},
    "moe_ep2_fsdp4": {"model": "deepseek_v3", "data_parallel_shard_degree": 4, "expert_parallel_degree": 2},
}

SEQ_LEN = 32
BATCH = 4  # rows per data-parallel rank
MAX_GLOBAL_ROWS = 16  # each step's rows are drawn once at this size; a run takes the first local x dp of them


def reference_for(name: str) -> str:
    """The one-process configuration whose global batch (hence losses) a configuration must reproduce."""
    settings = CONFIGS[name]
    data_parallel = settings.get("data_parallel_replicate_degree", 1) * settings.get("data_parallel_shard_degree", 1)
    prefix = "moe_" if settings.get("model") == "deepseek_v3" else ""
    return prefix + {1: "single", 2: "single_x2", 4: "single_x4"}[data_parallel]
STEPS = int(os.environ.get("SHARDWISE_TITAN_STEPS", "3"))
VOCAB = 2048


def _stub_unused_modules() -> None:
    """Stubs for packages whose import torchtitan reaches but whose code a CPU training step never runs."""
    import importlib.util

    def stub(name: str, **attributes: Any) -> None:
        top = name.split(".")[0]
        if top not in sys.modules and importlib.util.find_spec(top) is not None:
            return  # installed: the real package
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        module.__path__ = []  # a package, so stubbed submodules import
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)

    class _Unavailable:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("stubbed: not available in this CPU test environment")

    stub("tokenizers", AddedToken=_Unavailable, Tokenizer=_Unavailable)
    stub("datasets", Dataset=_Unavailable, IterableDataset=_Unavailable, load_dataset=_Unavailable)
    stub("datasets.distributed", split_dataset_by_node=_Unavailable)
    if importlib.util.find_spec("triton") is None:
        # torchtitan's async expert-parallel kernels are triton code (GPU only).
        kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

        def __getattr__(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Unavailable

        kernels.__getattr__ = __getattr__  # type: ignore[method-assign]
        sys.modules[kernels.__name__] = kernels
    if importlib.util.find_spec("tensorboard") is None:
        board = types.ModuleType("torch.utils.tensorboard")
        board.SummaryWriter = _Unavailable  # type: ignore[attr-defined]
        sys.modules[board.__name__] = board


class _CpuDeviceModule(types.SimpleNamespace):
    """What torchtitan asks of its device module (``torch.cuda`` by default), answered for the CPU."""

    def __init__(self) -> None:
        import collections

        super().__init__(
            set_device=lambda device: None,
            current_device=lambda: 0,
            device_count=lambda: 1,
            empty_cache=lambda: None,
            synchronize=lambda *args: None,
            get_device_name=lambda *args: "cpu",
            get_device_properties=lambda *args: types.SimpleNamespace(name="cpu", total_memory=1 << 34),
            memory_stats=lambda *args: collections.defaultdict(int),
            reset_peak_memory_stats=lambda *args: None,
            memory=types.SimpleNamespace(),
        )


def _cpu_device() -> None:
    """torchtitan picks "cuda" when no accelerator is present: point every module that read it at the CPU."""
    import torch
    import torchtitan.trainer  # noqa: F401  (imports the modules that copy device_type / device_module)

    cpu_module = _CpuDeviceModule()
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"  # type: ignore[attr-defined]
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = cpu_module  # type: ignore[attr-defined]
    from torchtitan.tools import utils

    utils.get_local_device = lambda: torch.device("cpu")


def _fixed_data_components() -> tuple[Any, Any]:
    """A tokenizer and a dataloader of fixed token batches, through torchtitan's Configurable interfaces."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class FixedTokenizer(BaseTokenizer):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Config, tokenizer_path: str | None = None) -> None:
            super().__init__()
            self.eos_id = VOCAB - 1

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return VOCAB

    class FixedBatches(BaseDataLoader):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(
            self, config: Config, *, dp_world_size: int, dp_rank: int, local_batch_size: int, seq_len: int, **_: Any
        ) -> None:
            self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
            self.local_batch_size, self.seq_len = local_batch_size, seq_len

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            step = 0
            while True:
                # Each step's rows do not depend on the data-parallel degree: drawn at MAX_GLOBAL_ROWS from the
                # step's own seed, the same on every rank; the global batch is the first local x dp of them and
                # each data-parallel rank takes its slice.
                generator = torch.Generator().manual_seed(1234 + step)
                step += 1
                tokens = torch.randint(0, VOCAB, (MAX_GLOBAL_ROWS, self.seq_len + 1), generator=generator)
                assert self.local_batch_size * self.dp_world_size <= MAX_GLOBAL_ROWS
                rows = tokens[self.dp_rank * self.local_batch_size:(self.dp_rank + 1) * self.local_batch_size]
                # One document per row: positions count from 0 (torchtitan builds its attention masks from them).
                positions = torch.arange(self.seq_len).expand(rows.shape[0], -1).contiguous()
                yield {"input": rows[:, :-1].contiguous(), "positions": positions}, rows[:, 1:].contiguous()

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    return FixedTokenizer.Config(), FixedBatches.Config()


def _trainer_config(name: str, out_dir: str, backend: str) -> Any:
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    settings = dict(CONFIGS[name])
    compile_blocks = settings.pop("compile", False)
    batch_multiplier = settings.pop("batch_multiplier", 1)
    model = settings.pop("model", "llama3")
    # FlexAttention has no CPU backward; torchtitan's own SDPA module (causal) takes its place.
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if model == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import model_registry as deepseek_registry
        from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

        config = deepseek_v3_debugmodel()
        spec = deepseek_registry("debugmodel")
        config.activation_checkpoint = None
    else:
        config = llama3_debugmodel()
        spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:2]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.model_spec = spec
    tokenizer, dataloader = _fixed_data_components()
    config.tokenizer = tokenizer
    config.dataloader = dataloader
    config.dump_folder = os.path.join(out_dir, name)
    config.training.seq_len = SEQ_LEN
    config.training.local_batch_size = BATCH * batch_multiplier
    config.training.steps = STEPS
    config.training.dtype = "float32"
    config.training.mixed_precision_param = "float32"
    # CUDA graphs are a GPU feature (torchtitan falls back to eager on CPU, but first refuses expert parallel's
    # all-to-all dispatcher, which synchronises with the host, under them).
    config.training.disable_cuda_graphs = True
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = False
    # Every configuration starts from the same weights: the seed checkpoint one process wrote (torchtitan's
    # own way to give runs of different parallelisms equal initial states), loaded through DCP.
    config.checkpoint.enable = True
    config.checkpoint.folder = "checkpoint"
    if name in ("seed", "moe_seed"):
        config.checkpoint.create_seed_checkpoint = True
    else:
        seed = "moe_seed" if model == "deepseek_v3" else "seed"
        config.checkpoint.load_only = True
        config.checkpoint.initial_load_path = os.path.join(out_dir, seed, "checkpoint", "step-0")
    config.debug.seed = 0
    config.lr_scheduler.warmup_steps = 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallelism = ParallelismConfig(spmd_backend=backend, **settings)
    if name in ("seed", "moe_seed") or "single" in name:
        parallelism.data_parallel_shard_degree = 1
    elif "data_parallel_shard_degree" not in settings:
        parallelism.data_parallel_shard_degree = world // (
            parallelism.tensor_parallel_degree * parallelism.context_parallel_degree
            * parallelism.data_parallel_replicate_degree
        )
    config.parallelism = parallelism
    if compile_blocks:
        # torch 2.13's AOTAutograd misplaces a saved mesh next to a saved RNG state when activation checkpointing
        # recomputes SDPA in a compiled block ("expected all tensors_saved_with_vc_check to be Tensors"), on
        # PyTorch's DTensor as on shardwise's: per-block compile is run without it.
        config.activation_checkpoint = None
        config.compile.enable = True
        config.compile.components = ["model"]
        config.compile.backend = "aot_eager"
    return config


class _RendezvousStores:
    """A fresh rendezvous store for each configuration, on a port no other process can take.

    Each Trainer initialises (and ``train`` then destroys) the default process group from the environment. A
    fresh store per configuration keeps one configuration's rendezvous keys from meeting the next's. Rank 0
    binds it to a port the OS picks and holds it for the whole configuration; every rank, rank 0 too, reaches
    it as a client (``TORCHELASTIC_USE_AGENT_STORE``), learning the port from torchrun's agent store. A port
    guessed next to torchrun's (MASTER_PORT + 1 + i) can be taken by any other process on the machine between
    the launch and the configuration's start: tests run side by side hit that (EADDRINUSE)."""

    def __init__(self) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            raise RuntimeError("torchtitan_run runs under torchrun (its agent's store is where ranks meet)")
        self._timeout = timedelta(minutes=10)
        self._host = os.environ["MASTER_ADDR"]
        self._agent = TCPStore(
            self._host, int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), is_master=False,
            timeout=self._timeout,
        )
        self._rank = int(os.environ["RANK"])
        self._held: list[Any] = []  # every store rank 0 started, alive to the end: a slow rank may still use one

    def enter(self, index: int) -> None:
        """Points the environment at configuration ``index``'s store (rank 0 starts it first)."""
        from torch.distributed import TCPStore

        key = f"shardwise_titan_store_port_{index}"
        if self._rank == 0:
            store = TCPStore(
                self._host, 0, int(os.environ["WORLD_SIZE"]), is_master=True, timeout=self._timeout,
                wait_for_workers=False,
            )
            self._held.append(store)
            self._agent.set(key, str(store.port))
        os.environ["MASTER_PORT"] = self._agent.get(key).decode()


def train(
    name: str, out_dir: str, backend: str, index: int, step_seconds: list[float], stores: _RendezvousStores
) -> list[float]:
    """One configuration through torchtitan's Trainer (its train() less set_timeout); the loss of every step.

    Appends each step's wall time to ``step_seconds``."""
    import torch
    from torchtitan.trainer import Trainer

    stores.enter(index)
    config = _trainer_config(name, out_dir, backend)
    trainer = Trainer(config)
    losses: list[float] = []
    log = trainer.metrics_processor.log

    def record_loss(step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> None:
        losses.append(float(global_avg_loss))
        log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = record_loss
    try:
        if name in ("seed", "moe_seed"):
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            # Trainer.train() less what torch 2.13 lacks (it ends step 1 with torch.distributed.set_timeout,
            # a newer torch's API): load, then train_step for each step.
            trainer.checkpointer.load(step=config.checkpoint.load_step)
            data = trainer.batch_generator(trainer.dataloader)
            while trainer.should_continue_training():
                trainer.step += 1
                started = time.perf_counter()
                trainer.train_step(data)
                step_seconds.append(time.perf_counter() - started)
    finally:
        trainer.close()
        # As torchtitan's train.py does at the end: the next configuration's Trainer initialises its own.
        torch.distributed.destroy_process_group()
    return losses


def main() -> None:
    out_json, backend, *names = sys.argv[1:]
    _stub_unused_modules()
    _cpu_device()
    import torch.distributed as dist

    results: dict[str, Any] = {}
    rank0 = os.environ.get("RANK", "0") == "0"
    stores = _RendezvousStores()
    for index, name in enumerate(names):
        started = time.perf_counter()
        try:
            step_seconds: list[float] = []
            losses = train(name, os.path.dirname(out_json), backend, index, step_seconds, stores)
        except Exception as error:  # one configuration's failure is a result, not the end of the run
            import traceback

            traceback.print_exc()
            if dist.is_initialized():
                dist.destroy_process_group()
            results[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        else:
            results[name] = {
                "losses": losses, "seconds": time.perf_counter() - started, "step_seconds": step_seconds
            }
        if rank0:
            with open(out_json, "w") as handle:
                json.dump(results, handle, indent=1)

if __name__ == "__main__":
    main()
