//! `ch.phoeniqs.Agent1` on the system bus: `GetReport`, `RunProbes(level)`, `GetProbeRun(id)`, and the
//! `HealthChanged(old, new)` signal. Who may call what is the bus policy's business
//! (packaging/dbus/ch.phoeniqs.Agent1.conf): the report for members of `phq-agent`, probes for
//! root only.
//!
//! Methods answer from the last published snapshot, like the HTTP endpoint. `RunProbes` asks
//! the probe desk, as `POST /v1/probes` does, as root on the guest (`AskedBy::LocalRoot`, the
//! bus policy's only caller), and answers at once with the run's record: the run goes in the
//! service's probe task, so `GetReport` (and `phq-agent status`) answer while it runs (issue 51:
//! a run on zbus's executor thread once held them for its whole length). The run's results come
//! in the next report (`probe_run` names it); the desk keeps one run at a time and refuses a
//! GPU that is not idle.

use super::recheck::{AskedBy, Desk, Refused};
use super::Shared;
use crate::config::ProbeLevel;
use std::sync::Arc;
use zbus::blocking::Connection;

pub const NAME: &str = "ch.phoeniqs.Agent1";
pub const PATH: &str = "/ch/phoeniqs/Agent1";
pub const INTERFACE: &str = "ch.phoeniqs.Agent1";

struct Agent {
    shared: Shared,
    /// Where every run the service starts is asked for.
    desk: Arc<Desk>,
}

fn fdo(msg: impl Into<String>) -> zbus::fdo::Error {
    zbus::fdo::Error::Failed(msg.into())
}

#[zbus::interface(name = "ch.phoeniqs.Agent1")]
impl Agent {
    /// The phq.status/v1 report of the last snapshot, as JSON.
    fn get_report(&self) -> zbus::fdo::Result<String> {
        let p = super::current(&self.shared).ok_or_else(|| fdo("no snapshot yet: the agent is starting"))?;
        String::from_utf8(p.report_json.to_vec()).map_err(|e| fdo(e.to_string()))
    }

    /// Queues a probe run at `level` (quick, standard, full) as root's request and returns its
    /// record as JSON (`GET /v1/probes/{id}`'s shape): its id, `asked_by: local_root`, state
    /// `queued`. Its results come in the next report after it ends (`probe_run` names it).
    fn run_probes(&self, level: &str) -> zbus::fdo::Result<String> {
        let level = match level {
            "quick" => ProbeLevel::Quick,
            "standard" => ProbeLevel::Standard,
            "full" => ProbeLevel::Full,
            other => {
                return Err(zbus::fdo::Error::InvalidArgs(format!("level {other:?}: expected quick, standard or full")))
            }
        };
        let p = super::current(&self.shared).ok_or_else(|| fdo("no snapshot yet: the agent is starting"))?;
        match self.desk.request(level, p.snapshot.clone(), AskedBy::LocalRoot) {
            Ok(run) => serde_json::to_string(&run).map_err(|e| fdo(e.to_string())),
            Err(Refused::Running(run)) => Err(fdo(format!("a probe run is already queued or running: {}", run.id))),
            Err(Refused::Busy(gpus)) => Err(fdo(format!(
                "not every GPU is idle, and the probes never take GPU time from a job: {}",
                gpus.join("; ")
            ))),
            Err(Refused::Stopping) => Err(fdo("the service is stopping")),
            // Root is not held to the platform's limit (`Desk::request`).
            Err(Refused::Limited(_) | Refused::Off) => Err(fdo("refused by probes.max_requests")),
        }
    }

    /// A probe run's record as JSON while it is current or among the last kept
    /// (`GET /v1/probes/{id}`'s answer): its state, times, counts, who asked and any error.
    fn get_probe_run(&self, id: &str) -> zbus::fdo::Result<String> {
        let run = self
            .desk
            .run(id)
            .ok_or_else(|| fdo(format!("no such probe run (the last {} are kept)", super::recheck::KEPT_RUNS)))?;
        serde_json::to_string(&run).map_err(|e| fdo(e.to_string()))
    }
}

/// Owns the name and serves the interface until the returned connection is dropped.
pub fn serve(shared: Shared, desk: Arc<Desk>) -> zbus::Result<Connection> {
    zbus::blocking::connection::Builder::system()?.name(NAME)?.serve_at(PATH, Agent { shared, desk })?.build()
}

/// Tells listeners the health changed.
pub fn health_changed(conn: &Connection, old: &str, new: &str) {
    if let Err(e) = conn.emit_signal(None::<()>, PATH, INTERFACE, "HealthChanged", &(old, new)) {
        tracing::warn!(error = %e, "cannot emit HealthChanged");
    }
}

/// The client side for `phq-agent status`: the report JSON from the running service.
pub fn get_report() -> zbus::Result<String> {
    let conn =
        zbus::blocking::connection::Builder::system()?.method_timeout(std::time::Duration::from_secs(5)).build()?;
    let proxy = zbus::blocking::Proxy::new(&conn, NAME, PATH, INTERFACE)?;
    proxy.call("GetReport", &())
}
