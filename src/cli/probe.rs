//! `phq-agent probe`: measure the GPUs through CUDA and judge them against their SKU's floors.

use crate::checks::{self, Settings};
use crate::config::ProbeLevel;
use crate::probe::{self, Options};
use crate::report;
use crate::snapshot::Timestamp;
use crate::sysroot::Sysroot;
use clap::Args;
use std::io::IsTerminal;

#[derive(Debug, Args)]
pub struct Probe {
    #[command(flatten)]
    pub machine: super::Machine,
    /// How long and how hard: quick (seconds), standard, full (minutes).
    #[arg(long, value_enum, default_value = "quick")]
    pub level: ProbeLevel,
    /// Only this GPU (index in PCI order, as nvidia-smi numbers them); repeat for several.
    #[arg(long, value_name = "N")]
    pub gpu: Vec<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Run even on GPUs with compute processes (takes GPU time from them).
    #[arg(long)]
    pub force: bool,
    /// Print what the run would do and the GPU time it plans (from the level's sizes and each
    /// GPU's floors), then stop: CUDA is not loaded and no GPU is touched.
    #[arg(long)]
    pub dry_run: bool,
    /// Seconds of GEMM on every probed GPU at once, each result checked (the full level runs
    /// 30; 0 turns it off; any level runs it when given).
    #[arg(long, value_name = "SECONDS")]
    pub gemm_seconds: Option<u32>,
    /// Seconds of FP64 GEMM on every probed GPU at once while each board's power is sampled and
    /// held to its SKU's target, as DCGM's targeted-power test does (the full level runs 30; 0
    /// turns it off; any level runs it when given).
    #[arg(long, value_name = "SECONDS")]
    pub power_seconds: Option<u32>,
    /// NCCL all-reduce message per GPU, e.g. 16G (Azure's health check), 512M or bytes; any level
    /// runs the all-reduce when given (standard runs 1G, full 16G, quick none; 0 turns it off).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub allreduce_size: Option<usize>,
}

/// `16G`, `512M`, `64K` (powers of 1024, as nccl-tests reads `-b`) or plain bytes.
fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, 'G' | 'g')) => (&t[..i], 30),
        Some((i, 'M' | 'm')) => (&t[..i], 20),
        Some((i, 'K' | 'k')) => (&t[..i], 10),
        _ => (t, 0),
    };
    let n: usize = digits.parse().map_err(|_| format!("{s:?}: expected a size such as 16G, 512M or 1048576"))?;
    n.checked_mul(1usize << shift).ok_or_else(|| format!("{s:?}: too large"))
}

impl Probe {
    pub fn run(self, g: &super::Global) -> anyhow::Result<i32> {
        let started_at = Timestamp::now();
        let config = g.load_config()?;
        let root = Sysroot::new(&self.machine.sysroot);
        let nvml =
            crate::collect::NvmlSource::choose(self.machine.nvml_lib.as_deref(), &root).under(config.nvml.deadlines());
        let snapshot = crate::collect::snapshot(&root, &nvml);
        let level = if self.level == ProbeLevel::None { ProbeLevel::Quick } else { self.level };
        let opts = Options {
            level,
            only: &self.gpu,
            force: self.force,
            gemm_seconds: self.gemm_seconds,
            power_seconds: self.power_seconds,
            allreduce_bytes: self.allreduce_size,
            nccl_allowance: config.probes.nccl_allowance,
        };
        if self.dry_run {
            // The GEMMs at the rate of the library the run would use: cuBLAS is looked up (its
            // library loaded, not initialised; no GPU is touched), as the run would.
            let plan = probe::plan_here(&snapshot, &opts, crate::cuda::blas().is_ok());
            if self.json {
                println!("{}", serde_json::to_string_pretty(&plan)?);
            } else {
                print!("{}", probe::budget::render(&plan));
            }
            return Ok(0);
        }
        let mut findings: Vec<checks::Finding> = checks::run(&snapshot, &Settings::from(&config))
            .into_iter()
            .filter(|f| f.id.starts_with("cuda."))
            .collect();
        let (probes, code) =
            match probe_with_progress(&snapshot, nvml.session(), &opts, &config.agent.state_dir, "phq-agent probe") {
                Ok((report, targets)) => {
                    findings.extend(probe::judge_here(&report, &targets, &config.agent.state_dir));
                    (Some(report), None)
                }
                Err(e) => {
                    eprintln!("phq-agent probe: cannot run: {e}");
                    findings.extend(probe::unavailable(&e.to_string()));
                    (None, Some(super::EXIT_UNKNOWN))
                }
            };
        let mut rep = report::build(&snapshot, findings, report::agent_id(&config.agent.id, &snapshot), started_at, 0);
        rep.probes = probes.map(|p| serde_json::to_value(p).unwrap_or_default());
        super::print_report(&rep, "phq-agent probe", self.json)?;
        Ok(code.unwrap_or_else(|| report::exit_code(&rep.findings)))
    }
}

/// Runs the probes with a spinner on a terminal (every step named), plain otherwise; NVML's
/// readings beside the figures through `nvml`, the session the snapshot was read with.
pub fn probe_with_progress(
    snapshot: &crate::snapshot::Snapshot,
    nvml: Option<&crate::collect::nvml::Session>,
    opts: &Options<'_>,
    state_dir: &std::path::Path,
    who: &str,
) -> Result<(probe::ProbeReport, Vec<probe::Target>), probe::NotRun> {
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new_spinner();
        b.enable_steady_tick(std::time::Duration::from_millis(120));
        b
    });
    let result = probe::run_here(snapshot, nvml, opts, state_dir, who, &mut |step| match &bar {
        Some(b) => b.set_message(step.to_string()),
        None => tracing::info!("probe: {step}"),
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    result
}
