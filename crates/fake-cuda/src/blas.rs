//! The cuBLAS calls the agent's GEMM makes, answered by the same library (a test points the
//! agent's cuBLAS at this file too). SGEMM is column-major `C = α·A·B + β·C` (cuBLAS library
//! guide, cublas<t>gemm).
//!
//! A GEMM is a kernel: its entries are exact FP32 arithmetic, but computing an 8192³ product
//! on a test machine's CPU would take minutes, so the result is *lazy*: the inputs are
//! snapshotted when the GEMM is queued (what the GPU would read), and each entry of C is
//! computed when something first reads it (a copy back, another GEMM). Reading every entry
//! costs what the whole product costs; reading a sample costs a sample. Entries written over
//! before they are read are never computed. The figures are the same as an eager product's.

use crate::codes::{CUresult, ILLEGAL_ADDRESS};
use crate::{with, CUdeviceptr, Handle, World};
use std::ffi::{c_int, c_void};
use std::sync::Arc;

pub type Status = c_int;
pub const SUCCESS: Status = 0;
pub const NOT_INITIALIZED: Status = 1;
pub const INVALID_VALUE: Status = 7;
pub const EXECUTION_FAILED: Status = 13;
pub const NOT_SUPPORTED: Status = 15;

pub struct BlasHandle {
    pub ctx: usize,
    /// 0: the context's default stream.
    pub stream: usize,
}

pub struct Pending {
    /// Byte offset of C(0,0) in its allocation.
    c_off: usize,
    m: usize,
    n: usize,
    k: usize,
    ldc: usize,
    a: Arc<Vec<u8>>,
    a_off: usize,
    lda: usize,
    b: Arc<Vec<u8>>,
    b_off: usize,
    ldb: usize,
    alpha: f32,
    beta: f32,
    /// C's bytes before the GEMM, when β ≠ 0.
    old: Option<Arc<Vec<u8>>>,
    done: Vec<u64>,
    /// Entries not yet computed nor written over.
    left: usize,
}

fn f32_at(bytes: &[u8], off: usize) -> f32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[off..off + 4]);
    f32::from_le_bytes(b)
}

impl Pending {
    fn is_done(&self, e: usize) -> bool {
        self.done[e / 64] & (1 << (e % 64)) != 0
    }
    fn mark(&mut self, e: usize) {
        if !self.is_done(e) {
            self.done[e / 64] |= 1 << (e % 64);
            self.left -= 1;
        }
    }
    fn entry(&self, i: usize, j: usize) -> f32 {
        let mut sum = 0.0f32;
        for p in 0..self.k {
            let a = f32_at(&self.a, self.a_off + 4 * (i + p * self.lda));
            let b = f32_at(&self.b, self.b_off + 4 * (p + j * self.ldb));
            sum += a * b;
        }
        let old = match &self.old {
            Some(o) => self.beta * f32_at(o, self.c_off + 4 * (i + j * self.ldc)),
            None => 0.0,
        };
        self.alpha * sum + old
    }
    /// The entries (i, j, element index, fully inside) whose bytes meet `[off, off + len)`.
    fn touching(&self, off: usize, len: usize) -> Vec<(usize, usize, usize, bool)> {
        let mut out = Vec::new();
        let end = off + len;
        for j in 0..self.n {
            let col = self.c_off + 4 * j * self.ldc;
            let col_end = col + 4 * self.m;
            if col_end <= off || col >= end {
                continue;
            }
            let first = off.saturating_sub(col) / 4;
            let last = ((end - col).div_ceil(4)).min(self.m);
            for i in first..last {
                let at = col + 4 * i;
                out.push((i, j, i + j * self.m, at >= off && at + 4 <= end));
            }
        }
        out
    }
}

