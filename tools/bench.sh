#!/usr/bin/env bash
# Runs the latency benchmark in release mode (against MONGODB_URI, or the local test server).
#   tools/bench.sh [--n 1000] [--warmup 200] [--only core|quota|obt|ratelimit|queue|network|scale|gc|adoption]
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo run --release --quiet --features rig-cli --bin mongotx-bench -- "$@"
