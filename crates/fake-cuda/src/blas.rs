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

/// How a GEMM's A and B are stored: FP32 column-major (SGEMM), or BF16 or FP16 with A row-major
/// and B column-major (the agent's tensor-core kernel, `phq_mma_gemm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Inputs {
    F32,
    Bf16RowCol,
    F16RowCol,
    /// BF16, both column-major (cublasGemmEx with CUDA_R_16BF).
    Bf16,
    /// FP16, both column-major (cublasGemmEx with CUDA_R_16F).
    F16,
    /// FP64 column-major A, B and C (cublasDgemm, the agent's `phq_dgemm`), summed in FP64 with
    /// one rounding per step (`fma.rn.f64`).
    F64,
}

impl Inputs {
    fn size(self) -> usize {
        match self {
            Inputs::F64 => 8,
            Inputs::F32 => 4,
            Inputs::Bf16RowCol | Inputs::F16RowCol | Inputs::Bf16 | Inputs::F16 => 2,
        }
    }

    /// Byte offset of element (r, c) of A (`a`) or B, leading dimension `ld`.
    fn at(self, a: bool, r: usize, c: usize, ld: usize) -> usize {
        match (self, a) {
            (Inputs::Bf16RowCol | Inputs::F16RowCol, true) => 2 * (c + r * ld),
            _ => self.size() * (r + c * ld),
        }
    }

    /// The bytes of one entry of C: FP64 for an FP64 GEMM, FP32 for every other.
    pub(crate) fn out_size(self) -> usize {
        if self == Inputs::F64 {
            8
        } else {
            4
        }
    }

    fn value(self, bytes: &[u8], off: usize) -> f32 {
        let half = || u16::from_le_bytes([bytes[off], bytes[off + 1]]);
        match self {
            Inputs::F32 => f32_at(bytes, off),
            // Not reached: an FP64 product is summed by `Pending::entry64`.
            Inputs::F64 => f64_at(bytes, off) as f32,
            Inputs::Bf16RowCol | Inputs::Bf16 => crate::ptx::Half::Bf16.to_f32(half()),
            Inputs::F16 | Inputs::F16RowCol => crate::ptx::Half::F16.to_f32(half()),
        }
    }
}

pub struct Pending {
    inputs: Inputs,
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
    alpha: f64,
    beta: f64,
    /// C's bytes before the GEMM, when β ≠ 0.
    old: Option<Arc<Vec<u8>>>,
    done: Vec<u64>,
    /// Entries not yet computed nor written over.
    left: usize,
    /// The allocation's generation once the GEMM was queued: while it stands, nothing has
    /// written over any entry of C.
    generation: u64,
    /// Entries (row, column) the scenario's faulty GPU computes 1.0 too large.
    wrong: Vec<(usize, usize)>,
}

fn f32_at(bytes: &[u8], off: usize) -> f32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[off..off + 4]);
    f32::from_le_bytes(b)
}

fn f64_at(bytes: &[u8], off: usize) -> f64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[off..off + 8]);
    f64::from_le_bytes(b)
}

impl Pending {
    /// The same product without its bookkeeping (the snapshots are shared).
    fn clone_shallow(&self) -> Pending {
        Pending {
            inputs: self.inputs,
            c_off: self.c_off,
            m: self.m,
            n: self.n,
            k: self.k,
            ldc: self.ldc,
            a: self.a.clone(),
            a_off: self.a_off,
            lda: self.lda,
            b: self.b.clone(),
            b_off: self.b_off,
            ldb: self.ldb,
            alpha: self.alpha,
            beta: self.beta,
            old: self.old.clone(),
            done: Vec::new(),
            left: 0,
            generation: self.generation,
            wrong: self.wrong.clone(),
        }
    }

