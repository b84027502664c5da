//! The install journal: `JOURNAL_DIR/state.json`, the installer's state in one file that a
//! reboot, a crash or `kill -9` leaves readable, and the service reports as `install`.
//!
//! The rules of this room:
//! 1. The journal moves between statuses only through the named transitions on `State`
//!    (`begin`, `start_step`, `finish_step`, `skip_step`, `need_reboot`, `start_reboot`,
//!    `await_reboot`, `fail`, `complete`); each refuses a move its status does not allow
//!    (`Status::allows`), as zincati's update agent refuses one. Nothing else writes `status`.
//! 2. "A reboot is pending" is kept in one place, `reboot_pending_since` with its reason, set
//!    by `need_reboot` and cleared by `resume_after_boot` when the boot is another.
//! 3. Every save's error is the caller's: a journal that cannot be written stops the install
//!    with an error naming the file (`JournalError`).
//! 4. The format on disk is `phq.install/v1` as it always was: cloud-init's user-data greps it
//!    for `"status": "reboot-required"`, the service and bundles read it.

use super::own_dir::{self, DirError};
use super::plan::StepId;
use crate::checks::Finding;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const STATE_SCHEMA: &str = "phq.install/v1";

/// Where the installer keeps its journal (`state.json`, readable by all: the service reports it,
/// cloud-init and phq-agent-install.service look at it), its lock and its log (root's alone).
/// Root's, 0755; made by the package's tmpfiles entry and by the installer itself.
pub const JOURNAL_DIR: &str = "/var/lib/phq-agent-install";

/// The journal is a few kilobytes; a larger file is not one the installer wrote.
const MAX_JOURNAL_BYTES: u64 = 4 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    /// A run is going through the steps (or was killed while it did).
    Running,
    /// The run stopped short of a reboot it needs: `--reboot never`, the boot-safety gate, or a
    /// reboot that failed.
    RebootRequired,
    /// The run asked for the reboot; the next boot resumes.
    Rebooting,
    Failed,
    Done,
}

impl Status {
    /// Whether the journal may go from `self` to `to`. A run begins from any status (the last
    /// one finished, stopped, failed, or was killed while running); only a running install
    /// ends, in one of the four ends; a reboot that was asked for and failed leaves it
    /// required.
    pub fn allows(self, to: Status) -> bool {
        use Status::*;
        matches!(
            (self, to),
            (_, Running) | (Running, RebootRequired | Rebooting | Failed | Done) | (Rebooting, RebootRequired)
        )
    }

    fn as_str(self) -> &'static str {
        match self {
            Status::Running => "running",
            Status::RebootRequired => "reboot-required",
            Status::Rebooting => "rebooting",
            Status::Failed => "failed",
            Status::Done => "done",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub finished_at: String,
    pub hash: String,
    pub seconds: f64,
}

/// The journal, and the installer's state in reports (`install`). Its fields are the file's;
/// change them only through the transitions below.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub schema: String,
    pub status: Status,
    pub plan: String,
    pub started_at: String,
    pub updated_at: String,
    /// Steps finished, by id (`StepId::as_str`; a name no step has any more is kept, unused).
    pub steps: BTreeMap<String, StepRecord>,
    /// The boot in which a step that needs a reboot finished; cleared by the next boot.
    /// `"unknown"` when the boot id could not be read (then only a person can tell).
    pub reboot_pending_since: Option<String>,
    pub reboot_reason: Option<String>,
    pub reboots: u32,
    pub error: Option<String>,
    pub findings: Vec<Finding>,
}

