#!/usr/bin/env bash
# Hardware validation on a machine with a Hopper GPU: runs the release binary's doctor and quick
# probes, measures the same copies with PyTorch (pinned host↔device, device copy by the copy
# engine, and an elementwise kernel copy beside the probe's SM copy; CUDA events, same buffer
# size and copy count), and prints them side by side as ratios, plus each figure against the
# link's physical limit; then the memory test's coverage and effective rate, the latency
# chase, the NVLink scope line, a short sustained GEMM, and with two GPUs or more NCCL's
# all-reduce beside nccl-tests' all_reduce_perf.
#
#   scripts/gpu-validate.sh [path/to/phq-agent]        (default: target/release/phq-agent)
#
# Writes everything to $OUT (the device tool's output folder) or ./gpu-validation-<date>/.
# Record the printed table, date, GPU and driver in docs/hardware-validation.md.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/phq-agent}
out=${OUT:-gpu-validation-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
# PyTorch and the probes then number GPUs the same way (PCI order, as nvidia-smi).
export CUDA_DEVICE_ORDER=PCI_BUS_ID
exec > >(tee "$out/summary.txt") 2>&1

echo "== machine  $(date -u +%FT%TZ)  $(uname -r)"
nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total --format=csv 2>&1 | tee "$out/nvidia-smi.csv"

echo "== phq-agent doctor"
/usr/bin/time -f "doctor wall %e s, peak RSS %M KiB" "$bin" doctor --json > "$out/doctor.json" 2> "$out/doctor.stderr"; echo "exit $?"
tail -1 "$out/doctor.stderr"
"$bin" doctor > "$out/doctor.txt" 2>&1; sed -n '1,60p' "$out/doctor.txt"

echo "== phq-agent probe --dry-run (GPU time planned at each SKU's floors)"
"$bin" probe --level quick --dry-run | tee "$out/plan.txt"
"$bin" probe --level quick --dry-run --json > "$out/plan.json"

echo "== phq-agent probe --level quick"
/usr/bin/time -f "probe wall %e s" "$bin" probe --level quick --json > "$out/probe.json" 2> "$out/probe.stderr"; echo "exit $?"
tail -3 "$out/probe.stderr"

echo "== PyTorch peer"
python3 - "$out/probe.json" > "$out/peer.json" <<'PY' || echo "PyTorch peer failed (is torch with CUDA installed?)"
import json, statistics, sys
import torch
rep = json.load(open(sys.argv[1]))
p = (rep.get("probes") or {}).get("params") or {"buffer_bytes": 64 << 20, "copies_per_sample": 8, "samples": 3}
n, copies, samples = p["buffer_bytes"], p["copies_per_sample"], p["samples"]
res = {}
for gpu in range(torch.cuda.device_count()):
    torch.cuda.set_device(gpu)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=f"cuda:{gpu}")
    dev2 = torch.empty(n, dtype=torch.uint8, device=f"cuda:{gpu}")
    def bw(fn, counted):
        fn(); torch.cuda.synchronize()
        out = []
        for _ in range(samples):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(copies):
                fn()
            e.record(); torch.cuda.synchronize()
            out.append(counted * copies / (s.elapsed_time(e) / 1000) / 1e9)
        return statistics.median(out)
    # FP32 GEMM of the probe's size, TF32 off (the probe's cuBLAS SGEMM is plain FP32).
    torch.backends.cuda.matmul.allow_tf32 = False
    g = p.get("gemm_n", 4096)
    a = torch.randint(-8, 9, (g, g), device=f"cuda:{gpu}").float()
    b = torch.randint(-8, 9, (g, g), device=f"cuda:{gpu}").float()
    def tflops(x, y, reps):
        # One untimed product, then `reps` between two events: TFLOP/s of an n×n×n GEMM.
        torch.matmul(x, y); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            torch.matmul(x, y)
        e.record(); torch.cuda.synchronize()
        return 2 * g ** 3 * reps / (s.elapsed_time(e) / 1000) / 1e12
    gemm_fp32 = tflops(a, b, 5)
    # The same product in BF16 on the tensor cores, FP32 accumulation (cuBLAS through torch):
    # the peer of probe.gemm-tensor.
    gemm_bf16 = tflops(a.bfloat16(), b.bfloat16(), 20)
    gemm_fp16 = tflops(a.half(), b.half(), 20)
    res[str(gpu)] = {
        "index": gpu,
        "gemm_bf16_tflops": gemm_bf16,
        "gemm_fp16_tflops": gemm_fp16,
        "h2d": bw(lambda: dev.copy_(host, non_blocking=True), n),
        "d2h": bw(lambda: host.copy_(dev, non_blocking=True), n),
        "d2d": bw(lambda: dev2.copy_(dev, non_blocking=True), 2 * n),
        # An elementwise kernel: every byte read and written by the SMs, as phq_copy_sm does.
        "sm_copy": bw(lambda: torch.add(dev.view(torch.float32), 0, out=dev2.view(torch.float32)), 2 * n),
        "gemm_tflops": gemm_fp32,
    }
