#!/usr/bin/env bash
# Builds the states docs/operations.md's runbooks walk and runs the admin command on them,
# printing each command line and what it printed: the outputs in docs/operations.md come from
# this script (as do CI's checks of a few lines of them).
#   tools/runbook.sh        # against the local test server (tools/test-server.sh), started here
# The states (examples/runbook_states.rs) go to database "bank", dropped first: dead
# coordinators, a dead GC runner's claim, a full quota provider and rate limiter, stuck batch
# queues, conflicts. Some are live for seconds only, so the sections run in the order the
# clocks need, not the order of the runbooks.
set -euo pipefail
cd "$(dirname "$0")/.."

tmp=$(mktemp -d)
server=""
gc=""
cleanup() {
    for pid in "$gc" "$server"; do
        if [[ -n "$pid" ]]; then
            kill "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
        fi
    done
    rm -rf "$tmp"
}
trap cleanup EXIT

# The test build's binaries and the state builder (one build, the features `cargo test` uses).
cargo build --quiet --example runbook_states --bin mongotx --bin mongotx-gc
export PATH="$PWD/target/debug:$PATH"

# The test server stops when its stdin reaches end-of-file: fd 3 keeps it open until we exit.
mkfifo "$tmp/stdin"
bash tools/test-server.sh <"$tmp/stdin" >"$tmp/server.out" 2>"$tmp/server.err" &
server=$!
exec 3>"$tmp/stdin"
port="" # the line may follow what Maven printed while building the server
for _ in $(seq 1 1200); do
    port=$(sed -n 's/.*MONGOTX_TEST_SERVER_PORT=\([0-9]*\).*/\1/p' "$tmp/server.out")
    if [[ -n "$port" ]]; then break; fi
    if ! kill -0 "$server" 2>/dev/null; then
        cat "$tmp/server.err" >&2
        echo "runbook: the test server stopped before listening" >&2
        exit 1
    fi
    sleep 0.5
done
if [[ -z "$port" ]]; then
    echo "runbook: the test server printed no port in 10 minutes" >&2
    exit 1
fi
export MONGODB_URI="mongodb://127.0.0.1:$port"
db=bank

# Prints a command line (as an operator types it: MONGODB_URI is set) and what it printed,
# stdout and stderr, with its exit status if not 0.
run() {
    echo "\$ $*"
    local status=0
    "$@" 2>&1 || status=$?
    if [[ "$status" -ne 0 ]]; then echo "(exit status $status)"; fi
    echo
}
section() { printf '#### %s\n\n' "$*"; }

section "state: examples/runbook_states.rs"
states=$(target/debug/examples/runbook_states "$db")
echo "$states"
echo
value() { sed -n "s/^$1=//p" <<<"$states"; }
committed=$(value committed)
staging=$(value staging)
claimed=$(value claimed)
live_until_ms=$(value live_until_ms)

# The limiter first: its live reservation is pending for 4 s only.
section "(c) a full rate limiter"
run mongotx --db "$db" limiter maps

section "(b) a full quota provider"
run mongotx --db "$db" quota project/42:cores

section "(a) a document stays held: before the deadline"
run mongotx --db "$db" why accounts carol
run mongotx --db "$db" txn "$staging"
run mongotx --db "$db" resolve "$staging"
run mongotx --db "$db" why accounts alice
run mongotx --db "$db" status
run mongotx --db "$db" why accounts erin
run mongotx-gc --db "$db" --once
run mongotx --db "$db" resolve "$claimed"

section "(b) a full quota provider: after the GC's sweep"
run mongotx --db "$db" quota project/42:cores

section "(d) a stuck batch queue"
run mongotx --db "$db" queue billing
run mongotx --db "$db" queue payments

section "(e) contention"
run mongotx --db "$db" contention

# The local test server's clock is this host's: wait for the live transactions' deadline.
left_ms=$((live_until_ms + 500 - $(date +%s%3N)))
if ((left_ms > 0)); then sleep "$(((left_ms + 999) / 1000))"; fi

section "(a) a document stays held: after the deadline"
run mongotx --db "$db" why accounts carol
run mongotx --db "$db" resolve "$staging"
run mongotx --db "$db" txn "$committed"
run mongotx-gc --db "$db" --once
run mongotx --db "$db" status

section "deploying: the GC runner's health check and metrics"
mongotx-gc --db "$db" --interval 1s --metrics-addr 127.0.0.1:0 >"$tmp/gc.out" 2>&1 &
gc=$!
addr=""
for _ in $(seq 1 100); do
    addr=$(sed -n 's|^metrics: http://\([^/]*\)/metrics.*|\1|p' "$tmp/gc.out")
    if [[ -n "$addr" ]] && grep -q '^round:' "$tmp/gc.out"; then break; fi
    sleep 0.1
done
run curl -s "http://$addr/health"
echo "\$ curl -s http://$addr/metrics | grep -E '^mongotx_gc_(rounds|resolved|left|last)'"
curl -s "http://$addr/metrics" | grep -E '^mongotx_gc_(rounds|resolved|left|last)'
echo
