//! The CUDA driver API and cuBLAS, loaded at run time with `dlopen`, never linked: the agent
//! starts, and says what is missing, on a guest with no driver.
//!
//! Only the calls the agent makes are bound, each by its exported name (the `_v2` names are
//! what `cuda.h` maps the plain names to since CUDA 4.0/11.0). A missing library or symbol is
//! an error naming the file and the symbol; nothing panics.
//!
//! The wrappers keep the driver's rules so callers cannot break them by accident:
//! - every call that works on a context makes that context current on the calling thread first
//!   (the driver API reference: most calls act on "the current context");
//! - a stream, event, buffer or cuBLAS handle holds its context (`Arc<Ctx>`), so the context
//!   is released only after everything made in it is destroyed;
//! - streams are synchronized before they are destroyed, so a buffer dropped after its stream
//!   has no copy in flight.
//!
//! Which library: `--cuda-lib` / `PHQ_CUDA_LIB` (see `use_library`), else `libcuda.so.1`, the
//! name the driver package installs; cuBLAS from `PHQ_CUBLAS_LIB`, else `libcublas.so.12`
//! (CUDA 12's soname), else `libcublas.so.13`, else `libcublas.so`; NCCL beside it in `nccl.rs`.

use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub(super) type Handle = *mut c_void;

/// The `CUresult` values the agent acts on (cuda.h).
pub mod code {
    pub const SUCCESS: i32 = 0;
    pub const OUT_OF_MEMORY: i32 = 2;
    pub const DEVICE_UNAVAILABLE: i32 = 46;
    pub const NO_DEVICE: i32 = 100;
    pub const ECC_UNCORRECTABLE: i32 = 214;
    pub const PEER_ACCESS_ALREADY_ENABLED: i32 = 704;
}

/// `CUdevice_attribute` values (cuda.h).
pub mod attr {
    /// 0 default, 1 exclusive-thread (gone since CUDA 8), 2 prohibited, 3 exclusive-process.
    pub const COMPUTE_MODE: i32 = 20;
    pub const MULTIPROCESSOR_COUNT: i32 = 16;
    pub const L2_CACHE_SIZE: i32 = 38;
    /// "Device supports switch multicast and reduction operations": what NVLink SHARP needs
    /// (NCCL's src/transport/nvls.cc asks it before enabling NVLS).
    pub const MULTICAST_SUPPORTED: i32 = 132;
}

/// Errors after which "the process is left in an inconsistent state and any further CUDA work
/// will return the same error" (driver API reference, `CUresult`, the texts of
/// CUDA_ERROR_ILLEGAL_ADDRESS … CUDA_ERROR_LAUNCH_FAILED); an uncorrectable ECC (214) or NVLink
/// (220) error met by running work poisons its context the same way, and DCGM's diagnostics
/// treat such a GPU as unusable until it is reset.
pub fn is_sticky(code: i32) -> bool {
    matches!(code, 214 | 220 | 700 | 714..=719)
}

/// Why a library could not be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadError {
    #[error("{what} was not found by the dynamic loader (tried {tried}): {reason}")]
    NotFound { what: &'static str, tried: String, reason: String },
    #[error("{file}: has no symbol {symbol}: the library is too old or not {what}")]
    Symbol { what: &'static str, file: String, symbol: &'static str },
}

