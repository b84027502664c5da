#!/usr/bin/env bash
# Builds the .deb (cargo-deb) and the .rpm (cargo-generate-rpm) into target/packages/, with:
#   - the binary built by `cargo auditable`, so it carries its own dependency list (a scanner
#     such as `cargo audit bin`, Trivy or Syft reads it from the shipped binary);
#   - a CycloneDX SBOM (cargo-cyclonedx) of the same dependency tree beside the packages;
#   - SHA256SUMS of the packages and the SBOM (what PHQ_PACKAGE_SHA256 is taken from);
#   - every time stamp in both packages set to the commit's time (SOURCE_DATE_EPOCH), so two
#     builds of the same commit give the same bytes (scripts/check-reproducible shows it);
#   - with PHQ_SIGNING_KEY (a key id or fingerprint in the caller's GnuPG keyring), signed apt
#     and dnf repositories under target/packages/repos/ (scripts/publish-repos).
# Installs the cargo tools first when they are missing (scripts/cargo-install-tool).
#   scripts/build-packages.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/cargo-install-tool cargo-deb 3.8.0
scripts/cargo-install-tool cargo-generate-rpm 0.21.1
scripts/cargo-install-tool cargo-auditable 0.7.7
scripts/cargo-install-tool cargo-cyclonedx 0.5.9
start=$(date +%s)
# The commit's time, for every time stamp the packaging tools write (they read this variable).
if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
  SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null) ||
    { echo "build-packages: not a git checkout; set SOURCE_DATE_EPOCH" >&2; exit 1; }
fi
export SOURCE_DATE_EPOCH
cargo auditable build --locked --release -p phq-agent
# Packages already built from the same inputs are kept, not made again: scripts/test builds them
# after .ci/run has, and the packaging alone (manual pages, compression, the SBOM's cargo
# metadata) is about 20 s of CI's critical path. The inputs: the binary just built (so every
# change to the code), the files the packages carry or are described by, this script (the
# tools' versions), and the time stamp; and the packages must still be the bytes SHA256SUMS
# lists. A signed build (PHQ_SIGNING_KEY) always runs whole.
out=target/packages
inputs=$({
  sha256sum target/release/phq-agent Cargo.toml Cargo.lock crates/*/Cargo.toml README.md scripts/build-packages.sh
  find packaging -type f -print0 | sort -z | xargs -0 sha256sum
  echo "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH"
} | sha256sum | cut -d ' ' -f 1)
if [ -z "${PHQ_SIGNING_KEY:-}" ] && [ "$(cat "$out/.inputs" 2>/dev/null)" = "$inputs" ] &&
  (cd "$out" && sha256sum --quiet --strict -c SHA256SUMS 2>/dev/null); then
  ls -l "$out"
  echo "kept: $out was built from these same inputs ($out/.inputs), and its files are what SHA256SUMS says"
  exit 0
fi
# Manual pages and shell completions come from the binary's own command line, so they cannot
# drift from it. gzip -n: no name or time stamp inside, as Debian's policy asks.
assets=target/assets
rm -rf "$assets" && mkdir -p "$assets/man" "$assets/completions"
target/release/phq-agent manpages "$assets/man"
gzip -9n "$assets"/man/*.1
target/release/phq-agent completions bash >"$assets/completions/phq-agent.bash"
target/release/phq-agent completions zsh >"$assets/completions/_phq-agent"
target/release/phq-agent completions fish >"$assets/completions/phq-agent.fish"
# The rpm's files from the source tree, staged so that every one carries the commit's time.
for f in packaging/config.toml packaging/systemd/phq-agent.service packaging/systemd/install/phq-agent-install.service packaging/systemd/phq-agent.socket \
  packaging/systemd/vsock/phq-agent-vsock.socket packaging/systemd/bug-report/phq-agent-bug-report.path packaging/systemd/bug-report/phq-agent-bug-report.service \
  packaging/systemd/phq-agent.sysusers packaging/systemd/phq-agent.tmpfiles packaging/dbus/ch.phoeniqs.Agent1.conf \
  README.md; do
  install -D -m 0644 "$f" "$assets/files/$f"
done
find "$assets" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
rm -rf "$out" && mkdir -p "$out"
cargo deb --locked --no-build -p phq-agent --output "$out/"
cargo generate-rpm -p . --output "$out/"
# The SBOM: the binary's dependencies (normal ones, for this target; not build tools).
version=$(target/release/phq-agent --version | cut -d ' ' -f 2)
cargo cyclonedx --quiet --format json --spec-version 1.5 --target x86_64-unknown-linux-gnu --no-build-deps \
  --override-filename "phq-agent-$version.cdx"
mv "phq-agent-$version.cdx.json" "$out/"
# cargo-cyclonedx writes one beside every workspace member; only the agent's ships.
rm -f crates/*/"phq-agent-$version.cdx.json"
(cd "$out" && sha256sum -- *.deb *.rpm *.cdx.json >SHA256SUMS)
echo "$inputs" >"$out/.inputs"
if [ -n "${PHQ_SIGNING_KEY:-}" ]; then
  scripts/publish-repos "$out" "$out/repos"
fi
ls -l "$out"
echo "built in $(( $(date +%s) - start )) s (SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH)"
