//! The CUDA backend of the probes (cudarc, libcuda and libcublas loaded at run time).
//!
//! Copies use the copy engines (`cuMemcpy*Async`), patterns use `cuMemsetD32Async`, the GEMM
//! uses cuBLAS: nothing here needs a kernel compiled with `nvcc`. Every copy of a sample is
//! queued before the stream runs them back to back; CUDA events around the batch time it.
//!
//! cudarc panics when libcuda is absent, so `CudaBackend::open` checks `is_culib_present()`
//! first and nothing else here runs without it; cuBLAS is checked the same way before the GEMM.

use super::{Backend, GemmResult, LevelParams, MemtestResult, ProbeError};
use crate::collect::cuda::describe;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError, PinnedHostSlice,
};
use std::sync::Arc;

fn cuda_err(what: &str) -> impl Fn(DriverError) -> ProbeError + '_ {
    move |e| ProbeError::Cuda(format!("{what}: {}", describe(e.0)))
}

pub struct CudaBackend {
    contexts: Vec<Arc<CudaContext>>,
}

/// Why the probes cannot run at all.
#[derive(Debug, thiserror::Error)]
pub enum Unavailable {
    #[error("libcuda.so was not found: the NVIDIA driver (its CUDA library) is not installed")]
    NoLibcuda,
    #[error("cuInit failed: {0}")]
    Init(String),
    #[error("CUDA sees no GPU")]
    NoDevice,
}

impl CudaBackend {
    /// Loads CUDA and opens a context per GPU, in PCI order (`CUDA_DEVICE_ORDER=PCI_BUS_ID`, so
    /// ordinals match nvidia-smi's indices).
    pub fn open() -> Result<(CudaBackend, Vec<String>), Unavailable> {
        // Set before cuInit reads it; the agent has no other thread running CUDA yet.
        std::env::set_var("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
        // SAFETY: only dlopens libcuda under its usual names to see whether it loads.
        if !unsafe { sys::is_culib_present() } {
            return Err(Unavailable::NoLibcuda);
        }
        cudarc::driver::result::init().map_err(|e| Unavailable::Init(describe(e.0)))?;
        let n = CudaContext::device_count().map_err(|e| Unavailable::Init(describe(e.0)))?;
        if n <= 0 {
            return Err(Unavailable::NoDevice);
        }
        let mut contexts = Vec::new();
        let mut pci = Vec::new();
        for i in 0..n as usize {
            let ctx = CudaContext::new(i).map_err(|e| Unavailable::Init(format!("GPU {i}: {}", describe(e.0))))?;
            pci.push(pci_bus_id(&ctx).unwrap_or_else(|| format!("cuda:{i}")));
            contexts.push(ctx);
        }
        Ok((CudaBackend { contexts }, pci))
    }

    fn ctx(&self, gpu: usize) -> Result<&Arc<CudaContext>, ProbeError> {
        self.contexts.get(gpu).ok_or_else(|| ProbeError::Cuda(format!("no CUDA device {gpu}")))
    }
}

/// `0000:09:00.0`, as sysfs writes it.
fn pci_bus_id(ctx: &CudaContext) -> Option<String> {
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: the buffer is 32 bytes as declared; libcuda is loaded (a context exists).
    let r = unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, ctx.cu_device()) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    // SAFETY: cuDeviceGetPCIBusId wrote a NUL-terminated string into the buffer.
    let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
    crate::collect::nvml::normalize_bus_id(&s)
}

fn timing_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent, ProbeError> {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(cuda_err("cuEventCreate"))
}

/// Runs `copies` of `enqueue` per sample on `stream`, timed by events; GB/s per sample for
/// `bytes_per_copy` counted bytes each.
fn timed(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    p: &LevelParams,
    bytes_per_copy: f64,
    mut enqueue: impl FnMut() -> Result<(), ProbeError>,
) -> Result<Vec<f64>, ProbeError> {
    enqueue()?; // warm-up, untimed
    stream.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
    let (start, end) = (timing_event(ctx)?, timing_event(ctx)?);
    let mut out = Vec::new();
    for _ in 0..p.samples {
        start.record(stream).map_err(cuda_err("cuEventRecord"))?;
        for _ in 0..p.copies_per_sample {
            enqueue()?;
        }
        end.record(stream).map_err(cuda_err("cuEventRecord"))?;
        stream.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
        let ms = start.elapsed_ms(&end).map_err(cuda_err("cuEventElapsedTime"))? as f64;
        out.push(bytes_per_copy * p.copies_per_sample as f64 / (ms / 1000.0) / 1e9);
    }
    Ok(out)
}

