"""A repository rule that builds the pinned Python environment, and its toolchain, in one of two forms.

`hermetic = True` (`@shardwise_python_hermetic`, selected by `--config=hermetic`, which every remote
config includes): the environment as declared files, described below. `hermetic = False`
(`@shardwise_python`, the default toolchain of `bazel test //...`): a virtual environment in the
output base named by `interpreter_path`, which carries no inputs. Both are built from the same lock
file. Why two: a hermetic test action links ~60,000 input files into its sandbox (tens of seconds
per test target on these 2-core machines, 109 targets), which would push the local suite far past
its 20-minute budget, while remote execution needs exactly those inputs.

Hermetic form:

The interpreter (a copy of the host's binary, its shared library and standard library) and every
package of the lock file are files of the repository `@shardwise_python`, listed by a glob. The
`py_runtime` names the interpreter by label and carries all of them in `files`, so every `py_test`
and `py_binary` has its interpreter and dependencies as inputs of its action: the action runs the
same on a remote worker that has none of the client's paths, and nothing resolves through PATH.
(The previous toolchain named an absolute `interpreter_path` inside the client's output base.)

`bazel test //...` never depends on which `python3` is first on the caller's PATH, and works under
--incompatible_strict_action_env. The lock file is a label attribute, so editing it re-runs this rule.
"""

_MIN_PYTHON = (3, 11)

def _find_host_python(rctx):
    override = rctx.os.environ.get("SHARDWISE_PYTHON")
    if override:
        return override
    for name in ["python3.11", "python3"]:
        found = rctx.which(name)
        if found:
            return str(found)
    fail("No python3 found on PATH to create the environment from; set SHARDWISE_PYTHON=/path/to/python3.11")

def _run(rctx, args, what, timeout = 600):
    result = rctx.execute(args, timeout = timeout, quiet = True)
    if result.return_code != 0:
        fail("{} failed (exit {}):\n{}\n{}".format(what, result.return_code, result.stdout, result.stderr))
    return result

# The stub Bazel writes for every py_binary/py_test is a small stdlib-only Python script that finds the
# runfiles and execs the runtime's interpreter (ours, from the inputs). Something must run the stub
# itself: the OS's python3, the same way /bin/bash runs shell actions. Debian and Ubuntu ship one.
_STUB_SHEBANG = "#!/usr/bin/env python3"

def _local_env(rctx, host_python, lock_file):
    """The virtual environment named by path: fast locally, useless to a remote worker."""
    venv = rctx.path("venv")
    rctx.report_progress("Creating the local Python environment from " + str(lock_file))
    _run(rctx, [host_python, "-m", "venv", str(venv)], "Creating the virtual environment")
    interpreter = str(venv) + "/bin/python3"
    _run(
        rctx,
        [interpreter, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check", "-r", str(lock_file)],
        "Installing " + str(lock_file),
        timeout = 3600,
    )
    rctx.file("BUILD.bazel", """\
load("@rules_python//python:defs.bzl", "py_runtime", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{interpreter}",
    python_version = "PY3",
    stub_shebang = "#!{interpreter}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

exports_files(["interpreter_path.txt"])
""".format(interpreter = interpreter))
    rctx.file("interpreter_path.txt", interpreter + "\n")

def _python_env_impl(rctx):
    host_python = _find_host_python(rctx)
    version = _run(rctx, [host_python, "-c", "import sys; print('%d %d' % sys.version_info[:2])"], "Probing " + host_python)
    major, minor = [int(part) for part in version.stdout.strip().split(" ")]
    if (major, minor) < _MIN_PYTHON:
        fail("{} is Python {}.{}; shardwise needs {}.{} or newer (set SHARDWISE_PYTHON)".format(
            host_python,
            major,
            minor,
            _MIN_PYTHON[0],
            _MIN_PYTHON[1],
        ))

    lock_file = rctx.path(rctx.attr.lock_file)
    if not rctx.attr.hermetic:
        _local_env(rctx, host_python, lock_file)
        return
    builder = rctx.path(rctx.attr._builder)
    rctx.report_progress("Building the Python environment from " + str(lock_file))
    _run(
        rctx,
        [host_python, str(builder), "--lock", str(lock_file), "--dest", str(rctx.path("python"))],
        "Building the Python environment (tools/build_defs/python_env_builder.py)",
        timeout = 3600,
    )
    layout = json.decode(rctx.read("python/layout.json"))
    interpreter = "python/" + layout["interpreter"]

    rctx.file("BUILD.bazel", """\
load("@rules_python//python:defs.bzl", "py_runtime", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

# The whole environment: interpreter, standard library, locked packages, C headers.
filegroup(
    name = "files",
    srcs = glob(["python/**"], exclude = ["python/layout.json"]),
)

# The interpreter alone, for genrules that run Python (their `tools` also list :files).
filegroup(
    name = "python3",
    srcs = ["{interpreter}"],
)

py_runtime(
    name = "py3_runtime",
    interpreter = "{interpreter}",
    files = [":files"],
    python_version = "PY3",
    stub_shebang = "{stub_shebang}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

exports_files(["interpreter_path.txt"])
""".format(interpreter = interpreter, stub_shebang = _STUB_SHEBANG))

    # For repository rules only (native_wheel_tag asks the interpreter for its wheel tag while BUILD
    # files load); no action reads it.
    rctx.file("interpreter_path.txt", str(rctx.path(interpreter)) + "\n")

python_env = repository_rule(
    implementation = _python_env_impl,
    attrs = {
        "lock_file": attr.label(mandatory = True, allow_single_file = True),
        "hermetic": attr.bool(default = True, doc = "declared files (True) or a virtual environment named by path (False)"),
        "_builder": attr.label(default = "//tools/build_defs:python_env_builder.py", allow_single_file = True),
    },
    environ = ["SHARDWISE_PYTHON", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_FIND_LINKS"],
    local = False,
)
