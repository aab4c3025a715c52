"""shardwise's Bazel macros: one call of `sw_package` per package folder.

    load("//tools/build_defs:defs.bzl", "sw_package")
    sw_package(name = "mesh", deps = [], test_deps = ["//testing"])

declares, for package folder `mesh/` (import `shardwise.mesh`, wheel `shardwise-mesh`):
  //mesh:mesh         py_library over mesh/shardwise/mesh/**
  //mesh:wheel        shardwise_mesh-<VERSION>-py3-none-any.whl (or the platform's tag, with native_modules)
  //mesh:tests_<k>    the package's test files packed into a few pytest processes (see below)
  //mesh:test_<file>  one pytest target per mesh/tests/test_*.py, tagged `manual`: run by name
                      (`bazel test //mesh:test_layout`), not by `//...`
Every package is type-checked by the root //:mypy_test (one mypy run, root mypy.ini).

Why packed: a pytest process that imports torch, pytest and the packages and starts a rank pool costs
about 6 s of one core before its first test, which over ~115 files was a quarter of `bazel test //...`
on 2 cores. Files of a package that run alike (same world size) are packed into targets of about
GROUP_SECONDS of test time each, longest first onto the lightest (test_seconds.bzl has the measured
seconds; `tools/build_defs/test_seconds.py` refreshes it). One process then serves several files and
its rank pool serves them all. GPU files keep one target each.
"""

load("@rules_python//python:defs.bzl", "py_library", "py_test")
load("@shardwise_versions//:versions.bzl", "VERSIONS")
load("@shardwise_wheel_tag//:tag.bzl", "NATIVE_WHEEL_TAG")
load(":test_seconds.bzl", "TEST_SECONDS")
load(":wheel.bzl", "sw_wheel")

_PYTEST_RUNNER = "//tools/build_defs:pytest_runner.py"
_MYPY_RUNNER = "//tools/build_defs:mypy_runner.py"

# Test seconds a packed target aims at, and what an unmeasured file is taken to need.
GROUP_SECONDS = 150
DEFAULT_TEST_SECONDS = 10

# Labels of a remote-execution GPU pool's platform properties; executors read what they know.
def _gpu_exec_properties(gpu_count):
    return {
        "OSFamily": "Linux",
        "gpu": "nvidia",
        "gpu-count": str(gpu_count),
    }

def sw_pytest(name, src = None, srcs = [], deps = [], data = [], env = {}, tags = [], size = "small", **kwargs):
    """One pytest process over one file (`src`) or several (`srcs`), as one test target run with the pinned
    interpreter; JUnit XML for CI."""
    files = ([src] if src else []) + list(srcs)
    py_test(
        name = name,
        srcs = files + [_PYTEST_RUNNER],
        main = _PYTEST_RUNNER,
        args = ["$(rootpath {})".format(f) for f in files],
        deps = deps,
        data = data,
        env = env,
        tags = tags,
        size = size,
        legacy_create_init = False,
        python_version = "PY3",
        **kwargs
    )

def sw_multi_rank_test(name, src = None, srcs = [], world_size = 4, gpu = False, deps = [], env = {}, tags = [], size = "medium", **kwargs):
    """Pytest files (one process) whose tests run on `world_size` ranks through shardwise.testing's pool.

    gpu=True: NCCL with one GPU per rank (with fewer GPUs, shardwise.testing runs the ranks on the
    GPUs they share, over gloo). Tagged `gpu` (filtered out by default, run by
    --config=gpu, one at a time through its --local_test_jobs=1), and carries exec_properties
    asking a remote-execution pool (--config=remote) for a machine with `world_size` GPUs. Not
    `exclusive`: Bazel 4 runs exclusive tests locally only, so --config=remote could not send them
    ("No usable spawn strategy found for spawn with mnemonic TestRunner", seen in the loopback check).
    """
    test_env = dict(env)
    test_env["SHARDWISE_TEST_WORLD_SIZE"] = str(world_size)
    test_tags = list(tags) + ["multi_rank"]
    exec_properties = {}
    if gpu:
        test_env["SHARDWISE_TEST_BACKEND"] = "nccl"
        test_tags += ["gpu"]
        exec_properties = _gpu_exec_properties(world_size)
    sw_pytest(
        name = name,
        src = src,
        srcs = srcs,
        deps = deps,
        env = test_env,
        tags = test_tags,
        size = size,
        exec_properties = exec_properties,
        **kwargs
    )

def sw_mypy_test(name, packages, libraries):
    """Type-checks packages with the root mypy.ini (strict defs) in ONE mypy run, as a test target.

    One run for every package: most of a cold mypy run is reading torch, which each per-package run
    repeated (8 targets took ~290 s of test time on 2 cores; one takes ~25 s).
    """
    py_test(
        name = name,
        srcs = [_MYPY_RUNNER],
        main = _MYPY_RUNNER,
        args = ["shardwise." + package for package in packages],
        deps = libraries,
        data = ["//:mypy.ini"],
        size = "medium",
        legacy_create_init = False,
        python_version = "PY3",
    )

def _test_target_name(src):
    return src.split("/")[-1][:-len(".py")]

