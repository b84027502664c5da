//! `phq-agent install`: arguments are the contract of DESIGN.md; the installer lands with its issue.

use clap::Args;

#[derive(Debug, Args)]
pub struct Install {
    /// CUDA 12 toolkit to install (default: install.cuda from the config).
    #[arg(long, value_name = "12.x")]
    pub cuda: Option<String>,
    /// Driver branch (default: install.driver_branch from the config).
    #[arg(long, value_name = "N")]
    pub driver_branch: Option<String>,
    /// Print the plan, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Reboot when a step needs it (auto) or report that one is needed (never).
    #[arg(long, value_parser = ["auto", "never"], default_value = "auto")]
    pub reboot: String,
    /// A mirror of NVIDIA's repository.
    #[arg(long, value_name = "URL")]
    pub repo_url: Option<String>,
}

impl Install {
    pub fn run(self, _g: &super::Global) -> anyhow::Result<i32> {
        super::not_built("install", "the installer is issue #5")
    }
}
