"""distribute_tensor, distribute_module, implicit_replication and the torch.Tensor/DTensor mixing error.

Errors that must be raised before any collective are exercised on rank 0 only:
if they communicated, rank 0 would wait for ranks that never join and the test
would time out.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.dtensor_ops import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    init_device_mesh,
)
from shardwise.dtensor_ops.experimental import implicit_replication
from shardwise.placement import Placement
from shardwise.testing import multi_rank


def chunk_oracle(full: torch.Tensor, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Placement, ...]) -> torch.Tensor:
    """The shard at ``coordinate``: torch.chunk per sharding mesh dim, left to right, empty trailing pieces."""
    piece = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            count = mesh_shape[mesh_dim]
            chunks = list(torch.chunk(piece, count, dim=placement.dim))
            while len(chunks) < count:
                chunks.append(piece.narrow(placement.dim, piece.size(placement.dim), 0))
            piece = chunks[coordinate[mesh_dim]]
    return piece


def as_dtensor(value: object) -> DTensor:
    """``value``, checked to be a DTensor (ops on DTensors are typed as returning torch.Tensor)."""
    assert isinstance(value, DTensor), type(value)
    return value


def linear_at(model: nn.Module, index: int) -> nn.Linear:
    layer = model.get_submodule(f"seq.{index}")
    assert isinstance(layer, nn.Linear)
    return layer


class MyModel(nn.Module):
    def __init__(self, n_features: int, n_layers: int, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.seq = nn.Sequential(*[nn.Linear(n_features, n_features, device=device) for _ in range(n_layers)])
        self.register_buffer("steps", torch.zeros((), device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)


@multi_rank
def test_distribute_tensor_layouts_and_leaves() -> None:
    mesh = init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    for requires_grad in (True, False):
        full = torch.randn(12, 3, requires_grad=requires_grad)
        dt = distribute_tensor(full, mesh, [Shard(0)])
        assert dt.size() == torch.Size([12, 3]) and dt.to_local().size() == torch.Size([3, 3])
        assert dt.requires_grad == requires_grad and dt.is_leaf
    dt = distribute_tensor(torch.randn(3, 12), mesh, [Shard(-1)])
    assert dt.placements[0] == Shard(1)

    # Uneven sizes (seed 004): torch.chunk pieces, trailing ones smaller or empty.
    for size, dim in (((13, 3, 3), 0), ((14, 3, 3), 0), ((3, 13, 3), 1), ((3, 14, 3), 1), ((3, 3, 13), 2), ((3, 3, 14), 2), ((2, 3), 0)):
        torch.manual_seed(3)
        full = torch.randn(size)
        dt = distribute_tensor(full, mesh, [Shard(dim)])
        assert dt.size() == full.size()
        assert torch.equal(dt.to_local(), chunk_oracle(full, (4,), (rank,), (Shard(dim),))), (size, dim)
        assert torch.equal(dt.full_tensor(), full)

    # The result owns its data: it never aliases the input.
    source = torch.ones(4)
    replicated = distribute_tensor(source, mesh)
    source.add_(1)
    assert replicated.to_local().tolist() == [1.0] * 4 and replicated.placements == (Replicate(),)

    # 2-D mesh, including nested and uneven sharding; the default mesh comes from `with mesh:`.
    mesh_2d = init_device_mesh("cpu", (2, 2))
    coordinate = tuple(mesh_2d.get_coordinate() or ())
    for shape, placements in (((6, 5), (Shard(0), Shard(1))), ((7, 2), (Shard(0), Shard(0))), ((3, 5), (Replicate(), Shard(1))), ((5, 4), (Shard(1), Replicate()))):
        torch.manual_seed(5)
        full = torch.randn(shape)
        with mesh_2d:
            dt = distribute_tensor(full, placements=placements)
        assert dt.device_mesh == mesh_2d
        assert torch.equal(dt.to_local(), chunk_oracle(full, (2, 2), coordinate, placements)), placements
        assert torch.equal(dt.full_tensor(), full)

    # Partial: the reduction of the pieces is the input.
    partial = distribute_tensor(torch.full((3,), 8.0), mesh, [Partial()])
    assert partial.placements == (Partial(),) and partial.full_tensor().tolist() == [8.0, 8.0, 8.0]


@multi_rank
def test_distribute_tensor_src_data_rank() -> None:
    mesh = init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    # Every rank holds different data; the layout must come from one rank only.
    torch.manual_seed(100 + rank)
    mine = torch.randn(9, 2)
    everyone = [torch.empty(9, 2) for _ in range(4)]
    dist.all_gather(everyone, mine)

    for placements in ((Shard(0),), (Replicate(),), (Shard(1),)):
        from_zero = distribute_tensor(mine, mesh, placements)
        assert torch.equal(from_zero.to_local(), chunk_oracle(everyone[0], (4,), (rank,), placements))
        from_two = distribute_tensor(mine, mesh, placements, src_data_rank=2)
        assert torch.equal(from_two.to_local(), chunk_oracle(everyone[2], (4,), (rank,), placements))
        # None: no communication, every rank cuts its own tensor.
        own = distribute_tensor(mine, mesh, placements, src_data_rank=None)
        assert torch.equal(own.to_local(), chunk_oracle(mine, (4,), (rank,), placements))

    # 2-D: the data comes from index src along every mesh dim, i.e. from one rank of the mesh.
    mesh_2d = init_device_mesh("cpu", (2, 2))
    coordinate = tuple(mesh_2d.get_coordinate() or ())
    for src, source_rank in ((0, 0), (1, 3)):
        layouts_2d: tuple[tuple[Placement, ...], ...] = (
            (Shard(0), Shard(1)),
            (Replicate(), Shard(0)),
            (Shard(1), Replicate()),
            (Replicate(), Replicate()),
        )
        for layout in layouts_2d:
            dt = distribute_tensor(mine, mesh_2d, layout, src_data_rank=src)
            expected = chunk_oracle(everyone[source_rank], (2, 2), coordinate, layout)
            assert torch.equal(dt.to_local(), expected), (src, layout)

    # Dtypes gloo cannot carry natively travel as raw bytes.
    flags = distribute_tensor(torch.tensor([rank % 2 == 0] * 5), mesh, [Shard(0)])
    assert flags.full_tensor().tolist() == [True] * 5
    complex_values = distribute_tensor(torch.full((4,), complex(rank, 1)), mesh, [Shard(0)])
    assert complex_values.full_tensor().tolist() == [complex(0, 1)] * 4

    if rank == 0:
        with pytest.raises(ValueError, match="src_data_rank"):
            distribute_tensor(mine, mesh, [Shard(0)], src_data_rank=4)
    dist.barrier()


@multi_rank
def test_distribute_tensor_errors_before_any_collective() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    tensor = torch.randn(12, 12)
    dtensor = distribute_tensor(tensor, mesh, [Shard(0), Shard(1)])
    new_mesh = init_device_mesh("cpu", (4,))
    if dist.get_rank() == 0:
        with pytest.raises(ValueError, match="must have the same length"):
            distribute_tensor(tensor, mesh, [Shard(0)])
        with pytest.raises(RuntimeError, match="distribute leaf tensor"):
            distribute_tensor(torch.randn(12, 12, requires_grad=True) + 2, mesh, [Shard(0), Shard(0)])
        # A non-leaf is refused first, as by PyTorch's, even when its placements are wrong too.
        with pytest.raises(RuntimeError, match="distribute leaf tensor"):
            distribute_tensor(torch.randn(12, 12, requires_grad=True) + 2, mesh, [Shard(0)])
        with pytest.raises(ValueError, match="to a different device mesh"):
            distribute_tensor(dtensor, new_mesh, [Shard(0)])
        with pytest.raises(ValueError, match="to a different placements"):
            distribute_tensor(dtensor, mesh, [Shard(0), Replicate()])
        with pytest.raises(ValueError, match="out of range"):
            distribute_tensor(tensor, mesh, [Shard(2), Replicate()])
        with pytest.raises(RuntimeError, match="no device_mesh"):
            distribute_tensor(tensor, placements=[Shard(0)])
        # The same DTensor, same placements: returned as is.
        assert distribute_tensor(dtensor, mesh, [Shard(0), Shard(-1)]) is dtensor
    dist.barrier()


@multi_rank
def test_distribute_module_hooks_and_replication() -> None:
    mesh = init_device_mesh("cpu", (4,))

    # Default: every parameter and buffer becomes a replicated DTensor; requires_grad is kept.
    model = MyModel(4, 2)
    linear_at(model, 1).bias.requires_grad_(False)
    originals = {name: param.detach().clone() for name, param in model.named_parameters()}
    distributed = distribute_module(model, mesh)
    assert distributed is model
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and isinstance(param, nn.Parameter), name
        assert param.placements == (Replicate(),)
        assert torch.equal(param.to_local(), originals[name])
    assert linear_at(model, 1).bias.requires_grad is False and linear_at(model, 0).weight.requires_grad
    assert isinstance(model.steps, DTensor) and model.steps.placements == (Replicate(),)
    with pytest.raises(RuntimeError, match="only be called once"):
        distribute_module(model, mesh)

    # input_fn / output_fn with the (module, values, mesh) signature.
    module = MyModel(20, 1)
    calls: list[str] = []

    def input_fn(mod: nn.Module, inputs: tuple[torch.Tensor, ...], device_mesh: object) -> DTensor:
        calls.append("in")
        return DTensor.from_local(inputs[0], device_mesh, [Shard(0)])  # type: ignore[arg-type]

    def output_fn(mod: nn.Module, outputs: torch.Tensor, device_mesh: object) -> torch.Tensor:
        calls.append("out")
        assert isinstance(outputs, DTensor)
        return outputs.to_local()

    replica = distribute_module(module, mesh, input_fn=input_fn, output_fn=output_fn)
    local_out = replica(torch.randn(5, 20))
    assert calls == ["in", "out"]
    assert isinstance(local_out, torch.Tensor) and not isinstance(local_out, DTensor)
    assert local_out.shape == (5, 20)

    # The deprecated (values, mesh) signature still works, with a FutureWarning.
    def legacy_input_fn(inputs: tuple[torch.Tensor, ...], device_mesh: object) -> DTensor:
        return DTensor.from_local(inputs[0], device_mesh, [Shard(0)])  # type: ignore[arg-type]

    def legacy_output_fn(outputs: torch.Tensor, device_mesh: object) -> torch.Tensor:
        assert isinstance(outputs, DTensor)
        return outputs.to_local()

    with pytest.warns(FutureWarning, match="Deprecating"):
        legacy = distribute_module(MyModel(20, 1), mesh, input_fn=legacy_input_fn, output_fn=legacy_output_fn)
    legacy_out = legacy(torch.randn(5, 20))
    assert type(legacy_out) is torch.Tensor and legacy_out.shape == (5, 20)

    with pytest.raises(ValueError, match="input_fn must take"):
        distribute_module(MyModel(2, 1), mesh, input_fn=lambda x: x)

    # A partition_fn lays out what it wants; the rest is replicated.
    def shard_weights(name: str, mod: nn.Module, device_mesh: object) -> None:
        if isinstance(mod, nn.Linear):
            mod.register_parameter("weight", nn.Parameter(distribute_tensor(mod.weight, device_mesh, [Shard(0)])))  # type: ignore[arg-type]

    partitioned = distribute_module(MyModel(8, 1), mesh, shard_weights)
    linear = linear_at(partitioned, 0)
    assert as_dtensor(linear.weight).placements == (Shard(0),) and as_dtensor(linear.bias).placements == (Replicate(),)


@multi_rank
def test_distribute_module_training_casting_and_meta() -> None:
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    reference = MyModel(10, 1)
    model = MyModel(10, 1)
    model.load_state_dict(reference.state_dict())

    def replicate_input_fn(mod: nn.Module, inputs: tuple[torch.Tensor, ...], device_mesh: object) -> DTensor:
        return DTensor.from_local(inputs[0], device_mesh, [Replicate()])  # type: ignore[arg-type]

    replica = distribute_module(model, mesh, input_fn=replicate_input_fn)
    x = torch.randn(10, 10, requires_grad=True)
    out = replica(x)
    assert isinstance(out, DTensor)
    out.full_tensor().sum().backward()
    expected_out = reference(x)
    expected_out.sum().backward()
    assert torch.allclose(out.full_tensor(), expected_out)
    weight_grad = as_dtensor(linear_at(replica, 0).weight.grad)
    assert weight_grad.placements == (Replicate(),)
    expected_grad = linear_at(reference, 0).weight.grad
    assert expected_grad is not None and torch.allclose(weight_grad.full_tensor(), expected_grad)

    # Casting: DTensor.to(dtype), module.to(dtype), autocast.
    dt = as_dtensor(DTensor.from_local(torch.rand(10), mesh, [Replicate()]).to(torch.bfloat16))
    assert dt.dtype == torch.bfloat16 and dt._local_tensor.dtype == torch.bfloat16
    dt = as_dtensor(distribute_tensor(torch.rand(10), mesh, [Replicate()]).to(torch.bfloat16))
    assert dt.dtype == torch.bfloat16 and dt._local_tensor.dtype == torch.bfloat16
    plain = distribute_module(MyModel(10, 1), mesh)
    plain = plain.to(torch.bfloat16)
    plain_weight = as_dtensor(linear_at(plain, 0).weight)
    assert plain_weight.dtype == torch.bfloat16 and plain_weight._local_tensor.dtype == torch.bfloat16
    fresh = distribute_module(MyModel(10, 1), mesh)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        output = as_dtensor(fresh(distribute_tensor(torch.rand(10), mesh, [Replicate()])))
    assert output.dtype == torch.bfloat16 and output._local_tensor.dtype == torch.bfloat16

    # A meta-device model is materialised shard by shard in partition_fn.
    meta_model = MyModel(20, 2, device="meta")

    def shard_fn(name: str, module: nn.Module, device_mesh: object) -> None:
        for param_name, param in list(module._parameters.items()):
            assert param is not None
            dist_param = distribute_tensor(param, device_mesh, [Shard(0)])  # type: ignore[arg-type]
            assert dist_param.is_meta
            materialised = torch.empty_like(dist_param, device="cpu")
            module.register_parameter(param_name, nn.Parameter(materialised))

    sharded = distribute_module(meta_model, mesh, shard_fn)
    for param in sharded.parameters():
        assert isinstance(param, DTensor) and not param.is_meta and param.device.type == "cpu"
        assert param.placements == (Shard(0),)
        assert param.to_local().shape[0] == param.shape[0] // 4


@multi_rank
def test_mixing_plain_tensors_and_implicit_replication() -> None:
    mesh = init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    full = torch.arange(8.0).reshape(4, 2)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    plain = torch.ones(4, 2)
    if rank == 0:
        with pytest.raises(RuntimeError, match=r"aten\.add\.Tensor.*mixed torch\.Tensor and DTensor.*implicit_replication"):
            dt + plain
    dist.barrier()
    with implicit_replication():
        mixed = dt + plain
    assert torch.equal(as_dtensor(mixed).full_tensor(), full + plain)
    # Python scalars (0-dim wrapped tensors) and 0-dim tensors are always fine.
    assert torch.equal(as_dtensor(dt * 2).full_tensor(), full * 2)
    assert torch.equal(as_dtensor(dt + torch.tensor(3.0)).full_tensor(), full + 3)
    # A one-element tensor is accepted with a warning (as PyTorch), treated as replicated.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shifted = dt + torch.tensor([1.0])
    assert any("one element" in str(w.message) for w in caught)
    assert torch.equal(as_dtensor(shifted).full_tensor(), full + 1)
    # The context is re-exported where PyTorch has it.
    import shardwise.dtensor_ops._api as api

    assert api.implicit_replication is implicit_replication


@multi_rank
def test_distribute_tensor_takes_the_source_tensor_whatever_the_others_hold() -> None:
    # Ranks passing tensors of other shapes or dtypes than the source is a user error, but the
    # result must be the source's tensor on every rank: never memory that nobody wrote (collectives
    # sized from each rank's own shape receive too little into too much), never a gloo crash.
    mesh = init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    source = torch.arange(16.0).reshape(8, 2)
    others = {1: torch.full((12, 2), float("nan")), 2: torch.full((4, 2), float("nan")), 3: torch.zeros(3, 8, 3, dtype=torch.int64)}
    mine = source if rank == 0 else others[rank]
    for placements in ((Shard(0),), (Shard(1),), (Replicate(),), (Partial(),)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dt = distribute_tensor(mine, mesh, placements)
        assert (dt.shape, dt.dtype, dt.stride()) == (source.shape, source.dtype, source.stride()), placements
        assert torch.equal(dt.full_tensor(), source), placements
        if not isinstance(placements[0], Partial):
            assert torch.equal(dt.to_local(), chunk_oracle(source, (4,), (rank,), placements)), placements
        mismatch = [w for w in caught if "the result is the source's tensor" in str(w.message)]
        assert len(mismatch) == (0 if rank == 0 else 1), (placements, [str(w.message) for w in caught])
        if rank != 0:
            assert mismatch[0].filename == __file__  # the warning points at the caller's line

    # 2-D, source index 1 along both dims (global rank 3); ranks disagree on the layout too: the
    # source's global stride (here transposed) is what every rank reports.
    mesh_2d = init_device_mesh("cpu", (2, 2))
    coordinate = tuple(mesh_2d.get_coordinate() or ())
    truth = torch.arange(30.0).reshape(5, 6)
    held = truth.t().contiguous().t() if rank == 3 else torch.full((7, 3), float("nan"))
    for layout in ((Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Replicate()), (Replicate(), Replicate())):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dt = distribute_tensor(held, mesh_2d, layout, src_data_rank=1)
        assert dt.shape == truth.shape and dt.stride() == (1, 5), (layout, dt.stride())
        assert torch.equal(dt.to_local(), chunk_oracle(truth, (2, 2), coordinate, layout)), layout

    # More dims than the metadata carries inline, and a different number of dims elsewhere.
    many = torch.arange(6.0).reshape(2, *([1] * 16), 3)
    held_many = many if rank == 0 else torch.full((5,) * 3, float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dt = distribute_tensor(held_many, mesh, [Shard(-1)])
    assert dt.shape == many.shape and torch.equal(dt.full_tensor(), many)


@multi_rank
def test_partial_avg_refuses_integer_dtypes_instead_of_truncating() -> None:
    mesh = init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    # The mean of 0, 1, 2, 3 is 1.5: no int64 holds it. Every rank raises alike, where the
    # placement meets the dtype.
    with pytest.raises(ValueError, match=r"Partial\('avg'\).*needs a floating-point or complex dtype, got torch.int64"):
        DTensor.from_local(torch.tensor([rank]), mesh, [Partial("avg")])
    with pytest.raises(ValueError, match=r"Partial\('avg'\).*got torch.int32"):
        DTensor.from_local(torch.tensor([rank], dtype=torch.int32), mesh, [Partial("avg")], run_check=True)
    with pytest.raises(ValueError, match=r"Partial\('avg'\).*got torch.bool"):
        distribute_tensor(torch.tensor([True]), mesh, [Partial("avg")])
    # Floating averages are exact, and converting one to an integer dtype reduces it first.
    averaged = DTensor.from_local(torch.tensor([rank + 0.5, -rank - 0.25]), mesh, [Partial("avg")])
    assert averaged.full_tensor().tolist() == [2.0, -1.75]
    as_int = averaged.to(torch.int64)
    assert as_int.dtype == torch.int64 and as_int.full_tensor().tolist() == [2, -1]
    # The other reductions of integers are exact.
    summed = DTensor.from_local(torch.tensor([rank]), mesh, [Partial("sum")])
    assert summed.full_tensor().tolist() == [6]
    assert DTensor.from_local(torch.tensor([rank]), mesh, [Partial("max")]).full_tensor().tolist() == [3]
