//! `probe.allreduce`: NCCL's all-reduce across the probed GPUs, as a training job runs it, and
//! its bus bandwidth by nccl-tests' method.
//!
//! - NCCL is loaded at run time (`cuda::nccl`). `ncclCommInitAll` cannot be aborted and NCCL in
//!   a VM can wait for ever on a P2P path that does not carry its traffic (NVIDIA/nccl#257), so
//!   each measurement runs in a child process of its own (`phq-agent allreduce-child`) under a
//!   deadline (`probe::supervise`): twice the planned GPU time plus an allowance for
//!   NCCL's start (`[probes] nccl_allowance`). Past it the child is killed and the step it was
//!   in is reported.
//! - Twice: once as NCCL chooses (`NCCL_NVLS_ENABLE=2`, NCCL's default, set so that a
//!   setting of the caller's cannot decide it) and once with `NCCL_NVLS_ENABLE=0` (NCCL's
//!   environment variables: NVLink SHARP off), so a fault of the NVSwitch fabric's reductions is
//!   told from a slow link. The child records whether every GPU reports
//!   `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED` (what NCCL asks before it enables NVLS,
//!   src/transport/nvls.cc) and the `NCCL_*` settings in effect (`nccl::settings_here`), so a
//!   finding can say why NVLS was not used.
//! - Each rank sends a buffer filled with rank + 1 (FP32) and receives into a buffer filled with
//!   a NaN; the sum, out of place, is n(n+1)/2 everywhere, exact in FP32, and every word of every
//!   rank's result is compared on its GPU (`phq_mem_check`) after the timed runs.
//! - Timing follows nccl-tests (v2.13.8, src/common.cu): 5 warm-up all-reduces (1 since
//!   v2.16.8), then samples of 20; algorithm bandwidth = bytes / time per all-reduce, bus
//!   bandwidth = algorithm bandwidth × 2(n−1)/n (src/all_reduce.cu, `AllReduceGetBw`).
//!   nccl-tests times a sample with a host clock from the first launch until every stream has
//!   finished; the agent records CUDA events on each rank's stream around the 20 and takes the
//!   longest rank, which leaves out the host's launch overhead (microseconds beside the
//!   milliseconds of a 1 GiB all-reduce).
//! - The child answers before it lets go of anything (`child` rule 8, `supervise`): its communicators, the
//!   check's module, its buffers and streams are never released one by one; `_exit` after the
//!   answer leaves them to the driver, so neither `ncclCommDestroy` (which synchronizes NCCL's
//!   streams) nor an exit handler can turn a result into a hang.

use super::kernels;
use super::levels::LevelParams;
use super::results::{ProbeError, Run, Stat};
use crate::cuda::{self, nccl};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// nccl-tests' defaults (v2.13.8, src/common.cu: `warmup_iters = 5`, `iters = 20`).
pub const WARMUP: u32 = 5;
pub const ITERS: u32 = 20;

/// What the child is asked.
#[derive(Debug, Serialize, Deserialize)]
pub struct Request {
    /// CUDA ordinals (PCI order), rank by rank.
    pub ordinals: Vec<usize>,
    /// Message size per rank.
    pub bytes: u64,
    pub samples: u32,
}

/// nccl-tests' bus bandwidth of an all-reduce over `ranks` (src/all_reduce.cu): the algorithm
/// bandwidth × 2(n−1)/n, the share of the message each rank's links carry.
pub fn bus_bandwidth(algbw: f64, ranks: usize) -> f64 {
    if ranks < 2 {
        return algbw;
    }
    algbw * 2.0 * (ranks as f64 - 1.0) / ranks as f64
}

/// How long one configuration may take: twice its planned transfers at `busbw_gbps`, plus the
/// allowance for NCCL's start.
pub fn deadline(p: &LevelParams, ranks: usize, busbw_gbps: f64, allowance: Duration) -> Duration {
    Duration::from_secs_f64(2.0 * planned_s(p, ranks, busbw_gbps)) + allowance
}

