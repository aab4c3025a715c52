"""Parallel styles: how one module is laid out over the tensor-parallel mesh dim.

Drop-in for ``torch.distributed.tensor.parallel.style`` (PyTorch 2.13).  A style
does two things to a module:

* its parameters become DTensors (``ColwiseParallel``/``RowwiseParallel`` shard
  them, ``SequenceParallel`` replicates them), via ``distribute_module``;
* forward hooks turn the module's plain input tensors into DTensors with a
  declared layout, redistribute them to the layout the module needs, and lay the
  outputs out as asked (optionally handing back the local tensors).

Every layout (``input_layouts``, ``output_layouts``, ...) is one placement on the
tensor-parallel mesh dim: styles are applied on a 1-D mesh.  ``parallelize_module``
picks the dim named ``"tp"`` of an n-D mesh.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
from shardwise.dtensor_ops import DTensor, distribute_module, distribute_tensor
from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement, Replicate, Shard

from ._common import as_dtensor, check_placement, check_shard_dim_fits, describe_module, require_1d_mesh, to_layout

__all__ = [
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "LayoutMismatchError",
]


class LayoutMismatchError(ValueError, AssertionError):
    """Two layout lists that must pair up one to one have different lengths.

    A ValueError by nature; also an AssertionError because PyTorch raises these with
    ``assert``, so code written against PyTorch that catches AssertionError still works.
    """


class ParallelStyle(ABC):
    """How a module is parallelized; ``parallelize_module`` calls ``_apply`` with a 1-D mesh.

    Subclasses implement ``_apply(module, device_mesh) -> module``.  ``src_data_rank``
    (set by ``parallelize_module``) is the mesh index whose parameter values are
    distributed; ``None`` lets every rank cut its own copy without communicating.
    """

    src_data_rank: int | None = 0

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """Parallelize ``module`` in place over ``device_mesh`` and return it."""

    def _check_module(self, module: nn.Module, module_path: str | None) -> None:
        """Raise if this style cannot be applied to ``module`` (called before any module is changed)."""

    def _apply_at(self, module: nn.Module, device_mesh: DeviceMesh, module_path: str | None) -> nn.Module:
        """``_apply`` for the module at ``module_path`` (the built-in styles name it in their errors)."""
        return self._apply(module, device_mesh)


class _BuiltinStyle(ParallelStyle):
    """The styles of this package: checked before anything changes, errors name the module path."""

    @abstractmethod
    def _parallelize(self, module: nn.Module, mesh: DeviceMesh, module_path: str | None) -> nn.Module: ...

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return self._apply_at(module, device_mesh, None)

    def _apply_at(self, module: nn.Module, device_mesh: DeviceMesh, module_path: str | None) -> nn.Module:
        mesh = require_1d_mesh(device_mesh, type(self).__name__)
        self._check_module(module, module_path)
        return self._parallelize(module, mesh, module_path)


# -- hooks (classes rather than closures: modules stay deep-copyable and picklable) ------------


class _InputTensorHook:
    """Forward pre-hook: lays out the module's input tensor (first positional argument or ``input=``).

    A plain tensor is taken as this rank's piece laid out as ``input_layout``; a DTensor keeps
    its own layout.  Either is then redistributed to ``desired_layout``.
    """

    def __init__(
        self,
        where: str,
        mesh: DeviceMesh,
        input_layout: Placement,
        desired_layout: Placement,
        async_op: bool,
        uneven_feature_count: int | None = None,
    ) -> None:
        self.where = where
        self.mesh = mesh
        self.input_layout = input_layout
        self.desired_layout = desired_layout
        self.async_op = async_op
        # A Linear's input features when they shard unevenly over the mesh: then no plain local
        # tensor declared sharded along its last dim can be right (see _refuse_uneven_plain_input).
        self.uneven_feature_count = uneven_feature_count

    def _prepare(self, value: Any, what: str) -> DTensor:
        if self.uneven_feature_count is not None and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            self._refuse_uneven_plain_input(value, what, self.uneven_feature_count)
        tensor = as_dtensor(value, self.mesh, self.input_layout, self.where, what)
        check_shard_dim_fits(self.desired_layout, tensor, self.where, f"the layout required for {what}")
        return to_layout(tensor, self.desired_layout, async_op=self.async_op)

    def _refuse_uneven_plain_input(self, value: torch.Tensor, what: str, features: int) -> None:
        """A plain tensor declared ``Shard`` on its feature dim is taken as an even shard (global size =
        local size x ranks), as in PyTorch; with uneven shards that is wrong on every rank, and the
        matmul would fail with a bare shape error.  Decided from the module, the mesh and the
        declared layout alone, so every rank raises alike, before any collective."""
        layout = self.input_layout
        if not isinstance(layout, Shard) or value.ndim == 0 or layout.dim not in (-1, value.ndim - 1):
            return
        ranks = self.mesh.size()
        pieces = ", ".join(str(len(piece)) for piece in torch.arange(features).chunk(ranks))
        raise ValueError(
            f"{self.where}: {what} is a plain local tensor (shape {tuple(value.shape)}) declared {layout!r}, but the "
            f"module's {features} input features do not divide over the {ranks} ranks of {self.mesh}: the shards are "
            f"uneven ({pieces}, and empty ones for missing pieces) and a local tensor cannot tell its global size (it "
            "would be taken as its local size times the number of ranks). Uneven shards need DTensors between "
            "modules: give the module that produces this input use_local_output=False (e.g. "
            "ColwiseParallel(use_local_output=False)), or pass DTensor.from_local(x, mesh, [Shard(-1)], shape=..., stride=...)"
        )

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (self._prepare(args[0], "input 0"), *args[1:]), kwargs
        if "input" in kwargs:
            prepared = dict(kwargs)
            prepared["input"] = self._prepare(kwargs["input"], "input 'input'")
            return args, prepared
        raise TypeError(
            f"{self.where} was called without an input tensor (no positional argument and no input=...); "
            "it expects its input as the first argument"
        )


class _OutputTensorHook:
    """Forward hook: redistributes the module's DTensor output to ``output_layout`` (None: as it is),
    then hands back the local tensor when ``use_local_output``."""

    def __init__(
        self, where: str, output_layout: Placement | None, use_local_output: bool, async_op: bool
    ) -> None:
        self.where = where
        self.output_layout = output_layout
        self.use_local_output = use_local_output
        self.async_op = async_op

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not isinstance(output, DTensor):
            if self.output_layout is None:
                return output
            raise TypeError(
                f"{self.where}: expected the module to return a DTensor (its parameters are DTensors), got "
                f"{type(output).__name__}; was its forward replaced after it was parallelized?"
            )
        if self.output_layout is not None:
            output = to_layout(output, self.output_layout, async_op=self.async_op)
        return output.to_local() if self.use_local_output else output


class _ParameterPartition:
    """``partition_fn`` for ``distribute_module``: lays out named parameters of the root module."""

    def __init__(self, placements: Mapping[str, Placement], src_data_rank: int | None) -> None:
        self.placements = dict(placements)
        self.src_data_rank = src_data_rank

    def __call__(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name != "":
            return
        for param_name, placement in self.placements.items():
            param = module._parameters.get(param_name)
            if param is None:
                continue
            distributed = distribute_tensor(param.detach(), mesh, (placement,), src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(distributed, requires_grad=param.requires_grad))


class _ReplicateAllParameters:
    """``partition_fn`` replicating every parameter of every submodule (from ``src_data_rank``)."""

    def __init__(self, src_data_rank: int | None) -> None:
        self.src_data_rank = src_data_rank

    def __call__(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            distributed = distribute_tensor(param.detach(), mesh, (Replicate(),), src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(distributed, requires_grad=param.requires_grad))


def _check_no_dtensor_parameters(module: nn.Module, where: str, style_name: str) -> None:
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise RuntimeError(
                f"{style_name}: {where} already has DTensor parameters ({name!r} is laid out as "
                f"{param.placements}); a module can be parallelized only once"
            )


def _layout_repr(layouts: Sequence[Placement | None] | None) -> str:
    return "None" if layouts is None else repr(tuple(layouts))


# -- ColwiseParallel / RowwiseParallel -----------------------------------------------------


_SUPPORTED_TP_MODULES = "nn.Linear and nn.Embedding (and their subclasses)"


def _linear_or_embedding(module: nn.Module, module_path: str | None, style_name: str) -> type[nn.Module]:
    where = describe_module(module, module_path)
    if isinstance(module, nn.Linear):
        kind: type[nn.Module] = nn.Linear
    elif isinstance(module, nn.Embedding):
        kind = nn.Embedding
    else:
        named = f"module '{module_path}'" if module_path else "the module"
        raise NotImplementedError(
            f"{style_name} supports {_SUPPORTED_TP_MODULES}, but {named} is a {type(module).__module__}."
            f"{type(module).__qualname__}; apply it to the Linear/Embedding submodules instead, or write a "
            "ParallelStyle for this module type"
        )
    _check_no_dtensor_parameters(module, where, style_name)
    weight = module._parameters.get("weight")
    if weight is None or weight.ndim != 2:
        raise ValueError(
            f"{style_name}: {where} must have a 2-D weight parameter, got "
            f"{None if weight is None else tuple(weight.shape)}"
        )
    return kind


class ColwiseParallel(_BuiltinStyle):
    """Shard an ``nn.Linear`` or ``nn.Embedding`` column-wise (by output features).

    Linear: weight ``Shard(0)`` and bias ``Shard(0)``; Embedding: weight ``Shard(1)``.
    The input (declared ``input_layouts``, default ``Replicate()``) is redistributed to
    ``Replicate()``; the output, ``Shard(-1)``, is redistributed to ``output_layouts``
    (default ``Shard(-1)``).  With ``use_local_output`` (default) the module returns the
    local tensor, otherwise the DTensor.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        check_placement(input_layouts, "input_layouts", "ColwiseParallel", allow_none=True)
        check_placement(output_layouts, "output_layouts", "ColwiseParallel", allow_none=True)
        self.input_layouts: tuple[Placement, ...] = (Replicate() if input_layouts is None else input_layouts,)
        self.output_layouts: tuple[Placement, ...] = (Shard(-1) if output_layouts is None else output_layouts,)
        self.desired_input_layouts: tuple[Placement, ...] = (Replicate(),)
        self.use_local_output = use_local_output

    def __repr__(self) -> str:
        return (
            f"ColwiseParallel(input_layouts={self.input_layouts[0]!r}, output_layouts={self.output_layouts[0]!r}, "
            f"use_local_output={self.use_local_output})"
        )

    def _check_module(self, module: nn.Module, module_path: str | None) -> None:
        _linear_or_embedding(module, module_path, "ColwiseParallel")

    def _parallelize(self, module: nn.Module, mesh: DeviceMesh, module_path: str | None) -> nn.Module:
        kind = _linear_or_embedding(module, module_path, "ColwiseParallel")
        where = f"ColwiseParallel on {describe_module(module, module_path)}"
        weight_layout = Shard(0) if kind is nn.Linear else Shard(1)
        distribute_module(module, mesh, _ParameterPartition({"weight": weight_layout, "bias": Shard(0)}, self.src_data_rank))
        module.register_forward_pre_hook(
            _InputTensorHook(where, mesh, self.input_layouts[0], self.desired_input_layouts[0], async_op=True),
            with_kwargs=True,
        )
        module.register_forward_hook(
            _OutputTensorHook(where, self.output_layouts[0], self.use_local_output, async_op=True)
        )
        return module


