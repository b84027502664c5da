//! Probes in a child process under a deadline, for the service (boot, idle and D-Bus probes).
//! The supervision this child and the all-reduce's share is `supervise.rs`.
//!
//! A kernel or a synchronisation that never returns cannot be cancelled from inside the process
//! that waits on it, and on a datacenter GPU no watchdog ends it (the CUDA driver API's
//! `CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT` is the run time limit, and only GPUs driving a
//! display have one). So the rules:
//!
//! 1. The service never runs CUDA itself: `run` starts `phq-agent probe-child` (this binary),
//!    hands it the snapshot and the level on stdin, and reads its stdout. — `run`, `child_main`.
//! 2. The child says each step as it starts (`step …`) and ends with one `answer {json}` line:
//!    the probe results and their findings, judged in the child. — `child_main`.
//! 3. The deadline is the level's planned GPU time (`plan_here`) twice over, plus
//!    `probes.deadline_margin` for CUDA's start, JIT compilation and the host's own work, plus
//!    `probes.nccl_allowance` and `EXIT_GRACE` for each of the two all-reduces where the plan
//!    has them (each runs under that allowance of its own, `probe::allreduce`, and may take
//!    the grace to exit). — `deadline`.
//! 4. The child takes the probe lock itself; past the deadline it is killed (SIGKILL) and
//!    reaped, and the kernel drops a dead process's file locks, so the lock is free again. A
//!    child blocked inside the driver (state D) dies only when the driver lets go: it is reaped
//!    by a thread of its own, the caller does not wait, and the lock is free when it exits.
//!    — `supervise::reap`.
//! 5. Then every GPU the plan had gets `probe.responsive` failing, naming the step that did not
//!    finish; a run that ends in time gives `probe.responsive` passing on each. — `overdue`.
//! 6. A child never outlives its parent: it gets SIGKILL when the thread that started it ends
//!    (`PR_SET_PDEATHSIG`, prctl(2): the thread, not the process — `supervise` stays on that
//!    thread until the child has ended or been killed), so killing a probe child also ends the
//!    all-reduce child it started. — `supervise::supervise`.
//! 7. The protocol has a descriptor of its own: a child moves it off stdout and points stdout
//!    at stderr, for libraries print there (NCCL's `NCCL_DEBUG` output goes to stdout: its
//!    src/debug.cc opens `ncclDebugFile = stdout`). — `supervise::private_protocol`.
//! 8. After its answer a child only exits: the all-reduce child answers before it lets go of
//!    anything and then ends with `_exit`, leaving its communicators, modules, buffers and
//!    streams to the process's end (the driver frees a process's contexts when it exits) and
//!    running no exit handlers (NCCL's destructor joins its RAS thread), so a teardown that
//!    blocks cannot turn a result or an error into a hang. The parent waits `EXIT_GRACE` at
//!    most for a child that has answered or closed its output, then kills it. — `supervise::finish`,
//!    `allreduce::child_main`.

use super::supervise::{private_protocol, say, supervise, Ended, EXIT_GRACE};
use crate::checks::Finding;
use crate::config::ProbeLevel;
use crate::snapshot::Snapshot;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The service's limits on a probe run (`[probes]`): the margin beside the planned GPU time
/// (rule 3), and each all-reduce's allowance for NCCL's start (`probe::allreduce`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub margin: Duration,
    pub nccl_allowance: Duration,
}

impl From<&crate::config::ProbesConfig> for Limits {
    fn from(c: &crate::config::ProbesConfig) -> Limits {
        Limits { margin: c.deadline_margin, nccl_allowance: c.nccl_allowance }
    }
}

/// What the child is asked (rule 1).
#[derive(Debug, Serialize, Deserialize)]
pub struct Request {
    pub level: ProbeLevel,
    pub state_dir: PathBuf,
    pub who: String,
    pub snapshot: Snapshot,
    /// `[probes] nccl_allowance` of the service's configuration.
    #[serde(default = "nccl_allowance")]
    pub nccl_allowance: Duration,
}

fn nccl_allowance() -> Duration {
    crate::config::NCCL_ALLOWANCE
}

/// What a run gives: the results (the `probes` of a report) and their findings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Answer {
    pub probes: serde_json::Value,
    pub findings: Vec<Finding>,
}

const ID: &str = "probe.responsive";

/// Rule 3: how long the child may take.
pub fn deadline(snapshot: &Snapshot, level: ProbeLevel, limits: Limits) -> Duration {
    // Planned as if cuBLAS were missing: the agent's own GEMM kernels are the slower, so the
    // deadline holds either way, and the service never loads a CUDA library itself (rule 1).
    deadline_for(&super::plan_here(snapshot, &super::Options::at(level), false), limits)
}

