//! A fake `libnccl.so.2`: the NCCL calls the agent's all-reduce probe makes, in the same library
//! as the fake CUDA driver (a test points `PHQ_NCCL_LIB` at this file), keeping NCCL's rules.
//! Sources: NCCL's API reference and user guide (docs.nvidia.com/deeplearning/nccl, *NCCL*) and
//! its source (github.com/NVIDIA/nccl, `src/`).
//!
//! - `ncclCommInitAll` makes one communicator per listed device, in one process. It walks the
//!   list once (src/init.cc, `ncclCommInitAll`): a device that does not exist is
//!   `ncclInvalidArgument` ("Invalid device %d (totalnDev=%d)"), one listed again is
//!   `ncclInvalidUsage` (its "duplicate device check"), whichever comes first; a negative count
//!   is `ncclInvalidArgument` ("Invalid device count requested"). Each communicator works in
//!   its device's primary context (NCCL calls `cudaSetDevice`).
//! - `ncclAllReduce` checks its arguments (src/misc/argcheck.cc: `PtrCheck`, `CudaPtrCheck`,
//!   `ArgsCheck`): a null buffer, a data type or operation out of range, a buffer on another
//!   device than the communicator's ("allocated on device %d mismatchs with NCCL device %d")
//!   are `ncclInvalidArgument`. A stream of another device's context fails the kernel launch (CUDA
//!   C++ Programming Guide, "Stream and Event Behavior": a kernel launch fails on a stream not
//!   of the current device), which NCCL returns as `ncclUnhandledCudaError`.
//! - One thread driving several devices must group their calls: "every NCCL call may have to
//!   block, waiting for other threads/ranks to arrive" (*NCCL*, "Management Of Multiple GPUs
//!   From One Thread"). A collective called outside a group on a communicator of more than one
//!   rank blocks here, for ever; so does a group in which a rank of the clique has no part (the
//!   others wait for it), and a ring through a pair of GPUs without peer access — an
//!   all-reduce that hangs where P2P is broken is NVIDIA/nccl#257, which `intel_iommu=off` cured.
//!   The fake blocks in the call itself (NCCL blocks in the kernel it launched): either way the
//!   caller never gets its answer, and a deadline must catch it. `ncclGroupEnd` without a
//!   `ncclGroupStart` is `ncclInvalidUsage` (src/group.cc).
//! - The sum is real: FP32, out of place or in place, every element. Memory filled with one
//!   word by `cuMemsetD32` stays one word, so a 16 GiB message costs no host memory.
//! - The time is the algorithm's: a ring moves 2(n−1)/n of the message over each GPU's slowest
//!   link (nccl-tests' bus bandwidth is then that link's rate: `src/all_reduce.cu`, "busBw =
//!   algBw * 2(n−1)/n"). NCCL runs a collective over several channels, each a ring of its own
//!   order (src/graph/search.cc searches one per channel; behind NVSwitches every GPU may follow
//!   every other), and the collective ends with its slowest channel: the fake charges the
//!   slowest pair of the clique, so a degraded link is seen whatever the rank order. NVLink
//!   SHARP (NVLS) on the NVSwitches runs at the scenario's `nccl.nvls_busbw_gbps` when it is set
//!   and `NCCL_NVLS_ENABLE` is not 0 at init (*NCCL*, "Environment Variables",
//!   NCCL_NVLS_ENABLE); each GPU's share crosses its own NVLinks to the switches, so a link
//!   slower than the scenario's `peers.gbps` slows NVLS by the same ratio.

use crate::scenario::Scenario;
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

/// `ncclDataType_t` (nccl.h): ncclFloat32 is 7 of the 10 types; `ncclRedOp_t`: ncclSum is 0 of
/// the 5 built-in operations.
const NCCL_FLOAT32: c_int = 7;
const NCCL_NUM_TYPES: c_int = 10;
const NCCL_SUM: c_int = 0;
const NCCL_NUM_OPS: c_int = 5;

/// NCCL_VERSION(2, 27, 3): what `ncclGetVersion` reports (2.9 on: major·10000 + minor·100 + patch).
const VERSION: c_int = 22703;

struct Comm {
    /// Scenario index of its device.
    dev: usize,
    rank: usize,
    clique: usize,
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
    stream: usize,
}

#[derive(Default)]
struct State {
    next: usize,
    comms: HashMap<usize, Comm>,
    cliques: HashMap<usize, Clique>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

thread_local! {
    /// NCCL's group is the calling thread's (src/group.cc keeps its depth thread-local).
    static GROUP: std::cell::RefCell<(u32, Vec<Op>)> = const { std::cell::RefCell::new((0, Vec::new())) };
}

fn state<T>(f: impl FnOnce(&mut State) -> T) -> T {
    let mut g = STATE.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(State::default))
}

