#!/usr/bin/env bash
# Benchmarks `phq-agent serve` (release build, fake NVML answering for 8 H100s, dcgm_compat on)
# side by side with two peers on the same machine in the same run:
#   - prometheus-node-exporter, another exporter serving its own /metrics;
#   - nginx (2 workers, as the agent has 2 runtime threads) serving the agent's own /metrics
#     bytes, plain and pre-gzipped, from a file: the cost of HTTP alone for the same bytes;
# measuring
#   - /metrics (plain and gzip, as Prometheus asks), /v1/status and /healthz requests/s and
#     latency percentiles under wrk (10 s, 2 threads, 16 connections), with the ratios. Sixteen:
#     the agent admits at most `MAX_PER_PEER` (16) connections from one address and trades an
#     idle one for each more (serve/http.rs), so wrk's 32 from 127.0.0.1 measured reconnects
#     (strace: an accept4 and a close every 1.8 requests), not the serving; nginx gets the same;
#   - idle RSS and CPU of the agent and both peers over the same 60 s, and RSS after the load.
# Everything listens on 127.0.0.1 only.   scripts/bench-serve.sh [idle-seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
idle=${1:-60}
need=()
command -v wrk >/dev/null || need+=(wrk)
command -v prometheus-node-exporter >/dev/null || need+=(prometheus-node-exporter)
command -v dbus-daemon >/dev/null || need+=(dbus-daemon)
command -v nginx >/dev/null || need+=(nginx-light)
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
[metrics]
dcgm_compat = true
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

# nginx serves the very bytes the agent serves, plain and gzipped, from files.
mkdir -p "$tmp/www"
curl -sf -H 'Authorization: Bearer bench-token-0123456789abcdef' -o "$tmp/www/metrics" http://127.0.0.1:19441/metrics
gzip -k -6 "$tmp/www/metrics"
cat > "$tmp/nginx.conf" <<CONF
user root;
worker_processes 2;
pid $tmp/nginx.pid;
error_log $tmp/nginx.err;
events { worker_connections 1024; }
http {
  access_log off;
  server {
    listen 127.0.0.1:19442;
    root $tmp/www;
    gzip_static on;
    location = /metrics { default_type "text/plain; version=0.0.4"; }
  }
}
CONF
nginx -c "$tmp/nginx.conf" -g 'daemon off;' & nginx_pid=$!; pids+=($nginx_pid)
for _ in $(seq 100); do curl -sf -o /dev/null http://127.0.0.1:19442/metrics && break; sleep 0.1; done

rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
# nginx's memory is its master's and its workers' together.
rss_tree() { local t=$(rss "$1"); for c in $(pgrep -P "$1"); do t=$((t + $(rss "$c"))); done; echo "$t"; }
cpu_tree() { local t=$(cpu_ticks "$1"); for c in $(pgrep -P "$1"); do t=$((t + $(cpu_ticks "$c"))); done; echo "$t"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
echo "machine: $(nproc) cores; agent binary $(stat -c %s target/release/phq-agent) bytes"
echo "metrics body: agent $(wc -c < "$tmp/www/metrics") bytes ($(wc -c < "$tmp/www/metrics.gz") gzipped), node-exporter $(curl -s http://127.0.0.1:19100/metrics | wc -c) bytes"
echo "agent /v1/status body: $(curl -sf -H 'Authorization: Bearer bench-token-0123456789abcdef' http://127.0.0.1:19441/v1/status | wc -c) bytes; agent threads: $(ls "/proc/$agent/task" | wc -l)"

echo "== idle ${idle} s (all three at once)"
hz=$(getconf CLK_TCK)
declare -A t0 r0
for who in agent:$agent node-exporter:$nodex nginx:$nginx_pid; do
  n=${who%%:*}; p=${who#*:}; t0[$n]=$(cpu_tree "$p"); r0[$n]=$(rss_tree "$p")
done
sleep "$idle"
for who in agent:$agent node-exporter:$nodex nginx:$nginx_pid; do
  n=${who%%:*}; p=${who#*:}
  python3 -c "print(f'{\"$n\":<14} idle: RSS {${r0[$n]}/1024:.1f} -> {$(rss_tree "$p")/1024:.1f} MiB, CPU {($(cpu_tree "$p")-${t0[$n]})/$hz/$idle*100:.3f} % of one core')"
done

run() { wrk -t2 -c16 -d10s --latency "$@" 2>&1 | awk '/Requests\/sec/ {rps=$2} /^ +50%/ {p50=$2} /^ +99%/ {p99=$2} END {printf "%10.0f req/s  p50 %s  p99 %s\n", rps, p50, p99}'; }
auth=(-H 'Authorization: Bearer bench-token-0123456789abcdef')
gz=(-H 'Accept-Encoding: gzip')
echo "== wrk (10 s, 2 threads, 16 connections)"
printf '%-30s' "agent /metrics";             a=$(run "${auth[@]}" http://127.0.0.1:19441/metrics); echo "$a"
printf '%-30s' "nginx, same bytes";          x=$(run http://127.0.0.1:19442/metrics); echo "$x"
printf '%-30s' "agent /metrics gzip";        ag=$(run "${auth[@]}" "${gz[@]}" http://127.0.0.1:19441/metrics); echo "$ag"
printf '%-30s' "nginx, same bytes gzip";     xg=$(run "${gz[@]}" http://127.0.0.1:19442/metrics); echo "$xg"
printf '%-30s' "node-exporter /metrics";     n=$(run http://127.0.0.1:19100/metrics); echo "$n"
printf '%-30s' "agent /v1/status";           run "${auth[@]}" http://127.0.0.1:19441/v1/status
printf '%-30s' "agent /healthz";             run http://127.0.0.1:19441/healthz
python3 - "$a" "$x" "$ag" "$xg" "$n" <<'PY'
import sys
a, x, ag, xg, n = (float(v.split()[0]) for v in sys.argv[1:])
print(f"/metrics rate: agent/nginx {a/x:.2f}x plain, {ag/xg:.2f}x gzip; agent/node-exporter {a/n:.1f}x")
PY
echo "agent RSS after load: $(( $(rss $agent) / 1024 )) MiB"
