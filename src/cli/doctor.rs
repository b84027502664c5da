//! `phq-agent doctor`: collect (or load a bundle), check, print; optionally save a bundle.

use crate::checks::{self, Settings};
use crate::config::ProbeLevel;
use crate::report::{self, bundle};
use crate::snapshot::Timestamp;
use crate::sysroot::Sysroot;
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct Doctor {
    #[command(flatten)]
    pub machine: super::Machine,
    /// Print the phq.status/v1 report as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also run the CUDA probes at this level.
    #[arg(long, value_enum, value_name = "LEVEL")]
    pub probe: Option<ProbeLevel>,
    /// Judge a saved bundle instead of this machine.
    #[arg(long, value_name = "BUNDLE", conflicts_with = "bundle")]
    pub from: Option<PathBuf>,
    /// Save what was read (snapshot, raw files, NVIDIA kernel log lines) to this .tar.gz.
    #[arg(long, value_name = "OUT.tar.gz")]
    pub bundle: Option<PathBuf>,
}

impl Doctor {
    pub fn run(self, g: &super::Global) -> anyhow::Result<i32> {
        let started_at = Timestamp::now();
        let config = g.load_config()?;
        let root = if self.bundle.is_some() {
            Sysroot::recording(&self.machine.sysroot)
        } else {
            Sysroot::new(&self.machine.sysroot)
        };
        let nvml =
            crate::collect::NvmlSource::choose(self.machine.nvml_lib.as_deref(), &root).under(config.nvml.deadlines());
        let snapshot = match &self.from {
            Some(path) => bundle::read_snapshot(path)?,
            None => crate::collect::snapshot(&root, &nvml),
        };
        let mut findings = checks::run(&snapshot, &Settings::from(&config));
        let mut probes = None;
        if let Some(level) = self.probe.filter(|l| *l != ProbeLevel::None) {
            // A named CUDA library (--cuda-lib) stands for the --sysroot machine's GPUs.
            let here = root.is_live() || self.machine.cuda_lib.is_some();
            match (&self.from, here) {
                (Some(_), _) | (None, false) => findings.extend(crate::probe::unavailable(
                    "probes measure this machine's GPUs, not a bundle or another --sysroot (name its CUDA library with --cuda-lib)",
                )),
                (None, true) => match super::probe::probe_with_progress(
                    &snapshot,
                    nvml.session(),
                    &crate::probe::Options { nccl_allowance: config.probes.nccl_allowance, ..crate::probe::Options::at(level) },
                    &config.agent.state_dir,
                    "phq-agent doctor --probe",
                ) {
                    Ok((report, targets)) => {
                        findings.extend(crate::probe::judge_here(&report, &targets, &config.agent.state_dir));
                        probes = Some(report);
                    }
                    Err(e) => findings.extend(crate::probe::unavailable(&e.to_string())),
                },
            }
        }
        let agent_id = report::agent_id(&config.agent.id, &snapshot);
        let mut report = report::build(&snapshot, findings, agent_id, started_at, 0);
        report.probes = probes.map(|p| serde_json::to_value(p).unwrap_or_default());
        if root.is_live() && self.from.is_none() {
            report.install = crate::install::report_value();
        }
        let code = report::exit_code(&report.findings);

        if let Some(out) = &self.bundle {
            // The fault history across boots, when this machine's service keeps one.
            let history = if root.is_live() && self.from.is_none() {
                match crate::history::History::load(&config.agent.state_dir) {
                    Ok(h) if !h.faults.is_empty() => Some(h),
                    Ok(_) => None,
                    Err(e) => {
                        eprintln!("phq-agent: the bundle goes without the fault history: {e}");
                        None
                    }
                }
            } else {
                None
            };
            // NVIDIA's own log, from this machine's driver (or the script the environment names).
            let bug_report = match crate::collect::bug_report::Options::from_env() {
                Ok(o) => crate::collect::bug_report::collect(&o, root.is_live(), &std::env::temp_dir()),
                Err(e) => crate::collect::bug_report::BugReport { log: None, note: e },
            };
            if bug_report.log.is_none() {
                eprintln!("phq-agent: {}", bug_report.note);
            }
            bundle::write(out, &snapshot, &report, &root.recorded(), history.as_ref(), &bug_report)?;
            eprintln!("phq-agent: bundle written to {}", out.display());
        }
        super::print_report(&report, "phq-agent doctor", self.json)?;
        Ok(code)
    }
}
