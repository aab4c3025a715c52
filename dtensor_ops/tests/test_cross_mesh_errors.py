"""DTensors of different meshes in one op: refused before any collective, with an error code written for
PyTorch catches.

PyTorch raises ``RuntimeError`` for these (an op on DTensors of two meshes; ``clip_grad_norm_`` over
gradients on two meshes, whose norms meet in one ``stack``); shardwise raised ``ValueError``. Now the
error is ``shardwise.mesh.MeshError``, which is both, so ``except RuntimeError`` and ``except ValueError``
each catch it. Checked on 4 gloo ranks against PyTorch's DTensor (an oracle in the test only).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from shardwise.testing import multi_rank

WORLD = 4


def _cases(lib: Any, flat: Any, square: Any) -> dict[str, Callable[[], Any]]:
    def on(mesh: Any) -> Any:
        placements = [lib.Shard(0)] + [lib.Replicate()] * (mesh.ndim - 1)
        return lib.distribute_tensor(torch.ones(4, 4), mesh, placements)

    def clip(foreach: bool) -> Callable[[], Any]:
        def run() -> Any:
            params = []
            for mesh in (flat, square):
                param = torch.nn.Parameter(on(mesh))
                param.grad = on(mesh)
                params.append(param)
            return torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=foreach)

        return run

    a, b = on(flat), on(square)
    return {
        "add": lambda: a + b,
        "mm": lambda: a @ b,
        "stack": lambda: torch.stack([a.sum(), b.sum()]),
        "copy_": lambda: a.clone().copy_(b),
        "clip_grad_norm_": clip(True),
        "clip_grad_norm_ without foreach": clip(False),
    }


def _raised(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return error
    return None


@multi_rank(world_size=WORLD)
def test_ops_over_two_meshes_raise_what_pytorch_raises_and_a_value_error() -> None:
    import torch.distributed.tensor as theirs
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    import shardwise.dtensor_ops as ours
    from shardwise.mesh import MeshError

    our_cases = _cases(ours, ours.init_device_mesh("cpu", (WORLD,)), ours.init_device_mesh("cpu", (2, 2)))
    their_cases = _cases(theirs, torch_init_device_mesh("cpu", (WORLD,)), torch_init_device_mesh("cpu", (2, 2)))
    for name, case in our_cases.items():
        their_error = _raised(their_cases[name])
        our_error = _raised(case)
        assert their_error is not None and isinstance(their_error, RuntimeError), (name, their_error)
        assert isinstance(our_error, MeshError), (name, our_error)
        assert isinstance(our_error, RuntimeError) and isinstance(our_error, ValueError)
        assert "different" in str(our_error) and "mesh" in str(our_error), (name, our_error)
    # Nothing was left half-done: the ranks still agree on a collective afterwards.
    flat = ours.init_device_mesh("cpu", (WORLD,))
    assert ours.distribute_tensor(torch.ones(4), flat, [ours.Shard(0)]).full_tensor().tolist() == [1.0] * 4


def test_op_schema_refuses_arguments_on_two_meshes_with_the_same_error() -> None:
    from shardwise.dtensor_ops._op_schema import OpSchema
    from shardwise.mesh import MeshError
    from shardwise.placement import DTensorSpec, Replicate, TensorMeta
    from shardwise.testing import FakeMesh

    meta = TensorMeta(torch.Size([4]), (1,), torch.float32)
    first = DTensorSpec(FakeMesh((4,)), (Replicate(),), meta)
    second = DTensorSpec(FakeMesh((2, 2)), (Replicate(), Replicate()), meta)
    schema = OpSchema(torch.ops.aten.add.Tensor, (first, second), {})
    with pytest.raises(RuntimeError, match="cross-mesh") as caught:
        schema.get_mesh_from_args()
    assert isinstance(caught.value, (MeshError, ValueError))
    assert schema.get_mesh_from_args(validate=False) == first.mesh
