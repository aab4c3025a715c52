"""The search over one-dim steps in C++ (optional), the same plans as ``search._search_in_python``.

Where no joint step is searched, the search runs in C++ when the optional ``_plan_search_ext``
module is built (``dtensor_ops/csrc/plan_search.cpp``, ``python dtensor_ops/csrc/build.py``): a
port of the Python search (``_search_in_python``, the reference and the fallback) that returns the
same plans, ties included, 10-40x faster on 3-D and 4-D meshes (tools/README.md,
``bench_mesh_scale``).  ``SHARDWISE_PLAN_SEARCH=python`` turns it off.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Sequence

from shardwise.placement import Partial, Placement, Replicate, Shard

from .._cost_model import priced_kind
from .._options import ENVIRONMENT_OVERRIDES, current_options
from .steps import _LINEAR_REDUCE_OPS, Placements, RedistributeStep, StepKind, StepPrice

# The environment overrides of the plan_search / plan_search_ext options (``_options``).
PLAN_SEARCH_ENV_VAR = ENVIRONMENT_OVERRIDES["plan_search"]
PLAN_SEARCH_EXT_ENV_VAR = ENVIRONMENT_OVERRIDES["plan_search_ext"]
# The interface of dtensor_ops/csrc/plan_search.cpp this module speaks (its kInterfaceVersion).
_PLAN_SEARCH_INTERFACE_VERSION = 3
# plan_search.cpp's Kind codes, in order.
_CPP_STEP_KINDS = (
    StepKind.ALL_GATHER,
    StepKind.ALL_REDUCE,
    StepKind.REDUCE_SCATTER,
    StepKind.ALL_TO_ALL,
    StepKind.LOCAL_CHUNK,
    StepKind.LOCAL_PARTIAL,
    StepKind.SHARD_TO_PARTIAL,
    StepKind.RELABEL,
)
_CPP_STEP_KINDS_LIST = list(_CPP_STEP_KINDS)
# The collective kind that prices each (None: free), as StepPricer.one_dim_price_terms takes them.
_CPP_PRICED_KINDS = tuple(priced_kind(kind) for kind in _CPP_STEP_KINDS)
# Sizes the C++ search takes (its integers are 64-bit; larger ones go to the Python search).
_CPP_MAX_SIZE = 2**62


def _plan_search_extension() -> ModuleType | None:
    """The compiled ``_plan_search_ext`` (``dtensor_ops/csrc/plan_search.cpp``), or None: search in Python.

    None where it is not built (a source checkout without ``python dtensor_ops/csrc/build.py``,
    another platform), built from another interface version, or switched off by the ``plan_search``
    option (``SHARDWISE_PLAN_SEARCH=python``). The ``plan_search_ext`` option
    (``SHARDWISE_PLAN_SEARCH_EXT=<path>``) loads a built module from that path (a Bazel output, which
    does not sit inside the package).
    """
    options = current_options()
    if options.plan_search == "python":
        return None
    return _load_plan_search_extension(options.plan_search_ext)


@functools.cache
def _load_plan_search_extension(path: str | None) -> ModuleType | None:
    name = __name__.rpartition(".")[0] + "._plan_search_ext"
    try:
        if path and name not in sys.modules:
            loader = importlib.machinery.ExtensionFileLoader(name, path)
            module_spec = importlib.util.spec_from_file_location(name, path, loader=loader)
            if module_spec is None:
                return None
            module = importlib.util.module_from_spec(module_spec)
            loader.exec_module(module)
            sys.modules[name] = module
        else:
            module = importlib.import_module(name)
    except ImportError:
        return None
    if getattr(module, "INTERFACE_VERSION", None) != _PLAN_SEARCH_INTERFACE_VERSION:
        return None
    return module


def _index_of(options: Sequence[Placement], placement: Placement) -> int:
    """Where ``placement`` is among ``options``: by identity first (``_candidates`` puts src's and
    dst's own objects there), so no placement ``__eq__`` runs in the common case."""
    for index, option in enumerate(options):
        if option is placement:
            return index
    return list(options).index(placement)


def _search_in_cpp(
    extension: ModuleType,
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    src: Placements,
    dst: Placements,
    itemsize: int,
    candidates: Sequence[Sequence[Placement]],
    step_price: StepPrice | None,
) -> tuple[RedistributeStep, ...] | None:
    """``_search_in_python`` over one-dim steps (no joint steps), in C++; None where it cannot run it.

    The same plan, ties included (``test_plan_search_ext`` compares them on random problems).
    ``step_price`` is called once per distinct (kind, mesh dim, bytes, copied bytes), so it must be pure; where it
    returns something other than an int, or a sum leaves 64 bits, None (the Python search decides).
    """
    if (
        type(itemsize) is not int
        or itemsize >= _CPP_MAX_SIZE
        or any(type(size) is not int or not 1 <= size < _CPP_MAX_SIZE for size in mesh_shape)
        or any(type(size) is not int or not 0 <= size < _CPP_MAX_SIZE for size in global_shape)
    ):
        return None
    reduce_ops: dict[str, int] = {"sum": 0}  # plan_search.cpp's kSumOp: a sum's local split copies
    encoded = []
    for options in candidates:
        row = []
        for placement in options:
            if isinstance(placement, Shard):
                row.append((1, placement.dim, 0, False))
            elif isinstance(placement, Replicate):
                row.append((0, 0, 0, False))
            else:
                assert isinstance(placement, Partial)
                op = placement.reduce_op
                row.append((2, 0, reduce_ops.setdefault(op, len(reduce_ops)), op in _LINEAR_REDUCE_OPS))
        encoded.append(row)
    src_indices = [_index_of(options, placement) for options, placement in zip(candidates, src)]
    dst_indices = [_index_of(options, placement) for options, placement in zip(candidates, dst)]
    # A pricer that gives its prices as numbers is priced in C++ (StepPricer.one_dim_price_terms).
    terms_of = getattr(step_price, "one_dim_price_terms", None)
    found = extension.search(
        list(mesh_shape),
        list(global_shape),
        itemsize,
        encoded,
        src_indices,
        dst_indices,
        step_price,
        _CPP_STEP_KINDS_LIST,
        None if terms_of is None else terms_of(_CPP_PRICED_KINDS),
    )
    if found is None:
        return None
    # Each step's ``before`` is the object the Python search has there: src's own until the dim changes.
    current = list(src)
    steps = []
    for mesh_dim, after_index, kind_code, moved, copied in found:
        after = candidates[mesh_dim][after_index]
        steps.append(
            RedistributeStep(mesh_dim, current[mesh_dim], after, _CPP_STEP_KINDS[kind_code], moved, local_copy_bytes=copied)
        )
        current[mesh_dim] = after
    return tuple(steps)

