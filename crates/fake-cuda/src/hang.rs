//! The scenario's `hang`: a kernel that never finishes, or a synchronisation that never returns.
//!
//! The rule kept: a kernel runs until it ends, and nothing outside it ends it on a GPU without a
//! display. The CUDA Driver API's `CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT` ("Specifies whether
//! there is a run time limit on kernels") is the only such limit, and it applies to GPUs that
//! drive a display; a datacenter GPU's is 0. So after a launch that never ends:
//! - `cuStreamSynchronize`, `cuEventSynchronize` and `cuCtxSynchronize` block ("Blocks until the
//!   device has completed all operations", CUDA Driver API, Stream and Event Management);
//! - `cuStreamQuery` and `cuEventQuery` answer `CUDA_ERROR_NOT_READY` ("if all operations in
//!   stream have not completed"), as often as they are asked.
//!
//! The fake blocks every synchronisation in the process once such a kernel is launched, not only
//! its own stream's: the probes wait on one GPU's work at a time, so the simplification does not
//! change what they see. A blocked call waits outside the world's lock, as a real one does not
//! hold up the driver's other threads.
//!
//! The public report of the real behaviour: on a GPU whose GSP stopped answering the driver logs
//! Xid 119 and the process that waits stays blocked (NVIDIA/open-gpu-kernel-modules issue #446);
//! a process in uninterruptible sleep after Xid 45 is stuck "forever" (leptonai/gpud pull request
//! #117).

use super::codes::CUresult;
use std::sync::atomic::{AtomicBool, Ordering};

/// A code no CUDA call returns, for "block once the world's lock is released".
pub(crate) const BLOCK: CUresult = -7_000;

/// Whether a never-ending kernel has been launched in this process.
static HUNG: AtomicBool = AtomicBool::new(false);

/// Called by `cuLaunchKernel` with the entry it launches.
pub(crate) fn launched(scenario: &super::scenario::Scenario, entry: &str) {
    if scenario.hang.as_ref().and_then(|h| h.kernel.as_deref()) == Some(entry) && !HUNG.swap(true, Ordering::SeqCst) {
        eprintln!("fake-cuda: {entry} launched: it never finishes (scenario hang)");
    }
}

/// Whether `function` must not return (the caller then answers `BLOCK`): a never-ending kernel was launched, or the scenario
/// names `function` itself.
pub(crate) fn sync_blocks(scenario: &super::scenario::Scenario, function: &str) -> bool {
    HUNG.load(Ordering::SeqCst) || scenario.hang.as_ref().and_then(|h| h.synchronize.as_deref()) == Some(function)
}

/// Whether a query must answer `CUDA_ERROR_NOT_READY`.
pub(crate) fn queries_not_ready() -> bool {
    HUNG.load(Ordering::SeqCst)
}

/// What a synchronisation returns: blocks for good on `BLOCK` (outside the lock).
pub(crate) fn settle(r: CUresult) -> CUresult {
    if r == BLOCK {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
    r
}
