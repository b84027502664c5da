//! One probe run's record, as the service's desk (`serve::recheck`) keeps it and a report names
//! it (`probe_run`): which run's results the report carries, who asked, and how it ended.

use crate::config::ProbeLevel;
use crate::snapshot::Timestamp;
use serde::{Deserialize, Serialize};

/// Who asked for a run: kept with the fault history, which names it when a run clears a fault.
pub use crate::history::{AskedBy, Channel};

/// Who asked for a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Boot,
    Idle,
    Request,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Queued,
    Running,
    Done,
    /// The probes could not run at all (no CUDA, the lock held elsewhere): `error` says why.
    Failed,
}

/// One probe run, as the desk and the report tell it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeRun {
    pub id: String,
    pub level: ProbeLevel,
    pub source: Source,
    /// Who asked (the service for boot and idle runs).
    #[serde(default)]
    pub asked_by: AskedBy,
    pub state: State,
    pub requested_at: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Timestamp>,
    /// Findings the run gave, and how many of them fail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub findings: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}
