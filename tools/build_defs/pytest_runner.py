"""Runs one pytest file as a Bazel test: JUnit XML where Bazel asks for it, every write under TEST_TMPDIR."""

from __future__ import annotations

import os
import sys

# Before anything imports: bytecode of the test's own sources is not written into the runfiles tree
# (the locked packages come with precompiled bytecode, which is still read).
sys.dont_write_bytecode = True

import pytest  # noqa: E402


def _scratch_environment(scratch: str) -> dict[str, str]:
    """Where every cache and temporary file of this test and its child processes goes.

    Set through the environment, so rank processes, torchrun workers and compilers started by the
    test inherit it. Without it inductor shares /tmp/torchinductor_<user> with every other process on
    the machine (a rank could wait on a lock held by another test's compile, or read its artifacts),
    triton and the CUDA driver write under $HOME, and hypothesis writes into the runfiles tree.
    """
    home = os.path.join(scratch, "home")
    return {
        "TMPDIR": os.path.join(scratch, "tmp"),
        "HOME": home,
        "XDG_CACHE_HOME": os.path.join(home, ".cache"),
        "XDG_CONFIG_HOME": os.path.join(home, ".config"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "torchinductor"),
        "TRITON_CACHE_DIR": os.path.join(scratch, "triton", "cache"),
        "TRITON_HOME": os.path.join(scratch, "triton"),
        "CUDA_CACHE_PATH": os.path.join(scratch, "cuda_cache"),
        "MPLCONFIGDIR": os.path.join(scratch, "matplotlib"),
        "TORCH_HOME": os.path.join(scratch, "torch_home"),
        "HYPOTHESIS_STORAGE_DIRECTORY": os.path.join(scratch, "hypothesis"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _confine_writes_to_test_tmpdir() -> None:
    scratch = os.environ.get("TEST_TMPDIR")
    if not scratch:
        return  # run by hand, outside Bazel: the user's own caches are what they expect
    for name, value in _scratch_environment(os.path.abspath(scratch)).items():
        os.environ[name] = value
        if name != "PYTHONDONTWRITEBYTECODE":
            os.makedirs(value, exist_ok=True)
    import tempfile

    tempfile.tempdir = None  # re-read TMPDIR if something already asked


def main() -> int:
    test_files = sys.argv[1:]
    if not test_files:
        print("pytest_runner: no test file given", file=sys.stderr)
        return 2
    _confine_writes_to_test_tmpdir()
    args = ["-p", "no:cacheprovider", "-ra", "--tb=short", *test_files]
    xml_output = os.environ.get("XML_OUTPUT_FILE")
    if xml_output:
        args += ["--junitxml", xml_output]
    shard_filter = os.environ.get("TESTBRIDGE_TEST_ONLY")
    if shard_filter:
        args += ["-k", shard_filter]
    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main())
