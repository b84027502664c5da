//! The fake's own rules, each answered with the real driver's code. One test function: the
//! driver is one per process, initialised once, and its fault counters are shared.

use super::*;
use crate::blas::{self, cublasCreate_v2, cublasSetStream_v2, cublasSgemm_v2};

const SCENARIO: &str = r#"{
  "driver_version": 12080,
  "devices": [
    {"name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:18:00.0", "memory_bytes": 1073741824,
     "context_bytes": 16777216, "fastest_first_rank": 1,
     "h2d_gbps": 50, "d2h_gbps": 40, "hbm_gbps": 2000,
     "stuck_bits": [{"offset": 8, "bit": 0, "value": 1}]},
    {"name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:2a:00.0", "memory_bytes": 1073741824,
     "context_bytes": 16777216, "fastest_first_rank": 0,
     "h2d_gbps": 50, "d2h_gbps": 40, "hbm_gbps": 2000},
    {"name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:3a:00.0", "memory_bytes": 1073741824,
     "context_bytes": 16777216, "fastest_first_rank": 2,
     "h2d_gbps": 50, "d2h_gbps": 40, "hbm_gbps": 2000,
     "faults": [{"on": "memset", "after": 1, "error": "CUDA_ERROR_ECC_UNCORRECTABLE"}]},
    {"name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:5d:00.0", "memory_bytes": 1073741824,
     "fastest_first_rank": 3, "h2d_gbps": 50, "d2h_gbps": 40, "hbm_gbps": 2000,
     "compute_mode": "exclusive_process", "other_process": true}
  ],
  "peers": {"access": true, "gbps": 400, "pairs": [
    {"src": 0, "dst": 2, "access": false}, {"src": 2, "dst": 0, "access": false},
    {"src": 1, "dst": 2, "access": false}, {"src": 2, "dst": 1, "access": false}]}
}"#;

/// The fake's reference kernel, a grid-stride fill, and a kernel with an instruction the
/// interpreter does not execute (`popc`).
const FILL_PTX: &str = ".version 7.8\n.target sm_90\n.address_size 64\n\
.visible .entry phq_fake_fill_u32(.param .u64 dst, .param .u32 value, .param .u64 count)\n{\n\
    .reg .pred %p<2>;\n    .reg .b32 %r<6>;\n    .reg .b64 %rd<8>;\n\
    ld.param.u64 %rd1, [dst];\n    ld.param.u32 %r1, [value];\n    ld.param.u64 %rd2, [count];\n\
    mov.u32 %r2, %ctaid.x;\n    mov.u32 %r3, %ntid.x;\n    mov.u32 %r4, %tid.x;\n    mov.u32 %r5, %nctaid.x;\n\
    mul.wide.u32 %rd3, %r2, %r3;\n    cvt.u64.u32 %rd4, %r4;\n    add.u64 %rd3, %rd3, %rd4;\n    mul.wide.u32 %rd5, %r5, %r3;\n\
LOOP:\n    setp.ge.u64 %p1, %rd3, %rd2;\n    @%p1 bra DONE;\n    shl.b64 %rd6, %rd3, 2;\n    add.u64 %rd7, %rd1, %rd6;\n\
    st.global.u32 [%rd7], %r1;\n    add.u64 %rd3, %rd3, %rd5;\n    bra.uni LOOP;\nDONE:\n    ret;\n}\n\
.visible .entry phq_unwritten()\n{\n    .reg .b32 %r<2>;\n    mov.u32 %r0, 3;\n    popc.b32 %r1, %r0;\n    ret;\n}\n\0";

fn ok(r: CUresult) {
    assert_eq!(r, SUCCESS, "{}", name(r));
}

fn name(r: CUresult) -> String {
    let mut p = std::ptr::null();
    unsafe { cuGetErrorName(r, &mut p) };
    unsafe { c_str(p) }
}

unsafe fn retain(ordinal: c_int) -> Handle {
    let mut c = std::ptr::null_mut();
    ok(cuDevicePrimaryCtxRetain(&mut c, ordinal));
    c
}

unsafe fn elapsed_ms(s: Handle, work: impl FnOnce()) -> f32 {
    let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
    ok(cuEventCreate(&mut a, 0));
    ok(cuEventCreate(&mut b, 0));
    ok(cuEventRecord(a, s));
    work();
    ok(cuEventRecord(b, s));
    ok(cuStreamSynchronize(s));
    let mut ms = 0.0;
    ok(cuEventElapsedTime(&mut ms, a, b));
    ms
}

