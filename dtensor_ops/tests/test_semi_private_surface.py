"""PyTorch's semi-private DTensor names under shardwise's module names, checked against PyTorch's own.

Pure helpers are compared with PyTorch's on many inputs; helpers that read the mesh run on 4 rank
threads for both implementations; random streams (which rank threads cannot tell apart: they share
one generator) run on 2 rank processes.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import run_on_ranks, run_on_threads

WORLD = 4

SURFACE = {
    "shardwise.dtensor_ops._dtensor_spec": ["DTensorSpec", "TensorMeta"],
    "shardwise.dtensor_ops._redistribute": ["Redistribute", "redistribute_local_tensor"],
    "shardwise.dtensor_ops._collective_utils": ["redistribute_cost", "shard_dim_alltoall", "unpad_tensor"],
    "shardwise.dtensor_ops._utils": [
        "compute_local_shape_and_global_offset",
        "compute_global_tensor_info",
        "compute_global_tensor_shape",
    ],
    "shardwise.dtensor_ops._random": ["manual_seed", "is_rng_supported_mesh", "OffsetBasedRNGTracker"],
    "shardwise.dtensor_ops._sharding_prop": ["ShardingPropagator"],
    "shardwise.dtensor_ops._ops._view_ops": [
        "dim_maps", "view_groups", "InputDim", "Flatten", "Split", "Singleton", "Broadcast", "Repeat",
    ],
    "shardwise.dtensor_ops._ops._embedding_ops": ["_MaskPartial"],
    "shardwise.dtensor_ops._ops.utils": ["normalize_dim", "is_tensor_partial"],
    "shardwise.dtensor_ops._api": ["_shard_tensor"],
    "shardwise.dtensor_ops._op_schema": [
        "OpSchema", "OpStrategy", "OpSpec", "TupleStrategy", "RuntimeSchemaInfo", "OutputSharding", "StrategyType",
        "PlacementList",
    ],
    "shardwise.dtensor_ops.debug": [
        "_clear_sharding_prop_cache", "_clear_fast_path_sharding_prop_cache", "_get_fast_path_sharding_prop_cache_stats",
    ],
    "shardwise.placement": ["_StridedShard"],
    "shardwise.tp_styles.input_reshard": ["input_reshard"],
}


@pytest.mark.parametrize("module_name", sorted(SURFACE))
def test_every_name_of_the_table_imports(module_name: str) -> None:
    module = importlib.import_module(module_name)
    missing = [name for name in SURFACE[module_name] if not hasattr(module, name)]
    assert not missing, f"{module_name} lacks {missing}"


# ----------------------------------------------------------------------------- pure helpers


def _as_plain(value: Any) -> Any:
    """A DimSpec tree as (class name, fields...) tuples, so both implementations compare."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,) + tuple(_as_plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    return value


VIEW_SHAPES = [(1,), (6,), (2, 3), (3, 2), (2, 1, 3), (1, 6), (6, 1), (2, 3, 4), (4, 6), (24,), (1, 1), (8, 1, 3), (1, 2, 1, 3)]


def test_view_groups_match_pytorch() -> None:
    from torch.distributed.tensor._ops import _view_ops as theirs

    from shardwise.dtensor_ops._ops import _view_ops as ours

    compared = 0
    for source in VIEW_SHAPES:
        for target in VIEW_SHAPES + [(-1,), (2, -1)]:
            if -1 not in target and math.prod(source) != math.prod(target):
                continue
            if -1 in target and math.prod(source) % 2 != 0 and target == (2, -1):
                continue
            assert _as_plain(ours.view_groups(source, target)) == _as_plain(theirs.view_groups(source, target)), (source, target)
            compared += 1
    assert compared > 60


