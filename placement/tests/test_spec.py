from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from shardwise.placement import DTensorSpec, MeshLike, Partial, Replicate, Shard, TensorMeta
from shardwise.testing import FakeMesh


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> TensorMeta:
    return TensorMeta(torch.Size(shape), torch.empty(shape).stride(), dtype)


MESH_2X3 = FakeMesh((2, 3), coordinate=(1, 2))


def test_fake_mesh_satisfies_the_mesh_protocol() -> None:
    assert isinstance(MESH_2X3, MeshLike)


def test_attributes_and_metadata_properties() -> None:
    spec = DTensorSpec(MESH_2X3, [Shard(0), Replicate()], meta(4, 6))
    assert spec.mesh is MESH_2X3 and spec.device_mesh is MESH_2X3
    assert spec.placements == (Shard(0), Replicate()) and isinstance(spec.placements, tuple)
    assert spec.shape == torch.Size([4, 6]) and spec.stride == (6, 1) and spec.ndim == 2
    assert spec.dtype == torch.float32


def test_negative_shard_dims_are_stored_normalised_once_ndim_is_known() -> None:
    spec = DTensorSpec(MESH_2X3, (Shard(-1), Shard(-3)), meta(2, 3, 4))
    assert spec.placements == (Shard(2), Shard(0))
    assert spec == DTensorSpec(MESH_2X3, (Shard(2), Shard(0)), meta(2, 3, 4))
    without_meta = DTensorSpec(MESH_2X3, (Shard(-1), Replicate()))
    assert without_meta.placements == (Shard(-1), Replicate())


def test_wrong_number_of_placements_names_both_counts() -> None:
    with pytest.raises(ValueError, match=r"DTensorSpec got 1 placements \(Shard\(dim=0\),\) for a 2-D mesh of shape \(2, 3\)"):
        DTensorSpec(MESH_2X3, [Shard(0)])
    with pytest.raises(ValueError, match="got 3 placements"):
        DTensorSpec(MESH_2X3, [Shard(0), Replicate(), Replicate()], meta(4))


def test_shard_dim_out_of_range_for_tensor_meta_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"Shard\(dim=2\) on mesh dim 1 is out of range for a tensor with 2 dims \(shape \(4, 6\)\); expected a dim in \[-2, 1\]"):
        DTensorSpec(MESH_2X3, [Replicate(), Shard(2)], meta(4, 6))
    with pytest.raises(ValueError, match=r"Shard\(dim=-3\) on mesh dim 0"):
        DTensorSpec(MESH_2X3, [Shard(-3), Replicate()], meta(4, 6))
    with pytest.raises(ValueError, match="a 0-dim tensor cannot be sharded"):
        DTensorSpec(MESH_2X3, [Shard(0), Replicate()], meta())


