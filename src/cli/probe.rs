//! `phq-agent probe`: arguments are the contract of DESIGN.md; CUDA probes land with their issue.

use crate::config::ProbeLevel;
use clap::Args;

#[derive(Debug, Args)]
pub struct Probe {
    #[arg(long, value_enum, default_value = "quick")]
    pub level: ProbeLevel,
    /// Only this GPU (CUDA index); repeat for several.
    #[arg(long, value_name = "N")]
    pub gpu: Vec<u32>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Run even on GPUs with compute processes (takes GPU time from them).
    #[arg(long)]
    pub force: bool,
}

impl Probe {
    pub fn run(self, _g: &super::Global) -> anyhow::Result<i32> {
        super::not_built("probe", "CUDA probes are issue #4")
    }
}
