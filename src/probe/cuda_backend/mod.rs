//! The CUDA backend of the probes: the driver API and cuBLAS through `crate::cuda`. This file
//! holds the GPUs (contexts and kernels, made on first use) and answers `Backend`; the
//! measurements are its `copies.rs`, `memtest.rs` and `gemm.rs`.
//!
//! Copies use the copy engines (`cuMemcpy*Async`); the memory test, the SM copy, the spin gate
//! and the latency chase are the agent's own PTX kernels (`kernels.ptx`, JIT-compiled by the
//! driver: no `nvcc` anywhere); the GEMM uses cuBLAS. Every copy of a sample is queued behind a
//! spin kernel that holds the stream until all are queued, then released, so they run back to
//! back (nvbandwidth's method); CUDA events around the batch time it.
//!
//! The rules this file keeps (each one a defect the strict fake driver caught):
//! - a context is made only on a GPU being probed, when its first probe starts; a busy,
//!   excluded or MIG GPU is never touched;
//! - every buffer comes from `cuMemAlloc`, which peer access covers (pool memory does not);
//! - events are created, recorded and read in the context of the stream they time;
//! - a sticky error (uncorrectable ECC, illegal address) is reported against the GPU whose
//!   context it poisoned (`ProbeError::Sticky`); `run` stops using that GPU and its peers
//!   carry on.

pub mod copies;
pub mod gemm;
mod memtest;

use super::affinity;
use super::allreduce;
use super::backend::{Backend, Half};
use super::kernels::{Gate, Loaded};
use super::levels::LevelParams;
use super::results::{GemmResult, MemtestResult, ProbeError, Run};
use super::targets::DeviceInfo;
use crate::cuda::{self, Ctx, CudaError, Device, Driver};
use std::collections::HashMap;
use std::sync::Arc;

/// Why the probes cannot run at all.
#[derive(Debug, thiserror::Error)]
pub enum Unavailable {
    #[error("libcuda.so was not found: the NVIDIA driver (its CUDA library) is not installed ({0})")]
    NoLibcuda(cuda::LoadError),
    #[error("cuInit failed: {0}")]
    Init(String),
    #[error("CUDA sees no GPU")]
    NoDevice,
}

pub struct CudaBackend {
    drv: Arc<Driver>,
    devices: Vec<Device>,
    /// Contexts of the GPUs probed so far, made on first use.
    contexts: HashMap<usize, Arc<Ctx>>,
    /// Each GPU's PCI address, for its CPUs in sysfs.
    pcis: Vec<String>,
    /// Where each GPU's pinned host buffers were placed (`affinity::Near::placement`).
    placement: HashMap<usize, String>,
    /// Each GPU's probe kernels, loaded on first use; why not, when the driver refused them.
    kernels: HashMap<usize, Result<Loaded, String>>,
    /// Whether cuBLAS started in each GPU's context, or why not (`gemm.rs`): tried once.
    cublas: HashMap<usize, Result<(), String>>,
    /// The level being run, for the memory test's patterns.
    pub level: crate::config::ProbeLevel,
}

/// A driver error as a probe error of `gpu`: sticky ones poison that GPU; a GPU that another
/// process holds in exclusive-process mode cannot be measured (`unknown`).
fn on(gpu: usize) -> impl Fn(CudaError) -> ProbeError {
    move |e| {
        if e.sticky {
            ProbeError::Sticky { gpu, code: e.code, message: e.to_string() }
        } else if e.code == cuda::code::DEVICE_UNAVAILABLE {
            ProbeError::Unavailable(format!(
                "GPU {gpu} refuses a context ({e}): another process holds it in exclusive-process compute mode"
            ))
        } else {
            ProbeError::Cuda(e.to_string())
        }
    }
}