def _uneven_feature_count(module: nn.Module, mesh: DeviceMesh) -> int | None:
    """The Linear's input features when they do not divide over the mesh (uneven shards), else None."""
    weight = module._parameters["weight"]
    assert weight is not None  # _linear_or_embedding checked it
    features = int(weight.shape[1])
    return features if features % mesh.size() else None


class RowwiseParallel(_BuiltinStyle):
    """Shard an ``nn.Linear`` or ``nn.Embedding`` row-wise (by input features / vocabulary).

    Linear: weight ``Shard(1)``, bias ``Replicate()``; the input (declared
    ``input_layouts``, default ``Shard(-1)``) is redistributed to ``Shard(-1)`` and the
    partial-sum output to ``output_layouts`` (default ``Replicate()``: one all-reduce).
    Embedding: weight ``Shard(0)``; the indices are redistributed to ``Replicate()``
    (give ``input_layouts=Replicate()`` for plain index tensors) and the partial output
    to ``output_layouts``.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        check_placement(input_layouts, "input_layouts", "RowwiseParallel", allow_none=True)
        check_placement(output_layouts, "output_layouts", "RowwiseParallel", allow_none=True)
        self.input_layouts: tuple[Placement, ...] = (Shard(-1) if input_layouts is None else input_layouts,)
        self.output_layouts: tuple[Placement, ...] = (Replicate() if output_layouts is None else output_layouts,)
        self.use_local_output = use_local_output

    def __repr__(self) -> str:
        return (
            f"RowwiseParallel(input_layouts={self.input_layouts[0]!r}, output_layouts={self.output_layouts[0]!r}, "
            f"use_local_output={self.use_local_output})"
        )

    def _check_module(self, module: nn.Module, module_path: str | None) -> None:
        _linear_or_embedding(module, module_path, "RowwiseParallel")

    def _parallelize(self, module: nn.Module, mesh: DeviceMesh, module_path: str | None) -> nn.Module:
        kind = _linear_or_embedding(module, module_path, "RowwiseParallel")
        where = f"RowwiseParallel on {describe_module(module, module_path)}"
        placements: dict[str, Placement]
        uneven_feature_count = None
        if kind is nn.Linear:
            placements = {"weight": Shard(1), "bias": Replicate()}
            desired_input: Placement = Shard(-1)
            uneven_feature_count = _uneven_feature_count(module, mesh)
        else:
            placements = {"weight": Shard(0)}
            desired_input = Replicate()
        distribute_module(module, mesh, _ParameterPartition(placements, self.src_data_rank))
        module.register_forward_pre_hook(
            _InputTensorHook(
                where, mesh, self.input_layouts[0], desired_input, async_op=True, uneven_feature_count=uneven_feature_count
            ),
            with_kwargs=True,
        )
        module.register_forward_hook(
            _OutputTensorHook(where, self.output_layouts[0], self.use_local_output, async_op=True)
        )
        return module


# -- SequenceParallel -------------------------------------------------------------------------


class SequenceParallel(_BuiltinStyle):
    """Run a module that works on each position independently (LayerNorm, RMSNorm, Dropout, ...)
    on the sequence shard each rank holds.

    Parameters are replicated (their gradients come back ``Partial``, summed where they
    are reduced).  The input is taken as sharded on ``sequence_dim``: a plain tensor is
    this rank's sequence shard, a DTensor laid out otherwise is redistributed to
    ``Shard(sequence_dim)``.  The output stays a DTensor unless ``use_local_output``.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__()
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
            raise TypeError(f"SequenceParallel: sequence_dim must be an int, got {sequence_dim!r}")
        self.sequence_sharding: tuple[Placement, ...] = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    @property
    def sequence_dim(self) -> int:
        placement = self.sequence_sharding[0]
        assert isinstance(placement, Shard)
        return placement.dim

    def __repr__(self) -> str:
        return f"SequenceParallel(sequence_dim={self.sequence_dim}, use_local_output={self.use_local_output})"

    def _check_module(self, module: nn.Module, module_path: str | None) -> None:
        _check_no_dtensor_parameters(module, describe_module(module, module_path), "SequenceParallel")

    def _parallelize(self, module: nn.Module, mesh: DeviceMesh, module_path: str | None) -> nn.Module:
        where = f"SequenceParallel on {describe_module(module, module_path)}"
        sharding = self.sequence_sharding[0]
        distribute_module(module, mesh, _ReplicateAllParameters(self.src_data_rank))
        module.register_forward_pre_hook(
            _InputTensorHook(where, mesh, sharding, sharding, async_op=True), with_kwargs=True
        )
        module.register_forward_hook(_OutputTensorHook(where, None, self.use_local_output, async_op=False))
        return module


