"""Counts dtensor_ops's ``_ContextParallel`` as a :class:`ParallelStyle`.

PyTorch keeps ``_ContextParallel`` (a ParallelStyle) in ``experimental._attention``; here that module
sits in ``dtensor_ops``, below the layer that defines ``ParallelStyle``, so the style is written
without the base class and registered as a virtual subclass from this layer, where
``parallelize_module`` checks it.
"""

from __future__ import annotations

from shardwise.dtensor_ops.experimental._attention import _ContextParallel

from .style import ParallelStyle

ParallelStyle.register(_ContextParallel)
