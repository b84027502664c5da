//! Streams and events (DRV: "Stream Management", "Event Management").

use super::*;

/// A stream belongs to the current context (DRV, cuStreamCreate).
///
/// # Safety
/// `s` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(s: *mut Handle, _flags: c_uint) -> CUresult {
    if s.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let c = match w.current_ctx() {
            Ok(c) => c,
            Err(e) => return e,
        };
        let h = w.handle();
        w.streams.insert(h, Stream { ctx: c, clock: 0.0 });
        *s = h as Handle;
        SUCCESS
    })
}

/// # Safety
/// `s` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(s: *mut Handle, flags: c_uint, _priority: c_int) -> CUresult {
    cuStreamCreate(s, flags)
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(s: Handle) -> CUresult {
    with(|w| {
        let id = s as usize;
        match w.streams.get(&id) {
            Some(st) if w.contexts.get(&st.ctx).is_some_and(|c| c.default_stream != id) => {
                w.streams.remove(&id);
                SUCCESS
            }
            _ => INVALID_HANDLE,
        }
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(s: Handle) -> CUresult {
    crate::hang::settle(with(|w| match w.stream(s) {
        Ok(_) if crate::hang::sync_blocks(&w.scenario, "cuStreamSynchronize") => crate::hang::BLOCK,
        Ok(id) => {
            kernels::settle_gates(w);
            w.now = w.now.max(w.streams[&id].clock);
            SUCCESS
        }
        Err(e) => e,
    }))
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(s: Handle) -> CUresult {
    if crate::hang::queries_not_ready() {
        return NOT_READY;
    }
    cuStreamSynchronize(s)
}

/// A stream may wait on an event of another device ("cudaStreamWaitEvent() will succeed even
/// if the input stream and input event are associated to different devices", PG, "Stream and
/// Event Behavior"); its later work starts no earlier than the event's.
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(s: Handle, e: Handle, _flags: c_uint) -> CUresult {
    with(|w| {
        let id = match w.stream(s) {
            Ok(id) => id,
            Err(e) => return e,
        };
        let Some(ev) = w.events.get(&(e as usize)) else { return INVALID_HANDLE };
        let at = ev.at.unwrap_or(0.0);
        let now = w.now;
        if let Some(st) = w.streams.get_mut(&id) {
            st.clock = st.clock.max(at).max(now);
        }
        SUCCESS
    })
}

/// # Safety
/// `e` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(e: *mut Handle, flags: c_uint) -> CUresult {
    if e.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let c = match w.current_ctx() {
            Ok(c) => c,
            Err(e) => return e,
        };
        let h = w.handle();
        w.events.insert(h, Event { ctx: c, timing: flags & CU_EVENT_DISABLE_TIMING == 0, at: None });
        *e = h as Handle;
        SUCCESS
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(e: Handle) -> CUresult {
    with(|w| match w.events.remove(&(e as usize)) {
        Some(_) => SUCCESS,
        None => INVALID_HANDLE,
    })
}

/// The event and the stream must belong to the same context: "cudaEventRecord() will fail if
/// the input event and input stream are associated to different devices" (PG, "Stream and
/// Event Behavior"); the driver answers CUDA_ERROR_INVALID_HANDLE.
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(e: Handle, s: Handle) -> CUresult {
    with(|w| {
        let id = match w.stream(s) {
            Ok(id) => id,
            Err(e) => return e,
        };
        let (sctx, clock) = (w.streams[&id].ctx, w.streams[&id].clock.max(w.now));
        let Some(ev) = w.events.get_mut(&(e as usize)) else { return INVALID_HANDLE };
        if ev.ctx != sctx {
            eprintln!("fake-cuda: cuEventRecord: the event and the stream belong to different contexts");
            return INVALID_HANDLE;
        }
        ev.at = Some(clock);
        SUCCESS
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(e: Handle) -> CUresult {
    crate::hang::settle(with(|w| match w.events.get(&(e as usize)).map(|ev| (ev.ctx, ev.at)) {
        Some(_) if crate::hang::sync_blocks(&w.scenario, "cuEventSynchronize") => crate::hang::BLOCK,
        Some((ctx, at)) => match w.contexts.get(&ctx).map(|c| c.device) {
            Some(device) => {
                kernels::settle_gates(w);
                w.now = w.now.max(at.unwrap_or(0.0));
                w.healthy(device).err().unwrap_or(SUCCESS)
            }
            None => INVALID_HANDLE,
        },
        None => INVALID_HANDLE,
    }))
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(e: Handle) -> CUresult {
    if crate::hang::queries_not_ready() {
        return NOT_READY;
    }
    cuEventSynchronize(e)
}

/// Milliseconds between two recorded events of one context (DRV, cuEventElapsedTime: an event
/// never recorded, or created with CU_EVENT_DISABLE_TIMING, is CUDA_ERROR_INVALID_HANDLE;
/// PG: "cudaEventElapsedTime() will fail if the two input events are associated to different
/// devices").
///
/// # Safety
/// `ms` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    if ms.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let (Some(a), Some(b)) = (w.events.get(&(start as usize)), w.events.get(&(end as usize))) else {
            return INVALID_HANDLE;
        };
        if a.ctx != b.ctx || !a.timing || !b.timing {
            return INVALID_HANDLE;
        }
        if let Some(c) = w.contexts.get(&a.ctx) {
            if let Err(e) = w.healthy(c.device) {
                return e;
            }
        }
        match (a.at, b.at) {
            (Some(x), Some(y)) => {
                *ms = ((y - x) * 1000.0) as f32;
                SUCCESS
            }
            _ => INVALID_HANDLE,
        }
    })
}

/// # Safety
/// `ms` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    cuEventElapsedTime(ms, start, end)
}
