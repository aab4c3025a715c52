"""``DeviceMesh``'s metaclass: a torch.compile opaque class that keeps its answers under torch's LocalTensorMode."""

from __future__ import annotations

from typing import Any

from torch._opaque_base import OpaqueBaseMeta

from shardwise.mesh import _simulation as simulation

__all__ = ["_DeviceMeshClass"]


# What torch's LocalTensorMode replaces on "the" DeviceMesh class while it is enabled
# (``_local_tensor._PATCHED_DEVICE_MESH_METHODS``): its module imports
# ``torch.distributed.device_mesh.DeviceMesh``, which is this class when shardwise stands in for
# torch (``shardwise.torch_switch``).
_METHODS_LOCAL_TENSOR_MODE_PATCHES = frozenset(
    {"get_coordinate", "get_local_rank", "get_rank", "_is_current_rank_part_of_mesh", "_sym_get_coordinate"}
)


class _DeviceMeshClass(OpaqueBaseMeta):
    """Keeps this class's own answers under torch's LocalTensorMode; a torch.compile opaque class.

    ``OpaqueBaseMeta`` is what torch.compile asks of a class it can take as an opaque *reference* type
    (torch's own ``DeviceMesh`` is one): while AOTAutograd traces, a mesh travels as torch's stand-in
    (``FakeScriptObject``), which is then still an instance of this class. shardwise.compile_support
    does the registration.

    torch's replacements read torch's mesh internals (``_rank_map``, its layout's
    ``remap_to_tensor``) and ignore the rank that ``_simulation.as_simulated_rank`` pins, which
    dtensor_ops relies on; ``_simulation`` already answers for every simulated rank, as they do.
    So their assignment is dropped (the mode's restore, which assigns our own methods, goes through).
    """

    def __setattr__(cls, name: str, value: Any) -> None:
        if name in _METHODS_LOCAL_TENSOR_MODE_PATCHES and _is_local_tensor_mode_patch(value):
            return
        super().__setattr__(name, value)


def _is_local_tensor_mode_patch(value: object) -> bool:
    return getattr(value, "__module__", None) == simulation._LOCAL_TENSOR_MODULE and str(
        getattr(value, "__qualname__", "")
    ).startswith("_LocalDeviceMesh.")
