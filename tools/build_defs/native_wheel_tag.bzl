"""Exposes the wheel tag of a package with compiled modules as `@shardwise_wheel_tag//:tag.bzl`.

A wheel holding a C++ extension is only good for the interpreter and platform it was built for, so
its file name and WHEEL file carry e.g. `cp311-cp311-linux_x86_64` instead of `py3-none-any`. The
tag is that of the pinned interpreter, the one that compiles the extensions; BUILD files need it at
analysis time (the wheel's file name), hence a repository rule. Both Python environments are made from
the host's Python (`host_python.bzl`), so the tag is read from it: asking an environment's interpreter
would build that environment (a whole pip install of the lock file) just for the tag.
"""

load(":host_python.bzl", "find_host_python")

_TAG_SCRIPT = """
import sys, sysconfig
python = "cp%d%d" % sys.version_info[:2]
print("-".join([python, python, sysconfig.get_platform().replace("-", "_").replace(".", "_")]))
"""

def _native_wheel_tag_impl(rctx):
    interpreter = find_host_python(rctx)
    result = rctx.execute([interpreter, "-c", _TAG_SCRIPT], quiet = True)
    if result.return_code != 0:
        fail("Computing the native wheel tag with {} failed:\n{}".format(interpreter, result.stderr))
    rctx.file("BUILD.bazel", "")
    rctx.file("tag.bzl", "NATIVE_WHEEL_TAG = {}\n".format(repr(result.stdout.strip())))

native_wheel_tag = repository_rule(
    implementation = _native_wheel_tag_impl,
    environ = ["SHARDWISE_PYTHON"],
)
