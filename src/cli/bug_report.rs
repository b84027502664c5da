//! `phq-agent bug-report --out DIR`: the root helper's side of NVIDIA's bug report
//! (`collect::bug_report_helper`), run by `phq-agent-bug-report.service` when the service asks.
//! Hidden from the help: a person runs `nvidia-bug-report.sh` or `doctor --bundle` instead.

use crate::collect::bug_report_helper::{self, Outcome};
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct BugReport {
    /// The directory the log and its status go into (root's own; made 0750 when missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// The user whose group may read them (the service's).
    #[arg(long, value_name = "USER", default_value = "phq-agent")]
    pub reader: String,
}

/// Exit codes: 0 the log is written; 1 the script left none (the status says why); 2 refused,
/// the script ran within the rate limit; 3 could not start (no such user, an unsafe directory).
impl BugReport {
    pub fn run(self) -> anyhow::Result<i32> {
        let (_, gid) = super::token::user_ids(&self.reader)?;
        let options = crate::collect::bug_report::Options::from_env().map_err(anyhow::Error::msg)?;
        let (outcome, note) = bug_report_helper::answer(&self.out, gid, &options)?;
        eprintln!("phq-agent bug-report: {note}");
        Ok(match outcome {
            Outcome::Ok => 0,
            Outcome::Failed => 1,
            Outcome::Refused => 2,
        })
    }
}
