"""Offline stand-in for rules_python: the standard load path over Bazel's native Python rules.

No registry reachable from our machines carries the real rules_python, so BUILD files load from
here; a newer Bazel with the real rules_python can replace this repository without touching them.
"""

load("@bazel_tools//tools/python:toolchain.bzl", _py_runtime_pair = "py_runtime_pair")

# --incompatible_load_python_rules_from_bzl accepts native Python rules only when this tag, the one the
# real rules_python adds, is present: it marks the call as coming through the rules_python load path.
_MIGRATION_TAG = "__PYTHON_RULES_MIGRATION_DO_NOT_USE_WILL_BREAK__"

def _tagged(attrs):
    attrs["tags"] = list(attrs.get("tags", [])) + [_MIGRATION_TAG]
    return attrs

def py_library(**attrs):
    native.py_library(**_tagged(attrs))

def py_binary(**attrs):
    native.py_binary(**_tagged(attrs))

def py_test(**attrs):
    native.py_test(**_tagged(attrs))

def py_runtime(**attrs):
    native.py_runtime(**_tagged(attrs))

def py_runtime_pair(**attrs):
    _py_runtime_pair(**attrs)
