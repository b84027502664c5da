//! NVIDIA's own support log: `nvidia-bug-report.sh`, run unattended under a deadline, its
//! `nvidia-bug-report.log.gz` kept for the support bundle. It must never hang the caller, leave a
//! process behind or fill a disk; a script that is absent, fails, overruns or writes too much is
//! a note, never an error.
//!
//! What the script is and does, from NVIDIA's script as the driver's .run package ships it
//! (`NVIDIA-Linux-x86_64-*/nvidia-bug-report.sh`, its `usage()` and start):
//! - installed as `/usr/bin/nvidia-bug-report.sh` (the .run installer's and the distributions'
//!   packages, e.g. Arch Linux's nvidia-utils PKGBUILD: `install -D -m755 nvidia-bug-report.sh
//!   "${pkgdir}/usr/bin/nvidia-bug-report.sh"`);
//! - `--output-file FILE` writes FILE, gzip'd to `FILE.gz` when gzip is present;
//! - `--safe-mode` "disable[s] some parts of the script that may hang the system": an unattended
//!   run on a machine whose GPU just failed takes it; `--extra-system-data` adds collection meant
//!   for diagnosing a hang by hand, and is not passed;
//! - it refuses to run unless `id -u` is 0 (`lspci -vxxx` and the kernel logs need root), and
//!   moves an existing log aside to `.old`, so it runs in a fresh private directory of its own.
//!
//! Run as root, the script reads files in every user's home (issue 51). Its walk, in NVIDIA's
//! R580 script (580.126.09, `$Change: 37062940 $`; the same loop in the R535-era copies): `cat
//! /etc/passwd | cut -d : -f 6 | sort | uniq`, and in each home it `cat`s `.nvidia-settings-rc`,
//! `.nv/nvidia-application-profiles-rc` and its `.backup`, `.d` and `.d.backup` (each file of a
//! directory), `.nv/nvidia-application-profile-globals-rc` and its `.backup`, and the first file
//! of `.config/vulkan{,sc}/icd.d/` and `.local/share/vulkan{,sc}/icd.d/`, each after a `[ -f ]`
//! or `[ -r ]` test, both of which follow symbolic links. A user who plants a link there has root
//! copy its target (the shadow file, a host key) into the log. So a root run (`run_in`) happens in
//! a mount namespace of its own whose `/etc/passwd` holds the uid-0 lines alone
//! (`Unshared::passwd`): the script walks root's home only, and no other user's. Where that
//! namespace cannot be made, the script is not run as root. Its `TMPDIR` and working directory
//! are its private directory, so its fixed temporary names (`$TMPDIR/nvbrtesttemp.$$` and
//! others) are in no directory another user can write.
//!
//! Must not: build a shell string (the script is the program, the arguments a list), follow a
//! link to its output, wait past the deadline (its whole process group is killed there), or let
//! a root script see any home but root's.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where the driver installs the script (module comment).
pub const DRIVER_SCRIPT: &str = "/usr/bin/nvidia-bug-report.sh";
/// The name NVIDIA support asks for, in the bundle and as the script writes it (`--output-file`
/// plus the `.gz` it appends).
pub const LOG_NAME: &str = "nvidia-bug-report.log.gz";
/// The script's whole run. Its own start message says it "may take several seconds"; on a
/// machine whose GPU hangs, a part it still runs in safe mode may block, and the bundle then
/// goes without the log. Two minutes bound an interactive `doctor --bundle` and a service
/// thread alike.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(120);
/// The largest log kept: the gzip'd logs support receives are a few MiB; the cap bounds what a
/// runaway script (a journal of months, a log in a loop) can add to each bundle, and so to the
/// bundles the service keeps in its state directory.
pub const MAX_LOG_BYTES: u64 = 32 << 20;
/// Names another script (a test's stand-in, or a driver installed elsewhere); also run under
/// `--sysroot`, since it is named for the machine being judged.
pub const SCRIPT_ENV: &str = "PHQ_BUG_REPORT_SCRIPT";
/// Overrides `DEFAULT_DEADLINE` (humantime, e.g. `30s`).
pub const DEADLINE_ENV: &str = "PHQ_BUG_REPORT_TIMEOUT";
/// How long a killed script is waited for before a thread of its own reaps it (one blocked in
/// the driver dies only when the driver lets go).
const REAP_GRACE: Duration = Duration::from_secs(5);

