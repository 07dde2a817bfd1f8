#!/usr/bin/env bash
# Builds FerretDB 1.24 (a MongoDB-wire-compatible server nobody here wrote) from the Go module
# proxy into tools/.bin, once, and prints its path:
#   tools/ferretdb.sh
# `go install` cannot build it: the module's build/version/version.txt is empty in the proxy's
# copy and FerretDB panics on an empty version, so the source is copied and the file filled in.
# Run it on SQLite in a directory of its own (what .ci/run and tests/it/ferretdb.rs do):
#   dir=$(mktemp -d); "$(tools/ferretdb.sh)" --handler=sqlite --sqlite-url="file:$dir/" \
#       --state-dir="$dir" --listen-addr=127.0.0.1:27018 --telemetry=disable --debug-addr=-
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version="v1.24.2"
bin="$root/tools/.bin"
server="$bin/ferretdb-$version"
if [[ ! -x "$server" ]]; then
  mkdir -p "$bin"
  tmp="$(mktemp -d)"
  trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
  # A module of its own, so that `go mod download` has somewhere to record what it fetched.
  (cd "$tmp" && go mod init mongotx-ferretdb-build >/dev/null 2>&1 &&
    GOFLAGS=-mod=mod go mod download "github.com/FerretDB/FerretDB@$version" >&2)
  src="$(cd "$tmp" && go mod download -json "github.com/FerretDB/FerretDB@$version" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  cp -r "$src" "$tmp/ferretdb"
  chmod -R u+w "$tmp/ferretdb"
  echo "$version" >"$tmp/ferretdb/build/version/version.txt"
  (cd "$tmp/ferretdb" && GOFLAGS="-buildvcs=false" go build -trimpath -o "$tmp/ferretdb-server" ./cmd/ferretdb >&2)
  mv "$tmp/ferretdb-server" "$server"
fi
echo "$server"
