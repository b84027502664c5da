//! Apply a plan: every command through a `Runner` (program + arguments, never a shell), every
//! finished step journaled in `JOURNAL_DIR/state.json` (written whole to a temporary file,
//! fsynced, renamed), one installer at a time under a `flock`.
//!
//! The journal, its lock and the log live in a directory that root owns and nobody else can
//! write (`journal_dir`), never in the service's state directory: the service's user owns that
//! one, and whatever it can write it could turn into a link that root follows, or into a
//! journal that starts a root install at the next boot.
//!
//! Resuming is planning again: a step the machine already has is skipped by the plan, and one
//! whose effect the plan cannot see (a hold, an enabled unit in a chroot) is skipped when the
//! journal holds it with the same hash. A step killed half-way is not journaled, so it runs
//! again — each is idempotent.

use super::plan::{Action, Arg, Cmd, Plan, Retry, StepId, DKMS_MOK, DOWNLOAD_DIR, MOK_PASSWORD_FILE};
use crate::checks::{Finding, Severity};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const STATE_SCHEMA: &str = "phq.install/v1";

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
    fn fetch(&mut self, url: &str, to: &Path) -> Result<(), String>;
    fn sleep(&mut self, d: Duration);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RebootPolicy {
    Auto,
    Never,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    Running,
    RebootRequired,
    Rebooting,
    Failed,
    Done,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub finished_at: String,
    pub hash: String,
    pub seconds: f64,
}

/// The journal, and the installer's state in reports (`install`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub schema: String,
    pub status: Status,
    pub plan: String,
    pub started_at: String,
    pub updated_at: String,
    /// Steps finished, by id.
    pub steps: BTreeMap<String, StepRecord>,
    /// The boot in which a step that needs a reboot finished; cleared by the next boot.
    /// `"unknown"` when the boot id could not be read (then only a person can tell).
    pub reboot_pending_since: Option<String>,
    pub reboot_reason: Option<String>,
    pub reboots: u32,
    pub error: Option<String>,
    pub findings: Vec<Finding>,
}

impl State {
    fn new(plan: &Plan) -> State {
        let now = crate::snapshot::Timestamp::now().to_string();
        State {
            schema: STATE_SCHEMA.into(),
            status: Status::Running,
            plan: plan.summary.clone(),
            started_at: now.clone(),
            updated_at: now,
            steps: BTreeMap::new(),
            reboot_pending_since: None,
            reboot_reason: None,
            reboots: 0,
            error: None,
            findings: Vec::new(),
        }
    }
}

/// Where the installer keeps its journal (`state.json`, readable by all: the service reports it,
/// cloud-init and phq-agent-install.service look at it), its lock and its log (root's alone).
/// Root's, 0755; made by the package's tmpfiles entry and by the installer itself.
pub const JOURNAL_DIR: &str = "/var/lib/phq-agent-install";

pub fn state_path(journal_dir: &Path) -> PathBuf {
    journal_dir.join("state.json")
}

/// The journal is a few kilobytes; a larger file is not one the installer wrote.
const MAX_JOURNAL_BYTES: u64 = 4 << 20;

