//! Running programs: the `Runner` the installer changes the machine through (a program and an
//! argument list, never a shell string), the real one (`SystemRunner`, logging to root's own
//! log), and a plan's `Cmd` run with its retries (`run_cmd`).
//!
//! The rules of this room:
//! 1. Every program is run as a program and its arguments; nothing here builds a shell string.
//! 2. A secret goes on stdin (`run_input`), never in an argument any user could read in /proc,
//!    and never into the log.
//! 3. Output without a bound of its own is read as it comes, not kept (`run_reading`).
//! 4. A failed command is a `CommandError` (program, arguments, exit status, the end of what it
//!    printed), not a formatted string.

use super::download::{download, MAX_DOWNLOAD_BYTES};
use super::own_dir;
use super::plan::{render_cmd, Arg, Cmd, Retry};
use super::{ActionError, Options};
use anyhow::Context;
use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

/// What a program did: its exit code (None: a signal ended it) and what it printed.
#[derive(Debug, Clone)]
pub struct Output {
    pub code: Option<i32>,
    /// Bytes: `dpkg-deb --fsys-tarfile` writes a tar stream.
    pub stdout: Vec<u8>,
    pub stderr: String,
}

impl Output {
    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }

    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// The world the installer changes. The real one runs programs and fetches over HTTP; tests
/// use a recording one.
pub trait Runner {
    fn run(&mut self, program: &str, args: &[String], env: &[(String, String)]) -> std::io::Result<Output>;
    /// `run` with `input` on the program's stdin: for a secret (a password) that must not be
    /// an argument, where any user could read it in /proc. Never logged.
    fn run_input(&mut self, program: &str, args: &[String], input: &[u8]) -> std::io::Result<Output>;
    /// `run` with the program's stdout handed to `read` as it is written, never kept whole: for
    /// output with no bound of its own (`dpkg-deb --fsys-tarfile` unpacks whatever a mirror's
    /// package holds). When `read` returns, the pipe is closed, which stops a program still
    /// writing as `head` stops its writer (its next write fails: SIGPIPE, or EPIPE where it
    /// ignores the signal), and its exit is waited for. The `Output` has no stdout.
    fn run_reading(
        &mut self,
        program: &str,
        args: &[String],
        read: &mut dyn FnMut(&mut dyn Read),
    ) -> std::io::Result<Output>;
    /// One download attempt of `url` to `to`.
    fn fetch(&mut self, url: &str, to: &Path) -> anyhow::Result<()>;
    fn sleep(&mut self, d: Duration);
}

/// How many lines of a failed command's output its error keeps.
const TAIL_LINES: usize = 6;

/// A program that exited otherwise than with 0 (omicron's `ExecutionError`): what ran, how it
/// ended, and the end of what it printed. Its message is one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandError {
    pub program: String,
    pub args: Vec<String>,
    /// The exit code; None when a signal ended it.
    pub status: Option<i32>,
    /// The last lines of its stderr, where apt, dpkg and dnf say why.
    pub stderr_tail: Vec<String>,
    /// The last lines of its stdout: apt prints its unmet dependencies there, before the
    /// `E:` lines it writes to stderr.
    pub stdout_tail: Vec<String>,
}

impl CommandError {
    /// `program args` ended with `out`.
    pub fn new(program: &str, args: &[String], out: &Output) -> CommandError {
        CommandError {
            program: program.into(),
            args: args.to_vec(),
            status: out.code,
            stderr_tail: last_lines(&out.stderr, TAIL_LINES),
            stdout_tail: last_lines(&out.stdout_text(), TAIL_LINES),
        }
    }
}

impl std::fmt::Display for CommandError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = Cmd {
            program: self.program.clone(),
            args: self.args.iter().cloned().map(Arg::Lit).collect(),
            env: Vec::new(),
            retry: Retry::Never,
            url: None,
        };
        // What it printed, in the order it is read: stdout's end, then stderr's.
        let said: Vec<&String> = self.stdout_tail.iter().chain(&self.stderr_tail).collect();
        let said: Vec<&str> = said[said.len().saturating_sub(TAIL_LINES)..].iter().map(|l| l.as_str()).collect();
        write!(f, "`{}` exited {}: {}", render_cmd(&shown, true), status(self.status), said.join(" / "))
    }
}

