"""``DTensorConverter``: every valid sharding of an op's tensor arguments, one combination at a time.

An op test runs the op once on plain tensors and then once per combination yielded here, with
each tensor argument replaced by a DTensor laid out with that combination's placements, and
compares the results. A tensor the converter cannot turn into a DTensor (sparse, quantized,
nested, meta, a tensor subclass, ...) is passed through unchanged and counted as a miss, so that
``successful()`` tells the test that the combination did not really exercise DTensor.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from shardwise.dtensor_ops import distribute_tensor
from shardwise.mesh import DeviceMesh
from shardwise.mesh._simulation import is_local_tensor
from shardwise.placement import Placement, Replicate, Shard

__all__ = ["DTensorConverter"]

PlacementChoice = tuple[Placement, ...]


class DTensorConverter:
    """Iterate over ``(args, kwargs)`` with every tensor replaced by a DTensor on ``mesh``.

    Each tensor argument may be replicated or sharded on every tensor dim whose size is evenly
    divided by the mesh dims sharding it (sizes 1 excluded); on an n-D mesh every mesh dim picks
    its own placement, and several mesh dims may shard the same tensor dim (each must divide the
    piece it receives). Bool tensors are only replicated, as in PyTorch's converter. 0-dim
    tensors are always replicated. The combinations are the cartesian product over the tensor
    arguments, in the order they appear (positional args, then kwargs), each converted lazily
    when its combination is yielded.
    """

    def __init__(self, mesh: DeviceMesh, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        self.hit = 0
        self.miss = 0
        self.mesh = mesh
        self.args = args
        self.kwargs = kwargs
        flat_args, args_spec = tree_flatten(args)
        flat_kwargs, kwargs_spec = tree_flatten(kwargs)
        self.flatten_args: list[Any] = flat_args
        self.flatten_args_spec: TreeSpec = args_spec
        self.flatten_kwargs: list[Any] = flat_kwargs
        self.flatten_kwargs_spec: TreeSpec = kwargs_spec
        choices_per_tensor = [
            self.gen_placement_choices_for_arg(leaf)
            for leaf in itertools.chain(flat_args, flat_kwargs)
            if isinstance(leaf, torch.Tensor)
        ]
        self.num_tensor_args = len(choices_per_tensor)
        self.num_combinations = math.prod(len(choices) for choices in choices_per_tensor)
        self.sharding_combs: Iterator[tuple[PlacementChoice, ...]] = itertools.product(*choices_per_tensor)

    # ------------------------------------------------------------------------------ choices

    def gen_sharding_choices_for_arg(self, arg: torch.Tensor, mesh_dim: int = 0) -> list[Placement]:
        """The placements mesh dim ``mesh_dim`` alone may give ``arg``: Replicate, then Shard(i).

        On a 1-D mesh these are exactly the choices the iterator uses for ``arg``.
        """
        if not 0 <= mesh_dim < self.mesh.ndim:
            raise IndexError(f"mesh_dim {mesh_dim} is out of range for a {self.mesh.ndim}-D mesh {self.mesh}")
        choices: list[Placement] = [Replicate()]
        if arg.dtype == torch.bool:
            return choices
        mesh_dim_size = self.mesh.shape[mesh_dim]
        choices.extend(
            Shard(dim) for dim, size in enumerate(arg.shape) if size > 1 and size % mesh_dim_size == 0
        )
        return choices

    def gen_placement_choices_for_arg(self, arg: torch.Tensor) -> list[PlacementChoice]:
        """Every placement tuple (one placement per mesh dim) that shards ``arg`` evenly.

        A tensor that cannot become a DTensor gets the single all-Replicate choice: it is passed
        through unchanged (and counted as a miss) whatever the choice.
        """
        if not _convertible(arg) or not self.is_supported_tensor(arg):
            return [(Replicate(),) * self.mesh.ndim]
        per_mesh_dim = [self.gen_sharding_choices_for_arg(arg, mesh_dim) for mesh_dim in range(self.mesh.ndim)]
        return [
            placements
            for placements in itertools.product(*per_mesh_dim)
            if self._shards_evenly(tuple(arg.shape), placements)
        ]

    def _shards_evenly(self, shape: tuple[int, ...], placements: PlacementChoice) -> bool:
        # Nested sharding: each later mesh dim splits the piece the earlier ones left.
        pieces = list(shape)
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                mesh_dim_size = self.mesh.shape[mesh_dim]
                if pieces[placement.dim] % mesh_dim_size != 0:
                    return False
                pieces[placement.dim] //= mesh_dim_size
        return True

    # ------------------------------------------------------------------------------ support

    def is_supported_tensor(self, t: torch.Tensor) -> bool:
        """Whether DTensor can carry ``t``: a dense strided tensor on a real device, not a lazy view."""
        unsupported = (
            t.layout != torch.strided,  # sparse (COO, CSR, ...) and mkldnn layouts
            t.is_mkldnn,
            t.is_quantized,
            t.is_nested,
            torch._is_functional_tensor(t),
            t.is_neg(),
            t.is_conj(),
            t.device.type in ("lazy", "meta"),
        )
        return not any(unsupported)

    def successful(self) -> bool:
        """True once at least one tensor was converted and none had to be passed through."""
        return self.hit > 0 and self.miss == 0

    # ------------------------------------------------------------------------------ iteration

    def __iter__(self) -> DTensorConverter:
        return self

    def __next__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        placements_per_tensor = iter(next(self.sharding_combs))
        new_args = [self._convert_leaf(leaf, placements_per_tensor) for leaf in self.flatten_args]
        new_kwargs = [self._convert_leaf(leaf, placements_per_tensor) for leaf in self.flatten_kwargs]
        return (
            tree_unflatten(new_args, self.flatten_args_spec),
            tree_unflatten(new_kwargs, self.flatten_kwargs_spec),
        )

    def _convert_leaf(self, leaf: object, placements_per_tensor: Iterator[PlacementChoice]) -> object:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return self.to_dist_tensor(leaf, self.mesh, next(placements_per_tensor))

    def to_dist_tensor(self, t: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
        """``t`` as a DTensor with ``placements`` (counted as a hit), or ``t`` itself (a miss).

        A 0-dim tensor is replicated whatever ``placements`` says; an ``nn.Parameter`` stays a
        Parameter (wrapping the DTensor) with the same ``requires_grad``.
        """
        if _convertible(t):
            if not self.is_supported_tensor(t):
                self.miss += 1
                return t
            self.hit += 1
            target: Sequence[Placement] = [Replicate()] * mesh.ndim if t.ndim == 0 else placements
            converted: torch.Tensor = distribute_tensor(t, mesh, target)
            if type(t) is nn.Parameter:
                converted = nn.Parameter(converted, requires_grad=t.requires_grad)
            return converted
        if torch.overrides.is_tensor_like(t):
            # Tensor subclasses (DTensor included) cannot be redistributed as plain data.
            self.miss += 1
            return t
        raise TypeError(f"DTensorConverter can only convert tensors, got {type(t).__name__}")


def _convertible(t: torch.Tensor) -> bool:
    # A LocalTensor (every simulated rank's tensor, under LocalTensorMode) is plain data too.
    return type(t) is torch.Tensor or type(t) is nn.Parameter or is_local_tensor(t)
