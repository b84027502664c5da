//! NVIDIA's bug report for a service that is not root: a root helper the service can ask, but
//! not steer. NVIDIA's script refuses any user but root (`collect::bug_report`), and the
//! shipped service runs as `phq-agent`; so systemd runs the script for it, this way:
//!
//! 1. The service writes `REQUEST` in its own state directory (`ask`). Its contents are for a
//!    person reading the directory: nothing on the root side reads them.
//! 2. `phq-agent-bug-report.path` watches that file (`PathChanged=`: systemd.path(5), "activated
//!    if the file which was open for writing gets closed"; a rename onto the name counts too,
//!    systemd's path.c watches `IN_MOVED_TO`) and starts `phq-agent-bug-report.service`, a root
//!    oneshot whose command line is fixed in the unit: `phq-agent bug-report --out DIR`.
//! 3. That command (`answer`) runs the script through `collect::bug_report` (deadline, size cap,
//!    group kill) and leaves `LOG_NAME` and then `STATUS` in `DIR`, a directory root owns
//!    (0750 root:phq-agent, packaging's tmpfiles entry), each file 0640 root:phq-agent.
//! 4. The service waits, bounded by the script's deadline plus `SLACK`, for a `STATUS` that is
//!    new since its request, then takes the log when the status says there is one.
//!
//! Trust: the phq-agent user controls everything in its state directory, so the request is a
//! doorbell and nothing more: the root side takes no path, name, option or byte from it. It
//! writes only into `DIR`, which it refuses unless root owns it and no other user can write it
//! (`checked_out_dir`), and writes each file as a new one renamed into place
//! (`durable::write_owned`: `O_EXCL|O_NOFOLLOW`, owner and mode set on the descriptor), so a
//! link planted at a name is replaced, never written through. A flood of requests cannot keep
//! root running the script: at most one run per `MIN_INTERVAL`, remembered in `LAST_RUN` inside
//! `DIR` (root's, so the service cannot reset it), and systemd's own trigger and start limits
//! on top (systemd.path(5) `TriggerLimitBurst=`, systemd.unit(5) `StartLimitBurst=`).
//!
//! Why this design rather than a setuid binary, sudo rule or a D-Bus method: systemd already
//! runs the service's units, so the root side is one more unit with its own sandbox
//! (systemd.exec(5)) and nothing the service's user can pass to it; a socket-activated helper
//! would have to parse a request, and a setuid binary would inherit the caller's environment.
//!
//! Must not: follow a link in `DIR`, read the request's contents, or run the script more than
//! once per `MIN_INTERVAL`.

use super::bug_report::{self, BugReport, LOG_NAME};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// The request's name in the service's state directory (the path unit watches
/// `/var/lib/phq-agent/bug-report.request`, the default state directory's).
pub const REQUEST: &str = "bug-report.request";
/// Where the shipped root helper leaves the log (the root unit's `--out`, packaging's tmpfiles).
pub const DIR: &str = "/var/lib/phq-agent-bug-report";
/// The helper's answer, written after the log: `ok`, `refused` or `failed`, then one note line.
pub const STATUS: &str = "status";
/// The time (seconds since the epoch) of the helper's last run of the script.
pub const LAST_RUN: &str = "last-run";
/// The root side's own rate limit: the service's (`serve::bug_bundle::MIN_INTERVAL`), kept
/// here again because the service's word is not trusted.
pub const MIN_INTERVAL: Duration = Duration::from_secs(30 * 60);
/// What the service waits past the script's deadline: systemd starting the oneshot, and the
/// writing of the log.
pub const SLACK: Duration = Duration::from_secs(30);
/// Overrides `DIR` for the service (a test's directory).
pub const DIR_ENV: &str = "PHQ_BUG_REPORT_HELPER_DIR";
/// `helper`: always ask the root helper; `self`: always run the script in-process; `auto` (the
/// default): ask the helper when not root and `DIR` exists, else run it in-process.
pub const VIA_ENV: &str = "PHQ_BUG_REPORT_VIA";

/// How the service gets the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Via {
    /// Run the script itself (it is root, or no helper is installed).
    Itself,
    /// Ask the root helper, which leaves the log in this directory.
    Helper(PathBuf),
}

impl Via {
    /// `VIA_ENV` and `DIR_ENV`, else the shipped case: the helper when not root and its
    /// directory exists. `live`: the service watches this machine (a `--sysroot` fixture's
    /// machine has no helper of its own unless a test forces one).
    pub fn from_env(live: bool) -> Result<Via, String> {
        let dir = std::env::var_os(DIR_ENV).filter(|d| !d.is_empty()).map_or_else(|| PathBuf::from(DIR), PathBuf::from);
        match std::env::var(VIA_ENV).as_deref() {
            Ok("helper") => Ok(Via::Helper(dir)),
            Ok("self") => Ok(Via::Itself),
            Ok("auto") | Ok("") | Err(std::env::VarError::NotPresent) => {
                // SAFETY: geteuid has no preconditions and cannot fail.
                let root = unsafe { libc::geteuid() } == 0;
                Ok(if live && !root && dir.is_dir() { Via::Helper(dir) } else { Via::Itself })
            }
            Ok(other) => Err(format!("{VIA_ENV}={other:?}: expected helper, self or auto")),
            Err(e) => Err(format!("{VIA_ENV}: {e}")),
        }
    }
}

