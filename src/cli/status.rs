//! `phq-agent status`: the D-Bus/HTTP client of the service lands with the service.

use clap::Args;

#[derive(Debug, Args)]
pub struct Status {}

impl Status {
    pub fn run(self, _g: &super::Global) -> anyhow::Result<i32> {
        super::not_built("status", "it asks the service of issue #6")
    }
}
