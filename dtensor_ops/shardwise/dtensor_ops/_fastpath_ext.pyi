"""Type stub of the compiled C++ module built from dtensor_ops/csrc/fastpath.cpp (see _fastpath.py)."""

from types import ModuleType
from typing import Any

INTERFACE_VERSION: int

def configure(
    dtensor_type: type,
    decision_module: ModuleType,
    self_keyed_types: frozenset[type],
    float_values_matter: dict[Any, bool],
    make_wrapper: Any,
    overload_type: type,
) -> None: ...
def call_key(op: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None: ...
def try_hit(op: Any, args: tuple[Any, ...]) -> Any: ...
def hit_count() -> int: ...
def reset_hit_count() -> None: ...