/// A failed call: which, and the library's own name and text for the code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {name} ({code}){}", if text.is_empty() { String::new() } else { format!(": {text}") })]
pub struct CudaError {
    pub call: &'static str,
    pub code: i32,
    pub name: String,
    pub text: String,
    /// A driver error that poisons the context (`is_sticky`); never a cuBLAS status.
    pub sticky: bool,
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// Declares a table of C functions and how to resolve it from a library.
macro_rules! api {
    ($what:literal, $file:literal, $table:ident { $($name:ident : fn($($arg:ty),*) -> $ret:ty;)* }) => {
        #[allow(non_snake_case)]
        pub struct $table { $($name: unsafe extern "C" fn($($arg),*) -> $ret,)* }

        impl Api for $table {
            const FILE: &'static str = $file;
            unsafe fn from(lib: &Library, file: &Path) -> std::result::Result<Self, LoadError> {
                // SAFETY: the caller keeps `lib` loaded while the table is used.
                unsafe { Self::resolve(lib, file) }
            }
        }

        impl $table {
            /// # Safety
            /// `lib` must stay loaded for as long as the table is used.
            unsafe fn resolve(lib: &Library, file: &Path) -> std::result::Result<Self, LoadError> {
                Ok($table {
                    $($name: *lib
                        .get::<unsafe extern "C" fn($($arg),*) -> $ret>(concat!(stringify!($name), "\0").as_bytes())
                        .map_err(|_| LoadError::Symbol {
                            what: $what,
                            file: file.display().to_string(),
                            symbol: stringify!($name),
                        })?,)*
                })
            }
        }
    };
}

api!("the CUDA driver", "libcuda (the NVIDIA driver's CUDA library)", DriverApi {
    cuInit: fn(c_uint) -> CUresult;
    cuDriverGetVersion: fn(*mut c_int) -> CUresult;
    cuGetErrorName: fn(CUresult, *mut *const c_char) -> CUresult;
    cuGetErrorString: fn(CUresult, *mut *const c_char) -> CUresult;
    cuDeviceGetCount: fn(*mut c_int) -> CUresult;
    cuDeviceGet: fn(*mut CUdevice, c_int) -> CUresult;
    cuDeviceGetPCIBusId: fn(*mut c_char, c_int, CUdevice) -> CUresult;
    cuDeviceGetAttribute: fn(*mut c_int, c_int, CUdevice) -> CUresult;
    cuDeviceCanAccessPeer: fn(*mut c_int, CUdevice, CUdevice) -> CUresult;
    cuDevicePrimaryCtxRetain: fn(*mut Handle, CUdevice) -> CUresult;
    cuDevicePrimaryCtxRelease_v2: fn(CUdevice) -> CUresult;
    cuCtxSetCurrent: fn(Handle) -> CUresult;
    cuCtxEnablePeerAccess: fn(Handle, c_uint) -> CUresult;
    cuStreamCreate: fn(*mut Handle, c_uint) -> CUresult;
    cuStreamDestroy_v2: fn(Handle) -> CUresult;
    cuStreamSynchronize: fn(Handle) -> CUresult;
    cuStreamWaitEvent: fn(Handle, Handle, c_uint) -> CUresult;
    cuEventCreate: fn(*mut Handle, c_uint) -> CUresult;
    cuEventDestroy_v2: fn(Handle) -> CUresult;
    cuEventRecord: fn(Handle, Handle) -> CUresult;
    cuEventElapsedTime: fn(*mut f32, Handle, Handle) -> CUresult;
    cuMemGetInfo_v2: fn(*mut usize, *mut usize) -> CUresult;
    cuMemAlloc_v2: fn(*mut CUdeviceptr, usize) -> CUresult;
    cuMemFree_v2: fn(CUdeviceptr) -> CUresult;
    cuMemHostAlloc: fn(*mut *mut c_void, usize, c_uint) -> CUresult;
    cuMemFreeHost: fn(*mut c_void) -> CUresult;
    cuMemcpyHtoDAsync_v2: fn(CUdeviceptr, *const c_void, usize, Handle) -> CUresult;
    cuMemcpyDtoHAsync_v2: fn(*mut c_void, CUdeviceptr, usize, Handle) -> CUresult;
    cuMemcpyDtoDAsync_v2: fn(CUdeviceptr, CUdeviceptr, usize, Handle) -> CUresult;
    cuMemcpyPeerAsync: fn(CUdeviceptr, Handle, CUdeviceptr, Handle, usize, Handle) -> CUresult;
    cuMemsetD32Async: fn(CUdeviceptr, c_uint, usize, Handle) -> CUresult;
    cuMemHostGetDevicePointer_v2: fn(*mut CUdeviceptr, *mut c_void, c_uint) -> CUresult;
    cuModuleLoadData: fn(*mut Handle, *const c_void) -> CUresult;
    cuModuleUnload: fn(Handle) -> CUresult;
    cuModuleGetFunction: fn(*mut Handle, Handle, *const c_char) -> CUresult;
    cuLaunchKernel: fn(
        Handle, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint,
        c_uint, Handle, *mut *mut c_void, *mut *mut c_void
    ) -> CUresult;
});

api!("cuBLAS", "cuBLAS (libcublas, part of the CUDA toolkit)", BlasApi {
    cublasGetProperty: fn(c_int, *mut c_int) -> c_int;
    cublasCreate_v2: fn(*mut Handle) -> c_int;
    cublasDestroy_v2: fn(Handle) -> c_int;
    cublasSetStream_v2: fn(Handle, Handle) -> c_int;
    cublasSgemm_v2: fn(
        Handle, c_int, c_int, c_int, c_int, c_int,
        *const f32, CUdeviceptr, c_int, CUdeviceptr, c_int,
        *const f32, CUdeviceptr, c_int
    ) -> c_int;
    cublasDgemm_v2: fn(
        Handle, c_int, c_int, c_int, c_int, c_int,
        *const f64, CUdeviceptr, c_int, CUdeviceptr, c_int,
        *const f64, CUdeviceptr, c_int
    ) -> c_int;
    cublasGemmEx: fn(
        Handle, c_int, c_int, c_int, c_int, c_int,
        *const c_void, CUdeviceptr, c_int, c_int, CUdeviceptr, c_int, c_int,
        *const c_void, CUdeviceptr, c_int, c_int, c_int, c_int
    ) -> c_int;
});

/// `cudaDataType_t` (library_types.h): CUDA_R_16BF, CUDA_R_16F and CUDA_R_32F; `cublasComputeType_t`
/// (cublas_api.h): CUBLAS_COMPUTE_32F; `cublasGemmAlgo_t`: CUBLAS_GEMM_DEFAULT.
pub const CUDA_R_16BF: c_int = 14;
pub const CUDA_R_16F: c_int = 2;
pub const CUDA_R_32F: c_int = 0;
pub const CUBLAS_COMPUTE_32F: c_int = 68;
pub const CUBLAS_GEMM_DEFAULT: c_int = -1;

/// `cuMemHostAlloc` flags (cuda.h): memory every context may use, and memory mapped into the
/// device's address space.
pub const CU_MEMHOSTALLOC_PORTABLE: c_uint = 0x01;
pub const CU_MEMHOSTALLOC_DEVICEMAP: c_uint = 0x02;

static CHOSEN: OnceLock<Option<PathBuf>> = OnceLock::new();

/// Names the CUDA library to load instead of `libcuda.so.1` (`--cuda-lib`); the first call
/// wins. A named library also means the CUDA it stands for is asked even under `--sysroot`.
pub fn use_library(path: Option<PathBuf>) {
    let _ = CHOSEN.set(path);
}

/// The library `use_library` named, if any.
pub fn named_library() -> Option<&'static Path> {
    CHOSEN.get().and_then(|p| p.as_deref())
}

