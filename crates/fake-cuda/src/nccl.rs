//! A fake `libnccl.so.2`: the NCCL calls the agent's all-reduce probe makes, in the same library
//! as the fake CUDA driver (a test points `PHQ_NCCL_LIB` at this file), keeping NCCL 2.27.3's
//! rules. Sources: NCCL's API reference and user guide (docs.nvidia.com/deeplearning/nccl,
//! *NCCL*) and its source at tag v2.27.3-1 (github.com/NVIDIA/nccl, `src/`).
//!
//! - `ncclCommInitAll` makes one communicator per listed device, in one process. It walks the
//!   list once (src/init.cc, `ncclCommInitAll`): a device that does not exist is
//!   `ncclInvalidArgument` ("Invalid device %d (totalnDev=%d)"), one listed again is
//!   `ncclInvalidUsage` (its "duplicate device check"), whichever comes first; a negative count
//!   is `ncclInvalidArgument` ("Invalid device count requested"); without a list NCCL takes
//!   devices 0‥n−1 unchecked, and a missing one fails `cudaSetDevice` (`ncclUnhandledCudaError`). Each communicator works in
//!   its device's primary context (NCCL calls `cudaSetDevice`). NVLink SHARP is set up there
//!   (src/transport/nvls.cc, `ncclNvlsInit`): off when `NCCL_NVLS_ENABLE` is 0 or the
//!   communicator has two GPUs or fewer; at the default (2) only where the device reports
//!   `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`. NCCL reads its integer parameters with
//!   `strtoll(value, NULL, 0)` (src/misc/param.cc): "0x1" is 1, "abc" is 0; so does the fake.
//! - `ncclAllReduce` checks its arguments (src/misc/argcheck.cc, `ArgsCheck`): a data type
//!   outside nccl.h's 12 or an operation outside the 5 built-in ones (no user operations are
//!   made here) is `ncclInvalidArgument`. Its buffers are checked only when `NCCL_CHECK_POINTERS`
//!   is 1 at init (src/init.cc, `checkPointers`; `CudaPtrCheck`): then a pointer that is not
//!   device memory, or memory of another device ("allocated on device %d mismatchs with NCCL
//!   device %d"), is `ncclInvalidArgument`. Unchecked, NCCL's kernel meets the bad pointer: its
//!   context is poisoned with CUDA_ERROR_ILLEGAL_ADDRESS and the other ranks wait for it (the
//!   fake's kernels read only their own device's memory; where a real one would reach a peer's
//!   buffer through the P2P mapping NCCL made, the fake is stricter).
//! - Group semantics (src/group.cc, src/include/group.h, src/enqueue.cc `ncclEnqueueCheck`): a
//!   call inside `ncclGroupStart`/`ncclGroupEnd` only queues; a call that fails returns its
//!   error and leaves it as the group's (`ncclGroupErrCheck`: each error replaces the one
//!   before), and the outermost `ncclGroupEnd` then returns that error and launches nothing. `ncclGroupEnd` without a `ncclGroupStart` is
//!   `ncclInvalidUsage` ("ncclGroupEnd: not in a group call"). The kernels are launched at the
//!   outermost `ncclGroupEnd`: a rank's stream of another device's context fails that launch
//!   (CUDA C++ Programming Guide, "Stream and Event Behavior": a kernel launch fails on a stream
//!   not of the current device), which NCCL returns as `ncclUnhandledCudaError`.
//! - One thread driving several devices must group their calls: "every NCCL call may have to
//!   block, waiting for other threads/ranks to arrive" (*NCCL*, "Management Of Multiple GPUs
//!   From One Thread"). A collective called outside a group on a communicator of more than one
//!   rank blocks here, for ever; so does a group in which a rank of the clique has no part (the
//!   others wait for it), and a ring through a pair whose peer access is reported but whose P2P
//!   writes never land (`peers.pairs[].lost`: PCIe ACS sending P2P to the IOMMU — *NCCL*,
//!   Troubleshooting, "PCI Access Control Services (ACS)"; NVIDIA/nccl#2079 and #257). The fake
//!   blocks in the call itself (NCCL blocks in the kernel it launched): either way the caller
//!   never gets its answer, and a deadline must catch it.
//! - A pair without peer access: NCCL asks NVML's P2P status of each pair it would join by P2P
//!   (src/graph/paths.cc, `ncclTopoCheckP2p`), and for GPUs joined by NVLink a status that is
//!   not OK fails the init — "P2P is disabled between NVLINK connected GPUs %d and %d … you can
//!   set NCCL_IGNORE_DISABLED_P2P=1", `ncclUnhandledCudaError` — unless
//!   `NCCL_IGNORE_DISABLED_P2P` is set. The fake takes the scenario's peer access for NVML's
//!   status (a driver answers both from the same capability) and the scenario's `nvlink` for
//!   the topology. Otherwise such a pair is no hang: NCCL's P2P transport declines it
//!   (src/transport/p2p.cc, `p2pCanConnect`: `cudaDeviceCanAccessPeer` answers 0) and the SHM
//!   transport carries it through host memory (src/transport/shm.cc, `shmCanConnect`: same host,
//!   same /dev/shm); the fake charges it at the host-staged copy rate (the slower of the
//!   source's device→host and the destination's host→device rate). Not modelled: NCCL also
//!   leaves PCIe pairs further apart than a PCIe switch (`PATH_PXB`) to SHM; the fake lets any
//!   PCIe pair with peer access use P2P.
//! - The sum is real: FP32, out of place or in place, every element. Memory filled with one
//!   word by `cuMemsetD32` stays one word, so a 16 GiB message costs no host memory.
//! - The time is the algorithm's: a ring moves 2(n−1)/n of the message over each GPU's slowest
//!   link (nccl-tests' bus bandwidth is then that link's rate: `src/all_reduce.cu`, "busBw =
//!   algBw * 2(n−1)/n"). NCCL runs a collective over several channels, each a ring of its own
//!   order (src/graph/search.cc searches one per channel; behind NVSwitches every GPU may follow
//!   every other), and the collective ends with its slowest channel: the fake charges the
//!   slowest pair of the clique, so a degraded link is seen whatever the rank order. NVLink
//!   SHARP (NVLS), where init enabled it, runs at the scenario's `nccl.nvls_busbw_gbps`; each
//!   GPU's share crosses its own NVLinks to the switches, so a pair slower than the scenario's
//!   `peers.gbps` slows NVLS by the same ratio.

