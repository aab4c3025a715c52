"""Tensor ops laid out as PyTorch's DTensor (the oracle) lays them out: factories, ``is_same_size``, gather.

A ``new_*`` tensor of the input's own global size follows the input's shards (the unwritten ``new_empty*``
its Partial too) and is built at each rank's local size and strides; another size is replicated.
``empty_like`` keeps a Partial input Partial; the initialized ``*_like`` make it Replicate.  A gather of
one position per row from a self sharded along the gathered dim picks locally into a pending sum (PyTorch:
its ``_MaskPartial``; here a plain ``Partial("sum")``), with no communication.  Ranks are threads:
placements, local shapes and strides, values of deterministic ops.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise.testing import run_on_threads

# The oracle, imported whole here: imported first inside the rank threads, its modules would be seen
# half-initialized by the other threads.
import torch.distributed.tensor  # noqa: E402,F401
import torch.distributed.tensor.debug  # noqa: E402,F401

WORLD = 4


def _api(name: str) -> Any:
    if name == "shardwise":
        import shardwise.dtensor_ops as api
        import shardwise.dtensor_ops.debug
        from shardwise.mesh import init_device_mesh
    else:
        import torch.distributed.tensor as api  # type: ignore[no-redef]
        import torch.distributed.tensor.debug
        from torch.distributed.device_mesh import init_device_mesh  # type: ignore[assignment]
    return api, init_device_mesh


def _describe(placements: Any) -> str:
    return ",".join(
        f"P({p.reduce_op})" if p.is_partial() else ("R" if p.is_replicate() else f"S{p.dim}") for p in placements
    )


_FACTORIES = {
    "new_empty_strided same": lambda x: x.new_empty_strided(x.shape, (x.shape[1], 1)),
    "new_empty_strided transposed": lambda x: x.new_empty_strided(x.shape, (1, x.shape[0])),
    "new_empty same": lambda x: x.new_empty(x.shape),
    "new_full same": lambda x: x.new_full(x.shape, 4.0),
    "new_zeros same": lambda x: x.new_zeros(x.shape),
    "new_ones same": lambda x: x.new_ones(x.shape),
    "new_full other": lambda x: x.new_full((3, 5), 4.0),
    "new_empty other": lambda x: x.new_empty((2, 2)),
    "empty_like": torch.empty_like,
    "zeros_like": torch.zeros_like,
    "ones_like": torch.ones_like,
}
_INITIALIZED = {"new_full same": 4.0, "new_zeros same": 0.0, "new_ones same": 1.0, "new_full other": 4.0, "zeros_like": 0.0, "ones_like": 1.0}


def _factories_on(name: str, mesh_shape: tuple[int, ...]) -> list[tuple[Any, ...]]:
    api, init_device_mesh = _api(name)
    mesh = init_device_mesh("cpu", mesh_shape)
    layouts = (
        [[api.Shard(0)], [api.Shard(1)], [api.Replicate()], [api.Partial()]]
        if mesh_shape == (WORLD,)
        else [[api.Shard(0), api.Shard(1)], [api.Partial(), api.Shard(0)], [api.Shard(1), api.Partial()], [api.Replicate(), api.Shard(1)]]
    )
    seen = []
    for shape in [(12, 8), (12, 7)]:
        for placements in layouts:
            # the local pieces of the layout with Partial dims replicated, then declared Partial
            pieces = api.distribute_tensor(
                torch.ones(shape), mesh, [api.Replicate() if p.is_partial() else p for p in placements]
            ).to_local()
            x = api.DTensor.from_local(pieces, mesh, placements, shape=shape, stride=(shape[1], 1))
            for factory, make in _FACTORIES.items():
                if mesh_shape != (WORLD,) and any(p.is_partial() for p in placements) and "same" not in factory:
                    continue
                y = make(x)
                local = y.to_local()
                # strides of size-1 dims carry no layout (and differ between the two implementations' pieces)
                strides = tuple(stride if extent != 1 else None for stride, extent in zip(local.stride(), local.shape))
                row = [factory, shape, _describe(placements), _describe(y.placements), tuple(local.shape), strides]
                if factory in _INITIALIZED:
                    row.append(torch.equal(y.full_tensor(), torch.full(tuple(y.shape), _INITIALIZED[factory])))
                seen.append(tuple(row))
    return seen


@pytest.mark.parametrize("mesh_shape", [(WORLD,), (2, 2)])
def test_factories_follow_the_input_as_pytorch(mesh_shape: tuple[int, ...]) -> None:
    ours = run_on_threads(_factories_on, "shardwise", mesh_shape, world_size=WORLD)
    theirs = run_on_threads(_factories_on, "torch", mesh_shape, world_size=WORLD)
    if mesh_shape == (WORLD,):
        assert ours == theirs
    else:
        # PyTorch follows the WHOLE input spec once any mesh dim is sharded, Partial dims included, so its
        # new_full/new_zeros/new_ones of a (Partial, Shard) input hold world-times the value; shardwise
        # decides per mesh dim and replicates the Partial one.  Everything else is the same.
        differing = [(mine, oracle) for mine, oracle in zip(ours[0], theirs[0]) if mine != oracle]
        assert differing and all(
            mine[0] in _INITIALIZED and mine[3] == oracle[3].replace("P(sum)", "R") for mine, oracle in differing
        )
        assert any(oracle[-1] is False for _, oracle in differing)  # PyTorch's ones/full: wrong values
    assert all(row[-1] is True for rank in ours for row in rank if row[0] in _INITIALIZED)
    rows = {(row[0], row[1], row[2]): row[3:6] for row in ours[1]}
    if mesh_shape == (WORLD,):
        assert rows[("new_empty_strided same", (12, 8), "S1")] == ("S1", (12, 2), (2, 1))
        assert rows[("new_empty_strided transposed", (12, 8), "S0")] == ("S0", (3, 8), (1, 3))
        assert rows[("new_full other", (12, 8), "S0")] == ("R", (3, 5), (5, 1))
        assert rows[("empty_like", (12, 8), "P(sum)")][0] == "P(sum)"
        assert rows[("new_empty same", (12, 8), "P(sum)")][0] == "P(sum)"
        assert rows[("new_zeros same", (12, 8), "P(sum)")][0] == "R"


def _same_size_on(name: str) -> list[bool]:
    api, init_device_mesh = _api(name)
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = api.distribute_tensor(torch.ones(8, 4), mesh, [api.Shard(0)])
    cols = api.distribute_tensor(torch.ones(8, 4), mesh, [api.Shard(1)])
    whole = api.distribute_tensor(torch.ones(8, 4), mesh, [api.Replicate()])
    other = api.distribute_tensor(torch.ones(4, 8), mesh, [api.Shard(0)])
    with api.debug.CommDebugMode() as comm:
        answers = [rows.is_same_size(cols), rows.is_same_size(whole), rows.is_same_size(other)]
        # A plain tensor on either side is compared by its own shape (no implicit replication needed).
        answers += [torch.ones(8, 4).is_same_size(rows), rows.is_same_size(torch.ones(2, 4))]
    return [*answers, comm.get_total_counts()]


def test_is_same_size_compares_global_shapes_without_moving_data() -> None:
    ours = run_on_threads(_same_size_on, "shardwise", world_size=WORLD)
    expected = [[True, True, False, True, False, 0]] * WORLD
    assert ours == run_on_threads(_same_size_on, "torch", world_size=WORLD) == expected


def _gather_on(name: str, mesh_shape: tuple[int, ...]) -> list[tuple[Any, ...]]:
    api, init_device_mesh = _api(name)
    mesh = init_device_mesh("cpu", mesh_shape)
    generator = torch.Generator().manual_seed(0)
    full = torch.randn(12, 8, 16, generator=generator)
    one_per_row = torch.randint(8, (4, 1, 8), generator=generator)
    several_per_row = torch.randint(8, (4, 3, 8), generator=generator)
    layouts = (
        [[api.Shard(1)], [api.Shard(0)], [api.Replicate()]]
        if mesh_shape == (WORLD,)
        else [[api.Shard(1), api.Shard(1)], [api.Shard(1), api.Shard(2)], [api.Shard(0), api.Shard(1)]]
    )
    seen = []
    for placements in layouts:
        for index in (one_per_row, several_per_row):
            x = api.distribute_tensor(full, mesh, placements)
            i = api.distribute_tensor(index, mesh, [api.Replicate()] * mesh.ndim)
            try:
                with api.debug.CommDebugMode() as comm:
                    y = torch.gather(x, 1, i)
            except RuntimeError as error:  # PyTorch 2.13 on some nested layouts ("MaskBuffer ... conflicting")
                seen.append((_describe(placements), tuple(index.shape), type(error).__name__, None, False))
                continue
            kinds = ",".join("P" if p.is_partial() else ("R" if p.is_replicate() else f"S{p.dim}") for p in y.placements)
            correct = torch.equal(y.full_tensor(), torch.gather(full, 1, index))
            seen.append((_describe(placements), tuple(index.shape), kinds, comm.get_total_counts(), correct))
    return seen


@pytest.mark.parametrize("mesh_shape", [(WORLD,), (2, 2)])
def test_gather_of_one_position_per_row_stays_local_as_pytorch(mesh_shape: tuple[int, ...]) -> None:
    ours = run_on_threads(_gather_on, "shardwise", mesh_shape, world_size=WORLD)
    theirs = run_on_threads(_gather_on, "torch", mesh_shape, world_size=WORLD)
    assert all(correct for rank in ours for *_, correct in rank)
    # Where PyTorch 2.13 answers right, the same placements and at most its collectives (nested shards
    # gathered whole: one all-to-all over both mesh dims where PyTorch all-gathers per dim); where it does
    # not (a row-sharded self with fewer index rows: sharded output of wrong values; nested shards of the
    # gathered dim: an error), shardwise answers right anyway (checked above).
    compared = [(mine, oracle) for mine, oracle in zip(ours[0], theirs[0]) if oracle[-1]]
    assert compared and all(mine[:3] == oracle[:3] and mine[3] <= oracle[3] for mine, oracle in compared)
    rows = {(layout, shape): (kinds, count) for layout, shape, kinds, count, _ in ours[0]}
    if mesh_shape == (WORLD,):
        assert rows[("S1", (4, 1, 8))] == ("P", 0)  # picked locally, summed later
        assert rows[("S1", (4, 3, 8))] == ("R", 1)  # several positions per row: self gathered first
    else:
        assert rows[("S1,S1", (4, 1, 8))] == ("P,P", 0)


def _gather_backward_and_bad_index(_: None = None) -> tuple[bool, str]:
    from shardwise.dtensor_ops import Replicate, Shard, distribute_tensor
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    full = torch.arange(24.0).reshape(2, 12).requires_grad_()
    index = torch.tensor([[5], [11]])
    x = distribute_tensor(full.detach(), mesh, [Shard(1)]).requires_grad_()
    picked = torch.gather(x, 1, distribute_tensor(index, mesh, [Replicate()]))
    (picked.full_tensor() * torch.tensor([[2.0], [3.0]])).sum().backward()
    (torch.gather(full, 1, index) * torch.tensor([[2.0], [3.0]])).sum().backward()
    assert x.grad is not None and full.grad is not None
    same_gradient = torch.equal(x.grad.full_tensor(), full.grad)
    with pytest.raises(RuntimeError) as raised:
        torch.gather(x, 1, distribute_tensor(torch.tensor([[12], [0]]), mesh, [Replicate()]))
    return same_gradient, str(raised.value)


def test_masked_gather_has_the_plain_gradient_and_rejects_bad_positions_on_every_rank() -> None:
    for same_gradient, message in run_on_threads(_gather_backward_and_bad_index, world_size=WORLD):
        assert same_gradient
        assert "index out of bounds for dimension 1 with size 12" in message


def _histc_on(name: str) -> list[tuple[Any, ...]]:
    api, init_device_mesh = _api(name)
    mesh = init_device_mesh("cpu", (WORLD,))
    full = torch.randn(12, 8, 6, generator=torch.Generator().manual_seed(1))
    low, high = full.min().item(), full.max().item()
    seen = []
    for placements in ([api.Shard(0)], [api.Shard(1)], [api.Shard(2)], [api.Replicate()]):
        x = api.distribute_tensor(full, mesh, placements)
        for ranged in (True, False):
            with api.debug.CommDebugMode() as comm:
                counts = x.histc(bins=10, min=low, max=high) if ranged else x.histc(bins=10)
            expected = full.histc(bins=10, min=low, max=high) if ranged else full.histc(bins=10)
            correct = torch.equal(counts.full_tensor(), expected)
            seen.append((_describe(placements), ranged, _describe(counts.placements), comm.get_total_counts(), correct))
    return seen


def test_histc_with_a_range_counts_each_piece_as_pytorch() -> None:
    ours = run_on_threads(_histc_on, "shardwise", world_size=WORLD)
    assert ours == run_on_threads(_histc_on, "torch", world_size=WORLD)
    rows = {(layout, ranged): (out, count, correct) for layout, ranged, out, count, correct in ours[0]}
    assert rows[("S1", True)] == ("P(sum)", 0, True)  # counted locally, summed later
    assert rows[("S1", False)] == ("R", 1, True)  # the data's own range needs the whole tensor


def _fill_partial_on(name: str, mesh_shape: tuple[int, ...]) -> list[tuple[str, str, float]]:
    api, init_device_mesh = _api(name)
    mesh = init_device_mesh("cpu", mesh_shape)
    layouts = (
        [[api.Partial()], [api.Partial("max")], [api.Partial("avg")]]
        if mesh_shape == (WORLD,)
        else [[api.Partial(), api.Shard(0)], [api.Shard(1), api.Partial()], [api.Partial(), api.Partial()]]
    )
    seen = []
    for placements in layouts:
        pieces = api.distribute_tensor(
            torch.zeros(4, 8), mesh, [api.Replicate() if p.is_partial() else p for p in placements]
        ).to_local()
        x = api.DTensor.from_local(torch.randn(pieces.shape), mesh, placements, shape=(4, 8), stride=(8, 1))
        x.fill_(8.0)
        values = x.full_tensor()
        assert bool((values == values[0, 0]).all())
        seen.append((_describe(placements), _describe(x.placements), values[0, 0].item()))
    return seen


@pytest.mark.parametrize("mesh_shape", [(WORLD,), (2, 2)])
def test_fill_of_a_partial_sum_holds_the_value_once(mesh_shape: tuple[int, ...]) -> None:
    ours = run_on_threads(_fill_partial_on, "shardwise", mesh_shape, world_size=WORLD)
    theirs = run_on_threads(_fill_partial_on, "torch", mesh_shape, world_size=WORLD)
    # Placements kept as PyTorch keeps them; the value filled is 8 (PyTorch: 8 on every part of a sum,
    # so 8 times the number of parts).
    assert [row[:2] for row in ours[0]] == [row[:2] for row in theirs[0]]
    assert all(value == 8.0 for rank in ours for *_, value in rank)
    if mesh_shape == (WORLD,):
        assert theirs[0][0][2] == 8.0 * WORLD


def _foreach_norm_over_meshes(name: str) -> list[tuple[Any, ...]]:
    api, init_device_mesh = _api(name)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    generator = torch.Generator().manual_seed(0)
    fulls = [torch.randn(12, 8, generator=generator), torch.randn(8, 8, generator=generator), torch.randn(6, generator=generator)]
    tensors = [
        api.distribute_tensor(fulls[0], mesh["x"], [api.Shard(0)]),
        api.distribute_tensor(fulls[1], mesh["y"], [api.Replicate()]),
        api.distribute_tensor(fulls[2], mesh["x"], [api.Shard(0)]),
    ]
    with api.debug.CommDebugMode() as comm:
        norms = torch.ops.aten._foreach_norm(tensors, 2)
    expected = torch.ops.aten._foreach_norm(fulls, 2)
    return [
        *((str(norm.device_mesh.mesh_dim_names), _describe(norm.placements), torch.allclose(norm.full_tensor(), want))
          for norm, want in zip(norms, expected)),
        comm.get_total_counts(),
    ]  # fmt: skip


def test_foreach_norm_of_tensors_on_different_meshes_as_pytorch() -> None:
    ours = run_on_threads(_foreach_norm_over_meshes, "shardwise", world_size=WORLD)
    theirs = run_on_threads(_foreach_norm_over_meshes, "torch", world_size=WORLD)
    # Each norm on its tensor's mesh, as PyTorch's; shardwise reduces a sharded tensor's norm at once
    # (Replicate) where PyTorch leaves it pending (its _NormPartial, which shardwise has no placement for).
    assert [[(mesh, correct) for mesh, _, correct in rank[:-1]] for rank in ours] == [
        [(mesh, correct) for mesh, _, correct in rank[:-1]] for rank in theirs
    ]
    assert ours[0][:-1] == [("('x',)", "R", True), ("('y',)", "R", True), ("('x',)", "R", True)]
    assert ours[0][-1] == 1  # the two row-sharded tensors on mesh x: one all-reduce together


def _max_min_of_partials_on(name: str) -> list[tuple[Any, ...]]:
    api, init_device_mesh = _api(name)
    mesh = init_device_mesh("cpu", (WORLD,))
    rank = mesh.get_local_rank()
    # every rank's parts, made the same way on every rank, so each can check the reduced values
    parts = [torch.arange(16.0).reshape(4, 4).remainder(r + 3) - r for r in range(WORLD)]
    others = [torch.arange(16.0).reshape(4, 4).flip(0).remainder(r + 2) for r in range(WORLD)]
    reduced = {"max": (torch.stack(parts).amax(0), torch.stack(others).amax(0)),
               "min": (torch.stack(parts).amin(0), torch.stack(others).amin(0))}  # fmt: skip
    shift = torch.full((4, 4), 2.0)
    seen = []
    for op, kind, with_partial_other in [
        (torch.maximum, "max", True), (torch.minimum, "min", True), (torch.maximum, "min", False),
        (torch.minimum, "max", False), (torch.maximum, "min", True),
    ]:  # fmt: skip
        a = api.DTensor.from_local(parts[rank], mesh, [api.Partial(kind)])
        b = (
            api.DTensor.from_local(others[rank], mesh, [api.Partial(kind)])
            if with_partial_other
            else api.distribute_tensor(shift, mesh, [api.Replicate()])
        )
        with api.debug.CommDebugMode() as comm:
            out = op(a, b)
        whole_a, whole_b = reduced[kind]
        expected = op(whole_a, whole_b if with_partial_other else shift)
        correct = torch.equal(out.full_tensor(), expected)
        seen.append((op.__name__, kind, with_partial_other, _describe(out.placements), comm.get_total_counts(), correct))
    return seen


def test_maximum_and_minimum_keep_partial_max_and_min_where_the_reduction_passes_through() -> None:
    ours = run_on_threads(_max_min_of_partials_on, "shardwise", world_size=WORLD)
    theirs = run_on_threads(_max_min_of_partials_on, "torch", world_size=WORLD)
    assert all(correct for rank in ours for *_, correct in rank)
    rows = {row[:3]: row[3:5] for row in ours[0]}
    assert rows[("maximum", "max", True)] == ("P(max)", 0) == theirs[0][0][3:5]
    assert rows[("minimum", "min", True)] == ("P(min)", 0) == theirs[0][1][3:5]
    assert rows[("maximum", "min", False)] == ("P(min)", 0)  # one partial operand: any order kind passes
    assert rows[("minimum", "max", False)] == ("P(max)", 0)
    # Two min-partials under maximum: one of them is reduced first (one all-reduce), then the other passes.
    assert rows[("maximum", "min", True)] == ("P(min)", 1)
