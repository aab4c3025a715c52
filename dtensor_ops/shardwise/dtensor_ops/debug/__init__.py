"""shardwise.dtensor_ops.debug: drop-in for ``torch.distributed.tensor.debug``.

* :class:`CommDebugMode` counts (and traces, per module and pass) the collectives
  run inside a ``with`` block, including those DTensor issues internally.
* :func:`visualize_sharding` prints which device holds which region of a 1-D or
  2-D DTensor.
"""

from ._comm_keys import CommCounts, canonical_comm_key
from ._comm_mode import CommDebugMode
from ._visualize_sharding import format_sharding_table, visualize_sharding

__all__ = ["CommDebugMode", "CommCounts", "canonical_comm_key", "visualize_sharding", "format_sharding_table"]