/// Computes the pending entries of the allocation at `base` that `[off, off + len)` covers.
pub(crate) fn materialise(w: &mut World, base: u64, off: usize, len: usize) {
    let Some(a) = w.allocs.get_mut(&base) else { return };
    let Some(mut p) = a.pending.take() else { return };
    for (i, j, e, _) in p.touching(off, len) {
        if !p.is_done(e) {
            let v = p.entry(i, j);
            let at = p.c_off + 4 * (i + j * p.ldc);
            a.bytes_mut()[at..at + 4].copy_from_slice(&v.to_le_bytes());
            p.mark(e);
        }
    }
    if p.left > 0 {
        a.pending = Some(p);
    }
}

/// About to write `[off, off + len)`: entries written whole need never be computed; an entry
/// written in part is computed first.
pub(crate) fn overwrite(w: &mut World, base: u64, off: usize, len: usize) {
    let partial = {
        let Some(p) = w.allocs.get_mut(&base).and_then(|a| a.pending.as_mut()) else { return };
        let mut partial = Vec::new();
        for (i, j, e, whole) in p.touching(off, len) {
            if whole {
                p.mark(e);
            } else if !p.is_done(e) {
                partial.push(p.c_off + 4 * (i + j * p.ldc));
            }
        }
        partial
    };
    for at in partial {
        materialise(w, base, at, 4);
    }
}

/// # Safety
/// `h` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cublasCreate_v2(h: *mut Handle) -> Status {
    if h.is_null() {
        return INVALID_VALUE;
    }
    let mut out = NOT_INITIALIZED;
    with(|w| {
        if let Ok(ctx) = w.current_ctx_pub() {
            let id = w.new_handle();
            w.blas.insert(id, BlasHandle { ctx, stream: 0 });
            *h = id as Handle;
            out = SUCCESS;
        }
        0
    });
    out
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cublasDestroy_v2(h: Handle) -> Status {
    let mut out = NOT_INITIALIZED;
    with(|w| {
        if w.blas.remove(&(h as usize)).is_some() {
            out = SUCCESS;
        }
        0
    });
    out
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cublasSetStream_v2(h: Handle, s: Handle) -> Status {
    let mut out = NOT_INITIALIZED;
    with(|w| {
        let exists = s.is_null() || w.stream_exists(s as usize);
        if let Some(b) = w.blas.get_mut(&(h as usize)) {
            out = if exists {
                b.stream = s as usize;
                SUCCESS
            } else {
                INVALID_VALUE
            };
        }
        0
    });
    out
}

/// # Safety
/// `s` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cublasGetStream_v2(h: Handle, s: *mut Handle) -> Status {
    if s.is_null() {
        return INVALID_VALUE;
    }
    let mut out = NOT_INITIALIZED;
    with(|w| {
        if let Some(b) = w.blas.get(&(h as usize)) {
            *s = b.stream as Handle;
            out = SUCCESS;
        }
        0
    });
    out
}

