#!/usr/bin/env bash
# Swactor's 100k cold converge beside a peer, measured in the same run.
#
#   scripts/bench-peer.sh [--runs R] [--nodes N] [--at REV]
#
# Defaults: 5 runs of 100000. Ours is built from the working tree, or with
# `--at REV` from that commit alone (exported with `git archive` into
# target-bench-peer/, built there with a target directory of its own), so
# uncommitted work in the tree does not enter the figures.
#
# Ours is the scale benchmark (actors/benches/scale.rs, `--nodes N --json`):
# N nodes converged cold through the real actors over the zero-latency fake
# provider. The peer is benches/peer-kube: kube-runtime's applier reconciling
# N objects once each from an in-memory store with a no-op reconciler on a
# current-thread runtime. Both are built once in release mode and copied
# aside (so a rebuild by someone else mid-run cannot change them), then run
# alternately, ours then the peer's, R times, each run a fresh process, so
# both see the same load. Prints a table, the medians and a last JSON line.
# Opt-in: CI does not run it (the peer's first build fetches about 150
# crates from crates.io and takes a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."

runs=5
nodes=100000
at=""
usage="usage: scripts/bench-peer.sh [--runs R] [--nodes N] [--at REV]"
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) runs=${2:?"$usage"}; shift 2 ;;
        --nodes) nodes=${2:?"$usage"}; shift 2 ;;
        --at) at=${2:?"$usage"}; shift 2 ;;
        -h | --help) echo "$usage"; exit 0 ;;
        *) echo "$usage" >&2; exit 2 ;;
    esac
done
for v in "$runs" "$nodes"; do
    [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "$usage (positive numbers)" >&2; exit 2; }
done
command -v jq >/dev/null || { echo "bench-peer.sh needs jq" >&2; exit 1; }
export CARGO_TERM_COLOR=never

# The executable a `--message-format=json` build made for target $1.
executable() {
    jq -r --arg name "$1" \
        'select(.reason == "compiler-artifact" and .target.name == $name and .executable != null) | .executable' |
        tail -1
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ -z "$at" ]; then
    echo "== building Swactor's scale benchmark from the working tree (cargo bench --no-run)" >&2
    ours=$(cargo bench -p swactor-actors --bench scale --no-run --message-format=json | executable scale)
    commit=$(git rev-parse --short HEAD)
    if [ -n "$(git status --porcelain -- actors provisioning engine providers Cargo.lock)" ]; then
        commit="$commit+uncommitted changes"
    fi
else
    rev=$(git rev-parse --verify "$at^{commit}")
    git show "$rev:actors/benches/scale.rs" | grep -c -- '"--json"' >/dev/null ||
        { echo "bench-peer.sh: the scale benchmark at $at has no --json" >&2; exit 1; }
    tree=$PWD/target-bench-peer/tree
    echo "== building Swactor's scale benchmark at $at ($rev) in $tree" >&2
    rm -rf "$tree"
    mkdir -p "$tree"
    git archive "$rev" | tar -x -C "$tree"
    ours=$(cd "$tree" && CARGO_TARGET_DIR=$PWD/../target \
        cargo bench -p swactor-actors --bench scale --no-run --message-format=json | executable scale)
    commit=$(git rev-parse --short "$rev")
fi
echo "== building the peer (benches/peer-kube, release)" >&2
peer=$(cargo build --release --locked --manifest-path benches/peer-kube/Cargo.toml \
    --message-format=json | executable peer-kube)
[ -x "$ours" ] && [ -x "$peer" ] || { echo "bench-peer.sh: a build gave no executable" >&2; exit 1; }
cp "$ours" "$work/scale"
cp "$peer" "$work/peer-kube"

load() { cut -d' ' -f1-3 /proc/loadavg; }
load_before=$(load)
echo "== $runs alternating runs of $nodes nodes/objects; commit $commit; $(uptime)"

# The median of the numbers on standard input, printed with format $1.
median() {
    sort -g | awk -v f="$1\n" '{ v[NR] = $1 } END { printf f, (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

echo
echo "| run | load (1 min) | Swactor converge | Swactor CPU | Swactor RSS/node | peer reconcile | peer CPU | peer store fill | peer RSS/object | ratio (Swactor / peer) |"
echo "|---|---|---|---|---|---|---|---|---|---|"
ours_secs=() peer_secs=() ratios=() ours_rss=() peer_rss=() peer_version=""
for i in $(seq 1 "$runs"); do
    la=$(cut -d' ' -f1 /proc/loadavg)
    o=$("$work/scale" --nodes "$nodes" --json | grep '^{"bench":"swactor scale"' | tail -1)
    p=$("$work/peer-kube" --objects "$nodes" --runs 1 | grep '^{"peer":' | tail -1)
    os=$(jq -r .converge_secs <<<"$o")
    oc=$(jq -r .cpu_secs <<<"$o")
    orss=$(jq -r .rss_per_node_bytes <<<"$o")
    ps=$(jq -r '.secs[0]' <<<"$p")
    pc=$(jq -r '.cpu_secs[0]' <<<"$p")
    pf=$(jq -r '.fill_secs[0]' <<<"$p")
    prss=$(jq -r .rss_per_object_bytes <<<"$p")
    peer_version=$(jq -r .version <<<"$p")
    r=$(awk -v a="$os" -v b="$ps" 'BEGIN { printf "%.2f", a / b }')
    echo "| $i | $la | $os s | $oc s | $orss B | $ps s | $pc s | $pf s | $prss B | $r |"
    ours_secs+=("$os") peer_secs+=("$ps") ratios+=("$r") ours_rss+=("$orss") peer_rss+=("$prss")
done
load_after=$(load)

om=$(printf '%s\n' "${ours_secs[@]}" | median %.4f)
pm=$(printf '%s\n' "${peer_secs[@]}" | median %.4f)
orm=$(printf '%s\n' "${ours_rss[@]}" | median %.0f)
prm=$(printf '%s\n' "${peer_rss[@]}" | median %.0f)
rm_=$(awk -v a="$om" -v b="$pm" 'BEGIN { printf "%.2f", a / b }')
pair_min=$(printf '%s\n' "${ratios[@]}" | sort -g | head -1)
pair_max=$(printf '%s\n' "${ratios[@]}" | sort -g | tail -1)
echo
echo "medians: Swactor converge $om s (RSS $orm B/node), peer (kube-runtime $peer_version applier) $pm s (RSS $prm B/object)"
echo "ratio of the medians (Swactor / peer): $rm_ (per pair $pair_min to $pair_max)"
echo "load average: $load_before before, $load_after after"
join() { local IFS=,; echo "$*"; }
echo "{\"nodes\":$nodes,\"runs\":$runs,\"commit\":\"$commit\",\"swactor_secs\":[$(join "${ours_secs[@]}")],\"peer_secs\":[$(join "${peer_secs[@]}")],\"swactor_median_secs\":$om,\"peer_median_secs\":$pm,\"ratio\":$rm_,\"swactor_rss_per_node_bytes\":$orm,\"peer_rss_per_object_bytes\":$prm,\"peer\":\"kube-runtime applier\",\"peer_version\":\"$peer_version\",\"load_before\":\"$load_before\",\"load_after\":\"$load_after\"}"
