"""What ``auto_plan`` chooses among: the planning problem of one model on one mesh, its candidate plans, and
each candidate stated as parallel styles.

``build_problem`` traces the model once (``_auto_trace``), finds its structure (``_auto_structure``) and reads
the mesh's ``tp`` / ``dp`` / ``cp`` dims; ``enumerate_candidates`` yields every consistent ``PlanChoice`` (blocks
of one kind share their choices, tied weights are cut alike); ``style_specs`` states a choice as the
``{module path: StyleSpec}`` plan ``parallelize_module`` takes. Pricing a choice is ``_auto_price_choice``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.placement import Placement, Replicate, Shard

from ._auto_cost import ComputeProfile, LayoutPricer, default_compute_profile
from ._auto_structure import _SEQUENCE_DIM, ModelStructure, Region, analyse_structure
from ._auto_trace import ModelTrace, trace_forward
from .style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "MeshDims",
    "PlanChoice",
    "PlanningMesh",
    "PlanningProblem",
    "StyleSpec",
    "block_index_pattern",
    "build_problem",
    "embedding_layout",
    "enumerate_candidates",
    "prepared_at_parent",
    "read_mesh_dims",
    "region_kind",
    "style_specs",
]

# What planning reads from a mesh: shape, ndim, mesh_dim_names, device_type (a DeviceMesh, or shardwise.testing's
# FakeMesh to plan for a mesh this process is not part of); applying a plan needs a DeviceMesh.
PlanningMesh = Any

_STYLE_CLASSES: dict[str, type[ParallelStyle]] = {
    "ColwiseParallel": ColwiseParallel,
    "RowwiseParallel": RowwiseParallel,
    "SequenceParallel": SequenceParallel,
    "PrepareModuleInput": PrepareModuleInput,
}


def _placement_source(placement: Placement | None) -> str:
    if placement is None:
        return "None"
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    return repr(placement)


def _value_source(value: Any) -> str:
    if isinstance(value, tuple):
        inner = ", ".join(_value_source(item) for item in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, Placement):
        return _placement_source(value)
    return repr(value)


@dataclasses.dataclass(frozen=True)
class StyleSpec:
    """A parallel style as data: it builds the style and prints as the Python that builds it."""

    name: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    def build(self) -> ParallelStyle:
        return _STYLE_CLASSES[self.name](**dict(self.kwargs))

    def source(self) -> str:
        arguments = ", ".join(f"{key}={_value_source(value)}" for key, value in self.kwargs)
        return f"{self.name}({arguments})"


@dataclasses.dataclass(frozen=True)
class PlanChoice:
    """One candidate: every decision the planner makes (see the module doc)."""

    sequence_parallel: bool
    region_modes: tuple[tuple[str, str], ...]  # (region kind, "tensor_parallel" | "replicate")
    embedding_modes: tuple[tuple[str, str], ...]  # (embedding FQN, "vocabulary" | "feature" | "replicate")
    head_mode: str  # "loss_parallel" | "gathered" | "replicate" | "none"
    prepare_region_inputs: bool = True  # lay a region's input out once at its parent module, not per entry
    fsdp_units: str = "none"  # "none" | "blocks" | "root"
    reshard_after_forward: bool = True
    context_parallel: bool = False

    def describe(self) -> str:
        parts = [f"sequence parallel {'on' if self.sequence_parallel else 'off'}"]
        modes: dict[str, list[str]] = {}
        for kind, mode in self.region_modes:
            modes.setdefault(mode, []).append(kind)
        parts += [f"{mode.replace('_', ' ')}: {', '.join(kinds)}" for mode, kinds in modes.items()]
        parts += [f"{name} by {mode}" if mode != "replicate" else f"{name} replicated" for name, mode in self.embedding_modes]
        parts.append({"loss_parallel": "head by vocabulary, loss parallel", "gathered": "head by vocabulary, logits gathered",
                      "replicate": "head replicated", "none": "no head"}[self.head_mode])
        if not self.prepare_region_inputs:
            parts.append("region inputs laid out per entry")
        if self.fsdp_units != "none":
            parts.append(f"FSDP units: {self.fsdp_units}, reshard_after_forward={self.reshard_after_forward}")
        if self.context_parallel:
            parts.append("context parallel attention")
        return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class MeshDims:
    mesh: Any
    tp: int | None
    dp: int | None
    cp: int | None

    def size(self, dim: int | None) -> int:
        return 1 if dim is None else int(self.mesh.shape[dim])

    def sub_mesh(self, dim: int | None) -> Any:
        if dim is None:
            return None
        if self.mesh.ndim == 1:
            return self.mesh
        names = self.mesh.mesh_dim_names
        return self.mesh[names[dim]]


def read_mesh_dims(mesh: PlanningMesh) -> MeshDims:
    # Planning reads the mesh's shape, dim names and device type only (a FakeMesh plans too); applying slices it.
    if not all(hasattr(mesh, attribute) for attribute in ("shape", "ndim", "mesh_dim_names", "device_type")):
        raise TypeError(f"auto_plan: mesh must be a shardwise DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if not names:
        if mesh.ndim != 1:
            raise ValueError(
                f"auto_plan: a {mesh.ndim}-D mesh needs dim names among 'dp' (FSDP), 'cp' (context parallel) and "
                "'tp' (tensor parallel)"
            )
        return MeshDims(mesh, 0, None, None)
    unknown = [name for name in names if name not in ("dp", "cp", "tp")]
    if unknown:
        raise ValueError(
            f"auto_plan: mesh dims {names}: {unknown} unknown; name each dim 'dp' (FSDP), 'cp' (context parallel) "
            "or 'tp' (tensor parallel)"
        )
    return MeshDims(mesh, *(names.index(name) if name in names else None for name in ("tp", "dp", "cp")))



def block_index_pattern(name: str, structure: ModelStructure) -> str:
    """``layers.3.attention.wo`` -> ``layers.*.attention.wo`` when every block of that list is of one kind."""
    for block in structure.blocks:
        if name == block.fqn or name.startswith(block.fqn + "."):
            list_name = block.fqn.rsplit(".", 1)[0]
            siblings = [b for b in structure.blocks if b.fqn.rsplit(".", 1)[0] == list_name]
            if len({b.kind for b in siblings}) == 1:
                return f"{list_name}.*{name[len(block.fqn):]}"
            return name
    return name


def region_kind(region: Region, structure: ModelStructure) -> str:
    return block_index_pattern(region.exit, structure).rsplit(".", 1)[0] or region.exit


@dataclasses.dataclass(frozen=True)
class PlanningProblem:
    model_name: str
    trace: ModelTrace
    structure: ModelStructure
    dims: MeshDims
    compute: ComputeProfile
    loss_parallel_allowed: bool
    cost_profile: Any
    parameter_itemsize: int
    attention_key_value_bytes: tuple[tuple[str, int], ...]  # per attention module: its first call's key + value bytes
    pricer: LayoutPricer
    parameter_dtype: torch.dtype
    # What a styled layer moves depends on the layer and a few choices only: priced once per planning.
    memo: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def tp_size(self) -> int:
        return self.dims.size(self.dims.tp)

    @functools.cached_property
    def regions_by_kind(self) -> dict[str, list[Region]]:
        """Regions grouped by kind (blocks of one kind share their choices), in call order."""
        kinds: dict[str, list[Region]] = {}
        for region in self.structure.regions:
            kinds.setdefault(region_kind(region, self.structure), []).append(region)
        return kinds


def _embedding_size(problem: PlanningProblem, name: str) -> tuple[int, int]:
    weight = problem.trace.calls_of(name)[0].module.get_parameter("weight")
    return int(weight.shape[0]), int(weight.shape[1])


def enumerate_candidates(problem: PlanningProblem) -> Iterable[PlanChoice]:
    structure, tp = problem.structure, problem.tp_size
    kinds = sorted(problem.regions_by_kind)
    sp_options = [False]
    if tp > 1 and structure.sequence_parallel_refused is None:
        sp_options.append(True)
    embedding_options: list[list[str]] = []
    for name in structure.embeddings:
        vocabulary, width = _embedding_size(problem, name)
        options = ["replicate"]
        if tp > 1 and vocabulary % tp == 0:
            options.append("vocabulary")
        if tp > 1 and width % tp == 0:
            options.append("feature")
        embedding_options.append(options)
    head_options = ["none"]
    if structure.head is not None:
        out_features = int(problem.trace.calls_of(structure.head)[0].module.get_parameter("weight").shape[0])
        head_options = ["replicate"]
        if tp > 1 and out_features % tp == 0:
            head_options.append("gathered")
            if problem.loss_parallel_allowed:
                head_options.append("loss_parallel")
    fsdp_options: list[tuple[str, bool]] = [("none", True)]
    if problem.dims.dp is not None and problem.dims.size(problem.dims.dp) > 1:
        fsdp_options = [("root", False)] + ([("blocks", True), ("blocks", False)] if structure.blocks else [])
    context_parallel = problem.dims.cp is not None and problem.dims.size(problem.dims.cp) > 1
    tied_heads = _tied_embeddings(problem)
    for sp in sp_options:
        mode_sets = [["tensor_parallel"]] * len(kinds) if sp else [(["tensor_parallel", "replicate"] if tp > 1 else ["replicate"])] * len(kinds)
        for modes in itertools.product(*mode_sets):
            for embedding_modes in itertools.product(*embedding_options):
                for head_mode in head_options:
                    if sp and (head_mode == "replicate" or any(mode == "replicate" for mode in embedding_modes)):
                        continue  # a whole layer on a sequence-cut stream needs its own gathers; not a candidate
                    if not _tying_holds(structure, embedding_modes, head_mode, tied_heads):
                        continue
                    for units, reshard in fsdp_options:
                        yield PlanChoice(
                            sequence_parallel=sp,
                            region_modes=tuple(zip(kinds, modes)),
                            embedding_modes=tuple(zip(structure.embeddings, embedding_modes)),
                            head_mode=head_mode,
                            fsdp_units=units,
                            reshard_after_forward=reshard,
                            context_parallel=context_parallel,
                        )


def _tied_embeddings(problem: PlanningProblem) -> set[str]:
    """Embeddings whose weight is the head's: both must be cut the same way (by vocabulary) or both whole."""
    head = problem.structure.head
    tied: set[str] = set()
    if head is None:
        return tied
    for names in problem.structure.tied:
        owners = {name.rsplit(".", 1)[0] for name in names}
        if head in owners:
            tied |= owners & set(problem.structure.embeddings)
    return tied