# -- PrepareModuleInput / PrepareModuleOutput ----------------------------------------------------


LayoutsArg = Placement | Sequence[Placement | None] | None


def _layouts_tuple(value: LayoutsArg, argument: str, style_name: str) -> tuple[Placement | None, ...] | None:
    if value is None:
        return None
    if isinstance(value, Placement):
        return (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{style_name}: {argument} must be a Placement or a sequence of Placement/None (one per tensor), "
            f"got {value!r}"
        )
    result = tuple(value)
    for index, item in enumerate(result):
        check_placement(item, f"{argument}[{index}]", style_name, allow_none=True)
    return result


def _kwarg_layouts_dict(
    value: Mapping[str, Placement] | None, argument: str, style_name: str
) -> dict[str, Placement] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{style_name}: {argument} must be a dict from keyword name to Placement, got {value!r}")
    result = dict(value)
    for name, item in result.items():
        if not isinstance(name, str):
            raise TypeError(f"{style_name}: {argument} keys must be keyword argument names (str), got {name!r}")
        check_placement(item, f"{argument}[{name!r}]", style_name)
    return result


class _Prepared:
    """A module input or output after the checks, before any collective: a DTensor in its current
    layout and where it goes, or a value left alone (``tensor`` None)."""

    __slots__ = ("value", "tensor", "desired")

    def __init__(self, value: Any, tensor: DTensor | None = None, desired: Placement | None = None) -> None:
        self.value = value
        self.tensor = tensor
        self.desired = desired

    def finish(self, use_local_output: bool) -> Any:
        """Redistribute (collectives happen here) and hand back the DTensor or its local tensor."""
        if self.tensor is None:
            return self.value
        tensor = self.tensor if self.desired is None else to_layout(self.tensor, self.desired, async_op=False)
        return tensor.to_local() if use_local_output else tensor


