//! NCCL, loaded at run time with `dlopen` like the driver and cuBLAS: `PHQ_NCCL_LIB`, else
//! `libnccl.so.2` (the soname NVIDIA's `libnccl2` / `libnccl` packages install), else
//! `libnccl.so`. Only what the all-reduce probe calls is bound.
//!
//! NCCL's rules the wrappers keep (NCCL's API reference and user guide, *NCCL*):
//! - `ncclCommInitAll` makes one communicator per device of the list, all in this process; it
//!   cannot be aborted, which is why the probe runs it in a child process (`probe::allreduce`);
//! - one thread driving several communicators groups their calls between `ncclGroupStart` and
//!   `ncclGroupEnd` ("Management Of Multiple GPUs From One Thread"), or the first call blocks
//!   waiting for the other ranks — `Comms::all_reduce_sum_f32` always groups;
//! - each rank's buffers and stream belong to its device (argcheck.cc refuses other devices'
//!   buffers; a stream of another device fails the launch): the caller passes them per rank, and
//!   each stream's context is checked against the rank's device here.

use super::{c_text, cached, Api, DeviceBuffer, LoadError, Loaded, Result, Stream};
use super::{CudaError, Handle};
use libloading::Library;
use std::ffi::{c_char, c_int, c_void};
use std::path::Path;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

api!("NCCL", "NCCL (libnccl.so.2, NVIDIA's collective communications library)", NcclApi {
    ncclGetVersion: fn(*mut c_int) -> c_int;
    ncclGetErrorString: fn(c_int) -> *const c_char;
    ncclCommInitAll: fn(*mut Handle, c_int, *const c_int) -> c_int;
    ncclCommDestroy: fn(Handle) -> c_int;
    ncclGroupStart: fn() -> c_int;
    ncclGroupEnd: fn() -> c_int;
    ncclAllReduce: fn(*const c_void, *mut c_void, usize, c_int, c_int, Handle, Handle) -> c_int;
});

/// The loaded NCCL library.
pub type Nccl = Loaded<NcclApi>;

/// `ncclDataType_t` ncclFloat32 and `ncclRedOp_t` ncclSum (nccl.h).
const NCCL_FLOAT32: c_int = 7;
const NCCL_SUM: c_int = 0;

static NCCL: Mutex<Option<Arc<Nccl>>> = Mutex::new(None);

/// NCCL: `PHQ_NCCL_LIB`, else `libnccl.so.2`, else `libnccl.so`.
pub fn nccl() -> std::result::Result<Arc<Nccl>, LoadError> {
    let candidates = match std::env::var_os("PHQ_NCCL_LIB") {
        Some(p) => vec![PathBuf::from(p)],
        None => vec![PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")],
    };
    cached(&NCCL, &candidates)
}

/// `ncclResult_t` names (nccl.h).
fn result_name(r: c_int) -> &'static str {
    match r {
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => "ncclResult (unknown)",
    }
}

impl Nccl {
    fn check(&self, call: &'static str, r: c_int) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: NCCL answers any code with a static string.
        let text = c_text(unsafe { (self.api.ncclGetErrorString)(r) });
        Err(CudaError { call, code: r, name: result_name(r).into(), text, sticky: false })
    }

    /// `ncclGetVersion` as NCCL writes it: "2.27.3" (2.9 on: major·10000 + minor·100 + patch;
    /// before, major·1000 + minor·100 + patch — nccl.h's NCCL_VERSION).
    pub fn version(&self) -> Result<String> {
        let mut v = 0;
        // SAFETY: the out pointer is a valid local.
        self.check("ncclGetVersion", unsafe { (self.api.ncclGetVersion)(&mut v) })?;
        Ok(if v >= 20900 {
            format!("{}.{}.{}", v / 10000, v % 10000 / 100, v % 100)
        } else {
            format!("{}.{}.{}", v / 1000, v % 1000 / 100, v % 100)
        })
    }

    /// One communicator per CUDA ordinal of `ordinals`, rank i on `ordinals[i]`.
    pub fn init_all(self: &Arc<Self>, ordinals: &[usize]) -> Result<Comms> {
        let list: Vec<c_int> = ordinals.iter().map(|o| *o as c_int).collect();
        let mut comms: Vec<Handle> = vec![std::ptr::null_mut(); list.len()];
        // SAFETY: `comms` has room for one handle per listed device.
        let r = unsafe { (self.api.ncclCommInitAll)(comms.as_mut_ptr(), list.len() as c_int, list.as_ptr()) };
        self.check("ncclCommInitAll", r)?;
        Ok(Comms { nccl: self.clone(), comms, ordinals: ordinals.to_vec() })
    }
}

/// Communicators made together by `ncclCommInitAll`, destroyed together.
pub struct Comms {
    nccl: Arc<Nccl>,
    comms: Vec<Handle>,
    ordinals: Vec<usize>,
}

impl Drop for Comms {
    fn drop(&mut self) {
        for c in &self.comms {
            // SAFETY: each live communicator destroyed once; its work was synchronized by the
            // caller (the buffers and streams it used outlive it in the probe).
            unsafe { (self.nccl.api.ncclCommDestroy)(*c) };
        }
    }
}

/// One rank's part of an all-reduce: what it sends, where it receives, the stream it queues on.
pub struct Part<'a> {
    pub send: &'a DeviceBuffer,
    pub recv: &'a DeviceBuffer,
    pub stream: &'a Stream,
}

impl Comms {
    /// Every rank's `recv` ← the FP32 sum of all ranks' `send` (`count` floats), out of place,
    /// each rank's part queued on its stream, the calls grouped as one thread must.
    pub fn all_reduce_sum_f32(&self, parts: &[Part<'_>], count: usize) -> Result<()> {
        const CALL: &str = "ncclAllReduce";
        if parts.len() != self.comms.len() {
            return Err(usage(CALL, format!("{} parts for {} ranks", parts.len(), self.comms.len())));
        }
        let bytes = count.saturating_mul(4);
        for (rank, p) in parts.iter().enumerate() {
            super::range_ok(CALL, bytes, p.send.len())?;
            super::range_ok(CALL, bytes, p.recv.len())?;
            if p.stream.ctx.ordinal != self.ordinals[rank] {
                return Err(usage(CALL, format!("rank {rank}'s stream is not of GPU {}", self.ordinals[rank])));
            }
        }
        // SAFETY: no pointers.
        self.nccl.check("ncclGroupStart", unsafe { (self.nccl.api.ncclGroupStart)() })?;
        let mut first = Ok(());
        for (p, comm) in parts.iter().zip(&self.comms) {
            // SAFETY: both buffers hold `count` floats on the rank's device (checked above) and
            // outlive the stream's work; the stream is the rank's device's.
            let r = unsafe {
                (self.nccl.api.ncclAllReduce)(
                    p.send.ptr() as *const c_void,
                    p.recv.ptr() as *mut c_void,
                    count,
                    NCCL_FLOAT32,
                    NCCL_SUM,
                    *comm,
                    p.stream.handle,
                )
            };
            if first.is_ok() {
                first = self.nccl.check(CALL, r);
            }
        }
        // The group is closed even after a failed call, so this thread is not left inside one.
        // SAFETY: no pointers.
        let end = self.nccl.check("ncclGroupEnd", unsafe { (self.nccl.api.ncclGroupEnd)() });
        first.and(end)
    }
}

/// A call the wrapper refuses before NCCL sees it, named as NCCL would name it.
fn usage(call: &'static str, text: String) -> CudaError {
    CudaError { call, code: 5, name: result_name(5).into(), text, sticky: false }
}
