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
# Manual pages and shell completions come from the binary's own command line, so they cannot
# drift from it. gzip -n: no name or time stamp inside, as Debian's policy asks.
assets=target/assets
rm -rf "$assets" && mkdir -p "$assets/man" "$assets/completions"
target/release/phq-agent manpages "$assets/man"
gzip -9n "$assets"/man/*.1
target/release/phq-agent completions bash >"$assets/completions/phq-agent.bash"
target/release/phq-agent completions zsh >"$assets/completions/_phq-agent"
target/release/phq-agent completions fish >"$assets/completions/phq-agent.fish"
out=target/packages
rm -rf "$out" && mkdir -p "$out"
cargo deb --locked --no-build -p phq-agent --output "$out/"
cargo generate-rpm -p . --output "$out/"
ls -l "$out"
echo "built in $(( $(date +%s) - start )) s"