def _check_and_wrap(
    value: Any, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None, where: str, what: str
) -> _Prepared:
    """Everything that can fail about one input/output, without communicating."""
    if value is None or (layout is None and desired is None):
        return _Prepared(value)
    if layout is None:
        if not isinstance(value, DTensor):
            raise ValueError(
                f"{where}: {what} has no declared layout (None) but a desired layout {desired!r}; the layout of a "
                f"plain {type(value).__name__} is unknown, so declare it (or pass a DTensor)"
            )
        assert desired is not None
        tensor = as_dtensor(value, mesh, desired, where, what)
    else:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: {what} has declared layout {layout!r} but is a {type(value).__name__}, not a tensor")
        tensor = as_dtensor(value, mesh, layout, where, what)
    if desired is not None:
        check_shard_dim_fits(desired, tensor, where, f"the desired layout of {what}")
    return _Prepared(value, tensor, desired)


class _PrepareInputsHook:
    def __init__(self, style: PrepareModuleInput, mesh: DeviceMesh, where: str) -> None:
        self.style = style
        self.mesh = mesh
        self.where = where

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return self.style._prepare_inputs(args, kwargs, self.mesh, self.where)


class PrepareModuleInput(_BuiltinStyle):
    """Lay out a module's inputs before its forward runs (its parameters are left alone).

    ``input_layouts`` declares the layout of each positional input (a Placement for a
    single input, or one Placement/None per input: None leaves that input alone) and
    ``desired_input_layouts`` the layout each must be redistributed to.
    ``input_kwarg_layouts`` / ``desired_input_kwarg_layouts`` do the same for keyword
    arguments by name (keywords not passed are skipped).  Plain tensors are taken as
    this rank's piece in the declared layout; DTensors keep their own layout.  With
    ``use_local_output`` the module receives local tensors, otherwise DTensors.
    """

    def __init__(
        self,
        *,
        input_layouts: LayoutsArg = None,
        desired_input_layouts: LayoutsArg = None,
        input_kwarg_layouts: Mapping[str, Placement] | None = None,
        desired_input_kwarg_layouts: Mapping[str, Placement] | None = None,
        use_local_output: bool = False,
    ) -> None:
        super().__init__()
        name = "PrepareModuleInput"
        self.input_layouts = _layouts_tuple(input_layouts, "input_layouts", name)
        self.desired_input_layouts = _layouts_tuple(desired_input_layouts, "desired_input_layouts", name)
        self.use_local_output = use_local_output
        if self.input_layouts is not None:
            if self.desired_input_layouts is None:
                raise LayoutMismatchError(
                    "desired module inputs should not be None! input_layouts is given, so desired_input_layouts "
                    "must say where each input goes (None entries leave an input as it is)"
                )
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise LayoutMismatchError(
                    "input_layouts and desired_input_layouts should have same length! Got "
                    f"{len(self.input_layouts)} input layouts {self.input_layouts} and "
                    f"{len(self.desired_input_layouts)} desired layouts {self.desired_input_layouts}"
                )
        elif self.desired_input_layouts is not None:
            raise LayoutMismatchError(
                "desired_input_layouts is given without input_layouts: give input_layouts too (one per positional "
                "input; None for an input to leave alone)"
            )
        self.input_kwarg_layouts: dict[str, Placement] = (
            _kwarg_layouts_dict(input_kwarg_layouts, "input_kwarg_layouts", name) or {}
        )
        self.desired_input_kwarg_layouts: dict[str, Placement] = (
            _kwarg_layouts_dict(desired_input_kwarg_layouts, "desired_input_kwarg_layouts", name) or {}
        )
        if len(self.input_kwarg_layouts) != len(self.desired_input_kwarg_layouts):
            raise LayoutMismatchError(
                "input_kwarg_layouts and desired_input_kwarg_layouts should have same length! Got keywords "
                f"{sorted(self.input_kwarg_layouts)} and {sorted(self.desired_input_kwarg_layouts)}"
            )
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise LayoutMismatchError(
                "input_kwarg_layouts and desired_input_kwarg_layouts must name the same keywords, got "
                f"{sorted(self.input_kwarg_layouts)} and {sorted(self.desired_input_kwarg_layouts)}"
            )
        self.with_kwargs = bool(self.input_kwarg_layouts)

    def __repr__(self) -> str:
        return (
            f"PrepareModuleInput(input_layouts={_layout_repr(self.input_layouts)}, "
            f"desired_input_layouts={_layout_repr(self.desired_input_layouts)}, "
            f"input_kwarg_layouts={self.input_kwarg_layouts}, "
            f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
            f"use_local_output={self.use_local_output})"
        )

    def _check_module(self, module: nn.Module, module_path: str | None) -> None:
        try:
            signature = inspect.signature(module.forward)
        except (TypeError, ValueError):
            return  # a forward we cannot introspect (builtin); checked at call time instead
        parameters = list(signature.parameters.values())
        takes_var_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        keyword_names = {
            p.name
            for p in parameters
            if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        }
        unknown = sorted(set(self.input_kwarg_layouts) - keyword_names)
        if unknown and not takes_var_kwargs:
            raise ValueError(
                f"PrepareModuleInput: input_kwarg_layouts names {unknown}, which "
                f"{describe_module(module, module_path)} does not take as keyword arguments; its forward takes "
                f"{sorted(keyword_names)}"
            )
        if self.input_layouts is not None and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
            positional = [
                p
                for p in parameters
                if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            ]
            if len(self.input_layouts) > len(positional):
                raise ValueError(
                    f"PrepareModuleInput: {len(self.input_layouts)} input_layouts for "
                    f"{describe_module(module, module_path)}, whose forward takes at most {len(positional)} "
                    f"positional inputs ({[p.name for p in positional]})"
                )

    def _parallelize(self, module: nn.Module, mesh: DeviceMesh, module_path: str | None) -> nn.Module:
        where = f"PrepareModuleInput on {describe_module(module, module_path)}"
        module.register_forward_pre_hook(_PrepareInputsHook(self, mesh, where), with_kwargs=True)
        return module

    def _prepare_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh, where: str
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        prepared_args = args
        positional: list[_Prepared] = []
        if self.input_layouts is not None:
            desired_layouts = self.desired_input_layouts
            assert desired_layouts is not None
            if len(args) != len(self.input_layouts):
                raise ValueError(
                    "module inputs and input_layouts should have same length! "
                    f"{where} got {len(args)} positional inputs and {len(self.input_layouts)} input_layouts "
                    f"{self.input_layouts}"
                )
            positional = [
                _check_and_wrap(value, mesh, layout, desired, where, f"input {index}")
                for index, (value, layout, desired) in enumerate(zip(args, self.input_layouts, desired_layouts))
            ]
        keywords = {
            name: _check_and_wrap(
                kwargs[name], mesh, layout, self.desired_input_kwarg_layouts[name], where, f"keyword input {name!r}"
            )
            for name, layout in self.input_kwarg_layouts.items()
            if name in kwargs
        }
        # Every input is checked before the first collective, so a bad one fails on every rank alike.
        if self.input_layouts is not None:
            prepared_args = tuple(item.finish(self.use_local_output) for item in positional)
        if not keywords:
            return prepared_args, kwargs
        prepared_kwargs = dict(kwargs)
        for name, item in keywords.items():
            prepared_kwargs[name] = item.finish(self.use_local_output)
        return prepared_args, prepared_kwargs