/// A move the journal's status does not allow (`Status::allows`): a bug in the installer, which
/// stops it rather than write a journal that says something that did not happen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the install journal cannot go from {from} to {to}")]
pub struct IllegalTransition {
    pub from: Status,
    pub to: Status,
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: {source}", path.display())]
    Decode { path: PathBuf, source: serde_json::Error },
    #[error("cannot encode the journal: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("{}: cannot write the journal: {source}", path.display())]
    Write { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Dir(#[from] DirError),
    #[error(transparent)]
    Illegal(#[from] IllegalTransition),
}

impl State {
    /// The journal of an install that starts now, for the plan summarised by `plan`.
    pub fn new(plan: &str) -> State {
        let now = crate::snapshot::Timestamp::now().to_string();
        State {
            schema: STATE_SCHEMA.into(),
            status: Status::Running,
            plan: plan.into(),
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

    fn go(&mut self, to: Status) -> Result<(), IllegalTransition> {
        if !self.status.allows(to) {
            return Err(IllegalTransition { from: self.status, to });
        }
        self.status = to;
        Ok(())
    }

    /// Only a running install changes its steps.
    fn running(&self) -> Result<(), IllegalTransition> {
        match self.status {
            Status::Running => Ok(()),
            from => Err(IllegalTransition { from, to: Status::Running }),
        }
    }

    /// A run begins, from whatever status the last one left: for the plan summarised by `plan`,
    /// with its findings, no error, and an earlier reboot counted (`resume_after_boot`).
    pub fn begin(
        &mut self,
        plan: &str,
        findings: Vec<Finding>,
        boot_id: Option<&str>,
    ) -> Result<(), IllegalTransition> {
        self.go(Status::Running)?;
        self.plan = plan.into();
        self.error = None;
        self.findings = findings;
        self.resume_after_boot(boot_id);
        Ok(())
    }

    /// A different boot than the one that needed a reboot: it happened. Counted once, and the
    /// pending reboot forgotten. An unknown boot (either side) proves nothing.
    pub fn resume_after_boot(&mut self, boot_id: Option<&str>) {
        if let (Some(pending), Some(now)) = (&self.reboot_pending_since, boot_id) {
            if pending != now && pending != "unknown" {
                self.reboot_pending_since = None;
                self.reboot_reason = None;
                self.reboots += 1;
            }
        }
    }

    /// Whether step `id` is journaled as done with this `hash` (what it does now).
    pub fn has_step(&self, id: StepId, hash: &str) -> bool {
        self.steps.get(id.as_str()).is_some_and(|r| r.hash == hash)
    }

    /// A step starts (again): the records of the steps after it (`later`) go, since what they
    /// did was built on what this one is about to change.
    pub fn start_step(&mut self, later: &[StepId]) -> Result<(), IllegalTransition> {
        self.running()?;
        self.steps.retain(|id, _| !later.iter().any(|l| l.as_str() == id));
        Ok(())
    }

    /// A step finished: journaled with its hash; one that changed the modules or the initramfs
    /// makes a reboot pending.
    pub fn finish_step(
        &mut self,
        id: StepId,
        hash: String,
        seconds: f64,
        needs_reboot: bool,
        boot_id: Option<&str>,
    ) -> Result<(), IllegalTransition> {
        self.running()?;
        self.steps.insert(
            id.as_str().into(),
            StepRecord { finished_at: crate::snapshot::Timestamp::now().to_string(), hash, seconds },
        );
        if needs_reboot {
            self.need_reboot(boot_id, format!("step {id} changed the kernel modules or the initramfs"))?;
        }
        Ok(())
    }

    /// A step that found nothing it may do on this guest: not journaled (the next run looks
    /// again), its finding kept.
    pub fn skip_step(&mut self, why: Finding) -> Result<(), IllegalTransition> {
        self.running()?;
        self.findings.push(why);
        Ok(())
    }

    /// A reboot is needed, since `boot_id` (the one place that says so); a reboot already
    /// pending keeps its own boot and reason.
    pub fn need_reboot(&mut self, boot_id: Option<&str>, reason: String) -> Result<(), IllegalTransition> {
        self.running()?;
        if self.reboot_pending_since.is_none() {
            self.reboot_pending_since = Some(boot_id.unwrap_or("unknown").into());
            self.reboot_reason = Some(reason);
        }
        Ok(())
    }

    /// Why a reboot is pending, when one is.
    pub fn reboot_pending(&self) -> Option<&str> {
        self.reboot_pending_since.as_ref().map(|_| self.reboot_reason.as_deref().unwrap_or("a step needs it"))
    }

    /// The reboot is asked for; the journal says so before it happens.
    pub fn start_reboot(&mut self) -> Result<(), IllegalTransition> {
        self.go(Status::Rebooting)
    }

    /// Stopped short of the reboot: `finding` says why and what to do, `error` when it is a
    /// failure (the gate refused, the reboot failed) rather than a choice (`--reboot never`).
    pub fn await_reboot(&mut self, error: Option<String>, finding: Finding) -> Result<(), IllegalTransition> {
        self.go(Status::RebootRequired)?;
        if error.is_some() {
            self.error = error;
        }
        self.findings.push(finding);
        Ok(())
    }

    pub fn fail(&mut self, error: String, finding: Finding) -> Result<(), IllegalTransition> {
        self.go(Status::Failed)?;
        self.error = Some(error);
        self.findings.push(finding);
        Ok(())
    }

    /// Every step is done; `found` is what the verification found wrong.
    pub fn complete(&mut self, found: Vec<Finding>) -> Result<(), IllegalTransition> {
        self.go(Status::Done)?;
        self.findings.extend(found);
        Ok(())
    }
}

pub fn state_path(journal_dir: &Path) -> PathBuf {
    journal_dir.join("state.json")
}

/// The journal as it is on disk; `Ok(None)` when no install has run. Read without following a
/// link, and only from a regular file (a FIFO would hang the reader).
pub fn load_state(journal_dir: &Path) -> Result<Option<State>, JournalError> {
    let path = state_path(journal_dir);
    match crate::sysroot::read_regular(&path, true, MAX_JOURNAL_BYTES) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|source| JournalError::Decode { path, source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(JournalError::Read { path, source }),
    }
}

/// The journal's bytes as written to `state.json`. cloud-init's user-data greps them for
/// `"status": "reboot-required"` to decide on its reboot, so this encoding is a contract.
pub fn journal_bytes(st: &State) -> Result<Vec<u8>, JournalError> {
    Ok(serde_json::to_vec_pretty(st)?)
}

/// Writes the journal whole (`durable::write`: a temporary file, fsynced, renamed over the old
/// one, which also replaces a link planted at its name rather than writing through it).
pub fn save(journal_dir: &Path, st: &mut State) -> Result<(), JournalError> {
    st.updated_at = crate::snapshot::Timestamp::now().to_string();
    own_dir::own_dir(journal_dir, own_dir::Kind::Journal)?;
    let path = state_path(journal_dir);
    let json = journal_bytes(st)?;
    crate::durable::write(&path, &json, 0o644).map_err(|source| JournalError::Write { path, source })
}

#[cfg(test)]
mod tests;
