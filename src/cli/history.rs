//! `phq-agent history`: the fault history the service keeps across reboots (`crate::history`):
//! each physical GPU (by board serial), what it showed, in which boots, and which probe run
//! cleared it. Read-only; the service alone writes it.

use anyhow::Context;
use clap::Args;

#[derive(Debug, Args)]
pub struct History {
    /// Print the history as JSON (`phq.history/v1`).
    #[arg(long)]
    pub json: bool,
}

impl History {
    pub fn run(self, g: &super::Global) -> anyhow::Result<i32> {
        let config = g.load_config()?;
        let h = crate::history::History::load(&config.agent.state_dir)?;
        if self.json {
            // The file is the service's, but the guest's root can write it: every control
            // character in a string leaves as a JSON escape, as the table mode replaces it.
            let text = crate::text::json_pretty(&h).context("cannot encode the history")?;
            super::print_out(&format!("{text}\n"), false)?;
        } else {
            super::print_out(&render(&h), false)?;
        }
        Ok(0)
    }
}

/// One line a fault: the part, what it showed, the boots, and whether it stands.
pub fn render(h: &crate::history::History) -> String {
    use std::fmt::Write;
    if h.faults.is_empty() {
        return "No fault recorded: no GPU has shown a warning or a failure since the history began.\n".into();
    }
    let mut o = String::new();
    let _ = writeln!(o, "{:<16}  {:<13}  {:<24}  {:>5}  {:<20}  state", "serial", "gpu", "fault", "boots", "last seen");
    for f in &h.faults {
        let fault = match &f.code {
            Some(c) => format!("{} {c}", f.check),
            None => f.check.clone(),
        };
        let state = match &f.cleared {
            Some(c) => format!("cleared by probe run {} at {}", c.by_probe_run, c.at),
            None if f.boots.len() >= 2 => "open, came back after a reboot: inspect_hardware".into(),
            None => "open".into(),
        };
        let line = format!(
            "{:<16}  {:<13}  {fault:<24}  {:>5}  {:<20}  {state}",
            f.serial,
            f.gpu,
            f.boots.len(),
            f.last_seen.to_string()
        );
        // The file is the service's, but the guest's root can write it: printable, as a bundle.
        let _ = writeln!(o, "{}", crate::report::untrusted::printable(&line));
    }
    o
}
