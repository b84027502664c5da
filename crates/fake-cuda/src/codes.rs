//! `CUresult` values, names and texts as `cuda.h` and the driver API reference ("Error
//! Handling": `cuGetErrorName`, `cuGetErrorString`) give them.

pub type CUresult = std::ffi::c_int;

pub const SUCCESS: CUresult = 0;
pub const INVALID_VALUE: CUresult = 1;
pub const OUT_OF_MEMORY: CUresult = 2;
pub const NOT_INITIALIZED: CUresult = 3;
pub const DEVICE_UNAVAILABLE: CUresult = 46;
pub const NO_DEVICE: CUresult = 100;
pub const INVALID_DEVICE: CUresult = 101;
pub const INVALID_CONTEXT: CUresult = 201;
pub const ECC_UNCORRECTABLE: CUresult = 214;
pub const PEER_ACCESS_UNSUPPORTED: CUresult = 217;
pub const INVALID_PTX: CUresult = 218;
pub const UNSUPPORTED_PTX_VERSION: CUresult = 222;
pub const INVALID_HANDLE: CUresult = 400;
pub const NOT_FOUND: CUresult = 500;
pub const NOT_READY: CUresult = 600;
pub const ILLEGAL_ADDRESS: CUresult = 700;
pub const PEER_ACCESS_ALREADY_ENABLED: CUresult = 704;
pub const PEER_ACCESS_NOT_ENABLED: CUresult = 705;
pub const NOT_SUPPORTED: CUresult = 801;

/// (code, name, text). The texts are the driver's own short descriptions.
pub const TABLE: &[(CUresult, &str, &str)] = &[
    (0, "CUDA_SUCCESS", "no error"),
    (1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"),
    (2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
    (3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
    (4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"),
    (46, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"),
    (100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"),
    (101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
    (201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
    (214, "CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"),
    (217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access is not supported between these two devices"),
    (218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"),
    (220, "CUDA_ERROR_NVLINK_UNCORRECTABLE", "uncorrectable NVLink error detected during the execution"),
    (222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "the provided PTX was compiled with an unsupported toolchain."),
    (400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
    (500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"),
    (600, "CUDA_ERROR_NOT_READY", "device not ready"),
    (700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"),
    (702, "CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"),
    (704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"),
    (705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"),
    (716, "CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"),
    (719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"),
    (801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
    (802, "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"),
    (999, "CUDA_ERROR_UNKNOWN", "unknown error"),
];

pub fn by_name(name: &str) -> Option<CUresult> {
    TABLE.iter().find(|(_, n, _)| *n == name).map(|(c, _, _)| *c)
}

/// Errors after which "the process is left in an inconsistent state and any further CUDA work
/// will return the same error" (driver API reference, `CUresult`: the text of
/// CUDA_ERROR_ILLEGAL_ADDRESS and CUDA_ERROR_LAUNCH_FAILED; CUDA_ERROR_LAUNCH_TIMEOUT's says the
/// context "cannot be used (and must be destroyed similar to CUDA_ERROR_LAUNCH_FAILED)"). An
/// uncorrectable ECC or NVLink error met by running work poisons its context the same way
/// (DCGM's diagnostics treat a context that saw 214 as unusable until the GPU is reset).
pub fn is_sticky(code: CUresult) -> bool {
    matches!(code, 214 | 220 | 700 | 702 | 714 | 715 | 716 | 717 | 718 | 719)
}