/// Blocks for ever, as NCCL does where a rank never arrives (the module's rules).
fn hang(why: &str) -> ! {
    eprintln!("fake-nccl: {why}: blocking, as NCCL waits for a rank that never arrives");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
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
                eprintln!("fake-nccl: ncclCommInitAll: invalid device {o}");
                bad = INVALID_ARGUMENT;
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
    // Each communicator lives in its device's primary context, as cudaSetDevice makes it.
    for o in &ordinals {
        let mut ctx = std::ptr::null_mut();
        if crate::driver::cuDevicePrimaryCtxRetain(&mut ctx, *o) != 0 {
            eprintln!("fake-nccl: ncclCommInitAll: CUDA device {o} has no usable context");
            return UNHANDLED_CUDA_ERROR;
        }
    }
    let nvls = std::env::var("NCCL_NVLS_ENABLE").map(|v| v.trim() != "0").unwrap_or(true);
    state(|s| {
        let clique = s.next;
        s.next += 1;
        s.cliques.insert(clique, Clique { devs: devs.clone(), nvls });
        for (rank, dev) in devs.iter().enumerate() {
            s.next += 1;
            let h = 0x4e00_0000 + s.next;
            s.comms.insert(h, Comm { dev: *dev, rank, clique });
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
    GROUP.with(|g| g.borrow_mut().0 += 1);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> NcclResult {
    let ops = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.0 == 0 {
            return None;
        }
        g.0 -= 1;
        Some(if g.0 == 0 { std::mem::take(&mut g.1) } else { Vec::new() })
    });
    match ops {
        None => {
            eprintln!("fake-nccl: ncclGroupEnd: not in a group call");
            INVALID_USAGE
        }
        Some(ops) => run(ops),
    }
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
    let Some((dev, ranks)) = state(|s| s.comms.get(&(comm as usize)).map(|c| (c.dev, s.cliques[&c.clique].devs.len())))
    else {
        return INVALID_ARGUMENT;
    };
    if send.is_null() || recv.is_null() || !(0..NCCL_NUM_TYPES).contains(&datatype) || !(0..NCCL_NUM_OPS).contains(&op)
    {
        return INVALID_ARGUMENT;
    }
    if datatype != NCCL_FLOAT32 || op != NCCL_SUM {
        eprintln!("fake-nccl: ncclAllReduce: only ncclFloat32 with ncclSum is modelled");
        return INTERNAL_ERROR;
    }
    let (send, recv) = (send as CUdeviceptr, recv as CUdeviceptr);
    let bytes = (count * 4) as u64;
    let mut r = SUCCESS;
    let mut sid = 0;
    with(|w| {
        for p in [send, recv] {
            // A buffer on another device, or no device buffer at all (CudaPtrCheck).
            match w.find(p, bytes) {
                Ok((base, _)) if w.allocs[&base].device == dev => {}
                _ => {
                    eprintln!("fake-nccl: ncclAllReduce: {p:#x} is not {bytes} bytes of the communicator's device");
                    r = INVALID_ARGUMENT;
                    return 0;
                }
            }
        }
        match w.stream(stream) {
            Ok(id) if w.stream_device(id) == dev => sid = id,
            _ => {
                eprintln!("fake-nccl: ncclAllReduce: the stream is not one of the communicator's device");
                r = UNHANDLED_CUDA_ERROR;
            }
        }
        0
    });
    if r != SUCCESS {
        return r;
    }
    let op = Op { comm: comm as usize, send, recv, count, stream: sid };
    let grouped = GROUP.with(move |g| {
        let mut g = g.borrow_mut();
        if g.0 > 0 {
            g.1.push(op);
            None
        } else {
            Some(op)
        }
    });
    match grouped {
        None => SUCCESS,
        Some(_) if ranks > 1 => hang("ncclAllReduce outside a group, one thread, several ranks"),
        Some(op) => run(vec![op]),
    }
}

/// Runs a group's collectives: each clique's ranks together.
fn run(ops: Vec<Op>) -> NcclResult {
    let mut by_clique: HashMap<usize, Vec<(usize, Op)>> = HashMap::new();
    let mut shapes = Vec::new();
    state(|s| {
        for op in ops {
            let c = &s.comms[&op.comm];
            by_clique.entry(c.clique).or_default().push((c.rank, op));
        }
        for (clique, ops) in &by_clique {
            let cl = &s.cliques[clique];
            shapes.push((*clique, cl.devs.clone(), cl.nvls, ops.len()));
        }
    });
    for (clique, devs, nvls, n) in shapes {
        let mut ops = by_clique.remove(&clique).unwrap_or_default();
        ops.sort_by_key(|(rank, _)| *rank);
        if n != devs.len() || ops.iter().any(|(_, o)| o.count != ops[0].1.count) {
            hang("a rank of the clique has no part in the collective");
        }
        let mut hung = None;
        let r = with(|w| {
            // Every ordered pair: the channels' rings between them pass through each (the
            // module's rules).
            let pairs: Vec<(usize, usize)> =
                devs.iter().flat_map(|a| devs.iter().filter(move |b| *b != a).map(move |b| (*a, *b))).collect();
            if let Some((a, b)) = pairs.iter().find(|(a, b)| !w.scenario.peer(*a, *b).0) {
                hung = Some(format!(
                    "a ring runs from GPU {} to GPU {}, which have no peer access",
                    w.ordinal_of(*a),
                    w.ordinal_of(*b)
                ));
                return 0;
            }
            let ops: Vec<&Op> = ops.iter().map(|(_, o)| o).collect();
            if let Err(e) = reduce(w, &ops) {
                return e;
            }
            let busbw = bus_gbps(&w.scenario, &pairs, nvls);
            let nr = devs.len() as f64;
            let bytes = (ops[0].count * 4) as f64;
            let secs = if nr > 1.0 { bytes * 2.0 * (nr - 1.0) / nr / (busbw * 1e9) } else { 0.0 };
            let start = ops.iter().map(|o| w.stream_clock(o.stream)).fold(0.0, f64::max);
            for o in &ops {
                if let Some(st) = w.streams.get_mut(&o.stream) {
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

/// The bus bandwidth of the clique's all-reduce, GB/s: NVLS's where the scenario has it and it
/// is on, scaled by the slowest link's share of the nominal rate; else the slowest link's.
fn bus_gbps(s: &Scenario, pairs: &[(usize, usize)], nvls: bool) -> f64 {
    let slowest = pairs.iter().map(|(a, b)| s.peer(*a, *b).1).fold(f64::INFINITY, f64::min).max(1e-9);
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