/// The journal as it is on disk; `Ok(None)` when no install has run. Read without following a
/// link, and only from a regular file (a FIFO would hang the reader).
pub fn load_state(journal_dir: &Path) -> Result<Option<State>, String> {
    let path = state_path(journal_dir);
    match crate::sysroot::read_regular(&path, true, MAX_JOURNAL_BYTES) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Makes `dir` the installer's own directory, or says why it cannot be: it must be a real
/// directory (not a link) owned by this process's user and writable by nobody else. Created
/// 0755 when missing; a directory that others can write is refused, not repaired, since
/// someone may already have planted something in it.
pub fn journal_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    match std::fs::DirBuilder::new().mode(0o755).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(format!("{}: {e}", dir.display())),
        _ => {}
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !meta.file_type().is_dir() || meta.uid() != me || meta.mode() & 0o022 != 0 {
        return Err(format!(
            "{}: not a directory of uid {me} that only it can write (a link, another user's, or open to others: mode {:o}); the installer keeps its journal where nobody else can plant a file — remove it and rerun",
            dir.display(),
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Opens `name` in the installer's directory for writing without following a link (open(2):
/// `O_NOFOLLOW` fails with ELOOP on a symbolic link), created with `mode`; only a regular file
/// is accepted.
fn open_private(dir: &Path, name: &str, append: bool, mode: u32) -> Result<File, String> {
    journal_dir(dir)?;
    let path = dir.join(name);
    crate::sysroot::open_regular_rw(&path, append, mode).map_err(|e| format!("{}: {e}", path.display()))
}

/// The journal's bytes as written to `state.json`. cloud-init's user-data greps them for
/// `"status": "reboot-required"` to decide on its reboot, so this encoding is a contract.
pub fn journal_bytes(st: &State) -> Result<Vec<u8>, String> {
    serde_json::to_vec_pretty(st).map_err(|e| format!("cannot encode the journal: {e}"))
}

fn save(journal_dir: &Path, st: &mut State) -> Result<(), String> {
    st.updated_at = crate::snapshot::Timestamp::now().to_string();
    self::journal_dir(journal_dir)?;
    let path = state_path(journal_dir);
    let json = journal_bytes(st)?;
    crate::durable::write(&path, &json, 0o644).map_err(|e| format!("{}: cannot write the journal: {e}", path.display()))
}

/// Held for the whole install; the kernel drops it when the process dies, `kill -9` included.
pub struct Lock {
    _file: File,
}

fn lock_file(journal_dir: &Path) -> Result<(File, PathBuf), String> {
    let file = open_private(journal_dir, "lock", false, 0o600)?;
    Ok((file, journal_dir.join("lock")))
}

/// Writes our pid into the lock file we hold, for the message another installer prints.
fn claim(mut file: File) -> Lock {
    let _ = file.set_len(0);
    let _ = writeln!(file, "{}", std::process::id());
    Lock { _file: file }
}

/// Waits for the lock instead of refusing: `--resume` at boot, when cloud-init's own install
/// may still be running.
pub fn lock_wait(journal_dir: &Path) -> Result<Lock, String> {
    let (file, path) = lock_file(journal_dir)?;
    file.lock().map_err(|e| format!("{}: cannot lock: {e}", path.display()))?;
    Ok(claim(file))
}

/// The lock, or why not: another installer holds it (with its pid).
pub fn lock(journal_dir: &Path) -> Result<Lock, String> {
    let (file, path) = lock_file(journal_dir)?;
    match file.try_lock() {
        Ok(()) => Ok(claim(file)),
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = crate::sysroot::read_regular(&path, true, 64)
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default();
            let holder = holder.trim();
            Err(format!(
                "another phq-agent install is running{} (it holds {}); wait for it, or see `journalctl -u phq-agent-install`",
                if holder.is_empty() { String::new() } else { format!(" as pid {holder}") },
                path.display()
            ))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(format!("{}: cannot lock: {e}", path.display())),
    }
}

/// What apply needs from outside the plan.
pub struct Options<'a> {
    /// The journal's directory (`JOURNAL_DIR` outside tests).
    pub journal_dir: PathBuf,
    /// Files the plan writes land under this root (`/` outside tests).
    pub root: PathBuf,
    pub reboot: RebootPolicy,
    pub boot_id: Option<String>,
    pub network_tries: u32,
    /// How long to wait for a dpkg lock held by someone else.
    pub lock_wait: Duration,
    pub progress: &'a mut dyn FnMut(&str),
    pub verify: &'a mut dyn FnMut() -> Vec<Finding>,
    pub reboot_now: &'a mut dyn FnMut() -> Result<(), String>,
}

/// Runs the plan to its end, a failure, or a reboot; returns the journal as it was left.
pub fn apply(plan: &Plan, runner: &mut dyn Runner, o: &mut Options) -> Result<State, String> {
    let mut st = match load_state(&o.journal_dir) {
        Ok(Some(st)) => st,
        Ok(None) => State::new(plan),
        Err(e) => {
            (o.progress)(&format!("the journal is unreadable ({e}); starting it afresh — every step is idempotent"));
            State::new(plan)
        }
    };
    forget_mok_password_once_enrolled(runner, o);
    st.plan = plan.summary.clone();
    st.status = Status::Running;
    st.error = None;
    st.findings = plan.findings.clone();
    // A different boot than the one that needed a reboot: it happened.
    if let (Some(pending), Some(now)) = (&st.reboot_pending_since, &o.boot_id) {
        if pending != now && pending != "unknown" {
            st.reboot_pending_since = None;
            st.reboot_reason = None;
            st.reboots += 1;
        }
    }
    save(&o.journal_dir, &mut st)?;

    let is_deb = plan.distro.is_deb();
    let n = plan.steps.len();
    for (i, step) in plan.steps.iter().enumerate() {
        let head = format!("[{}/{n}] {}", i + 1, step.id);
        // The reboot is decided by the journal as much as by the plan: a step of an earlier
        // run in this same boot may be waiting for it.
        if step.actions.iter().any(|a| matches!(a, Action::Reboot)) {
            if st.reboot_pending_since.is_none() && st.reboots == 0 {
                if let Some(r) = &plan.reboot_reason {
                    st.reboot_pending_since = Some(o.boot_id.clone().unwrap_or_else(|| "unknown".into()));
                    st.reboot_reason = Some(r.clone());
                }
            }
            if st.reboot_pending_since.is_none() {
                (o.progress)(&format!("{head}: not needed"));
                continue;
            }
            let reason = st.reboot_reason.clone().unwrap_or_else(|| "a step needs it".into());
            if let Some(unsafe_boot) = boot_gate(plan, runner, o, &head) {
                st.status = Status::RebootRequired;
                st.error = Some(unsafe_boot.summary.clone());
                st.findings.push(unsafe_boot);
                save(&o.journal_dir, &mut st)?;
                return Ok(st);
            }
            return Ok(reboot(&mut st, o, &head, &reason));
        }
        if let Some(why) = &step.done {
            let said = if step.actions.is_empty() { "not needed" } else { "already done" };
            (o.progress)(&format!("{head}: {said} ({why})"));
            continue;
        }
        let hash = step.hash(is_deb);
        // The repair is planned only when dpkg is half-done now, so a repair finished in an
        // earlier run says nothing about this one (a later kill can leave dpkg half-done again).
        if step.id != StepId::Repair && st.steps.get(step.id.as_str()).is_some_and(|r| r.hash == hash) {
            (o.progress)(&format!("{head}: done in an earlier run"));
            continue;
        }
        if step.actions.iter().any(|a| matches!(a, Action::Verify)) {
            (o.progress)(&format!("{head}: {}", step.title));
            let mut wrong: Vec<Finding> = (o.verify)().into_iter().filter(|f| f.severity >= Severity::Warn).collect();
            // After the install's own reboot the VM should run the kernel it meant to boot, the
            // newest installed (the gate checked that one has the module).
            if st.reboots > 0 {
                let next = next_boot_kernel(plan, runner, &o.root);
                if next != plan.kernel {
                    wrong.push(
                        Finding::warn(
                            "install.running-kernel",
                            format!("the VM came back on kernel {}, not the newest installed, {next}", plan.kernel),
                        )
                        .detail("The install rebooted expecting the newest kernel, the one GRUB's default entry starts and the boot-safety gate checked; the boot loader chose another (GRUB_DEFAULT set to a saved or named entry, or a choice at the console).")
                        .remedy(format!("Check GRUB_DEFAULT in /etc/default/grub (0 boots the newest), or boot {next} once with `grub-reboot`; `phq-agent doctor` shows whether each kernel has the module.")),
                    );
                }
            }
            for f in &wrong {
                (o.progress)(&format!("      {} {}: {}", f.severity.label(), f.id, f.summary));
            }
            st.findings.extend(wrong);
            st.status = Status::Done;
            save(&o.journal_dir, &mut st)?;
            return Ok(st);
        }
        // A step that runs (again) may change what the later steps built on: a replaced driver
        // takes its fabric manager's match and its version locks with it, though the later
        // steps' commands read the same (real dnf showed the locks gone and the journal calling
        // the hold done). Their records go, so they are judged afresh. Not for the dpkg repair,
        // which finishes earlier work rather than changing it, nor for the pre-flight, which
        // runs whenever anything is left and only resolves.
        if !matches!(step.id, StepId::Repair | StepId::Preflight) {
            let later: Vec<&str> = plan.steps[i + 1..].iter().map(|s| s.id.as_str()).collect();
            st.steps.retain(|id, _| !later.contains(&id.as_str()));
        }
        (o.progress)(&format!("{head}: {}", step.title));
        let started = Instant::now();
        let mut skipped = None;
        for action in &step.actions {
            match run_action(action, plan, runner, o) {
                Ok(None) => {}
                Ok(Some(why)) => {
                    skipped = Some(why);
                    break;
                }
                Err(e) => {
                    st.status = Status::Failed;
                    st.error = Some(format!("step {}: {}", step.id, e.message));
                    st.findings.push(e.finding(step.id.as_str()));
                    save(&o.journal_dir, &mut st)?;
                    return Ok(st);
                }
            }
        }
        // Skipped with a warning (NCCL with no build for this CUDA): the install goes on, and
        // the step is not journaled, so the next run looks at the repository again.
        if let Some(why) = skipped {
            (o.progress)(&format!("      skipped: {}", why.summary));
            st.findings.push(why);
            save(&o.journal_dir, &mut st)?;
            continue;
        }
        let seconds = (started.elapsed().as_secs_f64() * 10.0).round() / 10.0;
        (o.progress)(&format!("      ok ({seconds} s)"));
        st.steps.insert(
            step.id.to_string(),
            StepRecord { finished_at: crate::snapshot::Timestamp::now().to_string(), hash, seconds },
        );
        if step.needs_reboot && st.reboot_pending_since.is_none() {
            st.reboot_pending_since = Some(o.boot_id.clone().unwrap_or_else(|| "unknown".into()));
            st.reboot_reason = Some(format!("step {} changed the kernel modules or the initramfs", step.id));
        }
        save(&o.journal_dir, &mut st)?;
    }
    st.status = Status::Done;
    save(&o.journal_dir, &mut st)?;
    Ok(st)
}

/// The boot-safety gate: before a reboot that should bring the driver up, the kernel that boots
/// next must have an `nvidia` module of the installed driver's version, and under Secure Boot
/// one signed by a key the firmware trusts; otherwise the VM would come back without its GPUs.
/// None when it is safe (or cannot be checked: said on the progress line), else the finding.
fn boot_gate(plan: &Plan, runner: &mut dyn Runner, o: &mut Options, head: &str) -> Option<Finding> {
    let check = plan.boot_check?;
    let kernel = next_boot_kernel(plan, runner, &o.root);
    let modinfo = |runner: &mut dyn Runner, field: &str| {
        runner.run("modinfo", &["-k".into(), kernel.clone(), "-F".into(), field.into(), "nvidia".into()], &[])
    };
    let version = match modinfo(runner, "version") {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            (o.progress)(&format!("{head}: modinfo is not installed, so the module of kernel {kernel} cannot be checked before the reboot"));
            return None;
        }
        Err(e) => return Some(unsafe_boot(&kernel, format!("modinfo: {e}"))),
        Ok(out) if !out.ok() || out.stdout_text().trim().is_empty() => {
            return Some(unsafe_boot(&kernel, format!("kernel {kernel} has no nvidia module ({})", out.stderr.trim())))
        }
        Ok(out) => out.stdout_text().trim().to_string(),
    };
    let want = match query_driver_version(plan, runner) {
        Ok(v) => v,
        Err(e) => return Some(unsafe_boot(&kernel, e.message)),
    };
    if version != want {
        return Some(unsafe_boot(
            &kernel,
            format!("its nvidia module is version {version}, the installed driver {want}"),
        ));
    }
    if check.secure_boot {
        let signer = modinfo(runner, "signer").map(|o| o.stdout_text().trim().to_string()).unwrap_or_default();
        if signer.is_empty() {
            return Some(unsafe_boot(&kernel, "its nvidia module is unsigned and Secure Boot is on".into()));
        }
        // A module DKMS signed loads only once its machine-owner key is enrolled; a
        // distribution's signed build is trusted through shim.
        if signer.contains("DKMS") {
            match mok_state(DKMS_MOK, runner) {
                MokState::Trusted => forget_mok_password(o),
                MokState::Queued => return Some(mok_confirm(&kernel, &o.root)),
                other => {
                    return Some(
                        unsafe_boot(&kernel, format!("its nvidia module is signed by DKMS's key ({signer}), which the firmware does not trust: {}", other.describe()))
                            .remedy(format!("Rerun phq-agent install: it queues the enrolment of {DKMS_MOK} (or by hand: `mokutil --import {DKMS_MOK}`), then confirm it at the VM console on the next boot.")),
                    );
                }
            }
        }
    }
    (o.progress)(&format!("{head}: kernel {kernel} has nvidia {version}; safe to reboot"));
    None
}

/// Whether the firmware trusts a certificate, as `mokutil --test-key` tells (mokutil's
/// `test_key` and `print_skip_message`: "is not enrolled"; "is already in db", "is already
/// enrolled" (MokListRT); "is already in the enrollment request" (MokNew); "is blocked in dbx" /
/// "in MokListX"; on stderr "is already in the built-in trusted keyring" and "Failed to open").
#[derive(Debug, Clone, PartialEq)]
enum MokState {
    Trusted,
    Queued,
    Absent,
    Blocked(String),
    /// The certificate is not there (DKMS has not signed anything yet).
    NoKey,
    Unknown(String),
}

impl MokState {
    fn describe(&self) -> String {
        match self {
            MokState::Trusted => "it is enrolled".into(),
            MokState::Queued => "its enrolment is queued, not yet confirmed".into(),
            MokState::Absent => "it is not enrolled".into(),
            MokState::Blocked(t) | MokState::Unknown(t) => format!("mokutil says {t:?}"),
            MokState::NoKey => "the certificate is not there".into(),
        }
    }
}

fn mok_state(key: &str, runner: &mut dyn Runner) -> MokState {
    let out = match runner.run("mokutil", &["--test-key".into(), key.into()], &[]) {
        Ok(out) => out,
        Err(e) => return MokState::Unknown(format!("mokutil: {e}")),
    };
    let text = format!("{}{}", out.stdout_text(), out.stderr);
    let has = |s: &str| text.contains(s);
    if has("is already enrolled") || has("is already in db") || has("is already in the built-in trusted keyring") {
        MokState::Trusted
    } else if has("is already in the enrollment request") {
        MokState::Queued
    } else if has("is blocked in") {
        MokState::Blocked(text.trim().to_string())
    } else if has("is not enrolled") {
        MokState::Absent
    } else if has("Failed to open") {
        MokState::NoKey
    } else {
        MokState::Unknown(text.trim().to_string())
    }
}

/// The one-time password of an enrolment: 12 characters a person can read off one screen and
/// type into the MOK manager's prompt (mokutil takes 1 to 256), without look-alikes (0/o, 1/l).
fn mok_password() -> Result<String, String> {
    const ALPHABET: &[u8] = b"abcdefghjkmnpqrstuvwxyz23456789";
    // Bytes at or above the largest multiple of the alphabet's size are skipped, so every
    // character is equally likely.
    let limit = (256 / ALPHABET.len() * ALPHABET.len()) as u8;
    let mut urandom = File::open("/dev/urandom").map_err(|e| format!("/dev/urandom: {e}"))?;
    let mut out = String::new();
    while out.len() < 12 {
        let mut bytes = [0u8; 32];
        std::io::Read::read_exact(&mut urandom, &mut bytes).map_err(|e| format!("/dev/urandom: {e}"))?;
        out.extend(bytes.iter().filter(|b| **b < limit).map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char));
    }
    out.truncate(12);
    Ok(out)
}

/// Queue `key` for enrolment unless the firmware trusts it or it is queued already.
fn enroll_mok(key: &str, runner: &mut dyn Runner, o: &mut Options) -> Result<(), StepError> {
    match mok_state(key, runner) {
        MokState::Trusted => {
            (o.progress)(&format!("      {key} is enrolled already"));
            forget_mok_password(o);
            return Ok(());
        }
        MokState::Queued => {
            (o.progress)(&format!("      {key} is queued for enrolment already; it is confirmed at the console on the next boot"));
            return Ok(());
        }
        MokState::Absent => {}
        MokState::NoKey => {
            return Err(err(format!(
                "{key} is not there: DKMS made no signing key while building the driver (see /etc/dkms/framework.conf, mok_signing_key and mok_certificate, and `dkms status`)"
            )))
        }
        other @ (MokState::Blocked(_) | MokState::Unknown(_)) => {
            return Err(err(format!("cannot enrol {key}: {}", other.describe())))
        }
    }
    let dir = under(&o.root, DOWNLOAD_DIR);
    private_dir(&dir).map_err(err)?;
    let password = mok_password().map_err(err)?;
    let file = dir.join(MOK_PASSWORD_FILE);
    crate::durable::write(&file, format!("{password}\n").as_bytes(), 0o600)
        .map_err(|e| err(format!("{}: {e}", file.display())))?;
    // mokutil reads the password twice from stdin (`get_password`: "input password:", "input
    // password again:"; `read_hidden_line` takes each line with getline, turning echo off only
    // when stdin is a terminal, so a pipe works).
    let input = format!("{password}\n{password}\n");
    let out = runner
        .run_input("mokutil", &["--import".into(), key.into()], input.as_bytes())
        .map_err(|e| err(format!("mokutil --import {key}: {e}")))?;
    if !out.ok() {
        return Err(err(format!("mokutil --import {key} failed ({}): {}", code(&out), out.stderr.trim())));
    }
    (o.progress)(&format!(
        "      {key} is queued for enrolment; its one-time password is in {DOWNLOAD_DIR}/{MOK_PASSWORD_FILE} (root-only)"
    ));
    Ok(())
}

/// The one-time password of a MOK enrolment is needed only until the key is enrolled: then it
/// goes, so no root-only secret lingers on the disk (or in a backup of it).
fn forget_mok_password(o: &mut Options) {
    let file = under(&o.root, &format!("{DOWNLOAD_DIR}/{MOK_PASSWORD_FILE}"));
    match std::fs::remove_file(&file) {
        Ok(()) => (o.progress)(&format!(
            "      DKMS's key is enrolled: its one-time password is deleted ({})",
            file.display()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => (o.progress)(&format!("      cannot delete {}: {e}", file.display())),
    }
}

/// At every run: a password kept from an earlier enrolment is deleted once the firmware trusts
/// the key (the run after the console's reboot asks nothing else of mokutil).
fn forget_mok_password_once_enrolled(runner: &mut dyn Runner, o: &mut Options) {
    let file = under(&o.root, &format!("{DOWNLOAD_DIR}/{MOK_PASSWORD_FILE}"));
    if std::fs::symlink_metadata(&file).is_ok() && mok_state(DKMS_MOK, runner) == MokState::Trusted {
        forget_mok_password(o);
    }
}

/// `dnf repolist --all`: each repository's id and whether it is enabled. dnf prints a header
/// ("repo id  repo name  status") and one line per repository, the id first and the status last.
pub fn parse_repolist(text: &str) -> Vec<(String, bool)> {
    text.lines()
        .filter(|l| !l.starts_with("repo id"))
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let enabled = match *words.last()? {
                "enabled" => true,
                "disabled" => false,
                _ => return None,
            };
            Some((words[0].to_string(), enabled))
        })
        .collect()
}

/// The CodeReady Builder repository for this machine: among the `codeready-builder` ids (not
/// debug or source), the one of the same kind as the enabled BaseOS — the same markers among
/// `eus`, `e4s`, `aus` and `rhui` (`rhel-9-for-x86_64-baseos-eus-rpms` goes with
/// `codeready-builder-for-rhel-9-x86_64-eus-rpms`, `rhel-9-baseos-rhui-rpms` with
/// `codeready-builder-for-rhel-9-rhui-rpms`). Its id and whether it is enabled already.
pub fn crb_repo(repos: &[(String, bool)]) -> Result<(String, bool), String> {
    let markers = |id: &str| -> Vec<&'static str> {
        let words: Vec<&str> = id.split('-').collect();
        ["eus", "e4s", "aus", "rhui"].into_iter().filter(|m| words.contains(m)).collect()
    };
    let crb: Vec<&(String, bool)> = repos
        .iter()
        .filter(|(id, _)| id.contains("codeready-builder"))
        .filter(|(id, _)| !["debug", "source", "srpms"].iter().any(|x| id.contains(x)))
        .collect();
    let baseos = repos.iter().find(|(id, on)| *on && id.contains("baseos")).map(|(id, _)| id.as_str());
    let Some(baseos) = baseos else {
        return Err("no BaseOS repository is enabled (dnf repolist --all), so there is no telling which CodeReady Builder repository goes with it".into());
    };
    let want = markers(baseos);
    let matching: Vec<&&(String, bool)> = crb.iter().filter(|(id, _)| markers(id) == want).collect();
    match matching.as_slice() {
        [one] => Ok((one.0.clone(), one.1)),
        [] => Err(format!(
            "no CodeReady Builder repository goes with the enabled {baseos} (dnf knows {}); register the machine (subscription-manager register) or ask the cloud's RHUI for it",
            if crb.is_empty() { "none".to_string() } else { crb.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>().join(", ") }
        )),
        many => Err(format!(
            "several CodeReady Builder repositories go with {baseos}: {}; enable one (dnf config-manager --set-enabled <id>) and rerun",
            many.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// Enable the CodeReady Builder repository `crb_repo` picks. subscription-manager owns the
/// repositories in /etc/yum.repos.d/redhat.repo and rewrites that file, so those are enabled
/// through it (`subscription-manager repos --enable`, as Red Hat documents for CRB); the others
/// (RHUI's files) through `dnf config-manager --set-enabled`.
fn enable_crb(runner: &mut dyn Runner, o: &mut Options) -> Result<(), StepError> {
    let args: Vec<String> = ["-q", "repolist", "--all"].map(String::from).to_vec();
    let out = runner.run("dnf", &args, &[]).map_err(|e| err(format!("dnf repolist: {e}")))?;
    if !out.ok() {
        return Err(err(format!("dnf repolist --all failed ({}): {}", code(&out), out.stderr.trim())));
    }
    let (id, enabled) = crb_repo(&parse_repolist(&out.stdout_text())).map_err(err)?;
    if enabled {
        (o.progress)(&format!("      {id} is enabled already"));
        return Ok(());
    }
    let redhat_repo = std::fs::read_to_string(under(&o.root, "/etc/yum.repos.d/redhat.repo")).unwrap_or_default();
    let c = if redhat_repo.lines().any(|l| l.trim() == format!("[{id}]")) {
        Cmd { retry: Retry::Network, ..super::plan::cmd("subscription-manager", &["repos", "--enable", &id]) }
    } else {
        super::plan::cmd("dnf", &["config-manager", "--set-enabled", &id])
    };
    let args = lit_args(&c);
    run_cmd(&c, &args, runner, o)
}

/// The reboot that confirms a queued enrolment needs a person at the console: shim's MOK
/// manager waits for a key press a few seconds, then boots on without enrolling, and the module
/// would not load. So no automatic reboot: what to do, and where the password is.
fn mok_confirm(kernel: &str, root: &Path) -> Finding {
    let file = format!("{DOWNLOAD_DIR}/{MOK_PASSWORD_FILE}");
    let have = under(root, &file).is_file();
    let password = if have {
        format!("the one-time password is in {file} (sudo cat {file})")
    } else {
        format!("the request was queued by someone else; if its password is lost, `mokutil --revoke-import` and rerun phq-agent install to queue it again with one kept in {file}")
    };
    Finding::warn(
        "install.mok-enrolment",
        format!("reboot at the VM console to confirm DKMS's signing key: kernel {kernel} has the driver, signed by a key whose enrolment waits for a person"),
    )
    .detail(format!(
        "Secure Boot is on and the nvidia module is signed by DKMS's key ({DKMS_MOK}). Its enrolment is queued; shim's MOK manager asks for it on the next boot, only at the console, and boots on without it if nobody answers. Not rebooting unattended; {password}."
    ))
    .remedy("Open the VM's console (virtctl vnc <vm>), reboot (sudo systemctl reboot), press a key when the MOK manager appears, choose Enroll MOK → Continue → Yes, type the password, then Reboot; phq-agent-install.service resumes the install.")
}

fn unsafe_boot(kernel: &str, why: String) -> Finding {
    Finding::fail("install.boot-safety", format!("not rebooting: the kernel that boots next ({kernel}) would start without the GPU driver"))
        .detail(why)
        .remedy(format!("Rebuild the module for that kernel (`dkms autoinstall -k {kernel}`; `dkms status` shows what is built), or install the kernel's headers and rerun phq-agent install."))
}

/// The kernel the next boot starts: on EL what grubby names as the default; on Debian and
/// Ubuntu the newest `/boot/vmlinuz-*`, because GRUB's `util/grub.d/10_linux.in` lists the
/// kernels it finds in /boot newest first (`version_sort -r`, the `.old` ones last) and the
/// default entry is the first (`GRUB_DEFAULT=0`, the GRUB manual's default and what Debian and
/// Ubuntu ship in /etc/default/grub; a machine set to `saved` or another entry is not covered);
/// the running one when neither tells.
fn next_boot_kernel(plan: &Plan, runner: &mut dyn Runner, root: &Path) -> String {
    if !plan.distro.is_deb() {
        if let Ok(out) = runner.run("grubby", &["--default-kernel".into()], &[]) {
            if let Some(k) = out.stdout_text().trim().strip_prefix("/boot/vmlinuz-").filter(|k| !k.is_empty()) {
                return k.to_string();
            }
        }
    }
    let numbers =
        |k: &str| -> Vec<u64> { k.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse().ok()).collect() };
    std::fs::read_dir(root.join("boot"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("vmlinuz-").map(str::to_string))
        .max_by(|a, b| numbers(a).cmp(&numbers(b)))
        .unwrap_or_else(|| plan.kernel.clone())
}

fn reboot(st: &mut State, o: &mut Options, head: &str, reason: &str) -> State {
    match o.reboot {
        RebootPolicy::Never => {
            (o.progress)(&format!("{head}: a reboot is required ({reason}); not rebooting (--reboot never)"));
            st.status = Status::RebootRequired;
            st.findings.push(Finding::warn("install.reboot-required", format!("reboot required: {reason}")).remedy(
                "Reboot the VM; phq-agent-install.service resumes the install (or run phq-agent install again)",
            ));
        }
        RebootPolicy::Auto => {
            (o.progress)(&format!("{head}: rebooting ({reason}); phq-agent-install.service resumes after it"));
            st.status = Status::Rebooting;
            let _ = save(&o.journal_dir, st);
            if let Err(e) = (o.reboot_now)() {
                st.status = Status::RebootRequired;
                st.error = Some(format!("could not reboot: {e}"));
                st.findings.push(
                    Finding::fail(
                        "install.reboot-required",
                        format!("reboot required ({reason}), and rebooting failed: {e}"),
                    )
                    .remedy("Reboot the VM by hand; the install resumes after it"),
                );
            }
        }
    }
    let _ = save(&o.journal_dir, st);
    st.clone()
}

struct StepError {
    message: String,
    url: Option<String>,
}

impl StepError {
    fn finding(&self, step: &str) -> Finding {
        match &self.url {
            Some(url) => Finding::fail("install.unreachable", format!("cannot reach {url}: {}", self.message))
                .detail(format!("Step {step} needs the network; it was retried and gave up."))
                .remedy("Check the VM's DNS and egress to that host (or set install.repo_url to a reachable mirror), then rerun phq-agent install")
                .evidence("url", url),
            None => Finding::fail("install.step-failed", format!("step {step} failed: {}", self.message))
                .remedy("Fix what the message says and rerun phq-agent install; finished steps are not repeated (log: /var/lib/phq-agent-install/log)"),
        }
    }
}

fn err(message: impl Into<String>) -> StepError {
    StepError { message: message.into(), url: None }
}

/// Runs one action. `Ok(Some(finding))`: the action found there is nothing it may do on this
/// guest (`Action::InstallForCuda` without a build for the CUDA); the rest of its step is
/// skipped, and the finding says why.
fn run_action(a: &Action, plan: &Plan, runner: &mut dyn Runner, o: &mut Options) -> Result<Option<Finding>, StepError> {
    match a {
        Action::InstallForCuda { package, cuda, query, install } => {
            install_for_cuda(package, cuda, query, install, plan, runner, o)
        }
        a => run_plain_action(a, plan, runner, o).map(|()| None),
    }
}

fn run_plain_action(a: &Action, plan: &Plan, runner: &mut dyn Runner, o: &mut Options) -> Result<(), StepError> {
    match a {
        Action::Run(c) => {
            let args = resolve_args(c, plan, runner)?;
            run_cmd(c, &args, runner, o)
        }
        Action::Write { path, contents } => {
            let target = under(&o.root, path);
            (o.progress)(&format!("      write {path}"));
            crate::durable::write(&target, contents.as_bytes(), 0o644)
                .map_err(|e| err(format!("{}: {e}", target.display())))
        }
        Action::Fetch { url, to } => {
            let target = under(&o.root, to);
            if let Some(dir) = target.parent() {
                private_dir(dir).map_err(err)?;
            }
            (o.progress)(&format!("      fetch {url}"));
            let mut last = String::new();
            for attempt in 1..=o.network_tries.max(1) {
                match runner.fetch(url, &target) {
                    Ok(()) => return Ok(()),
                    Err(e) => last = e,
                }
                if attempt < o.network_tries {
                    runner.sleep(Duration::from_secs(1 << attempt.min(5)));
                }
            }
            Err(StepError {
                message: format!("{last} (tried {} times)", o.network_tries.max(1)),
                url: Some(url.clone()),
            })
        }
        Action::InstallKey { file, deb_member, fingerprint, to, armored } => {
            let path = under(&o.root, file);
            if let Some(dir) = path.parent() {
                private_dir(dir).map_err(err)?; // still root's alone
            }
            let bytes = match deb_member {
                Some(member) => deb_member_bytes(&path, member, runner)?,
                None => crate::sysroot::read_regular(&path, true, 1 << 20)
                    .map_err(|e| err(format!("{}: {e}", path.display())))?,
            };
            let key = super::pgp::verified(&bytes, fingerprint)
                .map_err(|e| err(format!("{file} is not the pinned key: {e}; nothing from it was trusted")))?;
            // What was checked is what is written: the packets read above, by us, not the file.
            let target = under(&o.root, to);
            let out = if *armored { key.armored().into_bytes() } else { key.binary().to_vec() };
            crate::durable::write(&target, &out, 0o644).map_err(|e| err(format!("{}: {e}", target.display())))?;
            for sub in &key.unbound_subkeys {
                (o.progress)(&format!(
                    "      left out subkey {}: the pinned key does not bind it",
                    super::pgp::spaced(sub)
                ));
            }
            (o.progress)(&format!("      key {} verified and written to {to}", super::pgp::spaced(fingerprint)));
            Ok(())
        }
        Action::Resolve(pkgs) => resolve(pkgs, plan, runner, o),
        Action::RepairDpkg { configure, fix } => {
            // First the packages whose unpacking was killed: dpkg leaves them out of
            // --configure -a, and apt-get -f cannot reinstall one without its archive (the
            // keyring, whose own repository is not set up yet, is the usual one).
            let broken = reinst_required(runner)?;
            if !broken.is_empty() {
                (o.progress)(&format!(
                    "      {} was interrupted while unpacking: removing it for its step to install again",
                    broken.join(", ")
                ));
                let mut remove = vec!["--remove".to_string(), "--force-remove-reinstreq".to_string()];
                remove.extend(broken);
                let c = Cmd { args: remove.into_iter().map(Arg::Lit).collect(), ..configure.clone() };
                run_cmd(&c, &lit_args(&c), runner, o)?;
            }
            run_cmd(configure, &lit_args(configure), runner, o)?;
            run_cmd(fix, &lit_args(fix), runner, o)
        }
        Action::EnrollMok { key } => enroll_mok(key, runner, o),
        Action::EnableCrb => enable_crb(runner, o),
        Action::Reboot | Action::Verify => Ok(()),
        Action::InstallForCuda { .. } => Err(err("a package for a CUDA release is installed by run_action")),
    }
}

/// A command's arguments as they are (the repair's commands have no looked-up parts).
fn lit_args(c: &Cmd) -> Vec<String> {
    c.args
        .iter()
        .map(|a| match a {
            Arg::Lit(s) | Arg::AtDriverVersion(s) => s.clone(),
        })
        .collect()
}

/// Packages dpkg marks reinst-required (the third letter of `db:Status-Abbrev` is `R`): their
/// unpacking was interrupted, and dpkg will do nothing more with them until they are installed
/// again or removed with --force-remove-reinstreq (dpkg(1), dpkg-query(1)).
fn reinst_required(runner: &mut dyn Runner) -> Result<Vec<String>, StepError> {
    let args = vec!["-W".to_string(), "-f=${db:Status-Abbrev}${Package}\n".to_string()];
    let out = runner.run("dpkg-query", &args, &[]).map_err(|e| err(format!("dpkg-query: {e}")))?;
    Ok(out
        .stdout_text()
        .lines()
        .filter(|l| l.as_bytes().get(2) == Some(&b'R'))
        .filter_map(|l| l.get(3..).map(|n| n.trim().to_string()))
        .filter(|n| !n.is_empty())
        .collect())
}

/// The pre-flight: asks the package manager to resolve every package without installing any,
/// and turns a refusal into the names it could not find. apt-get -s exits non-zero when a
/// package cannot be resolved ("Unable to locate package", "has no installation candidate",
/// unmet dependencies); dnf with --assumeno always exits 1 ("Operation aborted") and says
/// "No match for argument" or "Problem" when it cannot.
fn resolve(pkgs: &[String], plan: &Plan, runner: &mut dyn Runner, o: &mut Options) -> Result<(), StepError> {
    let deb = plan.distro.is_deb();
    let (program, mut args): (&str, Vec<String>) = if deb {
        ("apt-get", vec!["-s".into(), "-q".into(), "install".into()])
    } else {
        ("dnf", vec!["-q".into(), "install".into(), "--assumeno".into()])
    };
    args.extend(pkgs.iter().cloned());
    (o.progress)(&format!("      $ {program} {}", args.join(" ")));
    let env: Vec<(String, String)> = if deb {
        super::plan::DEB_ENV.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    } else {
        Vec::new()
    };
    let out = runner.run(program, &args, &env).map_err(|e| err(format!("{program}: {e}")))?;
    let text = format!("{}\n{}", out.stdout_text(), out.stderr);
    let missing = unresolvable(&text);
    let refused = if deb { !out.ok() } else { dnf_refused(&text, &missing) };
    if !refused {
        (o.progress)(&format!("      all {} packages resolve", pkgs.len()));
        return Ok(());
    }
    let names = if missing.is_empty() {
        "the whole set (in the package manager's words:)".to_string()
    } else {
        missing.join(", ")
    };
    // The running kernel's own headers gone from the mirror is the usual case on a guest that
    // has not been upgraded for a while: DKMS cannot build for this kernel any more.
    let headers = [format!("linux-headers-{}", plan.kernel), format!("kernel-devel-{}", plan.kernel)];
    let kernel_gone = if missing.iter().any(|m| headers.contains(m)) {
        let upgrade = if deb {
            "apt-get install linux-image-<flavour> linux-headers-<flavour>"
        } else {
            "dnf upgrade kernel kernel-devel"
        };
        format!(
            " The headers of the running kernel {} have left the repositories (they carry a newer kernel now): upgrade the kernel (`{upgrade}`), reboot into it, and run phq-agent install again.",
            plan.kernel
        )
    } else {
        String::new()
    };
    Err(err(format!(
        "pre-flight: the repositories cannot install {names}; nothing was installed.{kernel_gone} {}",
        tail_lines(&text, 6)
    )))
}

/// Whether dnf's answer to `install --assumeno` is a refusal. It always exits 1 and ends with
/// "Error: Operation aborted." when it resolved everything and was told not to go on (dnf's CLI
/// raises that as an error); a real refusal says "No match for argument", "Problem" or another
/// error.
fn dnf_refused(text: &str, missing: &[String]) -> bool {
    !missing.is_empty()
        || text.contains("Problem")
        || text.lines().any(|l| l.trim_start().starts_with("Error:") && !l.contains("Operation aborted"))
}

/// Package names a resolver's output says it cannot install: asked for and unknown (apt's
/// "Unable to locate package", dnf's "No match for argument"), or a dependency no repository
/// has (apt's "X : Depends: Y but it is not installable", dnf's "nothing provides Y needed by X").
fn unresolvable(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        let l = line.trim();
        // dnf -q keeps only its closing error, which names every argument it found nothing for
        // on one line ("Error: Unable to find a match: a b"; dnf's MarkingErrors): the real-dnf
        // test (tests/install_el9.rs) saw no "No match for argument" line under -q.
        if let Some(names) = l.strip_prefix("Error: Unable to find a match: ") {
            for n in names.split_whitespace() {
                if !out.iter().any(|o| o == n) {
                    out.push(n.to_string());
                }
            }
            continue;
        }
        let name = l
            .strip_prefix("E: Unable to locate package ")
            .or_else(|| l.strip_prefix("No match for argument: "))
            .map(|n| n.trim().to_string())
            .or_else(|| {
                let rest = l.strip_prefix("E: Package '")?;
                rest.split_once('\'').map(|(n, _)| n.to_string())
            })
            .or_else(|| {
                let dep = l.strip_suffix(" but it is not installable")?.rsplit_once("Depends: ")?.1;
                dep.split_whitespace().next().map(str::to_string)
            })
            .or_else(|| {
                let rest = l.split_once("nothing provides ")?.1;
                rest.split_whitespace().next().map(str::to_string)
            });
        if let Some(n) = name.filter(|n| !n.is_empty() && !out.contains(n)) {
            out.push(n);
        }
    }
    out
}

/// Makes `dir` a directory only this process's user can write (mode 0700), or says why it
/// cannot be: a symlink, or another user's directory, is refused rather than used.
fn private_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(format!("{}: {e}", dir.display())),
        _ => {}
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !meta.file_type().is_dir() || meta.uid() != me {
        return Err(format!(
            "{}: not a directory of uid {me} (a symlink, or another user's); the installer keeps its downloads where only it can write — remove it and rerun",
            dir.display()
        ));
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("{}: cannot close it to other users: {e}", dir.display()))?;
    }
    Ok(())
}

fn under(root: &Path, abs: &str) -> PathBuf {
    root.join(abs.trim_start_matches('/'))
}

/// The keyring package is a few KiB: its key (about 2 KiB), a source list and its docs. A
/// member past this is not a keyring.
pub const MAX_DEB_MEMBER_BYTES: u64 = 1 << 20;
/// How much of the package's unpacked tar stream is read at most. A mirror's package may
/// unpack without end (a compression bomb): past this the reading stops, and with it dpkg-deb.
pub const MAX_DEB_TAR_BYTES: u64 = 16 << 20;

/// `dpkg-deb --fsys-tarfile` unpacks whatever compression the .deb uses; the member is read
/// from that tar stream as dpkg-deb writes it, without writing anything to disk and without
/// keeping more than the member (`MAX_DEB_MEMBER_BYTES`) or reading more than
/// `MAX_DEB_TAR_BYTES` of the stream.
fn deb_member_bytes(deb: &Path, member: &str, runner: &mut dyn Runner) -> Result<Vec<u8>, StepError> {
    let deb_s = deb.display().to_string();
    let mut found = TarMember::Missing;
    let out = runner
        .run_reading("dpkg-deb", &["--fsys-tarfile".into(), deb_s.clone()], &mut |stdout| {
            found = tar_member(stdout, member, MAX_DEB_TAR_BYTES, MAX_DEB_MEMBER_BYTES);
        })
        .map_err(|e| err(format!("dpkg-deb: {e}")))?;
    match found {
        // Stopped by the cap: dpkg-deb's exit (a broken pipe) says nothing about the package.
        TarMember::StreamTooLong => Err(err(format!(
            "{deb_s}: its contents run past {MAX_DEB_TAR_BYTES} bytes unpacked (dpkg-deb --fsys-tarfile); refused, and dpkg-deb stopped: a keyring package is a few KiB"
        ))),
        TarMember::TooLarge(n) => Err(err(format!(
            "{deb_s}: {member} is {n} bytes, past the {MAX_DEB_MEMBER_BYTES}-byte cap for a keyring; refused"
        ))),
        _ if !out.ok() => Err(err(format!("{deb_s} is not a valid .deb: {}", out.stderr.trim()))),
        TarMember::Found(bytes) => Ok(bytes),
        TarMember::Missing => Err(err(format!("{deb_s} holds no {member}"))),
        TarMember::Unreadable(e) => Err(err(format!("{deb_s}: {e}"))),
    }
}

/// What a bounded read of a tar stream found of one member.
#[derive(Debug)]
enum TarMember {
    Found(Vec<u8>),
    Missing,
    /// The member's size, past the cap.
    TooLarge(u64),
    /// The stream ran past its cap.
    StreamTooLong,
    Unreadable(std::io::Error),
}

/// Reads the tar stream `input` to its end, or to `max_stream` bytes, keeping only `member`
/// (`./` or not) when it is at most `max_member` bytes.
fn tar_member(input: &mut dyn Read, member: &str, max_stream: u64, max_member: u64) -> TarMember {
    let mut capped = Capped { inner: input, left: max_stream, over: false };
    let read = |archive: &mut tar::Archive<&mut Capped<'_>>| -> std::io::Result<TarMember> {
        for entry in archive.entries()? {
            let mut entry = entry?;
            let path = entry.path().map(|p| p.display().to_string()).unwrap_or_default();
            if path.trim_start_matches("./") != member {
                continue;
            }
            let size = entry.header().size()?;
            if size > max_member {
                return Ok(TarMember::TooLarge(size));
            }
            let mut buf = Vec::new();
            (&mut entry).take(max_member).read_to_end(&mut buf)?;
            return Ok(TarMember::Found(buf));
        }
        Ok(TarMember::Missing)
    };
    let found = read(&mut tar::Archive::new(&mut capped)).unwrap_or_else(TarMember::Unreadable);
    // The rest of the stream, so dpkg-deb ends on its own and its exit status tells.
    if !matches!(found, TarMember::TooLarge(_)) {
        let _ = std::io::copy(&mut capped, &mut std::io::sink());
    }
    if capped.over {
        TarMember::StreamTooLong
    } else {
        found
    }
}

