#!/usr/bin/env bash
# Builds (if needed) and runs the local MongoDB-wire-compatible test server in the foreground.
#   tools/test-server.sh            # free loopback port, printed as MONGOTX_TEST_SERVER_PORT=<port>
#   tools/test-server.sh --port N   # a fixed port
#   tools/test-server.sh --no-bulk-write   # play a server before 8.0 (announces 4.4, no bulkWrite)
#   tools/test-server.sh --no-prefilter    # every document through the stock matcher (to compare)
#   tools/test-server.sh --user NAME:PASSWORD:ROLE@DB[+ROLE@DB...]   # repeatable: require authentication
#       e.g. --user app:secret:readWrite@shop --user admin:pw:root@admin; users live on admin
#       (mongodb://app:secret@127.0.0.1:<port>/shop?authSource=admin), SCRAM-SHA-256 only, and may run
#       what their built-in roles (read, readWrite, dbAdmin, userAdmin, dbOwner, root, ...AnyDatabase)
#       allow on each role's database, as on MongoDB; without --user nothing is checked
# Stop it with Ctrl-C (or by closing its stdin). The Rust harness does the same on its own;
# this script is for pointing other tools (mongosh, mongotx-probe) at the server by hand.
set -euo pipefail
dir="$(cd "$(dirname "$0")/test-server" && pwd)"
jar="$dir/target/mongotx-test-server.jar"
if [[ ! -f "$jar" || "$dir/pom.xml" -nt "$jar" || -n "$(find "$dir/src" -newer "$jar" -type f 2>/dev/null)" ]]; then
  (cd "$dir" && mvn -B -q -DskipTests package)
fi
exec java -XX:+UseSerialGC -jar "$jar" --host 127.0.0.1 "$@"
