#!/usr/bin/env bash
# Probes a server for the guarantees mongotx needs.
#   tools/probe.sh --uri mongodb://host:27017/ [--tasks 64]
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo run --release --quiet --features cli --bin mongotx-probe -- "$@"
