#!/bin/sh
# The interpreter of the hermetic Python toolchain (@shardwise_python_hermetic), written by
# tools/build_defs/python_env.bzl from tools/build_defs/python_env_launcher.sh.tpl.
#
# The locked environment (interpreter, standard library, every locked package) is ONE declared input:
# the uncompressed tar archive next to this script, sha256 @DIGEST@.
# On first use it is unpacked into a directory named by that digest; this script then runs that
# directory's interpreter, with the arguments it was given. So an action carries 2 files for its
# Python instead of ~30,000, and still runs on a machine that has none of the client's paths.
#
# Where it is unpacked (the trade-off):
#   1. a machine-local cache, $SHARDWISE_PYTHON_ENV_CACHE or /tmp/shardwise-python-env-<uid>, one
#      directory per digest: unpacked once per machine and lock file (about 4 s and 1.3 GB of disk
#      here), then shared read-only by every later action. It lies outside the action's sandbox, but
#      it is content-addressed (a different archive is a different directory), written atomically
#      (unpacked aside, renamed into place, under a lock so that concurrent first actions wait for
#      one unpack instead of each doing it) and made read-only, so an action can neither see another
#      environment nor change this one. Old digests are not removed: delete the folder to reclaim.
#   2. the action's own scratch area ($TEST_TMPDIR, else the working directory) when the cache cannot
#      be used (not creatable or writable, not owned by this user, writable by others) or when
#      SHARDWISE_PYTHON_ENV_CACHE=none: nothing outside the action is touched, and every action pays
#      the unpack (seconds of CPU and 1.3 GB of writes per action).
# Assumes only the OS: /bin/sh, GNU tar and coreutils (flock from util-linux when present).
set -eu

digest=@DIGEST@
case $0 in
  */*) archive="${0%/*}/@ARCHIVE@" ;;
  *) archive="./@ARCHIVE@" ;;
esac

fail() {
  echo "shardwise python launcher: $*" >&2
  exit 127
}

# Unpacks the archive into directory $1 (which must not exist yet), atomically.
unpack() {
  parent=$(dirname "$1")
  mkdir -p "$parent" || fail "cannot create $parent"
  partial=$(mktemp -d "$parent/.unpacking.XXXXXX") || fail "cannot create a directory in $parent"
  if ! tar -xf "$archive" -C "$partial" --no-same-owner; then
    rm -rf "$partial"
    fail "unpacking $archive into $partial failed"
  fi
  # Read-only: nothing that runs from it (bytecode writes, pip) may change what other actions run.
  chmod -R a-w "$partial"/*
  if ! mv -T "$partial" "$1" 2>/dev/null; then
    # Another process put it there first (only possible without flock): keep theirs.
    chmod -R u+w "$partial"
    rm -rf "$partial"
  fi
  [ -x "$1/bin/python3" ] || fail "$1 holds no bin/python3"
}

cache_usable() {
  [ "$1" != none ] || return 1
  [ ! -L "$1" ] || return 1
  mkdir -p "$1" 2>/dev/null || return 1
  [ -O "$1" ] && [ -w "$1" ] || return 1
  # Group- or world-writable: someone else could have planted an environment under our digest.
  case $(ls -ld "$1") in
    ?????w* | ????????w*) return 1 ;;
  esac
  return 0
}

cache_root=${SHARDWISE_PYTHON_ENV_CACHE:-/tmp/shardwise-python-env-$(id -u)}
# The common case, without forking: unpacked before, by this user (an environment someone else put
# under our digest is never used).
env_dir="$cache_root/$digest"
if [ "$cache_root" != none ] && [ ! -L "$cache_root" ] && [ -O "$cache_root" ] && [ -O "$env_dir" ] \
  && [ -x "$env_dir/bin/python3" ]; then
  exec "$env_dir/bin/python3" "$@"
fi

[ -f "$archive" ] || fail "the environment archive $archive is not among this action's inputs"
if cache_usable "$cache_root"; then
  env_dir="$cache_root/$digest"
  if [ ! -x "$env_dir/bin/python3" ]; then
    if command -v flock >/dev/null 2>&1; then
      exec 9>"$cache_root/$digest.lock"
      flock 9
    fi
    [ -x "$env_dir/bin/python3" ] || unpack "$env_dir"
    # Not inherited by the interpreter: the lock is held only while unpacking.
    exec 9>&-
  fi
else
  env_dir="${TEST_TMPDIR:-$PWD}/.shardwise-python-env/$digest"
  [ -x "$env_dir/bin/python3" ] || unpack "$env_dir"
fi
exec "$env_dir/bin/python3" "$@"