use crate::{with, CUdeviceptr, Handle, Mem, World};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::Mutex;

pub type NcclResult = c_int;
pub const SUCCESS: NcclResult = 0;
pub const UNHANDLED_CUDA_ERROR: NcclResult = 1;
pub const INTERNAL_ERROR: NcclResult = 3;
pub const INVALID_ARGUMENT: NcclResult = 4;
pub const INVALID_USAGE: NcclResult = 5;

/// `ncclDataType_t` (nccl.h, 2.24 on): ncclFloat32 is 7 of the 12 types (`ncclNumTypes`);
/// `ncclRedOp_t`: ncclSum is 0 of the 5 built-in operations (`ncclNumOps`).
const NCCL_FLOAT32: c_int = 7;
const NCCL_NUM_TYPES: c_int = 12;
const NCCL_SUM: c_int = 0;
const NCCL_NUM_OPS: c_int = 5;

/// NCCL_VERSION(2, 27, 3): what `ncclGetVersion` reports (2.9 on: major·10000 + minor·100 + patch).
const VERSION: c_int = 22703;

struct Comm {
    /// Scenario index of its device.
    dev: usize,
    rank: usize,
    clique: usize,
    /// `NCCL_CHECK_POINTERS=1` at init.
    check_pointers: bool,
}

struct Clique {
    /// Its devices, rank by rank (the ring's order).
    devs: Vec<usize>,
    nvls: bool,
}

/// One rank's part of a grouped collective.
struct Op {
    comm: usize,
    send: CUdeviceptr,
    recv: CUdeviceptr,
    count: usize,
    /// The caller's stream handle, resolved at launch.
    stream: Handle,
}

/// The calling thread's group: its depth, the calls queued, and the first error met.
struct Group {
    depth: u32,
    ops: Vec<Op>,
    error: NcclResult,
}