/// What to run, for how long, and how much to keep.
#[derive(Debug, Clone)]
pub struct Options {
    pub script: PathBuf,
    pub deadline: Duration,
    pub max_bytes: u64,
    /// The script named by `SCRIPT_ENV` rather than the driver's own path.
    pub named: bool,
    /// While the script runs, its process group's id (else 0), for an owner that must kill it
    /// when it stops early (`kill_group`).
    pub group: Option<Arc<AtomicI32>>,
}

impl Options {
    /// The driver's script and the defaults, unless the environment names others.
    pub fn from_env() -> Result<Options, String> {
        let named = std::env::var_os(SCRIPT_ENV).filter(|s| !s.is_empty());
        let deadline = match std::env::var(DEADLINE_ENV) {
            Ok(v) => humantime::parse_duration(&v).map_err(|e| format!("{DEADLINE_ENV}={v:?}: {e}"))?,
            Err(_) => DEFAULT_DEADLINE,
        };
        Ok(Options {
            script: named.clone().map_or_else(|| PathBuf::from(DRIVER_SCRIPT), PathBuf::from),
            deadline,
            max_bytes: MAX_LOG_BYTES,
            named: named.is_some(),
            group: None,
        })
    }
}

/// The log, when there is one, and one line that says what happened either way.
#[derive(Debug, Clone, Default)]
pub struct BugReport {
    pub log: Option<Vec<u8>>,
    pub note: String,
}

impl BugReport {
    fn note(note: String) -> BugReport {
        BugReport { log: None, note }
    }
}

/// Runs the script for the live machine (`live`), or one `SCRIPT_ENV` names; never the copy
/// under another `--sysroot`, which is a fixture's file, not a program to execute. `work_in`:
/// where its private directory is made (and removed again).
pub fn collect(options: &Options, live: bool, work_in: &Path) -> BugReport {
    if !live && !options.named {
        return BugReport::note(format!(
            "{LOG_NAME}: not collected: --sysroot names another machine, and its script is not executed here (name one with {SCRIPT_ENV})"
        ));
    }
    let script = options.script.display();
    match std::fs::metadata(&options.script) {
        Ok(m) if m.is_file() => {}
        Ok(_) => return BugReport::note(format!("{LOG_NAME}: not collected: {script} is not a regular file")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return BugReport::note(format!(
                "{LOG_NAME}: not collected: {script} is absent (the NVIDIA driver ships it)"
            ))
        }
        Err(e) => return BugReport::note(format!("{LOG_NAME}: not collected: {script}: {e}")),
    }
    let dir = match private_dir(work_in) {
        Ok(d) => d,
        Err(e) => {
            return BugReport::note(format!(
                "{LOG_NAME}: not collected: no private directory in {}: {e}",
                work_in.display()
            ))
        }
    };
    let report = run_in(options, &dir);
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the bug report's directory");
    }
    report
}

/// A new directory only this user can enter: `mkdir` fails rather than reuse one planted there.
fn private_dir(parent: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
    let dir = parent.join(format!(".bug-report-{}-{nanos}", std::process::id()));
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    Ok(dir)
}

