#!/usr/bin/env bash
# The torture run's long form (release build): worker, checker and GC runner processes under
# SIGKILLs, toxiproxy resets and stalls, and late-delivered commands, then a full verification.
#   tools/torture.sh                       # 10 minutes with the default fault rates
#   tools/torture.sh --seconds 120 --kill-every 1s --fault-every 700ms --late-rate 0.03
# Uses MONGODB_URI when set, else starts the local test server. Needs Go (toxiproxy is built from
# the Go module proxy on first use) and a C compiler for --skews.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --features rig-cli --bin mongotx-torture --bin mongotx-gc
if [[ $# -eq 0 ]]; then
  set -- --seconds 600
fi
exec target/release/mongotx-torture run "$@"
