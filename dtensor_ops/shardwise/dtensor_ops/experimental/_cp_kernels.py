"""The attention kernels ring attention runs on each (query block, key/value block) pair.

Each kernel answers the block's output with its log-sum-exp (float32, shape ``(B, H, Lq)``) and,
for the backward, the block's gradients given the *final* output and log-sum-exp of the whole
ring (so every block recomputes its softmax with the global normaliser, and the per-block
gradients add up to the exact gradient).  The kernel is the one ``F.scaled_dot_product_attention``
itself would pick for the local tensors (``torch._fused_sdp_choice``, which honours
``sdpa_kernel(...)``): the CPU flash kernel or the math path on CPU, flash / memory-efficient /
cuDNN / math on CUDA.

Masks are ``causal`` (SDPA's top-left triangle) or none; dropout is refused before the ring starts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

__all__ = ["BlockKernel", "BlockTensors", "accumulation_dtype", "choose_kernel", "kernel_by_name"]

aten = torch.ops.aten

def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half and single precision; float64 inputs keep float64 (rounding them to float32 would lose digits)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# torch._fused_sdp_choice's answers (torch.nn.attention.SDPBackend values).
_MATH, _FLASH, _EFFICIENT, _CUDNN = 0, 1, 2, 3


@dataclass(frozen=True)
class BlockTensors:
    """A block's backward inputs: the output gradient, query, key, value, the ring's output and log-sum-exp."""

    grad_out: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


class BlockKernel(ABC):
    """One attention kernel's forward (output, float32 log-sum-exp) and backward on a block pair.

    The fused ATen kernels take contiguous inputs, the ring's output and its gradient in the query's
    dtype and the log-sum-exp in the form their forward returned it: prepared here, once for all of
    them (``takes_prepared_inputs``); the math kernel reads its inputs as they are.
    """

    name: str
    takes_prepared_inputs = True

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of softmax(q k^T * scale [+ causal mask]) v; ``lse`` ``(B, H, Lq)`` in the accumulation dtype."""
        if self.takes_prepared_inputs:
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        return self._forward(query, key, value, causal, scale)

    def backward(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of this block given the ring's final ``out`` and ``lse`` for these query rows."""
        if not self.takes_prepared_inputs:
            return self._backward(BlockTensors(grad_out, query, key, value, out, lse), causal, scale)
        prepared = BlockTensors(
            grad_out.to(query.dtype).contiguous(),
            query.contiguous(),
            key.contiguous(),
            value.contiguous(),
            out.to(query.dtype).contiguous(),
            self._kernel_lse(lse, query.dtype).contiguous(),
        )
        return self._backward(prepared, causal, scale)

    def _kernel_lse(self, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The ring's ``(B, H, Lq)`` log-sum-exp as this kernel's backward reads it (float32 on CUDA)."""
        return lse.float()

    @abstractmethod
    def _forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` on (prepared) inputs."""

    @abstractmethod
    def _backward(self, inputs: BlockTensors, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`backward` on (prepared) inputs."""


def _causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    # SDPA's is_causal is top-left aligned: query i sees keys 0..i.
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).triu(1)


class MathKernel(BlockKernel):
    """Explicit matmuls in float32 (float64 for float64 inputs): any device; what ``sdpa_kernel(SDPBackend.MATH)`` asks for."""

    name = "math"
    takes_prepared_inputs = False  # any layout, any dtype: everything is widened first

    def _scores(self, query: torch.Tensor, key: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
        accumulate = accumulation_dtype(query.dtype)
        scores = torch.matmul(query.to(accumulate), key.to(accumulate).transpose(-2, -1)) * scale
        if causal:
            scores = scores.masked_fill(_causal_mask(query.size(-2), key.size(-2), query.device), float("-inf"))
        return scores

    def _forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self._scores(query, key, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probabilities = torch.exp(scores - lse.unsqueeze(-1))
        return torch.matmul(probabilities, value.to(probabilities.dtype)), lse

    def _backward(self, inputs: BlockTensors, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key = inputs.query, inputs.key
        accumulate = accumulation_dtype(query.dtype)
        grad_out_wide = inputs.grad_out.to(accumulate)
        probabilities = torch.exp(self._scores(query, key, causal, scale) - inputs.lse.to(accumulate).unsqueeze(-1))
        grad_value = torch.matmul(probabilities.transpose(-2, -1), grad_out_wide)
        grad_probabilities = torch.matmul(grad_out_wide, inputs.value.to(accumulate).transpose(-2, -1))
        # Softmax backward with the *global* row normaliser: sum_j p_ij dp_ij over all blocks is rowsum(dout * out).
        row_dot = (grad_out_wide * inputs.out.to(accumulate)).sum(-1, keepdim=True)
        grad_scores = probabilities * (grad_probabilities - row_dot) * scale
        grad_query = torch.matmul(grad_scores, key.to(accumulate))
        grad_key = torch.matmul(grad_scores.transpose(-2, -1), query.to(accumulate))
        return grad_query, grad_key, grad_value


class CpuFlashKernel(BlockKernel):
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (the CPU default)."""

    name = "flash_cpu"

    def _forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(query, key, value, 0.0, causal, scale=scale)
        return out, lse.to(accumulation_dtype(query.dtype))

    def _kernel_lse(self, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # The kernel's log-sum-exp is float32, float64 for float64 inputs: hand it back in that dtype.
        return lse.to(accumulation_dtype(dtype))

    def _backward(self, inputs: BlockTensors, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        grad_query, grad_key, grad_value = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            inputs.grad_out, inputs.query, inputs.key, inputs.value, inputs.out, inputs.lse, 0.0, causal, scale=scale
        )
        return grad_query, grad_key, grad_value


class CudaFlashKernel(BlockKernel):
    """``aten._scaled_dot_product_flash_attention`` (CUDA) and its backward."""

    name = "flash"

    def _forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        results = aten._scaled_dot_product_flash_attention.default(query, key, value, 0.0, causal, False, scale=scale)
        return results[0], results[1].float()

    def _backward(self, inputs: BlockTensors, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Dense (not nested) inputs: no cumulative sequence lengths (the forward returns None for them);
        # no dropout: the philox state is unread (shaped as the forward returns it, seed (2,) and offset ()).
        device = inputs.query.device
        seed = torch.zeros(2, dtype=torch.uint64, device=device)
        offset = torch.zeros((), dtype=torch.uint64, device=device)
        grad_query, grad_key, grad_value = aten._scaled_dot_product_flash_attention_backward.default(
            inputs.grad_out, inputs.query, inputs.key, inputs.value, inputs.out, inputs.lse, None, None,
            inputs.query.size(-2), inputs.key.size(-2), 0.0, causal, seed, offset, scale=scale,
        )  # fmt: skip
        return grad_query, grad_key, grad_value


class CudaEfficientKernel(BlockKernel):
    """``aten._scaled_dot_product_efficient_attention`` (CUDA) and its backward."""

    name = "efficient"

    def _forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention.default(query, key, value, None, True, 0.0, causal, scale=scale)
        # The kernel may pad the log-sum-exp's sequence dim (to a multiple of 32): keep the real rows.
        return out, lse[..., : query.size(-2)].float()

    def _backward(self, inputs: BlockTensors, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seed_and_offset = torch.zeros((), dtype=torch.int64, device=inputs.query.device)
        grads = aten._scaled_dot_product_efficient_attention_backward.default(
            inputs.grad_out, inputs.query, inputs.key, inputs.value, None, inputs.out, inputs.lse,
            seed_and_offset, seed_and_offset, 0.0, [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        return grads[0], grads[1], grads[2]


class CudnnKernel(BlockKernel):
    """``aten._scaled_dot_product_cudnn_attention`` (CUDA) and its backward; its log-sum-exp keeps a trailing dim."""

    name = "cudnn"

    def _forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        results = aten._scaled_dot_product_cudnn_attention.default(query, key, value, None, True, 0.0, causal, False, scale=scale)
        lse = results[1]
        if lse.dim() == query.dim():
            lse = lse.squeeze(-1)
        return results[0], lse.float()

    def _kernel_lse(self, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return lse.float().unsqueeze(-1)

    def _backward(self, inputs: BlockTensors, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # No dropout: seed and offset unread (shaped as the forward returns them); no bias; dense inputs.
        seed = torch.zeros((), dtype=torch.int64, device=inputs.query.device)
        grads = aten._scaled_dot_product_cudnn_attention_backward.default(
            inputs.grad_out, inputs.query, inputs.key, inputs.value, inputs.out, inputs.lse, seed, seed, None, None, None,
            inputs.query.size(-2), inputs.key.size(-2), 0.0, causal, scale=scale,
        )  # fmt: skip
        return grads[0], grads[1], grads[2]


_KERNELS: dict[str, BlockKernel] = {
    kernel.name: kernel for kernel in (MathKernel(), CpuFlashKernel(), CudaFlashKernel(), CudaEfficientKernel(), CudnnKernel())
}


def kernel_by_name(name: str) -> BlockKernel:
    try:
        return _KERNELS[name]
    except KeyError:
        raise ValueError(f"unknown ring attention kernel {name!r}; expected one of {sorted(_KERNELS)}") from None


def _sdp_choice(
    shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype, device: torch.device, is_causal: bool, scale: float, requires_grad: bool
) -> int:
    # Asked on fresh contiguous tensors of the given shapes (the kernels make their inputs contiguous).
    # Under torch.compile the answer is a constant of the trace (dynamo cannot put an op answering an
    # int into the graph); in eager this is a plain call.
    query, key, value = (torch.empty(shape, dtype=dtype, device=device, requires_grad=requires_grad) for shape in shapes)
    grouped = shapes[0][1] != shapes[1][1]
    return int(torch._fused_sdp_choice(query, key, value, None, 0.0, is_causal, scale=scale, enable_gqa=grouped))


# What ``torch._dynamo.assume_constant_result`` does (torch 2.13: it sets this mark and nothing else),
# without importing torch._dynamo when this module is imported: that import costs about a second, and
# under shardwise's torch switch it starts dynamo's own imports (FSDP's package among them) while this
# package is half imported.
_sdp_choice._dynamo_marked_constant = True  # type: ignore[attr-defined]


def choose_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    scale: float,
    query_length: int | None = None,
    kv_length: int | None = None,
) -> BlockKernel:
    """The kernel ``F.scaled_dot_product_attention`` would run on tensors like these (honours ``sdpa_kernel``).

    ``query_length`` / ``kv_length`` replace the tensors' sequence lengths in the question: a ring asks
    with the widest rank's lengths, so every rank gets the same kernel, also a rank that holds no
    token (for which no fused kernel applies; with ``sdpa_kernel`` forcing one, it alone would raise
    while the other ranks went on into the ring's collectives).
    """

    def shape_of(tensor: torch.Tensor, length: int | None) -> tuple[int, ...]:
        shape = tuple(tensor.shape)
        return shape if length is None else (*shape[:2], length, *shape[3:])

    shapes = (shape_of(query, query_length), shape_of(key, kv_length), shape_of(value, kv_length))
    requires_grad = any(t.requires_grad for t in (query, key, value))  # some checks read it (with the grad mode)
    choice = _sdp_choice(shapes, query.dtype, query.device, is_causal, scale, requires_grad)
    if query.device.type == "cpu":
        return _KERNELS["flash_cpu"] if choice == _FLASH else _KERNELS["math"]
    by_choice = {_FLASH: "flash", _EFFICIENT: "efficient", _CUDNN: "cudnn"}
    return _KERNELS[by_choice.get(choice, "math")]