/// The root helper's answer, as `STATUS` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The log is in the directory.
    Ok,
    /// Within `MIN_INTERVAL` of the last run: the script did not run.
    Refused,
    /// The script ran and left no log (the note says why).
    Failed,
}

impl Outcome {
    fn word(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Refused => "refused",
            Outcome::Failed => "failed",
        }
    }
}

/// The root side (`phq-agent bug-report --out DIR`): one run of the script unless one ran within
/// `MIN_INTERVAL`; the log and then `STATUS` written into `out`, readable by `gid`. The outcome
/// and its note; an error when `out` is not a directory only root can write.
pub fn answer(out: &Path, gid: u32, options: &bug_report::Options) -> anyhow::Result<(Outcome, String)> {
    checked_out_dir(out, gid)?;
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs();
    let last = read_small(&out.join(LAST_RUN)).ok().and_then(|t| t.trim().parse::<u64>().ok());
    // A clock set back (last in the future) does not block the helper until it catches up.
    if let Some(last) = last.filter(|&l| l <= now && now - l < MIN_INTERVAL.as_secs()) {
        let note = format!(
            "{LOG_NAME}: not collected: the root helper ran the script {} s ago, and runs it at most once per {} min",
            now - last,
            MIN_INTERVAL.as_secs() / 60
        );
        write_status(out, gid, Outcome::Refused, &note)?;
        return Ok((Outcome::Refused, note));
    }
    // Noted before the run: a script that hangs or a helper that is killed still counts.
    crate::durable::write(&out.join(LAST_RUN), format!("{now}\n").as_bytes(), 0o600)
        .map_err(|e| anyhow::anyhow!("{}: {e}", out.join(LAST_RUN).display()))?;
    let report: BugReport = bug_report::collect(options, true, out);
    let log = out.join(LOG_NAME);
    let outcome = match &report.log {
        Some(bytes) => {
            crate::durable::write_owned(&log, bytes, 0o640, Some((0, gid)))
                .map_err(|e| anyhow::anyhow!("{}: {e}", log.display()))?;
            Outcome::Ok
        }
        None => {
            // An older run's log must not pass for this one's.
            match std::fs::remove_file(&log) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(anyhow::anyhow!("{}: cannot remove the last run's log: {e}", log.display()))
                }
                _ => {}
            }
            Outcome::Failed
        }
    };
    write_status(out, gid, outcome, &report.note)?;
    Ok((outcome, report.note))
}

fn write_status(out: &Path, gid: u32, outcome: Outcome, note: &str) -> anyhow::Result<()> {
    let path = out.join(STATUS);
    let text = format!("{}\n{}\n", outcome.word(), note.replace('\n', " "));
    crate::durable::write_owned(&path, text.as_bytes(), 0o640, Some((0, gid)))
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// `out` as the root side may write it: made 0750 (owner us, group `gid`) when missing;
/// otherwise a directory (not a link to one) that we own and no one else can write.
fn checked_out_dir(out: &Path, gid: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .mode(0o750)
                .create(out)
                .map_err(|e| anyhow::anyhow!("{}: cannot create: {e}", out.display()))?;
            // Through the directory's own descriptor, opened without following a link.
            let dir = open_dir_nofollow(out)?;
            std::os::unix::fs::fchown(&dir, Some(me), Some(gid))
                .and_then(|()| dir.set_permissions(std::fs::Permissions::from_mode(0o750)))
                .map_err(|e| anyhow::anyhow!("{}: cannot give it to group {gid}: {e}", out.display()))
        }
        Err(e) => Err(anyhow::anyhow!("{}: {e}", out.display())),
        Ok(m) if m.file_type().is_symlink() => {
            Err(anyhow::anyhow!("{}: a symbolic link; the helper writes only into a real directory", out.display()))
        }
        Ok(m) if !m.is_dir() => Err(anyhow::anyhow!("{}: not a directory", out.display())),
        Ok(m) if m.uid() != me || m.mode() & 0o022 != 0 => Err(anyhow::anyhow!(
            "{}: owned by uid {} with mode {:o}; the helper writes only into a directory of its own user (uid {me}) that no one else can write",
            out.display(),
            m.uid(),
            m.mode() & 0o7777
        )),
        Ok(_) => Ok(()),
    }
}

fn open_dir_nofollow(path: &Path) -> anyhow::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// A small regular file's text, never through a link.
fn read_small(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let (file, _) = crate::sysroot::open_regular(path, true)?;
    let mut text = String::new();
    file.take(4096).read_to_string(&mut text)?;
    Ok(text)
}