fn run_in(options: &Options, dir: &Path) -> BugReport {
    let script = options.script.display();
    let started = Instant::now();
    // Its chatter goes to a file in its directory: no pipe to fill, and its last line says why
    // it failed.
    let output = match std::fs::File::create(dir.join("output.txt")) {
        Ok(f) => f,
        Err(e) => return BugReport::note(format!("{LOG_NAME}: not collected: {e}")),
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let unshared = match root.then(|| Unshared::prepare(dir)).transpose() {
        Ok(u) => u,
        Err(e) => {
            return BugReport::note(format!(
                "{LOG_NAME}: not collected: {script} would run as root, and it reads files in every home /etc/passwd names; no passwd of root alone could be made for it: {e}"
            ))
        }
    };
    let mut cmd = std::process::Command::new(&options.script);
    cmd.arg("--safe-mode")
        .arg("--output-file")
        .arg(dir.join("nvidia-bug-report.log"))
        .current_dir(dir)
        .env("TMPDIR", dir)
        .stdin(std::process::Stdio::null())
        .stderr(output.try_clone().map_or_else(|_| std::process::Stdio::null(), Into::into))
        .stdout(output)
        // A group of its own, so the deadline kills whatever it started too.
        .process_group(0);
    // The script dies with the thread that started it.
    super::deadline::dies_with_parent(&mut cmd);
    if let Some(u) = unshared {
        u.apply(&mut cmd);
    }
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) if root => {
            return BugReport::note(format!(
                "{LOG_NAME}: not collected: {script} runs as root only in a mount namespace where /etc/passwd names root alone, and that could not be set up: {e}"
            ))
        }
        Err(e) => return BugReport::note(format!("{LOG_NAME}: not collected: cannot run {script}: {e}")),
    };
    let unset = AtomicI32::new(0);
    let group = options.group.as_deref().unwrap_or(&unset);
    group.store(child.id() as i32, Ordering::Release);
    let ended = wait_group(child, options.deadline, group);
    let took = started.elapsed();
    match ended {
        Some(status) if status.success() => {}
        Some(status) => {
            return BugReport::note(format!(
                "{LOG_NAME}: not collected: {script} --safe-mode failed ({status}) after {took:.1?}{}",
                last_line(&dir.join("output.txt")).map(|l| format!(": {l}")).unwrap_or_default()
            ))
        }
        None => {
            return BugReport::note(format!(
            "{LOG_NAME}: not collected: {script} --safe-mode did not finish within {:?}; its process group was killed",
            options.deadline
        ))
        }
    }
    let log = dir.join(LOG_NAME);
    match read_capped(&log, options.max_bytes) {
        Ok(bytes) => BugReport {
            note: format!("{LOG_NAME}: {script} --safe-mode, {} bytes in {took:.1?}", bytes.len()),
            log: Some(bytes),
        },
        Err(why) => BugReport::note(format!("{LOG_NAME}: left out: {why}")),
    }
}

/// The mount namespace a root run of the script gets (module comment): its own, with nothing
/// propagating back, and `/etc/passwd` replaced by a file of the real one's uid-0 lines.
struct Unshared {
    passwd: std::ffi::CString,
    target: std::ffi::CString,
}

impl Unshared {
    const TARGET: &'static str = "/etc/passwd";

    /// Writes the root-only passwd into `dir` (the script's private directory).
    fn prepare(dir: &Path) -> std::io::Result<Unshared> {
        let real = std::fs::read_to_string(Self::TARGET)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", Self::TARGET)))?;
        let text = Self::passwd(&real);
        if text.is_empty() {
            return Err(std::io::Error::other(format!("{} names no user of uid 0", Self::TARGET)));
        }
        let path = dir.join("passwd");
        std::fs::write(&path, text)?;
        let c = |p: &Path| {
            std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
                .map_err(|_| std::io::Error::other(format!("{}: a NUL in the path", p.display())))
        };
        Ok(Unshared { passwd: c(&path)?, target: c(Path::new(Self::TARGET))? })
    }

    /// The lines of `real` whose uid (the third field) is 0: root's own entries, whose homes only
    /// root can write.
    fn passwd(real: &str) -> String {
        real.lines().filter(|l| l.split(':').nth(2) == Some("0")).map(|l| format!("{l}\n")).collect()
    }

