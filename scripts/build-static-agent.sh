#!/usr/bin/env bash
# Builds the swactor binary statically linked, for remote machines: the SSH
# provider (and every provider that bootstraps over SSH) uploads it to each
# host and runs its `agent` subcommand there. A static binary runs whatever
# C library the host has.
#
# Usage: scripts/build-static-agent.sh [--debug] [--drop-build]
# Leaves the binary at target/release/swactor-agent (target/debug/... with
# --debug), next to the swactor binary the same profile builds: the daemon
# looks for it there first. `swactor up --agent-binary PATH` (or
# $SWACTOR_AGENT_BINARY) names another. "target" is cargo's target
# directory: $CARGO_TARGET_DIR when set (a relative one is taken from the
# directory the script is run in), else whatever cargo's configuration
# says, else target/ in the repository.
#
# The static build has its own tree under target/<host triple>/ (crt-static
# changes every crate's flags, so nothing is shared with the normal build).
# --drop-build removes that tree once the binary is copied out: CI does, to
# keep its disk use down; keep it locally for fast rebuilds.
set -euo pipefail
# Resolved before the cd below, so it means what it meant to the caller.
if [ -n "${CARGO_TARGET_DIR:-}" ]; then
    CARGO_TARGET_DIR=$(realpath -m -- "$CARGO_TARGET_DIR")
    export CARGO_TARGET_DIR
fi
cd "$(dirname "$0")/.."

profile=release
flags=(--release)
drop_build=0
for arg in "$@"; do
    case "$arg" in
        --debug) profile=debug; flags=() ;;
        --drop-build) drop_build=1 ;;
        *) echo "build-static-agent: unknown argument $arg (usage: [--debug] [--drop-build])" >&2; exit 2 ;;
    esac
done
host=$(rustc -vV | sed -n 's/^host: //p')
case "$host" in
    *-linux-gnu) ;;
    *) echo "build-static-agent: needs a *-linux-gnu host toolchain, not $host" >&2; exit 1 ;;
esac

# glibc links statically with crt-static; the result is a static-pie binary.
# Without debug info either way: the binary is uploaded to every host and
# copied into every image, and line tables would triple its size.
RUSTFLAGS="-C target-feature=+crt-static" \
CARGO_PROFILE_DEV_DEBUG=0 CARGO_PROFILE_DEV_STRIP=debuginfo \
CARGO_PROFILE_RELEASE_STRIP=debuginfo \
    cargo build "${flags[@]}" -p swactor --target "$host"

# Where cargo put it: the target directory as cargo itself resolves it.
target=$(cargo metadata --no-deps --format-version 1 \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
if [ -z "$target" ]; then
    echo "build-static-agent: cannot tell cargo's target directory from \`cargo metadata\`" >&2
    exit 1
fi
built="$target/$host/$profile/swactor"
out="$target/$profile/swactor-agent"
mkdir -p "$target/$profile"
cp "$built" "$out.tmp"
mv "$out.tmp" "$out"
# A dynamically linked ELF names its loader in a PT_INTERP header.
if command -v readelf >/dev/null; then
    if readelf -l "$out" | grep -q "program interpreter"; then
        echo "build-static-agent: $out is still dynamically linked" >&2
        exit 1
    fi
elif command -v file >/dev/null; then
    if file "$out" | grep -q "dynamically linked"; then
        echo "build-static-agent: $out is still dynamically linked" >&2
        exit 1
    fi
else
    echo "build-static-agent: warning: neither readelf nor file is installed; static linking not checked" >&2
fi
if [ "$drop_build" = 1 ]; then
    rm -rf "${target:?}/$host"
fi
echo "$out ($(du -h "$out" | cut -f1)), sha256 $(sha256sum "$out" | cut -d' ' -f1)"