/// The service side: rings the doorbell (`request`, in the service's state directory), waits
/// at most `wait` for the helper's answer in `dir`, and takes the log it left. Blocks: for the
/// bundle's thread, never the event task.
pub fn ask(request: &Path, dir: &Path, wait: Duration) -> BugReport {
    use std::os::unix::fs::MetadataExt;
    let note = |why: String| BugReport { log: None, note: format!("{LOG_NAME}: not collected: {why}") };
    if !dir.is_dir() {
        return note(format!(
            "not root, and no root helper: {} is absent (phq-agent-bug-report.path and .service install it)",
            dir.display()
        ));
    }
    let status = dir.join(STATUS);
    // The answer must be a new file: the helper renames each one into place, a new inode.
    let before = std::fs::symlink_metadata(&status).ok().map(|m| (m.dev(), m.ino()));
    let asked = SystemTime::now();
    let stamp = humantime::format_rfc3339_seconds(asked);
    if let Err(e) = crate::durable::write(
        request,
        format!("asked at {stamp}; the root helper reads nothing of this file\n").as_bytes(),
        0o600,
    ) {
        return note(format!("cannot ask the root helper: {}: {e}", request.display()));
    }
    let asked = std::fs::metadata(request).and_then(|m| m.modified()).unwrap_or(asked);
    let until = Instant::now() + wait;
    loop {
        if let Some(answer) = new_answer(&status, before, asked) {
            return taken(dir, answer, asked);
        }
        if Instant::now() >= until {
            return note(format!(
                "the root helper did not answer within {wait:?} (is phq-agent-bug-report.path enabled? it watches {})",
                request.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `STATUS` when it is another file than `before` and no older than the request.
fn new_answer(status: &Path, before: Option<(u64, u64)>, asked: SystemTime) -> Option<(Outcome, String)> {
    use std::os::unix::fs::MetadataExt;
    let (file, meta) = crate::sysroot::open_regular(status, true).ok()?;
    if Some((meta.dev(), meta.ino())) == before || meta.modified().ok()? < asked {
        return None;
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(file, 4096), &mut text).ok()?;
    let (word, rest) = text.split_once('\n')?;
    let outcome = match word {
        "ok" => Outcome::Ok,
        "refused" => Outcome::Refused,
        _ => Outcome::Failed,
    };
    Some((outcome, crate::text::printable(rest.trim()).into_owned()))
}

fn taken(dir: &Path, (outcome, note): (Outcome, String), asked: SystemTime) -> BugReport {
    let prefix = "from the root helper (phq-agent-bug-report.service)";
    match outcome {
        Outcome::Ok => {
            let log = dir.join(LOG_NAME);
            let fresh = std::fs::symlink_metadata(&log).and_then(|m| m.modified()).is_ok_and(|t| t >= asked);
            if !fresh {
                return BugReport {
                    log: None,
                    note: format!("{LOG_NAME}: not collected: {prefix}: its log is older than the request"),
                };
            }
            match bug_report::read_capped(&log, bug_report::MAX_LOG_BYTES) {
                Ok(bytes) => BugReport { log: Some(bytes), note: format!("{prefix}: {note}") },
                Err(why) => BugReport { log: None, note: format!("{LOG_NAME}: left out: {prefix}: {why}") },
            }
        }
        Outcome::Refused => BugReport { log: None, note: format!("{note} (refused by the root helper's rate limit)") },
        Outcome::Failed => BugReport { log: None, note: format!("{prefix}: {note}") },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_helper_directory_is_said() {
        let dir = tempfile::tempdir().unwrap();
        let r = ask(&dir.path().join(REQUEST), &dir.path().join("absent"), Duration::from_millis(10));
        assert!(r.log.is_none() && r.note.contains("no root helper"), "{r:?}");
        assert!(!dir.path().join(REQUEST).exists(), "a request with no one to answer it");
    }

    #[test]
    fn a_helper_that_does_not_answer_is_said_and_an_old_status_is_no_answer() {
        let dir = tempfile::tempdir().unwrap();
        let helper = dir.path().join("helper");
        std::fs::create_dir(&helper).unwrap();
        // The last run's answer, from before this request.
        std::fs::write(helper.join(STATUS), "ok\nearlier\n").unwrap();
        std::fs::write(helper.join(LOG_NAME), b"earlier log").unwrap();
        let r = ask(&dir.path().join(REQUEST), &helper, Duration::from_millis(200));
        assert!(r.log.is_none() && r.note.contains("did not answer within 200ms"), "{r:?}");
        assert!(dir.path().join(REQUEST).is_file());
    }

    #[test]
    fn a_refusal_is_said_as_the_helpers_rate_limit() {
        let dir = tempfile::tempdir().unwrap();
        let helper = dir.path().join("helper");
        std::fs::create_dir(&helper).unwrap();
        let request = dir.path().join(REQUEST);
        let (h, r) = (helper.clone(), request.clone());
        // The helper's part: answers once the request is there.
        let answering = std::thread::spawn(move || {
            while !r.exists() {
                std::thread::sleep(Duration::from_millis(5));
            }
            crate::durable::write(&h.join(STATUS), b"refused\nran 5 s ago\n", 0o640).unwrap();
        });
        let got = ask(&request, &helper, Duration::from_secs(30));
        answering.join().unwrap();
        assert!(got.log.is_none() && got.note == "ran 5 s ago (refused by the root helper's rate limit)", "{got:?}");
    }
}