impl CudaBackend {
    /// Loads CUDA and lists its GPUs in PCI order (`main` sets `CUDA_DEVICE_ORDER=PCI_BUS_ID`
    /// before anything loads CUDA, so ordinals are nvidia-smi's indices). No context is made.
    pub fn open() -> Result<(CudaBackend, Vec<DeviceInfo>), Unavailable> {
        let drv = cuda::driver().map_err(Unavailable::NoLibcuda)?;
        let describe = |e: CudaError| crate::collect::cuda::describe(&e);
        drv.init().map_err(|e| Unavailable::Init(describe(e)))?;
        let n = drv.device_count().map_err(|e| Unavailable::Init(describe(e)))?;
        if n == 0 {
            return Err(Unavailable::NoDevice);
        }
        let mut devices = Vec::new();
        let mut info = Vec::new();
        for i in 0..n {
            let d = drv.device(i).map_err(|e| Unavailable::Init(format!("GPU {i}: {}", describe(e))))?;
            info.push(DeviceInfo {
                pci: d
                    .pci_bus_id()
                    .ok()
                    .and_then(|s| crate::collect::nvml::normalize_bus_id(&s))
                    .unwrap_or_else(|| format!("cuda:{i}")),
                compute_mode: d.attribute(cuda::attr::COMPUTE_MODE).unwrap_or(0),
            });
            devices.push(d);
        }
        let pcis = info.iter().map(|d| d.pci.clone()).collect();
        let backend = CudaBackend {
            drv,
            devices,
            contexts: HashMap::new(),
            pcis,
            placement: HashMap::new(),
            kernels: HashMap::new(),
            cublas: HashMap::new(),
            level: crate::config::ProbeLevel::Quick,
        };
        Ok((backend, info))
    }

    /// The GPU's primary context, retained on first use.
    fn ctx(&mut self, gpu: usize) -> Result<Arc<Ctx>, ProbeError> {
        if let Some(c) = self.contexts.get(&gpu) {
            return Ok(c.clone());
        }
        let d = self.devices.get(gpu).ok_or_else(|| ProbeError::Cuda(format!("no CUDA device {gpu}")))?;
        let c = d.retain_context().map_err(on(gpu))?;
        self.contexts.insert(gpu, c.clone());
        Ok(c)
    }

    /// The GPU's context and its probe kernels, loaded (JIT-compiled) on first use. A driver that
    /// cannot compile them (too old for the PTX's version, CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
    /// a JIT failure, CUDA_ERROR_INVALID_PTX) leaves the kernel probes `unknown` with its answer;
    /// a sticky error poisons the GPU as anywhere else.
    fn with_kernels(&mut self, gpu: usize) -> Result<(Arc<Ctx>, &Loaded), ProbeError> {
        let ctx = self.ctx(gpu)?;
        if !self.kernels.contains_key(&gpu) {
            let sms = self.devices[gpu].attribute(cuda::attr::MULTIPROCESSOR_COUNT).unwrap_or(132).max(1) as u32;
            // An unreadable L2 size: the H100's 50 MiB, so the eviction still covers a Hopper L2.
            let l2 = self.devices[gpu].attribute(cuda::attr::L2_CACHE_SIZE).map_or(50 << 20, |b| b.max(0) as usize);
            let loaded = match Loaded::load(&ctx, sms, l2) {
                Ok(k) => Ok(k),
                Err(e) if e.sticky => return Err(on(gpu)(e)),
                Err(e) => Err(format!("the driver could not load the probe kernels: {e}")),
            };
            self.kernels.insert(gpu, loaded);
        }
        match &self.kernels[&gpu] {
            Ok(k) => Ok((ctx, k)),
            Err(why) => Err(ProbeError::Unavailable(why.clone())),
        }
    }
}

impl Backend for CudaBackend {
    fn h2d(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let _near = self.near(gpu);
        self.gated(gpu, |ctx, gate| copies::h2d(ctx, gate, p))
    }

    fn d2h(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let _near = self.near(gpu);
        self.gated(gpu, |ctx, gate| copies::d2h(ctx, gate, p))
    }

    fn bidir(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let _near = self.near(gpu);
        self.gated(gpu, |ctx, gate| copies::bidir(ctx, gate, p))
    }

    fn d2d(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.gated(gpu, |ctx, gate| copies::d2d(ctx, gate, p))
    }

    fn sm_copy(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let (ctx, k) = self.with_kernels(gpu)?;
        let gate = Gate::new(&ctx, k).map_err(on(gpu))?;
        copies::sm_copy(&ctx, k, &gate, p).map_err(on(gpu))
    }

    fn host_latency(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let _near = self.near(gpu);
        let (ctx, k) = self.with_kernels(gpu)?;
        copies::host_latency(&ctx, k, p).map_err(on(gpu))
    }

