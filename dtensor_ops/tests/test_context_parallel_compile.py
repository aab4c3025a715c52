"""torch.compile(fullgraph=True) of a context-parallel attention block: one frame, the ring's collectives in the graphs.

PyTorch's own compiled CP tests are skipped ("compilation with context_parallel doesn't work yet").
Here the ring-attention mode is traced by dynamo like any TorchFunctionMode, the kernel choice
becomes a trace-time constant, and the ring's autograd.Function is one higher-order op.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._functorch.aot_autograd import make_boxed_func

from shardwise.dtensor_ops import init_device_mesh
from shardwise.dtensor_ops.experimental._attention import _cp_options, context_parallel, set_rotate_method
from shardwise.testing import multi_rank


def _reset_options() -> None:
    # Options are process state: pooled rank processes keep them from one test to the next.
    _cp_options.enable_load_balance = True
    set_rotate_method("allgather")


class _AttentionBlock(torch.nn.Module):
    """Projections around SDPA, as in a Transformer layer (the compiled unit)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        query, key, value = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, seq, dim))


def _graph_collectives(graph: torch.fx.GraphModule) -> dict[str, int]:
    """Collectives launched in ``graph`` and its subgraphs (dynamo keeps an autograd.Function's bodies as subgraphs)."""
    counts: dict[str, int] = {}
    for module in graph.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            target = str(node.target)
            if node.op == "call_function" and "_c10d_functional" in target and "wait_tensor" not in target:
                name = target.split(".")[1]
                counts[name] = counts.get(name, 0) + 1
    return counts


@multi_rank(world_size=2)  # compiling costs ~20 s per rank on 2 shared cores: 2 ranks, not 4
def test_compiled_fullgraph_attention_block_puts_the_ring_in_the_graphs() -> None:
    """torch.compile(fullgraph=True) of projections + SDPA in the context: one frame, gradients equal eager.

    The dynamo graph holds the whole ring (W - 1 rotations forward, 2W - 1 backward).  AOTAutograd's
    min-cut partitioner (inductor's) then keeps the forward's rotated key/value blocks for the
    backward instead of rotating them again, so the backward graph only hands gradients on (W
    all-to-alls, allgather: none but those); the default partitioner, by contrast, duplicates
    rotations between the graphs, which is why this test uses the min-cut one.
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    _reset_options()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    for rotate in ("alltoall", "allgather"):
        set_rotate_method(rotate)
        torch.manual_seed(9)
        block = _AttentionBlock(16, 4)
        x = torch.randn(2, 8 * world, 16)
        graphs: dict[str, list[torch.fx.GraphModule]] = {"dynamo": [], "forward": [], "backward": []}

        def capture(kind: str) -> Any:
            def compiler(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
                graphs[kind].append(graph)
                return make_boxed_func(graph.forward)

            return compiler

        def backend(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
            graphs["dynamo"].append(graph)
            aot = aot_autograd(
                fw_compiler=capture("forward"), bw_compiler=capture("backward"), partition_fn=min_cut_rematerialization_partition
            )
            return aot(graph, example_inputs)

        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True, backend=backend)
        eager_piece, compiled_piece = x.clone(), x.clone()
        with context_parallel(mesh, buffers=[eager_piece, compiled_piece], buffer_seq_dims=[1, 1]):
            eager_out = block(eager_piece)
            eager_out.sum().backward()
            eager_grads = [p.grad.clone() for p in block.parameters() if p.grad is not None]
            block.zero_grad()
            compiled_out = compiled(compiled_piece)
            compiled_out.sum().backward()
            compiled_grads = [p.grad.clone() for p in block.parameters() if p.grad is not None]
            block.zero_grad()
        torch.testing.assert_close(compiled_out, eager_out)
        assert len(compiled_grads) == len(eager_grads) == 2
        for got, want in zip(compiled_grads, eager_grads):
            torch.testing.assert_close(got, want)
        assert [len(graphs[kind]) for kind in ("dynamo", "forward", "backward")] == [1, 1, 1], {k: len(v) for k, v in graphs.items()}
        traced = _graph_collectives(graphs["dynamo"][0])
        forward, backward = _graph_collectives(graphs["forward"][0]), _graph_collectives(graphs["backward"][0])
        if rotate == "alltoall":
            assert traced == {"all_to_all_single": 3 * world - 2}, traced
            assert forward == {"all_to_all_single": world - 1} and backward == {"all_to_all_single": world}, (forward, backward)
        else:
            assert traced == {"all_gather_into_tensor": 2, "all_to_all_single": world}, traced
            assert forward == {"all_gather_into_tensor": 1} and backward == {"all_to_all_single": world}, (forward, backward)
