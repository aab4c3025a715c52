"""`sw_wheel`: the wheel of one package, its sibling wheels as compatible-range requirements.

Pure Python (`py3-none-any`) unless `platform_tag` is set, for a package that ships compiled modules.
"""

WheelInfo = provider(
    doc = "A built shardwise wheel.",
    fields = {
        "distribution": "distribution name, e.g. shardwise-mesh",
        "version": "the package version",
        "wheel": "the .whl File",
        "transitive_wheels": "depset of this wheel and every sibling wheel it requires",
    },
)

def compatible_range(version):
    """The versions a dependent accepts: same minor while below 1.0, same major from 1.0 on."""
    major, minor, _patch = [int(part) for part in version.split(".")]
    if major == 0:
        return ">={},<0.{}".format(version, minor + 1)
    return ">={},<{}".format(version, major + 1)

def _sw_wheel_impl(ctx):
    tag = ctx.attr.platform_tag or "py3-none-any"
    file_stem = "{}-{}-{}".format(ctx.attr.distribution.replace("-", "_"), ctx.attr.version, tag)
    wheel = ctx.actions.declare_file(file_stem + ".whl")

    requirements = list(ctx.attr.external_requires)
    for dep in ctx.attr.requires:
        info = dep[WheelInfo]
        requirements.append("{}{}".format(info.distribution, compatible_range(info.version)))

    args = ctx.actions.args()
    args.add("--output", wheel)
    args.add("--distribution", ctx.attr.distribution)
    args.add("--version", ctx.attr.version)
    args.add("--summary", ctx.attr.summary)
    args.add("--strip-prefix", ctx.attr.strip_prefix)
    if ctx.attr.platform_tag:
        args.add("--platform-tag", ctx.attr.platform_tag)
    if ctx.file.readme:
        args.add("--readme", ctx.file.readme)
    args.add_all(requirements, before_each = "--requires")
    args.add_all(
        ["{}={}".format(name, target) for name, target in sorted(ctx.attr.console_scripts.items())],
        before_each = "--console-script",
    )
    args.add_all(ctx.files.srcs)

    inputs = list(ctx.files.srcs)
    if ctx.file.readme:
        inputs.append(ctx.file.readme)
    ctx.actions.run(
        executable = ctx.executable._builder,
        arguments = [args],
        inputs = inputs,
        outputs = [wheel],
        mnemonic = "PyWheel",
        progress_message = "Building wheel " + wheel.short_path,
    )

    transitive = depset([wheel], transitive = [dep[WheelInfo].transitive_wheels for dep in ctx.attr.requires])
    return [
        # Returned as runfiles too, so tests can take wheels as `data`.
        DefaultInfo(files = depset([wheel]), runfiles = ctx.runfiles(transitive_files = transitive)),
        WheelInfo(
            distribution = ctx.attr.distribution,
            version = ctx.attr.version,
            wheel = wheel,
            transitive_wheels = transitive,
        ),
    ]

sw_wheel = rule(
    implementation = _sw_wheel_impl,
    attrs = {
        "distribution": attr.string(mandatory = True),
        "version": attr.string(mandatory = True),
        "srcs": attr.label_list(allow_files = True),
        "strip_prefix": attr.string(mandatory = True),
        # e.g. "cp311-cp311-linux_x86_64" for a package with compiled modules; empty: pure Python.
        "platform_tag": attr.string(default = ""),
        "readme": attr.label(allow_single_file = True),
        "summary": attr.string(default = ""),
        "requires": attr.label_list(providers = [WheelInfo]),
        "external_requires": attr.string_list(),
        # Console scripts the installer creates: {"name": "module:function"}.
        "console_scripts": attr.string_dict(),
        "_builder": attr.label(
            default = "//tools/build_defs:wheel_builder",
            executable = True,
            cfg = "exec",
        ),
    },
)