/// GPU time of one configuration's all-reduces at `busbw_gbps`.
pub fn planned_s(p: &LevelParams, ranks: usize, busbw_gbps: f64) -> f64 {
    if p.allreduce_bytes == 0 || ranks < 2 {
        return 0.0;
    }
    let ops = (WARMUP + ITERS * p.allreduce_samples) as f64;
    let moved = bus_bandwidth(p.allreduce_bytes as f64, ranks);
    ops * moved / (busbw_gbps.max(1.0) * 1e9)
}

/// Runs one configuration in a child process under `limit` (the module's rules). `nvls`: NCCL's
/// default `NCCL_NVLS_ENABLE=2` in the child; false: 0.
pub fn run(
    ordinals: &[usize],
    p: &LevelParams,
    nvls: bool,
    limit: Duration,
    progress: &mut dyn FnMut(&str),
) -> Result<Run, ProbeError> {
    let mut cmd = super::supervise::this_program();
    cmd.arg("allreduce-child");
    if let Some(lib) = cuda::named_library() {
        cmd.arg("--cuda-lib").arg(lib);
    }
    cmd.env("NCCL_NVLS_ENABLE", if nvls { "2" } else { "0" });
    let request =
        Request { ordinals: ordinals.to_vec(), bytes: p.allreduce_bytes as u64, samples: p.allreduce_samples };
    let input =
        serde_json::to_vec(&request).map_err(|e| ProbeError::Cuda(format!("cannot encode the request: {e}")))?;
    match super::supervise::supervise(cmd, &input, limit, "starting CUDA", progress).map_err(ProbeError::Cuda)? {
        super::supervise::Ended::Answer(json) => serde_json::from_str::<Result<Run, ProbeError>>(&json)
            .map_err(|e| ProbeError::Cuda(format!("the all-reduce process answered what is not an answer: {e}")))?,
        super::supervise::Ended::Overdue { step } => Err(ProbeError::Hung { step, deadline_s: limit.as_secs() }),
    }
}

/// The child's side: reads a `Request` on stdin, measures, says each step and the answer.
pub fn child_main() -> anyhow::Result<i32> {
    if let Err(e) = super::supervise::private_protocol() {
        tracing::warn!("allreduce-child: the protocol stays on stdout ({e})");
    }
    let request: Request = serde_json::from_reader(std::io::stdin().lock())
        .map_err(|e| anyhow::anyhow!("allreduce-child: cannot read the request on stdin: {e}"))?;
    let mut held = Held::default();
    let answer = measure(&request, &|step| super::supervise::say(format!("step {step}")), &mut held);
    let line = serde_json::to_string(&answer).unwrap_or_else(|e| {
        serde_json::json!({ "Err": { "Cuda": format!("cannot encode the answer: {e}") } }).to_string()
    });
    super::supervise::say(format!("answer {line}"));
    // Rule 8 of `child`: nothing is released one by one after the answer, and no exit handler
    // runs; what C stdio holds of NCCL's output is flushed first (to stderr, rule 7).
    std::mem::forget(held);
    // SAFETY: fflush(NULL) flushes every C stream; _exit ends the process at once, which is
    // what is wanted: nothing here needs to run after the answer.
    unsafe {
        libc::fflush(std::ptr::null_mut());
        libc::_exit(0)
    }
}

/// What a measurement holds until the process ends: every rank's buffers and stream, the
/// communicators, the check's modules. Kept by the caller so an early error does not release
/// them (a stream's release synchronizes it, and one that never finishes would turn the error
/// into a hang).
#[derive(Default)]
struct Held {
    ranks: Vec<Rank>,
    comms: Option<nccl::Comms>,
    modules: Vec<kernels::Loaded>,
}

/// A driver or NCCL error of rank `rank`'s GPU as a probe error (a sticky one poisons it).
fn on(gpu: usize) -> impl Fn(cuda::CudaError) -> ProbeError {
    move |e| {
        if e.sticky {
            ProbeError::Sticky { gpu, code: e.code, message: e.to_string() }
        } else {
            ProbeError::Cuda(format!("GPU {gpu}: {e}"))
        }
    }
}

