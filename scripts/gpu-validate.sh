#!/usr/bin/env bash
# Hardware validation on a machine with a Hopper GPU, in one run that fits a short lease:
#
#  1. what the machine is (nvidia-smi, the driver's libraries, the kernel modules, /dev);
#  2. `doctor` (its wall time and peak RSS) and a support bundle of the machine (`--bundle`);
#  3. the quick level through cuBLAS, its PyTorch peer on the same GPUs with the same sizes
#     (pinned copies, device copy, an elementwise kernel beside the SM copy, FP32/BF16/FP16/FP64
#     matmuls; CUDA events), side by side as ratios and against each link's physical limit
#     (scripts/gpu-validate-table.py);
#  4. the quick level again without cuBLAS: the agent's own PTX GEMM and mma.sync kernels;
#  5. the standard level (nvbandwidth's 512 MiB copies, moving inversions), with its own peer;
#  6. a sustained all-GPU GEMM and the power test beside nvidia-smi's own power readings;
#  7. with two GPUs or more, NCCL's all-reduce beside nccl-tests' all_reduce_perf;
#  8. `serve` on 127.0.0.1 with a probe at boot: /healthz, /v1/status, /metrics from real NVML,
#     and an Xid written to /dev/kmsg (as root) that the kernel-log follower must hand over;
#  9. ptxas of the machine's own toolkit over the shipped PTX.
#
#   scripts/gpu-validate.sh [path/to/phq-agent [STEP...]]   (default: target/release/phq-agent, every step)
#
# STEP: doctor quick own-kernels standard sustained power allreduce serve nvml-events idle nvml-costs
# ptxas (the
# machine's description always comes first): a second run in the same lease repeats only some.
#
# cuBLAS: `libcublas.so.12` where the loader finds it, else the first libcublas.so.1[23] under
# /usr and /opt (a CUDA 13 image carries cuBLAS 13 in its Python packages; the agent binds only
# calls both keep). Each step says why it was skipped; none stops the others.
# Everything lands in a work folder; with $OUT (the device tool's output folder, which brings
# back 8 files at most) the folder is packed into $OUT/gpu-validation.tgz beside summary.txt and
# the bundle. Record the summary, date, GPU and driver in docs/hardware-validation.md.
# PHQ_VALIDATE_ARGS: extra arguments for every agent command (a --sysroot when rehearsing the
# script against the fakes), split on spaces.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=$(realpath "${1:-target/release/phq-agent}")
only=("${@:2}")
want() { [ ${#only[@]} -eq 0 ] || [[ " ${only[*]} " == *" $1 "* ]]; }
here=$PWD
w=${OUT:+/tmp/gpu-validation}
w=${w:-gpu-validation-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$w"
read -r -a extra <<< "${PHQ_VALIDATE_ARGS:-}"
agent() { "$bin" "$@" "${extra[@]}"; }
# PyTorch and the probes then number GPUs the same way (PCI order, as nvidia-smi).
export CUDA_DEVICE_ORDER=PCI_BUS_ID
# The summary goes straight to $OUT too: it comes back even if the lease's limit kills the run.
exec > >(tee "$w/summary.txt" ${OUT:+"$OUT/summary.txt"}) 2>&1
trap 'if [ -n "${OUT:-}" ]; then tar czf "$OUT/gpu-validation.tgz" -C "$w" .; fi' EXIT

step() { echo; echo "== $*  [$(date -u +%T)]"; }
# `timed LABEL CMD…`: CMD's exit code, and "LABEL wall N s, peak RSS M KiB" on stderr (GNU time
# where the image has it, else the wall time alone).
timed() {
    local label=$1; shift
    if [ -x /usr/bin/time ]; then
        /usr/bin/time -f "$label wall %e s, peak RSS %M KiB" "$@"
    else
        local t0 rc; t0=$(date +%s%N); "$@"; rc=$?
        echo "$label wall $(( ($(date +%s%N) - t0) / 1000000 )) ms (no GNU time here: no peak RSS)" >&2
        return $rc
    fi
}

step "machine  $(date -u +%FT%TZ)  $(uname -r)"
nvidia-smi --query-gpu=index,name,serial,pci.bus_id,driver_version,vbios_version,pcie.link.gen.current,pcie.link.width.current,memory.total,power.limit,clocks.max.sm --format=csv 2>&1 | tee "$w/nvidia-smi.csv"
nvidia-smi 2>&1 | head -20
nvidia-smi -q > "$w/nvidia-smi-q.txt" 2>&1
nvidia-smi topo -m > "$w/nvidia-smi-topo.txt" 2>&1
cat /proc/driver/nvidia/version 2>&1 | head -2
ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libnvidia-ml|libcublas|libnccl' | tee "$w/ldconfig.txt"
lsmod 2>/dev/null | grep -E '^nvidia' | tee "$w/lsmod.txt"
ls -l /dev/nvidia* /dev/vsock /dev/kmsg 2>&1 | tee "$w/dev.txt" | head -12
cat /etc/os-release > "$w/os-release" 2>&1; grep PRETTY "$w/os-release"
ls -d /usr/local/cuda*/version.json /usr/local/cuda*/lib64/libcudart.so.* /usr/local/cuda*/include/cuda.h 2>&1 | head -6
"$bin" --version

if [ -z "${PHQ_CUBLAS_LIB:-}" ] && ! ldconfig -p 2>/dev/null | grep -qE 'libcublas\.so\.1[23] '; then
    found=$(find /usr /opt -name 'libcublas.so.1[23]' 2>/dev/null | head -1)
    if [ -n "$found" ]; then
        export PHQ_CUBLAS_LIB=$found
        echo "cuBLAS: neither libcublas.so.12 nor .13 on the loader's path; using $found"
    else
        echo "cuBLAS: none found; the probes use the agent's own kernels"
    fi
fi

if want doctor; then
step "phq-agent doctor"
timed doctor timeout -k 5 90 "$bin" doctor --json "${extra[@]}" > "$w/doctor.json" 2> "$w/doctor.stderr"; echo "exit $?"
tail -1 "$w/doctor.stderr"
timeout -k 5 90 "$bin" doctor "${extra[@]}" > "$w/doctor.txt" 2>&1; echo "exit $?"; sed -n '1,60p' "$w/doctor.txt"
timeout -k 5 90 "$bin" doctor "${extra[@]}" --bundle "$w/bundle.tar.gz" > /dev/null 2> "$w/bundle.stderr"; echo "bundle: exit $?, $(stat -c %s "$w/bundle.tar.gz" 2>/dev/null) bytes"
[ -n "${OUT:-}" ] && cp "$w/bundle.tar.gz" "$OUT/" 2>/dev/null

step "phq-agent probe --dry-run (GPU time planned at each SKU's floors)"
agent probe --level quick --dry-run | tee "$w/plan.txt"
agent probe --level standard --dry-run > "$w/plan-standard.txt"; tail -3 "$w/plan-standard.txt"
fi

# One probe run: its JSON, stderr and wall time; the exit code said (124: killed at 240 s).
probe() {
    local name=$1; shift
    step "phq-agent probe $*${PHQ_CUBLAS_LIB:+  (cuBLAS: $PHQ_CUBLAS_LIB)}"
    timed probe timeout -k 5 240 "$bin" probe "$@" --json "${extra[@]}" > "$w/$name.json" 2> "$w/$name.stderr"; echo "exit $?"
    tail -3 "$w/$name.stderr"
}
peer() {
    step "PyTorch peer of $1"
    python3 "$here/scripts/gpu-validate-peer.py" "$w/$1.json" > "$w/peer-$1.json" 2> "$w/peer-$1.stderr" \
        || { echo "PyTorch peer failed (is torch with CUDA installed?)"; tail -3 "$w/peer-$1.stderr"; }
}
table() {
    step "side by side: $1 (GB/s; d2d counts bytes read + written)"
    python3 "$here/scripts/gpu-validate-table.py" "$w/$1.json" "$w/peer-$2.json" "$w/doctor.json" || echo "no table for $1"
}

if want quick; then
probe quick --level quick
peer quick
table quick quick
fi

if want own-kernels; then
saved=${PHQ_CUBLAS_LIB-}
export PHQ_CUBLAS_LIB=/nonexistent/libcublas.so.12
probe quick-own-kernels --level quick
table quick-own-kernels quick
if [ -n "$saved" ]; then export PHQ_CUBLAS_LIB=$saved; else unset PHQ_CUBLAS_LIB; fi
fi

if want standard; then
probe standard --level standard
peer standard
table standard standard
fi

if want sustained; then
probe sustained --level quick --gemm-seconds 20
python3 - "$w/sustained.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for f in r.get("findings", []):
    if f["id"] == "probe.gemm-sustained":
        c = (f.get("evidence") or {}).get("conditions") or {}
        print(f"{f['severity'].upper():<6}{f.get('gpu') or '':<14}{f['summary']}  [SM {c.get('sm_clock_mhz')} MHz, {c.get('power_mw')} mW, {c.get('throttle_reasons')}]")
PY
fi

if want power; then
nvidia-smi --query-gpu=index,power.draw,power.limit,clocks.sm,temperature.gpu --format=csv,noheader -lms 500 > "$w/power-nvidia-smi.csv" 2>&1 &
smi=$!
probe power --level quick --gemm-seconds 0 --power-seconds 20
kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
python3 - "$w/power.json" "$w/power-nvidia-smi.csv" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
peak = {}
for line in open(sys.argv[2]):
    parts = [p.strip() for p in line.split(",")]
    try:
        peak[int(parts[0])] = max(peak.get(int(parts[0]), 0.0), float(parts[1].split()[0]))
    except (ValueError, IndexError):
        pass
for f in r.get("findings", []):
    if f["id"] in ("probe.power", "probe.power-limit", "probe.gemm-fp64"):
        print(f"{f['severity'].upper():<8}{f['id']:<20}{f.get('gpu') or '':<14}{f['summary']}")
print("nvidia-smi's highest power.draw per GPU over the same run (W):", peak or "none read")
PY
fi

if want allreduce; then
step "all-reduce (NCCL) beside nccl-tests' all_reduce_perf, the same message and GPUs"
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if [ "$gpus" -lt 2 ]; then
    echo "$gpus GPU(s): no all-reduce to measure (probe.allreduce needs two or more)"
else
    probe allreduce --level quick --allreduce-size 1G
    python3 - "$w/allreduce.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for f in r.get("findings", []):
    if f["id"] == "probe.allreduce":
        print(f"{f['severity'].upper():<8}{f['summary']}")
        ok = ((f.get("evidence") or {}).get("allreduce") or {}).get("nccl", {}).get("ok") or {}
        print(f"        multicast reported by every GPU: {ok.get('multicast')}; {ok.get('library')}")
        for s in ok.get("settings", []):
            print(f"        NCCL setting: {s['name']}={s['value']} ({s['from']})")
PY
    if command -v all_reduce_perf > /dev/null; then
        # nccl-tests, one process driving every GPU (-g), as the probe does; its busbw column is
        # the peer of the probe's figure.
        all_reduce_perf -b 1G -e 1G -g "$gpus" -c 1 | tee "$w/all_reduce_perf.txt" | tail -6
    else
        echo "all_reduce_perf (nccl-tests) is not installed: no peer figure"
    fi
fi
fi

if want serve; then
step "phq-agent serve on 127.0.0.1:9440, a quick probe at boot"
s=$w/serve
mkdir -p "$s/state"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$s/token"
chmod 600 "$s/token"
cat > "$s/config.toml" <<EOF
[agent]
state_dir = "$s/state"
[http]
listen = "127.0.0.1:9440"
token_file = "$s/token"
[vsock]
enabled = false
[probes]
at_boot = "quick"
when_idle = "off"
EOF
timeout -k 5 180 "$bin" serve --config "$s/config.toml" -v "${extra[@]}" > "$s/serve.log" 2>&1 &
srv=$!
python3 - "$s/token" "$s" <<'PY'
import json, sys, time, urllib.request
token = open(sys.argv[1]).read().strip()
def get(path, auth=True):
    req = urllib.request.Request("http://127.0.0.1:9440" + path)
    if auth:
        req.add_header("Authorization", "Bearer " + token)
    t = time.monotonic()
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return body, time.monotonic() - t
start = time.monotonic()
status = None
while time.monotonic() - start < 90:
    try:
        body, _ = get("/v1/status")
        status = json.loads(body)
        if (status.get("probes") or {}).get("gpus"):
            break
    except Exception as e:
        status = {"error": str(e)}
    time.sleep(1)
print(f"/v1/status with probe results after {time.monotonic() - start:.1f} s" if status and (status.get("probes") or {}).get("gpus") else f"no probe results in /v1/status after 90 s: {str(status)[:300]}")
for path, auth in (("/healthz", False), ("/v1/status", True), ("/metrics", True)):
    try:
        body, secs = get(path, auth)
        open(f"{sys.argv[2]}/{path.strip('/').replace('/', '-')}.out", "wb").write(body)
        print(f"{path}: {len(body)} bytes in {secs * 1000:.1f} ms")
    except Exception as e:
        print(f"{path}: {e}")
PY
grep -E '^phq_gpu_(up|info|temperature|power|memory)' "$s/metrics.out" 2>/dev/null | head -8
bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader 2>/dev/null | head -1 | tr 'A-F' 'a-f' | sed 's/^0000//; s/\.[0-7]$//')
if [ -n "$bus" ] && [ -w /dev/kmsg ]; then
    # An Xid line as the driver prints it (kmsg.rs cites the format), written by a process: the
    # kernel gives it facility LOG_USER, and the follower must NOT take it for the driver's
    # (only the driver speaks for the GPU). Xid 13 would read as the application's fault.
    echo "NVRM: Xid (PCI:$bus): 13, pid=1, name=phq-validate, Graphics Exception: written by scripts/gpu-validate.sh" > /dev/kmsg
    dmesg 2>/dev/null | tail -1
    sleep 12
    python3 - "$s/token" <<'PY'
import json, sys, urllib.request
req = urllib.request.Request("http://127.0.0.1:9440/v1/status", headers={"Authorization": "Bearer " + open(sys.argv[1]).read().strip()})
r = json.load(urllib.request.urlopen(req, timeout=10))
xids = [f for f in r.get("findings", []) if "xid" in f["id"]]
print("after a process wrote an Xid line to /dev/kmsg:", [(f["id"], f["severity"], f["summary"]) for f in xids] or "no Xid finding (right: the line is not the kernel's)")
PY
else
    echo "no /dev/kmsg to write or no GPU address: the Xid step skipped"
fi
# At rest past a snapshot tick (30 s) and an Xid watcher's wait (15 s): CPU ticks and RSS of
# the service, then its health and NVML's responsiveness as the service judged them.
pid=$(pgrep -P "$srv" -x phq-agent | head -1)
if [ -n "$pid" ]; then
    ticks() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
    t0=$(ticks); sleep 40; t1=$(ticks)
    echo "at rest for 40 s: $((t1 - t0)) CPU ticks ($(getconf CLK_TCK)/s), $(grep VmRSS "/proc/$pid/status" | tr -s ' ')"
fi
python3 - "$s/token" <<'PY'
import json, sys, urllib.request
req = urllib.request.Request("http://127.0.0.1:9440/v1/status", headers={"Authorization": "Bearer " + open(sys.argv[1]).read().strip()})
r = json.load(urllib.request.urlopen(req, timeout=10))
print("health:", r.get("health"), "verdict:", (r.get("verdict") or {}).get("action"), (r.get("verdict") or {}).get("findings"))
for f in r.get("findings", []):
    if f["id"].startswith("nvml.") or f["severity"] in ("fail",):
        print(f"  {f['severity']:<8}{f['id']:<22}{f['summary']}")
PY
kill -TERM "$srv"; wait "$srv"; echo "serve exit $? (0: stopped by SIGTERM; 124: by its 180 s guard)"
grep -ciE 'error|warn' "$s/serve.log" | sed 's/^/serve log warnings and errors: /'
grep -iE 'error|warn' "$s/serve.log" | head -8
fi

if want nvml-events; then
step "NVML: does a wait on one event set hold another thread's nvmlEventSetCreate? (nvidia-ml-py)"
python3 - <<'PY' || echo "no nvidia-ml-py here"
import threading, time
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
def wait():
    s = n.nvmlEventSetCreate()
    n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, s)
    try:
        n.nvmlEventSetWait_v2(s, 5000)
    except n.NVMLError as e:
        print("  the waiting thread's wait ended:", e)
t = threading.Thread(target=wait); t.start(); time.sleep(0.5)
for name, call in (("nvmlDeviceGetTemperature", lambda: n.nvmlDeviceGetTemperature(h, 0)),
                   ("nvmlEventSetCreate", n.nvmlEventSetCreate),
                   ("nvmlDeviceGetTemperature", lambda: n.nvmlDeviceGetTemperature(h, 0))):
    t0 = time.monotonic(); call(); print(f"  {name} during the other thread's 5 s wait: {time.monotonic() - t0:.3f} s")
t.join()
t0 = time.monotonic(); n.nvmlEventSetCreate(); print(f"  nvmlEventSetCreate with no wait in progress: {time.monotonic() - t0:.3f} s")
# What a wait costs the process in CPU while nothing happens (the service's watcher waits 15 s at a time).
import resource
s = n.nvmlEventSetCreate()
n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, s)
c0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.monotonic()
try:
    n.nvmlEventSetWait_v2(s, 5000)
except n.NVMLError:
    pass
c1 = resource.getrusage(resource.RUSAGE_SELF)
print(f"  one {time.monotonic() - t0:.1f} s wait with nothing to report: {((c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)) * 1e3:.1f} ms of CPU")
PY
fi

if want idle; then
step "the service at rest, 60 s each: real NVML, the fake NVML (no driver calls), no NVML"
# Where an idle snapshot's CPU goes on a real machine: the same service and sysfs, with NVML's
# reading real, replaced by the fake library (target/release/libfake_nvml.so, carried with the
# binary when the run is asked for), or absent. Ticks of 1/CLK_TCK s over 60 s after 20 s settling.
fake=$here/target/release/libfake_nvml.so
for how in real fake none; do
    case $how in
        real) lib=() ;;
        fake) [ -f "$fake" ] || { echo "fake: $fake not carried: skipped"; continue; }
              lib=(--nvml-lib "$fake"); export PHQ_FAKE_NVML_SCENARIO=$here/examples/scenarios/h200-vm.json ;;
        none) lib=(--nvml-lib /nonexistent/libnvidia-ml.so.1) ;;
    esac
    d=$w/idle-$how; mkdir -p "$d/state"
    head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$d/token"; chmod 600 "$d/token"
    printf '[agent]\nstate_dir = "%s"\n[http]\nlisten = "127.0.0.1:9441"\ntoken_file = "%s"\n[vsock]\nenabled = false\n[probes]\nat_boot = "none"\nwhen_idle = "off"\n' "$d/state" "$d/token" > "$d/config.toml"
    timeout -k 5 120 "$bin" serve --config "$d/config.toml" -q "${lib[@]}" > "$d/serve.log" 2>&1 &
    srv=$!; sleep 20
    pid=$(pgrep -P "$srv" -x phq-agent | head -1)
    if [ -n "$pid" ]; then
        t0=$(awk '{print $14 + $15}' "/proc/$pid/stat"); sleep 60; t1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
        echo "$how NVML: $((t1 - t0)) ticks in 60 s, $(grep VmRSS "/proc/$pid/status" | tr -s ' '), $(grep -E '^(Anonymous)' "/proc/$pid/smaps_rollup" | tr -s ' ')"
    else
        echo "$how NVML: the service did not start: $(tail -2 "$d/serve.log")"
    fi
    kill -TERM "$srv" 2>/dev/null; wait "$srv" 2>/dev/null
    unset PHQ_FAKE_NVML_SCENARIO
