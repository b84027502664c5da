//! `phq-agent install`: plan from this guest and the config, then apply — or print the plan.
//!
//! Exit codes: 0 installed and verified; 1 installed with warnings, or a reboot is required
//! (`--reboot never`); 2 a step or the verification failed; 3 could not start (unsupported
//! guest, another install running, not root); 64 usage.

use crate::install::journal::{self, Status};
use crate::install::runner::SystemRunner;
use crate::install::{self, apply, lock, plan, Options, RebootPolicy};
use crate::sysroot::Sysroot;
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct Install {
    #[command(flatten)]
    pub machine: super::Machine,
    /// CUDA 12 toolkit to install (default: install.cuda from the config).
    #[arg(long, value_name = "12.x")]
    pub cuda: Option<String>,
    /// Driver branch (default: install.driver_branch from the config).
    #[arg(long, value_name = "N")]
    pub driver_branch: Option<String>,
    /// Replace an installed driver of another branch or the proprietary flavour.
    #[arg(long)]
    pub replace_driver: bool,
    /// Print the plan, change nothing.
    #[arg(long, conflicts_with = "resume")]
    pub dry_run: bool,
    /// Continue an unfinished install (phq-agent-install.service at boot); exit 0 at once when
    /// none is pending.
    #[arg(long)]
    pub resume: bool,
    /// Reboot when a step needs it (auto) or report that one is needed (never).
    #[arg(long, value_parser = ["auto", "never"], default_value = "auto")]
    pub reboot: String,
    /// A mirror of NVIDIA's repository root (…/compute/cuda/repos).
    #[arg(long, value_name = "URL")]
    pub repo_url: Option<String>,
}

/// Checks whose trouble the verification reports: what the install itself is about.
const VERIFIED: &[&str] = &["driver.", "pci.", "gpu.", "nvml.", "fabric.", "cuda."];

impl Install {
    pub fn run(self, g: &super::Global) -> anyhow::Result<i32> {
        let config = g.load_config()?;
        let c = &config.install;
        let branch_text = self.driver_branch.clone().unwrap_or_else(|| c.driver_branch.clone());
        let Ok(driver_branch) = branch_text.trim().parse::<u32>() else {
            eprintln!("phq-agent install: driver branch {branch_text:?} is not a number such as 550");
            return Ok(super::EXIT_USAGE);
        };
        let settings = plan::Settings {
            cuda: self.cuda.clone().unwrap_or_else(|| c.cuda.clone()),
            driver_branch,
            repo_url: self.repo_url.clone().unwrap_or_else(|| c.repo_url.clone()),
            key_fingerprint: c.repo_key_fingerprint.clone(),
            epel_url: c.epel_url.clone(),
            epel_key_fingerprint: c.epel_key_fingerprint.clone(),
            replace_driver: self.replace_driver || c.replace_driver,
            allow_plain_http: c.allow_plain_http,
        };
        if let Some(url) = &self.repo_url {
            if let Err(e) = crate::config::check_mirror_url("--repo-url", url, c.allow_plain_http) {
                eprintln!("phq-agent install: {e}");
                return Ok(super::EXIT_USAGE);
            }
        }
        let root = Sysroot::new(&self.machine.sysroot);
        if !self.dry_run {
            if !root.is_live() {
                eprintln!("phq-agent install: --sysroot stands for another machine; only --dry-run can plan for it");
                return Ok(super::EXIT_USAGE);
            }
            // SAFETY: geteuid has no preconditions and cannot fail.
            if unsafe { libc::geteuid() } != 0 {
                eprintln!("phq-agent install: installing needs root (try sudo, or --dry-run to see the plan)");
                return Ok(super::EXIT_UNKNOWN);
            }
        }
        // Root's own directory, never the service's state directory (install/own_dir.rs says why).
        let journal_dir = PathBuf::from(journal::JOURNAL_DIR);
        // Hold the lock from the first look at the machine to the last step: what is planned
        // must be what is applied.
        let _lock = if self.dry_run {
            None
        } else {
            let locked = if self.resume { lock::lock_wait(&journal_dir) } else { lock::lock(&journal_dir) };
            match locked {
                Ok(l) => Some(l),
                Err(e) => {
                    eprintln!("phq-agent install: {e}");
                    return Ok(super::EXIT_UNKNOWN);
                }
            }
        };
        // Decided under the lock: an install that was running when we asked has finished by now.
        if self.resume {
            match journal::load_state(&journal_dir) {
                Ok(None) => {
                    eprintln!("phq-agent install --resume: no install has run here; nothing to resume");
                    return Ok(0);
                }
                Ok(Some(st)) if st.status == Status::Done => {
                    eprintln!(
                        "phq-agent install --resume: the install finished at {}; nothing to resume",
                        st.updated_at
                    );
                    return Ok(0);
                }
                Ok(Some(st)) => {
                    eprintln!("phq-agent install --resume: resuming ({:?} at {})", st.status, st.updated_at)
                }
                Err(e) => eprintln!("phq-agent install --resume: {e}; resuming from a fresh plan"),
            }
        }
        let (the_plan, boot_id) = match make_plan(&root, &settings) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("phq-agent install: {e}");
                return Ok(super::EXIT_UNKNOWN);
            }
        };
        if self.dry_run {
            super::print_out(&plan::render(&the_plan), false)?;
            return Ok(0);
        }
        let mut runner = SystemRunner::new(&journal_dir);
        eprintln!("phq-agent install: {}", the_plan.summary);
        for f in &the_plan.findings {
            eprintln!("  {} {}: {}", f.severity.label(), f.id, f.summary);
        }
        let mut progress = |line: &str| eprintln!("{line}");
        let nvml_lib = self.machine.nvml_lib.clone();
        let sysroot = self.machine.sysroot.clone();
        let checks_settings = crate::checks::Settings::from(&config);
        let mut verify = move || verify_now(&sysroot, nvml_lib.clone(), &checks_settings);
        let mut reboot_now = reboot_through_logind;
        let mut opts = Options {
            journal_dir: journal_dir.clone(),
            root: PathBuf::from("/"),
            reboot: if self.reboot == "never" { RebootPolicy::Never } else { RebootPolicy::Auto },
            boot_id,
            network_tries: 4,
            lock_wait: std::time::Duration::from_secs(600),
            progress: &mut progress,
            verify: &mut verify,
            reboot_now: &mut reboot_now,
        };
        let st = match apply::apply(&the_plan, &mut runner, &mut opts) {
            Ok(st) => st,
            Err(e) => {
                eprintln!("phq-agent install: {e}");
                return Ok(2);
            }
        };
        Ok(finish(&st))
    }
}

