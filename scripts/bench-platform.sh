#!/usr/bin/env bash
# Benchmarks `phq-platform`, the node's poller (release build), against N real agents on
# loopback addresses, each `phq-agent serve` on the fake NVML answering for 8 healthy H100s
# (hgx-8gpu-healthy), polled over `transport = "http"` with the read token; first at rest, then
# for N = 8 and N = 64 (or the N given). A benchmark, not a test: it prints figures and asserts
# none. Measured:
#   - at rest, over one window side by side: the poller with no targets (a file_sd file `[]`)
#     and one agent that nobody polls: CPU % of one core and RSS of each;
#   - for each N, after the warm-up (every target's `phq_poll_success` 1 on the poller's
#     /metrics, then one more interval + jitter), over the window: the poller's CPU per poll,
#     i.e. per target per poll cycle (utime + stime from /proc/PID/stat, in 10 ms ticks; and
#     its threads' schedstat run time, in ns); its RSS (VmRSS at the window's end, VmHWM) in
#     all, per target, and per target above the poller at rest; its /metrics page (bytes,
#     series) and the mean of `phq_poll_duration_seconds` over the targets (each target's last
#     poll) from one scrape after the window; the failed polls in the window.
# The poller serves no count of its polls, so the polls in the window are derived: each target
# is polled, then sleeps interval + a uniform part of jitter, so one cycle is
# interval + jitter/2 + the mean poll duration, and polls = N × window / cycle.
# The goal it reports against (the platform's issue): at most 1 ms of CPU and 64 KiB of memory
# per VM per cycle.          scripts/bench-platform.sh [window-seconds] [N ...]   (60; 8 64)
# PHQ_BENCH_TRANSPORT=tls polls over `transport = "tls"` instead, the supported path on OpenShift:
# a TLS 1.3 handshake per poll with the platform's client certificate, which the agents check
# against a CA (`http.client_ca`); the certificates are made here with openssl, their keys
# PHQ_BENCH_KEY=ec (ECDSA P-256, the default) or rsa (RSA 2048, cert-manager's default key).
set -euo pipefail
cd "$(dirname "$0")/.."
window=${1:-60}
shift || true
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(8 64)
interval=5 jitter=1 # seconds, as in the poller's config below
agent_base=21100    # agent i listens on 127.0.1.(i+1):(21100+i), its own address as each VM has;
                    # the poller on 127.0.0.1:21090
poller_port=21090
rest_agent_port=21099

transport=${PHQ_BENCH_TRANSPORT:-http}
keyalg=${PHQ_BENCH_KEY:-ec}
case "$transport:$keyalg" in http:* | tls:ec | tls:rsa) ;; *) echo "PHQ_BENCH_TRANSPORT is http or tls, PHQ_BENCH_KEY ec or rsa" >&2; exit 2 ;; esac

cargo build --release --quiet -p phq-agent -p fake-nvml -p phq-platform