/// One rank's buffers and stream.
struct Rank {
    gpu: usize,
    ctx: std::sync::Arc<cuda::Ctx>,
    send: cuda::DeviceBuffer,
    recv: cuda::DeviceBuffer,
    stream: cuda::Stream,
    start: cuda::Event,
    end: cuda::Event,
}

/// The measurement itself (in the child); what it makes is kept in `held`.
fn measure(req: &Request, say: &dyn Fn(&str), held: &mut Held) -> Result<Run, ProbeError> {
    let n = req.ordinals.len();
    if n < 2 || req.bytes < 8 || req.samples == 0 {
        return Err(ProbeError::Unavailable(format!(
            "an all-reduce needs two GPUs or more and a message (asked: {n} GPUs, {} bytes)",
            req.bytes
        )));
    }
    let drv = cuda::driver().map_err(|e| ProbeError::Unavailable(e.to_string()))?;
    drv.init().map_err(|e| ProbeError::Cuda(e.to_string()))?;
    say("loading NCCL");
    let lib = nccl::nccl().map_err(|e| {
        ProbeError::Unavailable(format!("{e} (`phq-agent install` installs it: NVIDIA's libnccl2 / libnccl)"))
    })?;
    let version = lib.version().map_err(|e| ProbeError::Cuda(e.to_string()))?;
    let library = format!("NCCL {version} ({})", lib.file.display());
    // The message: what was asked, halved until both buffers fit in 90% of every GPU's free memory.
    let mut bytes = req.bytes & !7;
    let mut ctxs = Vec::new();
    for &gpu in &req.ordinals {
        let ctx = drv.device(gpu).and_then(|d| d.retain_context()).map_err(on(gpu))?;
        let (free, _) = ctx.mem_info().map_err(on(gpu))?;
        while bytes > 64 << 20 && 2 * bytes > free as u64 / 10 * 9 {
            bytes /= 2;
        }
        ctxs.push((gpu, ctx));
    }
    let note =
        (bytes < req.bytes).then(|| format!("{bytes} bytes instead of {}: the GPUs' free memory is short", req.bytes));
    // NVLS needs every GPU's multicast (nvls.cc asks the device); a driver that does not know
    // the attribute leaves it unsaid.
    let multicast = req
        .ordinals
        .iter()
        .map(|&gpu| drv.device(gpu).and_then(|d| d.attribute(cuda::attr::MULTICAST_SUPPORTED)).ok().map(|v| v == 1))
        .collect::<Option<Vec<bool>>>()
        .map(|all| all.iter().all(|m| *m));
    let settings = nccl::settings_here();
    let count = (bytes / 4) as usize;
    let nan = 0x7fc0_0000u32;
    let Held { ranks, comms: held_comms, modules } = held;
    for (rank, (gpu, ctx)) in ctxs.into_iter().enumerate() {
        let e = on(gpu);
        // Held before any work is queued on it.
        ranks.push(Rank {
            gpu,
            send: ctx.alloc(bytes as usize).map_err(&e)?,
            recv: ctx.alloc(bytes as usize).map_err(&e)?,
            stream: ctx.stream().map_err(&e)?,
            start: ctx.event().map_err(&e)?,
            end: ctx.event().map_err(&e)?,
            ctx,
        });
        let r = &ranks[rank];
        r.stream.memset_d32(&r.send, 0, (rank as f32 + 1.0).to_bits(), count).map_err(&e)?;
        r.stream.memset_d32(&r.recv, 0, nan, count).map_err(&e)?;
        r.stream.synchronize().map_err(&e)?;
    }
    let ranks: &[Rank] = ranks;
    let sync = |ranks: &[Rank]| ranks.iter().try_for_each(|r| r.stream.synchronize().map_err(on(r.gpu)));
    let gpus: Vec<usize> = ranks.iter().map(|r| r.gpu).collect();
    say(&format!("ncclCommInitAll over GPUs {gpus:?} ({library})"));
    // A communicator that does not start is NCCL's failure to start, told apart from a fault of
    // the links by the judge (`probe.nccl-start`), with what decides it: NCCL's version, the
    // driver's CUDA and NCCL's own last warning.
    let not_started = |e: cuda::CudaError| ProbeError::NotStarted {
        error: e.to_string(),
        library: library.clone(),
        driver_cuda: drv.version().map_or_else(|e| e.to_string(), crate::collect::cuda::version_string),
        warning: lib.last_error(),
    };
    let comms = &*held_comms.insert(lib.init_all(&gpus).map_err(not_started)?);
    let parts: Vec<nccl::Part<'_>> =
        ranks.iter().map(|r| nccl::Part { send: &r.send, recv: &r.recv, stream: &r.stream }).collect();
    let all_reduce = || comms.all_reduce_sum_f32(&parts, count).map_err(|e| ProbeError::Cuda(e.to_string()));
    say(&format!("{WARMUP} warm-up all-reduces of {bytes} bytes over GPUs {gpus:?}"));
    for _ in 0..WARMUP {
        all_reduce()?;
    }
    sync(ranks)?;
    let mut busbw = Vec::new();
    let mut algbw = Vec::new();
    for s in 0..req.samples {
        say(&format!("all-reduce sample {} of {}: {ITERS} × {bytes} bytes over GPUs {gpus:?}", s + 1, req.samples));
        for r in ranks {
            r.stream.record(&r.start).map_err(on(r.gpu))?;
        }
        for _ in 0..ITERS {
            all_reduce()?;
        }
        for r in ranks {
            r.stream.record(&r.end).map_err(on(r.gpu))?;
        }
        sync(ranks)?;
        let mut longest = 0f64;
        for r in ranks {
            longest = longest.max(r.start.elapsed_ms(&r.end).map_err(on(r.gpu))? as f64 / 1e3);
        }
        let alg = bytes as f64 / (longest / ITERS as f64).max(1e-12) / 1e9;
        algbw.push(alg);
        busbw.push(bus_bandwidth(alg, n));
    }
    drop(parts);
    say(&format!("checking the sum on GPUs {gpus:?}"));
    let sum = (n * (n + 1) / 2) as f32;
    let word = u64::from(sum.to_bits()) * 0x1_0000_0001;
    let (mut wrong, mut first_wrong) = (0, None);
    for r in ranks {
        let e = on(r.gpu);
        let sms = drv.device(r.gpu).and_then(|d| d.attribute(cuda::attr::MULTIPROCESSOR_COUNT)).unwrap_or(132);
        modules.push(kernels::Loaded::load(&r.ctx, sms.max(1) as u32, 0).map_err(&e)?);
        let k = modules.last().ok_or_else(|| ProbeError::Cuda("the check's module was not kept".into()))?;
        let (count, kept) = kernels::check_solid(&r.stream, k, &r.recv, word).map_err(&e)?;
        wrong += count;
        if first_wrong.is_none() {
            first_wrong = kept
                .first()
                .map(|m| format!("GPU {}: {:#018x} at {:#x}, for {:#018x}", r.gpu, m.read, m.address, m.expected));
        }
    }
    let busbw = Stat::of(busbw).ok_or_else(|| ProbeError::Cuda("no valid sample".into()))?;
    let median_alg = Stat::of(algbw).map(|s| s.median).unwrap_or(0.0);
    Ok(Run {
        busbw_gbps: busbw,
        algbw_gbps: median_alg,
        bytes,
        iters: ITERS,
        library,
        checked_words: n as u64 * bytes / 8,
        wrong_words: wrong,
        first_wrong,
        note,
        multicast,
        settings,
    })
}

