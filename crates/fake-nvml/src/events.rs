//! Xid events through the event set: create, register, wait, free. Split from `lib.rs` by area;
//! the rules each keeps are beside it, with their sources.

use super::*;

/// Threads of this process inside `nvmlEventSetWait_v2`.
static WAITING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One thread inside `nvmlEventSetWait_v2`, counted in `WAITING` until it returns.
struct Waiting;

impl Waiting {
    fn enter() -> Waiting {
        WAITING.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Waiting
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITING.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Rule: `nvmlEventSetCreate` does not return while another thread of the process is inside
/// `nvmlEventSetWait` (on any set); it returns when that wait does. NVML's reference says
/// nothing of it; it was seen on the real library (H200, driver 580.159.04, 2026-12-04: a
/// service thread waiting 15 s held a second thread's `nvmlEventSetCreate` past its 10 s
/// deadline; the agent's docs/hardware-validation.md records the run).
#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetCreate(out: *mut nvmlEventSet_t) -> Ret {
    while WAITING.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    with_state(|s| {
        let id = s.next_set;
        s.next_set += 1;
        s.sets.insert(id, EventSet::default());
        Ok(id)
    })
    .map(|id| put(out, id as nvmlEventSet_t))
    .unwrap_or_else(|e| e)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(h: nvmlDevice_t, out: *mut c_ulonglong) -> Ret {
    device_call(h, "nvmlDeviceGetSupportedEventTypes", |_| Some(put(out, nvmlEventTypeXidCriticalError as c_ulonglong)))
}

#[no_mangle]
pub extern "C" fn nvmlDeviceRegisterEvents(h: nvmlDevice_t, types: c_ulonglong, set: nvmlEventSet_t) -> Ret {
    let r = device_call(h, "nvmlDeviceRegisterEvents", |_| Some(OK));
    if r != OK {
        return r;
    }
    if types & nvmlEventTypeXidCriticalError as c_ulonglong == 0 {
        return NOT_SUPPORTED;
    }
    with_state(|s| {
        let es = s.sets.get_mut(&(set as usize)).ok_or(INVALID)?;
        if !es.devices.contains(&index_of(h)) {
            es.devices.push(index_of(h));
        }
        Ok(OK)
    })
    .unwrap_or_else(|e| e)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> Ret {
    hang("nvmlEventSetWait_v2", None);
    let _waiting = Waiting::enter();
    let deadline = Instant::now() + Duration::from_millis(timeout_ms as u64);
    loop {
        // Deliver the earliest due event not yet delivered on this set, or learn when the next is due.
        let step = with_state(|s| {
            let elapsed = s.started.elapsed();
            let es = s.sets.get(&(set as usize)).ok_or(INVALID)?;
            let mut next_due: Option<Duration> = None;
            let mut due: Option<(usize, usize, u64, Duration)> = None;
            for &dev in &es.devices {
                let delivered = es.delivered.get(&dev).copied().unwrap_or(0);
                let Some(ev) = s.scenario.devices.get(dev).and_then(|d| d.xid_events.get(delivered)) else { continue };
                let at = Duration::from_millis(ev.after_ms);
                if at <= elapsed {
                    if due.is_none_or(|(_, _, _, t)| at < t) {
                        due = Some((dev, delivered, ev.xid, at));
                    }
                } else {
                    next_due = Some(next_due.map_or(at, |n: Duration| n.min(at)));
                }
            }
            if let Some((dev, delivered, xid, _)) = due {
                if let Some(es) = s.sets.get_mut(&(set as usize)) {
                    es.delivered.insert(dev, delivered + 1);
                }
                return Ok(Ok((dev, xid)));
            }
            Ok(Err(next_due.map(|n| s.started + n)))
        });
        match step {
            Err(e) => return e,
            Ok(Ok((dev, xid))) => {
                if data.is_null() {
                    return INVALID;
                }
                *data = nvmlEventData_t {
                    device: handle_of(dev),
                    eventType: nvmlEventTypeXidCriticalError as c_ulonglong,
                    eventData: xid,
                    gpuInstanceId: u32::MAX,
                    computeInstanceId: u32::MAX,
                };
                return OK;
            }
            Ok(Err(next)) => {
                let now = Instant::now();
                let wake = next.map_or(deadline, |n| n.min(deadline));
                if now >= deadline {
                    return TIMEOUT;
                }
                std::thread::sleep(wake.saturating_duration_since(now).max(Duration::from_millis(1)));
            }
        }
    }
}

#[no_mangle]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> Ret {
    with_state(|s| s.sets.remove(&(set as usize)).map(|_| OK).ok_or(INVALID)).unwrap_or_else(|e| e)
}
