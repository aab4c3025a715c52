"""shardwise.tp_styles: tensor and sequence parallelism for nn.Modules (drop-in for
``torch.distributed.tensor.parallel``, PyTorch 2.13).

``parallelize_module(model, mesh, plan)`` applies parallel styles
(``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``, ``PrepareModuleOutput``, ``PrepareModuleInputOutput``) to
submodules chosen by path; ``loss_parallel()`` computes cross-entropy on logits
sharded on the class dim without gathering them. ``auto_plan`` / ``auto_parallelize``
choose the whole plan (TP regions, sequence and loss parallelism, FSDP units, CP) from
one fake-tensor trace and the cost model.
"""

from . import _context_parallel_style  # noqa: F401  (registers _ContextParallel as a ParallelStyle)
from .api import parallelize_module
from .auto_plan import (
    AutoPlan,
    AutoPlanError,
    DataDependentControlFlowError,
    ExampleInputMismatchError,
    UnsupportedModelError,
    auto_parallelize,
    auto_plan,
)
from .loss import loss_parallel
from .style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "AutoPlan",
    "AutoPlanError",
    "ColwiseParallel",
    "DataDependentControlFlowError",
    "ExampleInputMismatchError",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "UnsupportedModelError",
    "auto_parallelize",
    "auto_plan",
    "loss_parallel",
    "parallelize_module",
]
