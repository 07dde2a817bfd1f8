#!/usr/bin/env bash
# Builds (if needed) and runs the local MongoDB-wire-compatible test server in the foreground.
#   tools/test-server.sh            # free loopback port, printed as MONGOTX_TEST_SERVER_PORT=<port>
#   tools/test-server.sh --port N   # a fixed port
#   tools/test-server.sh --no-bulk-write   # play a server before 8.0 (announces 4.4, no bulkWrite)
#   tools/test-server.sh --no-prefilter    # every document through the stock matcher (to compare)
# Stop it with Ctrl-C (or by closing its stdin). The Rust harness does the same on its own;
# this script is for pointing other tools (mongosh, mongotx-probe) at the server by hand.
set -euo pipefail
dir="$(cd "$(dirname "$0")/test-server" && pwd)"
jar="$dir/target/mongotx-test-server.jar"
if [[ ! -f "$jar" || "$dir/pom.xml" -nt "$jar" || -n "$(find "$dir/src" -newer "$jar" -type f 2>/dev/null)" ]]; then
  (cd "$dir" && mvn -B -q -DskipTests package)
fi
exec java -XX:+UseSerialGC -jar "$jar" --host 127.0.0.1 "$@"
