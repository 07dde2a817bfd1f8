#!/usr/bin/env bash
# Installs toxiproxy's server from the Go module proxy into tools/.bin (once) and prints its path.
#   tools/toxiproxy.sh
# The torture run calls this itself; run it by hand to start toxiproxy for other experiments:
#   "$(tools/toxiproxy.sh)" -host 127.0.0.1 -port 8474
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version="v2.5.0"
bin="$root/tools/.bin"
server="$bin/toxiproxy-server-$version"
if [[ ! -x "$server" ]]; then
  mkdir -p "$bin"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  GOBIN="$tmp" GOFLAGS="-buildvcs=false" go install "github.com/Shopify/toxiproxy/v2/cmd/server@$version" >&2
  mv "$tmp/server" "$server"
fi
echo "$server"