#[derive(Default)]
struct State {
    next: usize,
    comms: HashMap<usize, Comm>,
    cliques: HashMap<usize, Clique>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

thread_local! {
    /// NCCL's group is the calling thread's (src/group.cc keeps its depth and error
    /// thread-local).
    static GROUP: std::cell::RefCell<Group> =
        const { std::cell::RefCell::new(Group { depth: 0, ops: Vec::new(), error: SUCCESS }) };
}

fn state<T>(f: impl FnOnce(&mut State) -> T) -> T {
    let mut g = STATE.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(State::default))
}

/// NCCL's version line (src/init.cc, VERSION_STRING), for the CUDA 12.9 build.
const VERSION_STRING: &str = "NCCL version 2.27.3+cuda12.9";

/// An integer parameter as NCCL reads one from its environment (src/misc/param.cc,
/// `ncclLoadParam`: `strtoll(str, NULL, 0)`): leading blanks and a sign, then hexadecimal after
/// "0x", octal after "0", else decimal, up to the first character that is not a digit; no
/// digits at all is 0. Unset or empty: `default`.
fn param(name: &str, default: i64) -> i64 {
    let Ok(v) = std::env::var(name) else { return default };
    if v.is_empty() {
        return default;
    }
    let t = v.trim_start();
    let (neg, t) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let (radix, digits) = if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        (16, h)
    } else if t.starts_with('0') {
        (8, t)
    } else {
        (10, t)
    };
    let n = digits
        .chars()
        .map_while(|c| c.to_digit(radix))
        .fold(0i64, |n, d| n.saturating_mul(radix as i64).saturating_add(d as i64));
    if neg {
        -n
    } else {
        n
    }
}

/// Blocks for ever, as NCCL does where a rank never arrives (the module's rules).
fn hang(why: &str) -> ! {
    eprintln!("fake-nccl: {why}: blocking, as NCCL waits for a rank that never arrives");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

/// The text of NCCL's last warning: src/debug.cc (`ncclDebugLog`) keeps every WARN's text in
/// `ncclLastError` whatever NCCL_DEBUG says, and `ncclGetLastError` returns it (src/init.cc:
/// "comm is currently unused and can be set to NULL").
static LAST_ERROR: std::sync::Mutex<Option<std::ffi::CString>> = std::sync::Mutex::new(None);

/// A warning: kept for `ncclGetLastError`, and on stderr for the person reading the test.
fn warn(text: &str) {
    eprintln!("fake-nccl: NCCL WARN {text}");
    if let Ok(c) = std::ffi::CString::new(text) {
        *LAST_ERROR.lock().unwrap_or_else(|e| e.into_inner()) = Some(c);
    }
}

#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: Handle) -> *const c_char {
    let last = LAST_ERROR.lock().unwrap_or_else(|e| e.into_inner());
    // The text stays in the static until the next warning replaces it, as NCCL's buffer does.
    last.as_ref().map_or(c"".as_ptr(), |c| c.as_ptr())
}

/// # Safety
/// `version` must be writable.
#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> NcclResult {
    if version.is_null() {
        return INVALID_ARGUMENT;
    }
    *version = VERSION;
    SUCCESS
}

/// NCCL's own texts (src/init.cc, `ncclGetErrorString`).
#[no_mangle]
pub extern "C" fn ncclGetErrorString(r: NcclResult) -> *const c_char {
    let s: &'static [u8] = match r {
        SUCCESS => b"no error\0",
        UNHANDLED_CUDA_ERROR => b"unhandled cuda error (run with NCCL_DEBUG=INFO for details)\0",
        2 => b"unhandled system error (run with NCCL_DEBUG=INFO for details)\0",
        INTERNAL_ERROR => b"internal error - please report this issue to the NCCL developers\0",
        INVALID_ARGUMENT => b"invalid argument (run with NCCL_DEBUG=WARN for details)\0",
        INVALID_USAGE => b"invalid usage (run with NCCL_DEBUG=WARN for details)\0",
        6 => b"remote process exited or there was a network error\0",
        7 => b"NCCL operation in progress\0",
        _ => b"unknown result code\0",
    };
    s.as_ptr() as *const c_char
}

