//! What a board draws while the fake CUDA driver in the same process runs GEMMs on it. A real
//! board's sensor sees the GPU's work; here only the fake CUDA knows that work, and it exports
//! `phq_fake_cuda_load_mw` (`crates/fake-cuda/src/power.rs`) for this module to ask.
//!
//! The agent loads libcuda with `RTLD_LOCAL` (libloading), so the symbol is not global: the
//! loaded objects are walked (`dl_iterate_phdr`, dl_iterate_phdr(3)), the one whose file is a
//! libcuda opened again without loading (`RTLD_NOLOAD`, dlopen(3): "Don't load the shared
//! object … a handle for an object already resident") and the symbol looked up in it. A process
//! without the fake CUDA (a real libcuda, or none) answers -1: the scenario's power stands.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

/// The first two fields of `struct dl_phdr_info` (link.h); the rest is never read.
#[repr(C)]
struct DlPhdrInfo {
    addr: usize,
    name: *const c_char,
}

extern "C" {
    fn dl_iterate_phdr(
        callback: unsafe extern "C" fn(*mut DlPhdrInfo, usize, *mut c_void) -> c_int,
        data: *mut c_void,
    ) -> c_int;
    fn dlopen(file: *const c_char, mode: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void;
}

/// dlfcn.h (glibc): `RTLD_LAZY` 0x1, `RTLD_NOLOAD` 0x4.
const RTLD_LAZY: c_int = 0x1;
const RTLD_NOLOAD: c_int = 0x4;

type LoadFn = unsafe extern "C" fn(*const c_char) -> i64;

unsafe extern "C" fn each(info: *mut DlPhdrInfo, _size: usize, data: *mut c_void) -> c_int {
    let found = &mut *(data as *mut Option<CString>);
    if info.is_null() || (*info).name.is_null() {
        return 0;
    }
    let name = CStr::from_ptr((*info).name);
    let file = name.to_bytes().rsplit(|b| *b == b'/').next().unwrap_or_default();
    if file.starts_with(b"libcuda.so") || file.starts_with(b"libfake_cuda.so") {
        *found = Some(name.to_owned());
        return 1;
    }
    0
}

/// The fake CUDA's `phq_fake_cuda_load_mw`, when this process has loaded it.
fn find() -> Option<LoadFn> {
    let mut found: Option<CString> = None;
    // SAFETY: `each` reads only the two fields `DlPhdrInfo` declares and writes `found`, which
    // outlives the walk.
    unsafe { dl_iterate_phdr(each, &mut found as *mut Option<CString> as *mut c_void) };
    let file = found?;
    // SAFETY: RTLD_NOLOAD never loads a new object; the handle of a resident one stays valid
    // (its reference is never dropped).
    let h = unsafe { dlopen(file.as_ptr(), RTLD_LAZY | RTLD_NOLOAD) };
    if h.is_null() {
        return None;
    }
    // SAFETY: the name is a NUL-terminated literal.
    let f = unsafe { dlsym(h, c"phq_fake_cuda_load_mw".as_ptr()) };
    // SAFETY: the fake CUDA exports it with exactly this signature.
    (!f.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, LoadFn>(f) })
}

/// -1: the GPU at `bus_id` runs no GEMM (or no fake CUDA is here); 0: it does, at its limit;
/// else the milliwatts its board draws.
pub fn load_mw(bus_id: &str) -> i64 {
    let Some(f) = find() else { return -1 };
    let Ok(c) = CString::new(bus_id) else { return -1 };
    // SAFETY: a NUL-terminated string that lives through the call.
    unsafe { f(c.as_ptr()) }
}
