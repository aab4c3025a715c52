"""The planner's C++ search (``_plan_search_ext``) returns exactly the Python search's plans.

The Python search (``_redistribute_plan._search_in_python``) is the reference: on random problems
(meshes of 1 to 4 dims with dims of size 1, uneven and empty tensor dims, 0-d tensors, every Partial
kind and ``_MaskPartial``, item sizes 1 to 8) and under several prices (bytes, the gloo and NCCL
profiles, prices built to tie), both return the same steps: same order, kinds, bytes, placements
(the very objects), so ties are broken alike. Under Bazel the module is the one //dtensor_ops
packages; outside it, the one ``python dtensor_ops/csrc/build.py`` writes into the package, and the
comparisons skip where it is not built.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

from shardwise.dtensor_ops._cost_model import StepPricer
from shardwise.dtensor_ops._options import use_options
from shardwise.dtensor_ops._planner import native_search, search as planner
from shardwise.dtensor_ops._planner.native_search import (
    PLAN_SEARCH_ENV_VAR,
    PLAN_SEARCH_EXT_ENV_VAR,
    _plan_search_extension,
    _search_in_cpp,
)
from shardwise.dtensor_ops._planner.search import _candidates, _search_in_python, find_cheapest_plan
from shardwise.dtensor_ops._planner.steps import Placements, RedistributeStep, StepKind
from shardwise.mesh._cost_profile import BUILTIN_PROFILES, COLLECTIVE_KINDS, CollectiveCost, CostProfile
from shardwise.placement import Partial, Placement, Replicate, Shard, _MaskPartial

EXTENSION = _plan_search_extension()
needs_extension = pytest.mark.skipif(
    EXTENSION is None, reason="_plan_search_ext is not built (python dtensor_ops/csrc/build.py)"
)


@dataclass(frozen=True)
class ShapeMesh:
    shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None = None

    @property
    def mesh(self) -> torch.Tensor:
        """The rank grid (torchrun's row-major layout), which tells the profile which groups span nodes."""
        return torch.arange(math.prod(self.shape)).reshape(self.shape)


Price = Callable[[StepKind, tuple[int, ...], int, int], int]

# Costs that differ by dim and across nodes: mesh dim 1 calibrated on its own, groups spanning
# nodes of 4 ranks priced by the inter-node table.
_UNEVEN = CostProfile(
    name="uneven",
    source="test",
    costs={kind: CollectiveCost(3e-5 + 1e-6 * i, 1.7e9 + 3e8 * i, alpha_per_peer_s=2e-7) for i, kind in enumerate(COLLECTIVE_KINDS)},
    inter_node_costs={"all_gather": CollectiveCost(9e-5, 2.1e8), "all_to_all": CollectiveCost(7.7e-5, 3.3e8)},
    dim_costs={"1": {"all_reduce": CollectiveCost(1.3e-5, 9.1e9, measured_alpha_s=((2, 4e-6),)), "local_copy": CollectiveCost(1e-7, 3e10)}},
    ranks_per_node=4,
)


def _prices(mesh_shape: tuple[int, ...]) -> dict[str, Price | None]:
    mesh = ShapeMesh(mesh_shape)
    return {
        "bytes": None,
        "gloo": StepPricer(mesh, BUILTIN_PROFILES["gloo-loopback"]).step_picoseconds,
        "nccl": StepPricer(mesh, BUILTIN_PROFILES["nccl"]).step_picoseconds,
        # The pricers themselves: the C++ search prices from their terms (one_dim_price_terms), the
        # Python one by calling them.
        "gloo terms": StepPricer(mesh, BUILTIN_PROFILES["gloo-loopback"]),
        "nccl terms": StepPricer(mesh, BUILTIN_PROFILES["nccl"]),
        "uneven terms": StepPricer(mesh, _UNEVEN),
        # Every collective costs the same: plans tie on price and are told apart by the later keys.
        "latency only": lambda kind, dims, nbytes, copied: 5 if kind.is_collective else 0,
        # Everything is free: only collectives, bytes and step counts, then exploration order, decide.
        "free": lambda kind, dims, nbytes, copied: 0,
        "per dim": lambda kind, dims, nbytes, copied: (dims[0] + 1) * 1000 + nbytes // 64 + copied // 512,
    }


def _random_placement(rng: random.Random, tensor_ndim: int) -> Placement:
    roll = rng.random()
    if roll < 0.25 or (tensor_ndim == 0 and roll < 0.6):
        return Replicate()
    if roll < 0.6:
        return Shard(rng.randrange(tensor_ndim))
    if roll < 0.95:
        return Partial(rng.choice(("sum", "sum", "avg", "max", "min")))
    return _MaskPartial(offset_shape=None, offset_dim=0)


def _random_problem(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...], Placements, Placements, int]:
    mesh_ndim = rng.randint(1, 4)
    while True:
        mesh_shape = tuple(rng.choice((1, 2, 2, 3, 4, 5, 8)) for _ in range(mesh_ndim))
        if math.prod(mesh_shape) <= 512:
            break
    # Up to 3 tensor dims (2 on 4-D meshes, where the reference's state space grows as 5^4).
    tensor_ndim = rng.choice((0, 1, 2, 2, 3) if mesh_ndim < 4 else (0, 1, 2, 2))
    global_shape = tuple(rng.choice((0, 1, 2, 3, 5, 7, 8, 13, 64, 1000, 4096)) for _ in range(tensor_ndim))
    while True:
        src = tuple(_random_placement(rng, tensor_ndim) for _ in mesh_shape)
        dst = tuple(_random_placement(rng, tensor_ndim) for _ in mesh_shape)
        if src != dst:
            return global_shape, mesh_shape, src, dst, rng.choice((1, 2, 4, 8))


