"""A repository rule that builds the pinned Python environment and registers it as the toolchain.

`bazel test //...` then never depends on which `python3` is first on the caller's PATH, and works
under --incompatible_strict_action_env. The lock file is a label attribute, so editing it re-runs
this rule and rebuilds the environment.
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
    venv = rctx.path("venv")
    rctx.report_progress("Creating the Python environment from " + str(lock_file))
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

python_env = repository_rule(
    implementation = _python_env_impl,
    attrs = {
        "lock_file": attr.label(mandatory = True, allow_single_file = True),
    },
    environ = ["SHARDWISE_PYTHON", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_FIND_LINKS"],
    local = False,
)
