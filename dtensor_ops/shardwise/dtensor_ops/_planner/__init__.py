"""The redistribution planner: the cheapest sequence of steps between two layouts.

Pure: no tensors, no communication.  Modules, bottom first:

* ``steps``: the model (states, ``StepKind``, ``RedistributeStep``, one-mesh-dim steps' validity, bytes
  and local copies);
* ``joint_steps``: steps over the joint group of several mesh dims;
* ``search``: the uniform-cost search over one problem (``find_cheapest_plan``) and the greedy baseline;
* ``lower_bound``: what any algorithm must move;
* ``size_one_dims``: planning without the mesh dims of size 1;
* ``strided_steps``: steps into and out of ``_StridedShard`` layouts;
* ``plans``: plans for specs (``plan_redistribute``, cached) and what a redistribution costs.
"""

from .joint_steps import joint_collective_dims, joint_step_bytes_per_rank, joint_transition_kind
from .lower_bound import lower_bound_bytes_per_rank
from .plans import (
    check_redistribute_specs,
    mesh_supports_joint_steps,
    plan_redistribute,
    redistribute_cost_bytes,
    redistribute_cost_picoseconds,
    redistribute_lower_bound_bytes,
)
from .search import find_cheapest_plan, naive_greedy_plan
from .size_one_dims import find_cheapest_plan_without_size_one_dims, lift_plan, relabel_size_one_dims, without_size_one_dims
from .steps import (
    Placements,
    RedistributeStep,
    StepKind,
    StepPrice,
    local_copy_bytes,
    plan_bytes_per_rank,
    plan_states,
    reduce_ops_commute,
    step_bytes_per_rank,
    transition_kind,
)
from .strided_steps import largest_piece_shape, run_indices, run_length, strided_gather_dim

__all__ = [
    "StepKind",
    "RedistributeStep",
    "Placements",
    "StepPrice",
    "transition_kind",
    "step_bytes_per_rank",
    "local_copy_bytes",
    "joint_transition_kind",
    "joint_step_bytes_per_rank",
    "joint_collective_dims",
    "mesh_supports_joint_steps",
    "find_cheapest_plan",
    "find_cheapest_plan_without_size_one_dims",
    "relabel_size_one_dims",
    "lift_plan",
    "without_size_one_dims",
    "naive_greedy_plan",
    "plan_bytes_per_rank",
    "plan_states",
    "lower_bound_bytes_per_rank",
    "reduce_ops_commute",
    "plan_redistribute",
    "redistribute_cost_bytes",
    "redistribute_cost_picoseconds",
    "redistribute_lower_bound_bytes",
    "check_redistribute_specs",
    "largest_piece_shape",
    "run_indices",
    "run_length",
    "strided_gather_dim",
]
