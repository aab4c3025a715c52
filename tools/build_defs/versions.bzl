"""Exposes every package's VERSION file to Starlark as `@shardwise_versions//:versions.bzl`.

BUILD files cannot read files, but wheel file names must carry the version at analysis time. The
VERSION files stay the single source of truth: they are read through labels, so editing one
re-runs this rule. A new package is added to the list in WORKSPACE.
"""

def _package_versions_impl(rctx):
    versions = {}
    for package in rctx.attr.packages:
        label = Label("//{}:VERSION".format(package))
        text = rctx.read(rctx.path(label)).strip()
        parts = text.split(".")
        if len(parts) != 3 or not all([p.isdigit() for p in parts]):
            fail("{} must hold a semantic version MAJOR.MINOR.PATCH, found {!r}".format(label, text))
        versions[package] = text
    rctx.file("BUILD.bazel", "")
    rctx.file("versions.bzl", "VERSIONS = {}\n".format(repr(versions)))

package_versions = repository_rule(
    implementation = _package_versions_impl,
    attrs = {
        "packages": attr.string_list(mandatory = True),
    },
)
