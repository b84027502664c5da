#!/usr/bin/env bash
# Builds the .deb (cargo-deb) and the .rpm (cargo-generate-rpm) from a clean checkout, into
# target/packages/. Installs the two cargo tools first when they are missing.
#   scripts/build-packages.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo-deb >/dev/null || cargo install --locked --quiet cargo-deb@3.8.0
command -v cargo-generate-rpm >/dev/null || cargo install --locked --quiet cargo-generate-rpm@0.21.1
start=$(date +%s)
cargo build --locked --release -p phq-agent
out=target/packages
rm -rf "$out" && mkdir -p "$out"
cargo deb --locked --no-build -p phq-agent --output "$out/"
cargo generate-rpm -p . --output "$out/"
ls -l "$out"
echo "built in $(( $(date +%s) - start )) s"
