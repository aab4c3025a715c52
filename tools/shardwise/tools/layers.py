"""The package layers of DESIGN.md, the layers inside dtensor_ops, and a checker for both.

    tools -> testing -> tp_styles / fsdp_ext / compile_support -> dtensor_ops -> placement -> mesh
    tools -> torch_switch (-> every product package, by name only when torch's path is imported)

Inside dtensor_ops, imports go one direction only (``DTENSOR_OPS_LAYERS``, bottom first), and no
product module takes part in an import cycle, counting imports inside functions and
``importlib.import_module("literal")`` too.

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
        {"torch_switch", "testing", "tp_styles", "fsdp_ext", "compile_support", "dtensor_ops", "placement", "mesh"}
    ),
    # The switch maps torch's paths onto every product package (it imports them by name only when
    # torch's path is imported, never at its own import); its tests may use the harness.
    "torch_switch": frozenset({"tp_styles", "fsdp_ext", "compile_support", "dtensor_ops", "placement", "mesh"}),
}

# The layers inside shardwise.dtensor_ops, bottom first: a module may import modules of its own layer
# and of the layers below (module names relative to shardwise.dtensor_ops; a package stands for all
# of its modules).  See dtensor_ops/README.md, "Inside the package".
DTENSOR_OPS_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "leaf types",
        (
            "_caches",
            "_call_schema",
            "_decision",
            "_simulated_kernels",
            "_rules",
            "_engine",
            "_shard_rng",
            "_op_handlers",
            "_implicit_replication",
            "_explicit_redistribution",
            "_placement_args",
            "_wrapper",
            "_extensions",
            "_options",
        ),
    ),
    ("planner", ("_cost_model", "_planner")),
    ("rules", ("_ops",)),
    ("propagation", ("_propagation", "_decision_pipeline", "_pricing")),
    ("collectives", ("_collectives",)),
    ("redistribution", ("_executor_steps", "_plan_executor", "_src_data")),
    ("DTensor class", ("_checkpoint", "_conversions", "_dtensor")),
    ("op handlers", ("_handlers",)),
    ("dispatch", ("_op_runner",)),
    ("API and factories", ("_api", "_factories", "experimental", "random", "debug")),
    # PyTorch's semi-private surface.  PyTorch's module paths here (``_op_schema``, ``_ops.utils``, ...) are
    # no files: the alias table (``PYTORCH_PATHS_SOURCE``) names the module serving each, and an import of
    # a path counts as an import of that module.
    ("PyTorch compat", ("_torch_compat",)),
    ("wiring", ("",)),  # the package __init__
)

# The alias table of PyTorch's module paths under dtensor_ops (path -> the module serving it), read from the
# checked tree's source.
PYTORCH_PATHS_SOURCE = pathlib.PurePath("dtensor_ops/shardwise/dtensor_ops/_torch_compat/pytorch_paths.py")
PYTORCH_PATHS_NAME = "PYTORCH_PATHS"

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


def module_name(relative_path: pathlib.PurePath) -> str | None:
    """``shardwise.<pkg>.<...>`` for a product source file (``<pkg>/shardwise/<pkg>/...``), else None."""
    parts = relative_path.parts
    if len(parts) < 3 or parts[1] != "shardwise" or relative_path.suffix != ".py":
        return None
    dotted = [*parts[1:-1], relative_path.stem]
    if dotted[-1] == "__init__":
        dotted.pop()
    return ".".join(dotted)


def _is_package(relative_path: pathlib.PurePath) -> bool:
    return relative_path.name == "__init__.py"


def imported_shardwise_modules(
    module: str, is_package: bool, tree: ast.AST, known_modules: frozenset[str]
) -> Iterator[tuple[int, str]]:
    """(line, module) for every shardwise module this module imports, wherever the import statement is.

    Relative imports are resolved; ``from package import name`` counts as importing the submodule
    ``package.name`` when that is a module, else the package; ``importlib.import_module("...")`` with a
    literal name counts too.
    """
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("shardwise."):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not base.startswith("shardwise"):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                yield node.lineno, candidate if candidate in known_modules else base
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value.startswith("shardwise.")
        ):
            yield node.lineno, node.args[0].value


def _dtensor_ops_layer(module: str) -> int | None:
    prefix = "shardwise.dtensor_ops"
    if module != prefix and not module.startswith(prefix + "."):
        return None
    relative = module[len(prefix) + 1 :]
    # The most specific member naming the module (or a package above it) gives its layer:
    # "_ops.utils" (PyTorch compat) before "_ops" (rules).
    best_index, best_length = -1, -1
    for index, (_, members) in enumerate(DTENSOR_OPS_LAYERS):
        for member in members:
            if member == "":
                matches = relative == ""
            else:
                matches = relative == member or relative.startswith(member + ".")
            if matches and len(member) > best_length:
                best_index, best_length = index, len(member)
    return best_index


def pytorch_paths(root: pathlib.Path) -> dict[str, str]:
    """The alias table of the tree at ``root`` (PyTorch-shaped path -> the module serving it); {} without one."""
    path = root / PYTORCH_PATHS_SOURCE
    if not path.is_file():
        return {}
    for node in ast.parse(path.read_text(encoding="utf-8"), str(PYTORCH_PATHS_SOURCE)).body:
        targets: list[ast.expr]
        if isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        elif isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        else:
            continue
        if value is not None and any(isinstance(t, ast.Name) and t.id == PYTORCH_PATHS_NAME for t in targets):
            table = ast.literal_eval(value)
            return {str(path_): str(served) for path_, served in table.items()}
    raise ValueError(f"{PYTORCH_PATHS_SOURCE} assigns no {PYTORCH_PATHS_NAME} literal")


def _product_sources(root: pathlib.Path) -> dict[str, tuple[pathlib.PurePath, bool, ast.AST]]:
    sources: dict[str, tuple[pathlib.PurePath, bool, ast.AST]] = {}
    packages = [name for name in ALLOWED_IMPORTS if (root / name).is_dir()]
    for _, path in python_files(root, packages):
        relative = path.relative_to(root)
        name = module_name(relative)
        if name is None or not is_product_source(relative):
            continue
        sources[name] = (relative, _is_package(relative), ast.parse(path.read_text(encoding="utf-8"), str(relative)))
    return sources


def product_import_graph(root: pathlib.Path) -> dict[str, list[tuple[int, str, str]]]:
    """module -> [(line, imported module, path)] over every product source file of the shardwise packages.

    An import of one of PyTorch's paths of the alias table is an import of the module serving it (the
    same module object at run time).
    """
    sources = _product_sources(root)
    aliases = pytorch_paths(root)
    known = frozenset(sources) | frozenset(aliases)
    graph: dict[str, list[tuple[int, str, str]]] = {}
    for name, (source_path, is_package, tree) in sources.items():
        edges = []
        for line, target in imported_shardwise_modules(name, is_package, tree, known):
            target = aliases.get(target, target)
            if target in sources and target != name:
                edges.append((line, target, str(source_path)))
        graph[name] = edges
    return graph


def check_pytorch_paths(root: pathlib.Path) -> list[Violation]:
    """The alias table's paths have no file of their own, and each names a module that exists."""
    sources = _product_sources(root)
    violations = []
    for path, served in sorted(pytorch_paths(root).items()):
        if path in sources:
            violations.append(
                Violation(str(sources[path][0]), 0, f"{path} is a file, but the alias table serves it with {served}")
            )
        if served not in sources and (root / served.split(".")[1]).is_dir():
            violations.append(
                Violation(str(PYTORCH_PATHS_SOURCE), 0, f"{path} is served by {served}, which is no module")
            )
    return violations