def test_dim_maps_match_pytorch() -> None:
    from torch.distributed.tensor._ops import _view_ops as theirs

    from shardwise.dtensor_ops._ops import _view_ops as ours

    t = torch.empty
    cases: list[tuple[Any, tuple[Any, ...]]] = [
        (torch.atleast_1d, (t(()),)), (torch.atleast_2d, (t(3),)), (torch.atleast_3d, (t(3),)),
        (torch.atleast_3d, (t(2, 3),)), (torch.broadcast_to, (t(3, 1), (2, 3, 4))),
        (torch.Tensor.expand, (t(1, 3), 4, -1)), (torch.Tensor.expand, (t(1, 3), (2, 4, 3))),
        (torch.flatten, (t(2, 3, 4),)), (torch.flatten, (t(()),)), (torch.movedim, (t(2, 3, 4), 0, 2)),
        (torch.movedim, (t(2, 3, 4, 5), (0, 1), (3, 0))), (torch.permute, (t(2, 3, 4), (2, 0, 1))),
        (torch.ravel, (t(2, 3),)), (torch.Tensor.repeat, (t(2, 3), 2, 1, 3)), (torch.Tensor.repeat, (t(1, 3), 4, 1)),
        (torch.reshape, (t(2, 3, 4), (6, -1))), (torch.squeeze, (t(2, 1, 3, 1),)), (torch.squeeze, (t(2, 1, 3, 1), 1)),
        (torch.squeeze, (t(2, 1, 3, 1), (1, 3))), (torch.tile, (t(2, 3), (2,))), (torch.tile, (t(2, 3), (2, 1, 2))),
        (torch.transpose, (t(2, 3, 4), 0, -1)), (torch.unsqueeze, (t(2, 3), -1)), (torch.Tensor.view, (t(2, 3, 4), 4, 6)),
        (torch.view_as_complex, (t(3, 4, 2),)), (torch.view_as_real, (t(3, 4, dtype=torch.cfloat),)),
    ]
    assert set(ours.dim_maps) == set(theirs.dim_maps)
    for fn, args in cases:
        assert _as_plain(ours.dim_maps[fn](*args)) == _as_plain(theirs.dim_maps[fn](*args)), fn
    with pytest.raises(TypeError, match="Did you mean to use .input_dim"):
        _ = ours.InputDim(0) == 0


def test_shard_split_helpers_match_pytorch() -> None:
    from torch.distributed.tensor import Shard as TheirShard

    from shardwise.placement import Shard

    tensor = torch.arange(10.0).reshape(5, 2)
    for num_chunks in (1, 2, 3, 4, 7):
        for with_padding in (True, False):
            ours, our_pads = Shard(0)._split_tensor(tensor, num_chunks, with_padding=with_padding)
            theirs, their_pads = TheirShard(0)._split_tensor(tensor, num_chunks, with_padding=with_padding)
            assert our_pads == their_pads and [p.tolist() for p in ours] == [p.tolist() for p in theirs]
        for size in (0, 1, 5, 8):
            for rank in range(num_chunks):
                assert Shard(0)._local_shard_size_and_offset(size, num_chunks, rank) == TheirShard(
                    0
                )._local_shard_size_and_offset(size, num_chunks, rank)


def test_ops_utils_and_mask_partial() -> None:
    from shardwise.dtensor_ops._ops._embedding_ops import _MaskPartial
    from shardwise.dtensor_ops._ops.utils import is_tensor_partial, normalize_dim
    from shardwise.placement import DTensorSpec, Partial, Replicate
    from shardwise.testing import FakeMesh

    assert (normalize_dim(-1, 3), normalize_dim(2, 3)) == (2, 2)
    with pytest.raises(IndexError):
        normalize_dim(3, 3)
    mesh = FakeMesh((2, 2), (0, 1))
    assert is_tensor_partial(DTensorSpec(mesh, [Replicate(), Partial()]))
    assert not is_tensor_partial(DTensorSpec(mesh, [Replicate(), Replicate()]))
    mask = _MaskPartial(offset_shape=torch.Size([8, 4]), offset_dim=0)
    assert mask.is_partial() and mask.reduce_op == "sum" and isinstance(mask, Partial)
    assert mask == _MaskPartial(torch.Size([8, 4]), 0) and mask != _MaskPartial(torch.Size([8, 4]), 1)
    assert mask != Partial() and hash(mask) == hash(_MaskPartial(torch.Size([8, 4]), 0))


# ----------------------------------------------------------------------------- mesh helpers (rank threads)


