"""DTensorConverter on real meshes (ranks as threads: conversions run collectives)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

from shardwise.dtensor_ops import DTensor, Placement, Replicate, Shard, distribute_tensor
from shardwise.mesh import DeviceMesh
from shardwise.testing import DTensorConverter
from shardwise.testing import DTensorOpTestBase

R = Replicate()


def _s(dim: int) -> Shard:
    return Shard(dim)


class ConverterTest(DTensorOpTestBase):
    def _mesh_2x2(self) -> DeviceMesh:
        return DeviceMesh(self.device_type, torch.arange(4).reshape(2, 2))

    def test_choices_per_tensor_on_a_one_dim_mesh(self) -> None:
        mesh = self.build_device_mesh()
        converter = DTensorConverter(mesh, (), {})
        expected: list[tuple[torch.Tensor, list[Placement]]] = [
            (torch.zeros(4, 8), [R, _s(0), _s(1)]),
            (torch.zeros(4, 6), [R, _s(0)]),
            (torch.zeros(3, 5), [R]),
            (torch.zeros(1, 4), [R, _s(1)]),  # a size-1 dim is never sharded
            (torch.zeros(8, 4, dtype=torch.bool), [R]),  # bools only replicate, as PyTorch's converter
            (torch.tensor(2.0), [R]),
        ]
        for tensor, choices in expected:
            self.assertEqual(converter.gen_sharding_choices_for_arg(tensor), choices, f"shape {tuple(tensor.shape)}")
            self.assertEqual(converter.gen_placement_choices_for_arg(tensor), [(c,) for c in choices])

    def test_combinations_are_the_product_over_args_and_kwargs(self) -> None:
        mesh = self.build_device_mesh()
        args = (torch.zeros(4, 8), 3.0, [torch.zeros(4, 6)])
        kwargs = {"weight": torch.zeros(8), "scale": 2}
        converter = DTensorConverter(mesh, args, kwargs)
        self.assertEqual((converter.num_tensor_args, converter.num_combinations), (3, 3 * 2 * 2))
        seen = []
        for dist_args, dist_kwargs in converter:
            first, number, (second,) = dist_args
            self.assertEqual((number, dist_kwargs["scale"]), (3.0, 2))
            seen.append((first.placements[0], second.placements[0], dist_kwargs["weight"].placements[0]))
        self.assertEqual(seen, list(itertools.product([R, _s(0), _s(1)], [R, _s(0)], [R, _s(0)])))
        self.assertTrue(converter.successful())
        self.assertEqual((converter.hit, converter.miss), (3 * 12, 0))

    def test_two_dim_mesh_combinations_respect_nested_sharding(self) -> None:
        converter = DTensorConverter(self._mesh_2x2(), (), {})
        self.assertEqual(len(converter.gen_placement_choices_for_arg(torch.zeros(4, 8))), 9)
        # (2, 4): Shard(0) on both mesh dims would split 2 rows four ways.
        choices = converter.gen_placement_choices_for_arg(torch.zeros(2, 4))
        self.assertEqual(len(choices), 8)
        self.assertNotIn((_s(0), _s(0)), choices)
        self.assertIn((_s(1), _s(1)), choices)
        # (6, 3): 6 rows split in 2 leaves 3, which does not split again.
        self.assertEqual(
            converter.gen_placement_choices_for_arg(torch.zeros(6, 3)), [(R, R), (R, _s(0)), (_s(0), R)]
        )
        self.assertEqual(converter.gen_sharding_choices_for_arg(torch.zeros(6, 3), mesh_dim=1), [R, _s(0)])

    def test_every_yielded_dtensor_holds_the_original_values(self) -> None:
        for mesh in (self.build_device_mesh(), self._mesh_2x2()):
            full = torch.arange(32.0).reshape(4, 8)
            vector = torch.arange(8) * 3
            scalar = torch.tensor(1.5)
            converter = DTensorConverter(mesh, (full, [vector]), {"alpha": scalar})
            count = 0
            for (dist_full, (dist_vector,)), dist_kwargs in converter:
                count += 1
                for original, converted in ((full, dist_full), (vector, dist_vector), (scalar, dist_kwargs["alpha"])):
                    self.assertIsInstance(converted, DTensor)
                    self.assertTrue(torch.equal(converted.full_tensor(), original))
                self.assertEqual(dist_kwargs["alpha"].placements, (R,) * mesh.ndim)
            self.assertEqual(count, converter.num_combinations)
            self.assertTrue(converter.successful())

    def test_parameters_stay_parameters(self) -> None:
        weight = nn.Parameter(torch.ones(4, 4))
        converter = DTensorConverter(self.build_device_mesh(), (weight,), {})
        for (converted,), _ in converter:
            self.assertIsInstance(converted, nn.Parameter)
            self.assertIsInstance(converted, DTensor)
            self.assertTrue(converted.requires_grad)
        self.assertTrue(converter.successful())

    def test_complex_tensors_convert(self) -> None:
        values = torch.arange(8.0).reshape(4, 2) * (1 + 2j)
        converter = DTensorConverter(self.build_device_mesh(), (values,), {})
        for (converted,), _ in converter:
            self.assertTrue(torch.equal(converted.full_tensor(), values))
        self.assertTrue(converter.successful())

    def _unsupported_tensors(self, mesh: DeviceMesh) -> dict[str, torch.Tensor]:
        return {
            "sparse": torch.eye(4).to_sparse(),
            "sparse_csr": torch.eye(4).to_sparse_csr(),
            "quantized": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            "meta": torch.empty(4, 4, device="meta"),
            "conjugate view": torch.ones(4, dtype=torch.complex64).conj(),
            "dtensor": distribute_tensor(torch.ones(4), mesh, [R]),
        }

    # Beta / prototype / deprecation notices of these tensor kinds.
    @pytest.mark.filterwarnings("ignore::UserWarning")
    def test_unsupported_tensors_pass_through_as_misses(self) -> None:
        mesh = self.build_device_mesh()
        unsupported = self._unsupported_tensors(mesh)
        for kind, tensor in unsupported.items():
            with self.subTest(kind=kind):
                dense = torch.zeros(4, 4)
                converter = DTensorConverter(mesh, (dense, tensor), {})
                self.assertEqual(converter.num_combinations, 3, kind)  # only the dense tensor varies
                for (converted_dense, passed), _ in converter:
                    self.assertIs(passed, tensor, kind)
                    self.assertIsInstance(converted_dense, DTensor)
                self.assertEqual((converter.hit, converter.miss), (3, 3), kind)
                self.assertFalse(converter.successful(), kind)

    def test_no_tensor_means_no_success(self) -> None:
        converter = DTensorConverter(self.build_device_mesh(), (1, 2.0), {"name": "x"})
        self.assertEqual(list(converter), [((1, 2.0), {"name": "x"})])
        self.assertFalse(converter.successful())

    def test_to_dist_tensor_rejects_non_tensors(self) -> None:
        converter = DTensorConverter(self.build_device_mesh(), (), {})
        with self.assertRaisesRegex(TypeError, "can only convert tensors, got list"):
            converter.to_dist_tensor([1, 2], converter.mesh, [R])  # type: ignore[arg-type]