/// # Safety
/// `comms` must hold `ndev` writable handles; `devlist` is null or holds `ndev` ints.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(comms: *mut Handle, ndev: c_int, devlist: *const c_int) -> NcclResult {
    if comms.is_null() || ndev < 0 {
        return INVALID_ARGUMENT;
    }
    let ordinals: Vec<c_int> = if devlist.is_null() {
        (0..ndev).collect()
    } else {
        std::slice::from_raw_parts(devlist, ndev as usize).to_vec()
    };
    // One walk of the list, as NCCL's: each entry checked for existence, then for a repeat.
    let mut devs = Vec::new();
    let mut bad = SUCCESS;
    with(|w| {
        for (i, o) in ordinals.iter().enumerate() {
            let Ok(d) = w.device(*o) else {
                // Without a list NCCL checks nothing and cudaSetDevice fails on the missing GPU.
                eprintln!("fake-nccl: ncclCommInitAll: invalid device {o}");
                bad = if devlist.is_null() { UNHANDLED_CUDA_ERROR } else { INVALID_ARGUMENT };
                return 0;
            };
            if ordinals[..i].contains(o) {
                eprintln!("fake-nccl: ncclCommInitAll: CUDA device {o} is listed twice");
                bad = INVALID_USAGE;
                return 0;
            }
            devs.push(d);
        }
        0
    });
    if bad != SUCCESS {
        return bad;
    }
    // NCCL links the CUDA runtime statically, and its first runtime call refuses a driver older
    // than that runtime with cudaErrorInsufficientDriver (35, "CUDA driver version is
    // insufficient for CUDA runtime version": CUDA runtime API reference, cudaError); NCCL's
    // CUDACHECK warns "Cuda failure '%s'" with the runtime's text and answers
    // ncclUnhandledCudaError (src/include/checks.h; NVIDIA's NCCL 2.27.3 says exactly this on a
    // machine without a driver, tests/real_libs.rs).
    let mut too_old = false;
    with(|w| {
        let needs = w.scenario.nccl.as_ref().and_then(|n| n.needs_driver_version);
        too_old = needs.is_some_and(|v| w.scenario.driver_version < v);
        0
    });
    if too_old {
        warn("Cuda failure 'CUDA driver version is insufficient for CUDA runtime version'");
        return UNHANDLED_CUDA_ERROR;
    }
    // Each communicator lives in its device's primary context, as cudaSetDevice makes it.
    for o in &ordinals {
        let mut ctx = std::ptr::null_mut();
        if crate::driver::cuDevicePrimaryCtxRetain(&mut ctx, *o) != 0 {
            eprintln!("fake-nccl: ncclCommInitAll: CUDA device {o} has no usable context");
            return UNHANDLED_CUDA_ERROR;
        }
    }
    // ncclNvlsInit: NCCL_NVLS_ENABLE (default 2) 0 is off, as are two GPUs or fewer; 2 asks
    // the device; any other value forces it on.
    let enable = param("NCCL_NVLS_ENABLE", 2);
    let multicast = with(|w| w.scenario.multicast() as i32) == 1;
    let nvls = enable != 0 && devs.len() > 2 && (enable != 2 || multicast);
    let check_pointers = param("NCCL_CHECK_POINTERS", 0) == 1;
    // NVLink-joined GPUs must have P2P (paths.cc, ncclTopoCheckP2p).
    if param("NCCL_IGNORE_DISABLED_P2P", 0) == 0 {
        let mut refused = None;
        with(|w| {
            refused = devs.iter().enumerate().find_map(|(i, a)| {
                devs[i + 1..]
                    .iter()
                    .find(|b| {
                        (w.scenario.nvlink(*a, **b) && !w.scenario.peer(*a, **b).0)
                            || (w.scenario.nvlink(**b, *a) && !w.scenario.peer(**b, *a).0)
                    })
                    .map(|b| (w.ordinal_of(*a), w.ordinal_of(*b)))
            });
            0
        });
        if let Some((a, b)) = refused {
            warn(&format!(
                "P2P is disabled between NVLINK connected GPUs {a} and {b}. This should not be the case given their \
                 connectivity, and is probably due to a hardware issue. If you still want to proceed, you can set \
                 NCCL_IGNORE_DISABLED_P2P=1."
            ));
            return UNHANDLED_CUDA_ERROR;
        }
    }
    // NCCL_DEBUG: NCCL's version line, once per process, to its debug file — stdout, through C
    // stdio and unflushed, so block-buffered where stdout is a pipe (src/debug.cc: `ncclDebugFile
    // = stdout`, `fwrite`). At VERSION and WARN it is the bare line; above WARN (INFO, ABORT,
    // TRACE) an INFO line with host, pid, thread and device (src/init.cc, `showVersion`,
    // VERSION_STRING; debug.cc's line format).
    static VERSION_SHOWN: std::sync::Once = std::sync::Once::new();
    let level = std::env::var("NCCL_DEBUG").unwrap_or_default().to_ascii_uppercase();
    let line = match level.as_str() {
        "VERSION" | "WARN" => Some(format!("{VERSION_STRING}\n")),
        "INFO" | "ABORT" | "TRACE" => Some(format!(
            "{}:{}:{} [{}] NCCL INFO {VERSION_STRING}\n",
            std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim(),
            std::process::id(),
            std::process::id(),
            ordinals.first().copied().unwrap_or(0)
        )),
        _ => None,
    };
    if let Some(line) = line {
        VERSION_SHOWN.call_once(|| {
            extern "C" {
                fn printf(format: *const c_char, ...) -> c_int;
            }
            if let Ok(text) = std::ffi::CString::new(line) {
                printf(c"%s".as_ptr(), text.as_ptr());
            }
        });
    }
    state(|s| {
        let clique = s.next;
        s.next += 1;
        s.cliques.insert(clique, Clique { devs: devs.clone(), nvls });
        for (rank, dev) in devs.iter().enumerate() {
            s.next += 1;
            let h = 0x4e00_0000 + s.next;
            s.comms.insert(h, Comm { dev: *dev, rank, clique, check_pointers });
            *comms.add(rank) = h as Handle;
        }
    });
    SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclCommDestroy(comm: Handle) -> NcclResult {
    state(|s| if s.comms.remove(&(comm as usize)).is_some() { SUCCESS } else { INVALID_ARGUMENT })
}

