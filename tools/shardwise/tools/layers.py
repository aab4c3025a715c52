"""The package layers of DESIGN.md, and a checker that finds imports crossing them.

    tools -> testing -> tp_styles / fsdp_ext / compile_support -> dtensor_ops -> placement -> mesh

`python -m shardwise.tools.layers [ROOT]` prints every violation and exits non-zero if there is one.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys
from collections.abc import Iterable, Iterator

# package -> the shardwise packages it may import (besides itself).
ALLOWED_IMPORTS: dict[str, frozenset[str]] = {
    "mesh": frozenset(),
    "placement": frozenset({"mesh"}),
    "dtensor_ops": frozenset({"placement", "mesh"}),
    "tp_styles": frozenset({"dtensor_ops", "placement", "mesh"}),
    "fsdp_ext": frozenset({"dtensor_ops", "placement", "mesh"}),
    "compile_support": frozenset({"dtensor_ops", "placement", "mesh"}),
    "testing": frozenset({"tp_styles", "fsdp_ext", "compile_support", "dtensor_ops", "placement", "mesh"}),
    "tools": frozenset(
        {"testing", "tp_styles", "fsdp_ext", "compile_support", "dtensor_ops", "placement", "mesh"}
    ),
}

# PyTorch's own DTensor stack: product code must be written without it (tests: oracle only).
FORBIDDEN_TORCH_MODULES = (
    "torch.distributed.tensor",
    "torch.distributed._tensor",
    "torch.distributed.device_mesh",
)


@dataclasses.dataclass(frozen=True)
class Violation:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def _imported_modules(tree: ast.AST) -> Iterator[tuple[int, list[str]]]:
    """Per imported name: its line and the dotted names it may reach, most specific last."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, [alias.name]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from torch.distributed import tensor` reaches the stack as well as the module itself.
            for alias in node.names:
                yield node.lineno, [node.module, f"{node.module}.{alias.name}"]


def is_product_source(relative_path: pathlib.PurePath) -> bool:
    """Library code a user imports: not tests, not benchmarks (which may use PyTorch's DTensor as an oracle)."""
    parts = relative_path.parts
    if "tests" in parts or relative_path.name.startswith("test_"):
        return False
    return not relative_path.name.startswith("bench_")


def check_source(package: str, relative_path: pathlib.PurePath, source: str) -> list[Violation]:
    """Violations in one file of `package` (its path relative to the repository root)."""
    if package not in ALLOWED_IMPORTS:
        return [Violation(str(relative_path), 0, f"unknown package folder {package!r}")]
    is_test = "tests" in relative_path.parts
    allowed = ALLOWED_IMPORTS[package] | {package}
    if is_test:
        # Tests also use the shared harnesses and model zoo of shardwise.testing.
        allowed = allowed | {"testing"}
    product = is_product_source(relative_path)
    violations = []
    for line, candidates in _imported_modules(ast.parse(source, filename=str(relative_path))):
        message = _first_violation(package, candidates, allowed, is_test=is_test, product=product)
        if message is not None:
            violations.append(Violation(str(relative_path), line, message))
    return violations


def _first_violation(
    package: str, candidates: list[str], allowed: frozenset[str], *, is_test: bool, product: bool
) -> str | None:
    for module in candidates:
        if module.startswith("shardwise."):
            target = module.split(".")[1]
            if target not in allowed:
                what = "tests" if is_test else "package"
                return (
                    f"{what} of shardwise.{package} imports {module}; it may import only "
                    f"{', '.join(sorted('shardwise.' + name for name in allowed))}"
                )
        elif product and any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN_TORCH_MODULES):
            return (
                f"product code imports {module}: PyTorch's DTensor stack is allowed only in tests "
                "(as an oracle) and benchmarks"
            )
    return None


def python_files(root: pathlib.Path, packages: Iterable[str]) -> Iterator[tuple[str, pathlib.Path]]:
    for package in packages:
        folder = root / package
        for path in sorted(folder.rglob("*.py")):
            if "build_defs" in path.parts:
                continue  # Bazel tooling, not a shardwise module.
            yield package, path


def check_tree(root: pathlib.Path) -> list[Violation]:
    packages = [name for name in ALLOWED_IMPORTS if (root / name).is_dir()]
    violations: list[Violation] = []
    for package, path in python_files(root, packages):
        relative = path.relative_to(root)
        violations += check_source(package, relative, path.read_text(encoding="utf-8"))
    return violations


def main(argv: list[str]) -> int:
    root = pathlib.Path(argv[1] if len(argv) > 1 else ".").resolve()
    violations = check_tree(root)
    for violation in violations:
        print(violation)
    print(f"{len(violations)} layer violation(s) in {root}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