def _tying_holds(structure: ModelStructure, embedding_modes: Sequence[str], head_mode: str, tied: set[str]) -> bool:
    for name, mode in zip(structure.embeddings, embedding_modes):
        if name in tied:
            head_cut = head_mode in ("loss_parallel", "gathered")
            if head_cut != (mode == "vocabulary") or (not head_cut and mode != "replicate"):
                return False
    return True




def prepared_at_parent(choice: PlanChoice, region: Region) -> bool:
    """Whether the region's input is laid out once at its parent module (several entries read it) rather than
    by each entry's own style (one entry: the same collectives, without the parent's extra DTensor)."""
    return choice.prepare_region_inputs and region.parent is not None and len(region.entries) > 1



def style_specs(problem: PlanningProblem, choice: PlanChoice) -> dict[str, StyleSpec]:
    structure = problem.structure
    stream: Placement = Shard(_SEQUENCE_DIM) if choice.sequence_parallel else Replicate()
    specs: dict[str, StyleSpec] = {}

    def put(name: str, spec: StyleSpec) -> None:
        specs.setdefault(block_index_pattern(name, structure), spec)

    for name, mode in choice.embedding_modes:
        if mode == "vocabulary":
            put(name, StyleSpec("RowwiseParallel", (("input_layouts", Replicate()), ("output_layouts", embedding_layout(problem, name, choice)))))
        elif mode == "feature":
            put(name, StyleSpec("ColwiseParallel", (("input_layouts", Replicate()), ("output_layouts", embedding_layout(problem, name, choice)))))
    modes = dict(choice.region_modes)
    for region in structure.regions:
        if modes[region_kind(region, structure)] != "tensor_parallel":
            continue
        prepared = prepared_at_parent(choice, region)
        if prepared:
            assert region.parent is not None
            call = problem.trace.calls_of(region.parent)[0]
            layouts = tuple(stream if index == region.parent_input_index else None for index in range(len(call.inputs)))
            desired = tuple(Replicate() if index == region.parent_input_index else None for index in range(len(call.inputs)))
            put(region.parent, StyleSpec("PrepareModuleInput", (("input_layouts", layouts), ("desired_input_layouts", desired))))
        for entry in region.entries:
            kwargs: tuple[tuple[str, Any], ...] = ()
            if not prepared and choice.sequence_parallel:
                kwargs += (("input_layouts", stream),)
            if region.needs_global_views:
                kwargs += (("use_local_output", False),)
            put(entry, StyleSpec("ColwiseParallel", kwargs))
        put(region.exit, StyleSpec("RowwiseParallel", (("output_layouts", stream),) if choice.sequence_parallel else ()))
    if choice.sequence_parallel:
        for name in structure.stream_modules:
            put(name, StyleSpec("SequenceParallel"))
    if structure.head is not None and choice.head_mode in ("loss_parallel", "gathered"):
        kwargs = (("input_layouts", stream),) if choice.sequence_parallel else ()
        if choice.head_mode == "loss_parallel":
            kwargs += (("output_layouts", Shard(-1)), ("use_local_output", False))
        else:
            kwargs += (("output_layouts", Replicate()),)
        put(structure.head, StyleSpec("ColwiseParallel", kwargs))
    return specs