impl std::error::Error for CommandError {}

/// A command's arguments as they are (the repair's commands have no looked-up parts).
pub fn lit_args(c: &Cmd) -> Vec<String> {
    c.args
        .iter()
        .map(|a| match a {
            Arg::Lit(s) | Arg::AtDriverVersion(s) => s.clone(),
        })
        .collect()
}

/// Runs `c` with `args` (its arguments, looked-up parts filled in), shown on the progress line
/// and retried as its `retry` says; a failure names the URL of a network command.
pub fn run_cmd(c: &Cmd, args: &[String], runner: &mut dyn Runner, o: &mut Options) -> Result<(), ActionError> {
    run_cmd_output(c, args, runner, o).map(|_| ())
}

/// `run_cmd`, keeping what the command printed.
pub fn run_cmd_output(
    c: &Cmd,
    args: &[String],
    runner: &mut dyn Runner,
    o: &mut Options,
) -> Result<Output, ActionError> {
    let shown = render_cmd(&Cmd { args: args.iter().cloned().map(Arg::Lit).collect(), ..c.clone() }, true);
    (o.progress)(&format!("      $ {shown}"));
    let tries = if c.retry == Retry::Network { o.network_tries.max(1) } else { 1 };
    let lock_deadline = Instant::now() + o.lock_wait;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let out = runner.run(&c.program, args, &c.env).map_err(|e| {
            ActionError::new(match e.kind() {
                std::io::ErrorKind::NotFound => format!("{} is not installed on this guest", c.program),
                _ => format!("{}: {e}", c.program),
            })
        })?;
        if out.ok() {
            return Ok(out);
        }
        let text = format!("{}\n{}", out.stdout_text(), out.stderr);
        if c.retry == Retry::DpkgLock && is_dpkg_lock(&out.stderr) && Instant::now() < lock_deadline {
            (o.progress)("      another package manager holds the dpkg lock; waiting");
            runner.sleep(Duration::from_secs(5));
            continue;
        }
        // A signature refusal is dnf's verdict on what it fetched, not a network failure:
        // another try fetches the same packages and gets the same answer (dnf's wording:
        // "Public key for <file> is not installed", "GPG check FAILED").
        let refused = ["GPG check FAILED", "Public key for "].iter().any(|m| text.contains(m));
        if attempt < tries && !refused {
            (o.progress)(&format!("      failed (exit {}); trying again", status(out.code)));
            runner.sleep(Duration::from_secs(1 << attempt.min(5)));
            continue;
        }
        let failed = CommandError::new(&c.program, args, &out);
        return Err(ActionError {
            message: failed.to_string(),
            url: c.url.clone().filter(|_| c.retry == Retry::Network),
        });
    }
}

/// An exit status as the messages say it: its code, or that a signal ended the program.
fn status(code: Option<i32>) -> String {
    code.map(|c| c.to_string()).unwrap_or_else(|| "on a signal".into())
}

fn is_dpkg_lock(stderr: &str) -> bool {
    stderr.contains("dpkg frontend lock") || stderr.contains("lock-frontend") || stderr.contains("/var/lib/dpkg/lock")
}

/// The last `n` lines of `s` that say something, trimmed, joined with " / " for one line.
pub fn tail_lines(s: &str, n: usize) -> String {
    last_lines(s, n).join(" / ")
}

fn last_lines(s: &str, n: usize) -> Vec<String> {
    let lines: Vec<&str> = s.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].iter().map(|l| l.to_string()).collect()
}

/// What is kept of a program's stderr when its stdout is streamed (`Runner::run_reading`).
const MAX_STDERR_BYTES: usize = 64 << 10;

/// The real world: programs run with stdin closed and their output appended to `log`. The log
/// is for a person reading afterwards: a write to it that fails (a full disk) does not fail the
/// command, whose error carries its own output.
pub struct SystemRunner {
    pub log: Option<File>,
}