#[test]
fn the_drivers_rules() {
    let dir = std::env::temp_dir().join(format!("fake-cuda-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("scenario.json");
    std::fs::write(&path, SCENARIO).unwrap();
    std::env::set_var("PHQ_FAKE_CUDA_SCENARIO", &path);
    std::env::remove_var("CUDA_DEVICE_ORDER");
    unsafe {
        let mut n = 0;
        assert_eq!(cuDeviceGetCount(&mut n), NOT_INITIALIZED, "before cuInit");
        ok(cuInit(0));
        ok(cuDeviceGetCount(&mut n));
        assert_eq!(n, 4);

        // FASTEST_FIRST (no CUDA_DEVICE_ORDER): ordinal 0 is not the lowest PCI address.
        let mut bus = [0 as c_char; 32];
        ok(cuDeviceGetPCIBusId(bus.as_mut_ptr(), 32, 0));
        assert_eq!(c_str(bus.as_ptr()), "0000:2a:00.0");
        // Ordinals from here: 0 = 2a, 1 = 18, 2 = 3a, 3 = 5d.

        // No current context: CUDA_ERROR_INVALID_CONTEXT.
        let mut p: CUdeviceptr = 0;
        assert_eq!(cuMemAlloc_v2(&mut p, 1 << 20), INVALID_CONTEXT);
        let mut s = std::ptr::null_mut();
        assert_eq!(cuStreamCreate(&mut s, 0), INVALID_CONTEXT);

        // Exclusive-process mode with another process on the GPU.
        let mut c3 = std::ptr::null_mut();
        assert_eq!(cuDevicePrimaryCtxRetain(&mut c3, 3), DEVICE_UNAVAILABLE);

        let c0 = retain(0);
        let c1 = retain(1);
        ok(cuCtxSetCurrent(c0));
        let mut s0 = std::ptr::null_mut();
        ok(cuStreamCreate(&mut s0, 0));

        // Out of memory: 1 GiB minus the context's 16 MiB is left.
        assert_eq!(cuMemAlloc_v2(&mut p, 1 << 30), OUT_OF_MEMORY);

        // Copies take bytes ÷ rate of virtual time: 64 MiB at 50 GB/s.
        let mib64 = 64usize << 20;
        let mut d0: CUdeviceptr = 0;
        ok(cuMemAlloc_v2(&mut d0, mib64));
        let mut host: *mut c_void = std::ptr::null_mut();
        ok(cuMemHostAlloc(&mut host, mib64, 0));
        std::ptr::write_bytes(host as *mut u8, 0x5a, mib64);
        let ms = elapsed_ms(s0, || ok(cuMemcpyHtoDAsync_v2(d0, host, mib64, s0)));
        let want = mib64 as f64 / 50e9 * 1e3;
        assert!((ms as f64 - want).abs() < 1e-3, "{ms} ms for {want}");
        // A device copy reads and writes every byte: 2 × 64 MiB at 2000 GB/s.
        let mut d0b: CUdeviceptr = 0;
        ok(cuMemAlloc_v2(&mut d0b, mib64));
        let ms = elapsed_ms(s0, || ok(cuMemcpyDtoDAsync_v2(d0b, d0, mib64, s0)));
        assert!((ms as f64 - 2.0 * mib64 as f64 / 2000e9 * 1e3).abs() < 1e-3, "{ms}");
        let mut back = vec![0u8; 16];
        ok(cuMemcpyDtoHAsync_v2(back.as_mut_ptr() as *mut c_void, d0b, 16, s0));
        assert_eq!(back, vec![0x5a; 16]);

        // An event recorded on a stream of another context: CUDA_ERROR_INVALID_HANDLE.
        ok(cuCtxSetCurrent(c1));
        let mut ev1 = std::ptr::null_mut();
        ok(cuEventCreate(&mut ev1, 0));
        assert_eq!(cuEventRecord(ev1, s0), INVALID_HANDLE);
        // ... but waiting on another context's event is allowed.
        let mut s1 = std::ptr::null_mut();
        ok(cuStreamCreate(&mut s1, 0));
        ok(cuEventRecord(ev1, s1));
        ok(cuStreamWaitEvent(s0, ev1, 0));
        // An event never recorded cannot be timed.
        let mut ev_never = std::ptr::null_mut();
        ok(cuEventCreate(&mut ev_never, 0));
        let mut ms = 0.0;
        assert_eq!(cuEventElapsedTime(&mut ms, ev1, ev_never), INVALID_HANDLE);

        // Peer copies: 64 MiB from GPU 0 (2a) to GPU 1 (18). Plain cuMemAlloc buffers, access
        // enabled from the copying context: the peer link's 400 GB/s.
        let mut d1: CUdeviceptr = 0;
        ok(cuMemAlloc_v2(&mut d1, mib64));
        ok(cuCtxSetCurrent(c0));
        let staged = elapsed_ms(s0, || ok(cuMemcpyPeerAsync(d1, c1, d0, c0, mib64, s0)));
        assert!((staged as f64 - mib64 as f64 / 40e9 * 1e3).abs() < 1e-3, "no access yet: staged at 40 GB/s, {staged}");
        ok(cuCtxEnablePeerAccess(c1, 0));
        assert_eq!(cuCtxEnablePeerAccess(c1, 0), PEER_ACCESS_ALREADY_ENABLED);
        let direct = elapsed_ms(s0, || ok(cuMemcpyPeerAsync(d1, c1, d0, c0, mib64, s0)));
        assert!((direct as f64 - mib64 as f64 / 400e9 * 1e3).abs() < 1e-3, "{direct}");
        // Pool memory does not follow cuCtxEnablePeerAccess: staged until the pool grants it.
        ok(cuCtxSetCurrent(c1));
        let mut pool_buf: CUdeviceptr = 0;
        ok(cuMemAllocAsync(&mut pool_buf, mib64, s1));
        ok(cuCtxSetCurrent(c0));
        let pooled = elapsed_ms(s0, || ok(cuMemcpyPeerAsync(pool_buf, c1, d0, c0, mib64, s0)));
        assert!((pooled - staged).abs() < 1e-3, "pool memory without pool access: {pooled}");
        let mut pool = std::ptr::null_mut();
        ok(cuDeviceGetDefaultMemPool(&mut pool, 1));
        let grant = MemAccessDesc { location_type: 1, location_id: 0, flags: 3 };
        ok(cuMemPoolSetAccess(pool, &grant, 1));
        let granted = elapsed_ms(s0, || ok(cuMemcpyPeerAsync(pool_buf, c1, d0, c0, mib64, s0)));
        assert!((granted - direct).abs() < 1e-3, "{granted}");

        // No peer access between 0 and 2 at all.
        let c2 = retain(2);
        let mut can = 1;
        ok(cuDeviceCanAccessPeer(&mut can, 0, 2));
        assert_eq!(can, 0);
        assert_eq!(cuCtxEnablePeerAccess(c2, 0), PEER_ACCESS_UNSUPPORTED);

        // A freed pointer is no longer memory: CUDA_ERROR_INVALID_VALUE, and so is freeing twice.
        ok(cuMemFree_v2(d0b));
        assert_eq!(cuMemcpyDtoHAsync_v2(back.as_mut_ptr() as *mut c_void, d0b, 16, s0), INVALID_VALUE);
        assert_eq!(cuMemFree_v2(d0b), INVALID_VALUE);

        // A stuck bit on GPU 1 (scenario device 0): offset 8 of its memory reads bit 0 set.
        ok(cuCtxSetCurrent(c1));
        let mut s1b = std::ptr::null_mut();
        ok(cuStreamCreate(&mut s1b, 0));
        let mut first: CUdeviceptr = 0;
        ok(cuMemAlloc_v2(&mut first, 4096));
        // GPU 1's earlier allocations come first; find the one at the start of its memory.
        let base1 = BASE; // scenario device 0
        ok(cuMemsetD32Async(base1, 0, 4, s1b));
        let mut words = [0u32; 4];
        ok(cuMemcpyDtoHAsync_v2(words.as_mut_ptr() as *mut c_void, base1, 16, s1b));
        // Still dirty in the L2: the copy reads what was written, not the cell.
        assert_eq!(words, [0, 0, 0, 0], "a line dirty in the L2 reads what was written");
        // Twice the L2 written elsewhere: the line went to HBM, and the cell's fault shows.
        let mut evict: CUdeviceptr = 0;
        ok(cuMemAlloc_v2(&mut evict, 100 << 20));
        ok(cuMemsetD32Async(evict, 7, (100 << 20) / 4, s1b));
        ok(cuMemcpyDtoHAsync_v2(words.as_mut_ptr() as *mut c_void, base1, 16, s1b));
        assert_eq!(words, [0, 0, 1, 0], "the stuck bit reads 1 whatever was written");
        ok(cuMemFree_v2(evict));

        // A sticky error: GPU 2's second memset meets an uncorrectable ECC error. The memset
        // itself is queued; every later call in that context answers 214; GPU 0 carries on.
        ok(cuCtxSetCurrent(c2));
        let mut s2 = std::ptr::null_mut();
        ok(cuStreamCreate(&mut s2, 0));
        let mut d2: CUdeviceptr = 0;
        ok(cuMemAlloc_v2(&mut d2, 4096));
        ok(cuMemsetD32Async(d2, 1, 1024, s2));
        ok(cuMemsetD32Async(d2, 2, 1024, s2));
        assert_eq!(cuStreamSynchronize(s2), ECC_UNCORRECTABLE);
        assert_eq!(cuMemAlloc_v2(&mut p, 4096), ECC_UNCORRECTABLE);
        assert_eq!(cuCtxSynchronize(), ECC_UNCORRECTABLE);
        assert_eq!(name(ECC_UNCORRECTABLE), "CUDA_ERROR_ECC_UNCORRECTABLE");
        ok(cuCtxSetCurrent(c0));
        ok(cuStreamSynchronize(s0));

        // Kernels: a PTX module declares them by name, each runs through the fake's
        // reimplementation, at the GPU's HBM rate.
        let ptx = FILL_PTX.as_bytes();
        let (mut module, mut f, mut g) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(cuModuleLoadData(&mut module, c"not ptx".as_ptr() as *const c_void), INVALID_PTX);
        assert_eq!(name(INVALID_PTX), "CUDA_ERROR_INVALID_PTX");
        // PTX newer than the driver's CUDA release (ISA 9.0 needs CUDA 13.0; this driver is 12.8).
        let newer = b".version 9.0\n.target sm_90\n.address_size 64\n.visible .entry k()\n{ ret; }\n\0";
        assert_eq!(cuModuleLoadData(&mut module, newer.as_ptr() as *const c_void), codes::UNSUPPORTED_PTX_VERSION);
        assert_eq!(name(codes::UNSUPPORTED_PTX_VERSION), "CUDA_ERROR_UNSUPPORTED_PTX_VERSION");
        ok(cuModuleLoadData(&mut module, ptx.as_ptr() as *const c_void));
        assert_eq!(cuModuleGetFunction(&mut f, module, c"phq_missing".as_ptr()), NOT_FOUND);
        assert_eq!(name(NOT_FOUND), "CUDA_ERROR_NOT_FOUND");
        ok(cuModuleGetFunction(&mut f, module, c"phq_fake_fill_u32".as_ptr()));
        let mut k0: CUdeviceptr = 0;
        ok(cuMemAlloc_v2(&mut k0, 4096));
        let (mut dst, mut value, mut count) = (k0, 0xdead_beef_u32, 1024u64);
        let mut params: [*mut c_void; 3] = [
            &mut dst as *mut _ as *mut c_void,
            &mut value as *mut _ as *mut c_void,
            &mut count as *mut _ as *mut c_void,
        ];
        let null = std::ptr::null_mut();
        // More than 1024 threads in a block: refused.
        assert_eq!(cuLaunchKernel(f, 1, 1, 1, 2048, 1, 1, 0, s0, params.as_mut_ptr(), null), INVALID_VALUE);
        // A stream of another context than the module's: refused.
        assert_eq!(cuLaunchKernel(f, 4, 1, 1, 256, 1, 1, 0, s1b, params.as_mut_ptr(), null), INVALID_HANDLE);
        let ms = elapsed_ms(s0, || ok(cuLaunchKernel(f, 4, 1, 1, 256, 1, 1, 0, s0, params.as_mut_ptr(), null)));
        assert!((ms as f64 - 4096.0 / 2000e9 * 1e3).abs() < 1e-9, "{ms}");
        let mut words = [0u32; 4];
        ok(cuMemcpyDtoHAsync_v2(words.as_mut_ptr() as *mut c_void, k0 + 4092 - 12, 16, s0));
        assert_eq!(words, [0xdead_beef; 4]);
        // A kernel with an instruction the fake's interpreter does not execute is refused,
        // never silently skipped.
        ok(cuModuleGetFunction(&mut g, module, c"phq_unwritten".as_ptr()));
        assert_eq!(cuLaunchKernel(g, 1, 1, 1, 1, 1, 1, 0, s0, params.as_mut_ptr(), null), NOT_SUPPORTED);
        // NCCL on GPUs 0 and 1, before GPU 1 is poisoned below.
        nccl_rules();
        // A kernel writing a peer's memory without access (GPU 1 → GPU 2): the launch is
        // accepted and the context is poisoned with an illegal address.
        ok(cuCtxSetCurrent(c1));
        let (mut module1, mut f1) = (std::ptr::null_mut(), std::ptr::null_mut());
        ok(cuModuleLoadData(&mut module1, ptx.as_ptr() as *const c_void));
        ok(cuModuleGetFunction(&mut f1, module1, c"phq_fake_fill_u32".as_ptr()));
        let (mut peer, mut value1, mut count1) = (d2, 1u32, 1024u64);
        let mut params1: [*mut c_void; 3] = [
            &mut peer as *mut _ as *mut c_void,
            &mut value1 as *mut _ as *mut c_void,
            &mut count1 as *mut _ as *mut c_void,
        ];
        ok(cuLaunchKernel(f1, 4, 1, 1, 256, 1, 1, 0, s1b, params1.as_mut_ptr(), null));
        assert_eq!(cuStreamSynchronize(s1b), ILLEGAL_ADDRESS);
        assert_eq!(cuModuleUnload(module1), SUCCESS);
        assert_eq!(cuModuleGetFunction(&mut f1, module1, c"phq_fake_fill_u32".as_ptr()), INVALID_HANDLE);
        ok(cuCtxSetCurrent(c0));

        // Page-locked host memory through its unified address: flags must be 0, the pointer must
        // come from cuMemHostAlloc.
        let mut host: *mut c_void = std::ptr::null_mut();
        ok(cuMemHostAlloc(&mut host, 8, 0x3));
        let mut dev_ptr: CUdeviceptr = 0;
        assert_eq!(cuMemHostGetDevicePointer_v2(&mut dev_ptr, host, 1), INVALID_VALUE);
        let mut not_pinned = [0u8; 8];
        assert_eq!(
            cuMemHostGetDevicePointer_v2(&mut dev_ptr, not_pinned.as_mut_ptr() as *mut c_void, 0),
            INVALID_VALUE
        );
        ok(cuMemHostGetDevicePointer_v2(&mut dev_ptr, host, 0));
        assert_eq!(dev_ptr, host as u64);
        // The agent's spin kernel: a stream waited on before the host released the flag would
        // have waited for the timeout, and the kernel says so in its status word.
        let agent = format!("{}\0", include_str!("../../../src/probe/kernels.ptx"));
        let (mut agent_module, mut spin) = (std::ptr::null_mut(), std::ptr::null_mut());
        ok(cuModuleLoadData(&mut agent_module, agent.as_ptr() as *const c_void));
        ok(cuModuleGetFunction(&mut spin, agent_module, c"phq_spin".as_ptr()));
        let words = host as *mut u32;
        let (mut flag, mut timeout, mut status) = (dev_ptr, 10_000_000_000u64, dev_ptr + 4);
        let mut spin_params: [*mut c_void; 3] = [
            &mut flag as *mut _ as *mut c_void,
            &mut timeout as *mut _ as *mut c_void,
            &mut status as *mut _ as *mut c_void,
        ];
        ok(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s0, spin_params.as_mut_ptr(), null));
        ok(cuStreamSynchronize(s0));
        assert_eq!(std::ptr::read_volatile(words.add(1)), 1, "never released: timed out");
        std::ptr::write_volatile(words.add(1), 0);
        ok(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s0, spin_params.as_mut_ptr(), null));
        std::ptr::write_volatile(words, 1);
        ok(cuStreamSynchronize(s0));
        assert_eq!(std::ptr::read_volatile(words.add(1)), 0, "released before the wait");
        // Every kernel the agent ships has a reimplementation here.
        for entry in agent.lines().filter_map(|l| l.strip_prefix(".visible .entry ")) {
            let name = entry.trim_end_matches('(');
            assert!(kernels::NAMES.contains(&name), "the fake cannot run the agent's kernel {name}");
        }
        ok(cuModuleUnload(agent_module));
        ok(cuMemFreeHost(host));

        // cuBLAS: an exact integer product, computed lazily, at the scenario's rate.
        let n = 64usize;
        let a_host: Vec<f32> = (0..n * n).map(|x| ((x * 7) % 9) as f32 - 4.0).collect();
        let b_host: Vec<f32> = (0..n * n).map(|x| ((x * 5) % 7) as f32 - 3.0).collect();
        let (mut a, mut b, mut c) = (0, 0, 0);
        for (ptr, data) in [(&mut a, &a_host), (&mut b, &b_host)] {
            ok(cuMemAlloc_v2(ptr, n * n * 4));
            ok(cuMemcpyHtoDAsync_v2(*ptr, data.as_ptr() as *const c_void, n * n * 4, s0));
        }
        ok(cuMemAlloc_v2(&mut c, n * n * 4));
        let mut h = std::ptr::null_mut();
        assert_eq!(cublasCreate_v2(&mut h), blas::SUCCESS);
        assert_eq!(cublasSetStream_v2(h, s0), blas::SUCCESS);
        let (one, zero) = (1.0f32, 0.0f32);
        let ni = n as c_int;
        let ms = elapsed_ms(s0, || {
            assert_eq!(cublasSgemm_v2(h, 0, 0, ni, ni, ni, &one, a, ni, b, ni, &zero, c, ni), blas::SUCCESS);
        });
        assert!((ms as f64 - 2.0 * (n * n * n) as f64 / 50e12 * 1e3).abs() < 1e-6, "{ms}");
        let mut got = vec![0f32; n * n];
        ok(cuMemcpyDtoHAsync_v2(got.as_mut_ptr() as *mut c_void, c, n * n * 4, s0));
        for j in 0..n {
            for i in 0..n {
                let want: f32 = (0..n).map(|k| a_host[i + k * n] * b_host[k + j * n]).sum();
                assert_eq!(got[i + j * n], want, "C({i},{j})");
            }
        }
        assert_eq!(cublasSgemm_v2(h, 0, 0, -1, ni, ni, &one, a, ni, b, ni, &zero, c, ni), blas::INVALID_VALUE);
        // A GEMM reading GPU 2's memory, to which GPU 0 has no access: an illegal address,
        // sticky in GPU 0's context.
        assert_eq!(cublasSgemm_v2(h, 0, 0, 1, 1, 1, &one, d2, 1, b, ni, &zero, c, ni), blas::SUCCESS);
        assert_eq!(cuStreamSynchronize(s0), ILLEGAL_ADDRESS);
        assert_eq!(name(ILLEGAL_ADDRESS), "CUDA_ERROR_ILLEGAL_ADDRESS");
    }
}