/// A reader that gives at most `left` bytes and then fails, noting in `over` that there was
/// more (a stream that ends exactly at the cap is not over it).
struct Capped<'a> {
    inner: &'a mut dyn Read,
    left: u64,
    over: bool,
}

impl Read for Capped<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            let mut one = [0u8; 1];
            if self.inner.read(&mut one)? == 0 {
                return Ok(0);
            }
            self.over = true;
            return Err(std::io::Error::other("past the cap"));
        }
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.left -= n as u64;
        Ok(n)
    }
}

/// `Arg::AtDriverVersion` becomes `pkg=<the repository's version of pkg whose upstream part is
/// the installed driver's>` (apt) or `pkg-<driver version>` (dnf).
fn resolve_args(c: &Cmd, plan: &Plan, runner: &mut dyn Runner) -> Result<Vec<String>, StepError> {
    let mut driver_version: Option<String> = None;
    let mut out = Vec::new();
    for a in &c.args {
        match a {
            Arg::Lit(s) => out.push(s.clone()),
            Arg::AtDriverVersion(pkg) => {
                if driver_version.is_none() {
                    driver_version = Some(query_driver_version(plan, runner)?);
                }
                let dv = driver_version.as_deref().unwrap_or_default();
                if plan.distro.is_deb() {
                    out.push(format!("{pkg}={}", candidate_at(pkg, dv, runner)?));
                } else {
                    out.push(format!("{pkg}-{dv}"));
                }
            }
        }
    }
    Ok(out)
}