/// Loads `candidates` in order; the first that loads wins.
fn open(what: &'static str, candidates: &[PathBuf]) -> std::result::Result<(Library, PathBuf), LoadError> {
    let mut first_reason = None;
    for c in candidates {
        // SAFETY: loading runs the library's initialisers; libcuda and libcublas are the
        // vendor's libraries (or the test double named on purpose) and have no unsound ones.
        match unsafe { Library::new(c) } {
            Ok(lib) => return Ok((lib, c.clone())),
            Err(e) => {
                first_reason.get_or_insert(e.to_string());
            }
        }
    }
    Err(LoadError::NotFound {
        what,
        tried: candidates.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(", "),
        reason: first_reason.unwrap_or_default(),
    })
}

/// A table of C functions the `api!` macro declares.
pub trait Api: Sized {
    /// The library, as a person would look for it.
    const FILE: &'static str;
    /// # Safety
    /// `lib` must stay loaded for as long as the table is used.
    unsafe fn from(lib: &Library, file: &Path) -> std::result::Result<Self, LoadError>;
}

/// A loaded library and its resolved table, kept loaded for the process's life: libcuda does
/// not support being unloaded while it has initialised, and cuBLAS's handles point into it.
pub struct Loaded<A> {
    pub(super) api: A,
    _lib: Library,
    pub file: PathBuf,
}

// SAFETY: the table holds plain function pointers into a library that is never unloaded. The
// driver API is thread-safe (CUDA programming guide, "Thread safety"); a cuBLAS handle is used by
// one thread at a time (`BlasHandle`), which is what cuBLAS asks ("Thread Safety").
unsafe impl<A> Send for Loaded<A> {}
// SAFETY: as above.
unsafe impl<A> Sync for Loaded<A> {}

/// The loaded driver library.
pub type Driver = Loaded<DriverApi>;
/// The loaded cuBLAS library.
pub type Blas = Loaded<BlasApi>;

/// The library in `slot`, loaded from the first of `candidates` that loads on first use; a
/// failure is retried next time (the installer may have put the library there since).
pub(super) fn cached<A: Api>(
    slot: &Mutex<Option<Arc<Loaded<A>>>>,
    candidates: &[PathBuf],
) -> std::result::Result<Arc<Loaded<A>>, LoadError> {
    let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = slot.as_ref() {
        return Ok(d.clone());
    }
    let (lib, file) = open(A::FILE, candidates)?;
    // SAFETY: the library is stored beside the table and never unloaded.
    let api = unsafe { A::from(&lib, &file) }?;
    let d = Arc::new(Loaded { api, _lib: lib, file });
    *slot = Some(d.clone());
    Ok(d)
}

static DRIVER: Mutex<Option<Arc<Driver>>> = Mutex::new(None);

/// The CUDA driver library: `use_library`'s, else `libcuda.so.1`, else `libcuda.so`.
pub fn driver() -> std::result::Result<Arc<Driver>, LoadError> {
    let candidates = match named_library() {
        Some(p) => vec![p.to_path_buf()],
        None => vec![PathBuf::from("libcuda.so.1"), PathBuf::from("libcuda.so")],
    };
    cached(&DRIVER, &candidates)
}

pub(super) fn c_text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the driver's error names and texts are static NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl Driver {
    /// The driver's own name and text for `r`.
    pub fn error(&self, call: &'static str, r: CUresult) -> CudaError {
        let (mut name, mut text) = (std::ptr::null(), std::ptr::null());
        // SAFETY: both out pointers are valid locals; the driver answers these before cuInit.
        let (nr, tr) = unsafe { ((self.api.cuGetErrorName)(r, &mut name), (self.api.cuGetErrorString)(r, &mut text)) };
        let name = if nr == code::SUCCESS { c_text(name) } else { format!("CUDA error {r}") };
        let text = if tr == code::SUCCESS { c_text(text) } else { String::new() };
        CudaError { call, code: r, name, text, sticky: is_sticky(r) }
    }

    fn check(&self, call: &'static str, r: CUresult) -> Result<()> {
        if r == code::SUCCESS {
            Ok(())
        } else {
            Err(self.error(call, r))
        }
    }

    /// `cuDriverGetVersion`: 12040 for CUDA 12.4. Answers before `cuInit`.
    pub fn version(&self) -> Result<i32> {
        let mut v = 0;
        // SAFETY: the out pointer is a valid local.
        self.check("cuDriverGetVersion", unsafe { (self.api.cuDriverGetVersion)(&mut v) })?;
        Ok(v)
    }

    /// `cuInit(0)`; repeating it is harmless.
    pub fn init(&self) -> Result<()> {
        // SAFETY: no pointers.
        self.check("cuInit", unsafe { (self.api.cuInit)(0) })
    }

    /// How many GPUs CUDA sees (in `CUDA_DEVICE_ORDER`, which `main` sets to PCI order).
    pub fn device_count(&self) -> Result<usize> {
        let mut n = 0;
        // SAFETY: the out pointer is a valid local.
        self.check("cuDeviceGetCount", unsafe { (self.api.cuDeviceGetCount)(&mut n) })?;
        Ok(n.max(0) as usize)
    }

    /// The device at `ordinal`: no context is made.
    pub fn device(self: &Arc<Self>, ordinal: usize) -> Result<Device> {
        let mut handle = 0;
        // SAFETY: the out pointer is a valid local.
        self.check("cuDeviceGet", unsafe { (self.api.cuDeviceGet)(&mut handle, ordinal as c_int) })?;
        Ok(Device { drv: self.clone(), ordinal, handle })
    }
}

/// A GPU as CUDA numbers it. Asking about it makes no context.
pub struct Device {
    drv: Arc<Driver>,
    pub ordinal: usize,
    handle: CUdevice,
}

