//! The platform's view of a `phq.status/v1` report: the fields its poller turns into metrics,
//! and nothing else. Fields the view does not name are ignored (the schema grows within v1);
//! the ones it names are typed, so a report whose `action` is not an `Action` or whose `gpus`
//! is not a list does not parse, and the poller says which field.
//!
//! Everything here is the guest's claim: the tenant is root in the VM and can write any of it.
//! Identity (which VM, which node) never comes from here.

use crate::{Action, Owner};
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct Status {
    pub schema: String,
    pub agent: Agent,
    #[serde(default)]
    pub gpus: Vec<Gpu>,
    #[serde(default)]
    pub findings: Vec<Finding>,
    /// Absent from agents older than the verdict (schema: "added within v1").
    #[serde(default)]
    pub verdict: Option<Verdict>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Agent {
    pub version: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Gpu {
    /// The PCI address inside the guest, `0000:0a:00.0`.
    pub pci_address: String,
    #[serde(default)]
    pub uuid: Option<String>,
    #[serde(default)]
    pub model: String,
    /// NVML's board serial: the physical part, as the guest reads it.
    #[serde(default)]
    pub serial: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Finding {
    pub id: String,
    /// `pass`, `warn`, `fail` or `unknown`.
    pub severity: String,
    #[serde(default)]
    pub gpu: Option<String>,
    #[serde(default)]
    pub action: Action,
    #[serde(default)]
    pub owner: Owner,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Verdict {
    pub action: Action,
    pub owner: Owner,
    #[serde(default)]
    pub findings: Vec<String>,
    /// The GPUs (PCI addresses in the guest) the verdict's findings are about.
    #[serde(default)]
    pub gpus: Vec<String>,
    #[serde(default)]
    pub basis: Vec<String>,
}
