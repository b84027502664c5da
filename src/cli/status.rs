//! `phq-agent status`: the running service's report, asked over D-Bus (`ch.phoeniqs.Agent1`).
//!
//! D-Bus alone: the bus policy lets only the service's user own that name, so the answer comes
//! from the service and from nothing else. There is no fallback to the HTTP port with the token:
//! port 9440 is unprivileged, and whoever listens there while the service is down would be handed
//! root's token and could answer for the service (issue 37).

use crate::report::{self, Report};
use anyhow::{bail, Context};
use clap::Args;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct Status {
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

impl Status {
    pub fn run(self, _g: &super::Global) -> anyhow::Result<i32> {
        let json = over_dbus().context(
            "the service did not answer on D-Bus (ch.phoeniqs.Agent1): is it running (systemctl status phq-agent)? \
             `status` asks the service only through the system bus, whose policy lets no other program own its name; \
             it never sends the token to whatever listens on the HTTP port",
        )?;
        // The service's report carries what the guest said of itself (a hostname, a process's
        // name): bounded and printable before a terminal sees it, as a bundle's is.
        let what = "the service's report";
        let r: Report = report::untrusted::parse(json.as_bytes(), what)?;
        report::untrusted::check_report(&r, what)?;
        if self.json {
            let text = crate::text::json_pretty(&r).context("cannot encode the report")?;
            super::print_out(&format!("{text}\n"), false)?;
        } else {
            super::print_report(&r, "phq-agent status", false)?;
        }
        Ok(report::exit_code(&r.findings))
    }
}

/// The D-Bus call, given 5 s (a wedged bus must not hang `status`).
fn over_dbus() -> anyhow::Result<String> {
    match crate::collect::units::within(Duration::from_secs(5), crate::serve::dbus::get_report) {
        Ok(r) => Ok(r?),
        Err(why) => bail!("{why}"),
    }
}