impl SystemRunner {
    /// Appends to `journal_dir/log` (root's alone, never through a link); without it, commands
    /// still run and only the log is missing, which is said.
    pub fn new(journal_dir: &Path) -> SystemRunner {
        let log = match own_dir::open_private(journal_dir, "log", true, 0o600) {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!("phq-agent install: no log: {e}");
                None
            }
        };
        SystemRunner { log }
    }
}

impl Runner for SystemRunner {
    fn run(&mut self, program: &str, args: &[String], env: &[(String, String)]) -> std::io::Result<Output> {
        let out = std::process::Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(std::process::Stdio::null())
            .output()?;
        if let Some(log) = &mut self.log {
            let _ = writeln!(log, "$ {program} {}", args.join(" "));
            let _ = log.write_all(&out.stdout);
            let _ = log.write_all(&out.stderr);
            let _ = writeln!(log, "(exit {:?})", out.status.code());
        }
        Ok(Output { code: out.status.code(), stdout: out.stdout, stderr: String::from_utf8_lossy(&out.stderr).into() })
    }

    fn run_input(&mut self, program: &str, args: &[String], input: &[u8]) -> std::io::Result<Output> {
        let mut child = std::process::Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        // Written from another thread: a program that writes much before reading its input
        // would otherwise block on a full pipe while we block on its stdin.
        let writer = child.stdin.take().map(|mut stdin| {
            let input = input.to_vec();
            std::thread::spawn(move || stdin.write_all(&input))
        });
        let out = child.wait_with_output()?;
        if let Some(w) = writer {
            // A program that exits without reading its input closes the pipe: its exit status
            // says what went wrong, not our write.
            let _ = w.join();
        }
        if let Some(log) = &mut self.log {
            let _ = writeln!(log, "$ {program} {} (input on stdin, not logged)", args.join(" "));
            let _ = log.write_all(&out.stdout);
            let _ = log.write_all(&out.stderr);
            let _ = writeln!(log, "(exit {:?})", out.status.code());
        }
        Ok(Output { code: out.status.code(), stdout: out.stdout, stderr: String::from_utf8_lossy(&out.stderr).into() })
    }

    fn run_reading(
        &mut self,
        program: &str,
        args: &[String],
        read: &mut dyn FnMut(&mut dyn Read),
    ) -> std::io::Result<Output> {
        let mut child = std::process::Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        // stderr is read to its end on another thread, so a program that writes much of it never
        // blocks on a full pipe, and only its first `MAX_STDERR_BYTES` are kept.
        let stderr = child.stderr.take().map(|mut e| {
            std::thread::spawn(move || {
                let (mut kept, mut chunk) = (Vec::new(), [0u8; 8192]);
                while let Ok(n @ 1..) = e.read(&mut chunk) {
                    let room = MAX_STDERR_BYTES.saturating_sub(kept.len());
                    kept.extend_from_slice(&chunk[..n.min(room)]);
                }
                kept
            })
        });
        if let Some(mut stdout) = child.stdout.take() {
            read(&mut stdout);
        } // the pipe closes here
        let status = child.wait()?;
        let stderr = stderr.and_then(|t| t.join().ok()).unwrap_or_default();
        if let Some(log) = &mut self.log {
            let _ = writeln!(log, "$ {program} {} (stdout read, not logged)", args.join(" "));
            let _ = log.write_all(&stderr);
            let _ = writeln!(log, "(exit {:?})", status.code());
        }
        Ok(Output { code: status.code(), stdout: Vec::new(), stderr: String::from_utf8_lossy(&stderr).into() })
    }

    fn fetch(&mut self, url: &str, to: &Path) -> anyhow::Result<()> {
        let bytes = download(url, MAX_DOWNLOAD_BYTES)?;
        crate::durable::write(to, &bytes, 0o644).with_context(|| to.display().to_string())
    }

    fn sleep(&mut self, d: Duration) {
        std::thread::sleep(d);
    }
}

#[cfg(test)]
mod tests;