#[cfg(test)]
mod tests {
    use super::super::judge::allreduce_finding;
    use super::super::levels::params;
    use super::super::results::{AllReduce, Outcome, ProbeReport};
    use super::*;
    use crate::checks::Severity;
    use crate::config::ProbeLevel;

    fn run(busbw: f64) -> Run {
        Run {
            busbw_gbps: Stat { samples: vec![busbw], median: busbw },
            algbw_gbps: busbw / 1.75,
            bytes: 16 << 30,
            iters: ITERS,
            library: "NCCL 2.27.3".into(),
            checked_words: 8 * (2 << 30),
            wrong_words: 0,
            first_wrong: None,
            note: None,
            multicast: Some(true),
            settings: vec![],
        }
    }

    fn report(nccl: Outcome<Run>, nvls_off: Option<Outcome<Run>>) -> (ProbeReport, AllReduce) {
        let a = AllReduce {
            gpus: (0..8).map(|i| format!("0000:{:02x}:00.0", 9 + i)).collect(),
            bytes: 16 << 30,
            nccl,
            nvls_off,
            deadline_s: 71,
        };
        let level = ProbeLevel::Full;
        let r = ProbeReport {
            level,
            params: params(level),
            gpus: vec![],
            peers: vec![],
            skipped: vec![],
            nvlink: None,
            allreduce: Some(a.clone()),
        };
        (r, a)
    }