tmp=$(mktemp -d)
pids=()
stop_all() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
cleanup() { stop_all; rm -rf "$tmp"; }
trap cleanup EXIT
trap 'exit 130' INT TERM
token=bench-token-0123456789abcdef
printf '%s\n' "$token" > "$tmp/token"
chmod 600 "$tmp/token"
scheme=http agent_tls="" poller_tls=""
if [ "$transport" = tls ]; then
  # A CA, the agents' server certificate (the poller checks no agent's name) and the
  # platform's client certificate (CN phq-platform, the agent's default `http.client_names`,
  # with clientAuth).
  newkey=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1)
  [ "$keyalg" = rsa ] && newkey=(-newkey rsa:2048)
  pki=$tmp/pki
  mkdir -p "$pki"
  openssl req -x509 "${newkey[@]}" -nodes -keyout "$pki/ca.key" -out "$pki/ca.pem" -subj /CN=bench-ca -days 2 2>/dev/null
  issue() { # NAME SUBJECT EXTENSIONS
    openssl req "${newkey[@]}" -nodes -keyout "$pki/$1.key" -out "$pki/$1.csr" -subj "$2" 2>/dev/null
    printf '%b' "$3" > "$pki/$1.ext"
    openssl x509 -req -in "$pki/$1.csr" -CA "$pki/ca.pem" -CAkey "$pki/ca.key" -CAcreateserial \
      -out "$pki/$1.pem" -days 2 -extfile "$pki/$1.ext" 2>/dev/null
  }
  issue server /CN=phq-agent 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n'
  issue platform /CN=phq-platform 'extendedKeyUsage=clientAuth\n'
  chmod 600 "$pki"/*.key
  scheme=https
  agent_tls="tls_cert = \"$pki/server.pem\"
tls_key = \"$pki/server.key\"
client_ca = \"$pki/ca.pem\""
  poller_tls="[tls]
cert_file = \"$pki/platform.pem\"
key_file = \"$pki/platform.key\""
fi
hz=$(getconf CLK_TCK)

# The address of agent I of N: one loopback address each (Linux routes all of 127.0.0.0/8 to
# lo), as each VM has its own on the pod network — a TLS client keeps its sessions per address.
agent_addr() { echo "127.0.1.$(($1 + 1)):$((agent_base + $1))"; }
# start_agent NAME ADDRESS:PORT: one agent of its own (state_dir, address), the shared token.
start_agent() {
  mkdir -p "$tmp/$1/state"
  cat > "$tmp/$1/config.toml" <<CONF
[agent]
state_dir = "$tmp/$1/state"
[http]
listen = "$2"
token_file = "$tmp/token"
$agent_tls
[vsock]
enabled = false
[probes]
at_boot = "none"
CONF
  PHQ_FAKE_NVML_SCENARIO=examples/scenarios/hgx-8gpu-healthy.json \
    target/release/phq-agent serve -q --config "$tmp/$1/config.toml" \
    --sysroot tests/fixtures/sysroots/hgx-8gpu-healthy --nvml-lib target/release/libfake_nvml.so \
    2>>"$tmp/$1/stderr" &
  last_pid=$!
  pids+=("$last_pid")
}
wait_healthz() { # ADDRESS:PORT [SCHEME]
  for _ in $(seq 300); do curl -sfk -o /dev/null "${2:-$scheme}://$1/healthz" && return 0; sleep 0.2; done
  echo "nothing answers /healthz on :$1" >&2; return 1
}
# start_poller NAME TARGETS_FILE
start_poller() {
  mkdir -p "$tmp/$1"
  cat > "$tmp/$1/platform.toml" <<CONF
node = "bench-node"
listen = "127.0.0.1:$poller_port"
targets_file = "$2"
[poll]
interval = "${interval}s"
jitter = "${jitter}s"
timeout = "5s"
concurrency = 16
[token]
read_token_file = "$tmp/token"
$poller_tls
CONF
  target/release/phq-platform --config "$tmp/$1/platform.toml" 2>>"$tmp/$1/stderr" &
  last_pid=$!
  pids+=("$last_pid")
  wait_healthz "127.0.0.1:$poller_port" http # the poller serves its page in clear
}
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# The same CPU to the nanosecond: each live thread's sum_exec_runtime. A thread that ends inside
# the window takes its share with it, so the row prints the threads' ids at both ends.
cpu_ns() { cat /proc/"$1"/task/*/schedstat | awk '{s += $1} END {printf "%.0f\n", s}'; }
tids() { ls /proc/"$1"/task | sort -n | tr '\n' ' ' | sed 's/ $//'; }
status_kb() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status"; }
scrape() { curl -sf "http://127.0.0.1:$poller_port/metrics"; }
sum_of() { awk -v m="$1" 'index($0, m "{") == 1 {s += $NF; n++} END {printf "%s %d\n", s + 0, n}'; }
fmt() { awk -v x="$1" -v f="$2" 'BEGIN {printf f, x}'; }

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo); load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src crates || echo ' (with uncommitted changes under src/ or crates/)'); window ${window} s; poll interval ${interval}s + jitter ${jitter}s, timeout 5s, concurrency 16; transport $transport$([ "$transport" = tls ] && echo " ($keyalg keys)")"

# --- At rest: the poller with no targets, beside one agent nobody polls, over the same window.
echo '[]' > "$tmp/empty.json"
start_agent rest-agent "127.0.0.1:$rest_agent_port"; rest_agent=$last_pid
wait_healthz "127.0.0.1:$rest_agent_port"
start_poller rest-poller "$tmp/empty.json"; rest_poller=$last_pid
sleep 5 # both past their start: the agent's first snapshot, the poller's first read of the file
echo "== at rest, ${window} s side by side"
pt0=$(ticks "$rest_poller"); pr0=$(status_kb "$rest_poller" VmRSS)
at0=$(ticks "$rest_agent"); ar0=$(status_kb "$rest_agent" VmRSS)
sleep "$window"
pt1=$(ticks "$rest_poller"); pr1=$(status_kb "$rest_poller" VmRSS); ph=$(status_kb "$rest_poller" VmHWM)
at1=$(ticks "$rest_agent"); ar1=$(status_kb "$rest_agent" VmRSS); ah=$(status_kb "$rest_agent" VmHWM)
rest_rss=$pr1
awk -v w="$window" -v hz="$hz" \
  -v pt=$((pt1 - pt0)) -v pr0="$pr0" -v pr1="$pr1" -v ph="$ph" \
  -v at=$((at1 - at0)) -v ar0="$ar0" -v ar1="$ar1" -v ah="$ah" 'BEGIN {
  printf "poller, 0 targets: CPU %.3f %% of one core (%d ticks of %d ms), RSS %.1f -> %.1f MiB (HWM %.1f MiB)\n", pt / hz / w * 100, pt, 1000 / hz, pr0 / 1024, pr1 / 1024, ph / 1024
  printf "agent, not polled: CPU %.3f %% of one core (%d ticks of %d ms), RSS %.1f -> %.1f MiB (HWM %.1f MiB)\n", at / hz / w * 100, at, 1000 / hz, ar0 / 1024, ar1 / 1024, ah / 1024
}'
stop_all

