//! Each target's state: what the poller saw (its own facts) and what the guest said (claims).

use crate::guest::Said;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Whose VM it is, from the namespace the platform placed it in (never from the guest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The platform's own validation VM (`validation_namespaces`): its report is a fact.
    Validation,
    /// A tenant's VM: its report is a claim.
    Tenant,
}

impl Source {
    pub fn word(self) -> &'static str {
        match self {
            Source::Validation => "validation",
            Source::Tenant => "tenant",
        }
    }

    pub fn of(namespace: &str, validation_namespaces: &[String]) -> Source {
        if validation_namespaces.iter().any(|n| n == namespace) {
            Source::Validation
        } else {
            Source::Tenant
        }
    }
}

#[derive(Debug)]
pub struct TargetState {
    pub source: Source,
    pub first_seen: Instant,
    /// The last poll's outcome: `None` before the first.
    pub last_ok: Option<bool>,
    pub last_success: Option<Instant>,
    pub last_duration: Option<Duration>,
    pub last_error: Option<String>,
    pub failures: BTreeMap<&'static str, u64>,
    /// The last good poll's series.
    pub said: Said,
    /// POST /v1/probes answers by status code.
    pub probe_requests: BTreeMap<u16, u64>,
    pub last_probe_request: Option<Instant>,
}

impl TargetState {
    pub fn new(source: Source, now: Instant) -> TargetState {
        TargetState {
            source,
            first_seen: now,
            last_ok: None,
            last_success: None,
            last_duration: None,
            last_error: None,
            failures: BTreeMap::new(),
            said: Said::default(),
            probe_requests: BTreeMap::new(),
            last_probe_request: None,
        }
    }
}