def test_non_placements_and_bad_meta_are_type_errors() -> None:
    with pytest.raises(TypeError, match=r"placements\[1\] is 'R' of type str; expected a Placement"):
        DTensorSpec(MESH_2X3, [Shard(0), "R"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="tensor_meta must be a TensorMeta or None, got tuple"):
        DTensorSpec(MESH_2X3, [Shard(0), Replicate()], (torch.Size([2]), (1,), torch.float32))  # type: ignore[arg-type]


def test_layout_queries() -> None:
    spec = DTensorSpec(FakeMesh((2, 3, 4, 5)), [Shard(1), Partial("max"), Shard(1), Shard(0)], meta(8, 9, 2))
    assert spec.num_shards == 2 * 4 * 5
    assert spec.num_shards_per_dim == (5, 8, 1)
    assert spec.shard_mesh_dims(1) == (0, 2) and spec.shard_mesh_dims(-2) == (0, 2)
    assert spec.shard_mesh_dims(0) == (3,) and spec.shard_mesh_dims(2) == ()
    assert spec.partial_mesh_dims == (1,)
    assert spec.is_sharded() and spec.has_partial() and not spec.is_replicated()


def test_predicates_on_simple_specs() -> None:
    replicated = DTensorSpec(MESH_2X3, [Replicate(), Replicate()], meta(3))
    assert replicated.is_replicated() and not replicated.is_sharded() and not replicated.has_partial()
    assert replicated.num_shards == 1 and replicated.num_shards_per_dim == (1,) and replicated.partial_mesh_dims == ()
    partial = DTensorSpec(MESH_2X3, [Partial(), Partial("avg")])
    assert partial.has_partial() and partial.partial_mesh_dims == (0, 1) and not partial.is_sharded()
    sharded_on_size_one = DTensorSpec(FakeMesh((1,)), [Shard(0)], meta(3))
    assert sharded_on_size_one.is_sharded() and sharded_on_size_one.num_shards == 1


def test_metadata_needs_tensor_meta() -> None:
    spec = DTensorSpec(MESH_2X3, [Shard(0), Replicate()])
    for name in ("shape", "stride", "ndim", "dtype", "num_shards_per_dim"):
        with pytest.raises(ValueError, match=r"Spec\(S\(0\)R\): .* is unknown because this DTensorSpec has no tensor_meta"):
            getattr(spec, name)
    assert spec.num_shards == 2


def test_local_shape_and_offset_uses_the_mesh_coordinate_by_default() -> None:
    spec = DTensorSpec(MESH_2X3, [Shard(0), Shard(0)], meta(10, 4))
    # Coordinate (1, 2): second half of 10 rows (5..9), then its third of three pieces (2, 2, 1).
    assert spec.local_shape_and_offset() == ((1, 4), (9, 0))
    assert spec.local_shape() == (1, 4)
    assert spec.local_shape_and_offset((0, 1)) == ((2, 4), (2, 0))
    outside = DTensorSpec(FakeMesh((2, 3), coordinate=None), [Shard(0), Shard(0)], meta(10, 4))
    assert outside.local_shape_and_offset() == ((0, 0), (10, 4))


def test_equal_by_value_and_hash_agrees() -> None:
    first = DTensorSpec(FakeMesh((2, 3)), [Shard(-1), Partial()], meta(4, 6))
    second = DTensorSpec(FakeMesh((2, 3)), (Shard(1), Partial("sum")), meta(4, 6))
    assert first == second and hash(first) == hash(second)
    different = [
        DTensorSpec(FakeMesh((2, 3), dim_names=("dp", "tp")), [Shard(1), Partial()], meta(4, 6)),
        DTensorSpec(FakeMesh((3, 2)), [Shard(1), Partial()], meta(4, 6)),
        DTensorSpec(FakeMesh((2, 3)), [Shard(0), Partial()], meta(4, 6)),
        DTensorSpec(FakeMesh((2, 3)), [Shard(1), Partial("max")], meta(4, 6)),
        DTensorSpec(FakeMesh((2, 3)), [Shard(1), Partial()], meta(4, 7)),
        DTensorSpec(FakeMesh((2, 3)), [Shard(1), Partial()], meta(4, 6, dtype=torch.float16)),
        DTensorSpec(FakeMesh((2, 3)), [Shard(1), Partial()]),
    ]
    for other in different:
        assert first != other
    assert len({first, second, *different}) == 1 + len(different)
    assert first != (Shard(1), Partial())


def test_hash_is_computed_once_at_construction() -> None:
    class CountingMesh(FakeMesh):
        hashes = 0

        def __hash__(self) -> int:
            CountingMesh.hashes += 1
            return super().__hash__()

    spec = DTensorSpec(CountingMesh((2,)), [Shard(0)], meta(4))
    after_construction = CountingMesh.hashes
    for _ in range(5):
        hash(spec)
        _ = {spec: 1}[spec]
    assert CountingMesh.hashes == after_construction


def test_specs_are_immutable() -> None:
    spec = DTensorSpec(MESH_2X3, [Shard(0), Replicate()], meta(4, 6))
    with pytest.raises(AttributeError, match="DTensorSpec is immutable"):
        spec.placements = (Replicate(), Replicate())
    with pytest.raises(AttributeError, match="DTensorSpec is immutable"):
        del spec.tensor_meta


def test_with_placements_and_with_tensor_meta_make_new_validated_specs() -> None:
    spec = DTensorSpec(MESH_2X3, [Shard(0), Replicate()], meta(4, 6))
    moved = spec.with_placements([Replicate(), Shard(-1)])
    assert moved.placements == (Replicate(), Shard(1)) and moved.tensor_meta == spec.tensor_meta
    assert spec.placements == (Shard(0), Replicate())
    assert spec.with_tensor_meta(None).tensor_meta is None
    with pytest.raises(ValueError, match="out of range"):
        spec.with_tensor_meta(meta())


def test_pickle_round_trip() -> None:
    for spec in [
        DTensorSpec(MESH_2X3, [Shard(1), Partial("min")], meta(4, 6)),
        DTensorSpec(MESH_2X3, [Replicate(), Shard(-1)]),
    ]:
        restored: DTensorSpec[Any] = pickle.loads(pickle.dumps(spec))
        assert restored == spec and hash(restored) == hash(spec)
        assert restored.placements == spec.placements


def test_repr_and_str_are_readable() -> None:
    spec = DTensorSpec(FakeMesh((2,)), [Shard(0)], meta(4, 6))
    assert repr(spec) == (
        "DTensorSpec(mesh=FakeMesh(shape=(2,), coordinate=(0,)), placements=(Shard(dim=0),), "
        "tensor_meta=TensorMeta(shape=torch.Size([4, 6]), stride=(6, 1), dtype=torch.float32))"
    )
    assert str(spec) == "Spec(S(0) on (4, 6))"
    assert str(DTensorSpec(MESH_2X3, [Partial(), Replicate()])) == "Spec(P(sum)R)"


def test_tensor_meta_is_a_hashable_named_tuple() -> None:
    first = TensorMeta(shape=torch.Size([2, 3]), stride=(3, 1), dtype=torch.int32)
    assert first == meta(2, 3, dtype=torch.int32) and hash(first) == hash(meta(2, 3, dtype=torch.int32))
    assert first.shape == torch.Size([2, 3]) and first.stride == (3, 1) and first.dtype == torch.int32
    assert pickle.loads(pickle.dumps(first)) == first


def test_partial_avg_needs_a_dtype_that_can_hold_a_mean() -> None:
    mesh = FakeMesh((2, 4), (0, 1))
    shape, stride = torch.Size([4, 3]), (3, 1)
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
        with pytest.raises(ValueError) as raised:
            DTensorSpec(mesh, (Replicate(), Partial("avg")), TensorMeta(shape, stride, dtype))
        message = str(raised.value)
        assert "Partial('avg') on mesh dim 1" in message and str(dtype) in message
        assert "floating-point or complex dtype" in message and "truncated" in message
    # Floating and complex dtypes average fine; the other reductions of integers are exact.
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64):
        DTensorSpec(mesh, (Partial("avg"), Partial("avg")), TensorMeta(shape, stride, dtype))
    for reduce_op in ("sum", "max", "min"):
        DTensorSpec(mesh, (Partial(reduce_op), Replicate()), TensorMeta(shape, stride, torch.int64))
    # Without tensor metadata there is no dtype to check yet.
    DTensorSpec(mesh, (Partial("avg"), Shard(0)))
    spec = DTensorSpec(mesh, (Partial("avg"), Shard(0)))
    with pytest.raises(ValueError, match="floating-point"):
        spec.with_tensor_meta(TensorMeta(shape, stride, torch.int16))


