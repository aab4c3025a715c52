"""shardwise.placement is pure layout code: it may import only the stdlib, torch and shardwise.mesh."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import shardwise.placement

PACKAGE_DIR = Path(shardwise.placement.__file__).parent
FORBIDDEN_TORCH_MODULES = ("torch.distributed",)


def imported_modules(source_file: Path) -> set[str]:
    tree = ast.parse(source_file.read_text(), filename=str(source_file))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def test_package_imports_only_stdlib_torch_and_mesh() -> None:
    source_files = sorted(PACKAGE_DIR.glob("*.py"))
    assert source_files, PACKAGE_DIR
    offenders = []
    for source_file in source_files:
        for module in imported_modules(source_file):
            top = module.split(".")[0]
            allowed = (
                top in sys.stdlib_module_names
                or module == "__future__"
                or (top == "torch" and not module.startswith(FORBIDDEN_TORCH_MODULES))
                or module == "shardwise.mesh"
                or module.startswith("shardwise.mesh.")
            )
            if not allowed:
                offenders.append(f"{source_file.name}: {module}")
    assert not offenders, f"imports outside the placement layer: {offenders}"