/// # Safety
/// `count` must be writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: Handle, count: *mut c_int) -> NcclResult {
    if count.is_null() {
        return INVALID_ARGUMENT;
    }
    state(|s| match s.comms.get(&(comm as usize)) {
        Some(c) => {
            *count = s.cliques[&c.clique].devs.len() as c_int;
            SUCCESS
        }
        None => INVALID_ARGUMENT,
    })
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> NcclResult {
    GROUP.with(|g| g.borrow_mut().depth += 1);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> NcclResult {
    let ended = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return None;
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Some((SUCCESS, Vec::new()));
        }
        let error = std::mem::replace(&mut g.error, SUCCESS);
        Some((error, std::mem::take(&mut g.ops)))
    });
    match ended {
        None => {
            eprintln!("fake-nccl: ncclGroupEnd: not in a group call");
            INVALID_USAGE
        }
        // group.cc: `if ((ret = ncclGroupError) != ncclSuccess) goto fail;` — nothing launched.
        Some((error, _)) if error != SUCCESS => error,
        Some((_, ops)) => run(ops),
    }
}

/// A call's error, kept as its group's when it is in one (`ncclGroupErrCheck`).
fn group_err(r: NcclResult) -> NcclResult {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 && r != SUCCESS {
            g.error = r;
        }
    });
    r
}

