"""``shardwise.dtensor_ops.random``: seeding for random ops on DTensors (drop-in for ``torch.distributed.tensor.random``).

Random ops on DTensors draw per shard from the ranks' own generators, which must
be in the same state on every rank of the mesh: seed them alike with
:func:`manual_seed` (or ``torch.manual_seed(seed)`` on every rank). See the
package README, "Random ops", for what holds on CPU and on CUDA.
"""

from ._random import is_rng_supported_mesh, manual_seed

__all__ = ["is_rng_supported_mesh", "manual_seed"]