impl Device {
    /// `0000:09:00.0`, lower case as sysfs writes it.
    pub fn pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as c_char; 32];
        // SAFETY: the buffer is as long as declared.
        let r = unsafe { (self.drv.api.cuDeviceGetPCIBusId)(buf.as_mut_ptr(), buf.len() as c_int, self.handle) };
        self.drv.check("cuDeviceGetPCIBusId", r)?;
        Ok(c_text(buf.as_ptr()).to_ascii_lowercase())
    }

    pub fn attribute(&self, attribute: i32) -> Result<i32> {
        let mut v = 0;
        // SAFETY: the out pointer is a valid local.
        let r = unsafe { (self.drv.api.cuDeviceGetAttribute)(&mut v, attribute, self.handle) };
        self.drv.check("cuDeviceGetAttribute", r)?;
        Ok(v)
    }

    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        let mut v = 0;
        // SAFETY: the out pointer is a valid local.
        let r = unsafe { (self.drv.api.cuDeviceCanAccessPeer)(&mut v, self.handle, peer.handle) };
        self.drv.check("cuDeviceCanAccessPeer", r)?;
        Ok(v != 0)
    }

    /// Retains the device's primary context (the one the runtime API shares), released when the
    /// last holder drops it.
    pub fn retain_context(&self) -> Result<Arc<Ctx>> {
        let mut h = std::ptr::null_mut();
        // SAFETY: the out pointer is a valid local.
        let r = unsafe { (self.drv.api.cuDevicePrimaryCtxRetain)(&mut h, self.handle) };
        self.drv.check("cuDevicePrimaryCtxRetain", r)?;
        Ok(Arc::new(Ctx { drv: self.drv.clone(), device: self.handle, ordinal: self.ordinal, handle: h }))
    }
}

/// A retained primary context.
pub struct Ctx {
    drv: Arc<Driver>,
    device: CUdevice,
    /// The CUDA ordinal of its device.
    pub(super) ordinal: usize,
    handle: Handle,
}

// SAFETY: a CUcontext may be made current on any thread (driver API reference,
// cuCtxSetCurrent); every use here binds it first.
unsafe impl Send for Ctx {}
// SAFETY: as above; the driver serialises what it must.
unsafe impl Sync for Ctx {}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: this context was retained once by `retain_context`.
        unsafe { (self.drv.api.cuDevicePrimaryCtxRelease_v2)(self.device) };
    }
}

impl Ctx {
    /// Makes this context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the handle is a live retained context.
        self.drv.check("cuCtxSetCurrent", unsafe { (self.drv.api.cuCtxSetCurrent)(self.handle) })
    }

    /// Lets work in this context reach `peer`'s `cuMemAlloc` memory directly (NVLink or PCIe
    /// P2P). Already enabled is fine.
    pub fn enable_peer_access(&self, peer: &Ctx) -> Result<()> {
        self.bind()?;
        // SAFETY: both handles are live contexts; flags must be 0 (driver API reference).
        let r = unsafe { (self.drv.api.cuCtxEnablePeerAccess)(peer.handle, 0) };
        if r == code::PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        self.drv.check("cuCtxEnablePeerAccess", r)
    }

    /// (free, total) bytes of the device's memory.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: both out pointers are valid locals.
        self.drv.check("cuMemGetInfo", unsafe { (self.drv.api.cuMemGetInfo_v2)(&mut free, &mut total) })?;
        Ok((free, total))
    }

    pub fn stream(self: &Arc<Self>) -> Result<Stream> {
        self.bind()?;
        let mut h = std::ptr::null_mut();
        // SAFETY: the out pointer is a valid local. Flags 1: CU_STREAM_NON_BLOCKING, so the
        // legacy default stream never serialises the probe's streams.
        self.drv.check("cuStreamCreate", unsafe { (self.drv.api.cuStreamCreate)(&mut h, 1) })?;
        Ok(Stream { ctx: self.clone(), handle: h })
    }

    pub fn event(self: &Arc<Self>) -> Result<Event> {
        self.bind()?;
        let mut h = std::ptr::null_mut();
        // SAFETY: the out pointer is a valid local. Flags 0: a timing event.
        self.drv.check("cuEventCreate", unsafe { (self.drv.api.cuEventCreate)(&mut h, 0) })?;
        Ok(Event { ctx: self.clone(), handle: h })
    }

    /// `cuMemAlloc`: ordinary device memory, which `cuCtxEnablePeerAccess` covers (memory from
    /// the stream-ordered pool, `cuMemAllocAsync`, does not: CUDA programming guide, "Stream
    /// Ordered Memory Allocator", peer access).
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer> {
        self.bind()?;
        let mut ptr = 0;
        // SAFETY: the out pointer is a valid local.
        self.drv.check("cuMemAlloc", unsafe { (self.drv.api.cuMemAlloc_v2)(&mut ptr, bytes) })?;
        Ok(DeviceBuffer { ctx: self.clone(), ptr, bytes })
    }

    /// Page-locked host memory, `CU_MEMHOSTALLOC_PORTABLE` as nvbandwidth allocates it (usable
    /// from every context), not write-combined (which the host reads back slowly, and the
    /// memory test reads every byte). Its pages come from the NUMA node of the CPU that touches
    /// them first, the calling thread's: a probe pins the thread near the GPU before calling
    /// this (`probe::affinity`), as nvbandwidth sets the CPU affinity before `cuMemHostAlloc`.
    pub fn pinned(self: &Arc<Self>, bytes: usize) -> Result<PinnedBuffer> {
        self.bind()?;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: the out pointer is a valid local.
        self.drv.check("cuMemHostAlloc", unsafe {
            (self.drv.api.cuMemHostAlloc)(&mut ptr, bytes, CU_MEMHOSTALLOC_PORTABLE)
        })?;
        if ptr.is_null() && bytes > 0 {
            return Err(self.drv.error("cuMemHostAlloc", code::OUT_OF_MEMORY));
        }
        Ok(PinnedBuffer { ctx: self.clone(), ptr: ptr.cast(), bytes, device: None })
    }

    /// Page-locked host memory that kernels read and write directly (`CU_MEMHOSTALLOC_DEVICEMAP`),
    /// through the device pointer `cuMemHostGetDevicePointer` gives (the spin kernel's flag, the
    /// host end of a latency chase). Zeroed.
    pub fn mapped(self: &Arc<Self>, bytes: usize) -> Result<PinnedBuffer> {
        const CU_MEMHOSTALLOC_PORTABLE_DEVICEMAP: c_uint = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP;
        self.bind()?;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: the out pointer is a valid local.
        self.drv.check("cuMemHostAlloc", unsafe {
            (self.drv.api.cuMemHostAlloc)(&mut ptr, bytes, CU_MEMHOSTALLOC_PORTABLE_DEVICEMAP)
        })?;
        if ptr.is_null() {
            return Err(self.drv.error("cuMemHostAlloc", code::OUT_OF_MEMORY));
        }
        let mut buf = PinnedBuffer { ctx: self.clone(), ptr: ptr.cast(), bytes, device: None };
        buf.as_mut_slice().fill(0);
        let mut dev = 0;
        // SAFETY: `ptr` is a live cuMemHostAlloc allocation; flags must be 0 (driver API reference).
        self.drv.check("cuMemHostGetDevicePointer", unsafe {
            (self.drv.api.cuMemHostGetDevicePointer_v2)(&mut dev, ptr, 0)
        })?;
        buf.device = Some(dev);
        Ok(buf)
    }

    /// Loads a PTX module into this context; the driver JIT-compiles it for the GPU
    /// (cuModuleLoadData). A JIT failure is CUDA_ERROR_INVALID_PTX (218) or
    /// CUDA_ERROR_UNSUPPORTED_PTX_VERSION (222, a driver older than the text's `.version`).
    pub fn load_ptx(self: &Arc<Self>, ptx: &str) -> Result<Module> {
        let text = std::ffi::CString::new(ptx).map_err(|_| CudaError {
            call: "cuModuleLoadData",
            code: 1,
            name: "CUDA_ERROR_INVALID_VALUE".into(),
            text: "the PTX text holds a NUL byte".into(),
            sticky: false,
        })?;
        self.bind()?;
        let mut h = std::ptr::null_mut();
        // SAFETY: the out pointer is a valid local; `text` is NUL-terminated and outlives the call.
        self.drv.check("cuModuleLoadData", unsafe { (self.drv.api.cuModuleLoadData)(&mut h, text.as_ptr().cast()) })?;
        Ok(Module { ctx: self.clone(), handle: h })
    }
}

