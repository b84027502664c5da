#!/usr/bin/env bash
# Times `phq-agent doctor` over the 8-GPU HGX fixture (release build) with hyperfine: from files
# only, and with the fake NVML answering for 8 GPUs (scenario hgx-8gpu-healthy) and a private
# dbus-daemon answering for systemd. Reports median and p95 wall time and the peak RSS.
# There is no peer for doctor as a whole; on a GPU machine, scripts/gpu-validate.sh puts
# nvidia-smi beside it.
#   scripts/bench-doctor.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v hyperfine >/dev/null || { apt-get update -qq && apt-get install -y -qq hyperfine; }
[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
cargo build --release --quiet -p phq-agent -p fake-nvml
bin=target/release/phq-agent
lib=target/release/libfake_nvml.so
root=tests/fixtures/sysroots/hgx-8gpu-healthy
cfg=tests/fixtures/config/empty/config.toml
export PHQ_FAKE_NVML_SCENARIO=examples/scenarios/hgx-8gpu-healthy.json

# A private bus with no systemd on it: the unit lookups fail fast, as on a bus without systemd.
tmp=$(mktemp -d)
trap 'kill "$bus_pid" 2>/dev/null; rm -rf "$tmp"' EXIT
cat > "$tmp/bus.conf" <<CONF
<busconfig><type>custom</type><listen>unix:path=$tmp/bus</listen><auth>EXTERNAL</auth>
<policy context="default"><allow send_destination="*"/><allow receive_sender="*"/><allow own="*"/></policy></busconfig>
CONF
dbus-daemon --config-file="$tmp/bus.conf" --nofork --print-address=1 > "$tmp/addr" &
bus_pid=$!
for _ in $(seq 50); do [ -s "$tmp/addr" ] && break; sleep 0.05; done
export DBUS_SYSTEM_BUS_ADDRESS=$(head -1 "$tmp/addr")

echo "binary: $(stat -c %s $bin) bytes; machine: $(nproc) cores, $(uname -r)"
hyperfine -N -i --warmup 20 --runs 200 --export-json "$tmp/bench.json" \
  -n files+dbus "$bin doctor --json --sysroot $root --config $cfg" \
  -n files+dbus+nvml "$bin doctor --json --sysroot $root --config $cfg --nvml-lib $lib" >/dev/null 2>&1
python3 - "$tmp/bench.json" <<'PY'
import json, statistics, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    t = sorted(r["times"])
    print(f"{r['command']:<18} median {statistics.median(t)*1e3:6.2f} ms   p95 {t[int(len(t)*.95)]*1e3:6.2f} ms   n={len(t)}")
PY
for mode in "" "--nvml-lib $lib"; do
  /usr/bin/time -f "peak RSS ${mode:+(nvml) }%M KiB" "$bin" doctor --json --sysroot "$root" --config "$cfg" $mode >/dev/null || true
done