    /// `copies.rs`.
    fn peer_latency(&mut self, src: usize, dst: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.peer_chase(src, dst, p)
    }

    fn can_access_peer(&mut self, src: usize, dst: usize) -> Result<bool, ProbeError> {
        let (a, b) = (self.devices.get(src), self.devices.get(dst));
        let (Some(a), Some(b)) = (a, b) else {
            return Err(ProbeError::Cuda(format!("no CUDA device {src} or {dst}")));
        };
        a.can_access_peer(b).map_err(on(src))
    }

    /// `copies.rs`: timed, then their data checked on `dst`.
    fn p2p(&mut self, src: usize, dst: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.peer_copies(src, dst, p)
    }

    /// `memtest.rs`.
    fn memory_integrity(&mut self, gpu: usize, p: &LevelParams) -> Result<MemtestResult, ProbeError> {
        self.memtest_one(gpu, p)
    }

    /// `memtest.rs`: every GPU at once.
    fn memory_integrity_all(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
    ) -> Vec<(usize, Result<MemtestResult, ProbeError>)> {
        self.memtest_every(gpus, p)
    }

    /// `gemm.rs`.
    fn gemm(&mut self, gpu: usize, p: &LevelParams) -> Result<GemmResult, ProbeError> {
        self.gemm_fp32(gpu, p)
    }

    /// `gemm.rs`.
    fn gemm_tensor(&mut self, gpu: usize, p: &LevelParams, half: Half) -> Result<GemmResult, ProbeError> {
        self.gemm_half(gpu, p, half)
    }

    /// `gemm.rs`: every GPU at once.
    fn gemm_sustained(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
        secs: f64,
    ) -> Vec<(usize, Result<GemmResult, ProbeError>)> {
        self.gemm_all(gpus, p, secs)
    }

    fn gemm_fp64(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
        secs: f64,
    ) -> Vec<(usize, Result<GemmResult, ProbeError>)> {
        self.gemm_fp64_all(gpus, p, secs)
    }

    /// In a child process (`allreduce::run`). This process lets go of every GPU first: the
    /// all-reduce is the run's last probe, and a GPU in exclusive-process compute mode admits
    /// the child's context only once this process holds none.
    fn allreduce(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
        nvls: bool,
        limit: std::time::Duration,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Run, ProbeError> {
        self.kernels.clear();
        self.cublas.clear();
        self.contexts.clear();
        allreduce::run(gpus, p, nvls, limit, progress)
    }

    fn release(&mut self, gpu: usize) {
        // The module before the context it lives in.
        self.kernels.remove(&gpu);
        self.cublas.remove(&gpu);
        self.contexts.remove(&gpu);
    }

    fn host_placement(&self, gpu: usize) -> Option<String> {
        self.placement.get(&gpu).cloned()
    }
}

impl CudaBackend {
    /// Runs `f` with the GPU's context and a spin gate for its copies — or without a gate when
    /// the kernels cannot load (the copies are then timed as queued, as before nvbandwidth's
    /// method: launch gaps may lower the figure slightly).
    fn gated<T>(
        &mut self,
        gpu: usize,
        f: impl FnOnce(&Arc<Ctx>, Option<&Gate<'_>>) -> cuda::Result<T>,
    ) -> Result<T, ProbeError> {
        match self.with_kernels(gpu) {
            Ok((ctx, k)) => {
                let gate = Gate::new(&ctx, k).map_err(on(gpu))?;
                f(&ctx, Some(&gate)).map_err(on(gpu))
            }
            Err(ProbeError::Unavailable(_)) => {
                let ctx = self.ctx(gpu)?;
                f(&ctx, None).map_err(on(gpu))
            }
            Err(e) => Err(e),
        }
    }

    /// Runs the calling thread near GPU `gpu` while the guard lives, so pinned buffers are
    /// allocated on its NUMA node; remembers where for the report.
    fn near(&mut self, gpu: usize) -> affinity::Near {
        let near = affinity::near(self.pcis.get(gpu).map(String::as_str).unwrap_or(""));
        self.placement.insert(gpu, near.placement.clone());
        near
    }

    /// The driver this backend loaded (for the report).
    pub fn library(&self) -> &std::path::Path {
        &self.drv.file
    }
}