/// # Safety
/// The buffers are device pointers (checked against the fake's memory).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: Handle,
    stream: Handle,
) -> NcclResult {
    let (send, recv) = (send as CUdeviceptr, recv as CUdeviceptr);
    // A failed call is its group's error too (`ncclGroupErrCheck`).
    group_err('call: {
        // CommCheck: not a live communicator.
        let Some((dev, ranks, check_pointers)) = state(|s| {
            s.comms.get(&(comm as usize)).map(|c| (c.dev, s.cliques[&c.clique].devs.len(), c.check_pointers))
        }) else {
            eprintln!("fake-nccl: ncclAllReduce: {comm:?} is not a communicator");
            break 'call INVALID_ARGUMENT;
        };
        if !(0..NCCL_NUM_TYPES).contains(&datatype) || !(0..NCCL_NUM_OPS).contains(&op) {
            eprintln!("fake-nccl: ncclAllReduce: invalid type {datatype} or reduction operation {op}");
            break 'call INVALID_ARGUMENT;
        }
        if datatype != NCCL_FLOAT32 || op != NCCL_SUM {
            eprintln!("fake-nccl: ncclAllReduce: only ncclFloat32 with ncclSum is modelled");
            break 'call INTERNAL_ERROR;
        }
        if check_pointers {
            let bytes = (count * 4) as u64;
            let bad = with(|w| {
                [send, recv]
                    .into_iter()
                    .any(|p| !matches!(w.find(p, bytes), Ok((base, _)) if w.allocs[&base].device == dev))
                    as i32
            });
            if bad != 0 {
                eprintln!("fake-nccl: ncclAllReduce: a buffer is not {bytes} bytes of the communicator's device");
                break 'call INVALID_ARGUMENT;
            }
        }
        let op = Op { comm: comm as usize, send, recv, count, stream };
        let ungrouped = GROUP.with(move |g| {
            let mut g = g.borrow_mut();
            if g.depth > 0 {
                g.ops.push(op);
                None
            } else {
                Some(op)
            }
        });
        match ungrouped {
            None => SUCCESS,
            Some(_) if ranks > 1 => hang("ncclAllReduce outside a group, one thread, several ranks"),
            Some(op) => run(vec![op]),
        }
    })
}

/// Launches a group's collectives: each clique's ranks together.
fn run(ops: Vec<Op>) -> NcclResult {
    let mut by_clique: HashMap<usize, Vec<(usize, usize, Op)>> = HashMap::new();
    let mut shapes = Vec::new();
    state(|s| {
        for op in ops {
            let c = &s.comms[&op.comm];
            by_clique.entry(c.clique).or_default().push((c.rank, c.dev, op));
        }
        for (clique, ops) in &by_clique {
            let cl = &s.cliques[clique];
            shapes.push((*clique, cl.devs.clone(), cl.nvls, ops.len()));
        }
    });
    for (clique, devs, nvls, n) in shapes {
        let mut ops = by_clique.remove(&clique).unwrap_or_default();
        ops.sort_by_key(|(rank, _, _)| *rank);
        // The launch: each rank's kernel on its stream, which must be of the rank's device.
        let mut streams = Vec::new();
        let launched = with(|w| {
            for (_, dev, o) in &ops {
                match w.stream(o.stream) {
                    Ok(id) if w.stream_device(id) == *dev => streams.push(id),
                    _ => {
                        eprintln!("fake-nccl: ncclGroupEnd: a rank's stream is not of its device: the launch fails");
                        return UNHANDLED_CUDA_ERROR;
                    }
                }
            }
            0
        });
        if launched != 0 {
            return launched;
        }
        // A kernel meeting a buffer it cannot reach faults; the others wait for its rank.
        let fault = with(|w| {
            for (rank, dev, o) in &ops {
                let bytes = (o.count * 4) as u64;
                let reach = |p| matches!(w.find(p, bytes), Ok((base, _)) if w.allocs[&base].device == *dev);
                if !reach(o.send) || !reach(o.recv) {
                    w.poison(*dev, crate::codes::ILLEGAL_ADDRESS);
                    return *rank as i32 + 1;
                }
            }
            0
        });
        if fault != 0 {
            hang(&format!("rank {}'s kernel met an illegal address", fault - 1));
        }
        if n != devs.len() || ops.iter().any(|(_, _, o)| o.count != ops[0].2.count) {
            hang("a rank of the clique has no part in the collective");
        }
        let mut hung = None;
        let r = with(|w| {
            // Every ordered pair: the channels' rings between them pass through each (the
            // module's rules).
            let pairs: Vec<(usize, usize)> =
                devs.iter().flat_map(|a| devs.iter().filter(move |b| *b != a).map(move |b| (*a, *b))).collect();
            if let Some((a, b)) = pairs.iter().find(|(a, b)| w.scenario.peer(*a, *b).0 && w.scenario.lost(*a, *b)) {
                hung = Some(format!(
                    "a ring runs from GPU {} to GPU {}, whose P2P writes never land",
                    w.ordinal_of(*a),
                    w.ordinal_of(*b)
                ));
                return 0;
            }
            let ops: Vec<&Op> = ops.iter().map(|(_, _, o)| o).collect();
            if let Err(e) = reduce(w, &ops) {
                return e;
            }
            let busbw = bus_gbps(w, &pairs, nvls);
            let nr = devs.len() as f64;
            let bytes = (ops[0].count * 4) as f64;
            let secs = if nr > 1.0 { bytes * 2.0 * (nr - 1.0) / nr / (busbw * 1e9) } else { 0.0 };
            let start = streams.iter().map(|s| w.stream_clock(*s)).fold(0.0, f64::max);
            for s in &streams {
                if let Some(st) = w.streams.get_mut(s) {
                    st.clock = start + secs;
                }
            }
            0
        });
        if let Some(why) = hung {
            hang(&why);
        }
        if r != 0 {
            return UNHANDLED_CUDA_ERROR;
        }
    }
    SUCCESS
}