    /// The entries the scenario's fault makes wrong.
    pub(crate) fn wrong_entries(&self) -> &[(usize, usize)] {
        &self.wrong
    }

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
        let x = self.inputs;
        for p in 0..self.k {
            let a = x.value(&self.a, self.a_off + x.at(true, i, p, self.lda));
            let b = x.value(&self.b, self.b_off + x.at(false, p, j, self.ldb));
            sum += a * b;
        }
        let old = match &self.old {
            Some(o) => self.beta as f32 * f32_at(o, self.c_off + 4 * (i + j * self.ldc)),
            None => 0.0,
        };
        let fault = if self.wrong.contains(&(i, j)) { 1.0 } else { 0.0 };
        self.alpha as f32 * sum + old + fault
    }
    /// An FP64 product's entry: the sum in k order, one fused multiply-add per step, as
    /// `phq_dgemm` adds (`fma.rn.f64`; PTX ISA, "fma": one rounding, to nearest even).
    fn entry64(&self, i: usize, j: usize) -> f64 {
        let mut sum = 0.0f64;
        for p in 0..self.k {
            let a = f64_at(&self.a, self.a_off + 8 * (i + p * self.lda));
            let b = f64_at(&self.b, self.b_off + 8 * (p + j * self.ldb));
            sum = a.mul_add(b, sum);
        }
        let old = match &self.old {
            Some(o) => self.beta * f64_at(o, self.c_off + 8 * (i + j * self.ldc)),
            None => 0.0,
        };
        let fault = if self.wrong.contains(&(i, j)) { 1.0 } else { 0.0 };
        self.alpha * sum + old + fault
    }
    /// Entry (i, j)'s bytes as C holds them.
    fn entry_bytes(&self, i: usize, j: usize) -> Vec<u8> {
        if self.inputs == Inputs::F64 {
            self.entry64(i, j).to_le_bytes().to_vec()
        } else {
            self.entry(i, j).to_le_bytes().to_vec()
        }
    }
    /// The entries (i, j, element index, fully inside) whose bytes meet `[off, off + len)`.
    fn touching(&self, off: usize, len: usize) -> Vec<(usize, usize, usize, bool)> {
        let mut out = Vec::new();
        let end = off + len;
        let es = self.inputs.out_size();
        for j in 0..self.n {
            let col = self.c_off + es * j * self.ldc;
            let col_end = col + es * self.m;
            if col_end <= off || col >= end {
                continue;
            }
            let first = off.saturating_sub(col) / es;
            let last = ((end - col).div_ceil(es)).min(self.m);
            for i in first..last {
                let at = col + es * i;
                out.push((i, j, i + j * self.m, at >= off && at + es <= end));
            }
        }
        out
    }
}

/// A GEMM input scanned for periodicity: its snapshot, (its address, offset), the answer.
pub(crate) type Scanned = (std::sync::Weak<Vec<u8>>, (usize, usize), bool);

/// Whether a rows×cols input's entries (A's when `a`) depend only on row and column modulo `p`.
///
/// Asked of whole runs, not entry by entry: an input is a set of runs, each of entries that
/// lie side by side (a column of a column-major matrix, a row of a row-major one), the runs
/// `ld` entries apart. Its entries depend only on (index in the run mod p, run mod p) exactly
/// when every run equals itself shifted by `p` entries and every run from the `p`th on equals
/// the run `p` before it: then (i, o) = (i, o − p) = … = (i, o mod p) = (i mod p, o mod p). Two
/// memcmps per run where an entry-by-entry scan was a third of a probe test's time (perf).
#[allow(clippy::too_many_arguments)]
fn periodic(x: Inputs, a: bool, bytes: &[u8], off: usize, ld: usize, rows: usize, cols: usize, p: usize) -> bool {
    let size = x.size();
    // Which index runs side by side: the layout `Inputs::at` gives.
    let (inner, outer) = if x.at(a, 1, 0, ld) == size { (rows, cols) } else { (cols, rows) };
    if inner == 0 || outer == 0 {
        return true;
    }
    let run = |o: usize| {
        let start = off + size * o * ld;
        &bytes[start..start + size * inner]
    };
    let shift = size * p.min(inner);
    (0..outer).all(|o| {
        let r = run(o);
        r[shift..] == r[..r.len() - shift] && (o < p || r == run(o - p))
    })
}