def _layout_helpers(module: Any, utils: Any, init_mesh: Any) -> list[Any]:
    mesh = init_mesh("cpu", (2, 2))
    results: list[Any] = []
    for placements in (
        [module.Shard(0), module.Shard(1)],
        [module.Shard(1), module.Shard(1)],
        [module.Replicate(), module.Shard(0)],
        [module.Shard(0), module.Partial()],
    ):
        for shape in ((8, 6), (5, 3), (3, 1)):
            results.append(tuple(utils.compute_local_shape_and_global_offset(shape, mesh, placements)))
        local = torch.empty(4, 6).t()
        shape, stride = utils.compute_global_tensor_info(local, mesh, placements)
        results.append((list(shape), list(stride)))
    flat = init_mesh("cpu", (WORLD,))
    # Uneven shards: rank r holds r + 1 rows.
    local_rows = torch.empty(dist.get_rank() + 1, 3)
    results.append(tuple(utils.compute_global_tensor_shape(local_rows.shape, flat, [module.Shard(0)])))
    return results


def test_layout_helpers_match_pytorch() -> None:
    import torch.distributed.tensor as td
    import torch.distributed.tensor._utils as their_utils

    import shardwise.dtensor_ops as sw
    import shardwise.dtensor_ops._utils as our_utils
    from shardwise.mesh import init_device_mesh

    ours = run_on_threads(lambda: _layout_helpers(sw, our_utils, init_device_mesh), world_size=WORLD)
    theirs = run_on_threads(lambda: _layout_helpers(td, their_utils, td.init_device_mesh), world_size=WORLD)
    def normalise(value: Any) -> Any:
        return tuple(normalise(item) for item in value) if isinstance(value, (list, tuple, torch.Size)) else int(value)

    assert normalise(ours) == normalise(theirs)
    assert ours[0][-1] == (10, 3)


def _collective_helpers() -> dict[str, Any]:
    import shardwise.dtensor_ops as sw
    from shardwise.dtensor_ops._api import _shard_tensor
    from shardwise.dtensor_ops._collective_utils import redistribute_cost, shard_dim_alltoall, unpad_tensor
    from shardwise.dtensor_ops._redistribute import Redistribute
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    rank = dist.get_rank()
    full = torch.arange(8 * 12.0).reshape(8, 12)
    rows = sw.distribute_tensor(full, mesh, [sw.Shard(0)])
    with CommDebugMode() as comm:
        moved = shard_dim_alltoall(rows.to_local(), 0, 1, mesh, 0)
    spec_rows, spec_cols = rows._spec, rows.redistribute(mesh, [sw.Shard(1)])._spec
    with CommDebugMode() as no_comm:
        cut = _shard_tensor(full, [sw.Shard(1)], mesh)
    replicated = sw.distribute_tensor(full, mesh, [sw.Replicate()]).requires_grad_()
    gathered = Redistribute.apply(replicated, mesh, (sw.Shard(0),), False, torch.float64)
    gathered.to_local().sum().backward()
    return {
        "moved": torch.equal(moved, full[:, 3 * rank : 3 * rank + 3]),
        "alltoall": comm.get_comm_counts()[torch.ops._c10d_functional.all_to_all_single],
        "total": comm.get_total_counts(),
        "costs": (
            redistribute_cost(spec_rows, spec_rows),
            redistribute_cost(sw.distribute_tensor(full, mesh, [sw.Replicate()])._spec, spec_rows),
            redistribute_cost(spec_rows, spec_cols) > 0,
        ),
        "unpad": unpad_tensor(torch.ones(5, 2), 0, 2).shape,
        "shard_tensor": (torch.equal(cut.to_local(), full[:, 3 * rank : 3 * rank + 3]), no_comm.get_total_counts()),
        "redistribute_apply": (gathered.dtype, gathered.placements, replicated.grad.dtype),
    }


def test_collective_helpers_and_private_api() -> None:
    results = run_on_threads(_collective_helpers, world_size=WORLD)
    for result in results:
        assert result["moved"] and result["alltoall"] == 1 and result["total"] == 1
        assert result["costs"] == (0.0, 0.0, True)
        assert result["unpad"] == torch.Size([3, 2])
        assert result["shard_tensor"] == (True, 0)
        dtype, placements, grad_dtype = result["redistribute_apply"]
        assert dtype == torch.float64 and grad_dtype == torch.float32 and str(placements) == "(Shard(dim=0),)"


