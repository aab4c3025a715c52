"""The one place a DTensor wrapper is built around a local tensor (no checks: the hot path of every op)."""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from shardwise.placement import DTensorSpec

__all__ = ["wrap_local_tensor"]

_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
_WrapperT = TypeVar("_WrapperT", bound=torch.Tensor)


def wrap_local_tensor(
    cls: type[_WrapperT], local_tensor: torch.Tensor, spec: DTensorSpec[Any], requires_grad: bool = False
) -> _WrapperT:
    """An instance of the DTensor class ``cls`` holding ``local_tensor`` laid out as ``spec`` (tensor_meta set).

    The wrapper reports the global shape and stride of ``spec`` and the local tensor's dtype,
    layout and device.
    """
    meta = spec.tensor_meta
    result: Any = _make_wrapper_subclass(
        cls,
        meta.shape,  # type: ignore[union-attr]
        meta.stride,  # type: ignore[union-attr]
        None,
        None,
        local_tensor.dtype,
        local_tensor.layout,
        local_tensor.device,
        False,
        requires_grad,
    )
    result._local_tensor = local_tensor
    result._spec = spec
    return result
