#!/usr/bin/env bash
# The previous version of mongotx, for the mixed-version torture test (tests/it/mixed_versions.rs):
# builds the pinned commit's `mongotx-torture` and `mongotx-gc` once, caches them under
# target/previous/<sha>/bin, and prints that directory on its last line of stdout (everything
# else goes to stderr). With the cache present it only checks two files and prints.
#
# Called by `.ci/run` before `cargo test` (so the build's time shows on its own) and by the test
# itself, possibly from two test processes at once: a lock makes the second wait for the first's
# build and then use it.
set -euo pipefail

# The last commit of main before stored documents carry a `_format` field (issue 49, "a stored
# format that outlives a release"): the release a service upgrades from, whose instances keep
# reading and writing the same documents while the new ones roll out. Move it forward only to
# the commit of a release that is really deployed; the test then proves the next one can run
# beside it.
PREVIOUS=d9a40fe1c07f1d2e0f74574b3b93fb7e3e46071f

root=$(cd "$(dirname "$0")/.." && pwd)
base=$root/target/previous/$PREVIOUS
bin=$base/bin

# The cache: the directory is renamed into place only once both binaries are in it, so its
# presence means a whole build (a build killed halfway leaves no `bin`).
cached() { [ -x "$bin/mongotx-torture" ] && [ -x "$bin/mongotx-gc" ]; }
if cached; then
    echo "$bin"
    exit 0
fi

mkdir -p "$base"
exec 9>"$base/.lock"
if ! flock -n 9; then
    echo "previous-version.sh: another build of the previous version is running; waiting for it" >&2
    flock 9
fi
if cached; then
    echo "$bin"
    exit 0
fi

if ! git -C "$root" cat-file -e "$PREVIOUS^{commit}" 2>/dev/null; then
    echo "previous-version.sh: commit $PREVIOUS (the previous version) is not in this clone (a shallow one?); fetch it with \`git fetch --unshallow\` or clone without --depth" >&2
    exit 1
fi

started=$SECONDS
src=$base/src
build=$base/target
rm -rf "$src" "$build" "$bin.tmp"
mkdir -p "$src"
# `tar -m` stamps every file with the time of extraction rather than the commit's: the sources
# are then newer than anything a seeded target dir holds (below), so cargo can never take an
# artifact of another tree of mongotx for this one's.
git -C "$root" archive "$PREVIOUS" | tar -x -m -C "$src"
# Its own workspace root: cargo looks for a workspace in the parent directories, and this copy
# lives inside the current checkout, whose manifest is not one today but could become one.
printf '\n[workspace]\n' >>"$src/Cargo.toml"

# A clean build of these two binaries compiles some 275 crates: 10 minutes on the 2-core
# development machine, which CI (a fresh clone, a 30-minute budget) cannot afford. Nearly all of
# them are the registry dependencies the current build has compiled already in target/debug,
# with the same versions (the same Cargo.lock), profile and features, so the separate target dir
# starts as a copy of their artifacts and cargo reuses each one whose fingerprint matches (a
# registry crate's fingerprint is its version, features, profile and compiler; mtimes are kept
# with `cp -p`, as cargo compares a unit's output with its dependencies'). Anything that differs
# is rebuilt, so the copy can only save time, never stand in for a changed crate. The mongotx
# package's own artifacts are left out: it is the one crate whose source differs, and it is
# always compiled from the pinned source. Copied, never linked: a build here must not write
# into target/debug, whose binaries the test suite runs (`CARGO_BIN_EXE_*`).
# (The current build's target dir: target/ unless CARGO_TARGET_DIR moves it.)
seed=${CARGO_TARGET_DIR:-$root/target}/debug
if [ -d "$seed/.fingerprint" ] && [ -d "$seed/deps" ]; then
    mkdir -p "$build/debug/deps" "$build/debug/build" "$build/debug/.fingerprint"
    for dir in .fingerprint build; do
        find "$seed/$dir" -mindepth 1 -maxdepth 1 ! -name 'mongotx-*' -print0 |
            xargs -0 -r cp -a -t "$build/debug/$dir"
    done
    # Libraries and their dep-info only: the test, example and binary executables beside them
    # are most of the directory's gigabytes and no build here needs them.
    find "$seed/deps" -maxdepth 1 -type f \( -name 'lib*.rlib' -o -name 'lib*.rmeta' \
        -o -name 'lib*.so' -o -name '*.d' \) ! -name 'libmongotx*' ! -name 'mongotx*' -print0 |
        xargs -0 -r cp -p -t "$build/debug/deps"
    echo "previous-version.sh: target dir seeded from target/debug in $((SECONDS - started)) s" >&2
fi

# What a `cargo test` running this script sets for its test process, which the build must not
# inherit: the variables cargo gives a crate (CARGO_MANIFEST_DIR and the like: a build script
# that watches one, as ring's does, would look changed and be run again, and everything above it
# compiled again; 3 minutes instead of 1 here) and its jobserver's.
clean=()
while IFS= read -r -d '' entry; do
    name=${entry%%=*}
    case $name in
        CARGO_PKG_* | CARGO_BIN_EXE_* | CARGO_MANIFEST_DIR | CARGO_MANIFEST_PATH | CARGO_CRATE_NAME | \
            CARGO_BIN_NAME | CARGO_PRIMARY_PACKAGE | CARGO_TARGET_TMPDIR | CARGO_RUSTC_CURRENT_DIR | \
            OUT_DIR | CARGO_MAKEFLAGS | MAKEFLAGS | MFLAGS | CARGO_BUILD_TARGET_DIR)
            clean+=(-u "$name")
            ;;
    esac
done < <(env -0)

# The binaries' own feature (Cargo.toml: both need `rig-cli`), the pinned Cargo.lock as it is
# (`--locked`: the registries are the only network it may use), and no incremental cache (a
# one-off build).
#
# And one small example, only for what it does to the dependencies' features: cargo unifies the
# dev-dependencies' features into the graph only when a target that uses them is built (tests,
# examples). Without one, chrono lacks the `clock` feature the tests' build gives it, and chrono,
# bson, the driver and a few more differ from the seed and are compiled again (10 crates, 5.8
# minutes here); with it the dependencies are the test build's to the feature.
(
    cd "$src"
    env "${clean[@]}" CARGO_TARGET_DIR="$build" CARGO_INCREMENTAL=0 \
        cargo build --locked --features rig-cli --bin mongotx-torture --bin mongotx-gc \
        --example probe >&2
)
mkdir -p "$bin.tmp"
cp "$build/debug/mongotx-torture" "$build/debug/mongotx-gc" "$bin.tmp/"
rm -rf "$bin" # a cache missing a binary (deleted by hand): replaced whole
mv "$bin.tmp" "$bin"
# Only the two binaries are kept: the build's dependencies take a gigabyte or more, and CI once
# ran out of disk.
rm -rf "$src" "$build"
echo "previous-version.sh: built $PREVIOUS in $((SECONDS - started)) s" >&2
echo "$bin"