/// Rule 3 for a plan: twice its GPU time, the margin, and for each of the two all-reduces its
/// allowance and the grace its child has to exit.
pub(crate) fn deadline_for(plan: &super::budget::Plan, limits: Limits) -> Duration {
    let nccl = if plan.allreduce_s > 0.0 { 2 * (limits.nccl_allowance + EXIT_GRACE) } else { Duration::ZERO };
    Duration::from_secs_f64(plan.total_s.max(0.0) * 2.0) + limits.margin + nccl
}

/// Runs the probes at `level` in a child under its deadline (rules 1–5). `Err`: they could not
/// run at all (no CUDA, the lock held, no child), said as findings by the caller.
pub fn run(
    snapshot: &Snapshot,
    level: ProbeLevel,
    state_dir: &Path,
    who: &str,
    limits: Limits,
    progress: &mut dyn FnMut(&str),
) -> Result<Answer, String> {
    let limit = deadline(snapshot, level, limits);
    let mut cmd = super::supervise::this_program();
    cmd.arg("probe-child");
    if let Some(lib) = crate::cuda::named_library() {
        cmd.arg("--cuda-lib").arg(lib);
    }
    let request = Request {
        level,
        state_dir: state_dir.to_path_buf(),
        who: who.to_string(),
        snapshot: snapshot.clone(),
        nccl_allowance: limits.nccl_allowance,
    };
    let input = serde_json::to_vec(&request).map_err(|e| format!("cannot encode the probe request: {e}"))?;
    let answer = match supervise(cmd, &input, limit, "starting CUDA", progress)? {
        Ended::Answer(json) => serde_json::from_str::<Result<Answer, String>>(&json)
            .map_err(|e| format!("the probe process answered what is not an answer: {e}"))
            .and_then(|a| a),
        Ended::Overdue { step } => return Ok(overdue(snapshot, level, limit, &step)),
    };
    answer.map(|mut a| {
        a.findings.extend(plan_gpus(snapshot, level).into_iter().map(|gpu| {
            let mut f = Finding::pass(ID, format!("the probes finished within their {} s deadline", limit.as_secs()));
            f.gpu = Some(gpu);
            f
        }));
        a
    })
}

/// The GPUs the plan probes, by PCI address.
fn plan_gpus(snapshot: &Snapshot, level: ProbeLevel) -> Vec<String> {
    let plan = super::plan_here(snapshot, &super::Options::at(level), false);
    plan.gpus.into_iter().map(|g| g.pci).collect()
}

/// Rule 5: the answer of a run killed at its deadline.
fn overdue(snapshot: &Snapshot, level: ProbeLevel, limit: Duration, step: &str) -> Answer {
    let findings = plan_gpus(snapshot, level)
        .into_iter()
        .map(|gpu| {
            let mut f = Finding::fail(
                ID,
                format!("the probes did not finish within their {} s deadline, blocked at: {step}", limit.as_secs()),
            )
            .detail(
                "A kernel or a synchronisation never returned (a GPU that stopped answering: Xid 79, 119, or a \
                 kernel that never ends). The probe process was killed and the probe lock released; the \
                 results of this run are lost.",
            )
            .remedy("Read `dmesg | grep -E 'NVRM|Xid'`; reset the GPU or restart the VM, then probe again.")
            .evidence("step", step)
            .evidence("deadline_s", limit.as_secs());
            f.gpu = Some(gpu);
            f
        })
        .collect();
    Answer { probes: serde_json::json!({ "error": format!("killed at its deadline during: {step}") }), findings }
}

/// The child's side (rule 2): reads a `Request` on stdin, runs the probes here, prints the
/// steps and the answer on stdout. Its exit code says nothing; the answer line does.
pub fn child_main() -> anyhow::Result<i32> {
    if let Err(e) = private_protocol() {
        tracing::warn!("probe-child: the protocol stays on stdout ({e})");
    }
    let request: Request = serde_json::from_reader(std::io::stdin().lock())
        .map_err(|e| anyhow::anyhow!("probe-child: cannot read the request on stdin: {e}"))?;
    let opts = super::Options { nccl_allowance: request.nccl_allowance, ..super::Options::at(request.level) };
    // This process's own NVML session, as every command opens one where it starts: the
    // service's cannot cross into a child, and the child reads no snapshot of its own (its
    // parent's came with the request). `collect`'s session, under the default deadlines.
    let nvml = request.snapshot.nvml().map(|n| crate::collect::nvml::Session::new(&n.library, Default::default()));
    let answer: Result<Answer, String> =
        match super::run_here(&request.snapshot, nvml.as_ref(), &opts, &request.state_dir, &request.who, &mut |step| {
            say(format!("step {}", step.replace('\n', " ")))
        }) {
            Ok((report, targets)) => Ok(Answer {
                probes: serde_json::to_value(&report).unwrap_or_default(),
                findings: super::judge_here(&report, &targets, &request.state_dir),
            }),
            Err(e) => Err(e.to_string()),
        };
    let line = serde_json::to_string(&answer)
        .unwrap_or_else(|e| serde_json::json!({ "Err": format!("cannot encode the answer: {e}") }).to_string());
    say(format!("answer {line}"));
    Ok(0)
}