def _assert_same_plan(got: tuple[RedistributeStep, ...] | None, expected: tuple[RedistributeStep, ...], problem: Any) -> None:
    assert got is not None, f"the C++ search declined {problem}"
    assert got == expected, f"{problem}:\nC++:    {[str(s) for s in got]}\nPython: {[str(s) for s in expected]}"
    # The placements are the objects the Python search puts there (src's own until a dim changes).
    for ours, reference in zip(got, expected):
        assert ours.before is reference.before and ours.after is reference.after, (problem, ours, reference)


def _compare(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: Placements, dst: Placements, itemsize: int, price: Price | None) -> tuple[RedistributeStep, ...]:
    assert EXTENSION is not None
    candidates = _candidates(src, dst, len(global_shape))
    expected = _search_in_python(global_shape, mesh_shape, src, dst, itemsize, candidates, [], price)
    got = _search_in_cpp(EXTENSION, global_shape, mesh_shape, src, dst, itemsize, candidates, price)
    _assert_same_plan(got, expected, (global_shape, mesh_shape, src, dst, itemsize))
    return expected


def test_the_packaged_module_is_the_one_the_planner_uses() -> None:
    if not os.environ.get("TEST_SRCDIR"):
        pytest.skip("outside Bazel the module is whatever build.py last wrote (or none)")
    # Under Bazel //dtensor_ops packages the genrule's output (native_modules): it must load, from there.
    assert EXTENSION is not None, "shardwise/dtensor_ops/_plan_search_ext.so did not load"
    assert EXTENSION.__file__ is not None
    assert EXTENSION.__file__.endswith(os.path.join("shardwise", "dtensor_ops", "_plan_search_ext.so")), EXTENSION.__file__
    assert not os.environ.get(PLAN_SEARCH_EXT_ENV_VAR)


