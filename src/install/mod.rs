//! install: read the guest's facts once (`gather`), plan purely (`plan/`), apply step by step
//! (`apply`), with the journal, the lock, the commands, the downloads, the boot-safety gate and
//! CRB each in a room of its own. `pgp` is the trust gate for every repository key.
//!
//! The rules of this room:
//! 1. Facts are read once, by `gather`; the plan decides from them and touches nothing; only
//!    `apply` and the rooms it calls change the machine, and only through a `Runner`: a program
//!    and its arguments, never a shell string.
//! 2. Rooms depend downwards only. At the bottom `pgp`, `sources`, `download` and `own_dir` use
//!    no other room; `plan` uses `pgp` and `sources`; `journal` and `lock` use `own_dir` (and
//!    `plan`'s `StepId`); `runner` runs `plan`'s commands; `deb`, `boot_gate` and `crb` act
//!    through `runner`; `apply` is on top. What siblings share (`Options`, `RebootPolicy`,
//!    `ActionError`) lives here, in the parent, never in one sibling the others import back.
//! 3. Nothing from a repository is trusted before `pgp` verified it against a pinned
//!    fingerprint, and what is installed is what was verified, written by the agent.
//! 4. Root's own files (journal, lock, log, downloads) live where nobody else can write and are
//!    never opened through a link (`own_dir`); the guest's files under `Options::root` are read
//!    through a `Sysroot`.
//! 5. Every step is idempotent and journaled; a failed save of the journal stops the install.

pub mod apply;
pub mod boot_gate;
pub mod crb;
pub mod deb;
pub mod download;
mod gather;
pub mod journal;
pub mod lock;
pub mod own_dir;
pub mod pgp;
pub mod plan;
pub mod runner;
pub mod sources;
#[cfg(test)]
mod test_machine;

pub use gather::gather;

use crate::checks::Finding;
use plan::StepId;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RebootPolicy {
    Auto,
    Never,
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
    pub reboot_now: &'a mut dyn FnMut() -> anyhow::Result<()>,
}

/// Why an action failed: what to say, and the URL when the network was the trouble (its
/// finding is then `install.unreachable`, else `install.step-failed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionError {
    pub message: String,
    pub url: Option<String>,
}

impl ActionError {
    pub fn new(message: impl Into<String>) -> ActionError {
        ActionError { message: message.into(), url: None }
    }

    /// The finding of step `step` failing with this error.
    pub fn finding(&self, step: StepId) -> Finding {
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

impl From<runner::CommandError> for ActionError {
    fn from(e: runner::CommandError) -> ActionError {
        ActionError::new(e.to_string())
    }
}

impl From<own_dir::DirError> for ActionError {
    fn from(e: own_dir::DirError) -> ActionError {
        ActionError::new(e.to_string())
    }
}

impl From<deb::DebError> for ActionError {
    fn from(e: deb::DebError) -> ActionError {
        ActionError::new(e.to_string())
    }
}

/// The install journal (`journal::JOURNAL_DIR`) as the report's `install` member; `None` when
/// no install has run.
pub fn report_value() -> Option<serde_json::Value> {
    match journal::load_state(std::path::Path::new(journal::JOURNAL_DIR)) {
        Ok(Some(st)) => serde_json::to_value(st).ok(),
        Ok(None) => None,
        Err(e) => {
            Some(serde_json::json!({ "schema": journal::STATE_SCHEMA, "status": "unreadable", "error": e.to_string() }))
        }
    }
}