fn pinned(ctx: &Arc<CudaContext>, bytes: usize) -> Result<PinnedHostSlice<u8>, ProbeError> {
    // SAFETY: the buffer is written (copied into) before it is read. Flags 0: ordinary pinned
    // memory, as nvbandwidth uses (write-combined memory is slow for the host to read back).
    unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }.map_err(cuda_err("cuMemHostAlloc"))
}

fn device<T: cudarc::driver::DeviceRepr>(stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<T>, ProbeError> {
    // SAFETY: every probe fills its device buffers (memset or copy) before reading them.
    unsafe { stream.alloc::<T>(len) }.map_err(cuda_err("cuMemAlloc"))
}

impl Backend for CudaBackend {
    fn h2d(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let ctx = self.ctx(gpu)?.clone();
        let stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        let host = pinned(&ctx, p.buffer_bytes)?;
        let mut dev = device::<u8>(&stream, p.buffer_bytes)?;
        timed(&ctx, &stream, p, p.buffer_bytes as f64, || {
            stream.memcpy_htod(&host, &mut dev).map_err(cuda_err("cuMemcpyHtoDAsync"))
        })
    }

    fn d2h(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let ctx = self.ctx(gpu)?.clone();
        let stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        let mut host = pinned(&ctx, p.buffer_bytes)?;
        let dev = stream.alloc_zeros::<u8>(p.buffer_bytes).map_err(cuda_err("cuMemAlloc"))?;
        timed(&ctx, &stream, p, p.buffer_bytes as f64, || {
            stream.memcpy_dtoh(&dev, &mut host).map_err(cuda_err("cuMemcpyDtoHAsync"))
        })
    }

    fn bidir(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        // Two streams, one per direction, joined by events: the sample's time is the whole
        // batch, its bytes both directions' copies.
        let ctx = self.ctx(gpu)?.clone();
        let (up, down) = (
            ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?,
            ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?,
        );
        let host_up = pinned(&ctx, p.buffer_bytes)?;
        let mut host_down = pinned(&ctx, p.buffer_bytes)?;
        let mut dev_up = device::<u8>(&up, p.buffer_bytes)?;
        let dev_down = down.alloc_zeros::<u8>(p.buffer_bytes).map_err(cuda_err("cuMemAlloc"))?;
        let (start, mid, end) = (timing_event(&ctx)?, timing_event(&ctx)?, timing_event(&ctx)?);
        let mut out = Vec::new();
        for _ in 0..p.samples {
            start.record(&up).map_err(cuda_err("cuEventRecord"))?;
            down.wait(&start).map_err(cuda_err("cuStreamWaitEvent"))?;
            for _ in 0..p.copies_per_sample {
                up.memcpy_htod(&host_up, &mut dev_up).map_err(cuda_err("cuMemcpyHtoDAsync"))?;
                down.memcpy_dtoh(&dev_down, &mut host_down).map_err(cuda_err("cuMemcpyDtoHAsync"))?;
            }
            mid.record(&down).map_err(cuda_err("cuEventRecord"))?;
            up.wait(&mid).map_err(cuda_err("cuStreamWaitEvent"))?;
            end.record(&up).map_err(cuda_err("cuEventRecord"))?;
            up.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
            let ms = start.elapsed_ms(&end).map_err(cuda_err("cuEventElapsedTime"))? as f64;
            out.push(2.0 * p.buffer_bytes as f64 * p.copies_per_sample as f64 / (ms / 1000.0) / 1e9);
        }
        Ok(out)
    }

    fn d2d(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let ctx = self.ctx(gpu)?.clone();
        let stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        let src = stream.alloc_zeros::<u8>(p.buffer_bytes).map_err(cuda_err("cuMemAlloc"))?;
        let mut dst = device::<u8>(&stream, p.buffer_bytes)?;
        // A device copy reads and writes every byte: count both, as the reference figures do.
        timed(&ctx, &stream, p, 2.0 * p.buffer_bytes as f64, || {
            stream.memcpy_dtod(&src, &mut dst).map_err(cuda_err("cuMemcpyDtoDAsync"))
        })
    }

    fn can_access_peer(&mut self, src: usize, dst: usize) -> Result<bool, ProbeError> {
        let (a, b) = (self.ctx(src)?, self.ctx(dst)?);
        let mut can = 0;
        // SAFETY: both devices come from live contexts; the out pointer is a valid local.
        let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(ProbeError::Cuda(format!("cuDeviceCanAccessPeer: {}", describe(r))));
        }
        Ok(can != 0)
    }

    fn p2p(&mut self, src: usize, dst: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let (a, b) = (self.ctx(src)?.clone(), self.ctx(dst)?.clone());
        a.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: `b` is a live context; enabling twice answers PEER_ACCESS_ALREADY_ENABLED.
        let r = unsafe { sys::cuCtxEnablePeerAccess(b.cu_ctx(), 0) };
        if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Err(ProbeError::Cuda(format!("cuCtxEnablePeerAccess: {}", describe(r))));
        }
        let stream = a.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        let from = stream.alloc_zeros::<u8>(p.buffer_bytes).map_err(cuda_err("cuMemAlloc"))?;
        let b_stream = b.default_stream();
        let mut to = device::<u8>(&b_stream, p.buffer_bytes)?;
        b_stream.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
        let (a_ctx, b_ctx) = (a.cu_ctx(), b.cu_ctx());
        let bytes = p.buffer_bytes;
        timed(&a, &stream, p, bytes as f64, || {
            let (src_ptr, _s) = from.device_ptr(&stream);
            let (dst_ptr, _d) = to.device_ptr_mut(&stream);
            // SAFETY: both buffers are live allocations of `bytes` bytes in their contexts, and
            // peer access from `a` to `b` was enabled above.
            unsafe {
                cudarc::driver::result::memcpy_peer_async(b_ctx, dst_ptr, a_ctx, src_ptr, bytes, stream.cu_stream())
            }
            .map_err(cuda_err("cuMemcpyPeerAsync"))
        })
    }

    fn memory_integrity(&mut self, gpu: usize, p: &LevelParams) -> Result<MemtestResult, ProbeError> {
        const PATTERNS: [u32; 4] = [0x0000_0000, 0xFFFF_FFFF, 0xAAAA_AAAA, 0x5555_5555];
        let ctx = self.ctx(gpu)?.clone();
        let stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        let (free, _) = {
            ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
            cudarc::driver::result::mem_get_info().map_err(cuda_err("cuMemGetInfo"))?
        };
        // Leave room for the driver and other buffers: at most 90% of what is free.
        let bytes = p.memtest_bytes.min(free / 10 * 9) & !(4095);
        let words = bytes / 4;
        let chunk_words = (64 << 20) / 4;
        let dev = device::<u32>(&stream, words)?;
        // SAFETY: the host buffer is only read after a copy into it completed.
        let mut host =
            unsafe { ctx.alloc_pinned_with_flags::<u32>(chunk_words, 0) }.map_err(cuda_err("cuMemHostAlloc"))?;
        let mut mismatches = 0u64;
        let mut first = None;
        for pattern in PATTERNS {
            {
                let (ptr, _w) = dev.device_ptr(&stream);
                // SAFETY: `ptr` addresses `words` u32s of a live allocation on this stream's device.
                let r = unsafe { sys::cuMemsetD32Async(ptr, pattern, words, stream.cu_stream()) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    return Err(ProbeError::Cuda(format!("cuMemsetD32Async: {}", describe(r))));
                }
            }
            let mut off = 0;
            while off < words {
                let n = chunk_words.min(words - off);
                let view = dev.slice(off..off + n);
                stream.memcpy_dtoh(&view, &mut host).map_err(cuda_err("cuMemcpyDtoHAsync"))?;
                stream.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
                let got = host.as_slice().map_err(cuda_err("pinned buffer"))?;
                for (i, w) in got[..n].iter().enumerate().filter(|(_, w)| **w != pattern) {
                    mismatches += 1;
                    if first.is_none() {
                        first = Some((((off + i) * 4) as u64, format!("{w:#010x} for {pattern:#010x}")));
                    }
                }
                off += n;
            }
        }
        Ok(MemtestResult {
            bytes_tested: bytes as u64,
            patterns: PATTERNS.iter().map(|p| format!("{p:#010x}")).collect(),
            mismatches,
            first_mismatch: first,
        })
    }

    fn gemm(&mut self, gpu: usize, p: &LevelParams) -> Result<GemmResult, ProbeError> {
        // SAFETY: only dlopens libcublas under its usual names to see whether it loads.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(ProbeError::Unavailable(
                "cuBLAS (libcublas.so) is not installed; the GEMM probe needs it (it ships with the CUDA toolkit)"
                    .into(),
            ));
        }
        let ctx = self.ctx(gpu)?.clone();
        let stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| ProbeError::Cuda(format!("cublasCreate: {e:?}")))?;
        let n = p.gemm_n;
        // Small integers are exact in FP32 and so are their sums of products (< 2^24 for
        // n ≤ 16384 and |values| ≤ 2), so the GPU must match the host reference exactly.
        let value = |i: usize, k: usize, salt: usize| ((i * 7 + k * 3 + salt) % 5) as f32 - 2.0;
        let a_host: Vec<f32> = (0..n * n).map(|x| value(x % n, x / n, 1)).collect();
        let b_host: Vec<f32> = (0..n * n).map(|x| value(x % n, x / n, 2)).collect();
        let a = stream.clone_htod(&a_host).map_err(cuda_err("cuMemcpyHtoD"))?;
        let b = stream.clone_htod(&b_host).map_err(cuda_err("cuMemcpyHtoD"))?;
        let mut c = stream.alloc_zeros::<f32>(n * n).map_err(cuda_err("cuMemAlloc"))?;
        let ni = n as i32;
        let cfg = GemmConfig {
            transa: cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
            transb: cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
            m: ni,
            n: ni,
            k: ni,
            alpha: 1.0f32,
            lda: ni,
            ldb: ni,
            beta: 0.0f32,
            ldc: ni,
        };
        let run = |c: &mut CudaSlice<f32>| -> Result<(), ProbeError> {
            // SAFETY: a, b and c hold n×n f32 each, matching the dimensions in `cfg`.
            unsafe { blas.gemm(cfg, &a, &b, c) }.map_err(|e| ProbeError::Cuda(format!("cublasSgemm: {e:?}")))
        };
        run(&mut c)?; // warm-up, and the result that is checked
        stream.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
        let c_host = stream.clone_dtoh(&c).map_err(cuda_err("cuMemcpyDtoH"))?;
        let mut checked = 0;
        let mut max_rel = 0.0f64;
        for s in 0..1024usize {
            let (i, j) = ((s * 7919) % n, (s * 104_729) % n);
            let reference: f64 = (0..n).map(|k| a_host[i + k * n] as f64 * b_host[k + j * n] as f64).sum();
            let got = c_host[i + j * n] as f64;
            max_rel = max_rel.max((got - reference).abs() / reference.abs().max(1.0));
            checked += 1;
        }
        let (start, end) = (timing_event(&ctx)?, timing_event(&ctx)?);
        let mut tflops = Vec::new();
        for _ in 0..3 {
            start.record(&stream).map_err(cuda_err("cuEventRecord"))?;
            for _ in 0..p.gemm_reps {
                run(&mut c)?;
            }
            end.record(&stream).map_err(cuda_err("cuEventRecord"))?;
            stream.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
            let ms = start.elapsed_ms(&end).map_err(cuda_err("cuEventElapsedTime"))? as f64;
            tflops.push(2.0 * (n as f64).powi(3) * p.gemm_reps as f64 / (ms / 1000.0) / 1e12);
        }
        Ok(GemmResult {
            n,
            tflops_samples: tflops,
            max_rel_error: max_rel,
            checked_entries: checked,
            library: "cuBLAS SGEMM".into(),
        })
    }
}