fn make_plan(root: &Sysroot, settings: &plan::Settings) -> Result<(plan::Plan, Option<String>), plan::PlanError> {
    let nvml = crate::collect::NvmlSource::Skip("not needed to plan".into());
    let snapshot = crate::collect::snapshot(root, &nvml);
    let facts = install::gather(root, &snapshot);
    Ok((plan::plan(&facts, settings)?, snapshot.host.boot_id.clone()))
}

fn verify_now(
    sysroot: &std::path::Path,
    nvml_lib: Option<PathBuf>,
    settings: &crate::checks::Settings,
) -> Vec<crate::checks::Finding> {
    let root = Sysroot::new(sysroot);
    let source = crate::collect::NvmlSource::choose(nvml_lib.as_deref(), &root);
    let snapshot = crate::collect::snapshot(&root, &source);
    crate::checks::run(&snapshot, settings)
        .into_iter()
        .filter(|f| VERIFIED.iter().any(|p| f.id.starts_with(p)))
        .collect()
}

/// logind's `Reboot(false)` (no interactive authorization: we are root), else `systemctl reboot`.
fn reboot_through_logind() -> anyhow::Result<()> {
    let logind = crate::collect::units::within(std::time::Duration::from_secs(10), || -> zbus::Result<()> {
        let conn = zbus::blocking::Connection::system()?;
        conn.call_method(
            Some("org.freedesktop.login1"),
            "/org/freedesktop/login1",
            Some("org.freedesktop.login1.Manager"),
            "Reboot",
            &(false,),
        )?;
        Ok(())
    });
    let why = match logind {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(e)) => e.to_string(),
        Err(e) => e,
    };
    tracing::warn!("logind reboot failed ({why}); trying systemctl reboot");
    let status = std::process::Command::new("systemctl")
        .arg("reboot")
        .status()
        .map_err(|e| anyhow::anyhow!("logind: {why}; systemctl: {e}"))?;
    anyhow::ensure!(status.success(), "logind: {why}; systemctl reboot exited {status}");
    Ok(())
}

fn finish(st: &journal::State) -> i32 {
    let worst = st.findings.iter().map(|f| f.severity).max();
    let (line, code) = match st.status {
        Status::Failed => (format!("failed: {}", st.error.clone().unwrap_or_default()), 2),
        Status::RebootRequired => ("stopped: a reboot is required".to_string(), 1),
        Status::Rebooting => ("rebooting; the install resumes after it".to_string(), 0),
        Status::Running => ("stopped".to_string(), 2),
        Status::Done => match worst {
            Some(crate::checks::Severity::Fail) => {
                ("installed, but verification found problems (phq-agent doctor)".into(), 2)
            }
            Some(crate::checks::Severity::Warn) => ("installed, with warnings".into(), 1),
            _ => ("installed and verified".into(), 0),
        },
    };
    eprintln!("phq-agent install: {line}");
    for f in st.findings.iter().filter(|f| f.severity >= crate::checks::Severity::Warn) {
        if let Some(r) = &f.remedy {
            eprintln!("  {} {}: {}\n      → {r}", f.severity.label(), f.id, f.summary);
        }
    }
    code
}
