#!/usr/bin/env bash
# Runs the torture tests (tests/it/torture.rs: kills, resets and late deliveries; processes a
# minute ahead or behind; shards whose clocks disagree) N times in a row, stopping at the first
# failure, and prints each run's verdict and the tally. A test that fails by chance shows here.
#   tools/torture-loop.sh 20
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-20}"
cargo test --quiet --test it --no-run
log="$(mktemp)"
passed=0
for i in $(seq 1 "$runs"); do
  started=$(date +%s)
  if cargo test --quiet --test it torture:: -- --test-threads 3 >"$log" 2>&1; then
    passed=$((passed + 1))
    echo "run $i: passed ($(($(date +%s) - started)) s): $(grep -o 'test result: [^;]*; [0-9]* failed' "$log")"
  else
    echo "run $i: FAILED ($(($(date +%s) - started)) s); its output:"
    cat "$log"
    echo "torture loop: $passed of $i runs passed"
    rm -f "$log"
    exit 1
  fi
done
rm -f "$log"
echo "torture loop: $passed of $runs runs passed in a row"