done
fi

if want nvml-costs; then
step "NVML: what each call a snapshot makes costs on this driver (nvidia-ml-py; median of 5, GPU 0)"
python3 - <<'PY' || echo "no nvidia-ml-py here"
import time, statistics, resource
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
C = n.NVML_CLOCK_SM
calls = [
    ("DeviceGetCount", lambda: n.nvmlDeviceGetCount()),
    ("SystemGetDriverVersion", lambda: n.nvmlSystemGetDriverVersion()),
    ("DeviceGetName", lambda: n.nvmlDeviceGetName(h)),
    ("DeviceGetUUID", lambda: n.nvmlDeviceGetUUID(h)),
    ("DeviceGetSerial", lambda: n.nvmlDeviceGetSerial(h)),
    ("DeviceGetPciInfo", lambda: n.nvmlDeviceGetPciInfo(h)),
    ("DeviceGetTemperature", lambda: n.nvmlDeviceGetTemperature(h, 0)),
    ("DeviceGetPowerUsage", lambda: n.nvmlDeviceGetPowerUsage(h)),
    ("DeviceGetEnforcedPowerLimit", lambda: n.nvmlDeviceGetEnforcedPowerLimit(h)),
    ("DeviceGetMemoryInfo", lambda: n.nvmlDeviceGetMemoryInfo(h)),
    ("DeviceGetUtilizationRates", lambda: n.nvmlDeviceGetUtilizationRates(h)),
    ("DeviceGetClockInfo", lambda: n.nvmlDeviceGetClockInfo(h, C)),
    ("DeviceGetMaxClockInfo", lambda: n.nvmlDeviceGetMaxClockInfo(h, C)),
    ("DeviceGetCurrentClocksEventReasons", lambda: n.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
    ("DeviceGetTotalEccErrors", lambda: n.nvmlDeviceGetTotalEccErrors(h, 1, 1)),
    ("DeviceGetMemoryErrorCounter", lambda: n.nvmlDeviceGetMemoryErrorCounter(h, 1, 1, 1)),
    ("DeviceGetRemappedRows", lambda: n.nvmlDeviceGetRemappedRows(h)),
    ("DeviceGetEccMode", lambda: n.nvmlDeviceGetEccMode(h)),
    ("DeviceGetPersistenceMode", lambda: n.nvmlDeviceGetPersistenceMode(h)),
    ("DeviceGetComputeMode", lambda: n.nvmlDeviceGetComputeMode(h)),
    ("DeviceGetMigMode", lambda: n.nvmlDeviceGetMigMode(h)),
    ("DeviceGetInforomImageVersion", lambda: n.nvmlDeviceGetInforomImageVersion(h)),
    ("DeviceGetVbiosVersion", lambda: n.nvmlDeviceGetVbiosVersion(h)),
    ("DeviceGetCurrPcieLinkWidth", lambda: n.nvmlDeviceGetCurrPcieLinkWidth(h)),
    ("DeviceGetPcieReplayCounter", lambda: n.nvmlDeviceGetPcieReplayCounter(h)),
    ("DeviceGetComputeRunningProcesses", lambda: n.nvmlDeviceGetComputeRunningProcesses(h)),
    ("DeviceGetViolationStatus", lambda: n.nvmlDeviceGetViolationStatus(h, 0)),
    ("DeviceGetNvLinkState (link 0)", lambda: n.nvmlDeviceGetNvLinkState(h, 0)),
    ("DeviceGetGpuFabricInfo", lambda: n.nvmlDeviceGetGpuFabricInfo(h, n.c_nvmlGpuFabricInfo_t())),
    ("DeviceGetFieldValues (230)", lambda: n.nvmlDeviceGetFieldValues(h, [230])),
    ("GpmQueryDeviceSupport", lambda: n.nvmlGpmQueryDeviceSupport(h)),
    ("GpmSampleGet", lambda: n.nvmlGpmSampleGet(h, n.nvmlGpmSampleAlloc())),
]
rows = []
for name, f in calls:
    ts, err = [], None
    for _ in range(5):
        c0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
        try:
            f()
        except Exception as e:
            err = type(e).__name__ + ": " + str(e)[:40]
        t1 = time.perf_counter(); c1 = resource.getrusage(resource.RUSAGE_SELF)
        ts.append((t1 - t0, (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)))
    rows.append((statistics.median(t for t, _ in ts) * 1e3, statistics.median(c for _, c in ts) * 1e3, name, err))
for wall, cpu, name, err in sorted(rows, reverse=True):
    print(f"  {wall:8.3f} ms wall {cpu:7.3f} ms CPU  {name}{'  (' + err + ')' if err else ''}")
print(f"  sum of medians: {sum(r[0] for r in rows):.1f} ms wall, {sum(r[1] for r in rows):.1f} ms CPU")
PY
fi

if want ptxas; then
step "ptxas of this machine's toolkit over the shipped PTX"
if command -v ptxas > /dev/null; then
    ptxas --version | tail -1
    for f in src/probe/kernels.ptx src/probe/tensor.ptx; do
        ptxas -arch=sm_90 "$f" -o /dev/null && echo "$f: assembled for sm_90"
    done
else
    echo "no ptxas on this machine"
fi
fi

step "files in $w"; ls "$w"
