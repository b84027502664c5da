#!/usr/bin/env python3
"""The PyTorch peer of the probes (scripts/gpu-validate.sh): the same buffer size, copies per
sample and GEMM side on the same GPUs, timed with CUDA events. Argument: the probe's JSON."""
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
    # FP64 on the FP64 units: the peer of probe.gemm-fp64 (the power test's load).
    gemm_fp64 = tflops(a.double(), b.double(), 3)
    res[str(gpu)] = {
        "index": gpu,
        "gemm_bf16_tflops": gemm_bf16,
        "gemm_fp16_tflops": gemm_fp16,
        "gemm_fp64_tflops": gemm_fp64,
        "h2d": bw(lambda: dev.copy_(host, non_blocking=True), n),
        "d2h": bw(lambda: host.copy_(dev, non_blocking=True), n),
        "d2d": bw(lambda: dev2.copy_(dev, non_blocking=True), 2 * n),
        # An elementwise kernel: every byte read and written by the SMs, as phq_copy_sm does.
        "sm_copy": bw(lambda: torch.add(dev.view(torch.float32), 0, out=dev2.view(torch.float32)), 2 * n),
        "gemm_tflops": gemm_fp32,
    }
print(json.dumps(res))