    /// NVLS that adds nothing over the rings (both at the links' 375) is the fabric's fault, not
    /// a link's: the finding says so.
    #[test]
    fn a_shortfall_with_nvls_no_faster_than_the_rings_points_at_the_fabric() {
        let (r, a) = report(Outcome::Ok(run(375.0)), Some(Outcome::Ok(run(374.0))));
        let f = allreduce_finding(&r, &a, Some(460.0));
        assert_eq!(f.severity, Severity::Fail);
        assert!(f.detail.contains("NVLink SHARP on the NVSwitches is not helping"), "{}", f.detail);
        let (r, a) = report(Outcome::Ok(run(470.0)), Some(Outcome::Ok(run(374.0))));
        assert_eq!(allreduce_finding(&r, &a, Some(460.0)).severity, Severity::Pass);
    }

    #[test]
    fn a_wrong_word_fails_whatever_the_rate() {
        let mut bad = run(480.0);
        bad.wrong_words = 1;
        bad.first_wrong = Some("GPU 3: 0x4210000042100000 at 0x7f0000000000, for 0x4210000042100000".into());
        let (r, a) = report(Outcome::Ok(bad), None);
        let f = allreduce_finding(&r, &a, Some(460.0));
        assert_eq!(f.severity, Severity::Fail);
        assert!(f.summary.contains("wrong sum: 1 of"), "{}", f.summary);
    }

    /// Azure's floors hold for a board of 8 of one SKU with 16 GiB messages, and for nothing
    /// else.
    #[test]
    fn the_floor_is_azures_for_8_gpus_and_16_gib_only() {
        use crate::facts::allreduce_floor;
        assert_eq!(allreduce_floor(0x2330, 8, 16 << 30), Some(460.0));
        assert_eq!(allreduce_floor(0x2335, 8, 16 << 30), Some(431.0));
        assert_eq!(allreduce_floor(0x2330, 4, 16 << 30), None);
        assert_eq!(allreduce_floor(0x2330, 8, 1 << 30), None);
        assert_eq!(allreduce_floor(0x2331, 8, 16 << 30), None);
    }

    /// The deadline covers twice the transfers at the planned rate, plus NCCL's start.
    #[test]
    fn the_deadline_is_twice_the_planned_transfers_plus_the_allowance() {
        let p = params(ProbeLevel::Full);
        // 65 all-reduces of 16 GiB, 1.75 of each over the links, at 335 GB/s: 5.83 s.
        let planned = planned_s(&p, 8, 335.0);
        assert!((planned - 65.0 * 1.75 * (16u64 << 30) as f64 / 335e9).abs() < 1e-9, "{planned}");
        assert_eq!(deadline(&p, 8, 335.0, Duration::from_secs(60)), Duration::from_secs_f64(2.0 * planned + 60.0));
        assert_eq!(planned_s(&params(ProbeLevel::Quick), 8, 335.0), 0.0);
        assert_eq!(planned_s(&p, 1, 335.0), 0.0);
    }

    #[test]
    fn bus_bandwidth_is_nccl_tests() {
        // 8 ranks: ×1.75; 2 ranks: ×1 (all_reduce.cu's factor 2(n−1)/n).
        assert_eq!(bus_bandwidth(100.0, 8), 175.0);
        assert_eq!(bus_bandwidth(100.0, 2), 100.0);
        assert_eq!(bus_bandwidth(100.0, 1), 100.0);
    }
}
