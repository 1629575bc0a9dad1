#!/usr/bin/env bash
# Proves that the policy crates' clippy.toml bites inside each crate itself
# (swactor-provisioning, the reconciler's core, and swactor-jobs, the jobs
# core): builds each with `--cfg swactor_policy_probe` (which compiles
# provisioning/src/policy_probe.rs into it) and checks that clippy rejects
# every marked line, while the normal build (checked by .ci/run) stays clean.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}/policy-probe"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
probe_crate() {
    local package=$1
    if RUSTFLAGS="--cfg swactor_policy_probe" cargo clippy -p "$package" --lib -- -D warnings >"$out" 2>&1; then
        cat "$out"
        echo "FAIL: clippy accepted $package with forbidden calls in it"
        exit 1
    fi
    local fail=0 probe=provisioning/src/policy_probe.rs line n name
    while IFS= read -r line; do
        n=${line%%:*}
        name=${line##*PROBE: }
        if grep -qE "^ *--> $probe:$n:[0-9]+|^ *$n \| .*PROBE: $name" "$out"; then
            echo "ok   $package: $name (line $n) rejected"
        else
            echo "FAIL $package: $name (line $n) was not rejected"
            fail=1
        fi
    done < <(grep -n "PROBE: " "$probe" | grep -v "^[0-9]*://!")
    if ! grep -q "disallowed" "$out"; then
        echo "FAIL: no disallowed-methods/types diagnostics at all for $package"
        fail=1
    fi
    if [ "$fail" -ne 0 ]; then
        cat "$out"
        exit 1
    fi
    echo "$package policy probe: PASS"
}
probe_crate swactor-provisioning
probe_crate swactor-jobs
