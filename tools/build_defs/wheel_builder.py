"""Writes a pure-Python wheel (PEP 427) from source files: deterministic, no build backend needed."""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import zipfile

# Fixed timestamp so the same sources give a byte-identical wheel (Bazel caches by content).
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _metadata(args: argparse.Namespace, readme: str | None) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {args.distribution}",
        f"Version: {args.version}",
        f"Summary: {args.summary}",
        "Requires-Python: >=3.11",
    ]
    lines += [f"Requires-Dist: {requirement}" for requirement in args.requires]
    if readme is not None:
        lines.append("Description-Content-Type: text/markdown")
        return "\n".join(lines) + "\n\n" + readme
    return "\n".join(lines) + "\n"


def _entry_points(console_scripts: list[str]) -> str:
    lines = ["[console_scripts]"]
    for script in sorted(console_scripts):
        name, sep, target = script.partition("=")
        module, colon, function = target.partition(":")
        if not (sep and colon and name.strip() and module.strip() and function.strip()):
            raise SystemExit(f"--console-script {script!r}: expected NAME=MODULE:FUNCTION")
        lines.append(f"{name.strip()} = {module.strip()}:{function.strip()}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", required=True)
    parser.add_argument("--distribution", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--summary", default="")
    parser.add_argument("--strip-prefix", required=True)
    parser.add_argument("--readme")
    parser.add_argument(
        "--platform-tag", default="",
        help="the wheel tag of a package with compiled modules (e.g. cp311-cp311-linux_x86_64); default py3-none-any",
    )
    parser.add_argument("--requires", action="append", default=[])
    parser.add_argument(
        "--console-script", action="append", default=[], metavar="NAME=MODULE:FUNCTION",
        help="a console script the installer creates (entry_points.txt, [console_scripts])",
    )
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()

    prefix = args.strip_prefix.rstrip("/") + "/"
    entries: dict[str, bytes] = {}
    for path in args.files:
        # Sources may come from the source tree or bazel-out; the archive path is package-relative.
        if path.startswith(prefix):
            archive_name = path[len(prefix):]
        elif "/" + prefix in path:
            archive_name = path[path.index("/" + prefix) + len(prefix) + 1:]
        else:
            raise SystemExit(f"{path} is not under the package folder {prefix}")
        with open(path, "rb") as source:
            entries[archive_name] = source.read()

    readme = None
    if args.readme:
        with open(args.readme, encoding="utf-8") as handle:
            readme = handle.read()

    dist_info = f"{args.distribution.replace('-', '_')}-{args.version}.dist-info"
    entries[f"{dist_info}/METADATA"] = _metadata(args, readme).encode()
    if args.console_script:
        entries[f"{dist_info}/entry_points.txt"] = _entry_points(args.console_script).encode()
    purelib = "false" if args.platform_tag else "true"
    entries[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: shardwise wheel_builder\n"
        f"Root-Is-Purelib: {purelib}\nTag: {args.platform_tag or 'py3-none-any'}\n"
    ).encode()

    record_name = f"{dist_info}/RECORD"
    record_lines = [f"{name},{_record_hash(data)},{len(data)}" for name, data in sorted(entries.items())]
    record_lines.append(f"{record_name},,")
    entries[record_name] = ("\n".join(record_lines) + "\n").encode()

    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with zipfile.ZipFile(args.output, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=_ZIP_EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, entries[name])


if __name__ == "__main__":
    main()
