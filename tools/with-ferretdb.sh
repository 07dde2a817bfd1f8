#!/usr/bin/env bash
# Runs a command beside a throwaway FerretDB 1.24 (built by tools/ferretdb.sh) on SQLite, or on
# PostgreSQL (Debian's postgresql package, installed when missing; a cluster of its own in a
# temporary directory), with the connection string in FERRETDB_URI. Stops everything after and
# exits with the command's status.
#   tools/with-ferretdb.sh sqlite -- sh -c 'target/debug/mongotx-probe --uri "$FERRETDB_URI"'
#   tools/with-ferretdb.sh postgresql -- sh -c 'MONGODB_URI=$FERRETDB_URI cargo test --test it conformance::'
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
backend="${1:?usage: tools/with-ferretdb.sh sqlite|postgresql -- COMMAND...}"
shift
[[ "${1:-}" == "--" ]] && shift
[[ $# -gt 0 ]] || { echo "with-ferretdb: no command given" >&2; exit 2; }

ferretdb="$(bash "$root/tools/ferretdb.sh")"
dir="$(mktemp -d)"
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# initdb refuses to run as root: as root, PostgreSQL runs as the package's postgres user.
as_postgres() {
  if [[ "$(id -u)" == 0 ]]; then su postgres -s /bin/sh -c "$1"; else sh -c "$1"; fi
}
ferret_pid=""
stop_pg=""
cleanup() {
  if [[ -n "$ferret_pid" ]]; then
    kill "$ferret_pid" 2>/dev/null || true
    wait "$ferret_pid" 2>/dev/null || true
  fi
  if [[ -n "$stop_pg" ]]; then as_postgres "$stop_pg" >/dev/null 2>&1 || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT

case "$backend" in
  sqlite)
    args=(--handler=sqlite "--sqlite-url=file:$dir/")
    ;;
  postgresql)
    pgbin="$(find /usr/lib/postgresql -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -n 1)"
    if [[ -z "$pgbin" ]]; then
      echo "with-ferretdb: installing Debian's postgresql package" >&2
      sudo=""
      [[ "$(id -u)" == 0 ]] || sudo="sudo"
      $sudo apt-get install -y -q postgresql >&2
      pgbin="$(find /usr/lib/postgresql -maxdepth 2 -name bin -type d | sort -V | tail -n 1)"
    fi
    pgport="$(free_port)"
    [[ "$(id -u)" == 0 ]] && chown postgres "$dir"
    as_postgres "$pgbin/initdb -D $dir/pg -A trust -U postgres" >/dev/null
    as_postgres "$pgbin/pg_ctl -D $dir/pg -o '-p $pgport -k $dir -c listen_addresses=127.0.0.1' -l $dir/pg.log -w start" >/dev/null
    stop_pg="$pgbin/pg_ctl -D $dir/pg -m immediate stop"
    as_postgres "$pgbin/createdb -h 127.0.0.1 -p $pgport -U postgres ferretdb"
    args=(--handler=postgresql "--postgresql-url=postgres://postgres@127.0.0.1:$pgport/ferretdb")
    ;;
  *)
    echo "with-ferretdb: the backend is sqlite or postgresql, not $backend" >&2
    exit 2
    ;;
esac

port="$(free_port)"
"$ferretdb" "${args[@]}" "--state-dir=$dir" "--listen-addr=127.0.0.1:$port" \
  --telemetry=disable --debug-addr=- --log-level=error >"$dir/ferretdb.log" 2>&1 &
ferret_pid=$!
for _ in $(seq 1 150); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then break; fi
  sleep 0.2
done
export FERRETDB_URI="mongodb://127.0.0.1:$port/"
status=0
"$@" || status=$?
exit "$status"
