//! Probes in a child process under a deadline, for the service (boot, idle and D-Bus probes).
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
//!    — `reap`.
//! 5. Then every GPU the plan had gets `probe.responsive` failing, naming the step that did not
//!    finish; a run that ends in time gives `probe.responsive` passing on each. — `overdue`.
//! 6. A child never outlives its parent: it gets SIGKILL when the thread that started it ends
//!    (`PR_SET_PDEATHSIG`, prctl(2): the thread, not the process — `supervise` stays on that
//!    thread until the child has ended or been killed), so killing a probe child also ends the
//!    all-reduce child it started. — `supervise`.
//! 7. The protocol has a descriptor of its own: a child moves it off stdout and points stdout
//!    at stderr (`private_protocol`), for libraries print there (NCCL's `NCCL_DEBUG` output
//!    goes to stdout: its src/debug.cc opens `ncclDebugFile = stdout`).
//! 8. After its answer a child only exits: the all-reduce child answers before it lets go of
//!    anything and then ends with `_exit`, leaving its communicators, modules, buffers and
//!    streams to the process's end (the driver frees a process's contexts when it exits) and
//!    running no exit handlers (NCCL's destructor joins its RAS thread), so a teardown that
//!    blocks cannot turn a result or an error into a hang. The parent waits `EXIT_GRACE` at
//!    most for a child that has answered or closed its output, then kills it. — `finish`,
//!    `allreduce::child_main`.

use crate::checks::Finding;
use crate::config::ProbeLevel;
use crate::snapshot::Snapshot;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program to run the probes: {e}"))?;
    let mut cmd = std::process::Command::new(exe);
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

/// How a supervised child ended.
pub(crate) enum Ended {
    /// Its `answer …` line, the text after the word.
    Answer(String),
    /// Killed at its deadline during `step`, the last it announced.
    Overdue { step: String },
}

/// Runs `cmd` as a child that reads `input` on stdin and says `step …` lines and one `answer …`
/// line on stdout (rules 2 and 4): each step goes to `progress`; past `limit` the child is
/// killed and reaped. `Err`: it could not start, or ended without an answer.
pub(crate) fn supervise(
    mut cmd: std::process::Command,
    input: &[u8],
    limit: Duration,
    first_step: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<Ended, String> {
    use std::os::unix::process::CommandExt;
    // Rule 6. The parent's pid, taken before the fork: a parent gone before prctl took effect
    // is seen as a new parent pid.
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: between fork and exec only prctl, getppid and errno reads run, all
    // async-signal-safe; nothing allocates (a parent gone already is ESRCH, for no one reads it).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    let mut child = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start the probe process: {e}"))?;
    let sent = child.stdin.take().map(|mut stdin| stdin.write_all(input).and_then(|()| stdin.flush()));
    if let Some(Err(e)) = sent {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("cannot hand the probe process its request: {e}"));
    }
    // The child's lines, read on a thread of their own so the wait below keeps its deadline.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    if let Some(out) = child.stdout.take() {
        std::thread::Builder::new()
            .name("probe-child-out".into())
            .spawn(move || {
                for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| format!("cannot read the probe process: {e}"))?;
    }
    let started = Instant::now();
    let mut step = first_step.to_string();
    let ended = loop {
        let left = limit.saturating_sub(started.elapsed());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some(s) = line.strip_prefix("step ") {
                    step = s.to_string();
                    progress(s);
                } else if let Some(json) = line.strip_prefix("answer ") {
                    break Ok(Ended::Answer(json.to_string()));
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                // An answer that arrived with the deadline still counts.
                if let Some(json) = rx.try_iter().find_map(|l| l.strip_prefix("answer ").map(str::to_string)) {
                    break Ok(Ended::Answer(json));
                }
                // Rule 4: killed and reaped; its probe lock goes with it.
                let _ = child.kill();
                tracing::error!(deadline = ?limit, %step, "the probe process did not finish within its deadline and was killed");
                reap(child);
                return Ok(Ended::Overdue { step });
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let status = finish(child).unwrap_or_else(|| "killed after closing its output".into());
                return Err(format!("the probe process ended without an answer ({status}) during: {step}"));
            }
        }
    };
    finish(child);
    ended
}

/// Rule 8: a child that has answered (or closed its output) only exits; one that has not
/// within `EXIT_GRACE` is killed and reaped. Its exit status, when it exited by itself.
fn finish(mut child: std::process::Child) -> Option<String> {
    let until = Instant::now() + EXIT_GRACE;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status.to_string()),
            Err(e) => return Some(e.to_string()),
            Ok(None) if Instant::now() >= until => {
                tracing::warn!(grace = ?EXIT_GRACE, "the probe process is done but did not exit; killed");
                let _ = child.kill();
                reap(child);
                return None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// How long a child that has answered may take to exit (rule 8): ending a process that held
/// CUDA contexts frees their memory in the driver, seconds at most.
pub(crate) const EXIT_GRACE: Duration = Duration::from_secs(30);

/// Reaps a killed child. One blocked inside the driver (uninterruptible sleep, state D: gpud's
/// report of `nvidia-smi` after Xid 45, leptonai/gpud pull request #117) dies only when the
/// driver lets go, so it is waited for briefly here, then by a thread of its own: the caller
/// goes on, and the probe lock stays held, said once, until the process is gone.
fn reap(mut child: std::process::Child) {
    let until = Instant::now() + REAP_GRACE;
    while Instant::now() < until {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = child.id();
    tracing::error!(
        pid,
        "the killed probe process has not exited (blocked in the driver?); the probe lock stays held until it does"
    );
    let _ = std::thread::Builder::new().name("probe-child-reap".into()).spawn(move || {
        let _ = child.wait();
        tracing::info!(pid, "the killed probe process exited; the probe lock is free");
    });
}

/// How long a killed child is waited for before a thread takes over (a process that is not
/// blocked in the kernel is gone within milliseconds of SIGKILL).
const REAP_GRACE: Duration = Duration::from_secs(2);

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

/// One line of a child's protocol, flushed at once (rule 2): the parent may kill the child at
/// any moment and must have heard the last step. On the protocol's own descriptor once
/// `private_protocol` has made one (rule 7), else on stdout.
pub(crate) fn say(line: String) {
    if let Some(out) = PROTOCOL.get() {
        let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(o, "{line}").and_then(|()| o.flush());
        return;
    }
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{line}").and_then(|()| o.flush());
}

static PROTOCOL: std::sync::OnceLock<std::sync::Mutex<std::fs::File>> = std::sync::OnceLock::new();

/// Rule 7: the pipe to the parent moves to a descriptor of its own (close-on-exec), and stdout
/// becomes a copy of stderr, so what a library prints there cannot be read as the protocol.
pub(crate) fn private_protocol() -> std::io::Result<()> {
    use std::os::fd::FromRawFd;
    std::io::stdout().lock().flush()?;
    // SAFETY: F_DUPFD_CLOEXEC on fd 1 returns a new descriptor this function then owns.
    let fd = unsafe { libc::fcntl(1, libc::F_DUPFD_CLOEXEC, 3) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just made and is owned by nothing else.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    // SAFETY: both descriptors are open; dup2 replaces fd 1 atomically.
    if unsafe { libc::dup2(2, 1) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let _ = PROTOCOL.set(std::sync::Mutex::new(file));
    Ok(())
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