/// C's entries as a `p`×`p` table when they repeat with period `p` in both indices: a GEMM of
/// inputs whose entries depend only on row and column modulo `p` (the agent's GEMM inputs do,
/// with 17) and nothing written over C since. Each table entry is the same sum in the same
/// order as `Pending::entry`, so it equals every entry it stands for to the bit. `None` when
/// that cannot be said: the caller then reads C entry by entry.
pub(crate) fn periodic_table(w: &mut World, base: u64, p: usize) -> Option<Vec<f32>> {
    let a = w.allocs.get(&base)?;
    let pd = a.pending.as_ref()?;
    // The table is FP32 (`phq_gemm_check` compares FP32 words): an FP64 product has none.
    if pd.generation != a.generation || pd.old.is_some() || pd.m < p || pd.n < p || pd.inputs == Inputs::F64 {
        return None;
    }
    let key = |m: &Arc<Vec<u8>>, off: usize| (Arc::as_ptr(m) as usize, off);
    let (ka, kb) = (key(&pd.a, pd.a_off), key(&pd.b, pd.b_off));
    let known = |w: &World, k: (usize, usize), m: &Arc<Vec<u8>>| {
        w.periodic
            .iter()
            .find(|(weak, kk, _)| *kk == k && weak.upgrade().is_some_and(|x| Arc::ptr_eq(&x, m)))
            .map(|x| x.2)
    };
    let (am, bm) = (pd.a.clone(), pd.b.clone());
    let (a_ok, b_ok) = (known(w, ka, &am), known(w, kb, &bm));
    let pd = w.allocs.get(&base)?.pending.as_ref()?;
    let a_ok = a_ok.unwrap_or_else(|| periodic(pd.inputs, true, &pd.a, pd.a_off, pd.lda, pd.m, pd.k, p));
    let b_ok = b_ok.unwrap_or_else(|| periodic(pd.inputs, false, &pd.b, pd.b_off, pd.ldb, pd.k, pd.n, p));
    // The table from the sums alone: the scenario's wrong entries are exceptions to it, which
    // the caller takes from `wrong_entries`.
    let clean = Pending { wrong: Vec::new(), done: Vec::new(), old: None, ..pd.clone_shallow() };
    let table = (a_ok && b_ok).then(|| (0..p * p).map(|e| clean.entry(e / p, e % p)).collect());
    w.periodic.retain(|(weak, _, _)| weak.strong_count() > 0);
    w.periodic.push((Arc::downgrade(&am), ka, a_ok));
    w.periodic.push((Arc::downgrade(&bm), kb, b_ok));
    table
}

/// Computes the pending entries of the allocation at `base` that `[off, off + len)` covers.
pub(crate) fn materialise(w: &mut World, base: u64, off: usize, len: usize) {
    let Some(a) = w.allocs.get_mut(&base) else { return };
    let Some(mut p) = a.pending.take() else { return };
    let es = p.inputs.out_size();
    for (i, j, e, _) in p.touching(off, len) {
        if !p.is_done(e) {
            let v = p.entry_bytes(i, j);
            let at = p.c_off + es * (i + j * p.ldc);
            a.write_with(at, es, |d, _| d.copy_from_slice(&v));
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
        let es = p.inputs.out_size();
        for (i, j, e, whole) in p.touching(off, len) {
            if whole {
                p.mark(e);
            } else if !p.is_done(e) {
                partial.push((p.c_off + es * (i + j * p.ldc), es));
            }
        }
        partial
    };
    for (at, es) in partial {
        materialise(w, base, at, es);
    }
}

/// `cublasGetProperty`: MAJOR_VERSION (0), MINOR_VERSION (1) or PATCH_LEVEL (2) of
/// `libraryPropertyType` (library_types.h), from the scenario's `cublas.version`.
///
/// # Safety
/// `value` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cublasGetProperty(kind: c_int, value: *mut c_int) -> Status {
    if value.is_null() {
        return INVALID_VALUE;
    }
    let mut out = NOT_INITIALIZED;
    with(|w| {
        let part = w.scenario.cublas.version.split('.').nth(kind.max(0) as usize).and_then(|p| p.parse().ok());
        out = match (kind, part) {
            (0..=2, Some(v)) => {
                *value = v;
                SUCCESS
            }
            _ => INVALID_VALUE,
        };
        0
    });
    out
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
        // cuBLAS runs on a CUDA runtime of its own, which refuses a driver older than the
        // runtime ("cudaErrorInsufficientDriver: the installed NVIDIA CUDA driver is older than
        // the CUDA runtime library", CUDA runtime API reference, cudaError); cuBLAS answers
        // any error of "the CUDA Runtime API called by the cuBLAS routine" with
        // CUBLAS_STATUS_NOT_INITIALIZED (cuBLAS library guide, cublasStatus_t).
        if w.scenario.cublas.needs_driver_version.is_some_and(|v| w.scenario.driver_version < v) {
            return 0;
        }
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
    let (m, n, k, lda, ldb, ldc) = match dims("cublasSgemm_v2", (transa, transb), (m, n, k), (lda, ldb, ldc)) {
        Ok(d) => d,
        Err(s) => return s,
    };
    let (alpha, beta) = (f64::from(*alpha), f64::from(*beta));
    let mut out = NOT_INITIALIZED;
    with(|w| {
        out = gemm(w, h, Inputs::F32, (m, n, k), alpha, (a, lda), (b, ldb), beta, (c, ldc));
        0
    });
    out
}

