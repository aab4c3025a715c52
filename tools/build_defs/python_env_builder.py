"""Builds the pinned Python environment as plain files in one directory (run by python_env.bzl).

    python_env_builder.py --lock requirements.lock --dest DIR [--archive ENV.tar]

lays out DIR as a relocatable Python installation:

    DIR/bin/python3           the interpreter every Bazel action runs (a launcher, see below)
    DIR/bin/python3.X         a copy of the host interpreter's binary
    DIR/lib/libpython3.X.so*  its shared library, when it was built with one
    DIR/lib/python3.X/...     its standard library (without the test suite and GUI modules)
    DIR/<site dir>/...        every locked package, installed with `pip --no-deps --target`
    DIR/include/python3.X     its C headers (inductor and the pybind11 extension compile against them)

and writes DIR/layout.json (the interpreter's relative path, the site dir) for the repository rule.

With --archive, the directory is then packed into ONE uncompressed tar file (deterministic: sorted
names, mtime 0, owner 0, no user names), DIR is removed, and layout.json (written next to the
archive, as ENV.tar.json) also holds the archive's sha256. That archive is what the hermetic
toolchain declares: an action carries one 1.3 GB input instead of ~30,000 files, and the launcher
python_env.bzl writes unpacks it on first use into a directory named by that digest. Uncompressed
because unpacking it is what every cold action pays (about 4 s here, gzip about 25 s, zstd about 13 s;
measured on this 2-core machine), while the upload to a remote CAS happens once per lock file.

Everything is a declared file of the repository, so each test action carries its interpreter and
packages as inputs and runs on a machine that has none of the client's paths (remote execution).
Python finds its standard library relative to its own binary, so the copy works wherever it lands.
Bytecode is compiled here with unchecked-hash invalidation: a remote worker materialises inputs with
new mtimes, which would make timestamp-checked .pyc files stale and have every test action recompile
torch (tens of seconds per action on two cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tarfile

# Parts of the standard library no test or build step imports; the test suite alone is ~2,000 files
# that every action would otherwise carry.
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "__pycache__", "ensurepip"}

# Runfiles manifests separate the two paths of an entry with a space, so Bazel 4 cannot carry a file
# whose path holds one (setuptools ships three: "Lorem ipsum.txt", "script (dev).tmpl", "launcher manifest.xml").
_UNCARRIABLE = (" ", "\n", "\t")


def _copy_stdlib(source: str, dest: str) -> None:
    def ignore(directory: str, names: list[str]) -> set[str]:
        skipped = {name for name in names if name in _STDLIB_SKIP or name.endswith(".pyc")}
        if os.path.samefile(directory, source):
            return skipped
        return {name for name in names if name == "__pycache__" or name.endswith(".pyc")}

    shutil.copytree(source, dest, symlinks=False, ignore=ignore)


def _copy_shared_library(dest_lib: str) -> str | None:
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    name = sysconfig.get_config_var("LDLIBRARY")
    libdir = sysconfig.get_config_var("LIBDIR")
    path = os.path.join(libdir, name)
    if not os.path.exists(path):
        raise SystemExit(f"python_env_builder: the interpreter is built shared but {path} does not exist")
    os.makedirs(dest_lib, exist_ok=True)
    real = os.path.realpath(path)
    # Keep both the unversioned name and the soname the binary asks for.
    for target_name in {name, os.path.basename(real), sysconfig.get_config_var("INSTSONAME") or name}:
        shutil.copy2(real, os.path.join(dest_lib, target_name))
    return str(os.path.basename(real))


def _write_launcher(path: str, binary_name: str, shared: bool) -> None:
    # A host build with a shared libpython carries an absolute RUNPATH to the host's lib directory
    # (pyenv: /root/.pyenv/versions/X/lib); the launcher points the loader at our copy instead.
    # Ranks and compilers started with sys.executable inherit LD_LIBRARY_PATH from it.
    lines = ["#!/bin/sh", 'here="$(dirname "$0")"']
    if shared:
        lines.append('LD_LIBRARY_PATH="$here/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"')
        lines.append("export LD_LIBRARY_PATH")
    lines.append(f'exec "$here/{binary_name}" "$@"')
    with open(path, "w") as launcher:
        launcher.write("\n".join(lines) + "\n")
    os.chmod(path, 0o755)


def _site_dir_relative() -> str:
    # Where this kind of interpreter's own site.py looks for packages under its prefix
    # (pyenv/python.org: lib/python3.X/site-packages; Debian: local/lib/python3.X/dist-packages).
    base = sys.base_prefix
    purelib = sysconfig.get_path("purelib", vars={"base": base, "platbase": base, "installed_base": base})
    relative = os.path.relpath(purelib, base)
    if relative.startswith(".."):
        relative = os.path.join("lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")
    return relative


def _rename_uncarriable(root: str, site_path: str) -> list[str]:
    """Renames files whose names Bazel 4's runfiles cannot carry (a space) and the sources naming them.

    setuptools reads `jaraco/text/Lorem ipsum.txt` when imported (dropping it breaks `import setuptools`,
    hence torch's build helpers and pip's wheel installs): the file becomes `Lorem_ipsum.txt`, and each
    quoted occurrence of the old name in the Python sources of the same top-level package is rewritten
    (before bytecode is compiled).
    """
    renamed = []
    for directory, _dirnames, filenames in os.walk(root):
        for name in filenames:
            if not any(ch in name for ch in _UNCARRIABLE):
                continue
            new_name = "".join("_" if ch in _UNCARRIABLE else ch for ch in name)
            os.rename(os.path.join(directory, name), os.path.join(directory, new_name))
            renamed.append(os.path.relpath(os.path.join(directory, name), root))
            relative = os.path.relpath(directory, site_path)
            package_root = site_path if relative.startswith("..") else os.path.join(site_path, relative.split(os.sep)[0])
            for source_dir, _subdirs, sources in os.walk(package_root):
                for source in sources:
                    if not source.endswith(".py"):
                        continue
                    path = os.path.join(source_dir, source)
                    with open(path, encoding="utf-8", errors="surrogateescape") as handle:
                        text = handle.read()
                    patched = text
                    for quote in ("'", '"'):
                        patched = patched.replace(f"{quote}{name}{quote}", f"{quote}{new_name}{quote}")
                    if patched != text:
                        with open(path, "w", encoding="utf-8", errors="surrogateescape") as handle:
                            handle.write(patched)
    return renamed


def _replace_symlinks(root: str) -> None:
    # Bazel follows symlinks in a glob; a dangling one fails the whole glob, and a link out of the
    # repository would leak a host path. Pip does not create links, but copies of host files can.
    for directory, _dirnames, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(directory, name)
            if os.path.islink(path):
                target = os.path.realpath(path)
                os.remove(path)
                if os.path.exists(target):
                    shutil.copy2(target, path)


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # The same environment gives the same bytes (and so the same digest, the same remote-cache keys)
    # whoever builds it and whenever: no times, owners or user names in the archive.
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if info.isdir():
        info.mode = 0o755
    elif info.isfile():
        info.mode = 0o755 if info.mode & 0o111 else 0o644
    return info


def write_archive(tree: str, archive: str) -> str:
    """Packs `tree` (deterministically) into the uncompressed tar `archive`; returns its sha256."""
    entries = []
    for directory, dirnames, filenames in os.walk(tree):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, tree)
            if relative == "layout.json":
                continue
            entries.append((relative, path))
    entries.sort()
    temporary = archive + ".part"
    with tarfile.open(temporary, "w", format=tarfile.GNU_FORMAT) as tar:
        for relative, path in entries:
            info = _normalized(tar.gettarinfo(path, arcname=relative))
            if info.isfile():
                with open(path, "rb") as handle:
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
    digest = hashlib.sha256()
    with open(temporary, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    os.replace(temporary, archive)
    return digest.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lock", required=True)
    parser.add_argument("--dest", required=True)
    parser.add_argument("--archive", help="pack DEST into this tar file, then remove DEST")
    args = parser.parse_args()

    dest = os.path.abspath(args.dest)
    if os.path.exists(dest):
        shutil.rmtree(dest)
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    binary_name = f"python{version}"

    os.makedirs(os.path.join(dest, "bin"))
    shutil.copy2(os.path.realpath(getattr(sys, "_base_executable", sys.executable)), os.path.join(dest, "bin", binary_name))
    os.chmod(os.path.join(dest, "bin", binary_name), 0o755 | stat.S_IRUSR)
    shared_library = _copy_shared_library(os.path.join(dest, "lib"))
    _write_launcher(os.path.join(dest, "bin", "python3"), binary_name, shared_library is not None)

    stdlib = sysconfig.get_path("stdlib")
    _copy_stdlib(stdlib, os.path.join(dest, "lib", binary_name))
    platstdlib = sysconfig.get_path("platstdlib")
    dynload = os.path.join(platstdlib, "lib-dynload")
    if os.path.isdir(dynload) and not os.path.exists(os.path.join(dest, "lib", binary_name, "lib-dynload")):
        shutil.copytree(dynload, os.path.join(dest, "lib", binary_name, "lib-dynload"))
    include = sysconfig.get_path("include")
    if os.path.isdir(include):
        shutil.copytree(include, os.path.join(dest, "include", os.path.basename(include)))
    else:
        print(f"python_env_builder: warning: no C headers at {include}; C++ builds will fail", file=sys.stderr)

    site_dir = _site_dir_relative()
    site_path = os.path.join(dest, site_dir)
    os.makedirs(site_path, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--disable-pip-version-check",
         "--no-warn-script-location", "--target", site_path, "-r", args.lock],
        check=True,
    )
    # Console scripts pip wrote carry the host interpreter's path in their shebang: nothing runs them.
    shutil.rmtree(os.path.join(site_path, "bin"), ignore_errors=True)
    renamed = _rename_uncarriable(dest, site_path)
    _replace_symlinks(dest)

    # Compiled by the copied interpreter, so the .pyc files match the binary that reads them; some
    # files in packages are templates or data that do not compile, which compileall reports and skips.
    # The source path recorded in each .pyc is made independent of where this build ran (-s/-p), so
    # the archive's bytes (its digest, every remote-cache key) do not depend on the output base;
    # Python replaces that recorded path with the real one when it loads the module. -f: the modules
    # compileall itself imported may already have timestamp-checked bytecode holding the build path.
    subprocess.run(
        [os.path.join(dest, "bin", "python3"), "-m", "compileall", "-q", "-q", "-j", "0", "-f",
         "--invalidation-mode", "unchecked-hash", "-s", dest, "-p", "/shardwise-python-env",
         os.path.join(dest, "lib", binary_name), site_path],
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    probe = subprocess.run(
        [os.path.join(dest, "bin", "python3"), "-c", "import sys, torch, pytest; print(sys.prefix)"],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
    )
    if probe.returncode != 0 or os.path.realpath(probe.stdout.strip()) != os.path.realpath(dest):
        raise SystemExit(f"python_env_builder: the copied interpreter does not run from {dest}:\n{probe.stdout}{probe.stderr}")

    layout = {"interpreter": "bin/python3", "site_dir": site_dir, "version": version, "renamed": renamed}
    if args.archive:
        layout["archive_sha256"] = write_archive(dest, os.path.abspath(args.archive))
        layout["files"] = sum(len(files) for _dirs, _subdirs, files in os.walk(dest))
        shutil.rmtree(dest)
        with open(os.path.abspath(args.archive) + ".json", "w") as handle:
            json.dump(layout, handle)
        return 0
    with open(os.path.join(dest, "layout.json"), "w") as handle:
        json.dump(layout, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