def test_dim_map_sums_and_num_shards_map_describe_the_layout() -> None:
    spec = DTensorSpec(MESH_2X3, [Partial(), Shard(1)], meta(4, 6, 5))
    assert spec.dim_map == [-1, 1, -1]
    assert spec.sums == [0]
    assert spec.num_shards_map == [1, 3, 1]
    replicated = DTensorSpec(MESH_2X3, [Replicate(), Replicate()], meta(4, 6))
    assert replicated.dim_map == [-1, -1] and replicated.sums == [] and replicated.num_shards_map == [1, 1]


def test_dim_map_of_a_dim_sharded_twice_names_both_mesh_dims() -> None:
    spec = DTensorSpec(MESH_2X3, [Shard(0), Shard(0)], meta(12, 2))
    assert spec.num_shards_map == [6, 1]
    with pytest.raises(ValueError, match="tensor dim 0 is sharded on mesh dims 0 and 1"):
        spec.dim_map


def test_from_dim_map_round_trips_and_refuses_conflicts() -> None:
    spec = DTensorSpec.from_dim_map(MESH_2X3, [1, -1, 0], [], meta(6, 2, 4))
    assert spec.placements == (Shard(2), Shard(0))
    assert spec.dim_map == [1, -1, 0]
    with_sum = DTensorSpec.from_dim_map(MESH_2X3, [-1, 1], [0])
    assert with_sum.placements == (Partial(), Shard(1)) and with_sum.sums == [0]
    with pytest.raises(RuntimeError, match="cannot shard both tensor dims 0 and 1"):
        DTensorSpec.from_dim_map(MESH_2X3, [0, 0], [])
    with pytest.raises(RuntimeError, match="either Partial or Shard"):
        DTensorSpec.from_dim_map(MESH_2X3, [0, -1], [0])
