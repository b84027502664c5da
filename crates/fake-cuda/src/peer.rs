//! Peer access between GPUs (DRV: "Peer Context Memory Access").

use super::*;

/// # Safety
/// `can` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, dev: CUdevice, peer: CUdevice) -> CUresult {
    if can.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let (a, b) = match (w.device(dev), w.device(peer)) {
            (Ok(a), Ok(b)) => (a, b),
            _ => return INVALID_DEVICE,
        };
        *can = (a != b && w.scenario.peer(a, b).0) as c_int;
        SUCCESS
    })
}

/// Enables access from the current context to `peer`'s memory (DRV, cuCtxEnablePeerAccess):
/// CUDA_ERROR_INVALID_CONTEXT without a current context, CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
/// when cuDeviceCanAccessPeer says no, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED the second time,
/// CUDA_ERROR_INVALID_VALUE for flags other than 0.
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: Handle, flags: c_uint) -> CUresult {
    with(|w| {
        let c = match w.current_ctx() {
            Ok(c) => c,
            Err(e) => return e,
        };
        if flags != 0 {
            return INVALID_VALUE;
        }
        let Some(p) = w.contexts.get(&(peer as usize)) else { return INVALID_HANDLE };
        let (me, them) = (w.contexts[&c].device, p.device);
        if me == them {
            return INVALID_DEVICE;
        }
        if !w.scenario.peer(me, them).0 {
            return PEER_ACCESS_UNSUPPORTED;
        }
        let Some(ctx) = w.contexts.get_mut(&c) else { return INVALID_CONTEXT };
        if ctx.peers.contains(&them) {
            return PEER_ACCESS_ALREADY_ENABLED;
        }
        ctx.peers.push(them);
        SUCCESS
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuCtxDisablePeerAccess(peer: Handle) -> CUresult {
    with(|w| {
        let c = match w.current_ctx() {
            Ok(c) => c,
            Err(e) => return e,
        };
        let Some(them) = w.contexts.get(&(peer as usize)).map(|p| p.device) else { return INVALID_HANDLE };
        let Some(ctx) = w.contexts.get_mut(&c) else { return INVALID_CONTEXT };
        if !ctx.peers.contains(&them) {
            return PEER_ACCESS_NOT_ENABLED;
        }
        ctx.peers.retain(|d| *d != them);
        SUCCESS
    })
}