@needs_extension
@pytest.mark.parametrize("seed", range(4))
def test_random_problems_get_the_reference_plans(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        global_shape, mesh_shape, src, dst, itemsize = _random_problem(rng)
        for price in _prices(mesh_shape).values():
            _compare(global_shape, mesh_shape, src, dst, itemsize, price)


@needs_extension
@pytest.mark.parametrize("mesh_shape", [(4, 4, 4), (64, 64, 4), (8, 8, 8, 8), (16, 16, 8, 8), (4, 4, 2, 2)])
def test_the_benchmark_problems_get_the_reference_plans(mesh_shape: tuple[int, ...]) -> None:
    # bench_mesh_scale's move: every mesh dim changes, Shard(i % 2) -> Shard((i + 1) % 2) of 4096x4096 fp32.
    src = tuple(Shard(i % 2) for i in range(len(mesh_shape)))
    dst = tuple(Shard((i + 1) % 2) for i in range(len(mesh_shape)))
    for price in _prices(mesh_shape).values():
        plan = _compare((4096, 4096), mesh_shape, src, dst, 4, price)
        assert len(plan) >= len(mesh_shape)


@needs_extension
def test_find_cheapest_plan_takes_the_cpp_search_without_joint_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the Python search ran")

    src, dst = (Shard(0), Shard(1), Partial()), (Shard(1), Replicate(), Shard(0))
    expected = find_cheapest_plan((64, 48), (4, 2, 3), src, dst, 4)
    monkeypatch.setattr(planner, "_search_in_python", refuse)
    assert find_cheapest_plan((64, 48), (4, 2, 3), src, dst, 4) == expected
    # Joint steps are searched in Python only, on meshes of at most 16 ranks; larger meshes stay in C++.
    assert find_cheapest_plan((64, 48), (4, 2, 3), src, dst, 4, allow_joint_steps=True) == expected
    with pytest.raises(AssertionError, match="the Python search ran"):
        find_cheapest_plan((64, 48), (2, 2, 2), src, dst, 4, allow_joint_steps=True)


@needs_extension
def test_what_the_cpp_search_cannot_reproduce_goes_to_the_python_search() -> None:
    src, dst = (Shard(0), Replicate()), (Replicate(), Shard(0))
    # A price that is not an int: the Python search adds what it gets.
    as_float: Price = lambda kind, dims, nbytes, copied: 1.5 if kind.is_collective else 0.25  # type: ignore[assignment,return-value]
    candidates = _candidates(src, dst, 2)
    assert _search_in_cpp(EXTENSION, (8, 8), (2, 2), src, dst, 4, candidates, as_float) is None  # type: ignore[arg-type]
    assert find_cheapest_plan((8, 8), (2, 2), src, dst, 4, step_price=as_float) == _search_in_python(
        (8, 8), (2, 2), src, dst, 4, candidates, [], as_float
    )
    # Bytes past 64 bits: Python's integers do not overflow.
    huge = (2**61, 8)
    assert EXTENSION is not None
    assert _search_in_cpp(EXTENSION, huge, (2, 2), src, dst, 8, candidates, None) is None
    assert find_cheapest_plan(huge, (2, 2), src, dst, 8) == _search_in_python(huge, (2, 2), src, dst, 8, candidates, [], None)


@needs_extension
def test_a_pricer_is_priced_in_cpp_without_calling_back(monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = (Shard(0), Shard(1), Partial()), (Shard(1), Replicate(), Shard(0))
    pricer = StepPricer(ShapeMesh((4, 2, 3)), _UNEVEN)
    expected = _search_in_python((64, 48), (4, 2, 3), src, dst, 4, _candidates(src, dst, 2), [], pricer)

    def refuse(*args: object) -> None:
        raise AssertionError("the C++ search called the pricer back")

    monkeypatch.setattr(StepPricer, "__call__", refuse)
    monkeypatch.setattr(StepPricer, "step_picoseconds", refuse)
    assert find_cheapest_plan((64, 48), (4, 2, 3), src, dst, 4, step_price=pricer) == expected


def test_price_terms_are_the_pricers_picoseconds_to_the_last_one() -> None:
    # The formula plan_search.cpp applies to a row of terms (the same double operations in the same
    # order, built without FMA contraction) gives step_picoseconds exactly, per kind code, with and
    # without local copies.
    rng = random.Random(7)
    for _ in range(200):
        size = rng.choice((1, 2, 3, 4, 8))
        pricer = StepPricer(ShapeMesh((size,)), rng.choice((_UNEVEN, BUILTIN_PROFILES["nccl"], BUILTIN_PROFILES["gloo-loopback"])))
        row = pricer.one_dim_price_terms(native_search._CPP_PRICED_KINDS)[0]
        copy_term = row[len(native_search._CPP_STEP_KINDS)]
        assert copy_term is not None
        for code, kind in enumerate(native_search._CPP_STEP_KINDS):
            nbytes = 0 if not kind.is_collective else rng.randrange(0, 2 ** rng.randrange(1, 50))
            copied = rng.choice((0, rng.randrange(1, 2 ** rng.randrange(1, 40))))
            term = row[code]
            if kind.is_collective:
                seconds = 0.0 if term is None else term[0] + nbytes / term[1]
                if copied:
                    seconds += copy_term[0] + copied / copy_term[1]
            else:
                seconds = 0.0 if term is None else term[0] + (nbytes + copied) / term[1]
            assert round(seconds * 1e12) == pricer.step_picoseconds(kind, (0,), nbytes, copied), (kind, nbytes, copied, term)


@needs_extension
def test_a_failing_price_fails_the_plan_as_in_python() -> None:
    def broken(kind: StepKind, dims: tuple[int, ...], nbytes: int, copied: int) -> int:
        raise ValueError(f"no price for {kind.value} on {dims}")

    with pytest.raises(ValueError, match="no price for"):
        find_cheapest_plan((8, 8), (2, 2), (Shard(0), Shard(1)), (Replicate(), Replicate()), 4, step_price=broken)


def test_the_python_search_can_be_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    # By the environment override of the plan_search option, read when the planner asks...
    monkeypatch.setenv(PLAN_SEARCH_ENV_VAR, "python")
    assert _plan_search_extension() is None
    monkeypatch.setenv(PLAN_SEARCH_ENV_VAR, "fortran")
    with pytest.raises(ValueError, match="SHARDWISE_PLAN_SEARCH='fortran': expected 'cpp' or 'python'"):
        _plan_search_extension()
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"option plan_search='fortran': expected one of \['cpp', 'python'\]"):
        with use_options(plan_search="fortran"):
            pass
    assert _plan_search_extension() is EXTENSION
    # ... or by the option itself, on this thread only.
    with use_options(plan_search="python"):
        assert _plan_search_extension() is None
        assert find_cheapest_plan((8, 8), (2, 2), (Shard(0), Shard(1)), (Replicate(), Replicate()), 4)
    assert _plan_search_extension() is EXTENSION