/// A loaded module; its kernels are valid while it lives.
pub struct Module {
    ctx: Arc<Ctx>,
    handle: Handle,
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: a live module, unloaded once; its kernels' launches were synchronized by
            // their streams, which borrow the module's functions and are dropped first.
            unsafe { (self.ctx.drv.api.cuModuleUnload)(self.handle) };
        }
    }
}

impl Module {
    /// The kernel `name` (its `.entry`); CUDA_ERROR_NOT_FOUND (500) when the module has none.
    pub fn function(&self, name: &'static str) -> Result<Function<'_>> {
        let c = std::ffi::CString::new(name).map_err(|_| self.ctx.drv.error("cuModuleGetFunction", 1))?;
        let mut h = std::ptr::null_mut();
        self.ctx.bind()?;
        // SAFETY: live module; `c` is NUL-terminated.
        let r = unsafe { (self.ctx.drv.api.cuModuleGetFunction)(&mut h, self.handle, c.as_ptr()) };
        self.ctx.drv.check("cuModuleGetFunction", r)?;
        Ok(Function { module: self, handle: h, name })
    }
}

/// A kernel of a loaded module.
pub struct Function<'m> {
    module: &'m Module,
    handle: Handle,
    pub name: &'static str,
}

// `Stream::launch` passes a u32 argument as the low half of an 8-byte slot.
const _: () = assert!(cfg!(target_endian = "little"), "kernel arguments are laid out for a little-endian host");

/// One kernel argument, as the `.entry` declares its parameter.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    U32(u32),
    U64(u64),
}

/// Device memory from `cuMemAlloc`.
pub struct DeviceBuffer {
    ctx: Arc<Ctx>,
    ptr: CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer {
    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: allocated by cuMemAlloc in this context and freed once.
            unsafe { (self.ctx.drv.api.cuMemFree_v2)(self.ptr) };
        }
    }
}

/// Page-locked host memory from `cuMemHostAlloc`.
pub struct PinnedBuffer {
    ctx: Arc<Ctx>,
    ptr: *mut u8,
    bytes: usize,
    /// The pointer kernels use, for memory mapped into the device's address space.
    device: Option<CUdeviceptr>,
}

impl PinnedBuffer {
    /// The device pointer of mapped memory (`Ctx::mapped`); `None` for other pinned memory.
    pub fn device_ptr(&self) -> Option<CUdeviceptr> {
        self.device
    }

    /// Reads the 32-bit word at byte `offset` as it is in memory now (a kernel may be writing
    /// it: a volatile read, never cached in a register).
    pub fn read_u32(&self, offset: usize) -> u32 {
        assert!(
            offset + 4 <= self.bytes && offset.is_multiple_of(4),
            "word {offset} outside a {}-byte buffer",
            self.bytes
        );
        // SAFETY: in bounds and aligned (checked above; cuMemHostAlloc returns page-aligned memory).
        unsafe { std::ptr::read_volatile(self.ptr.add(offset).cast::<u32>()) }
    }