/// Column-major DGEMM, checked as cublasSgemm_v2 is (cuBLAS library guide, cublas<t>gemm: the
/// same rules for every type), FP64 throughout, at the scenario's `dgemm_tflops` (on Hopper the
/// FP64 tensor cores: cuBLAS uses them for DGEMM, NVIDIA H100 datasheet "FP64 Tensor Core").
///
/// # Safety
/// `alpha` and `beta` must be readable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cublasDgemm_v2(
    h: Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f64,
    a: CUdeviceptr,
    lda: c_int,
    b: CUdeviceptr,
    ldb: c_int,
    beta: *const f64,
    c: CUdeviceptr,
    ldc: c_int,
) -> Status {
    if alpha.is_null() || beta.is_null() {
        return INVALID_VALUE;
    }
    let (m, n, k, lda, ldb, ldc) = match dims("cublasDgemm_v2", (transa, transb), (m, n, k), (lda, ldb, ldc)) {
        Ok(d) => d,
        Err(s) => return s,
    };
    let (alpha, beta) = (*alpha, *beta);
    let mut out = NOT_INITIALIZED;
    with(|w| {
        out = gemm(w, h, Inputs::F64, (m, n, k), alpha, (a, lda), (b, ldb), beta, (c, ldc));
        0
    });
    out
}

/// A GEMM's shape as cuBLAS checks it: CUBLAS_OP_N only (the fake models no transposes), no
/// negative size, each leading dimension at least its matrix's rows (cuBLAS library guide,
/// cublas<t>gemm: CUBLAS_STATUS_INVALID_VALUE "if m, n, k < 0" or a leading dimension too small).
type Dims = (usize, usize, usize, usize, usize, usize);
fn dims(
    what: &str,
    trans: (c_int, c_int),
    (m, n, k): (c_int, c_int, c_int),
    (lda, ldb, ldc): (c_int, c_int, c_int),
) -> Result<Dims, Status> {
    if trans != (0, 0) {
        eprintln!("fake-cuda: {what}: only CUBLAS_OP_N is modelled");
        return Err(NOT_SUPPORTED);
    }
    if m < 0 || n < 0 || k < 0 || lda < m.max(1) || ldb < k.max(1) || ldc < m.max(1) {
        return Err(INVALID_VALUE);
    }
    Ok((m as usize, n as usize, k as usize, lda as usize, ldb as usize, ldc as usize))
}

/// `cudaDataType_t` values (library_types.h) and the compute type (cublas_api.h).
const CUDA_R_32F: c_int = 0;
const CUDA_R_16F: c_int = 2;
const CUDA_R_16BF: c_int = 14;
const CUBLAS_COMPUTE_32F: c_int = 68;