def _propagator_cache() -> tuple[Any, ...]:
    import shardwise.dtensor_ops as sw
    from shardwise.dtensor_ops._sharding_prop import ShardingPropagator, sharding_propagator
    from shardwise.dtensor_ops.debug import _clear_sharding_prop_cache, _get_python_sharding_prop_cache_info
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    x = sw.distribute_tensor(torch.ones(8, 4), mesh, [sw.Shard(0)])
    _clear_sharding_prop_cache()
    first = _get_python_sharding_prop_cache_info()
    x + x
    x + x  # decided once: dispatch's own lookup hits the second time
    after = _get_python_sharding_prop_cache_info()
    decision = sharding_propagator.propagate_op_sharding(torch.ops.aten.add.Tensor, (x._spec, x._spec), {})
    again = sharding_propagator.propagate_op_sharding.cache_info()
    fresh = ShardingPropagator().propagate_op_sharding_non_cached(torch.ops.aten.add.Tensor, (x._spec, x._spec), {})
    return (
        (first.hits, first.misses, first.currsize),
        (after.misses, after.currsize >= 1),
        again.hits - after.hits,
        str(decision.output_specs.placements),
        fresh.output_specs == decision.output_specs,
    )


def test_sharding_propagator_and_its_cache() -> None:
    for result in run_on_threads(_propagator_cache, world_size=WORLD):
        assert result == ((0, 0, 0), (1, True), 1, "(Shard(dim=0),)", True)


# ----------------------------------------------------------------------------- random streams (processes)


def _tracker_streams() -> dict[str, Any]:
    import shardwise.dtensor_ops as sw
    import shardwise.dtensor_ops._random as sw_random
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    sw_random.manual_seed(5, mesh)
    assert sw_random.is_rng_supported_mesh(mesh)
    tracker = sw_random.OffsetBasedRNGTracker(mesh)
    sharded = sw.DTensor.from_local(torch.empty(4), mesh, [sw.Shard(0)])._spec
    with tracker._distribute_region(sharded):
        in_region = torch.rand(4)
    after_region = torch.rand(2)
    sw_random._rng_tracker = tracker
    try:
        tracker.distribute_region_enabled = False
        plain = sw.DTensor.from_local(torch.empty(4), mesh, [sw.Shard(0)]).uniform_().to_local()
    finally:
        sw_random._rng_tracker = None
    streamed = sw.DTensor.from_local(torch.empty(4), mesh, [sw.Shard(0)]).uniform_().to_local()
    return {"in_region": in_region, "after": after_region, "plain": plain, "streamed": streamed}


def test_offset_based_rng_tracker_gives_each_shard_its_stream() -> None:
    first, second = run_on_ranks(_tracker_streams, world_size=2)
    assert not torch.equal(first["in_region"], second["in_region"])  # different shards, different values
    assert torch.equal(first["after"], second["after"])  # and the generators stay in step
    assert torch.equal(first["plain"], second["plain"])  # region disabled: each rank's generator as it is
    assert not torch.equal(first["streamed"], second["streamed"])


def _tracker_state_sync(mesh_shape: tuple[int, ...], sync: bool) -> dict[str, Any]:
    import warnings

    import shardwise.dtensor_ops._random as sw_random
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(100 + dist.get_rank())  # seeded per rank on purpose: the states differ
    with warnings.catch_warnings(record=True) as caught, CommDebugMode() as comm:
        warnings.simplefilter("always")
        sw_random.OffsetBasedRNGTracker(mesh, run_state_sync=sync)
    return {
        "draw": torch.rand(3),
        "warned": any("differed from the mesh's first rank's" in str(w.message) for w in caught),
        "broadcasts": comm.get_comm_counts()[torch.ops.c10d_functional.broadcast],
        "total": comm.get_total_counts(),
    }


