#!/usr/bin/env bash
# Pack this machine's fio and the libraries it links (glibc's own left out) into build/fio-bundle.tar.xz,
# for a benchmark host without a package mirror (benchmarks/replay_h200.sh unpacks and uses it).
# Needs fio here: apt-get install -y fio.
set -euo pipefail
cd "$(dirname "$0")/.."
FIO=$(command -v fio) || { echo "Error: fio is not installed here (apt-get install -y fio)." >&2; exit 1; }
D=$(mktemp -d); mkdir -p "$D/contract-fio/lib" build
cp "$FIO" "$D/contract-fio/"
ldd "$FIO" | awk '/=>/ {print $3}' | grep -v -E 'libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|ld-linux' \
  | xargs -I{} cp -L {} "$D/contract-fio/lib/"
tar cJf build/fio-bundle.tar.xz -C "$D" contract-fio
rm -rf "$D"
ls -la build/fio-bundle.tar.xz