fn query_driver_version(plan: &Plan, runner: &mut dyn Runner) -> Result<String, StepError> {
    let pkg = plan.driver_package.as_deref().ok_or_else(|| err("no driver package to take the version from"))?;
    let (program, args): (&str, Vec<String>) = if plan.distro.is_deb() {
        ("dpkg-query", vec!["-W".into(), "-f=${Version}".into(), pkg.into()])
    } else {
        ("rpm", vec!["-q".into(), "--qf".into(), "%{VERSION}".into(), pkg.into()])
    };
    let out = runner.run(program, &args, &[]).map_err(|e| err(format!("{program}: {e}")))?;
    let text = out.stdout_text();
    let v = text.trim();
    if !out.ok() || v.is_empty() {
        return Err(err(format!("cannot read the installed version of {pkg}: {}", out.stderr.trim())));
    }
    Ok(crate::collect::packages::upstream_version(v).to_string())
}

/// The repository version of `pkg` whose upstream part equals `upstream` (`apt-cache madison`).
fn candidate_at(pkg: &str, upstream: &str, runner: &mut dyn Runner) -> Result<String, StepError> {
    let out =
        runner.run("apt-cache", &["madison".into(), pkg.into()], &[]).map_err(|e| err(format!("apt-cache: {e}")))?;
    let versions = parse_madison(&out.stdout_text());
    versions.iter().find(|v| crate::collect::packages::upstream_version(v) == upstream).cloned().ok_or_else(|| {
        err(format!(
            "the repository has no {pkg} at the driver's version {upstream} (it has: {}); fabric manager must equal the driver exactly",
            if versions.is_empty() { "none".to_string() } else { versions.join(", ") }
        ))
    })
}

/// ` nvidia-fabricmanager-550 | 550.90.07-1 | http://… Packages` → versions.
pub fn parse_madison(text: &str) -> Vec<String> {
    text.lines().filter_map(|l| l.split('|').nth(1)).map(|v| v.trim().to_string()).filter(|v| !v.is_empty()).collect()
}

/// `Action::InstallForCuda`: the repository's versions of `package` from `query`, the newest
/// built for `cuda` installed with `install`; none, a warning and nothing installed.
fn install_for_cuda(
    package: &str,
    cuda: &str,
    query: &Cmd,
    install: &Cmd,
    plan: &Plan,
    runner: &mut dyn Runner,
    o: &mut Options,
) -> Result<Option<Finding>, StepError> {
    let out = run_cmd_output(query, &lit_args(query), runner, o)?;
    let text = out.stdout_text();
    // apt-cache madison: ` libnccl2 | 2.27.3-1+cuda12.9 | <uri> Packages`, and nothing (exit 0)
    // for a name no source has. dnf repoquery --qf: one `version-release` a line.
    let versions: Vec<String> = if plan.distro.is_deb() {
        parse_madison(&text)
    } else {
        text.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_string).collect()
    };
    let Some(version) = super::plan::newest_for_cuda(&versions, cuda) else {
        let mut cudas: Vec<&str> = versions.iter().filter_map(|v| super::plan::built_for_cuda(v)).collect();
        cudas.sort_by(|a, b| crate::facts::version_cmp(a, b));
        cudas.dedup();
        let has = if versions.is_empty() {
            format!("no {package} at all")
        } else {
            format!("{package} built for CUDA {} only", cudas.join(", "))
        };
        // Only what install.cuda takes (a CUDA 12 toolkit it knows) is offered as a choice.
        let choices: Vec<&str> = cudas
            .iter()
            .copied()
            .filter(|c| c.starts_with("12.") && crate::facts::cuda_min_driver(c).is_some())
            .collect();
        let remedy = if choices.is_empty() {
            format!("Use a mirror that carries NVIDIA's NCCL packages (install.repo_url), or install NCCL built for CUDA {cuda} yourself; then rerun phq-agent install")
        } else {
            format!("Choose an install.cuda the repository has NCCL for ({}), or install NCCL built for CUDA {cuda} yourself; then rerun phq-agent install", choices.join(", "))
        };
        return Ok(Some(
            Finding::warn("install.nccl", format!("NCCL is not installed: the repository has no {package} built for CUDA {cuda}"))
                .detail(format!("It has {has}. A build for another CUDA is not installed in its place: NCCL must be built for the toolkit's CUDA ({cuda}). Without NCCL the all-reduce probe (probe.allreduce) cannot run; everything else is installed."))
                .remedy(remedy)
                .evidence("package", package)
                .evidence("cuda", cuda)
                .evidence("versions", &versions),
        ));
    };
    let pinned = if plan.distro.is_deb() { format!("{package}={version}") } else { format!("{package}-{version}") };
    let mut args = lit_args(install);
    args.push(pinned);
    run_cmd(install, &args, runner, o).map(|()| None)
}

fn run_cmd(c: &Cmd, args: &[String], runner: &mut dyn Runner, o: &mut Options) -> Result<(), StepError> {
    run_cmd_output(c, args, runner, o).map(|_| ())
}

/// `run_cmd`, keeping what the command printed.
fn run_cmd_output(c: &Cmd, args: &[String], runner: &mut dyn Runner, o: &mut Options) -> Result<Output, StepError> {
    let shown = super::plan::render_cmd(&Cmd { args: args.iter().cloned().map(Arg::Lit).collect(), ..c.clone() }, true);
    (o.progress)(&format!("      $ {shown}"));
    let tries = if c.retry == Retry::Network { o.network_tries.max(1) } else { 1 };
    let lock_deadline = Instant::now() + o.lock_wait;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let out = runner.run(&c.program, args, &c.env).map_err(|e| {
            err(match e.kind() {
                std::io::ErrorKind::NotFound => format!("{} is not installed on this guest", c.program),
                _ => format!("{}: {e}", c.program),
            })
        })?;
        if out.ok() {
            return Ok(out);
        }
        let text = format!("{}\n{}", out.stdout_text(), out.stderr);
        let tail = tail_lines(&text, 6);
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
            (o.progress)(&format!("      failed (exit {}); trying again", code(&out)));
            runner.sleep(Duration::from_secs(1 << attempt.min(5)));
            continue;
        }
        let message = format!("`{shown}` exited {}: {tail}", code(&out));
        return Err(StepError { message, url: c.url.clone().filter(|_| c.retry == Retry::Network) });
    }
}

fn code(o: &Output) -> String {
    o.code.map(|c| c.to_string()).unwrap_or_else(|| "on a signal".into())
}

fn is_dpkg_lock(stderr: &str) -> bool {
    stderr.contains("dpkg frontend lock") || stderr.contains("lock-frontend") || stderr.contains("/var/lib/dpkg/lock")
}

fn tail_lines(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" / ")
}

/// What is kept of a program's stderr when its stdout is streamed (`Runner::run_reading`).
const MAX_STDERR_BYTES: usize = 64 << 10;

/// The real world: programs run with stdin closed and their output appended to `log`.
pub struct SystemRunner {
    pub log: Option<File>,
}