/// Host pointer mode only (α and β read from host memory), which is cuBLAS's default.
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cublasSetPointerMode_v2(h: Handle, mode: c_int) -> Status {
    if mode != 0 {
        return NOT_SUPPORTED;
    }
    cublas_known(h)
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cublasSetMathMode(h: Handle, _mode: c_int) -> Status {
    cublas_known(h)
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cublasSetWorkspace_v2(h: Handle, _ws: *mut c_void, _bytes: usize) -> Status {
    cublas_known(h)
}

fn cublas_known(h: Handle) -> Status {
    let mut out = NOT_INITIALIZED;
    with(|w| {
        if w.blas.contains_key(&(h as usize)) {
            out = SUCCESS;
        }
        0
    });
    out
}

/// Column-major SGEMM. Arguments as cuBLAS checks them (cuBLAS guide, cublas<t>gemm: "m, n,
/// k < 0" or a leading dimension too small is CUBLAS_STATUS_INVALID_VALUE). The kernel reads
/// A and B and writes C on the handle's GPU: a pointer no allocation holds, or memory of
/// another GPU this context has no access to, is an illegal address, a sticky error of the
/// context, seen by the next call (the launch itself succeeds; DRV, `CUresult`,
/// CUDA_ERROR_ILLEGAL_ADDRESS).
///
/// # Safety
/// `alpha` and `beta` must be readable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cublasSgemm_v2(
    h: Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: CUdeviceptr,
    lda: c_int,
    b: CUdeviceptr,
    ldb: c_int,
    beta: *const f32,
    c: CUdeviceptr,
    ldc: c_int,
) -> Status {
    if alpha.is_null() || beta.is_null() {
        return INVALID_VALUE;
    }
    if transa != 0 || transb != 0 {
        eprintln!("fake-cuda: cublasSgemm_v2: only CUBLAS_OP_N is modelled");
        return NOT_SUPPORTED;
    }
    if m < 0 || n < 0 || k < 0 || lda < m.max(1) || ldb < k.max(1) || ldc < m.max(1) {
        return INVALID_VALUE;
    }
    let (m, n, k, lda, ldb, ldc) = (m as usize, n as usize, k as usize, lda as usize, ldb as usize, ldc as usize);
    let (alpha, beta) = (*alpha, *beta);
    let mut out = NOT_INITIALIZED;
    with(|w| {
        out = sgemm(w, h, m, n, k, alpha, (a, lda), (b, ldb), beta, (c, ldc));
        0
    });
    out
}

#[allow(clippy::too_many_arguments)]
fn sgemm(
    w: &mut World,
    h: Handle,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    (a, lda): (CUdeviceptr, usize),
    (b, ldb): (CUdeviceptr, usize),
    beta: f32,
    (c, ldc): (CUdeviceptr, usize),
) -> Status {
    let Some(handle) = w.blas.get(&(h as usize)) else { return NOT_INITIALIZED };
    let ctx = handle.ctx;
    let Some(dev) = w.ctx_device(ctx) else { return NOT_INITIALIZED };
    let stream = if handle.stream == 0 { w.default_stream_of(ctx).unwrap_or(0) } else { handle.stream };
    if w.healthy_dev(dev).is_err() {
        return EXECUTION_FAILED;
    }
    if m == 0 || n == 0 {
        return SUCCESS;
    }
    let span = |ld: usize, rows: usize, cols: usize| (4 * (ld * (cols.max(1) - 1) + rows)) as u64;
    let regions = [(a, span(lda, m, k)), (b, span(ldb, k, n)), (c, span(ldc, m, n))];
    for (ptr, len) in regions {
        match w.reaches_ptr(ctx, ptr, len) {
            Ok(true) => {}
            Ok(false) | Err(_) => {
                eprintln!("fake-cuda: cublasSgemm_v2: {ptr:#x} is not memory this GPU may access");
                w.poison(dev, ILLEGAL_ADDRESS);
                return SUCCESS;
            }
        }
    }
    if let Err(code) = w.gemm_fault(dev) {
        let _: CUresult = code;
        return EXECUTION_FAILED;
    }
    let base_of = |w: &World, p: CUdeviceptr| w.find(p, 1);
    let (Ok((a_base, a_off)), Ok((b_base, b_off)), Ok((c_base, c_off))) = (base_of(w, a), base_of(w, b), base_of(w, c))
    else {
        return EXECUTION_FAILED;
    };
    let a_snap = w.snapshot(a_base);
    let b_snap = w.snapshot(b_base);
    let old = (beta != 0.0).then(|| w.snapshot(c_base));
    let pending = Pending {
        c_off,
        m,
        n,
        k,
        ldc,
        a: a_snap,
        a_off,
        lda,
        b: b_snap,
        b_off,
        ldb,
        alpha,
        beta,
        old,
        done: vec![0; (m * n).div_ceil(64)],
        left: m * n,
    };
    if let Some(alloc) = w.allocs.get_mut(&c_base) {
        alloc.pending = Some(pending);
        alloc.generation += 1;
    }
    let secs = 2.0 * (m * n * k) as f64 / (w.sgemm_tflops(dev) * 1e12);
    w.run_on_sm(stream, dev, secs);
    SUCCESS
}
