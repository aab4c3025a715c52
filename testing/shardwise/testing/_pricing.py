"""``priced_by``: run a block with plans and strategies priced by a named cost profile."""

from __future__ import annotations

import contextlib
from typing import Iterator

from shardwise.dtensor_ops._caches import clear_all_caches
from shardwise.dtensor_ops._options import use_options

__all__ = ["priced_by"]


@contextlib.contextmanager
def priced_by(cost_profile: str) -> Iterator[None]:
    """Plans and strategies priced by ``cost_profile`` (a built-in name or a profile file) inside the block.

    Caches are cleared on the way in and out, so nothing planned under another profile is reused.
    For tests whose expected collectives follow one profile and must not depend on the default's
    measured figures (e.g. joint steps, which pay where a collective's latency barely grows with its
    group, as on ``"nccl"``).
    """
    clear_all_caches()
    try:
        with use_options(cost_profile=cost_profile):
            yield
    finally:
        clear_all_caches()
