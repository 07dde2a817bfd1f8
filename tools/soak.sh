#!/usr/bin/env bash
# The soak run (release build): every system of mongotx at once for a long time, sampled every
# 10 s (memory, p50/p99 per operation, system collection sizes), failing on a trend; see
# docs/testing.md#the-soak-run.
#   tools/soak.sh                                   # 30 minutes, samples in target/soak/<time>/
#   tools/soak.sh --minutes 60 --out target/soak/60min
#   tools/soak.sh charts target/soak/60min/samples.jsonl   # its charts into tools/bench-results/
# Uses MONGODB_URI when set, else starts the local test server.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --features rig-cli \
  --bin mongotx-torture --bin mongotx-gc --bin mongotx-adopt
if [[ "${1:-}" == charts ]]; then
  exec target/release/mongotx-torture soak-charts --samples "${2:?samples.jsonl of a soak run}" \
    --out-dir tools/bench-results
fi
exec target/release/mongotx-torture soak "$@"