# --- N agents, one poller.
rows=()
for n in "${sizes[@]}"; do
  echo "== N = $n: starting $n agents and the poller"
  targets="$tmp/targets-$n.json"
  {
    echo '['
    for i in $(seq 0 $((n - 1))); do
      start_agent "agent-$n-$i" "$(agent_addr "$i")"
      printf '  {"targets": ["%s"], "labels": {"namespace": "bench", "vmi": "vm-%d", "vmi_uid": "00000000-0000-4000-8000-%012d", "transport": "%s"}}%s\n' \
        "$(agent_addr "$i")" "$i" "$i" "$transport" "$([ "$i" -lt $((n - 1)) ] && echo ,)"
    done
    echo ']'
  } > "$targets"
  for i in $(seq 0 $((n - 1))); do wait_healthz "$(agent_addr "$i")"; done
  start_poller "poller-$n" "$targets"; poller=$last_pid
  ok=0
  for _ in $(seq 120); do
    ok=$(scrape | awk 'index($0, "phq_poll_success{") == 1 && $NF == 1 {k++} END {print k + 0}')
    [ "$ok" -eq "$n" ] && break
    sleep 1
  done
  [ "$ok" -eq "$n" ] || { echo "only $ok of $n targets polled successfully after 120 s; the poller said:" >&2; tail -5 "$tmp/poller-$n/stderr" >&2; exit 1; }
  sleep $((interval + jitter)) # one more cycle: every target at its second poll or past it
  f0=$(scrape | sum_of phq_poll_failures_total | cut -d' ' -f1)
  t0=$(ticks "$poller"); ns0=$(cpu_ns "$poller"); th0=$(tids "$poller")
  sleep "$window"
  t1=$(ticks "$poller"); ns1=$(cpu_ns "$poller"); th1=$(tids "$poller")
  rss=$(status_kb "$poller" VmRSS); hwm=$(status_kb "$poller" VmHWM)
  scrape > "$tmp/metrics-$n.txt"
  f1=$(sum_of phq_poll_failures_total < "$tmp/metrics-$n.txt" | cut -d' ' -f1)
  read -r dsum dn < <(sum_of phq_poll_duration_seconds < "$tmp/metrics-$n.txt")
  ok=$(awk 'index($0, "phq_poll_success{") == 1 && $NF == 1 {k++} END {print k + 0}' "$tmp/metrics-$n.txt")
  bytes=$(wc -c < "$tmp/metrics-$n.txt")
  series=$(grep -vc -e '^#' -e '^$' "$tmp/metrics-$n.txt")
  row=$(awk -v n="$n" -v w="$window" -v hz="$hz" -v iv="$interval" -v jt="$jitter" -v dt=$((t1 - t0)) \
    -v dsum="$dsum" -v dn="$dn" -v rss="$rss" -v hwm="$hwm" -v rest="$rest_rss" \
    -v bytes="$bytes" -v series="$series" -v fails=$((f1 - f0)) -v ok="$ok" -v ns=$((ns1 - ns0)) 'BEGIN {
    d = dsum / dn; cycle = iv + jt / 2 + d; polls = n * w / cycle; cpu = dt / hz
    printf "%5d | %8.3f | %8.3f | %5d | %6.0f | %7.1f | %7.1f | %9.1f | %12.1f | %10d | %6d | %7.2f | %8.2f | %d, %d/%d\n", \
      n, cpu / polls * 1000, ns / 1e6 / polls, dt, polls, rss / 1024, hwm / 1024, rss / n, (rss - rest) / n, bytes, series, d * 1000, cpu / w * 100, fails, ok, n
  }')
  echo "$row"
  [ "$th0" = "$th1" ] || echo "   the poller's threads changed in the window ($th0 -> $th1): the schedstat column misses the ended ones' CPU"
  rows+=("$row")
  stop_all
done

echo
echo "== the poller, ${window} s per row (CPU: utime + stime; polls = N × window / (interval + jitter/2 + mean duration))"
echo "    N | CPU/poll | CPU/poll | ticks | polls  | RSS MiB | HWM MiB | RSS/N KiB | (RSS-rest)/N | /metrics B | series | poll ms |    CPU % | failed,"
echo "      | ms, stat | ms,sched |       |        |         |         |           |          KiB |            |        |    mean | one core | success"
printf '%s\n' "${rows[@]}"
echo "goal per VM per cycle: CPU <= 1 ms, memory <= 64 KiB; poller at rest RSS $(fmt "$rest_rss" '%d') KiB"
