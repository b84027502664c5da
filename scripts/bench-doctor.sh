#!/usr/bin/env bash
# Times `phq-agent doctor` over the 8-GPU HGX fixture (release build): wall time with hyperfine
# (warm-up, then many runs; the median is the figure to quote) and peak RSS with GNU time.
# There is no peer for doctor as a whole; nvidia-smi on a real GPU is the comparison the
# hardware validation script makes.
#   scripts/bench-doctor.sh [fixture]
set -euo pipefail
cd "$(dirname "$0")/.."
fixture=${1:-hgx-8gpu-healthy}
root=tests/fixtures/sysroots/$fixture
command -v hyperfine >/dev/null || { apt-get update -qq && apt-get install -y -qq hyperfine; }
[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
cargo build --release --quiet
bin=target/release/phq-agent
cfg=tests/fixtures/config/empty/config.toml
echo "fixture: $fixture   binary: $(stat -c %s $bin) bytes"
hyperfine -N -i --warmup 20 --runs 200 --export-json /tmp/bench-doctor.json \
  "$bin doctor --json --sysroot $root --config $cfg" \
  "$bin doctor --sysroot $root --config $cfg" | grep -v "^ *$"
python3 - <<'PY'
import json, statistics
d = json.load(open("/tmp/bench-doctor.json"))
for r in d["results"]:
    t = sorted(r["times"])
    print(f"{r['command'].split()[1:3]}: median {statistics.median(t)*1e3:.2f} ms, p95 {t[int(len(t)*.95)]*1e3:.2f} ms, n={len(t)}")
PY
/usr/bin/time -f "peak RSS: %M KiB" "$bin" doctor --json --sysroot "$root" --config "$cfg" >/dev/null || true