def sw_package(name, deps = [], test_deps = [], multi_rank_tests = {}, test_data = [], summary = None, native_modules = {}):
    """Declares the library, wheel and tests of a package: its test files packed into `tests_<k>` targets,
    each file also a `manual` target of its own (see the module docstring; mypy: //:mypy_test).

    Args:
      name: the package folder and import name (`shardwise.<name>`).
      deps: sibling package libraries this package imports (they become wheel requirements too).
      test_deps: extra libraries the tests import (e.g. "//testing").
      multi_rank_tests: {"tests/test_x.py": world_size} for files that run on ranks.
        Files named tests/test_*_gpu.py always run on GPUs (world size from this dict, default 2).
      test_data: files the tests read.
      summary: the wheel's one-line description.
      native_modules: {"shardwise/<pkg>/_ext.so": "//<pkg>/csrc:ext"}: compiled modules built by
        other targets, placed at that path in the library (tests import them) and in the wheel,
        which then carries the pinned interpreter's platform tag. Modules built by hand inside the
        source tree (*.so) are never packaged: builds stay reproducible from the sources.
    """
    if name not in VERSIONS:
        fail("package {} has no VERSION registered: add it to package_versions in WORKSPACE".format(name))
    for path, built in sorted(native_modules.items()):
        native.genrule(
            name = "native_" + path.split("/")[-1].split(".")[0].lstrip("_"),
            srcs = [built],
            outs = [path],
            cmd = "cp $< $@",
        )
    py_library(
        name = name,
        srcs = native.glob(["shardwise/**/*.py"]),
        # A package's top-level *.pth files (the switch's) are data here and land at the wheel's root.
        data = native.glob(["shardwise/**/py.typed", "*.pth"]) + sorted(native_modules.keys()),
        imports = ["."],
        deps = deps,
        visibility = ["//visibility:public"],
    )
    native.filegroup(
        name = "all_files",
        srcs = native.glob(["shardwise/**", "tests/**", "README.md", "VERSION"], exclude = ["**/__pycache__/**"]),
        visibility = ["//visibility:public"],
    )
    sw_wheel(
        name = "wheel",
        distribution = "shardwise-" + name.replace("_", "-"),
        version = VERSIONS[name],
        srcs = native.glob(["shardwise/**", "*.pth"], exclude = ["**/__pycache__/**", "**/*.pyc", "**/*.so"]) +
               sorted(native_modules.keys()),
        strip_prefix = native.package_name(),
        platform_tag = NATIVE_WHEEL_TAG if native_modules else "",
        readme = "README.md" if native.glob(["README.md"]) else None,
        requires = [_wheel_label(dep) for dep in deps],
        external_requires = ["torch>=2.13,<2.14"],
        summary = summary or "shardwise " + name,
        visibility = ["//visibility:public"],
    )

    helpers = native.glob(["tests/*.py"], exclude = ["tests/test_*.py"])
    test_libs = [":" + name] + test_deps
    if helpers:
        py_library(
            name = "test_helpers",
            srcs = helpers,
            imports = ["tests"],
            deps = test_libs,
            testonly = True,
        )
        test_libs = test_libs + [":test_helpers"]

    # World size (0: not multi-rank) -> the CPU test files that run with it, packed together below.
    alike = {}
    for src in native.glob(["tests/test_*.py"]):
        target = _test_target_name(src)
        if src.endswith("_gpu.py"):
            sw_multi_rank_test(
                name = target,
                src = src,
                world_size = multi_rank_tests.get(src, 2),
                gpu = True,
                deps = test_libs,
                data = test_data,
            )
            continue
        world_size = multi_rank_tests.get(src, 0)
        alike.setdefault(world_size, []).append(src)
        _cpu_test(target, [src], world_size, test_libs, test_data, tags = ["manual"])

    groups = []
    for world_size in sorted(alike):
        for files in pack_test_files(native.package_name(), alike[world_size]):
            groups.append((world_size, files))
    for index, (world_size, files) in enumerate(groups):
        # flaky: a multi-rank target is retried (up to 3 attempts; Bazel reports it FLAKY) while the one rank
        # SIGSEGV seen in a packed clean run is not understood: a non-Python thread of a rank (gloo's) died
        # while the rank was in a plain CPU gloo all-gather (dtensor_ops tests_5, 1 of ~110 packed target
        # runs over 4 clean suites; 0 of 21 runs of that target alone since, 15 of them with core dumps on).
        _cpu_test("tests_{}".format(index + 1), files, world_size, test_libs, test_data, size = "medium", flaky = world_size > 0)

def _cpu_test(name, files, world_size, deps, data, tags = [], size = None, flaky = False):
    if world_size:
        sw_multi_rank_test(name = name, srcs = files, world_size = world_size, deps = deps, data = data, tags = tags, size = size or "medium", flaky = flaky)
    else:
        sw_pytest(name = name, srcs = files, deps = deps, data = data, tags = tags, size = size or "small", flaky = flaky)

def pack_test_files(package, files):
    """`files` (paths inside `package`) in lists of about GROUP_SECONDS of measured test time each.

    Longest first, each onto the lightest list so far; the number of lists is the total over
    GROUP_SECONDS, rounded up. Each list is sorted, so the packing only changes when the files or
    their measured seconds do.
    """
    weighted = sorted([(-TEST_SECONDS.get(package + "/" + f, DEFAULT_TEST_SECONDS), f) for f in files])
    total = 0
    for negative_weight, _ in weighted:
        total -= negative_weight
    count = min(len(files), max(1, (total + GROUP_SECONDS - 1) // GROUP_SECONDS))
    loads = [0] * count
    lists = [[] for _ in range(count)]
    for negative_weight, f in weighted:
        lightest = 0
        for index in range(count):
            if loads[index] < loads[lightest]:
                lightest = index
        lists[lightest].append(f)
        loads[lightest] -= negative_weight
    return [sorted(members) for members in lists]

def _wheel_label(dep):
    # "//placement" -> "//placement:wheel"
    if ":" in dep:
        return dep.split(":")[0] + ":wheel"
    return dep + ":wheel"
