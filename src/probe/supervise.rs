//! Supervising a child process that speaks the probes' protocol: the service's probe child
//! (`child.rs`) and each NCCL all-reduce (`allreduce.rs`). The parent hands the child its request
//! on stdin, hears `step …` lines and one `answer …` line, kills it at its deadline and reaps
//! it; the child keeps the protocol on a descriptor of its own and dies with the thread that
//! started it. The rule numbers are those at the top of `child.rs`.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

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
    // Rule 6.
    crate::collect::deadline::dies_with_parent(&mut cmd);
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

/// One line of a child's protocol, flushed at once (rule 2): the parent may kill the child at
/// any moment and must have heard the last step. On the protocol's own descriptor once
/// `private_protocol` has made one (rule 7), else on stdout.
/// A command that runs this very program: the image this process runs (`/proc/self/exe`), not
/// the file at its path, which a package upgrade may have replaced or removed meanwhile (issue
/// 51: an all-reduce started from `current_exe()` under a rebuilt binary failed with "No such
/// file or directory"). proc(5): `/proc/[pid]/exe` is a link to the executed command, and the
/// kernel opens it as the file the process runs, so execve(2) through it starts the same
/// program whatever became of its path; `argv[0]` stays the program's name.
pub(crate) fn this_program() -> std::process::Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new("/proc/self/exe");
    cmd.arg0(env!("CARGO_PKG_NAME"));
    cmd
}

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
