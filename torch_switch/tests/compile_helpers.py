"""A program written only against torch's paths, run under torchrun with the switch on: tensor-parallel blocks,
each compiled on its own as torchtitan compiles its TransformerBlocks, trained against the same model in
plain torch on every rank.

``python compile_helpers.py [BACKEND]`` under torchrun (2 ranks); prints one line per checked step.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

DIM, HIDDEN, BLOCKS, STEPS = 8, 16, 2, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def main(backend: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    if "--torch" not in sys.argv:  # (--torch: the same program on PyTorch's own DTensor, as an oracle)
        import shardwise.dtensor_ops

        assert DTensor is shardwise.dtensor_ops.DTensor, "run with SHARDWISE_AS_TORCH=1"
    torch.manual_seed(0)
    reference = Model()
    model = Model()
    model.load_state_dict(reference.state_dict())
    for index, block in enumerate(model.blocks):
        # Block 0: plain TP (replicated activations); block 1: sequence parallel around it (torchtitan's plan).
        if index == 0:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        else:
            plan = {
                "norm": SequenceParallel(),
                "up": ColwiseParallel(),
                "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            }
            block.register_forward_pre_hook(lambda module, args: None)  # hooks run inside the compiled call too
            parallelize_module(block, mesh, {"": PrepareModuleInput(input_layouts=(Replicate(),),
                                                                    desired_input_layouts=(Shard(1),),
                                                                    use_local_output=False)})
        parallelize_module(block, mesh, plan)
        block.compile(backend=backend, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(2, 4, DIM, generator=torch.Generator().manual_seed(step))
        out = model(x)
        if isinstance(out, DTensor):
            out = out.full_tensor()
        loss = out.square().mean()
        loss.backward()
        expected = reference(x).square().mean()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for (name, param), (_, reference_param) in zip(model.named_parameters(), reference.named_parameters()):
            assert param.grad is not None and reference_param.grad is not None, name
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            torch.testing.assert_close(grad, reference_param.grad, rtol=1e-5, atol=1e-6, msg=name)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f} equals plain torch's {expected.item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(arguments[0] if arguments else "aot_eager")
