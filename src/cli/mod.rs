//! The command line (docs/reference.md, "Commands, flags and exit codes"): one file per subcommand, each a struct with
//! `run`. Exit codes: doctor's follow the monitoring-plugin convention (0 ok, 1 warn, 2 fail,
//! 3 unknown or could not run); usage errors exit 64.

pub mod bug_report;
pub mod doctor;
pub mod history;
pub mod install;
pub mod probe;
pub mod report;
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

/// Flags every subcommand takes.
#[derive(Debug, Args)]
pub struct Global {
    /// Configuration file [default: /etc/phq-agent/config.toml]; drop-ins are read from
    /// config.d/*.toml beside it.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// More log output on stderr (-v info, -vv debug).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Only errors on stderr.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
}

/// Which machine to look at: the subcommands that read one (doctor, install, probe, serve).
#[derive(Debug, Args)]
pub struct Machine {
    /// Read /sys, /proc, /etc and /dev under this directory instead of / (fixtures, bundles).
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub sysroot: PathBuf,
    /// NVML library to load instead of libnvidia-ml.so.1 (a fake one in tests).
    #[arg(long, value_name = "PATH", env = "PHQ_NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
    /// CUDA driver library to load instead of libcuda.so.1 (a fake one in tests). A named
    /// library is asked even with --sysroot: it stands for that machine's GPUs.
    #[arg(long, value_name = "PATH", env = "PHQ_CUDA_LIB")]
    pub cuda_lib: Option<PathBuf>,
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
    #[command(after_help = EXIT_CODES_FINDINGS)]
    Doctor(doctor::Doctor),
    /// Install the NVIDIA driver (open kernel modules) and CUDA 12; resumable, idempotent.
    #[command(after_help = "Exit codes: 0 installed and verified; 1 installed with warnings, or a reboot is \
                            required; 2 a step or the verification failed; 3 could not start (unsupported \
                            guest, another install running, not root); 64 usage.")]
    Install(install::Install),
    /// Measure the GPUs through CUDA: bandwidths, memory integrity, a checked GEMM.
    #[command(after_help = EXIT_CODES_FINDINGS)]
    Probe(probe::Probe),
    /// Render a support bundle's report as one HTML page (what `doctor --bundle` puts in it).
    #[command(after_help = "Exit codes: 0 written; 3 the bundle could not be read or the page not written; 64 \
                            usage.")]
    Report(report::Report),
    /// Run as the systemd service: snapshots, HTTP, metrics, D-Bus, pushes.
    #[command(after_help = "Exit codes: 0 stopped by SIGTERM or SIGINT; 3 could not start (configuration, \
                            token, listen address); 64 usage.")]
    Serve(serve::Serve),
    /// Ask the running service for its report (over D-Bus only).
    #[command(after_help = "Exit codes: those of the service's report, as doctor's (0 passed, 1 a warning, \
                            2 a failure, 3 unknown); 3 when the service does not answer on D-Bus; 64 usage.")]
    Status(status::Status),
    /// Show the fault history the service keeps across reboots: each GPU by serial, its faults,
    /// the boots that saw them, and the probe run that cleared them.
    #[command(after_help = "Exit codes: 0 shown; 3 the history could not be read; 64 usage.")]
    History(history::History),
    /// Create the HTTP bearer token if there is none (0600, owned by the service's user).
    #[command(after_help = "Exit codes: 0 the token files exist and belong to the service's user; 3 they \
                            could not be made so (the error says which and why); 64 usage.")]
    Token(token::Token),
    /// Print shell completions (bash, zsh, fish) to stdout; the packages install them.
    #[command(after_help = "Exit codes: 0 printed; 64 usage.")]
    Completions(Completions),
    /// The service's probe process (probe::child): reads its request on stdin, answers on stdout.
    #[command(hide = true)]
    ProbeChild {
        /// The CUDA library the service was given.
        #[arg(long, value_name = "PATH")]
        cuda_lib: Option<PathBuf>,
    },
    /// An all-reduce's process (probe::allreduce): reads its request on stdin, answers on stdout.
    #[command(hide = true)]
    AllreduceChild {
        /// The CUDA library the parent was given.
        #[arg(long, value_name = "PATH")]
        cuda_lib: Option<PathBuf>,
    },
    /// The root helper's run of NVIDIA's bug report, for a service that is not root
    /// (collect::bug_report_helper; phq-agent-bug-report.service runs it).
    #[command(
        hide = true,
        after_help = "Exit codes: 0 the log is written; 1 the script left none (the status \
                                         file says why); 2 refused by the rate limit; 3 could not start; 64 usage."
    )]
    BugReport(bug_report::BugReport),
    /// Write the manual pages (phq-agent.1 and one per subcommand) into a directory; the
    /// packages install them.
    #[command(hide = true)]
    Manpages {
        /// The directory (it must exist).
        dir: PathBuf,
    },
}

