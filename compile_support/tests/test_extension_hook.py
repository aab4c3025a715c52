"""The extension hook: with compile_support installed, `import shardwise.dtensor_ops` alone makes DTensor
compile; without it, dtensor_ops works eagerly and DTensor conversions do not compile.

Each case runs in a fresh interpreter whose ``sys.path`` holds the package folders of this one, with or
without compile_support's.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent(
    """
    import json, sys, tempfile, os
    import torch
    import torch.distributed as dist
    import shardwise.dtensor_ops as dtensor_ops
    from torch._library.opaque_object import is_opaque_type
    from shardwise.dtensor_ops import DTensor, Shard, distribute_tensor, init_device_mesh

    report = {
        "extensions": list(dtensor_ops._extensions.installed_extensions()),
        "dynamo_imported_by_dtensor_ops": "torch._dynamo" in sys.modules,
        "shard_is_opaque": is_opaque_type(Shard),
    }
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    report["eager"] = (x * 2).full_tensor().tolist()
    try:
        compiled = torch.compile(lambda t: DTensor.from_local(t, mesh, [Shard(0)]) * 2, backend="eager", fullgraph=True)
        report["compiled_from_local"] = compiled(torch.arange(4.0)).to_local().tolist()
    except Exception as error:
        report["compiled_from_local"] = type(error).__name__
    dist.destroy_process_group()
    print("REPORT" + json.dumps(report))
    """
)


def _package_roots() -> dict[str, str]:
    """Package name -> the sys.path entry holding ``shardwise/<package>`` in this interpreter."""
    roots: dict[str, str] = {}
    for entry in sys.path:
        folder = pathlib.Path(entry or ".") / "shardwise"
        if folder.is_dir():
            for child in folder.iterdir():
                if child.is_dir() and (child / "__init__.py").exists():
                    roots.setdefault(child.name, str(pathlib.Path(entry or ".").resolve()))
    return roots


def _run_probe(with_compile_support: bool) -> dict[str, object]:
    import json

    roots = _package_roots()
    if "compile_support" not in roots or "dtensor_ops" not in roots:
        pytest.fail(f"expected compile_support and dtensor_ops importable from sys.path, found {sorted(roots)}")
    if not with_compile_support and roots["compile_support"] == roots["dtensor_ops"]:
        pytest.skip("every package shares one folder here (an installed layout): cannot leave compile_support out")
    entries = sorted(
        {root for name, root in roots.items() if with_compile_support or name != "compile_support"}
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(entries)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT")]
    assert done.returncode == 0 and lines, f"probe failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    return dict(json.loads(lines[-1][len("REPORT") :]))


def test_installed_the_hook_runs_without_any_extra_import() -> None:
    report = _run_probe(with_compile_support=True)
    assert report["extensions"] == ["compile_support"]
    assert report["shard_is_opaque"] is True
    # The dynamo half of the hook waits for dynamo: importing dtensor_ops does not pay for it.
    assert report["dynamo_imported_by_dtensor_ops"] is False
    assert report["eager"] == [0.0, 2.0, 4.0, 6.0]
    assert report["compiled_from_local"] == [0.0, 2.0, 4.0, 6.0]


def test_absent_dtensor_ops_works_eagerly_and_from_local_does_not_compile() -> None:
    report = _run_probe(with_compile_support=False)
    assert report["extensions"] == []
    assert report["shard_is_opaque"] is False
    assert report["eager"] == [0.0, 2.0, 4.0, 6.0]
    assert report["compiled_from_local"] == "Unsupported"
