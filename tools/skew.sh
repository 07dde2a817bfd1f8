#!/usr/bin/env bash
# Builds the clock-skew shim (tools/skew/skew.c) and prints the path of the shared library.
#   tools/skew.sh [output-dir]     # default: target/mongotx-skew
# Use: LD_PRELOAD=<printed path> MONGOTX_SKEW_MS=60000 some-command
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/target/mongotx-skew}"
mkdir -p "$out"
lib="$out/libmongotx_skew.so"
if [[ ! -f "$lib" || "$root/tools/skew/skew.c" -nt "$lib" ]]; then
  "${CC:-cc}" -shared -fPIC -O2 -o "$lib.tmp" "$root/tools/skew/skew.c" -ldl
  mv "$lib.tmp" "$lib"
fi
echo "$lib"