/// Exit codes of the commands that judge findings: the monitoring-plugin convention.
const EXIT_CODES_FINDINGS: &str = "Exit codes (monitoring-plugin convention): 0 every check passed; 1 a warning; \
                                   2 a failure; 3 something could not be checked, or the command could not \
                                   run (bad configuration, unreadable bundle); 64 usage.";

#[derive(Debug, Args)]
pub struct Completions {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

impl Cli {
    pub fn run(self) -> i32 {
        init_logging(&self.global);
        if let Command::Doctor(doctor::Doctor { machine, .. })
        | Command::Install(install::Install { machine, .. })
        | Command::Probe(probe::Probe { machine, .. })
        | Command::Serve(serve::Serve { machine, .. }) = &self.command
        {
            crate::cuda::use_library(machine.cuda_lib.clone());
        }
        let result = match self.command {
            Command::Doctor(c) => c.run(&self.global),
            Command::Install(c) => c.run(&self.global),
            Command::Probe(c) => c.run(&self.global),
            Command::Serve(c) => c.run(&self.global),
            Command::Report(c) => c.run(&self.global),
            Command::Status(c) => c.run(&self.global),
            Command::History(c) => c.run(&self.global),
            Command::Token(c) => c.run(&self.global),
            Command::BugReport(c) => c.run(),
            Command::Completions(c) => {
                let mut out = Vec::new();
                clap_complete::generate(c.shell, &mut <Cli as clap::CommandFactory>::command(), "phq-agent", &mut out);
                print_out(&String::from_utf8_lossy(&out), false).map(|()| 0)
            }
            Command::ProbeChild { cuda_lib } => {
                crate::cuda::use_library(cuda_lib);
                crate::probe::child::child_main()
            }
            Command::AllreduceChild { cuda_lib } => {
                crate::cuda::use_library(cuda_lib);
                crate::probe::allreduce::child_main()
            }
            Command::Manpages { dir } => clap_mangen::generate_to(<Cli as clap::CommandFactory>::command(), &dir)
                .map(|()| 0)
                .map_err(|e| anyhow::anyhow!("{}: cannot write the manual pages: {e}", dir.display())),
        };
        match result {
            Ok(code) => code,
            Err(e) => {
                eprint!("{}", error_text(&e));
                if crate::serve::port::is_port_taken(&e) {
                    crate::serve::port::EXIT_PORT_TAKEN
                } else {
                    EXIT_UNKNOWN
                }
            }
        }
    }
}

/// The whole chain, "what" first, then each "because" — each said once: a cause whose text the
/// lines before already carry (an error that quotes its source) is not repeated.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut said = format!("phq-agent: error: {e}\n");
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !said.contains(&text) {
            said.push_str(&format!("  caused by: {text}\n"));
        }
    }
    said
}

/// Prints a report: pretty JSON, or the table for people (coloured where the terminal wants it).
pub fn print_report(r: &crate::report::Report, title: &str, json: bool) -> anyhow::Result<()> {
    if json {
        let text = crate::text::json_pretty(r).map_err(|e| anyhow::anyhow!("cannot encode the report: {e}"))?;
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

    #[test]
    fn every_flag_is_described_and_every_command_gives_its_exit_codes() {
        let cli = Cli::command();
        for sub in cli.get_subcommands().filter(|s| !s.is_hide_set()) {
            let name = sub.get_name();
            assert!(
                sub.get_after_help().is_some_and(|h| h.to_string().contains("Exit codes")),
                "{name} --help does not give its exit codes"
            );
            for arg in sub.get_arguments().filter(|a| !a.is_hide_set()) {
                let id = arg.get_id().as_str();
                if ["help", "version"].contains(&id) {
                    continue;
                }
                assert!(arg.get_help().is_some(), "{name} --{id} has no description");
            }
        }
    }

    #[test]
    fn probe_levels_on_the_command_line_are_the_ones_that_run() {
        assert!(Cli::try_parse_from(["phq-agent", "probe", "--level", "none"]).is_err());
        assert!(Cli::try_parse_from(["phq-agent", "doctor", "--probe", "none"]).is_err());
        assert!(Cli::try_parse_from(["phq-agent", "probe", "--level", "standard"]).is_ok());
    }

    #[test]
    fn status_and_token_take_no_machine_flags() {
        for sub in ["status", "token"] {
            assert!(Cli::try_parse_from(["phq-agent", sub, "--sysroot", "/x"]).is_err(), "{sub} --sysroot");
            assert!(Cli::try_parse_from(["phq-agent", sub, "--nvml-lib", "/x"]).is_err(), "{sub} --nvml-lib");
        }
        assert!(Cli::try_parse_from(["phq-agent", "status", "--config", "/x"]).is_ok());
    }

    #[test]
    fn an_error_that_quotes_its_cause_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let e = anyhow::Error::new(io).context("/x: No such file or directory (os error 2)");
        assert_eq!(error_text(&e), "phq-agent: error: /x: No such file or directory (os error 2)\n");
        let e = anyhow::anyhow!("the disk is full").context("/x: cannot write the token");
        assert_eq!(error_text(&e), "phq-agent: error: /x: cannot write the token\n  caused by: the disk is full\n");
    }
}