impl SystemRunner {
    /// Appends to `journal_dir/log` (root's alone, never through a link); without it, commands
    /// still run and only the log is missing, which is said.
    pub fn new(journal_dir: &Path) -> SystemRunner {
        let log = match open_private(journal_dir, "log", true, 0o600) {
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

    fn fetch(&mut self, url: &str, to: &Path) -> Result<(), String> {
        let bytes = download(url, MAX_DOWNLOAD_BYTES)?;
        crate::durable::write(to, &bytes, 0o644).map_err(|e| format!("{}: {e}", to.display()))
    }

    fn sleep(&mut self, d: Duration) {
        std::thread::sleep(d);
    }
}

/// What the installer downloads is small: a keyring package (about 4 KiB), a key, EPEL's release
/// package (about 20 KiB). A body past this is not what was asked for, and is not read on.
pub const MAX_DOWNLOAD_BYTES: u64 = 16 << 20;

/// Whether a redirect may be followed: never from `https` down to plain `http` (what TLS
/// protected would then come unprotected, from wherever the redirect points), at most ten in a
/// row (reqwest's own default policy, `redirect::Policy::default`, stops at ten).
pub fn redirect_allowed(from: &str, to: &str, hops: usize) -> Result<(), String> {
    if hops >= 10 {
        return Err(format!("more than 10 redirects (the last to {to})"));
    }
    let scheme = |u: &str| u.split_once("://").map(|(s, _)| s.to_ascii_lowercase()).unwrap_or_default();
    if scheme(from) == "https" && scheme(to) != "https" {
        return Err(format!("refused a redirect from {from} to {to}: from https down to {}", scheme(to)));
    }
    Ok(())
}

/// One GET of `url`: redirects only as `redirect_allowed` says, a body of at most `max` bytes.
pub fn download(url: &str, max: u64) -> Result<Vec<u8>, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the HTTP client: {e}"))?;
    rt.block_on(async {
        let policy = reqwest::redirect::Policy::custom(|attempt| {
            let from = attempt.previous().last().map(|u| u.to_string()).unwrap_or_default();
            match redirect_allowed(&from, attempt.url().as_str(), attempt.previous().len()) {
                Ok(()) => attempt.follow(),
                Err(e) => attempt.error(e),
            }
        });
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(120))
            .redirect(policy)
            .build()
            .map_err(|e| e.to_string())?;
        let mut resp = client.get(url).send().await.map_err(|e| describe(&e.without_url()))?;
        if !resp.status().is_success() {
            return Err(format!("HTTP {}", resp.status()));
        }
        if let Some(n) = resp.content_length().filter(|n| *n > max) {
            return Err(format!("the server announces {n} bytes; refused above {max}"));
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| describe(&e.without_url()))? {
            if body.len() as u64 + chunk.len() as u64 > max {
                return Err(format!("the body runs past {max} bytes; refused"));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    })
}

fn describe(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::install::plan::{self, Facts, Settings};
    use crate::snapshot::{OsRelease, SecureBoot};

    /// A small working stand-in for the machine: commands succeed unless told to fail, queries
    /// answer like dpkg-query and apt-cache do, fetches write a file or fail like a dead network.
    #[derive(Default)]
    struct FakeMachine {
        ran: Vec<String>,
        fail_when: Option<String>,
        offline: bool,
        fetched: u32,
        slept: Duration,
        key: Vec<u8>,
        /// `dpkg` answers "lock held" this many more times.
        lock_busy: u32,
        /// A package the repositories do not have: apt-get names it, as apt does
        /// ("E: Unable to locate package NAME", exit 100), for a simulation and an install alike.
        missing: Option<String>,
        /// A package whose unpacking was killed: dpkg refuses to configure while it is there,
        /// dpkg-query shows it with the reinst-required flag, and removing it clears it.
        reinstreq: Option<String>,
        /// The nvidia module's version for every kernel, as `modinfo -k K -F version nvidia`
        /// reads it (default: the installed driver's, 550.90.07); empty: no module, which
        /// modinfo answers with "Module nvidia not found" and exit 1 (kmod's modinfo).
        module: Option<String>,
        /// `modinfo -F signer`: empty for an unsigned module.
        signer: String,
        /// Where DKMS's certificate stands with the firmware, as `mokutil --test-key` answers
        /// (mokutil's `test_key`: "is not enrolled" exit 0, the others exit 1); `--import` of a
        /// certificate that is not enrolled queues it.
        mok: FakeMok,
        /// What was written to a program's stdin.
        stdin: Vec<String>,
        /// What `dnf repolist --all` prints.
        repolist: String,
        /// Other members of the keyring package besides its key (a maintainer script, a source).
        deb_extra: Vec<(String, Vec<u8>)>,
        /// What a fetch serves (default: a stand-in package, "deb").
        served: Option<Vec<u8>>,
        /// The NCCL builds the repository has, as `apt-cache madison libnccl2` and `dnf
        /// repoquery … libnccl` list them (default: `NCCL_BUILDS`).
        nccl: Option<Vec<&'static str>>,
        /// The keyring package unpacks without end (a compression bomb from a mirror).
        deb_bomb: Option<DebBomb>,
        /// How many bytes of dpkg-deb's stream the installer read.
        deb_read: u64,
    }

    #[derive(Clone, Copy, PartialEq, Debug)]
    enum DebBomb {
        /// The key file itself claims 8 GiB, and its data never ends.
        HugeMember,
        /// Another member before the key claims 8 GiB, and its data never ends.
        EndlessBefore,
    }

    /// A tar member's header for `path` claiming 8 GiB, followed by zeros without end.
    fn endless_tar(path: &str) -> impl Read {
        let mut h = tar::Header::new_gnu();
        h.set_path(path).unwrap();
        h.set_size(8 << 30);
        h.set_mode(0o644);
        h.set_cksum();
        std::io::Cursor::new(h.as_bytes().to_vec()).chain(std::io::repeat(0))
    }

    /// Counts what passes through it.
    struct Counting<'a, R> {
        inner: R,
        read: &'a mut u64,
    }

    impl<R: Read> Read for Counting<'_, R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.inner.read(buf)?;
            *self.read += n as u64;
            Ok(n)
        }
    }

    /// Builds for several CUDA releases, as NVIDIA's repositories carry them (not in order: the
    /// choice compares versions itself).
    const NCCL_BUILDS: &[&str] =
        &["2.28.3-1+cuda13.0", "2.27.3-1+cuda12.9", "2.21.5-1+cuda12.4", "2.20.5-1+cuda12.4", "2.26.5-1+cuda12.8"];

    #[derive(Default, Clone, Copy, PartialEq, Debug)]
    enum FakeMok {
        #[default]
        Absent,
        Queued,
        Enrolled,
        NoKey,
    }

    impl Runner for FakeMachine {
        fn run(&mut self, program: &str, args: &[String], _env: &[(String, String)]) -> std::io::Result<Output> {
            let line = format!("{program} {}", args.join(" "));
            self.ran.push(line.clone());
            let ok = |stdout: &[u8]| Output { code: Some(0), stdout: stdout.to_vec(), stderr: String::new() };
            if program == "dpkg" && self.lock_busy > 0 {
                self.lock_busy -= 1;
                let stderr = "dpkg: error: dpkg frontend lock was locked by another process with pid 4242".into();
                return Ok(Output { code: Some(2), stdout: vec![], stderr });
            }
            if let Some(name) = self.reinstreq.clone() {
                if program == "dpkg" && args.first().map(String::as_str) == Some("--configure") {
                    let stderr = format!("dpkg: error processing package {name} (--configure):\n package is in a very bad inconsistent state; you should\n reinstall it before attempting configuration");
                    return Ok(Output { code: Some(1), stdout: vec![], stderr });
                }
                if program == "dpkg-query" && args.iter().any(|a| a.contains("db:Status-Abbrev")) {
                    return Ok(ok(format!("ii bash\niHR{name}\n").as_bytes()));
                }
                if program == "dpkg" && args.iter().any(|a| a == "--force-remove-reinstreq") && args.contains(&name) {
                    self.reinstreq = None;
                    return Ok(ok(b""));
                }
            }
            if let Some(name) = self.missing.as_ref().filter(|n| program == "apt-get" && args.contains(n)) {
                let stderr = format!("Reading package lists...\nE: Unable to locate package {name}");
                return Ok(Output { code: Some(100), stdout: vec![], stderr });
            }
            if self.fail_when.as_deref().is_some_and(|f| line.contains(f)) {
                return Ok(Output { code: Some(100), stdout: vec![], stderr: "E: Unable to locate package".into() });
            }
            if program == "mokutil" && args.first().map(String::as_str) == Some("--test-key") {
                let key = &args[1];
                let (code, stdout, stderr) = match self.mok {
                    FakeMok::Absent => (0, format!("{key} is not enrolled\n"), String::new()),
                    FakeMok::Queued => (1, format!("{key} is already in the enrollment request\n"), String::new()),
                    FakeMok::Enrolled => (1, format!("{key} is already enrolled\n"), String::new()),
                    FakeMok::NoKey => (255, String::new(), format!("Failed to open {key}\n")),
                };
                return Ok(Output { code: Some(code), stdout: stdout.into_bytes(), stderr });
            }
            Ok(match program {
                "dnf" if args.iter().any(|a| a == "repolist") => ok(self.repolist.as_bytes()),
                "modinfo" if args.iter().any(|a| a == "version") => match self.module.as_deref().unwrap_or("550.90.07") {
                    "" => Output {
                        code: Some(1),
                        stdout: vec![],
                        stderr: "modinfo: ERROR: Module nvidia not found.".into(),
                    },
                    v => ok(format!("{v}\n").as_bytes()),
                },
                "modinfo" => ok(format!("{}\n", self.signer).as_bytes()),
                "dpkg-query" => ok(b"550.90.07-0ubuntu1"),
                "apt-cache" if args.iter().any(|a| a == "libnccl2") => {
                    let builds = self.nccl.as_deref().unwrap_or(NCCL_BUILDS);
                    let lines: String =
                        builds.iter().map(|v| format!("  libnccl2 | {v} | http://r/ Packages\n")).collect();
                    ok(lines.as_bytes())
                }
                "dnf" if args.iter().any(|a| a == "repoquery") => {
                    let builds = self.nccl.as_deref().unwrap_or(NCCL_BUILDS);
                    ok(builds.iter().map(|v| format!("{v}\n")).collect::<String>().as_bytes())
                }
                "apt-cache" => ok(b" nvidia-fabricmanager-550 | 550.127.05-1 | http://r/ Packages\n nvidia-fabricmanager-550 | 550.90.07-1 | http://r/ Packages\n"),
                "dpkg-deb" => {
                    let mut b = tar::Builder::new(Vec::new());
                    let mut h = tar::Header::new_gnu();
                    h.set_size(self.key.len() as u64);
                    h.set_mode(0o644);
                    h.set_cksum();
                    b.append_data(&mut h, "./usr/share/keyrings/cuda-archive-keyring.gpg", self.key.as_slice()).unwrap();
                    for (name, data) in &self.deb_extra {
                        let mut h = tar::Header::new_gnu();
                        h.set_size(data.len() as u64);
                        h.set_mode(0o755);
                        h.set_cksum();
                        b.append_data(&mut h, name, data.as_slice()).unwrap();
                    }
                    ok(&b.into_inner().unwrap())
                }
                _ => ok(b""),
            })
        }
        fn run_input(&mut self, program: &str, args: &[String], input: &[u8]) -> std::io::Result<Output> {
            self.stdin.push(String::from_utf8_lossy(input).into_owned());
            let out = self.run(program, args, &[])?;
            if program == "mokutil" && args.first().map(String::as_str) == Some("--import") {
                // Two identical lines, as mokutil's get_password asks; else its "Abort".
                let lines: Vec<&str> = std::str::from_utf8(input).unwrap_or("").lines().collect();
                if lines.len() < 2 || lines[0] != lines[1] || lines[0].is_empty() {
                    return Ok(Output { code: Some(255), stdout: vec![], stderr: "Abort\n".into() });
                }
                if self.mok == FakeMok::Absent {
                    self.mok = FakeMok::Queued;
                }
            }
            Ok(out)
        }
        fn run_reading(
            &mut self,
            program: &str,
            args: &[String],
            read: &mut dyn FnMut(&mut dyn Read),
        ) -> std::io::Result<Output> {
            let out = self.run(program, args, &[])?;
            let mut counted = 0;
            match self.deb_bomb {
                None => read(&mut Counting { inner: out.stdout.as_slice(), read: &mut counted }),
                Some(DebBomb::HugeMember) => read(&mut Counting {
                    inner: endless_tar("./usr/share/keyrings/cuda-archive-keyring.gpg"),
                    read: &mut counted,
                }),
                Some(DebBomb::EndlessBefore) => {
                    read(&mut Counting { inner: endless_tar("./usr/share/doc/bomb"), read: &mut counted })
                }
            }
            self.deb_read += counted;
            // A writer whose reader stopped early dies of SIGPIPE.
            let code = if self.deb_bomb.is_some() { None } else { out.code };
            Ok(Output { code, stdout: Vec::new(), ..out })
        }
        fn fetch(&mut self, url: &str, to: &Path) -> Result<(), String> {
            self.fetched += 1;
            if self.offline {
                return Err(format!("error sending request for url ({url}): connection refused"));
            }
            std::fs::write(to, self.served.as_deref().unwrap_or(b"deb")).map_err(|e| e.to_string())
        }
        fn sleep(&mut self, d: Duration) {
            self.slept += d;
        }
    }

    /// A v4 key packet and its fingerprint.
    fn test_key() -> (Vec<u8>, String) {
        test_key_seeded(42)
    }

    fn test_key_seeded(seed: u8) -> (Vec<u8>, String) {
        let mut body =
            vec![4, 0x5f, 0, 0, 0, 22, 9, 0x2b, 0x06, 0x01, 0x04, 0x01, 0xda, 0x47, 0x0f, 0x01, 0x01, 0x07, 0x40];
        body.extend([seed; 32]);
        let mut p = vec![0xc6, body.len() as u8];
        p.extend(&body);
        let fpr = crate::install::pgp::keys(&p).unwrap()[0].fingerprint.clone();
        (p, fpr)
    }

    fn fresh_ubuntu_hgx(_dir: &str, fpr: &str) -> (Facts, Settings) {
        let f = Facts {
            os: Ok(OsRelease {
                id: "ubuntu".into(),
                id_like: vec![],
                version_id: "22.04".into(),
                pretty_name: String::new(),
            }),
            kernel: Some("5.15.0-113-generic".into()),
            headers_present: true,
            secure_boot: Some(SecureBoot::Disabled),
            gpus: 8,
            nvswitches: 4,
            packages: Ok(vec![]),
            nouveau_off: false,
            nouveau_loaded: true,
            nvidia_loaded: None,
            nvidia_module_built: false,
            dpkg_interrupted: false,
            apt_lists: vec![],
            apt_sources: vec![],
            enabled_units: vec![],
            files: Default::default(),
            keys: Default::default(),
        };
        let s = Settings {
            cuda: "12.4".into(),
            driver_branch: 550,
            repo_url: String::new(),
            key_fingerprint: fpr.into(),
            epel_url: String::new(),
            epel_key_fingerprint: String::new(),
            replace_driver: false,
            allow_plain_http: false,
        };
        (f, s)
    }

    /// A fresh 8-GPU Ubuntu guest's plan, its state directory, and a machine whose keyring
    /// carries the test key; `pin` replaces the pinned fingerprint (default: the test key's).
    fn fresh_install(pin: Option<&str>) -> (tempfile::TempDir, Plan, FakeMachine) {
        let dir = tempfile::tempdir().unwrap();
        let (key, fpr) = test_key();
        let (f, s) = fresh_ubuntu_hgx(dir.path().to_str().unwrap(), pin.unwrap_or(&fpr));
        let p = plan::plan(&f, &s).unwrap();
        (dir, p, FakeMachine { key, ..Default::default() })
    }

    /// `fresh_install` on a guest whose dpkg was interrupted: the plan starts with its repair.
    fn fresh_install_interrupted() -> (tempfile::TempDir, Plan, FakeMachine) {
        let dir = tempfile::tempdir().unwrap();
        let (key, fpr) = test_key();
        let (mut f, s) = fresh_ubuntu_hgx(dir.path().to_str().unwrap(), &fpr);
        f.dpkg_interrupted = true;
        let p = plan::plan(&f, &s).unwrap();
        assert_eq!(p.steps[0].id.as_str(), "repair");
        (dir, p, FakeMachine { key, ..Default::default() })
    }

    struct Run {
        state: State,
        progress: Vec<String>,
        rebooted: bool,
    }

    /// Runs `f` with the installer's options over `dir` (its root under `dir/root`): progress
    /// lines kept, a verification that finds one warning, a reboot that is only noted. Returns
    /// what `f` returned, the progress lines and whether a reboot was asked for.
    fn with_options<R>(
        dir: &Path,
        policy: RebootPolicy,
        boot: Option<&str>,
        network_tries: u32,
        lock_wait: Duration,
        f: impl FnOnce(&mut Options) -> R,
    ) -> (R, Vec<String>, bool) {
        let mut lines = Vec::new();
        let mut rebooted = false;
        let mut progress = |l: &str| lines.push(l.to_string());
        let mut verify = || vec![Finding::pass("driver.loaded", "ok"), Finding::warn("gpu.ecc", "3 corrected")];
        let mut reboot_now = || {
            rebooted = true;
            Ok(())
        };
        let mut o = Options {
            journal_dir: dir.join("journal"),
            root: dir.join("root"),
            reboot: policy,
            boot_id: boot.map(str::to_string),
            network_tries,
            lock_wait,
            progress: &mut progress,
            verify: &mut verify,
            reboot_now: &mut reboot_now,
        };
        let r = f(&mut o);
        (r, lines, rebooted)
    }

    fn apply_once(p: &Plan, m: &mut FakeMachine, dir: &Path, policy: RebootPolicy, boot: &str) -> Run {
        let (state, progress, rebooted) =
            with_options(dir, policy, Some(boot), 4, Duration::from_secs(1), |o| apply(p, m, o).unwrap());
        Run { state, progress, rebooted }
    }

    #[test]
    fn fresh_install_reboots_once_resumes_and_verifies() {
        let (dir, p, mut m) = fresh_install(None);

        let first = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        assert!(first.rebooted);
        assert_eq!(first.state.status, Status::Rebooting);
        // Fabric manager is pinned to the repository version whose upstream equals the driver's.
        assert!(
            m.ran.iter().any(|l| l.contains("install nvidia-fabricmanager-550=550.90.07-1 libnvidia-nscq-550=")),
            "{:#?}",
            m.ran
        );
        assert!(
            m.ran.iter().any(|l| l.starts_with("apt-mark hold libnvidia-compute-550 nvidia-dkms-550-open")),
            "{:#?}",
            m.ran
        );
        // NCCL: the newest build for the toolkit's CUDA (12.4), not the newest there is (13.0's),
        // then held.
        let nccl = m.ran.iter().position(|l| l.ends_with("confold install libnccl2=2.21.5-1+cuda12.4"));
        let held = m.ran.iter().position(|l| l == "apt-mark hold libnccl2");
        assert!(nccl.is_some() && nccl < held, "{:#?}", m.ran);
        // The nouveau file landed, atomically, under the root.
        assert_eq!(
            std::fs::read_to_string(dir.path().join("root/etc/modprobe.d/blacklist-nouveau.conf")).unwrap(),
            plan::NOUVEAU_CONF_TEXT
        );
        let on_disk = load_state(&dir.path().join("journal")).unwrap().unwrap();
        assert_eq!(on_disk.status, Status::Rebooting);
        assert_eq!(on_disk.reboot_pending_since.as_deref(), Some("boot-1"));

        // The resume unit runs again after the reboot: nothing is repeated, verification runs.
        let ran_before = m.ran.len();
        let second = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-2");
        assert!(!second.rebooted);
        assert_eq!(m.ran.len(), ran_before, "nothing may run twice: {:#?}", &m.ran[ran_before..]);
        assert_eq!(second.state.status, Status::Done);
        assert_eq!(second.state.reboots, 1);
        assert!(second.state.findings.iter().any(|f| f.id == "gpu.ecc"));
        assert!(second.progress.iter().any(|l| l.contains("done in an earlier run")));
    }

    /// A repository without NCCL for the toolkit's CUDA: nothing of NCCL is installed or held
    /// (a build for another CUDA is never taken instead), the rest of the install goes on, a
    /// warning names the CUDA releases there are builds for, and the step is not journaled: the
    /// run after the reboot looks again, so its journal carries the warning too.
    #[test]
    fn without_a_build_for_the_toolkits_cuda_nccl_is_skipped_with_a_warning() {
        let (dir, p, mut m) = fresh_install(None);
        m.nccl = Some(vec!["2.28.3-1+cuda13.0", "2.27.3-1+cuda12.9", "2.26.5-1+cuda12.8", "2.19.3-1+cuda12.40"]);
        let first = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        assert!(first.rebooted);
        assert!(m.ran.iter().any(|l| l == "apt-cache madison libnccl2"), "{:#?}", m.ran);
        assert!(!m.ran.iter().any(|l| l.contains("install libnccl2") || l.contains("hold libnccl2")), "{:#?}", m.ran);
        // The later steps still ran.
        assert!(m.ran.iter().any(|l| l.starts_with("apt-mark hold libnvidia-compute-550")), "{:#?}", m.ran);
        assert!(first.progress.iter().any(|l| l.contains("skipped: NCCL is not installed")), "{:#?}", first.progress);
        let check = |st: &State| {
            let w = st.findings.iter().find(|f| f.id == "install.nccl").expect("the NCCL warning");
            assert_eq!(w.severity, Severity::Warn);
            assert!(w.summary.contains("no libnccl2 built for CUDA 12.4"), "{w:?}");
            assert!(w.detail.contains("built for CUDA 12.8, 12.9, 12.40, 13.0 only"), "{w:?}");
            // Only CUDA 12 releases the installer knows are offered (not 12.40, nor 13.0).
            assert!(
                w.remedy.as_deref().unwrap_or("").contains("install.cuda the repository has NCCL for (12.8, 12.9)"),
                "{w:?}"
            );
            assert!(!st.steps.contains_key("nccl"), "{:?}", st.steps);
        };
        check(&first.state);
        let second = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-2");
        assert_eq!(second.state.status, Status::Done);
        check(&second.state);
        // A repository with no NCCL at all says so.
        m.nccl = Some(vec![]);
        let third = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-3");
        let w = third.state.findings.iter().find(|f| f.id == "install.nccl").expect("the NCCL warning");
        assert!(w.detail.contains("It has no libnccl2 at all"), "{w:?}");
    }

    /// EL: `dnf repoquery` lists the builds, and dnf installs `libnccl-<version-release>`.
    #[test]
    fn el_takes_the_build_for_its_cuda_from_repoquery() {
        let (_, fpr) = test_key();
        let (mut f, mut s) = fresh_ubuntu_hgx("", &fpr);
        f.os =
            Ok(OsRelease { id: "rocky".into(), id_like: vec![], version_id: "9.4".into(), pretty_name: String::new() });
        f.kernel = Some("5.14.0-427.13.1.el9_4.x86_64".into());
        s.cuda = "12.9".into();
        s.driver_branch = 580;
        let p = plan::plan(&f, &s).unwrap();
        let step = p.steps.iter().find(|st| st.id.as_str() == "nccl").expect("the NCCL step");
        let dir = tempfile::tempdir().unwrap();
        let mut m = FakeMachine::default();
        for a in &step.actions {
            let r = with_options(dir.path(), RebootPolicy::Never, None, 1, Duration::from_secs(1), |o| {
                run_action(a, &p, &mut m, o).map_err(|e| e.message)
            })
            .0;
            assert_eq!(r, Ok(None));
        }
        assert_eq!(
            m.ran,
            [
                "dnf -y -q repoquery --available --qf %{version}-%{release} libnccl",
                "dnf -y -q install libnccl-2.27.3-1+cuda12.9",
                "dnf -y -q install python3-dnf-plugin-versionlock",
                "dnf versionlock add libnccl",
            ]
        );
    }

    /// More than one reboot when a step needs it: Ubuntu's signed modules are per kernel, so when
    /// the VM comes back on another kernel (an upgrade that landed with the first reboot) the
    /// plan installs that kernel's module package, and that step reboots again. The journal
    /// counts both reboots; the third boot finds nothing to do and verifies.
    #[test]
    fn a_step_that_needs_a_reboot_after_the_first_gets_a_second() {
        let dir = tempfile::tempdir().unwrap();
        let (key, fpr) = test_key();
        let (mut f, s) = fresh_ubuntu_hgx(dir.path().to_str().unwrap(), &fpr);
        f.secure_boot = Some(SecureBoot::Enabled);
        let mut m = FakeMachine { key, signer: "Canonical Ltd. Kernel Module Signing".into(), ..Default::default() };
        let first = apply_once(&plan::plan(&f, &s).unwrap(), &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        assert!(first.rebooted, "{:#?}", first.progress);

        f.kernel = Some("5.15.0-126-generic".into());
        let p2 = plan::plan(&f, &s).unwrap();
        let second = apply_once(&p2, &mut m, dir.path(), RebootPolicy::Auto, "boot-2");
        assert!(
            m.ran.iter().any(|l| l.contains("linux-modules-nvidia-550-server-open-5.15.0-126-generic")),
            "{:#?}",
            m.ran
        );
        assert!(second.rebooted, "a second reboot: {:#?}", second.progress);
        assert_eq!(second.state.reboots, 1);

        let third = apply_once(&p2, &mut m, dir.path(), RebootPolicy::Auto, "boot-3");
        assert!(!third.rebooted);
        assert_eq!(third.state.status, Status::Done);
        assert_eq!(third.state.reboots, 2);
    }

    /// After its reboot the install checks the VM runs the newest installed kernel, the one it
    /// meant to boot; another one (a saved GRUB default) is a warning that says so.
    #[test]
    fn after_its_reboot_the_install_checks_the_newest_kernel_runs() {
        let (dir, p, mut m) = fresh_install(None);
        assert!(apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1").rebooted);
        let boot = dir.path().join("root/boot");
        std::fs::create_dir_all(&boot).unwrap();
        for k in ["5.15.0-113-generic", "5.15.0-126-generic"] {
            std::fs::write(boot.join(format!("vmlinuz-{k}")), b"").unwrap();
        }
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-2");
        let f = r.state.findings.iter().find(|f| f.id == "install.running-kernel").expect("the finding");
        assert!(
            f.summary.contains("came back on kernel 5.15.0-113-generic, not the newest installed, 5.15.0-126-generic"),
            "{}",
            f.summary
        );
    }

    /// The running kernel's headers have left the mirror: the pre-flight stops and says to move
    /// to the kernel the mirror carries, instead of a bare "cannot install".
    #[test]
    fn headers_gone_from_the_mirror_say_to_upgrade_the_kernel() {
        let dir = tempfile::tempdir().unwrap();
        let (key, fpr) = test_key();
        let (mut f, s) = fresh_ubuntu_hgx(dir.path().to_str().unwrap(), &fpr);
        f.headers_present = false;
        let p = plan::plan(&f, &s).unwrap();
        let mut m = FakeMachine { key, missing: Some(format!("linux-headers-{}", p.kernel)), ..Default::default() };
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(r.state.status, Status::Failed);
        let e = r.state.error.as_deref().unwrap();
        assert!(
            e.contains(&format!("The headers of the running kernel {} have left the repositories", p.kernel)),
            "{e}"
        );
        assert!(e.contains("reboot into it, and run phq-agent install again"), "{e}");
    }

    /// The boot-safety gate: the newest kernel in /boot (GRUB's default on Ubuntu) has no
    /// nvidia module, so the VM would come back without its GPUs. No reboot, a failure that says
    /// which kernel and what to do; once the module is built, the rerun reboots.
    #[test]
    fn no_reboot_into_a_kernel_without_the_driver() {
        let (dir, p, mut m) = fresh_install(None);
        let boot = dir.path().join("root/boot");
        std::fs::create_dir_all(&boot).unwrap();
        for k in ["5.15.0-113-generic", "5.15.0-126-generic", "5.15.0-99-generic"] {
            std::fs::write(boot.join(format!("vmlinuz-{k}")), b"").unwrap();
        }
        m.module = Some(String::new());
        let first = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        assert!(!first.rebooted);
        assert_eq!(first.state.status, Status::RebootRequired);
        let f = first.state.findings.iter().find(|f| f.id == "install.boot-safety").expect("the gate's finding");
        assert_eq!(f.severity, Severity::Fail);
        assert!(f.summary.contains("(5.15.0-126-generic) would start without the GPU driver"), "{}", f.summary);
        assert!(f.detail.contains("Module nvidia not found"), "{}", f.detail);
        assert!(f.remedy.as_deref().unwrap().contains("dkms autoinstall -k 5.15.0-126-generic"));
        assert!(m.ran.iter().any(|l| l == "modinfo -k 5.15.0-126-generic -F version nvidia"), "{:#?}", m.ran);

        // A module of another version is no better.
        m.module = Some("550.54.15".into());
        let second = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        assert!(!second.rebooted);
        let f = second.state.findings.iter().find(|f| f.id == "install.boot-safety").unwrap();
        assert!(f.detail.contains("version 550.54.15, the installed driver 550.90.07"), "{}", f.detail);

        // Built for that kernel: the reboot goes ahead.
        m.module = None;
        let third = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        assert!(third.rebooted, "{:#?}", third.progress);
        assert!(third
            .progress
            .iter()
            .any(|l| l.contains("kernel 5.15.0-126-generic has nvidia 550.90.07; safe to reboot")));
    }

    /// Under Secure Boot an unsigned module is refused before the reboot; a signed one passes.
    #[test]
    fn under_secure_boot_the_next_kernels_module_must_be_signed() {
        let dir = tempfile::tempdir().unwrap();
        let (key, fpr) = test_key();
        let (mut f, s) = fresh_ubuntu_hgx(dir.path().to_str().unwrap(), &fpr);
        f.secure_boot = Some(SecureBoot::Enabled);
        let p = plan::plan(&f, &s).unwrap();
        let mut m = FakeMachine { key, ..Default::default() };
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        assert!(!r.rebooted);
        let f = r.state.findings.iter().find(|f| f.id == "install.boot-safety").expect("the gate's finding");
        assert!(f.detail.contains("unsigned and Secure Boot is on"), "{}", f.detail);
        m.signer = "Canonical Ltd. Kernel Module Signing".into();
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        assert!(r.rebooted, "{:#?}", r.progress);
    }

    /// A fresh Debian 12 guest (branch 550, which the fake machine's packages report) with
    /// Secure Boot on.
    fn fresh_debian_sb(dir: &Path) -> (Plan, FakeMachine) {
        let (key, fpr) = test_key();
        let (mut f, s) = fresh_ubuntu_hgx(dir.to_str().unwrap(), &fpr);
        f.os =
            Ok(OsRelease { id: "debian".into(), id_like: vec![], version_id: "12".into(), pretty_name: String::new() });
        f.kernel = Some("6.1.0-27-cloud-amd64".into());
        f.secure_boot = Some(SecureBoot::Enabled);
        f.apt_sources =
            vec![("/etc/apt/sources.list".into(), "deb http://debian.mirror.example/debian bookworm main\n".into())];
        let p = plan::plan(&f, &s).unwrap();
        // Debian 12's dkms signs with a key whose certificate says "DKMS module signing key".
        (p, FakeMachine { key, signer: "DKMS module signing key".into(), ..Default::default() })
    }

    /// Debian under Secure Boot: DKMS builds and signs the driver, and the install queues DKMS's
    /// key for enrolment — its one-time password on mokutil's stdin, never an argument, kept
    /// root-only for the person at the console. The gate does not reboot unattended into the MOK
    /// manager (nobody would answer it) but says what to do; a rerun before the console visit
    /// queues nothing twice; once the key is enrolled the rerun reboots.
    #[test]
    fn secure_boot_with_dkms_queues_the_key_and_waits_for_the_console() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (p, mut m) = fresh_debian_sb(dir.path());
        let ids: Vec<&str> = p.steps.iter().map(|s| s.id.as_str()).collect();
        let (driver, mok) = (ids.iter().position(|i| *i == "driver"), ids.iter().position(|i| *i == "mok"));
        assert!(driver.is_some() && mok > driver, "{ids:?}");
        assert!(!p.findings.iter().any(|f| f.severity == Severity::Fail), "{:#?}", p.findings);

        let first = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        assert!(!first.rebooted, "{:#?}", first.progress);
        assert_eq!(first.state.status, Status::RebootRequired);
        let f = first.state.findings.iter().find(|f| f.id == "install.mok-enrolment").expect("the console finding");
        assert!(f.remedy.as_deref().unwrap().contains("Enroll MOK"), "{f:?}");
        let file = dir.path().join("root").join(DOWNLOAD_DIR.trim_start_matches('/')).join(MOK_PASSWORD_FILE);
        assert!(f.detail.contains(&format!("{DOWNLOAD_DIR}/{MOK_PASSWORD_FILE}")), "{}", f.detail);
        let password = std::fs::read_to_string(&file).unwrap().trim().to_string();
        assert_eq!(password.len(), 12);
        assert!(password.bytes().all(|c| b"abcdefghjkmnpqrstuvwxyz23456789".contains(&c)), "{password}");
        assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(m.stdin, vec![format!("{password}\n{password}\n")]);
        assert!(m.ran.iter().any(|l| l == "mokutil --import /var/lib/dkms/mok.pub"), "{:#?}", m.ran);
        assert!(!m.ran.iter().any(|l| l.contains(&password)), "the password is never an argument");
        assert!(!first.progress.iter().any(|l| l.contains(&password)), "nor printed");

        // Rerun before anyone came to the console: nothing queued twice, still no reboot.
        let second = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        assert!(!second.rebooted);
        assert_eq!(m.ran.iter().filter(|l| l.starts_with("mokutil --import")).count(), 1);

        // Confirmed at the console: the gate lets the reboot happen.
        m.mok = FakeMok::Enrolled;
        let third = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        assert!(third.rebooted, "{:#?}", third.progress);
        // Enrolled: the one-time password has served, and is gone from the disk.
        assert!(!file.exists(), "the MOK password outlived the enrolment");
        assert!(third.progress.iter().any(|l| l.contains("one-time password is deleted")), "{:#?}", third.progress);
    }

    /// The run after the console's reboot asks mokutil nothing in its steps (the enrolment step
    /// is journaled, the reboot is behind it): the password is deleted all the same, once the
    /// firmware trusts the key, and kept while it does not.
    #[test]
    fn the_mok_password_goes_once_the_key_is_enrolled() {
        let dir = tempfile::tempdir().unwrap();
        let (p, mut m) = fresh_debian_sb(dir.path());
        apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        let file = dir.path().join("root").join(DOWNLOAD_DIR.trim_start_matches('/')).join(MOK_PASSWORD_FILE);
        assert!(file.is_file());
        // Still queued on the next boot (nobody came to the console): kept.
        apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "boot-2");
        assert!(file.is_file());
        m.mok = FakeMok::Enrolled;
        apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "boot-3");
        assert!(!file.exists());
    }

    /// DKMS made no key (a framework.conf pointing elsewhere): the step fails saying so, and
    /// nothing is imported.
    #[test]
    fn secure_boot_without_a_dkms_key_says_where_it_looked() {
        let dir = tempfile::tempdir().unwrap();
        let (p, mut m) = fresh_debian_sb(dir.path());
        m.mok = FakeMok::NoKey;
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
        assert_eq!(r.state.status, Status::Failed);
        let e = r.state.error.unwrap();
        assert!(e.starts_with("step mok: /var/lib/dkms/mok.pub is not there: DKMS made no signing key"), "{e}");
        assert!(!m.ran.iter().any(|l| l.starts_with("mokutil --import")));
    }

    /// The real runner hands the input to the program's stdin, and a program that never reads
    /// it (a pipe closed under a large write) neither hangs nor fails the call.
    #[test]
    fn the_system_runner_writes_stdin_and_survives_a_program_that_ignores_it() {
        let mut r = SystemRunner { log: None };
        let out = r.run_input("cat", &[], b"one\ntwo\n").unwrap();
        assert!(out.ok());
        assert_eq!(out.stdout, b"one\ntwo\n");
        let out = r.run_input("true", &[], &vec![b'x'; 4 << 20]).unwrap();
        assert!(out.ok());
    }

    /// `dnf repolist --all` as RHEL 9 prints it (header, id, name, status), with the repository
    /// ids each way of getting RHEL's packages uses: Red Hat's CDN through subscription-manager
    /// (which lists the EUS twins too), AWS's RHUI (the CRB id Percona's install docs enable with
    /// `dnf config-manager`), a RHUI with `rhui-` ids (PerfKitBenchmarker enables
    /// `rhui-codeready-builder-for-rhel-9-x86_64-rhui-rpms` on its RHEL 9 VMs), and an EUS
    /// variant of the last made up by the same naming, for the markers.
    fn repolist(lines: &[(&str, bool)]) -> String {
        let mut out = String::from(
            "repo id                                         repo name                                  status\n",
        );
        for (id, on) in lines {
            out.push_str(&format!(
                "{id:<47} Red Hat Enterprise Linux 9 repository      {}\n",
                if *on { "enabled" } else { "disabled" }
            ));
        }
        out
    }

    #[test]
    fn the_codeready_builder_that_goes_with_the_enabled_baseos() {
        let cases: &[(&[(&str, bool)], &str)] = &[
            (
                &[
                    ("codeready-builder-for-rhel-9-x86_64-eus-rpms", false),
                    ("codeready-builder-for-rhel-9-x86_64-rpms", false),
                    ("codeready-builder-for-rhel-9-x86_64-source-rpms", false),
                    ("rhel-9-for-x86_64-appstream-rpms", true),
                    ("rhel-9-for-x86_64-baseos-eus-rpms", false),
                    ("rhel-9-for-x86_64-baseos-rpms", true),
                ],
                "codeready-builder-for-rhel-9-x86_64-rpms",
            ),
            (
                &[
                    ("codeready-builder-for-rhel-9-x86_64-eus-rpms", false),
                    ("codeready-builder-for-rhel-9-x86_64-rpms", false),
                    ("rhel-9-for-x86_64-baseos-eus-rpms", true),
                    ("rhel-9-for-x86_64-baseos-rpms", false),
                ],
                "codeready-builder-for-rhel-9-x86_64-eus-rpms",
            ),
            (
                &[
                    ("codeready-builder-for-rhel-9-rhui-debug-rpms", false),
                    ("codeready-builder-for-rhel-9-rhui-rpms", false),
                    ("rhel-9-appstream-rhui-rpms", true),
                    ("rhel-9-baseos-rhui-rpms", true),
                    ("rhui-client-config-server-9", true),
                ],
                "codeready-builder-for-rhel-9-rhui-rpms",
            ),
            (
                &[
                    ("rhui-codeready-builder-for-rhel-9-x86_64-eus-rhui-rpms", false),
                    ("rhui-codeready-builder-for-rhel-9-x86_64-rhui-rpms", false),
                    ("rhui-rhel-9-for-x86_64-baseos-rhui-rpms", true),
                ],
                "rhui-codeready-builder-for-rhel-9-x86_64-rhui-rpms",
            ),
            (
                &[
                    ("rhui-codeready-builder-for-rhel-9-x86_64-eus-rhui-rpms", false),
                    ("rhui-codeready-builder-for-rhel-9-x86_64-rhui-rpms", false),
                    ("rhui-rhel-9-for-x86_64-baseos-eus-rhui-rpms", true),
                ],
                "rhui-codeready-builder-for-rhel-9-x86_64-eus-rhui-rpms",
            ),
        ];
        for (repos, want) in cases {
            let parsed = parse_repolist(&repolist(repos));
            assert_eq!(parsed.len(), repos.len(), "every line read");
            assert_eq!(crb_repo(&parsed), Ok((want.to_string(), false)), "{repos:?}");
        }
        // Already on; none known; no BaseOS at all.
        let on = parse_repolist(&repolist(&[
            ("codeready-builder-for-rhel-9-x86_64-rpms", true),
            ("rhel-9-for-x86_64-baseos-rpms", true),
        ]));
        assert_eq!(crb_repo(&on), Ok(("codeready-builder-for-rhel-9-x86_64-rpms".into(), true)));
        let none = parse_repolist(&repolist(&[("rhel-9-for-x86_64-baseos-rpms", true)]));
        assert!(crb_repo(&none).unwrap_err().contains(
            "no CodeReady Builder repository goes with the enabled rhel-9-for-x86_64-baseos-rpms (dnf knows none)"
        ));
        assert!(crb_repo(&[]).unwrap_err().contains("no BaseOS repository is enabled"));
    }

    /// subscription-manager owns redhat.repo's repositories, so those are enabled through it;
    /// a RHUI repository through dnf config-manager.
    #[test]
    fn crb_is_enabled_through_whoever_owns_its_repository() {
        let dir = tempfile::tempdir().unwrap();
        let (_, p, mut m) = fresh_install(None);
        let run = |m: &mut FakeMachine| {
            with_options(dir.path(), RebootPolicy::Never, None, 1, Duration::from_secs(1), |o| {
                run_action(&Action::EnableCrb, &p, m, o).map_err(|e| e.message)
            })
            .0
        };
        m.repolist = repolist(&[("codeready-builder-for-rhel-9-rhui-rpms", false), ("rhel-9-baseos-rhui-rpms", true)]);
        run(&mut m).unwrap();
        assert_eq!(m.ran.last().unwrap(), "dnf config-manager --set-enabled codeready-builder-for-rhel-9-rhui-rpms");

        m.repolist =
            repolist(&[("codeready-builder-for-rhel-9-x86_64-rpms", false), ("rhel-9-for-x86_64-baseos-rpms", true)]);
        let repos = dir.path().join("root/etc/yum.repos.d");
        std::fs::create_dir_all(&repos).unwrap();
        std::fs::write(repos.join("redhat.repo"), "[codeready-builder-for-rhel-9-x86_64-rpms]\nenabled = 0\n").unwrap();
        run(&mut m).unwrap();
        assert_eq!(
            m.ran.last().unwrap(),
            "subscription-manager repos --enable codeready-builder-for-rhel-9-x86_64-rpms"
        );

        m.repolist = repolist(&[("rhel-9-for-x86_64-baseos-rpms", true)]);
        let e = run(&mut m).unwrap_err();
        assert!(e.contains("register the machine"), "{e}");
    }

    #[test]
    fn a_failed_step_is_journaled_and_the_rerun_starts_there() {
        let (dir, p, mut m) = fresh_install(None);
        // The toolkit resolves in the pre-flight and fails when installed.
        m.fail_when = Some("confold install cuda-toolkit-12-4".into());
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(r.state.status, Status::Failed);
        assert!(r.state.error.as_deref().unwrap().starts_with("step toolkit:"), "{:?}", r.state.error);
        let f = r.state.findings.iter().find(|f| f.id == "install.step-failed").unwrap();
        assert!(f.summary.contains("Unable to locate package"), "{}", f.summary);
        assert_eq!(
            m.ran.iter().filter(|l| l.contains("confold install cuda-toolkit-12-4")).count(),
            4,
            "network retries"
        );

        m.fail_when = None;
        m.ran.clear();
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert!(m.ran[0].contains("install cuda-toolkit-12-4"), "{:#?}", m.ran);
        assert_eq!(r.state.status, Status::RebootRequired);
        assert!(r.state.findings.iter().any(|f| f.id == "install.reboot-required"));
    }

    /// A step that runs again (here the driver, changed as a replaced branch changes it) makes
    /// the steps after it run again too, though the journal recorded them with the same
    /// commands: what they did was built on the old driver.
    #[test]
    fn a_step_that_runs_again_makes_the_later_steps_due() {
        let (dir, mut p, mut m) = fresh_install(None);
        m.fail_when = Some("confold install cuda-toolkit-12-4".into());
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert!(r.state.steps.contains_key("persistenced"), "{:?}", r.state.steps.keys());
        m.fail_when = None;
        m.ran.clear();
        let driver = p.steps.iter_mut().find(|s| s.id.as_str() == "driver").unwrap();
        driver.actions.push(Action::Run(super::super::plan::cmd("true", &[])));
        apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        let at = |needle: &str| m.ran.iter().position(|l| l.contains(needle));
        let (driver, persistenced) = (at("true"), at("systemctl enable nvidia-persistenced.service"));
        assert!(driver.is_some() && persistenced > driver, "{:#?}", m.ran);
    }

    /// A kill inside dpkg's unpacking leaves a reinst-required package, which neither
    /// `dpkg --configure -a` nor `apt-get install -f` (without its archive) repairs; the repair
    /// removes it first (for its step to install it again) and goes on.
    #[test]
    fn a_package_killed_while_unpacking_is_removed_and_installed_again() {
        let (dir, mut p, mut m) = fresh_install(None);
        // The plan's repair step, as the plan makes it for an interrupted dpkg.
        p.steps.insert(
            0,
            plan::Step {
                id: StepId::Repair,
                title: "finish what dpkg left half-done (dpkg was interrupted)".into(),
                actions: vec![Action::RepairDpkg {
                    configure: plan::Cmd {
                        program: "dpkg".into(),
                        args: vec![Arg::Lit("--configure".into()), Arg::Lit("-a".into())],
                        env: vec![],
                        retry: Retry::DpkgLock,
                        url: None,
                    },
                    fix: plan::Cmd {
                        program: "apt-get".into(),
                        args: vec![Arg::Lit("install".into()), Arg::Lit("-f".into())],
                        env: vec![],
                        retry: Retry::Never,
                        url: None,
                    },
                }],
                done: None,
                needs_reboot: false,
            },
        );
        m.reinstreq = Some("cuda-keyring".into());
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(r.state.status, Status::RebootRequired, "{:?} {:#?}", r.state.error, m.ran);
        let removed =
            m.ran.iter().position(|l| l == "dpkg --remove --force-remove-reinstreq cuda-keyring").expect("removed");
        assert!(m.ran[removed + 1] == "dpkg --configure -a", "configured after the removal: {:#?}", m.ran);
        assert!(
            r.progress.iter().any(|l| l.contains("cuda-keyring was interrupted while unpacking")),
            "{:#?}",
            r.progress
        );
    }

    #[test]
    fn dnf_assumeno_is_a_refusal_only_when_it_says_so() {
        let resolved = "Dependencies resolved.\nTransaction Summary\nInstall  3 Packages\nOperation aborted.\nError: Operation aborted.\n";
        assert!(!dnf_refused(resolved, &unresolvable(resolved)));
        let missing = "No match for argument: cuda-toolkit-12-6\nError: Unable to find a match: cuda-toolkit-12-6\n";
        assert_eq!(unresolvable(missing), ["cuda-toolkit-12-6"]);
        assert!(dnf_refused(missing, &unresolvable(missing)));
        let conflict =
            "Error: \n Problem: package nvidia-driver-3:580.65.06-1.el9.x86_64 requires nvidia-kmod-common\n";
        assert!(dnf_refused(conflict, &unresolvable(conflict)));
        let apt = "Reading package lists...\nE: Unable to locate package nvidia-open-580\nE: Package 'cuda-toolkit-12-9' has no installation candidate\n";
        assert_eq!(unresolvable(apt), ["nvidia-open-580", "cuda-toolkit-12-9"]);
        // A dependency no repository has: apt's words when Debian's contrib is off (as the
        // real-apt test saw them), and dnf's.
        let dep = "The following packages have unmet dependencies:\n nvidia-driver-cuda : Depends: nvidia-support but it is not installable\nE: Unable to correct problems, you have held broken packages.\n";
        assert_eq!(unresolvable(dep), ["nvidia-support"]);
        let dnf = "Error: \n Problem: cannot install the best candidate for the job\n  - nothing provides dkms needed by kmod-nvidia-open-dkms-3:580.82.07-1.el9.noarch\n";
        assert_eq!(unresolvable(dnf), ["dkms"]);
        // dnf 4.14 -q install --assumeno, as the real-dnf test saw it.
        let quiet = "Error: Unable to find a match: cuda-toolkit-12-6 libnvidia-nscq-999\n";
        assert_eq!(unresolvable(quiet), ["cuda-toolkit-12-6", "libnvidia-nscq-999"]);
        assert!(dnf_refused(quiet, &unresolvable(quiet)));
    }

    /// A package the repositories lack stops the install in the pre-flight, with its name,
    /// before any package is installed; the rerun, once the repositories have it, goes on.
    #[test]
    fn a_package_the_repositories_lack_stops_the_install_before_any_is_installed() {
        let (dir, p, mut m) = fresh_install(None);
        let steps: Vec<&str> = p.steps.iter().map(|s| s.id.as_str()).collect();
        let at = |id| steps.iter().position(|s| *s == id).unwrap();
        assert!(at("repo") < at("preflight") && at("preflight") < at("headers"), "{steps:?}");
        m.missing = Some("nvidia-fabricmanager-550".into());
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(r.state.status, Status::Failed);
        let e = r.state.error.as_deref().unwrap();
        assert!(
            e.starts_with("step preflight:")
                && e.contains("cannot install nvidia-fabricmanager-550; nothing was installed"),
            "{e}"
        );
        let simulated = m.ran.iter().position(|l| l.starts_with("apt-get -s -q install")).expect("the pre-flight ran");
        assert!(
            m.ran[simulated].contains("cuda-toolkit-12-4") && m.ran[simulated].contains("nvidia-dkms-550-open"),
            "{}",
            m.ran[simulated]
        );
        let installs_after: Vec<&String> = m.ran[simulated + 1..].iter().filter(|l| l.contains(" install ")).collect();
        assert!(installs_after.is_empty(), "installed after a failed pre-flight: {installs_after:?}");

        m.missing = None;
        m.ran.clear();
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert!(m.ran[0].starts_with("apt-get -s -q install"), "the pre-flight runs again first: {:#?}", m.ran);
        assert_eq!(r.state.status, Status::RebootRequired);
    }

    #[test]
    fn an_unreachable_repository_names_the_url_after_bounded_retries() {
        let (dir, p, mut m) = fresh_install(None);
        m.offline = true;
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(m.fetched, 4);
        assert_eq!(m.slept, Duration::from_secs(2 + 4 + 8));
        let f = r.state.findings.iter().find(|f| f.id == "install.unreachable").unwrap();
        assert!(f.summary.contains(
            "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/cuda-keyring_1.1-1_all.deb"
        ));
        assert!(m.ran.is_empty(), "nothing may run after the repository step failed");
    }

    #[test]
    fn downloads_go_to_a_directory_only_the_installer_can_write() {
        use std::os::unix::fs::PermissionsExt;
        let (dir, p, mut m) = fresh_install(None);
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_ne!(r.state.status, Status::Failed, "{:?}", r.state.error);
        let downloads = dir.path().join("root").join(plan::DOWNLOAD_DIR.trim_start_matches('/'));
        assert_eq!(std::fs::metadata(&downloads).unwrap().permissions().mode() & 0o777, 0o700);
        assert!(downloads.join(plan::CUDA_KEYRING_DEB).is_file());
        assert!(!plan::DOWNLOAD_DIR.starts_with("/var/lib/phq-agent/"), "never in the service's own directory");

        // A link planted where the directory should be is refused, and nothing is installed.
        let (dir, p, mut m) = fresh_install(None);
        let downloads = dir.path().join("root").join(plan::DOWNLOAD_DIR.trim_start_matches('/'));
        std::fs::create_dir_all(downloads.parent().unwrap()).unwrap();
        std::fs::create_dir_all(dir.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &downloads).unwrap();
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(r.state.status, Status::Failed);
        assert!(r.state.error.as_deref().unwrap().contains("a symlink, or another user's"), "{:?}", r.state.error);
        assert!(!m.ran.iter().any(|l| l.starts_with("dpkg -i")), "{:#?}", m.ran);
        assert_eq!(std::fs::read_dir(dir.path().join("elsewhere")).unwrap().count(), 0);
    }

    #[test]
    fn a_wrong_key_is_never_trusted() {
        let (dir, p, mut m) = fresh_install(Some(crate::facts::NVIDIA_REPO_KEY_FINGERPRINT));
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(r.state.status, Status::Failed);
        assert!(r.state.error.as_deref().unwrap().contains("is not the pinned key"), "{:?}", r.state.error);
        assert!(!dir.path().join("root").join(plan::NVIDIA_APT_KEYRING.trim_start_matches('/')).exists());
        assert!(!m.ran.iter().any(|l| l.starts_with("apt-get")), "{:#?}", m.ran);
    }

    /// A keyring package with NVIDIA's genuine key, a maintainer script and a source of its own
    /// (`[trusted=yes]`): only the key is taken out of it, checked, and written by the installer;
    /// the package is never given to dpkg, so its script never runs and its source never lands.
    #[test]
    fn a_keyring_package_gives_its_key_and_nothing_else() {
        let (dir, p, mut m) = fresh_install(None);
        m.deb_extra = vec![
            ("./DEBIAN/postinst".into(), b"#!/bin/sh\ntouch /tmp/owned\n".to_vec()),
            ("./etc/apt/sources.list.d/extra.list".into(), b"deb [trusted=yes] http://evil.example/ ./\n".to_vec()),
        ];
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(r.state.status, Status::RebootRequired, "{:?}", r.state.error);
        assert!(!m.ran.iter().any(|l| l.starts_with("dpkg -i") || l.starts_with("dpkg --install")), "{:#?}", m.ran);
        let root = dir.path().join("root");
        assert_eq!(std::fs::read(root.join(plan::NVIDIA_APT_KEYRING.trim_start_matches('/'))).unwrap(), m.key);
        assert!(!root.join("etc/apt/sources.list.d/extra.list").exists());
        let source = std::fs::read_to_string(root.join("etc/apt/sources.list.d/cuda-ubuntu2204-x86_64.list")).unwrap();
        assert!(
            source.contains(&format!(
                "deb [signed-by={}] https://developer.download.nvidia.com/",
                plan::NVIDIA_APT_KEYRING
            )),
            "{source}"
        );
        // A keyring whose key file holds a second key is refused before anything is written.
        let (dir, p, mut m) = fresh_install(None);
        let (other, _) = test_key_seeded(9);
        m.key = [m.key.clone(), other].concat();
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(r.state.status, Status::Failed);
        assert!(r.state.error.as_deref().unwrap().contains("2 primary keys"), "{:?}", r.state.error);
        assert!(!dir.path().join("root").join(plan::NVIDIA_APT_KEYRING.trim_start_matches('/')).exists());
    }

    /// Issue 37: a keyring package from a mirror that unpacks without end (a compression bomb)
    /// is read only up to the cap, and dpkg-deb stopped; a key file that claims more than a
    /// keyring could be is refused without reading it. Either way nothing is trusted, and the
    /// error names the package and the cap.
    #[test]
    fn a_keyring_package_that_unpacks_without_end_is_refused_at_the_cap() {
        for (bomb, says) in [
            (DebBomb::EndlessBefore, format!("run past {MAX_DEB_TAR_BYTES} bytes unpacked")),
            (DebBomb::HugeMember, format!("is 8589934592 bytes, past the {MAX_DEB_MEMBER_BYTES}-byte cap")),
        ] {
            let (dir, p, mut m) = fresh_install(None);
            m.deb_bomb = Some(bomb);
            let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
            assert_eq!(r.state.status, Status::Failed, "{bomb:?}");
            let e = r.state.error.as_deref().unwrap();
            assert!(e.contains(plan::CUDA_KEYRING_DEB) && e.contains(&says), "{bomb:?}: {e}");
            assert!(m.deb_read <= MAX_DEB_TAR_BYTES + 64 * 1024, "{bomb:?}: read {} bytes", m.deb_read);
            assert!(!dir.path().join("root").join(plan::NVIDIA_APT_KEYRING.trim_start_matches('/')).exists());
            assert!(!m.ran.iter().any(|l| l.starts_with("apt-get")), "{:#?}", m.ran);
        }
    }

    /// The real runner stops reading when told, and the writer with it: `yes` writes without
    /// end, and the call returns once the reader has had 1 MiB.
    #[test]
    fn the_system_runner_stops_a_writer_whose_output_is_no_longer_read() {
        let mut r = SystemRunner { log: None };
        let mut got = 0u64;
        let started = Instant::now();
        let out = r
            .run_reading("yes", &[], &mut |stdout| {
                got = std::io::copy(&mut stdout.take(1 << 20), &mut std::io::sink()).unwrap();
            })
            .unwrap();
        assert_eq!(got, 1 << 20);
        assert!(!out.ok(), "yes ends on the closed pipe: {out:?}");
        assert!(started.elapsed() < Duration::from_secs(30));
        // A program that ends on its own keeps its status and stderr.
        let out = r.run_reading("ls", &["/nonexistent-phq".into()], &mut |_| {}).unwrap();
        assert!(!out.ok() && out.stderr.contains("nonexistent-phq"), "{out:?}");
    }

    /// Issue 37: the keyring package's key file carries the pinned key and a subkey appended by
    /// someone else, unbound: root's keyring gets the pinned key alone, and the run says what
    /// it left out.
    #[test]
    fn a_foreign_subkey_never_reaches_roots_keyring() {
        let (dir, p, mut m) = fresh_install(None);
        let mut foreign = test_key_seeded(9).0;
        foreign[0] = 0xce; // the same key material as a public-subkey packet (tag 14)
        let pinned = m.key.clone();
        m.key = [pinned.clone(), foreign].concat();
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(r.state.status, Status::RebootRequired, "{:?}", r.state.error);
        let root = dir.path().join("root");
        assert_eq!(std::fs::read(root.join(plan::NVIDIA_APT_KEYRING.trim_start_matches('/'))).unwrap(), pinned);
        assert!(r.progress.iter().any(|l| l.contains("left out subkey")), "{:#?}", r.progress);
    }

    /// RHEL: EPEL's and NVIDIA's key files each hold exactly their pinned key, or nothing is
    /// imported; what rpm imports is the agent's own armor of the verified packets.
    #[test]
    fn an_el_key_file_with_a_second_block_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (key, fpr) = test_key();
        let (mut f, s) = fresh_ubuntu_hgx("", &fpr);
        f.os =
            Ok(OsRelease { id: "rhel".into(), id_like: vec![], version_id: "9.4".into(), pretty_name: String::new() });
        f.kernel = Some("5.14.0-427.13.1.el9_4.x86_64".into());
        let p = plan::plan(&f, &s).unwrap();
        // EPEL's pinned key cannot be made here, so the plan's EPEL key step fails with its own
        // fingerprint named; NVIDIA's (the test key) is what the fetches serve.
        let armored = crate::install::pgp::armor(&key);
        let evil = crate::install::pgp::armor(&test_key_seeded(5).0);
        let mut m = FakeMachine {
            key: key.clone(),
            served: Some(format!("{armored}{evil}").into_bytes()),
            ..Default::default()
        };
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(r.state.status, Status::Failed);
        assert!(r.state.error.as_deref().unwrap().contains("second armored block"), "{:?}", r.state.error);
        assert!(!m.ran.iter().any(|l| l.starts_with("rpm --import")), "{:#?}", m.ran);
        assert!(!dir.path().join("root/etc/pki/rpm-gpg").exists());

        // Rocky (no EPEL key to fetch): the NVIDIA key alone, re-armored by us, is imported.
        let dir = tempfile::tempdir().unwrap();
        f.os =
            Ok(OsRelease { id: "rocky".into(), id_like: vec![], version_id: "9.4".into(), pretty_name: String::new() });
        let p = plan::plan(&f, &s).unwrap();
        let mut m = FakeMachine {
            key: key.clone(),
            served: Some(format!("{armored}{evil}").into_bytes()),
            ..Default::default()
        };
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert!(
            r.state
                .error
                .as_deref()
                .unwrap()
                .contains("D42D0685.pub is not the pinned key: it holds a second armored block"),
            "{:?}",
            r.state.error
        );
        assert!(!m.ran.iter().any(|l| l.starts_with("rpm --import")), "{:#?}", m.ran);
        let dir = tempfile::tempdir().unwrap();
        let served = format!(
            "-----BEGIN PGP PUBLIC KEY BLOCK-----\nComment: as served\n\n{}",
            armored.split_once("\n\n").unwrap().1
        );
        let mut m = FakeMachine { key, served: Some(served.into_bytes()), ..Default::default() };
        apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert!(m.ran.iter().any(|l| l == &format!("rpm --import {}", plan::RHEL_KEY_PATH)), "{:#?}", m.ran);
        let written =
            std::fs::read_to_string(dir.path().join("root").join(plan::RHEL_KEY_PATH.trim_start_matches('/'))).unwrap();
        assert_eq!(written, armored, "our armor, not the file as served");
    }

    /// Root's files never follow a link the service's user (or anyone) planted: the journal's
    /// directory must be root's and closed to others, and the lock and the log are opened with
    /// O_NOFOLLOW; each planted link leaves its target untouched.
    #[test]
    fn planted_links_in_the_journal_directory_leave_their_targets_untouched() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious\n").unwrap();
        let journal = dir.path().join("journal");
        std::fs::create_dir(&journal).unwrap();
        for name in ["lock", "log"] {
            std::os::unix::fs::symlink(&victim, journal.join(name)).unwrap();
        }
        let e = lock(&journal).err().unwrap();
        assert!(e.contains("is a symbolic link"), "{e}");
        let e = lock_wait(&journal).err().unwrap();
        assert!(e.contains("is a symbolic link"), "{e}");
        let runner = SystemRunner::new(&journal);
        assert!(runner.log.is_none());
        // The journal itself: a link at its name is replaced, never written through.
        std::os::unix::fs::symlink(&victim, state_path(&journal)).unwrap();
        let (_, p, mut m) = fresh_install(None);
        with_options(dir.path(), RebootPolicy::Never, Some("b"), 1, Duration::ZERO, |o| apply(&p, &mut m, o).unwrap());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
        assert!(!std::fs::symlink_metadata(state_path(&journal)).unwrap().file_type().is_symlink());

        // A journal directory that is a link, or that others can write, is refused.
        let linked = dir.path().join("linked");
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &linked).unwrap();
        std::fs::create_dir(dir.path().join("elsewhere")).unwrap();
        assert!(lock(&linked).err().unwrap().contains("not a directory of uid"));
        std::fs::set_permissions(&journal, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(lock(&journal).err().unwrap().contains("open to others"));
        assert_eq!(std::fs::read_dir(dir.path().join("elsewhere")).unwrap().count(), 0);
        // The journal's default home is root's own, outside the service's state directory.
        assert!(!JOURNAL_DIR.starts_with(&format!("{}/", crate::config::AgentConfig::default().state_dir.display())));
    }

    #[test]
    fn redirects_never_go_down_from_https_and_stop_after_ten() {
        assert!(redirect_allowed("https://a.example/k", "https://b.example/k", 0).is_ok());
        assert!(redirect_allowed("http://a.example/k", "http://b.example/k", 0).is_ok());
        assert!(redirect_allowed("http://a.example/k", "https://b.example/k", 0).is_ok());
        let e = redirect_allowed("https://a.example/k", "http://b.example/k", 0).unwrap_err();
        assert!(e.contains("from https down to http"), "{e}");
        assert!(redirect_allowed("HTTPS://a.example/k", "ftp://b.example/k", 0).is_err());
        assert!(redirect_allowed("https://a.example/k", "https://a.example/j", 10)
            .unwrap_err()
            .contains("more than 10"));
    }

    /// A real HTTP server on 127.0.0.1: a body past the cap is refused, whether announced by
    /// Content-Length or only sent; a redirect chain longer than ten is refused.
    #[test]
    fn downloads_are_capped_and_redirects_bounded() {
        use std::io::{BufRead, BufReader};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let mut conn = conn;
                let mut line = String::new();
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                reader.read_line(&mut line).unwrap();
                loop {
                    let mut h = String::new();
                    if reader.read_line(&mut h).unwrap() == 0 || h == "\r\n" {
                        break;
                    }
                }
                let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
                let _ = match path.as_str() {
                    "/small" => {
                        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
                    }
                    "/announced" => {
                        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\nConnection: close\r\n\r\n")
                    }
                    "/endless" => {
                        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n");
                        let chunk = vec![b'x'; 64 * 1024];
                        // Bounded: 8 MiB, past the test's 1 MiB cap, then the server stops.
                        for _ in 0..128 {
                            if conn.write_all(&chunk).is_err() {
                                break;
                            }
                        }
                        Ok(())
                    }
                    p if p.starts_with("/loop") => conn.write_all(
                        format!(
                            "HTTP/1.1 302 Found\r\nLocation: /loop{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                            p.len()
                        )
                        .as_bytes(),
                    ),
                    _ => conn.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
                };
            }
        });
        let url = |p: &str| format!("http://127.0.0.1:{port}{p}");
        assert_eq!(download(&url("/small"), 1 << 20).unwrap(), b"hello");
        let e = download(&url("/announced"), 1 << 20).unwrap_err();
        assert!(e.contains("announces 999999999 bytes"), "{e}");
        let e = download(&url("/endless"), 1 << 20).unwrap_err();
        assert!(e.contains("runs past 1048576 bytes"), "{e}");
        let e = download(&url("/loop"), 1 << 20).unwrap_err();
        assert!(e.contains("more than 10 redirects"), "{e}");
        assert_eq!(download(&url("/nothing"), 1 << 20).unwrap_err(), "HTTP 404 Not Found");
    }

    #[test]
    fn the_lock_refuses_a_second_installer() {
        let dir = tempfile::tempdir().unwrap();
        let held = lock(dir.path()).unwrap();
        let e = lock(dir.path()).err().unwrap();
        assert!(
            e.contains("another phq-agent install is running") && e.contains(&std::process::id().to_string()),
            "{e}"
        );
        drop(held);
        assert!(lock(dir.path()).is_ok());
    }

    #[test]
    fn a_held_dpkg_lock_is_waited_for_then_given_up_on() {
        let (dir, p, mut m) = fresh_install_interrupted();
        m.lock_busy = 3;
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(r.state.status, Status::RebootRequired, "{:?}", r.state.error);
        assert_eq!(m.ran.iter().filter(|l| l.starts_with("dpkg --configure -a")).count(), 4);
        assert!(r.progress.iter().any(|l| l.contains("holds the dpkg lock; waiting")));

        // Held past lock_wait: a clear failure that names the holder.
        let dir = tempfile::tempdir().unwrap();
        let mut m = FakeMachine { key: m.key.clone(), lock_busy: u32::MAX, ..Default::default() };
        let (st, _, _) =
            with_options(dir.path(), RebootPolicy::Never, None, 1, Duration::ZERO, |o| apply(&p, &mut m, o).unwrap());
        assert_eq!(st.status, Status::Failed);
        assert!(st.error.as_deref().unwrap().contains("locked by another process with pid 4242"), "{:?}", st.error);
    }

    #[test]
    fn madison_output() {
        let v = parse_madison(" nvidia-fabricmanager-550 | 550.90.07-1 | http://r/ Packages\n\ngarbage\n");
        assert_eq!(v, ["550.90.07-1"]);
    }
}
