//! The command line (DESIGN.md "Command line"): one file per subcommand, each a struct with
//! `run`. Exit codes: doctor's follow the monitoring-plugin convention (0 ok, 1 warn, 2 fail,
//! 3 unknown or could not run); usage errors exit 64.

pub mod doctor;
pub mod install;
pub mod probe;
pub mod serve;
pub mod status;
pub mod token;

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// Exit code for usage errors (sysexits.h EX_USAGE).
pub const EXIT_USAGE: i32 = 64;
/// Exit code when the command could not do its job at all (monitoring "UNKNOWN").
pub const EXIT_UNKNOWN: i32 = 3;

#[derive(Debug, Parser)]
#[command(
    name = "phq-agent",
    version,
    about = "GPU health agent for NVIDIA Hopper GPUs passed through to KubeVirt VMs"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct Global {
    /// Configuration file; drop-ins are read from config.d/ beside it.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Read /sys, /proc, /etc and /dev under this directory instead of / (fixtures, bundles).
    #[arg(long, global = true, value_name = "DIR", default_value = "/")]
    pub sysroot: PathBuf,
    /// NVML library to load instead of libnvidia-ml.so.1.
    #[arg(long, global = true, value_name = "PATH", env = "PHQ_NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
    /// More log output on stderr (-v info, -vv debug).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Only errors on stderr.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
}

impl Global {
    /// The configuration: the named file must exist; the default may be absent.
    pub fn load_config(&self) -> anyhow::Result<crate::config::Config> {
        let (path, must_exist) = match &self.config {
            Some(p) => (p.clone(), true),
            None => (PathBuf::from(crate::config::DEFAULT_PATH), false),
        };
        Ok(crate::config::load(&path, must_exist)?)
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Tell what is wrong with this VM's GPUs, driver and CUDA, and what to do about it.
    Doctor(doctor::Doctor),
    /// Install the NVIDIA driver (open kernel modules) and CUDA 12; resumable, idempotent.
    Install(install::Install),
    /// Measure the GPUs through CUDA: bandwidths, memory integrity, a checked GEMM.
    Probe(probe::Probe),
    /// Run as the systemd service: snapshots, HTTP, metrics, D-Bus, pushes.
    Serve(serve::Serve),
    /// Ask the running service for its report.
    Status(status::Status),
    /// Create the HTTP bearer token if there is none (0600, owned by the service's user).
    Token(token::Token),
}

impl Cli {
    pub fn run(self) -> i32 {
        init_logging(&self.global);
        let result = match self.command {
            Command::Doctor(c) => c.run(&self.global),
            Command::Install(c) => c.run(&self.global),
            Command::Probe(c) => c.run(&self.global),
            Command::Serve(c) => c.run(&self.global),
            Command::Status(c) => c.run(&self.global),
            Command::Token(c) => c.run(&self.global),
        };
        match result {
            Ok(code) => code,
            Err(e) => {
                // The whole chain: "what" first, then each "because".
                eprintln!("phq-agent: error: {e}");
                for cause in e.chain().skip(1) {
                    eprintln!("  caused by: {cause}");
                }
                EXIT_UNKNOWN
            }
        }
    }
}

/// Prints a report: pretty JSON, or the table for people (coloured where the terminal wants it).
pub fn print_report(r: &crate::report::Report, title: &str, json: bool) -> anyhow::Result<()> {
    if json {
        let text = serde_json::to_string_pretty(r).map_err(|e| anyhow::anyhow!("cannot encode the report: {e}"))?;
        print_out(&format!("{text}\n"), false)
    } else {
        print_out(&crate::report::table::render(r, title, crate::report::table::terminal_width()), true)
    }
}

/// Writes the command's output to stdout (through anstream when `styled`, which strips colour
/// for NO_COLOR and non-terminals). A reader that went away (`phq-agent doctor | head`) is not
/// an error of ours.
pub fn print_out(text: &str, styled: bool) -> anyhow::Result<()> {
    use std::io::Write;
    let written = if styled {
        anstream::stdout().lock().write_all(text.as_bytes())
    } else {
        std::io::stdout().lock().write_all(text.as_bytes())
    };
    match written {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.map_err(|e| anyhow::anyhow!("cannot write the report to stdout: {e}")),
    }
}

fn init_logging(g: &Global) {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let level = if g.quiet {
        tracing::Level::ERROR
    } else {
        match g.verbose {
            0 => tracing::Level::WARN,
            1 => tracing::Level::INFO,
            _ => tracing::Level::DEBUG,
        }
    };
    // Under systemd, stderr is the journal: log there natively, so the fields (gpu, xid, check)
    // become journal fields a person can filter on (`journalctl -u phq-agent GPU=0000:0c:00.0`).
    let filter = tracing_subscriber::filter::LevelFilter::from_level(level);
    if stderr_is_journal() {
        if let Ok(journald) = tracing_journald::layer() {
            let _ = tracing_subscriber::registry()
                .with(journald.with_syslog_identifier("phq-agent".into()))
                .with(filter)
                .try_init();
            return;
        }
    }
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .with_max_level(level)
        .with_target(false)
        .try_init();
}

/// systemd sets `JOURNAL_STREAM=<dev>:<inode>` for a service whose stderr is the journal; it
/// is only true if stderr is still that very stream (sd_journal_stream_fd(3)).
fn stderr_is_journal() -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some(v) = std::env::var_os("JOURNAL_STREAM") else { return false };
    let Some((dev, ino)) = v.to_str().and_then(|s| s.split_once(':')) else { return false };
    let Ok(meta) = std::fs::metadata("/proc/self/fd/2") else { return false };
    dev.parse::<u64>().ok() == Some(meta.dev()) && ino.parse::<u64>().ok() == Some(meta.ino())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }
}