/// The bus bandwidth of the clique's all-reduce, GB/s: NVLS's where init enabled it, scaled by
/// the slowest pair's share of the nominal rate; else the slowest pair's. A pair without peer
/// access goes through host memory (SHM) at the staged rate.
fn bus_gbps(w: &World, pairs: &[(usize, usize)], nvls: bool) -> f64 {
    let s = &w.scenario;
    let rate = |a: usize, b: usize| match s.peer(a, b) {
        (true, g) if g > 0.0 => g,
        _ => w.staged_gbps(a, b),
    };
    let slowest = pairs.iter().map(|(a, b)| rate(*a, *b)).fold(f64::INFINITY, f64::min).max(1e-9);
    match s.nccl.as_ref().and_then(|n| n.nvls_busbw_gbps).filter(|_| nvls && !pairs.is_empty()) {
        Some(g) if s.peers.gbps > 0.0 => g * (slowest / s.peers.gbps).min(1.0),
        Some(g) => g,
        None => slowest,
    }
}

/// Every rank's `recv` gets the FP32 sum of all ranks' `send`. Buffers filled with one word
/// give a buffer filled with the sum, with no bytes made.
fn reduce(w: &mut World, ops: &[&Op]) -> Result<(), crate::codes::CUresult> {
    let bytes = ops[0].count * 4;
    let words: Option<Vec<u32>> = ops
        .iter()
        .map(|o| {
            let (base, off) = w.find(o.send, bytes as u64).ok()?;
            let a = &w.allocs[&base];
            match a.mem {
                Mem::Fill(x) if off % 4 == 0 && !w.stuck_in(a.device, o.send, bytes) => Some(x),
                _ => None,
            }
        })
        .collect();
    if let Some(words) = words {
        let sum: f32 = words.iter().map(|x| f32::from_bits(*x)).sum();
        for o in ops {
            w.fill(o.recv, bytes, sum.to_bits())?;
        }
        return Ok(());
    }
    let mut sum = vec![0f32; ops[0].count];
    for o in ops {
        let b = w.read(o.send, bytes)?;
        for (s, c) in sum.iter_mut().zip(b.chunks_exact(4)) {
            *s += f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    let out: Vec<u8> = sum.iter().flat_map(|v| v.to_le_bytes()).collect();
    for o in ops {
        w.write(o.recv, &out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// NCCL's integer parameters are `strtoll(value, NULL, 0)`.
    #[test]
    fn parameters_are_read_as_strtoll_reads_them() {
        for (value, want) in [("0", 0), ("2", 2), ("0x1", 1), ("010", 8), (" 7x", 7), ("abc", 0), ("-1", -1), ("", 5)] {
            std::env::set_var("PHQ_FAKE_NCCL_TEST_PARAM", value);
            assert_eq!(super::param("PHQ_FAKE_NCCL_TEST_PARAM", 5), want, "{value:?}");
        }
        std::env::remove_var("PHQ_FAKE_NCCL_TEST_PARAM");
        assert_eq!(super::param("PHQ_FAKE_NCCL_TEST_PARAM", 5), 5);
    }
}
