//! The unit tests' backend: a simulated HGX with fixed per-GPU bandwidths, an optional bad GPU
//! or sticky ECC error, a peer matrix, and a log of the calls `run` made, so a test can say
//! which GPUs were touched.

use super::backend::{Backend, Half};
use super::cuda_backend::gemm;
use super::levels::LevelParams;
use super::results::{GemmResult, MemtestResult, ProbeError};
use super::targets::Target;

/// A simulated HGX: fixed per-GPU bandwidths, an optional bad GPU, a peer matrix.
pub(super) struct SimGpus {
    pub(super) h2d: Vec<f64>,
    pub(super) peer: bool,
    pub(super) p2p: f64,
    pub(super) bad_memory: Option<usize>,
    /// This GPU meets an uncorrectable ECC error (sticky) in its memory test.
    pub(super) ecc_on: Option<usize>,
    pub(super) no_cublas: bool,
    /// cuBLAS is absent and the agent's own kernels run the GEMM, at the rate an H200 gave them
    /// (docs/hardware-validation.md: phq_sgemm 8.1 TFLOP/s).
    pub(super) own_kernels: bool,
    pub(super) calls: Vec<String>,
}

impl SimGpus {
    pub(super) fn hgx() -> Self {
        SimGpus {
            h2d: vec![55.0; 8],
            peer: true,
            p2p: 370.0,
            bad_memory: None,
            ecc_on: None,
            no_cublas: false,
            own_kernels: false,
            calls: vec![],
        }
    }
}

impl Backend for SimGpus {
    fn h2d(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.calls.push(format!("h2d {gpu}"));
        Ok((0..p.samples).map(|i| self.h2d[gpu] + i as f64 * 0.1).collect())
    }
    fn d2h(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.calls.push(format!("d2h {gpu}"));
        Ok(vec![self.h2d[gpu]; p.samples as usize])
    }
    fn bidir(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        Ok(vec![self.h2d[gpu] * 1.8; p.samples as usize])
    }
    fn d2d(&mut self, _gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        Ok(vec![2900.0; p.samples as usize])
    }
    fn sm_copy(&mut self, _gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        Ok(vec![3000.0; p.samples as usize])
    }
    fn host_latency(&mut self, _gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        Ok(vec![1100.0; p.samples as usize])
    }
    fn peer_latency(&mut self, _a: usize, _b: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        Ok(vec![900.0; p.samples as usize])
    }
    fn can_access_peer(&mut self, _a: usize, _b: usize) -> Result<bool, ProbeError> {
        Ok(self.peer)
    }
    fn release(&mut self, gpu: usize) {
        self.calls.push(format!("release {gpu}"));
    }
    fn p2p(&mut self, src: usize, dst: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.calls.push(format!("p2p {src}->{dst}"));
        Ok(vec![self.p2p; p.samples as usize])
    }
    fn memory_integrity(&mut self, gpu: usize, p: &LevelParams) -> Result<MemtestResult, ProbeError> {
        self.calls.push(format!("memory {gpu}"));
        if self.ecc_on == Some(gpu) {
            return Err(ProbeError::Sticky {
                gpu,
                code: 214,
                message: "cuMemsetD32Async: CUDA_ERROR_ECC_UNCORRECTABLE (214)".into(),
            });
        }
        let bad = self.bad_memory == Some(gpu);
        Ok(MemtestResult {
            bytes_tested: p.memtest_bytes as u64,
            patterns: vec!["0x00000000".into(), "0xffffffff".into()],
            mismatches: if bad { 3 } else { 0 },
            first_mismatch: bad.then(|| (0x1000, "0xfffffffe".into())),
            method: "host read-back".into(),
            chunks: 1,
            seed: None,
            passes: Vec::new(),
            seconds: None,
            ranges: Vec::new(),
        })
    }
    fn gemm(&mut self, gpu: usize, p: &LevelParams) -> Result<GemmResult, ProbeError> {
        self.calls.push(format!("gemm {gpu}"));
        if self.no_cublas {
            return Err(ProbeError::Unavailable(
                "cuBLAS (libcublas.so.12) is not installed: the GEMM probe needs it".into(),
            ));
        }
        let (tflops, library) = if self.own_kernels { (8.0, gemm::PTX_GEMM) } else { (50.0, "cuBLAS SGEMM") };
        Ok(GemmResult {
            n: p.gemm_n,
            tflops_samples: vec![tflops, tflops + 1.0, tflops - 1.0],
            max_rel_error: 0.0,
            checked_entries: 1024,
            wrong_entries: 0,
            library: library.into(),
            checked_on: "host".into(),
            first_wrong: None,
            seconds: 0.1,
            cublas_cannot_start: None,
        })
    }
    fn gemm_tensor(&mut self, gpu: usize, p: &LevelParams, half: Half) -> Result<GemmResult, ProbeError> {
        self.calls.push(format!("gemm_tensor {gpu} {half:?}"));
        Ok(GemmResult {
            n: p.gemm_n,
            tflops_samples: vec![300.0, 301.0, 299.0],
            max_rel_error: 0.0,
            checked_entries: 3 * p.gemm_n * p.gemm_n,
            wrong_entries: 0,
            library: if half == Half::Fp16 { gemm::PTX_MMA_FP16_GEMM } else { gemm::PTX_MMA_GEMM }.into(),
            checked_on: "device".into(),
            first_wrong: None,
            seconds: 0.1,
            cublas_cannot_start: None,
        })
    }
}

/// `n` H100 SXM GPUs at consecutive PCI addresses, every NVLink active.
pub(super) fn targets(n: usize) -> Vec<Target> {
    (0..n)
        .map(|i| Target {
            ordinal: i,
            pci: format!("0000:{:02x}:00.0", 9 + i),
            device_id: Some(0x2330),
            busy_pids: vec![],
            unusable: None,
            nvlinks_active: 18,
            nvlinks_known: true,
            nvlink_peers: None,
            serial: Some(format!("16503240{i:05}")),
            nvlink_remotes: Vec::new(),
            fabric: None,
        })
        .collect()
}
