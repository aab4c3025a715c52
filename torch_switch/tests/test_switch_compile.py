"""torch.compile over shardwise through the switch: what dynamo special-cases for torch's DTensor (its builder
takes ``torch.distributed.tensor.DTensor``, which is shardwise's class under the switch, and checks its flatten
contract, mesh and spec) holds for shardwise's DTensor, DeviceMesh and placements.

A torchrun job of 2 ranks, the program written against torch's paths only: two tensor-parallel blocks (plain
TP, and sequence parallel with a module-input hook), each compiled on its own (``fullgraph=True``, as
torchtitan compiles its TransformerBlocks), forward and backward for 2 SGD steps against the same model in
plain torch (losses and every gradient). Before, dynamo refused shardwise's DTensor at the first block
("Expecting DTensor inner attrs to be ['_local_tensor', 'device_mesh']").
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import compile_helpers
import switch_helpers
from shardwise.torch_switch import ENVIRONMENT_VARIABLE

HELPER = pathlib.Path(compile_helpers.__file__).resolve()


@pytest.fixture(scope="module")
def switched_python(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return switch_helpers.make_environment(tmp_path_factory.mktemp("venv"))


def test_tensor_parallel_blocks_compiled_one_by_one_train_as_plain_torch(
    switched_python: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    env = dict(os.environ)
    env[ENVIRONMENT_VARIABLE] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(HELPER.parent), *sys.path])
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")  # no compile cache shared with other tests
    done = subprocess.run(
        [str(switched_python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(HELPER), "aot_eager"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, f"torchrun exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    assert "step 1: loss" in done.stdout, done.stdout
