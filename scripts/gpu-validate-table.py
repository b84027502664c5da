#!/usr/bin/env python3
"""Side by side (scripts/gpu-validate.sh): the probe's figures, the PyTorch peer's, their ratio and
the link's physical limit. Arguments: probe JSON, peer JSON, doctor JSON."""
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
    # Each GEMM the probe ran beside the peer's matmul in the same format (median TFLOP/s).
    for key, what, peer_key in (
        ("gemm", "gemm", "gemm_tflops"),
        ("gemm_tensor", "bf16", "gemm_bf16_tflops"),
        ("gemm_tensor_fp16", "fp16", "gemm_fp16_tflops"),
        ("gemm_fp64", "fp64", "gemm_fp64_tflops"),
    ):
        gm = (g.get(key) or {}).get("ok") if isinstance(g.get(key), dict) else None
        if not gm:
            continue
        ours = sorted(gm["tflops_samples"])[len(gm["tflops_samples"]) // 2]
        theirs = pe.get(peer_key)
        r1 = f"{ours/theirs:.2f}" if theirs else "-"
        print(f"{g['pci']:<14}{what:<6}{ours:>9.1f}{(theirs or 0):>9.1f}{r1:>11}{'':>8}{'':>11}  TFLOP/s by {gm['library']}, {gm['wrong_entries']} wrong of {gm['checked_entries']}")
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
