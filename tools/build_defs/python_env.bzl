"""A repository rule that builds the pinned Python environment, and its toolchain, in one of two forms.

`hermetic = True` (`@shardwise_python_hermetic`, the default toolchain, registered in WORKSPACE): the
environment as ONE declared archive plus a launcher, described below.
`hermetic = False` (`@shardwise_python`, selected by `--config=venv`): a virtual environment in the
output base named by `interpreter_path`, which carries no inputs (local use only). Both are built from
the same lock file, so editing it re-runs this rule (it is a label attribute).

Hermetic form:

`python_env_builder.py` lays out a relocatable copy of the host's Python (binary, shared library,
standard library, headers) plus every locked package, with bytecode precompiled (`unchecked-hash`,
build paths stripped), and packs it into one deterministic, uncompressed tar archive
(`python_env.tar`, 1.3 GB, ~30,000 files), whose sha256 is written into the launcher `bin/python3`
(`python_env_launcher.sh.tpl`). The `py_runtime` names that launcher as its interpreter by label and
carries the archive in `files`, so every `py_test` and `py_binary` action has 2 inputs for its
Python (instead of the ~30,000 files an earlier form declared one by one: ~60,000 inputs per test
action, tens of seconds of sandbox and runfiles set-up each, and a remote upload file by file). On
first use the launcher unpacks the archive into a directory named by its digest: a machine-local
cache (`/tmp/shardwise-python-env-<uid>`, or $SHARDWISE_PYTHON_ENV_CACHE), else the action's own
scratch area; see the template for the trade-off. The action therefore runs the same on a remote
worker that has none of the client's paths, and nothing resolves through PATH except the OS's
`python3` that starts Bazel's launcher stub (and /bin/sh, tar for the launcher).

`bazel test //...` never depends on which `python3` is first on the caller's PATH, and works under
--incompatible_strict_action_env.
"""

load(":host_python.bzl", "find_host_python")

_MIN_PYTHON = (3, 11)

# The hermetic environment's one archive, at the repository's root.
_ARCHIVE = "python_env.tar"

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
    host_python = find_host_python(rctx)
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
    rctx.report_progress("Building the Python environment archive from " + str(lock_file))
    _run(
        rctx,
        [
            host_python,
            str(builder),
            "--lock",
            str(lock_file),
            "--dest",
            str(rctx.path("unpacked")),
            "--archive",
            str(rctx.path(_ARCHIVE)),
        ],
        "Building the Python environment (tools/build_defs/python_env_builder.py)",
        timeout = 3600,
    )
    layout = json.decode(rctx.read(_ARCHIVE + ".json"))
    rctx.template(
        "bin/python3",
        rctx.attr._launcher_template,
        substitutions = {
            "@DIGEST@": layout["archive_sha256"],
            "@ARCHIVE@": "../" + _ARCHIVE,
        },
        executable = True,
    )

    rctx.file("BUILD.bazel", """\
load("@rules_python//python:defs.bzl", "py_runtime", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

# The whole environment ({files} files: interpreter, standard library, locked packages, C headers)
# as one uncompressed tar archive, sha256 {digest}.
filegroup(
    name = "files",
    srcs = ["{archive}"],
)

# The interpreter: a launcher that unpacks the archive on first use into a directory named by its
# digest, then runs the interpreter there (tools/build_defs/python_env_launcher.sh.tpl). Genrules
# that run it list :files in their `tools` too.
filegroup(
    name = "python3",
    srcs = ["bin/python3"],
)

py_runtime(
    name = "py3_runtime",
    interpreter = "bin/python3",
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
""".format(
        archive = _ARCHIVE,
        digest = layout["archive_sha256"],
        files = layout["files"],
        stub_shebang = _STUB_SHEBANG,
    ))

python_env = repository_rule(
    implementation = _python_env_impl,
    attrs = {
        "lock_file": attr.label(mandatory = True, allow_single_file = True),
        "hermetic": attr.bool(default = True, doc = "declared files (True) or a virtual environment named by path (False)"),
        "_builder": attr.label(default = "//tools/build_defs:python_env_builder.py", allow_single_file = True),
        "_launcher_template": attr.label(default = "//tools/build_defs:python_env_launcher.sh.tpl", allow_single_file = True),
    },
    environ = ["SHARDWISE_PYTHON", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_FIND_LINKS"],
    local = False,
)
