"""Convolution of an input sharded on a spatial dim: halo exchange (rank threads, 1-D mesh of 4).

The output stays sharded on that dim, equals plain torch's on the full tensors (stride, padding,
dilation, groups, bias; uneven shards, shards narrower than the halo, empty shards), and costs
exactly ONE all_to_all_single. Gradients (through convolution_backward's rule) equal plain torch's.
PyTorch's DTensor convolves each shard alone here (wrong at the edges).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import DeviceMesh
from shardwise.testing import run_on_threads

_WORLD = 4
_funcol = torch.ops._c10d_functional

# (input shape, weight shape, sharded dim, keyword arguments)
_CASES: dict[str, tuple[tuple[int, ...], tuple[int, ...], int, dict[str, Any]]] = {
    "1d_plain": ((2, 3, 13), (4, 3, 3), 2, {}),
    "1d_padded": ((2, 3, 13), (4, 3, 3), 2, {"padding": 1}),
    "1d_stride_dilation": ((1, 2, 17), (3, 2, 3), 2, {"stride": 2, "padding": 2, "dilation": 2}),
    "1d_wide_kernel": ((1, 2, 9), (2, 2, 7), 2, {"padding": 3}),  # halo wider than a shard of 3 rows
    "1d_short": ((1, 1, 5), (1, 1, 3), 2, {"padding": 1}),  # shards of 2, 2, 1, 0 rows
    "2d_rows": ((2, 4, 10, 6), (6, 2, 3, 3), 2, {"padding": 1, "groups": 2}),
    "2d_columns": ((1, 3, 5, 11), (2, 3, 2, 4), 3, {"stride": (1, 3), "padding": (0, 2)}),
    "3d_depth": ((1, 1, 9, 4, 4), (2, 1, 3, 2, 2), 2, {"padding": (1, 0, 1)}),
}


def _convolve(case: str, bias: bool) -> None:
    mesh = DeviceMesh("cpu", list(range(_WORLD)))
    x_shape, w_shape, dim, options = _CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    full_x = torch.randn(x_shape, generator=generator)
    full_w = torch.randn(w_shape, generator=generator)
    full_b = torch.randn(w_shape[0], generator=generator) if bias else None
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[len(x_shape)]
    expected = conv(full_x, full_w, full_b, **options)

    x = distribute_tensor(full_x, mesh, [Shard(dim)]).requires_grad_(True)
    w = distribute_tensor(full_w, mesh, [Replicate()]).requires_grad_(True)
    b = None if full_b is None else distribute_tensor(full_b, mesh, [Replicate()]).requires_grad_(True)
    with CommDebugMode() as comm:
        out = conv(x, w, b, **options)
    assert isinstance(out, DTensor) and out.placements == (Shard(dim),)
    assert comm.get_comm_counts() == {_funcol.all_to_all_single: 1}
    torch.testing.assert_close(out.full_tensor(), expected)

    weights = torch.cos(torch.arange(expected.numel(), dtype=torch.float32)).reshape(expected.shape)
    reference = [full_x.clone().requires_grad_(True), full_w.clone().requires_grad_(True)]
    if full_b is not None:
        reference.append(full_b.clone().requires_grad_(True))
    ref_out = conv(reference[0], reference[1], reference[2] if full_b is not None else None, **options)
    ref_grads = torch.autograd.grad((ref_out * weights).sum(), reference)
    leaves = [x, w] + ([b] if b is not None else [])
    grads = torch.autograd.grad((out.full_tensor() * weights).sum(), leaves)
    for got, want in zip(grads, ref_grads, strict=True):
        assert isinstance(got, DTensor)
        torch.testing.assert_close(got.full_tensor(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_spatially_sharded_convolution_exchanges_halos(case: str, bias: bool) -> None:
    run_on_threads(_convolve, case, bias, world_size=_WORLD)


def _other_layouts_go_to_the_rule() -> None:
    mesh = DeviceMesh("cpu", list(range(_WORLD)))
    generator = torch.Generator().manual_seed(7)
    full_x = torch.randn(4, 3, 8, generator=generator)
    full_w = torch.randn(5, 3, 3, generator=generator)
    # A batch shard is the rule's (no communication); a sharded weight is the rule's too.
    x = distribute_tensor(full_x, mesh, [Shard(0)])
    w = distribute_tensor(full_w, mesh, [Replicate()])
    with CommDebugMode() as comm:
        out = F.conv1d(x, w, padding=1)
    assert out.placements == (Shard(0),) and comm.get_total_counts() == 0
    torch.testing.assert_close(out.full_tensor(), F.conv1d(full_x, full_w, padding=1))
    # Bad arguments: torch's error from the meta run, before the exchange.
    spatial = distribute_tensor(full_x, mesh, [Shard(2)])
    bad_w = distribute_tensor(torch.randn(5, 2, 3), mesh, [Replicate()])
    with CommDebugMode() as comm:
        with pytest.raises(RuntimeError, match="channel"):
            F.conv1d(spatial, bad_w)
    assert comm.get_total_counts() == 0


def test_other_layouts_go_to_the_rule_and_bad_arguments_fail_first() -> None:
    run_on_threads(_other_layouts_go_to_the_rule, world_size=_WORLD)
