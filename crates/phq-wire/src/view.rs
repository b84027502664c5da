//! The platform's view of a `phq.status/v1` report: the fields its poller turns into metrics,
//! and nothing else. Fields the view does not name are ignored (the schema grows within v1);
//! the ones it names are typed, so a report whose `action` is not an `Action` or whose `gpus`
//! is not a list does not parse, and the poller says which field.
//!
//! Everything here is the guest's claim: the tenant is root in the VM and can write any of it.
//! Identity (which VM, which node) never comes from here.
//!
//! The strings borrow from the body they were read from (`Cow`: a string with an escape in it is
//! the only one copied). The poller reads a report at every poll, an 8-GPU guest's with a hundred
//! findings, most of them passes it only looks at: allocating and freeing each one's strings was
//! a tenth of its CPU per poll (perf, 2026-12-06).

use crate::{Action, Owner};
use serde::Deserialize;
use std::borrow::Cow;

#[derive(Debug, Clone, Deserialize)]
pub struct Status<'a> {
    #[serde(borrow)]
    pub schema: Cow<'a, str>,
    #[serde(borrow)]
    pub agent: Agent<'a>,
    #[serde(default, borrow)]
    pub gpus: Vec<Gpu<'a>>,
    #[serde(default, borrow)]
    pub findings: Vec<Finding<'a>>,
    /// Absent from agents older than the verdict (schema: "added within v1").
    #[serde(default, borrow)]
    pub verdict: Option<Verdict<'a>>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Agent<'a> {
    #[serde(borrow)]
    pub version: Cow<'a, str>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Gpu<'a> {
    /// The PCI address inside the guest, `0000:0a:00.0`.
    #[serde(borrow)]
    pub pci_address: Cow<'a, str>,
    #[serde(default, borrow)]
    pub uuid: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    pub model: Cow<'a, str>,
    /// NVML's board serial: the physical part, as the guest reads it.
    #[serde(default, borrow)]
    pub serial: Option<Cow<'a, str>>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Finding<'a> {
    #[serde(borrow)]
    pub id: Cow<'a, str>,
    /// `pass`, `warn`, `fail` or `unknown`.
    #[serde(borrow)]
    pub severity: Cow<'a, str>,
    #[serde(default, borrow)]
    pub gpu: Option<Cow<'a, str>>,
    #[serde(default)]
    pub action: Action,
    #[serde(default)]
    pub owner: Owner,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Verdict<'a> {
    pub action: Action,
    pub owner: Owner,
    #[serde(default, borrow)]
    pub findings: Vec<Cow<'a, str>>,
    /// The GPUs (PCI addresses in the guest) the verdict's findings are about.
    #[serde(default, borrow)]
    pub gpus: Vec<Cow<'a, str>>,
    #[serde(default, borrow)]
    pub basis: Vec<Cow<'a, str>>,
}
