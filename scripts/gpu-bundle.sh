#!/usr/bin/env bash
# Builds the release test and benchmark executables (the PTX is embedded in
# them) and the `host` binary, and gathers them with scripts/gpu-run.sh into
# one folder (default .gpu/) that can be copied to a machine that has an
# NVIDIA GPU but no Rust toolchain, and run there with `bash .gpu/run.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu}
mkdir -p "$out/bin"
rm -f "$out"/bin/*
exes() { grep -o '"executable":"[^"]*"' | sed 's/"executable":"//; s/"$//'; }
{
  cargo test --release --no-run --message-format=json 2>/dev/null | exes
  cargo bench --no-run --message-format=json 2>/dev/null | exes
} | sort -u | while read -r exe; do
  name=$(basename "$exe" | sed 's/-[0-9a-f]\{16\}$//')
  cp "$exe" "$out/bin/$name"
done
cargo build --release -p host
cp target/release/host "$out/bin/host"
strip "$out"/bin/* 2>/dev/null || true
# The executables are mostly their two embedded PTX modules (text): gzip
# takes the folder from ~45 MB to ~12 MB; run.sh unpacks them first.
gzip -9 -f "$out"/bin/*
cp scripts/gpu-run.sh "$out/run.sh"
ls -la "$out/bin"
du -sh "$out"