print(json.dumps(res))
PY

echo "== side by side (GB/s; d2d counts bytes read + written)"
python3 - "$out/probe.json" "$out/peer.json" "$out/doctor.json" <<'PY'
import json, sys
probe = json.load(open(sys.argv[1]))
try:
    peer = json.load(open(sys.argv[2]))
except Exception:
    peer = {}
doctor = json.load(open(sys.argv[3]))
models = {g["pci_address"]: g["model"] for g in doctor.get("gpus", [])}
# Physical limits: PCIe Gen5 x16 carries 32 GT/s x 16 lanes x 128/130 / 8 = 63.0 GB/s per
# direction; device copies are bounded by the HBM datasheet bandwidth (docs/reference.md).
HBM = {"H100 SXM5 80GB": 3350, "H100 PCIe": 2000, "H100 NVL": 3900, "H200 SXM": 4800, "H200 NVL": 4800}
PCIE = 63.0
gpus = (probe.get("probes") or {}).get("gpus", [])
print(f"{'GPU':<14}{'what':<6}{'phq':>9}{'torch':>9}{'phq/torch':>11}{'limit':>8}{'phq/limit':>11}")
for g in gpus:
    pe = next((v for v in peer.values() if v.get("index") == g["ordinal"]), {})
    for key, what in (("h2d_gbps", "h2d"), ("d2h_gbps", "d2h"), ("d2d_gbps", "d2d"), ("sm_copy_gbps", "sm_copy")):
        o = g.get(key) or {}
        ours = o.get("ok", {}).get("median") if isinstance(o, dict) else None
        theirs = pe.get(what)
        limit = PCIE if what in ("h2d", "d2h") else HBM.get(models.get(g["pci"], ""), None)
        r1 = f"{ours/theirs:.2f}" if ours and theirs else "-"
        r2 = f"{ours/limit:.2f}" if ours and limit else "-"
        print(f"{g['pci']:<14}{what:<6}{(ours or 0):>9.1f}{(theirs or 0):>9.1f}{r1:>11}{(limit or 0):>8.0f}{r2:>11}")
    gm = g.get("gemm", {}).get("ok") if isinstance(g.get("gemm"), dict) else None
    if gm:
        ours = sorted(gm["tflops_samples"])[len(gm["tflops_samples"]) // 2]
        theirs = pe.get("gemm_tflops")
        r1 = f"{ours/theirs:.2f}" if theirs else "-"
        print(f"{g['pci']:<14}{'gemm':<6}{ours:>9.1f}{(theirs or 0):>9.1f}{r1:>11}{'':>8}{'':>11}  TFLOP/s, {gm['wrong_entries']} wrong of {gm['checked_entries']}")
    gt = (g.get("gemm_tensor") or {}).get("ok") if isinstance(g.get("gemm_tensor"), dict) else None
    if gt:
        ours = sorted(gt["tflops_samples"])[len(gt["tflops_samples"]) // 2]
        theirs = pe.get("gemm_bf16_tflops")
        r1 = f"{ours/theirs:.2f}" if theirs else "-"
        print(f"{g['pci']:<14}{'bf16':<6}{ours:>9.1f}{(theirs or 0):>9.1f}{r1:>11}{'':>8}{'':>11}  TFLOP/s by {gt['library']}, {gt['wrong_entries']} wrong of {gt['checked_entries']}")
    gh = (g.get("gemm_tensor_fp16") or {}).get("ok") if isinstance(g.get("gemm_tensor_fp16"), dict) else None
    if gh:
        ours = sorted(gh["tflops_samples"])[len(gh["tflops_samples"]) // 2]
        theirs = pe.get("gemm_fp16_tflops")
        r1 = f"{ours/theirs:.2f}" if theirs else "-"
        print(f"{g['pci']:<14}{'fp16':<6}{ours:>9.1f}{(theirs or 0):>9.1f}{r1:>11}{'':>8}{'':>11}  TFLOP/s by {gh['library']}, {gh['wrong_entries']} wrong of {gh['checked_entries']}")
    mt = (g.get("memory") or {}).get("ok")
    if mt:
        secs = mt.get("seconds") or 0
        traffic = mt["bytes_tested"] * 2 * len(mt.get("passes", []))  # each pass: one write, one read
        rate = f"{traffic / secs / 1e9:.0f} GB/s of write+check traffic" if secs else "no time"
        print(f"{'':<14}memory test: {mt['bytes_tested'] >> 20} MiB in {mt['chunks']} chunks, {len(mt.get('passes', []))} passes, {secs:.2f} s ({rate}), {mt['mismatches']} mismatches, method {mt['method']}")
    lat = (g.get("host_latency_ns") or {}).get("ok")
    if lat:
        print(f"{'':<14}host latency: {lat['median']:.0f} ns per dependent load (nvbandwidth host_device_latency_sm is the peer to run by hand)")
    print(f"{'':<14}host memory: {g.get('host_memory')}; NVML after h2d: {g.get('conditions', {}).get('h2d')}")
for f in probe.get("findings", []):
    if f["id"] == "probe.nvlink-scope":
        print(f"NVLink scope: {f['summary']}")
for f in probe.get("findings", []):
    if f["id"].startswith("probe.") and f["severity"] != "pass":
        print(f"{f['severity'].upper():<8}{f['id']:<26}{f.get('gpu') or '':<14}{f['summary']}")
PY
echo "== phq-agent probe --gemm-seconds 20 (every GPU at once; NVML clocks after it)"
"$bin" probe --level quick --gemm-seconds 20 --json > "$out/sustained.json" 2> "$out/sustained.stderr"; echo "exit $?"
python3 - "$out/sustained.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for f in r.get("findings", []):
    if f["id"] == "probe.gemm-sustained":
        c = (f.get("evidence") or {}).get("conditions") or {}
        print(f"{f['severity'].upper():<6}{f.get('gpu') or '':<14}{f['summary']}  [SM {c.get('sm_clock_mhz')} MHz, {c.get('power_mw')} mW, {c.get('throttle_reasons')}]")
PY
echo "== phq-agent probe --power-seconds 20 (FP64 on every GPU at once, board power held to DCGM's target) beside nvidia-smi's own power readings"
nvidia-smi --query-gpu=index,power.draw,power.limit --format=csv,noheader -lms 500 > "$out/power-nvidia-smi.csv" 2>&1 &
smi=$!
"$bin" probe --level quick --gemm-seconds 0 --power-seconds 20 --json > "$out/power.json" 2> "$out/power.stderr"; echo "exit $?"
kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
python3 - "$out/power.json" "$out/power-nvidia-smi.csv" <<'PY'
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
echo "== all-reduce (NCCL) beside nccl-tests' all_reduce_perf, the same message and GPUs"
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if [ "$gpus" -lt 2 ]; then
    echo "one GPU: no all-reduce to measure (probe.allreduce needs two or more)"
else
    "$bin" probe --level quick --allreduce-size 1G --json > "$out/allreduce.json" 2> "$out/allreduce.stderr"; echo "exit $?"
    python3 - "$out/allreduce.json" <<'PY'
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
        all_reduce_perf -b 1G -e 1G -g "$gpus" -c 1 | tee "$out/all_reduce_perf.txt" | tail -6
    else
        echo "all_reduce_perf (nccl-tests) is not installed: no peer figure"
    fi
fi
echo "== files in $out"; ls "$out"
