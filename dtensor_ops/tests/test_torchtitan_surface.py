"""What torchtitan 0.3.0 and spmd-types 0.2.3 take from ``torch.distributed.tensor``, under shardwise's names.

Every name they import or reach as an attribute (outside their tests and experiments) resolves at the
module that PyTorch's path maps to; the ones whose behaviour those programs depend on are checked
against PyTorch's own (an oracle in the test only): ``_ops._view_ops.infer_size`` / ``view_groups``
(spmd-types' checker rescales view sizes with them, on every rank's local shape, empty shards included),
``_api._FromTorchTensor`` / ``_ToTorchTensor`` (the autograd Functions behind ``from_local`` /
``to_local``, which spmd-types' checker intercepts by identity, with PyTorch's positional arguments),
and ``flex_cp_allgather`` (torchtitan's flex-attention context parallelism) on 4 gloo ranks.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import multi_rank

WORLD = 4

# PyTorch's module -> shardwise's, as the import switch maps them (module for module).
_PREFIXES = (
    ("torch.distributed.tensor.placement_types", "shardwise.placement"),
    ("torch.distributed.tensor.parallel", "shardwise.tp_styles"),
    ("torch.distributed.tensor", "shardwise.dtensor_ops"),
)

# Every (module, name) torchtitan and spmd_types import or reach (grep + AST walk of their sources).
USED_NAMES: dict[str, list[str]] = {
    "torch.distributed.tensor": [
        "DTensor", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "distribute_module",
        "distribute_tensor", "placement_types",
    ],
    "torch.distributed.tensor._api": ["_FromTorchTensor", "_ToTorchTensor", "_normalize_placements_for_grad"],
    "torch.distributed.tensor._dtensor_spec": ["DTensorSpec"],
    "torch.distributed.tensor._ops._view_ops": ["InputDim", "Split", "infer_size", "view_groups"],
    "torch.distributed.tensor._random": ["manual_seed"],
    "torch.distributed.tensor._redistribute": ["redistribute_local_tensor"],
    "torch.distributed.tensor._utils": ["ExplicitRedistributionContext"],
    "torch.distributed.tensor.experimental": ["local_map"],
    "torch.distributed.tensor.experimental._attention": [
        "_HeadTailLoadBalancer", "_PTRRLoadBalancer", "_context_parallel_shard", "_enable_context_parallel_dispatcher",
    ],
    "torch.distributed.tensor.experimental._context_parallel._attention": ["flex_cp_allgather"],
    "torch.distributed.tensor.parallel": ["ParallelStyle", "loss_parallel"],
    "torch.distributed.tensor.placement_types": ["Placement", "Replicate", "Shard", "Partial", "_StridedShard"],
}


def _shardwise_module(torch_path: str) -> str:
    for theirs, ours in _PREFIXES:
        if torch_path == theirs or torch_path.startswith(theirs + "."):
            return ours + torch_path[len(theirs) :]
    raise AssertionError(torch_path)


@pytest.mark.parametrize("torch_path", sorted(USED_NAMES))
def test_every_name_they_use_resolves_at_the_mapped_module(torch_path: str) -> None:
    module = importlib.import_module(_shardwise_module(torch_path))
    missing = [name for name in USED_NAMES[torch_path] if not hasattr(module, name)]
    assert not missing, f"{module.__name__} lacks {missing} (PyTorch's {torch_path})"


def test_submodules_they_import_are_then_attributes_of_the_package() -> None:
    """torchtitan: ``import torch.distributed.tensor._random`` then ``torch.distributed.tensor._random.manual_seed``."""
    import shardwise.dtensor_ops
    import shardwise.dtensor_ops._api
    import shardwise.dtensor_ops._random

    assert callable(shardwise.dtensor_ops._random.manual_seed)
    assert hasattr(shardwise.dtensor_ops._api, "_FromTorchTensor")


def test_placement_types_is_the_placement_package_as_attribute_and_as_submodule() -> None:
    import shardwise.dtensor_ops as dtensor_ops
    import shardwise.placement as placement
    from shardwise.dtensor_ops import placement_types

    assert placement_types is placement and dtensor_ops.placement_types is placement
    assert importlib.import_module("shardwise.dtensor_ops.placement_types") is placement
    assert placement_types.Shard(1) == dtensor_ops.Shard(1)


def test_the_flex_all_gather_is_one_op_at_both_of_pytorchs_paths() -> None:
    from shardwise.dtensor_ops.experimental import _attention, _cp_flex
    from shardwise.dtensor_ops.experimental._context_parallel import _attention as cp_attention

    assert _attention.flex_cp_allgather is _cp_flex.flex_cp_allgather
    assert cp_attention.flex_cp_allgather is _cp_flex.flex_cp_allgather


# -- _ops._view_ops ---------------------------------------------------------------------------------

INFER_CASES = [
    (24, (2, -1, 3)),
    (24, (-1,)),
    (24, (4, 6)),
    (6, [2, 3]),
    (0, (0, 4)),
    (0, (-1, 4)),
    (5, (5, 1, -1)),
    # errors: two -1, not a whole number, wrong total
    (6, (-1, -1)),
    (7, (2, -1)),
    (6, (4, 2)),
]


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        return tuple(fn(*args))
    except (RuntimeError, AssertionError) as error:
        return type(error)


@pytest.mark.parametrize("case", INFER_CASES)
def test_infer_size_resolves_minus_one_and_refuses_as_pytorch(case: tuple[int, Any]) -> None:
    from torch.distributed.tensor._ops import _view_ops as theirs

    from shardwise.dtensor_ops._ops import _view_ops as ours

    assert _outcome(ours.infer_size, *case) == _outcome(theirs.infer_size, *case), case


def _plain(spec: Any) -> Any:
    """A dim spec as nested tuples of its class name and fields (either implementation's)."""
    name = type(spec).__name__
    if name == "InputDim":
        return (name, spec.input_dim)
    if name == "Flatten":
        return (name, tuple(_plain(dim) for dim in spec.input_dims))
    if name == "Split":
        return (name, _plain(spec.input_dim), tuple(spec.group_shape), spec.split_id)
    return (name,)


VIEW_CASES = [
    ((2, 3, 4), (2, 12)),
    ((2, 3, 4), (6, 4)),
    ((2, 3), (3, 2)),
    ((6,), (2, 3)),
    ((1, 4), (4,)),
    ((4,), (1, 4, 1)),
    ((2, 1, 3), (6,)),
    ((2, 3, 4), (-1, 4)),
    ((24,), (2, -1, 3)),
    ((4, 6), (8, 3)),
    ((6, 4), (2, 3, 4)),
    ((2, 2, 1, 3), (4, 3)),
    ((2, 3, 4, 5), (6, 20)),
    ((3, 8, 16), (3, 8, 4, 4)),  # the attention head split
    ((3, 8, 4, 4), (3, 8, 16)),  # and its merge
    ((), (1,)),
]


@pytest.mark.parametrize("case", VIEW_CASES)
def test_view_groups_gives_pytorchs_dim_map(case: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    from torch.distributed.tensor._ops import _view_ops as theirs

    from shardwise.dtensor_ops._ops import _view_ops as ours

    source, target = case
    assert [_plain(d) for d in ours.view_groups(source, target)] == [_plain(d) for d in theirs.view_groups(source, target)]


@pytest.mark.parametrize(
    "full, empty",
    [
        (((3, 8), (3, 2, 4)), ((0, 8), (0, 2, 4))),  # a rank holding no row of a row-sharded tensor
        (((3, 8), (24,)), ((0, 8), (0,))),
        (((4, 6), (1, 4, 6)), ((0, 6), (1, 0, 6))),
        (((2, 3, 16), (2, 3, 4, 4)), ((2, 0, 16), (2, 0, 4, 4))),
    ],
)
def test_view_groups_of_an_empty_shard_group_as_the_other_ranks_shards(full: Any, empty: Any) -> None:
    """spmd-types asks with each rank's local shapes: a rank with an empty shard must get the same grouping."""
    from shardwise.dtensor_ops._ops import _view_ops as ours

    def without_sizes(spec: Any) -> Any:
        plain = _plain(spec)
        return plain if plain[0] != "Split" else (plain[0], plain[1], len(plain[2]), plain[3])

    assert [without_sizes(d) for d in ours.view_groups(*empty)] == [without_sizes(d) for d in ours.view_groups(*full)]


def test_view_groups_of_unrelated_empty_shapes_is_a_split_of_the_whole() -> None:
    from shardwise.dtensor_ops._ops._view_ops import Flatten, InputDim, Split, view_groups

    whole = Flatten((InputDim(0), InputDim(1), InputDim(2)))
    assert view_groups((2, 0, 3), (0, 6)) == (Split(whole, (0, 6), 0), Split(whole, (0, 6), 1))


# -- _api._FromTorchTensor / _ToTorchTensor -----------------------------------------------------------


@multi_rank(world_size=WORLD)
def test_from_and_to_torch_tensor_are_the_conversions_with_pytorchs_gradients() -> None:
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, _api, init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    torch_mesh = torch_init_device_mesh("cpu", (WORLD,))
    ours_of = {"S": Shard(0), "R": Replicate(), "P": Partial()}
    theirs_of = {"S": TorchShard(0), "R": TorchReplicate(), "P": TorchPartial()}
    weight = torch.arange(12.0).reshape(4, 3) / 7

    # from_local -> to_local -> plain computation, and back: gradients as PyTorch's for each placement.
    for name in ("S", "R", "P"):
        grads = []
        for cls, device_mesh, placement in ((DTensor, mesh, ours_of[name]), (TorchDTensor, torch_mesh, theirs_of[name])):
            local = (torch.ones(4, 3) * (rank + 1)).requires_grad_()
            built = cls.from_local(local, device_mesh, [placement])
            (built.to_local() * weight).sum().backward()
            grads.append(local.grad)
        torch.testing.assert_close(grads[0], grads[1], msg=f"to_local of {name}")
        # ... and through a redistribution to Replicate and full_tensor().
        grads = []
        for cls, device_mesh, placement in ((DTensor, mesh, ours_of[name]), (TorchDTensor, torch_mesh, theirs_of[name])):
            local = (torch.ones(4, 3) * (rank + 1)).requires_grad_()
            built = cls.from_local(local, device_mesh, [placement])
            (built.full_tensor() * (rank + 1)).sum().backward()
            grads.append(local.grad)
        torch.testing.assert_close(grads[0], grads[1], msg=f"full_tensor of {name}")

    # grad_placements of from_local (PyTorch 2.13): the gradient is moved there instead of the default.
    grads = []
    for cls, device_mesh, placement in ((DTensor, mesh, Partial()), (TorchDTensor, torch_mesh, TorchPartial())):
        local = torch.ones(3).requires_grad_()
        built = cls.from_local(local, device_mesh, [placement], grad_placements=[placement])
        (built.full_tensor() * 2).sum().backward()
        grads.append(local.grad)
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0] is not None and grads[0].tolist() == [0.5] * 3  # 2 split over 4 ranks' parts

    # The Functions themselves, with PyTorch's positional arguments (and no class: a DTensor).
    local = torch.arange(6.0).reshape(2, 3).requires_grad_()
    built = _api._FromTorchTensor.apply(local, mesh, (Shard(0),), False, None, None, None)
    assert type(built) is DTensor and built.placements == (Shard(0),) and built.shape == (8, 3)
    back = _api._ToTorchTensor.apply(built, None)
    assert torch.equal(back, local) and type(back) is torch.Tensor
    (back * 3).sum().backward()
    assert local.grad is not None and torch.equal(local.grad, torch.full((2, 3), 3.0))
    assert _api._normalize_placements_for_grad([Shard(1), Partial("max"), Replicate()]) == (
        Shard(1), Replicate(), Replicate(),
    )

    # _redistribute.redistribute_local_tensor with PyTorch 2.13's keywords (torchtitan's simple_fsdp passes specs
    # by name).
    from shardwise.dtensor_ops._redistribute import redistribute_local_tensor

    gathered = redistribute_local_tensor(
        built._local_tensor, current_spec=built._spec, target_spec=built._spec.with_placements((Replicate(),)), is_explicit=True
    )
    assert torch.equal(gathered, torch.arange(6.0).reshape(2, 3).repeat(WORLD, 1))


@multi_rank(world_size=WORLD)
def test_from_local_and_to_local_call_the_functions_with_pytorchs_arguments() -> None:
    """spmd-types' checker replaces ``apply`` of these two classes (by identity) with a typed call of it."""
    from shardwise.dtensor_ops import DTensor, Partial, Shard, _api, init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    seen: list[tuple[str, tuple[Any, ...]]] = []
    originals = {cls: cls.__dict__.get("apply") for cls in (_api._FromTorchTensor, _api._ToTorchTensor)}

    def recording(cls: Any, label: str) -> Any:
        parent_apply = super(cls, cls).apply  # torch.autograd.Function.apply, bound to cls

        def apply(*args: Any, **kwargs: Any) -> Any:
            seen.append((label, args))
            return parent_apply(*args, **kwargs)

        return staticmethod(apply)

    try:
        _api._FromTorchTensor.apply = recording(_api._FromTorchTensor, "from")  # type: ignore[method-assign]
        _api._ToTorchTensor.apply = recording(_api._ToTorchTensor, "to")  # type: ignore[method-assign]
        local = torch.ones(2, 3, requires_grad=True)
        built = DTensor.from_local(local, mesh, [Shard(-2)], grad_placements=[Shard(0)])
        built.to_local(grad_placements=[Partial()])
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.apply  # type: ignore[attr-defined]
            else:
                cls.apply = original  # type: ignore[method-assign]
    (label_from, from_args), (label_to, to_args) = seen
    assert label_from == "from" and from_args[0] is local and from_args[1] is mesh
    # placements, run_check, shape, stride, grad_placements: normalised tuples, as PyTorch passes them
    assert from_args[2:7] == ((Shard(0),), False, None, None, (Shard(0),))
    assert label_to == "to" and to_args == (built, (Partial(),))


# -- flex_cp_allgather -------------------------------------------------------------------------------


@multi_rank(world_size=WORLD)
def test_flex_cp_allgather_gathers_key_and_value_along_the_sequence() -> None:
    from shardwise.dtensor_ops import init_device_mesh
    from shardwise.dtensor_ops.experimental._context_parallel._attention import flex_cp_allgather

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(7)
    full_key = torch.randn(2, 3, 4 * WORLD, 5)  # (batch, heads, seq, head_dim)
    full_value = torch.randn(2, 3, 4 * WORLD, 6)
    for seq_dim in (2, 1):
        key = full_key.chunk(WORLD, dim=2)[rank].transpose(1, 2) if seq_dim == 1 else full_key.chunk(WORLD, dim=2)[rank]
        value = full_value.chunk(WORLD, dim=2)[rank].transpose(1, 2) if seq_dim == 1 else full_value.chunk(WORLD, dim=2)[rank]
        key, value = key.clone().requires_grad_(), value.clone().requires_grad_()
        gathered_key, gathered_value = flex_cp_allgather(key, value, seq_dim, mesh.get_group_name(0))
        expected_key = full_key.transpose(1, 2) if seq_dim == 1 else full_key
        expected_value = full_value.transpose(1, 2) if seq_dim == 1 else full_value
        assert torch.equal(gathered_key, expected_key) and torch.equal(gathered_value, expected_value), seq_dim
        # Backward: every rank's gradient of the gathered tensors, summed, cut back to this rank's piece.
        key_weight = torch.arange(float(gathered_key.numel())).reshape(gathered_key.shape) * (rank + 1)
        ((gathered_key * key_weight).sum() + gathered_value.sum()).backward()
        summed = key_weight / (rank + 1) * sum(range(1, WORLD + 1))
        assert key.grad is not None and value.grad is not None
        torch.testing.assert_close(key.grad, summed.chunk(WORLD, dim=seq_dim)[rank])
        torch.testing.assert_close(value.grad, torch.full_like(value, float(WORLD)))


# -- what torch's own code reached from them imports (DCP, LocalTensorMode's random tracker) -----------


def test_names_torchs_own_modules_import_from_the_dtensor_package() -> None:
    import shardwise.dtensor_ops as dtensor_ops
    from shardwise.dtensor_ops._ops.utils import prod
    from shardwise.placement import DTensorSpec, ShardOrderEntry, TensorMeta

    assert dtensor_ops._DTensorSpec is DTensorSpec and dtensor_ops._TensorMeta is TensorMeta
    assert dtensor_ops._ShardOrderEntry is ShardOrderEntry
    assert prod([2, 3, 4]) == 24 and prod([]) == 1


@pytest.mark.parametrize(
    "mesh_shape, placements, shape",
    [
        ((4,), ("S0",), (10, 3)),
        ((2, 2), ("S0", "S1"), (5, 7)),
        ((2, 2), ("S0", "S0"), (9, 2)),  # one tensor dim cut by both mesh dims
        ((2, 3), ("R", "S1"), (4, 8)),
        ((2, 2), ("P", "R"), (3, 3)),
    ],
)
def test_random_shard_numbering_matches_pytorchs(mesh_shape: tuple[int, ...], placements: tuple[str, ...], shape: tuple[int, ...]) -> None:
    import itertools
    from types import SimpleNamespace

    import torch.distributed.tensor._random as theirs
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    from shardwise.dtensor_ops import _random as ours
    from shardwise.placement import DTensorSpec, Partial, Replicate, Shard, TensorMeta
    from shardwise.testing import FakeMesh

    def build(name: str, shard: Any, replicate: Any, partial: Any) -> Any:
        return shard(int(name[1:])) if name.startswith("S") else replicate() if name == "R" else partial()

    our_spec = DTensorSpec(
        FakeMesh(mesh_shape),
        tuple(build(name, Shard, Replicate, Partial) for name in placements),
        TensorMeta(torch.Size(shape), torch.empty(shape).stride(), torch.float32),
    )
    # PyTorch's helpers read only these fields of a spec and its mesh.
    their_spec = SimpleNamespace(
        shape=torch.Size(shape),
        ndim=len(shape),
        placements=tuple(build(name, TorchShard, TorchReplicate, TorchPartial) for name in placements),
        mesh=SimpleNamespace(shape=mesh_shape, ndim=len(mesh_shape), size=lambda dim: mesh_shape[dim]),
    )
    first = ours._calc_first_shard_size(our_spec)
    assert tuple(first) == our_spec.local_shape((0,) * len(mesh_shape))
    if len({name for name in placements if name.startswith("S")}) == sum(name.startswith("S") for name in placements):
        # Where two mesh dims cut one tensor dim PyTorch's gives the size of one cut of the whole dim
        # (9 rows over (2, 2): 5); ours is the first shard's real size (3), which bounds every shard alike.
        assert first == theirs._calc_first_shard_size(their_spec)
    for coordinate in itertools.product(*(range(size) for size in mesh_shape)):
        index, count = ours._calc_shard_info(coordinate, our_spec)
        assert (index, count) == tuple(theirs._calc_shard_info(coordinate, their_spec)), coordinate
        assert ours._calc_shard_linear_idx(index, count) == theirs._calc_shard_linear_idx(index, count)


@multi_rank(world_size=WORLD)
def test_to_local_of_a_parameter_is_a_parameter_as_in_pytorch() -> None:
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

    from shardwise.dtensor_ops import Shard, distribute_tensor, init_device_mesh

    ours = torch.nn.Parameter(distribute_tensor(torch.ones(8, 2), init_device_mesh("cpu", (WORLD,)), [Shard(0)]))
    theirs = torch.nn.Parameter(torch_distribute_tensor(torch.ones(8, 2), torch_init_device_mesh("cpu", (WORLD,)), [TorchShard(0)]))
    for grad_enabled in (True, False):
        with torch.set_grad_enabled(grad_enabled):
            local, their_local = ours.to_local(), theirs.to_local()
        assert isinstance(their_local, torch.nn.Parameter)
        assert isinstance(local, torch.nn.Parameter) and local.shape == (2, 2)
        # The DTensor's own local tensor is not marked.
        assert not isinstance(ours._local_tensor, torch.nn.Parameter)
    plain = distribute_tensor(torch.ones(8, 2), init_device_mesh("cpu", (WORLD,)), [Shard(0)])
    assert not isinstance(plain.to_local(), torch.nn.Parameter)