    /// Writes the 32-bit word at byte `offset` so a kernel polling it sees it (volatile).
    pub fn write_u32(&self, offset: usize, value: u32) {
        assert!(
            offset + 4 <= self.bytes && offset.is_multiple_of(4),
            "word {offset} outside a {}-byte buffer",
            self.bytes
        );
        // SAFETY: in bounds and aligned (checked above). A kernel may read the word at the same
        // time; a 32-bit aligned store is single-copy atomic on the host and over PCIe.
        unsafe { std::ptr::write_volatile(self.ptr.add(offset).cast::<u32>(), value) }
    }

    /// The bytes. Call only when no copy into the buffer is in flight (its stream synchronized).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` addresses `bytes` bytes for the buffer's life (cuMemHostAlloc), and
        // callers read only after the copies into it completed.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`; `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc and freed once.
            unsafe { (self.ctx.drv.api.cuMemFreeHost)(self.ptr.cast()) };
        }
    }
}

pub struct Event {
    ctx: Arc<Ctx>,
    handle: Handle,
}

impl Event {
    /// Milliseconds from `self` to `end`, both recorded and complete.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        let mut ms = 0.0;
        // SAFETY: both are live events; the out pointer is a valid local.
        let r = unsafe { (self.ctx.drv.api.cuEventElapsedTime)(&mut ms, self.handle, end.handle) };
        self.ctx.drv.check("cuEventElapsedTime", r)?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: a live event destroyed once.
            unsafe { (self.ctx.drv.api.cuEventDestroy_v2)(self.handle) };
        }
    }
}

/// A stream in one context. Every copy on it is asynchronous: the host buffers involved must
/// live, and not be read, until `synchronize` returns (the async copy functions are `unsafe`
/// for that reason).
pub struct Stream {
    pub(super) ctx: Arc<Ctx>,
    pub(super) handle: Handle,
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: a live stream, drained and then destroyed once.
            unsafe {
                (self.ctx.drv.api.cuStreamSynchronize)(self.handle);
                (self.ctx.drv.api.cuStreamDestroy_v2)(self.handle);
            }
        }
    }
}

pub(super) fn range_ok(what: &'static str, bytes: usize, len: usize) -> Result<()> {
    if bytes > len {
        return Err(CudaError {
            call: what,
            code: 1,
            name: "CUDA_ERROR_INVALID_VALUE".into(),
            text: format!("{bytes} bytes do not fit a {len}-byte buffer"),
            sticky: false,
        });
    }
    Ok(())
}

