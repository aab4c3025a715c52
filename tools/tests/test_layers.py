"""Every package imports only the layers below it; product code never uses PyTorch's DTensor stack."""

from __future__ import annotations

import pathlib

import pytest

from shardwise.tools import layers

REPO_ROOT = pathlib.Path.cwd()  # Bazel runs tests from the workspace root of the runfiles tree.
# BUILD files are not in the runfiles; a package without one has no targets and fails elsewhere.
PACKAGE_FILES = ("README.md",)


def test_repository_has_no_layer_violations() -> None:
    checked = [path for _, path in layers.python_files(REPO_ROOT, layers.ALLOWED_IMPORTS) if path.exists()]
    assert len(checked) > 10, f"expected the package sources in the runfiles under {REPO_ROOT}"
    violations = layers.check_tree(REPO_ROOT)
    assert not violations, "\n".join(str(violation) for violation in violations)


@pytest.mark.parametrize("package", sorted(name for name in layers.ALLOWED_IMPORTS if (REPO_ROOT / name).is_dir()))
def test_each_package_folder_is_complete(package: str) -> None:
    folder = REPO_ROOT / package
    required_files = PACKAGE_FILES if package == "tools" else PACKAGE_FILES + ("VERSION",)
    for required in required_files:
        assert (folder / required).is_file(), f"{package}/ has no {required}"
    assert not (folder / "shardwise" / "__init__.py").exists(), (
        f"{package}/shardwise/__init__.py would break the PEP 420 namespace shared by all packages"
    )
    assert (folder / "shardwise" / package / "__init__.py").is_file()


def _violations(package: str, path: str, source: str) -> list[str]:
    return [v.message for v in layers.check_source(package, pathlib.PurePath(path), source)]


def test_upward_import_is_reported() -> None:
    found = _violations("mesh", "mesh/shardwise/mesh/_x.py", "from shardwise.dtensor_ops import DTensor\n")
    assert len(found) == 1 and "shardwise.dtensor_ops" in found[0]


def test_downward_import_is_allowed() -> None:
    assert _violations("dtensor_ops", "dtensor_ops/shardwise/dtensor_ops/_x.py", "import shardwise.mesh\n") == []


@pytest.mark.parametrize(
    "statement",
    [
        "from torch.distributed.tensor import DTensor",
        "import torch.distributed._tensor.api",
        "from torch.distributed import device_mesh",
        "from torch.distributed.tensor.parallel import ColwiseParallel",
    ],
)
def test_product_code_may_not_import_pytorch_dtensor(statement: str) -> None:
    found = _violations("dtensor_ops", "dtensor_ops/shardwise/dtensor_ops/_x.py", statement + "\n")
    assert len(found) == 1 and "PyTorch's DTensor stack" in found[0]


def test_tests_and_benchmarks_may_use_pytorch_dtensor_as_oracle() -> None:
    source = "from torch.distributed.tensor import DTensor\nfrom shardwise.testing import multi_rank\n"
    assert _violations("dtensor_ops", "dtensor_ops/tests/test_x.py", source) == []
    assert _violations("tools", "tools/shardwise/tools/bench_dispatch.py", source) == []


def test_tests_may_not_reach_above_their_layer() -> None:
    found = _violations("mesh", "mesh/tests/test_x.py", "from shardwise.dtensor_ops import DTensor\n")
    assert len(found) == 1


# -- inside dtensor_ops: one direction, no cycles -------------------------------------------------------------


def _write_tree(root: pathlib.Path, files: dict[str, str]) -> None:
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")


def _graph(root: pathlib.Path) -> dict[str, list[tuple[int, str, str]]]:
    return layers.product_import_graph(root)


def test_the_product_code_has_no_import_cycle_and_every_dtensor_ops_module_has_a_layer() -> None:
    graph = _graph(REPO_ROOT)
    assert "shardwise.dtensor_ops._op_runner" in graph
    assert layers.import_cycles(graph) == []
    assert layers.check_dtensor_ops_layers(graph) == []


