#!/usr/bin/env bash
# Benchmarks `phq-agent serve` (release build, fake NVML answering for 8 H100s) side by side with
# prometheus-node-exporter on the same machine in the same run:
#   - /metrics and /v1/status requests/s and latency percentiles under wrk (10 s, 2 threads,
#     32 connections), and node-exporter's /metrics the same way; the ratio of the /metrics rates;
#   - idle RSS and CPU of the agent over 60 s, and RSS after the load.
# Everything listens on 127.0.0.1 only.   scripts/bench-serve.sh [idle-seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
idle=${1:-60}
need=()
command -v wrk >/dev/null || need+=(wrk)
command -v prometheus-node-exporter >/dev/null || need+=(prometheus-node-exporter)
command -v dbus-daemon >/dev/null || need+=(dbus-daemon)
[ ${#need[@]} -eq 0 ] || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; }
cargo build --release --quiet -p phq-agent -p fake-nvml

tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
printf 'bench-token-0123456789abcdef\n' > "$tmp/token"; chmod 600 "$tmp/token"
cat > "$tmp/config.toml" <<CONF
[agent]
state_dir = "$tmp/state"
[http]
listen = "127.0.0.1:19441"
token_file = "$tmp/token"
CONF
cat > "$tmp/bus.conf" <<CONF
<busconfig><type>custom</type><listen>unix:path=$tmp/bus</listen><auth>EXTERNAL</auth>
<policy context="default"><allow send_destination="*"/><allow receive_sender="*"/><allow own="*"/></policy></busconfig>
CONF
dbus-daemon --config-file="$tmp/bus.conf" --nofork --print-address=1 > "$tmp/addr" & pids+=($!)
for _ in $(seq 50); do [ -s "$tmp/addr" ] && break; sleep 0.05; done
DBUS_SYSTEM_BUS_ADDRESS=$(head -1 "$tmp/addr") PHQ_FAKE_NVML_SCENARIO=examples/scenarios/hgx-8gpu-healthy.json \
  target/release/phq-agent serve --config "$tmp/config.toml" --sysroot tests/fixtures/sysroots/hgx-8gpu-healthy \
  --nvml-lib target/release/libfake_nvml.so -q & agent=$!; pids+=($agent)
prometheus-node-exporter --web.listen-address=127.0.0.1:19100 >/dev/null 2>&1 & nodex=$!; pids+=($nodex)
for _ in $(seq 100); do curl -sf -o /dev/null http://127.0.0.1:19441/healthz && curl -sf -o /dev/null http://127.0.0.1:19100/metrics && break; sleep 0.1; done

rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
echo "machine: $(nproc) cores; agent binary $(stat -c %s target/release/phq-agent) bytes"
echo "metrics body: agent $(curl -s -H 'Authorization: Bearer bench-token-0123456789abcdef' http://127.0.0.1:19441/metrics | wc -c) bytes, node-exporter $(curl -s http://127.0.0.1:19100/metrics | wc -c) bytes"

echo "== idle ${idle} s"
t0=$(cpu_ticks $agent); r0=$(rss $agent); sleep "$idle"; t1=$(cpu_ticks $agent); r1=$(rss $agent)
hz=$(getconf CLK_TCK)
python3 -c "print(f'agent idle: RSS {int($r0)/1024:.1f} -> {int($r1)/1024:.1f} MiB, CPU {($t1-$t0)/$hz/$idle*100:.3f} % of one core')"

run() { wrk -t2 -c32 -d10s --latency "$@" 2>&1 | awk '/Requests\/sec/ {rps=$2} /^ +50%/ {p50=$2} /^ +99%/ {p99=$2} END {printf "%10.0f req/s  p50 %s  p99 %s\n", rps, p50, p99}'; }
auth=(-H 'Authorization: Bearer bench-token-0123456789abcdef')
echo "== wrk (10 s, 2 threads, 32 connections)"
printf '%-28s' "agent /metrics";        a=$(run "${auth[@]}" http://127.0.0.1:19441/metrics); echo "$a"
printf '%-28s' "agent /v1/status";      run "${auth[@]}" http://127.0.0.1:19441/v1/status
printf '%-28s' "agent /healthz";        run http://127.0.0.1:19441/healthz
printf '%-28s' "node-exporter /metrics"; n=$(run http://127.0.0.1:19100/metrics); echo "$n"
python3 -c "a=float('$a'.split()[0]); n=float('$n'.split()[0]); print(f'/metrics rate ratio agent/node-exporter: {a/n:.1f}x')"
echo "agent RSS after load: $(( $(rss $agent) / 1024 )) MiB"
