//! `phq-agent serve`: the systemd service lands with its issue.

use clap::Args;

#[derive(Debug, Args)]
pub struct Serve {}

impl Serve {
    pub fn run(self, _g: &super::Global) -> anyhow::Result<i32> {
        super::not_built("serve", "the service is issue #6")
    }
}