/// The fake NCCL's rules (`nccl`), on GPUs 0 and 1 (peer access both ways, 400 GB/s).
unsafe fn nccl_rules() {
    use crate::nccl::*;
    let mut v = 0;
    assert_eq!(ncclGetVersion(&mut v), SUCCESS);
    assert!(v >= 22700, "{v}");
    let mut comms = [std::ptr::null_mut(); 2];
    assert_eq!(ncclCommInitAll(comms.as_mut_ptr(), 2, [0, 0].as_ptr()), INVALID_USAGE, "a device twice");
    assert_eq!(ncclCommInitAll(comms.as_mut_ptr(), 2, [0, 9].as_ptr()), INVALID_ARGUMENT, "no device 9");
    // NCCL's one walk: a missing device met before the repeat is the argument's fault.
    assert_eq!(ncclCommInitAll(comms.as_mut_ptr(), 2, [9, 9].as_ptr()), INVALID_ARGUMENT, "no device 9, twice");
    assert_eq!(ncclCommInitAll(comms.as_mut_ptr(), -1, std::ptr::null()), INVALID_ARGUMENT, "a negative count");
    assert_eq!(ncclCommInitAll(comms.as_mut_ptr(), 2, [0, 3].as_ptr()), UNHANDLED_CUDA_ERROR, "GPU 3 is taken");
    assert_eq!(ncclCommInitAll(comms.as_mut_ptr(), 2, [0, 1].as_ptr()), SUCCESS);
    let mut n = 0;
    assert_eq!(ncclCommCount(comms[0], &mut n), SUCCESS);
    assert_eq!(n, 2);
    // Each rank's buffers and stream in its device's primary context.
    let count = 4 << 20;
    let mut bufs = Vec::new();
    for (ordinal, value) in [(0, 1.5f32), (1, 2.25f32)] {
        ok(cuCtxSetCurrent(retain(ordinal)));
        let (mut send, mut recv, mut st) = (0, 0, std::ptr::null_mut());
        ok(cuMemAlloc_v2(&mut send, count * 4));
        ok(cuMemAlloc_v2(&mut recv, count * 4));
        ok(cuStreamCreate(&mut st, 0));
        ok(cuMemsetD32Async(send, value.to_bits(), count, st));
        ok(cuStreamSynchronize(st));
        bufs.push((send, recv, st));
    }
    let all = |n: usize| {
        assert_eq!(ncclGroupStart(), SUCCESS);
        for (r, (send, recv, st)) in bufs.iter().enumerate() {
            let (s, d) = (*send as *const c_void, *recv as *mut c_void);
            assert_eq!(ncclAllReduce(s, d, n, 7, 0, comms[r], *st), SUCCESS);
        }
        assert_eq!(ncclGroupEnd(), SUCCESS);
    };
    // The sum in every rank's buffer, in the ring's time: 2(n−1)/n of 16 MiB at 400 GB/s.
    ok(cuCtxSetCurrent(retain(0)));
    let ms = elapsed_ms(bufs[0].2, || all(count));
    assert!((ms as f64 - (count * 4) as f64 / 400e9 * 1e3).abs() < 1e-4, "{ms}");
    for (_, recv, st) in &bufs {
        let mut w = [0f32; 4];
        ok(cuMemcpyDtoHAsync_v2(w.as_mut_ptr() as *mut c_void, *recv + 4096, 16, *st));
        ok(cuStreamSynchronize(*st));
        assert_eq!(w, [3.75; 4]);
    }
    // Data that is not one word: summed element by element.
    for (r, (send, _, st)) in bufs.iter().enumerate() {
        let v: Vec<f32> = (0..8).map(|i| (i * (r + 1)) as f32).collect();
        ok(cuMemcpyHtoDAsync_v2(*send, v.as_ptr() as *const c_void, 32, *st));
        ok(cuStreamSynchronize(*st));
    }
    all(8);
    let mut w = [0f32; 8];
    ok(cuMemcpyDtoHAsync_v2(w.as_mut_ptr() as *mut c_void, bufs[1].1, 32, bufs[1].2));
    ok(cuStreamSynchronize(bufs[1].2));
    assert_eq!(w, [0.0, 3.0, 6.0, 9.0, 12.0, 15.0, 18.0, 21.0]);
    // Arguments NCCL refuses: 12 types (2.24 on), 5 built-in operations.
    let (s0, r0, st0) = bufs[0];
    let (s1, r1, st1) = bufs[1];
    let (s, r) = (s0 as *const c_void, r0 as *mut c_void);
    assert_eq!(ncclAllReduce(s, r, 8, 12, 0, comms[0], st0), INVALID_ARGUMENT, "no type 12");
    assert_eq!(ncclAllReduce(s, r, 8, 7, 5, comms[0], st0), INVALID_ARGUMENT, "no operation 5");
    assert_eq!(ncclAllReduce(s, r, 8, 7, 0, std::ptr::null_mut(), st0), INVALID_ARGUMENT, "no communicator");
    // A call that fails inside a group fails the group at ncclGroupEnd, and nothing runs: rank
    // 0's result keeps the NaN put there.
    let nan = 0x7fc0_0000u32;
    ok(cuCtxSetCurrent(retain(0)));
    ok(cuMemsetD32Async(r0, nan, 8, st0));
    ok(cuStreamSynchronize(st0));
    let rank1 = |t: c_int, st| ncclAllReduce(s1 as *const c_void, r1 as *mut c_void, 8, t, 0, comms[1], st);
    assert_eq!(ncclGroupStart(), SUCCESS);
    assert_eq!(ncclAllReduce(s, r, 8, 7, 0, comms[0], st0), SUCCESS);
    assert_eq!(rank1(12, st1), INVALID_ARGUMENT);
    assert_eq!(ncclGroupEnd(), INVALID_ARGUMENT, "the group's error");
    let mut w = [0u32; 2];
    ok(cuMemcpyDtoHAsync_v2(w.as_mut_ptr() as *mut c_void, r0, 8, st0));
    ok(cuStreamSynchronize(st0));
    assert_eq!(w, [nan; 2], "nothing was launched");
    // The kernels are launched at ncclGroupEnd: a rank's stream of another device fails there.
    assert_eq!(ncclGroupStart(), SUCCESS);
    assert_eq!(ncclAllReduce(s, r, 8, 7, 0, comms[0], st1), SUCCESS, "queued, not launched");
    assert_eq!(rank1(7, st1), SUCCESS);
    assert_eq!(ncclGroupEnd(), UNHANDLED_CUDA_ERROR, "GPU 1's stream for GPU 0's rank");
    // Buffers are checked only with NCCL_CHECK_POINTERS=1 at init (argcheck.cc, init.cc).
    std::env::set_var("NCCL_CHECK_POINTERS", "1");
    let mut checked = [std::ptr::null_mut(); 2];
    assert_eq!(ncclCommInitAll(checked.as_mut_ptr(), 2, [0, 1].as_ptr()), SUCCESS);
    std::env::remove_var("NCCL_CHECK_POINTERS");
    assert_eq!(ncclAllReduce(s, r1 as *mut c_void, 8, 7, 0, checked[0], st0), INVALID_ARGUMENT, "GPU 1's buffer");
    assert_eq!(ncclAllReduce(std::ptr::null(), r, 8, 7, 0, checked[0], st0), INVALID_ARGUMENT, "a null buffer");
    for c in checked {
        assert_eq!(ncclCommDestroy(c), SUCCESS);
    }
    // No NVLink SHARP: two GPUs, and this scenario's GPUs report no multicast.
    let mut mc = -1;
    ok(cuDeviceGetAttribute(&mut mc, 132, 0));
    assert_eq!(mc, 0);
    assert_eq!(ncclGroupEnd(), INVALID_USAGE, "not in a group");
    assert_eq!(c_str(ncclGetErrorString(INVALID_USAGE)), "invalid usage (run with NCCL_DEBUG=WARN for details)");
    for c in comms {
        assert_eq!(ncclCommDestroy(c), SUCCESS);
    }
    assert_eq!(ncclCommDestroy(comms[0]), INVALID_ARGUMENT, "destroyed already");
}