impl Stream {
    pub fn context(&self) -> &Arc<Ctx> {
        &self.ctx
    }

    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: a live stream.
        self.ctx.drv.check("cuStreamSynchronize", unsafe { (self.ctx.drv.api.cuStreamSynchronize)(self.handle) })
    }

    /// Records `ev` on this stream; the event must belong to this stream's context (the driver
    /// answers CUDA_ERROR_INVALID_HANDLE otherwise: driver API reference, cuEventRecord).
    pub fn record(&self, ev: &Event) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: live stream and event.
        self.ctx.drv.check("cuEventRecord", unsafe { (self.ctx.drv.api.cuEventRecord)(ev.handle, self.handle) })
    }

    /// Makes later work on this stream wait for `ev` (which may belong to another context).
    pub fn wait(&self, ev: &Event) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: live stream and event; flags 0.
        self.ctx
            .drv
            .check("cuStreamWaitEvent", unsafe { (self.ctx.drv.api.cuStreamWaitEvent)(self.handle, ev.handle, 0) })
    }

    /// Queues host→device of the first `bytes` of `src` into `dst` at byte `offset`.
    ///
    /// # Safety
    /// `src` must live, unchanged, until this stream is synchronized.
    pub unsafe fn copy_h2d(&self, dst: &DeviceBuffer, offset: usize, src: &PinnedBuffer, bytes: usize) -> Result<()> {
        range_ok("cuMemcpyHtoDAsync", offset.saturating_add(bytes), dst.bytes)?;
        range_ok("cuMemcpyHtoDAsync", bytes, src.bytes)?;
        self.ctx.bind()?;
        // SAFETY: both ranges lie inside live allocations (checked above); the caller keeps
        // `src` alive until the copy completes.
        let r = unsafe {
            (self.ctx.drv.api.cuMemcpyHtoDAsync_v2)(dst.ptr + offset as u64, src.ptr.cast(), bytes, self.handle)
        };
        self.ctx.drv.check("cuMemcpyHtoDAsync", r)
    }

    /// Queues device→host of `bytes` from `src` at byte `offset` into `dst` at `dst_offset`.
    ///
    /// # Safety
    /// `dst` must live, and not be read, until this stream is synchronized.
    pub unsafe fn copy_d2h(
        &self,
        dst: &PinnedBuffer,
        dst_offset: usize,
        src: &DeviceBuffer,
        offset: usize,
        bytes: usize,
    ) -> Result<()> {
        range_ok("cuMemcpyDtoHAsync", offset.saturating_add(bytes), src.bytes)?;
        range_ok("cuMemcpyDtoHAsync", dst_offset.saturating_add(bytes), dst.bytes)?;
        self.ctx.bind()?;
        // SAFETY: both ranges lie inside live allocations (checked above); the caller keeps
        // `dst` alive and unread until the copy completes.
        let r = unsafe {
            (self.ctx.drv.api.cuMemcpyDtoHAsync_v2)(
                dst.ptr.add(dst_offset).cast(),
                src.ptr + offset as u64,
                bytes,
                self.handle,
            )
        };
        self.ctx.drv.check("cuMemcpyDtoHAsync", r)
    }

    /// Queues a copy within one GPU (its copy engines).
    pub fn copy_d2d(&self, dst: &DeviceBuffer, src: &DeviceBuffer, bytes: usize) -> Result<()> {
        range_ok("cuMemcpyDtoDAsync", bytes, dst.bytes.min(src.bytes))?;
        self.ctx.bind()?;
        // SAFETY: both are live device allocations of at least `bytes`.
        let r = unsafe { (self.ctx.drv.api.cuMemcpyDtoDAsync_v2)(dst.ptr, src.ptr, bytes, self.handle) };
        self.ctx.drv.check("cuMemcpyDtoDAsync", r)
    }

    /// Queues a copy from `src` (another GPU's buffer, or this one's) into `dst`. Direct over
    /// NVLink or PCIe only when this stream's context has peer access to the other buffer's;
    /// otherwise the driver stages it through host memory (driver API reference,
    /// cuMemcpyPeerAsync; CUDA programming guide, "Peer-to-Peer Memory Copy").
    pub fn copy_peer(&self, dst: &DeviceBuffer, src: &DeviceBuffer, bytes: usize) -> Result<()> {
        range_ok("cuMemcpyPeerAsync", bytes, dst.bytes.min(src.bytes))?;
        self.ctx.bind()?;
        // SAFETY: both are live device allocations of at least `bytes` in their contexts.
        let r = unsafe {
            (self.ctx.drv.api.cuMemcpyPeerAsync)(dst.ptr, dst.ctx.handle, src.ptr, src.ctx.handle, bytes, self.handle)
        };
        self.ctx.drv.check("cuMemcpyPeerAsync", r)
    }

    /// Queues kernel `f` on this stream: `grid` blocks of `block` threads, one-dimensional, no
    /// dynamic shared memory. Each argument is passed by pointer, as cuLaunchKernel takes them.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number and type, and every pointer among them
    /// must address live memory of the size the kernel touches (device buffers of this context
    /// or its peers, mapped host memory) until this stream is synchronized.
    pub unsafe fn launch(&self, f: &Function<'_>, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        if !Arc::ptr_eq(&f.module.ctx, &self.ctx) {
            return Err(self.ctx.drv.error("cuLaunchKernel", 400));
        }
        // Each value in its own 8-byte slot; the driver reads as many bytes as the parameter's
        // type has (4 for a u32: the low half, first on a little-endian host).
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::U32(v) => u64::from(v),
                Arg::U64(v) => v,
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = slots.iter_mut().map(|s| (s as *mut u64).cast()).collect();
        self.ctx.bind()?;
        // SAFETY: the function and stream are live in this context; `ptrs` points at `slots`,
        // both alive across the call (the driver copies the values at launch); the caller
        // vouches for the pointers inside.
        let r = unsafe {
            (self.ctx.drv.api.cuLaunchKernel)(
                f.handle,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                self.handle,
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.ctx.drv.check("cuLaunchKernel", r)
    }

    /// Queues `words` 32-bit writes of `value` from byte `offset` of `dst` (4-byte aligned).
    pub fn memset_d32(&self, dst: &DeviceBuffer, offset: usize, value: u32, words: usize) -> Result<()> {
        range_ok("cuMemsetD32Async", offset.saturating_add(words.saturating_mul(4)), dst.bytes)?;
        self.ctx.bind()?;
        // SAFETY: the range lies inside a live device allocation (checked above).
        let r = unsafe { (self.ctx.drv.api.cuMemsetD32Async)(dst.ptr + offset as u64, value, words, self.handle) };
        self.ctx.drv.check("cuMemsetD32Async", r)
    }
}

static BLAS: Mutex<Option<Arc<Blas>>> = Mutex::new(None);

/// cuBLAS: `PHQ_CUBLAS_LIB`, else CUDA 12's `libcublas.so.12`, else CUDA 13's `libcublas.so.13`
/// (every call the agent binds is there: the H200 run of docs/hardware-validation.md probed with
/// cuBLAS 13.0), else `libcublas.so`. It ships with the CUDA toolkit, not the driver.
pub fn blas() -> std::result::Result<Arc<Blas>, LoadError> {
    let candidates = match std::env::var_os("PHQ_CUBLAS_LIB") {
        Some(p) => vec![PathBuf::from(p)],
        None => vec![PathBuf::from("libcublas.so.12"), PathBuf::from("libcublas.so.13"), PathBuf::from("libcublas.so")],
    };
    cached(&BLAS, &candidates)
}

/// `libraryPropertyType` (library_types.h): MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL.
pub const LIBRARY_PROPERTIES: [c_int; 3] = [0, 1, 2];

impl Blas {
    /// cuBLAS's own version, "12.9.1" (`cublasGetProperty`, which answers without a handle or a
    /// GPU); `None` when it will not say.
    pub fn version(&self) -> Option<String> {
        let mut parts = Vec::new();
        for p in LIBRARY_PROPERTIES {
            let mut v = 0;
            // SAFETY: the out pointer is a valid local; no handle is needed.
            if unsafe { (self.api.cublasGetProperty)(p, &mut v) } != 0 {
                return None;
            }
            parts.push(v.to_string());
        }
        Some(parts.join("."))
    }
}

