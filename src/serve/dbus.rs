//! `ch.phoeniqs.Agent1` on the system bus: `GetReport`, `RunProbes(level)`, and the
//! `HealthChanged(old, new)` signal. Who may call what is the bus policy's business
//! (packaging/dbus/ch.phoeniqs.Agent1.conf): the report for members of `phq-agent`, probes for
//! root only.
//!
//! Methods answer from the last published snapshot, like the HTTP endpoint. `RunProbes` runs the
//! probes on zbus's executor thread, so the interface answers nothing else while they run; the
//! probes themselves refuse GPUs with compute processes.

use super::Shared;
use crate::config::ProbeLevel;
use zbus::blocking::Connection;

pub const NAME: &str = "ch.phoeniqs.Agent1";
pub const PATH: &str = "/ch/phoeniqs/Agent1";
pub const INTERFACE: &str = "ch.phoeniqs.Agent1";

struct Agent {
    shared: Shared,
    /// Where the probe run lock lives.
    state_dir: std::path::PathBuf,
    /// `[probes]` deadline_margin and nccl_allowance.
    limits: crate::probe::child::Limits,
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

    /// Runs the probes at `level` (quick, standard, full) and returns their findings and results
    /// as JSON: `{"findings": [...], "probes": {...}}`.
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
        // In a child process under a deadline (probe::child): a kernel that never ends costs
        // this call its deadline, not the service.
        let answer = match crate::probe::child::run(
            &p.snapshot,
            level,
            &self.state_dir,
            "D-Bus RunProbes",
            self.limits,
            &mut |step| tracing::info!("probe: {step}"),
        ) {
            Ok(a) => serde_json::json!({ "findings": a.findings, "probes": a.probes }),
            Err(e) => serde_json::json!({ "findings": crate::probe::unavailable(&e), "probes": null, "error": e }),
        };
        Ok(answer.to_string())
    }
}

/// Owns the name and serves the interface until the returned connection is dropped.
pub fn serve(
    shared: Shared,
    state_dir: std::path::PathBuf,
    limits: crate::probe::child::Limits,
) -> zbus::Result<Connection> {
    zbus::blocking::connection::Builder::system()?
        .name(NAME)?
        .serve_at(PATH, Agent { shared, state_dir, limits })?
        .build()
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