/// Pattern memory read a word at a time is the same bytes as read one byte at a time, from
/// any start and for any length, the cut words at both ends included.
#[test]
fn pattern_bytes_from_any_address_are_each_bytes_own() {
    for mode in [1, 2, 3] {
        for addr in [0x1000u64, 0x1003, 0x1007, 0x2001] {
            for len in [0, 1, 5, 8, 13, 64, 67] {
                let mut got = vec![0u8; len];
                crate::pattern_bytes(&mut got, addr, mode, 0x9e37_79b9);
                let want: Vec<u8> = (0..len as u64)
                    .map(|i| {
                        let a = addr + i;
                        crate::kernels::pattern(a & !7, mode, 0x9e37_79b9).to_le_bytes()[(a & 7) as usize]
                    })
                    .collect();
                assert_eq!(got, want, "mode {mode}, address {addr:#x}, {len} bytes");
            }
        }
    }
}

/// A repeated word written from any phase and for any length is the word's bytes in turn; a
/// run of bytes is a repeated word only when every word is the first, the last byte included.
#[test]
fn repeated_words_are_filled_and_recognised_byte_for_byte() {
    let word = 0xa1b2_c3d4u32;
    for phase in 0..4 {
        for len in [0, 1, 3, 4, 7, 64, 1000, 4099] {
            let mut got = vec![0u8; len];
            crate::fill_pattern(&mut got, word, phase);
            let want: Vec<u8> = (0..len).map(|i| word.to_le_bytes()[(phase + i) % 4]).collect();
            assert_eq!(got, want, "phase {phase}, {len} bytes");
        }
    }
    let mut run = vec![0u8; 4096];
    crate::fill_pattern(&mut run, word, 0);
    assert_eq!(crate::uniform_word(&run), Some(word));
    for at in [0, 5, 4095] {
        let mut other = run.clone();
        other[at] ^= 1;
        assert_eq!(crate::uniform_word(&other), None, "a byte changed at {at}");
    }
    assert_eq!(crate::uniform_word(&run[..6]), None, "not whole words");
}