def test_an_upward_import_inside_dtensor_ops_is_reported(tmp_path: pathlib.Path) -> None:
    base = "dtensor_ops/shardwise/dtensor_ops/"
    _write_tree(
        tmp_path,
        {
            base + "__init__.py": "",
            base + "_dtensor.py": "",
            base + "_rules.py": "def f() -> None:\n    from ._dtensor import DTensor\n",  # lazy, still counted
        },
    )
    found = layers.check_dtensor_ops_layers(_graph(tmp_path))
    assert len(found) == 1
    assert "shardwise.dtensor_ops._rules (leaf types) imports shardwise.dtensor_ops._dtensor (DTensor class)" in str(found[0])


def test_a_module_in_no_layer_is_reported(tmp_path: pathlib.Path) -> None:
    _write_tree(tmp_path, {"dtensor_ops/shardwise/dtensor_ops/__init__.py": "", "dtensor_ops/shardwise/dtensor_ops/_new.py": ""})
    found = layers.check_dtensor_ops_layers(_graph(tmp_path))
    assert [violation.message for violation in found] == ["shardwise.dtensor_ops._new is in no layer of DTENSOR_OPS_LAYERS"]


def test_cycles_through_lazy_and_importlib_imports_are_found(tmp_path: pathlib.Path) -> None:
    base = "dtensor_ops/shardwise/dtensor_ops/"
    _write_tree(
        tmp_path,
        {
            base + "__init__.py": "",
            base + "_op_runner.py": "from . import _api\n",
            base + "_api.py": "def g() -> None:\n    from ._dtensor import DTensor\n",
            base + "_dtensor.py": "import importlib\nmodule = importlib.import_module('shardwise.dtensor_ops._op_runner')\n",
            base + "_caches.py": "",
        },
    )
    cycles = layers.import_cycles(_graph(tmp_path))
    assert cycles == [["shardwise.dtensor_ops._api", "shardwise.dtensor_ops._dtensor", "shardwise.dtensor_ops._op_runner"]]
    violations = layers.check_tree(tmp_path)
    assert any("import cycle among" in violation.message for violation in violations)


def test_an_import_of_a_pytorch_path_is_one_of_the_module_serving_it(tmp_path: pathlib.Path) -> None:
    base = "dtensor_ops/shardwise/dtensor_ops/"
    _write_tree(
        tmp_path,
        {
            base + "__init__.py": "",
            base + "_ops/__init__.py": "",
            base + "_ops/pointwise.py": "from . import utils\n",  # PyTorch's _ops.utils: the compat module
            base + "_torch_compat/__init__.py": "",
            base + "_torch_compat/ops_utils.py": "",
            base + "_torch_compat/pytorch_paths.py": (
                "PYTORCH_PATHS: dict[str, str] = {\n"
                "    'shardwise.dtensor_ops._ops.utils': 'shardwise.dtensor_ops._torch_compat.ops_utils',\n"
                "    'shardwise.dtensor_ops._random': 'shardwise.dtensor_ops._torch_compat.gone',\n"
                "}\n"
            ),
            base + "_random.py": "",  # a file at a path the table serves
        },
    )
    graph = _graph(tmp_path)
    assert [target for _, target, _ in graph["shardwise.dtensor_ops._ops.pointwise"]] == [
        "shardwise.dtensor_ops._torch_compat.ops_utils"
    ]
    messages = [violation.message for violation in layers.check_tree(tmp_path)]
    assert any("shardwise.dtensor_ops._ops.pointwise (rules) imports shardwise.dtensor_ops._torch_compat.ops_utils" in m for m in messages)
    assert "shardwise.dtensor_ops._random is a file, but the alias table serves it with shardwise.dtensor_ops._torch_compat.gone" in messages
    assert "shardwise.dtensor_ops._random is served by shardwise.dtensor_ops._torch_compat.gone, which is no module" in messages
