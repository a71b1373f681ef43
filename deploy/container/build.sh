#!/usr/bin/env bash
# Builds the `laneway` image from scratch: laneway-control, laneway-agent, laneway-sim-model
# and lanectl, and the shared libraries (glibc, libgcc, the loader) `ldd` says they load.
#
#   deploy/container/build.sh [release|debug] [TAG]      (default: release, laneway:dev)
#
# Build the binaries first: `cargo build --release --workspace --bins` (or without --release
# for `debug`). CARGO_TARGET_DIR is honoured.
set -euo pipefail
cd "$(dirname "$0")/../.."
profile="${1:-release}"
tag="${2:-laneway:dev}"
case "$profile" in
  release|debug) ;;
  *) echo "build.sh: profile is release or debug, not '$profile'" >&2; exit 2 ;;
esac
bins="${CARGO_TARGET_DIR:-target}/$profile"
ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
rootfs="$ctx/rootfs"
mkdir -p "$rootfs/bin" "$rootfs/data" "$rootfs/results" "$rootfs/tmp" "$rootfs/etc/laneway"
chmod 1777 "$rootfs/tmp"
for b in laneway-control laneway-agent laneway-sim-model lanectl; do
  if [ ! -x "$bins/$b" ]; then
    flag=""; [ "$profile" = release ] && flag=" --release"
    echo "build.sh: $bins/$b is missing; run: cargo build$flag --workspace --bins" >&2
    exit 1
  fi
  # Debug info stays in target/; the image gets the code.
  objcopy --strip-debug "$bins/$b" "$rootfs/bin/$b"
done
# Every shared library a binary loads, at the path it is loaded from, and the dynamic loader.
for b in "$rootfs"/bin/*; do
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'
done | sort -u | while read -r lib; do
  mkdir -p "$rootfs$(dirname "$lib")"
  cp -L "$lib" "$rootfs$lib"
done
cp deploy/container/Dockerfile "$ctx/"
if ! out="$(docker build -t "$tag" "$ctx" 2>&1)"; then
  echo "$out" >&2
  exit 1
fi
echo "built $tag ($(du -sh "$rootfs" | cut -f1) root filesystem from $bins)"