def check_dtensor_ops_layers(graph: dict[str, list[tuple[int, str, str]]]) -> list[Violation]:
    """Imports inside dtensor_ops that go up a layer, and modules no layer names."""
    violations = []
    names = [layer for layer, _ in DTENSOR_OPS_LAYERS]
    for module, edges in sorted(graph.items()):
        layer = _dtensor_ops_layer(module)
        if layer is None:
            continue
        if layer < 0:
            path = edges[0][2] if edges else module
            violations.append(Violation(path, 0, f"{module} is in no layer of DTENSOR_OPS_LAYERS"))
            continue
        for line, target, path in edges:
            target_layer = _dtensor_ops_layer(target)
            if target_layer is not None and target_layer > layer:
                violations.append(
                    Violation(
                        path,
                        line,
                        f"{module} ({names[layer]}) imports {target} ({names[target_layer]}), a layer above it",
                    )
                )
    return violations


def import_cycles(graph: dict[str, list[tuple[int, str, str]]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted; sorted."""
    index_of: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index_of[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for _, target, _ in graph.get(node, ()):
            if target not in index_of:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index_of[target])
        if low[node] == index_of[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index_of:
            visit(node)
    return sorted(cycles)


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
    graph = product_import_graph(root)
    violations += check_dtensor_ops_layers(graph)
    violations += check_pytorch_paths(root)
    for cycle in import_cycles(graph):
        violations.append(Violation(cycle[0], 0, f"import cycle among {', '.join(cycle)}"))
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
