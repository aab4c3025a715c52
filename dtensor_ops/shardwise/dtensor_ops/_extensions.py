"""Extensions that hook into dtensor_ops when they are installed, found without dtensor_ops naming them.

A package above dtensor_ops (``shardwise.compile_support`` is one) that must act when DTensor is
imported ships a module ``shardwise/<package>/_dtensor_ops_extension.py`` defining ``install()``.
``import shardwise.dtensor_ops`` runs ``install()`` of every such module found in the ``shardwise``
namespace, in package-name order, so users write no extra import and dtensor_ops keeps to its layer
(it never imports a package above it by name).  A package that is not installed is simply not found.
"""

from __future__ import annotations

import importlib
import os

__all__ = ["EXTENSION_MODULE", "installed_extensions", "load_extensions"]

EXTENSION_MODULE = "_dtensor_ops_extension"

_loaded: list[str] = []


def _extension_packages() -> list[str]:
    import shardwise

    found: set[str] = set()
    for root in shardwise.__path__:
        try:
            children = os.listdir(root)
        except OSError:
            continue
        for child in children:
            if os.path.isfile(os.path.join(root, child, EXTENSION_MODULE + ".py")):
                found.add(child)
    return sorted(found)


def load_extensions() -> None:
    """Run ``install()`` of every installed extension once (called by the package ``__init__``)."""
    for package in _extension_packages():
        if package in _loaded:
            continue
        module = importlib.import_module(f"shardwise.{package}.{EXTENSION_MODULE}")
        module.install()
        _loaded.append(package)


def installed_extensions() -> tuple[str, ...]:
    """The packages whose extension ran, e.g. ``("compile_support",)``."""
    return tuple(_loaded)
