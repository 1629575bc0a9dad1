#!/usr/bin/env bash
# Proves that swactor-provisioning's clippy.toml bites inside the crate itself:
# builds it with `--cfg swactor_policy_probe` (which compiles
# provisioning/src/policy_probe.rs) and checks that clippy rejects every
# marked line, while the normal build (checked by .ci/run) stays clean.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}/policy-probe"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
if RUSTFLAGS="--cfg swactor_policy_probe" cargo clippy -p swactor-provisioning --lib -- -D warnings >"$out" 2>&1; then
    cat "$out"
    echo "FAIL: clippy accepted provisioning with forbidden calls in it"
    exit 1
fi
fail=0
probe=provisioning/src/policy_probe.rs
while IFS= read -r line; do
    n=${line%%:*}
    name=${line##*PROBE: }
    if grep -qE "^ *--> $probe:$n:[0-9]+|^ *$n \| .*PROBE: $name" "$out"; then
        echo "ok   $name (line $n) rejected"
    else
        echo "FAIL $name (line $n) was not rejected"
        fail=1
    fi
done < <(grep -n "PROBE: " "$probe" | grep -v "^[0-9]*://!")
if ! grep -q "disallowed" "$out"; then
    echo "FAIL: no disallowed-methods/types diagnostics at all"
    fail=1
fi
if [ "$fail" -ne 0 ]; then
    cat "$out"
    exit 1
fi
echo "provisioning policy probe: PASS"