/// `cublasGemmEx`: C = α·A·B + β·C with A and B in 16 bits and C in FP32, summed in FP32 — the
/// tensor-core GEMM. Only the combinations the cuBLAS library guide lists for
/// CUBLAS_COMPUTE_32F with an FP32 C are accepted (cublasGemmEx, its table of Atype/Btype/Ctype:
/// CUDA_R_16BF or CUDA_R_16F inputs); any other is CUBLAS_STATUS_NOT_SUPPORTED, as the library
/// answers "the combination of the parameters Atype, Btype and Ctype ... is not supported". α
/// and β are FP32 for that compute type. The rate is the scenario's `tensor_tflops`.
///
/// # Safety
/// `alpha` and `beta` must be readable as FP32.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cublasGemmEx(
    h: Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: CUdeviceptr,
    atype: c_int,
    lda: c_int,
    b: CUdeviceptr,
    btype: c_int,
    ldb: c_int,
    beta: *const c_void,
    c: CUdeviceptr,
    ctype: c_int,
    ldc: c_int,
    compute: c_int,
    _algo: c_int,
) -> Status {
    if alpha.is_null() || beta.is_null() {
        return INVALID_VALUE;
    }
    let inputs = match (atype, btype, ctype, compute) {
        (CUDA_R_16BF, CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F) => Inputs::Bf16,
        (CUDA_R_16F, CUDA_R_16F, CUDA_R_32F, CUBLAS_COMPUTE_32F) => Inputs::F16,
        _ => {
            eprintln!(
                "fake-cuda: cublasGemmEx: types A {atype}, B {btype}, C {ctype}, compute {compute} are not modelled"
            );
            return NOT_SUPPORTED;
        }
    };
    let (m, n, k, lda, ldb, ldc) = match dims("cublasGemmEx", (transa, transb), (m, n, k), (lda, ldb, ldc)) {
        Ok(d) => d,
        Err(s) => return s,
    };
    let (alpha, beta) = (f64::from(*(alpha as *const f32)), f64::from(*(beta as *const f32)));
    let mut out = NOT_INITIALIZED;
    with(|w| {
        out = gemm(w, h, inputs, (m, n, k), alpha, (a, lda), (b, ldb), beta, (c, ldc));
        0
    });
    out
}

#[allow(clippy::too_many_arguments)]
fn gemm(
    w: &mut World,
    h: Handle,
    inputs: Inputs,
    (m, n, k): (usize, usize, usize),
    alpha: f64,
    (a, lda): (CUdeviceptr, usize),
    (b, ldb): (CUdeviceptr, usize),
    beta: f64,
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
    let tflops = match inputs {
        Inputs::F32 => w.sgemm_tflops(dev),
        Inputs::F64 => w.spec(dev).dgemm_tflops(),
        _ => w.spec(dev).tensor_tflops,
    };
    match queue(w, ctx, stream, inputs, (m, n, k), alpha, (a, lda), (b, ldb), beta, (c, ldc), tflops) {
        Queued::Done | Queued::Poisoned => SUCCESS,
        Queued::Failed => EXECUTION_FAILED,
    }
}

/// What queueing a GEMM came to.
pub(crate) enum Queued {
    Done,
    /// It touched memory the context may not reach: the context is poisoned, as a faulting
    /// kernel poisons it (the call itself succeeded).
    Poisoned,
    /// The scenario's GEMM fault, or a pointer into no allocation.
    Failed,
}