class _PrepareOutputsHook:
    def __init__(self, style: PrepareModuleOutput, mesh: DeviceMesh, where: str) -> None:
        self.style = style
        self.mesh = mesh
        self.where = where

    def __call__(self, module: nn.Module, args: tuple[Any, ...], outputs: Any) -> Any:
        return self.style._prepare_outputs(outputs, self.mesh, self.where)


class PrepareModuleOutput(_BuiltinStyle):
    """Lay out a module's outputs after its forward ran.

    ``output_layouts`` declares each output's layout (a Placement for a single output,
    or one Placement/None per element of a returned tuple/list: None leaves it alone),
    ``desired_output_layouts`` where each is redistributed to.  With
    ``use_local_output`` (default) the local tensors are returned.
    """

    def __init__(
        self,
        *,
        output_layouts: Placement | Sequence[Placement | None],
        desired_output_layouts: Placement | Sequence[Placement | None],
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        name = "PrepareModuleOutput"
        output_tuple = _layouts_tuple(output_layouts, "output_layouts", name)
        desired_tuple = _layouts_tuple(desired_output_layouts, "desired_output_layouts", name)
        if output_tuple is None or desired_tuple is None:
            raise TypeError("PrepareModuleOutput needs output_layouts and desired_output_layouts (not None)")
        if len(output_tuple) != len(desired_tuple):
            raise LayoutMismatchError(
                "output_layouts and desired_output_layouts should have same length! Got "
                f"{len(output_tuple)} output layouts {output_tuple} and {len(desired_tuple)} desired layouts "
                f"{desired_tuple}"
            )
        self.output_layouts: tuple[Placement | None, ...] = output_tuple
        self.desired_output_layouts: tuple[Placement | None, ...] = desired_tuple
        self.use_local_output = use_local_output

    def __repr__(self) -> str:
        return (
            f"PrepareModuleOutput(output_layouts={self.output_layouts}, "
            f"desired_output_layouts={self.desired_output_layouts}, use_local_output={self.use_local_output})"
        )

    def _parallelize(self, module: nn.Module, mesh: DeviceMesh, module_path: str | None) -> nn.Module:
        where = f"PrepareModuleOutput on {describe_module(module, module_path)}"
        module.register_forward_hook(_PrepareOutputsHook(self, mesh, where))
        return module

    def _prepare_outputs(self, outputs: Any, mesh: DeviceMesh, where: str) -> Any:
        single = not isinstance(outputs, (tuple, list))
        items: Sequence[Any] = (outputs,) if single else outputs
        if len(items) != len(self.output_layouts):
            raise ValueError(
                "module outputs and output_layouts should have same length! "
                f"{where} returned {len(items)} outputs and has {len(self.output_layouts)} output_layouts "
                f"{self.output_layouts}"
            )
        checked = [
            # An output declared None is left alone whatever its desired layout says.
            _check_and_wrap(value, mesh, layout, desired if layout is not None else None, where, f"output {index}")
            for index, (value, layout, desired) in enumerate(zip(items, self.output_layouts, self.desired_output_layouts))
        ]
        prepared = [item.finish(self.use_local_output) for item in checked]
        if single:
            return prepared[0]
        return tuple(prepared) if isinstance(outputs, tuple) else prepared


class PrepareModuleInputOutput(_BuiltinStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on the same module in one style.

    ``use_local_input`` is ``PrepareModuleInput``'s ``use_local_output`` (what the
    module's forward receives); ``use_local_output`` is ``PrepareModuleOutput``'s.
    """

    def __init__(
        self,
        *,
        input_layouts: LayoutsArg = None,
        desired_input_layouts: LayoutsArg = None,
        input_kwarg_layouts: Mapping[str, Placement] | None = None,
        desired_input_kwarg_layouts: Mapping[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Placement | Sequence[Placement | None],
        desired_output_layouts: Placement | Sequence[Placement | None],
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def __repr__(self) -> str:
        return f"PrepareModuleInputOutput({self.prepare_module_input!r}, {self.prepare_module_output!r})"

    def _check_module(self, module: nn.Module, module_path: str | None) -> None:
        self.prepare_module_input._check_module(module, module_path)
        self.prepare_module_output._check_module(module, module_path)

    def _parallelize(self, module: nn.Module, mesh: DeviceMesh, module_path: str | None) -> nn.Module:
        self.prepare_module_input._parallelize(module, mesh, module_path)
        self.prepare_module_output._parallelize(module, mesh, module_path)
        return module