def embedding_layout(problem: PlanningProblem, name: str, choice: PlanChoice) -> Placement:
    if not choice.sequence_parallel:
        return Replicate()
    return Shard(problem.structure.embedding_cut_dims[name])


def build_problem(
    model: nn.Module,
    mesh: PlanningMesh,
    example_inputs: tuple[Any, ...],
    loss_fn: Any,
    compute_profile: ComputeProfile | None,
    cost_profile: Any,
) -> PlanningProblem:
    dims = read_mesh_dims(mesh)
    if loss_fn not in (None, "cross_entropy", F.cross_entropy):
        raise ValueError(
            f"auto_plan: loss_fn {loss_fn!r}: expected None (the logits are returned whole) or F.cross_entropy / "
            "'cross_entropy' (then the logits may stay cut by vocabulary under loss_parallel)"
        )
    trace = trace_forward(model, example_inputs)
    structure = analyse_structure(model, trace, dims.size(dims.tp))
    if dims.cp is not None and dims.size(dims.cp) > 1 and structure.context_parallel_refused:
        raise ValueError(f"auto_plan: the mesh has a 'cp' dim but context parallelism cannot apply: {structure.context_parallel_refused}")
    parameters = list(model.parameters())
    itemsize = parameters[0].element_size() if parameters else 4
    parameter_dtype = parameters[0].dtype if parameters else torch.float32
    key_value: dict[str, int] = {}
    for op in trace.ops:
        if "scaled_dot_product" in str(op.func) and op.call is not None:
            key_value.setdefault(trace.calls[op.call].fqn, trace.nbytes(op.inputs[1]) + trace.nbytes(op.inputs[2]))
    return PlanningProblem(
        model_name=type(model).__name__,
        trace=trace,
        structure=structure,
        dims=dims,
        compute=compute_profile or default_compute_profile(str(mesh.device_type)),
        loss_parallel_allowed=loss_fn is not None,
        cost_profile=cost_profile,
        parameter_itemsize=itemsize,
        attention_key_value_bytes=tuple(key_value.items()),
        pricer=LayoutPricer(mesh, dims.tp, dims.dp, dims.cp, trace, cost_profile),
        parameter_dtype=parameter_dtype,
    )