/// Queues `C = α·A·B + β·C` (C column-major FP32, A and B as `inputs` says) on `stream` of
/// context `ctx` at `tflops`: the lazy product cuBLAS's SGEMM and the agent's own PTX GEMMs
/// leave.
#[allow(clippy::too_many_arguments)]
pub(crate) fn queue(
    w: &mut World,
    ctx: usize,
    stream: usize,
    inputs: Inputs,
    (m, n, k): (usize, usize, usize),
    alpha: f64,
    (a, lda): (CUdeviceptr, usize),
    (b, ldb): (CUdeviceptr, usize),
    beta: f64,
    (c, ldc): (CUdeviceptr, usize),
    tflops: f64,
) -> Queued {
    let Some(dev) = w.ctx_device(ctx) else { return Queued::Failed };
    // The bytes a column-major rows×cols matrix of `size`-byte entries spans; A row-major is
    // its transpose, a cols×rows one.
    let span = |size: usize, ld: usize, rows: usize, cols: usize| (size * (ld * (cols.max(1) - 1) + rows)) as u64;
    let es = inputs.size();
    let row_major = matches!(inputs, Inputs::Bf16RowCol | Inputs::F16RowCol);
    let a_span = if row_major { span(es, lda, k, m) } else { span(es, lda, m, k) };
    let regions = [(a, a_span), (b, span(es, ldb, k, n)), (c, span(inputs.out_size(), ldc, m, n))];
    for (ptr, len) in regions {
        match w.reaches_ptr(ctx, ptr, len) {
            Ok(true) => {}
            Ok(false) | Err(_) => {
                eprintln!("fake-cuda: GEMM: {ptr:#x} is not memory this GPU may access");
                w.poison(dev, ILLEGAL_ADDRESS);
                return Queued::Poisoned;
            }
        }
    }
    if let Err(code) = w.gemm_fault(dev) {
        let _: CUresult = code;
        return Queued::Failed;
    }
    let base_of = |w: &World, p: CUdeviceptr| w.find(p, 1);
    let (Ok((a_base, a_off)), Ok((b_base, b_off)), Ok((c_base, c_off))) = (base_of(w, a), base_of(w, b), base_of(w, c))
    else {
        return Queued::Failed;
    };
    let a_snap = w.snapshot(a_base);
    let b_snap = w.snapshot(b_base);
    let old = (beta != 0.0).then(|| w.snapshot(c_base));
    let pending = Pending {
        inputs,
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
        generation: 0,
        wrong: w.gemm_wrong(dev),
    };
    if let Some(alloc) = w.allocs.get_mut(&c_base) {
        alloc.generation += 1;
        alloc.pending = Some(Pending { generation: alloc.generation, ..pending });
    }
    let secs = 2.0 * (m * n * k) as f64 / (tflops * 1e12);
    w.run_on_sm(stream, dev, secs);
    crate::power::loaded(&w.spec(dev).pci_bus_id, secs, w.spec(dev).power_under_load_w);
    Queued::Done
}

#[cfg(test)]
mod periodic_tests {
    use super::*;

    /// The question asked entry by entry, as it was: the reference the run-wise answer must equal.
    #[allow(clippy::too_many_arguments)]
    fn entrywise(x: Inputs, a: bool, bytes: &[u8], off: usize, ld: usize, rows: usize, cols: usize, p: usize) -> bool {
        let size = x.size();
        let at = |r: usize, c: usize| &bytes[off + x.at(a, r, c, ld)..off + x.at(a, r, c, ld) + size];
        (0..cols).all(|c| (0..rows).all(|r| at(r, c) == at(r % p, c % p)))
    }

    /// Every layout, sizes below, at and above the period, a padded leading dimension, an offset:
    /// a periodic input, and the same with one byte changed at each place in turn (or in the
    /// padding, which no answer may read as an entry).
    #[test]
    fn the_run_wise_answer_is_the_entry_wise_one() {
        let p = 3;
        for x in [Inputs::F32, Inputs::Bf16RowCol, Inputs::F16RowCol, Inputs::Bf16, Inputs::F64] {
            for a in [true, false] {
                for (rows, cols) in [(1, 1), (2, 5), (3, 3), (7, 4), (4, 8), (9, 7)] {
                    let size = x.size();
                    let row_major = x.at(a, 1, 0, 100) != size;
                    let ld = if row_major { cols + 2 } else { rows + 1 };
                    let off = 5;
                    let (outer, inner) = if row_major { (rows, cols) } else { (cols, rows) };
                    let len = off + size * (outer * ld) + 3;
                    let mut bytes = vec![0xeeu8; len];
                    for r in 0..rows {
                        for c in 0..cols {
                            let at = off + x.at(a, r, c, ld);
                            for (k, b) in bytes[at..at + size].iter_mut().enumerate() {
                                *b = (17 * (r % p) + 5 * (c % p) + k) as u8;
                            }
                        }
                    }
                    let case = format!("{x:?} a={a} {rows}x{cols} ld={ld} ({inner} a run)");
                    assert!(periodic(x, a, &bytes, off, ld, rows, cols, p), "{case}: periodic input");
                    for i in 0..len {
                        let mut changed = bytes.clone();
                        changed[i] ^= 0x40;
                        assert_eq!(
                            periodic(x, a, &changed, off, ld, rows, cols, p),
                            entrywise(x, a, &changed, off, ld, rows, cols, p),
                            "{case}: byte {i} changed"
                        );
                    }
                }
            }
        }
    }
}