    /// Has the child enter the namespace before it runs the script.
    fn apply(self, cmd: &mut std::process::Command) {
        // SAFETY: the closure makes only system calls (unshare(2), mount(2)) on C strings
        // prepared before the fork, and allocates nothing: it is safe between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let none = std::ptr::null();
                if libc::unshare(libc::CLONE_NEWNS) != 0
                    || libc::mount(none, c"/".as_ptr(), none, libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()) != 0
                    || libc::mount(self.passwd.as_ptr(), self.target.as_ptr(), none, libc::MS_BIND, std::ptr::null())
                        != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

/// Waits for the script until `deadline`; then, or once it has exited, kills its process group
/// so nothing it started is left. The exit status, or `None` when the deadline came first.
fn wait_group(
    mut child: std::process::Child,
    deadline: Duration,
    group: &AtomicI32,
) -> Option<std::process::ExitStatus> {
    let pid = child.id() as libc::pid_t;
    let until = Instant::now() + deadline;
    let exited = loop {
        if exited_unreaped(pid) {
            break true;
        }
        if Instant::now() >= until {
            break false;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // The script is a zombie or still running, so its pid (the group's id) is not yet free to
    // be reused: the signal reaches its group and nothing else.
    kill_group(group);
    if exited {
        return child.wait().ok();
    }
    let grace = Instant::now() + REAP_GRACE;
    while Instant::now() < grace {
        if let Ok(Some(_)) = child.try_wait() {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    tracing::warn!(pid, "the bug report script, killed at its deadline, has not exited; reaped when it does");
    let _ = std::thread::Builder::new().name("bug-report-reap".into()).spawn(move || child.wait());
    None
}

/// Kills the process group `group` holds, once: whoever takes the id first (the deadline, or
/// an owner stopping) sends the signal, before the script is reaped, so the id is still its.
pub fn kill_group(group: &AtomicI32) {
    let pgid = group.swap(0, Ordering::AcqRel);
    if pgid > 0 {
        // SAFETY: killpg has no memory preconditions; a group already empty is ESRCH.
        unsafe { libc::killpg(pgid, libc::SIGKILL) };
    }
}

/// Whether `pid` (our child) has exited, without reaping it (`WNOWAIT`).
fn exited_unreaped(pid: libc::pid_t) -> bool {
    // SAFETY: a zeroed siginfo_t is a valid out-parameter for waitid.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a live, writable siginfo_t; `pid` is our own unreaped child.
    let r = unsafe {
        libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT)
    };
    // SAFETY: waitid filled `info` (or left it zeroed, pid 0, under WNOHANG).
    r == 0 && unsafe { info.si_pid() } == pid
}

/// The log, if it is a regular file (never through a link) of at most `max` bytes.
pub(crate) fn read_capped(path: &Path, max: u64) -> Result<Vec<u8>, String> {
    let (file, meta) = match crate::sysroot::open_regular(path, true) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("the script succeeded but wrote no {}", path.display()))
        }
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    if meta.len() > max {
        return Err(format!("{} bytes, more than the {max} a bundle takes", meta.len()));
    }
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.len() as u64 > max {
        return Err(format!("more than the {max} bytes a bundle takes"));
    }
    Ok(bytes)
}

/// The last non-empty line of the script's output, at most 200 characters, made printable.
fn last_line(path: &Path) -> Option<String> {
    let text = std::fs::read(path).ok()?;
    let tail = &text[text.len().saturating_sub(4096)..];
    let line = String::from_utf8_lossy(tail).lines().rev().find(|l| !l.trim().is_empty())?.trim().to_string();
    Some(crate::text::printable(&line.chars().take(200).collect::<String>()).into_owned())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_scripts_passwd_names_uid_0_alone() {
        let real = "root:x:0:0:root:/root:/bin/bash\nphq-agent:x:998:998::/var/lib/phq-agent:/usr/sbin/nologin\n\
                    toor:x:0:0::/root:/bin/sh\nmallory:x:1000:1000::/home/mallory:/bin/bash\nbroken\n";
        assert_eq!(super::Unshared::passwd(real), "root:x:0:0:root:/root:/bin/bash\ntoor:x:0:0::/root:/bin/sh\n");
    }
}