/// `cublasStatus_t` names (cublas_api.h).
pub fn blas_status(s: c_int) -> &'static str {
    match s {
        1 => "CUBLAS_STATUS_NOT_INITIALIZED",
        3 => "CUBLAS_STATUS_ALLOC_FAILED",
        7 => "CUBLAS_STATUS_INVALID_VALUE",
        8 => "CUBLAS_STATUS_ARCH_MISMATCH",
        11 => "CUBLAS_STATUS_MAPPING_ERROR",
        13 => "CUBLAS_STATUS_EXECUTION_FAILED",
        14 => "CUBLAS_STATUS_INTERNAL_ERROR",
        15 => "CUBLAS_STATUS_NOT_SUPPORTED",
        16 => "CUBLAS_STATUS_LICENSE_ERROR",
        _ => "CUBLAS_STATUS_UNKNOWN",
    }
}

fn blas_check(call: &'static str, s: c_int) -> Result<()> {
    if s == 0 {
        return Ok(());
    }
    Err(CudaError { call, code: s, name: blas_status(s).into(), text: String::new(), sticky: false })
}

/// A cuBLAS handle bound to one stream (and so one context).
pub struct BlasHandle {
    blas: Arc<Blas>,
    ctx: Arc<Ctx>,
    handle: Handle,
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: a live handle destroyed once, in its context.
            unsafe { (self.blas.api.cublasDestroy_v2)(self.handle) };
        }
    }
}

impl BlasHandle {
    /// A handle in `stream`'s context that queues its work on `stream`.
    pub fn new(blas: &Arc<Blas>, stream: &Stream) -> Result<BlasHandle> {
        stream.ctx.bind()?;
        let mut h = std::ptr::null_mut();
        // SAFETY: the out pointer is a valid local; a context is current, as cublasCreate needs.
        blas_check("cublasCreate", unsafe { (blas.api.cublasCreate_v2)(&mut h) })?;
        let handle = BlasHandle { blas: blas.clone(), ctx: stream.ctx.clone(), handle: h };
        // SAFETY: both handles are live.
        blas_check("cublasSetStream", unsafe { (blas.api.cublasSetStream_v2)(h, stream.handle) })?;
        Ok(handle)
    }

    /// C = A·B for n×n column-major FP32 matrices, queued on the handle's stream.
    pub fn sgemm(&self, n: usize, a: &DeviceBuffer, b: &DeviceBuffer, c: &DeviceBuffer) -> Result<()> {
        let need = n.saturating_mul(n).saturating_mul(4);
        for m in [a, b, c] {
            range_ok("cublasSgemm", need, m.bytes)?;
        }
        self.ctx.bind()?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let n = n as c_int;
        // SAFETY: each matrix holds n×n floats (checked above) in this handle's context; alpha
        // and beta are host scalars (the default pointer mode); 0 = CUBLAS_OP_N.
        let s = unsafe {
            (self.blas.api.cublasSgemm_v2)(self.handle, 0, 0, n, n, n, &alpha, a.ptr, n, b.ptr, n, &beta, c.ptr, n)
        };
        blas_check("cublasSgemm", s)
    }

    /// C = A·B for n×n column-major FP64 matrices, queued on the handle's stream (cuBLAS runs it
    /// on the FP64 tensor cores of an A100 or H100: cuBLAS library guide, "Tensor Core Usage").
    pub fn dgemm(&self, n: usize, a: &DeviceBuffer, b: &DeviceBuffer, c: &DeviceBuffer) -> Result<()> {
        let need = n.saturating_mul(n).saturating_mul(8);
        for m in [a, b, c] {
            range_ok("cublasDgemm", need, m.bytes)?;
        }
        self.ctx.bind()?;
        let (alpha, beta) = (1.0f64, 0.0f64);
        let n = n as c_int;
        // SAFETY: each matrix holds n×n doubles (checked above) in this handle's context; alpha
        // and beta are host scalars (the default pointer mode); 0 = CUBLAS_OP_N.
        let s = unsafe {
            (self.blas.api.cublasDgemm_v2)(self.handle, 0, 0, n, n, n, &alpha, a.ptr, n, b.ptr, n, &beta, c.ptr, n)
        };
        blas_check("cublasDgemm", s)
    }

    /// C = A·B for n×n column-major matrices, A and B BF16 (or FP16: `fp16`), C FP32, summed in
    /// FP32 (`cublasGemmEx` with CUBLAS_COMPUTE_32F: the tensor cores), queued on the handle's
    /// stream.
    pub fn gemm_half(&self, n: usize, a: &DeviceBuffer, b: &DeviceBuffer, c: &DeviceBuffer, fp16: bool) -> Result<()> {
        let input = if fp16 { CUDA_R_16F } else { CUDA_R_16BF };
        let half = n.saturating_mul(n).saturating_mul(2);
        range_ok("cublasGemmEx", half, a.bytes)?;
        range_ok("cublasGemmEx", half, b.bytes)?;
        range_ok("cublasGemmEx", half.saturating_mul(2), c.bytes)?;
        self.ctx.bind()?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let n = n as c_int;
        let (pa, pb) = (&alpha as *const f32 as *const c_void, &beta as *const f32 as *const c_void);
        // SAFETY: A and B hold n×n 16-bit values, C n×n floats (checked above) in this handle's
        // context; alpha and beta are FP32 host scalars, as CUBLAS_COMPUTE_32F reads them.
        let s = unsafe {
            (self.blas.api.cublasGemmEx)(
                self.handle,
                0,
                0,
                n,
                n,
                n,
                pa,
                a.ptr,
                input,
                n,
                b.ptr,
                input,
                n,
                pb,
                c.ptr,
                CUDA_R_32F,
                n,
                CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT,
            )
        };
        blas_check("cublasGemmEx", s)
    }
}