# 2 ranks only (a 4-process pool costs more than this test is worth); (1, 2): the broadcast runs along
# the mesh dim that has more than one rank.
@pytest.mark.parametrize("mesh_shape,sync", [((2,), True), ((2,), False), ((1, 2), True)])
def test_offset_based_rng_tracker_takes_the_first_ranks_generator_state(mesh_shape: tuple[int, ...], sync: bool) -> None:
    results = run_on_ranks(_tracker_state_sync, mesh_shape, sync, world_size=math.prod(mesh_shape))
    first_rank_draw = torch.rand(3, generator=torch.Generator().manual_seed(100))
    for rank, result in enumerate(results):
        if sync:
            # Every rank now draws what rank 0 draws; only ranks whose state differed were warned.
            assert torch.equal(result["draw"], first_rank_draw)
            assert result["warned"] == (rank != 0)
            assert result["broadcasts"] == result["total"] == 1
        else:
            assert not result["warned"] and result["total"] == 0
    if not sync:
        assert not torch.equal(results[0]["draw"], results[1]["draw"])


# ----------------------------------------------------------------------------- PyTorch's paths: the alias table

_FIRST_IMPORTS = r'''
import importlib, pickle, sys
import shardwise.dtensor_ops._op_schema as op_schema
from shardwise.dtensor_ops._ops.utils import normalize_dim
from shardwise.dtensor_ops import _redistribute
import shardwise.dtensor_ops._ops._view_ops
from shardwise.dtensor_ops._torch_compat import op_schema as compat_op_schema
from shardwise.dtensor_ops._torch_compat.pytorch_paths import PYTORCH_PATHS
assert op_schema is compat_op_schema
assert shardwise.dtensor_ops._ops.utils.normalize_dim is normalize_dim
assert shardwise.dtensor_ops._ops._view_ops is sys.modules["shardwise.dtensor_ops._torch_compat.view_ops"]
assert _redistribute is sys.modules["shardwise.dtensor_ops._torch_compat.redistribute"]
assert pickle.loads(pickle.dumps(op_schema.OpSchema)) is op_schema.OpSchema
print("ok", len(PYTORCH_PATHS))
'''


def test_pytorch_paths_are_served_by_one_module_under_both_names() -> None:
    import pathlib
    import pickle
    import sys

    import shardwise.dtensor_ops as sw
    from shardwise.dtensor_ops._torch_compat.pytorch_paths import PYTORCH_PATHS

    package_folder = pathlib.Path(sw.__file__).parent
    for path, served_by in PYTORCH_PATHS.items():
        module = importlib.import_module(path)
        assert module is importlib.import_module(served_by) is sys.modules[path], path
        assert module.__spec__.name == served_by  # the serving module keeps its own spec
        parent, _, child = path.rpartition(".")
        assert getattr(sys.modules[parent], child) is module, path
        assert importlib.util.find_spec(path) is not None, path
        relative = path.split(".")[2:]
        assert not package_folder.joinpath(*relative[:-1], relative[-1] + ".py").exists(), f"a file sits at {path}"
    import shardwise.dtensor_ops._ops.utils as ops_utils
    import shardwise.dtensor_ops._random as sw_random

    assert ops_utils is sw._ops.utils and sw_random is sw._random
    assert pickle.loads(pickle.dumps(ops_utils.normalize_dim)) is ops_utils.normalize_dim
    # A name that no table entry and no file has stays missing.
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("shardwise.dtensor_ops._ops._conv_ops")


def test_pytorch_paths_import_first_in_every_form() -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # this process's import path, Bazel's too
    done = subprocess.run([sys.executable, "-c", _FIRST_IMPORTS], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")


def test_only_the_compat_package_binds_modules_in_sys_modules() -> None:
    """PyTorch's paths reach compat code through the alias table alone: no module outside ``_torch_compat``
    assigns into ``sys.modules`` (or swaps a module's class)."""
    import ast
    import pathlib

    import shardwise.dtensor_ops as sw

    root = pathlib.Path(sw.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if "_torch_compat" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                text = ast.unparse(target)
                if text.startswith("sys.modules[") or text.endswith(".__class__"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.modules.setdefault", "sys.modules.update"):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node.func)}")
    assert not found, found
