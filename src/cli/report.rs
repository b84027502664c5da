//! `phq-agent report BUNDLE`: the page of a support bundle (`report.html`), rendered again from
//! the bundle's `report.json` — for the platform side, who received the bundle and may hold one
//! made by an older agent, without its page. A phq.status/v1 report on its own (`doctor --json`,
//! `/v1/status`, a pushed report) renders the same way.

use crate::report::{bundle, html};
use anyhow::Context;
use clap::Args;
use std::io::Read;
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct Report {
    /// The bundle (`doctor --bundle OUT.tar.gz`) whose report to render, or a phq.status/v1
    /// report as JSON.
    #[arg(value_name = "BUNDLE")]
    pub bundle: PathBuf,
    /// Write the page to this file (mode 0600, replaced whole if it exists) instead of stdout.
    #[arg(long, short, value_name = "OUT.html")]
    pub output: Option<PathBuf>,
}

impl Report {
    pub fn run(self, _g: &super::Global) -> anyhow::Result<i32> {
        let report = read(&self.bundle)?;
        let page = html::render(&report);
        match &self.output {
            Some(out) => {
                // durable::write syncs the file's directory: a bare name's is `.`.
                let out = if out.parent().is_some_and(|p| p.as_os_str().is_empty()) {
                    Path::new(".").join(out)
                } else {
                    out.clone()
                };
                // 0600 like the bundle: the page quotes the kernel log (Xid and SXid lines), which
                // kernel.dmesg_restrict keeps from other users.
                crate::durable::write(&out, page.as_bytes(), 0o600)
                    .with_context(|| format!("{}: cannot write the page", out.display()))?;
                eprintln!("phq-agent: {} written from {}", out.display(), self.bundle.display());
            }
            None => super::print_out(&page, false)?,
        }
        Ok(0)
    }
}

/// The report in a bundle (a gzip stream), else the file as a report's JSON.
fn read(path: &Path) -> anyhow::Result<crate::report::Report> {
    /// A report is tens to hundreds of KB; the same cap as the bundle reader's members.
    const MAX_REPORT_BYTES: u64 = 64 << 20;
    let (file, _) =
        crate::sysroot::open_regular(path, false).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut buf = Vec::new();
    let mut file = file.take(MAX_REPORT_BYTES + 1);
    (&mut file).take(2).read_to_end(&mut buf).with_context(|| format!("{}: cannot read", path.display()))?;
    // RFC 1952: every gzip member starts with ID1 ID2 = 0x1f 0x8b.
    if buf == [0x1f, 0x8b] {
        return bundle::read_report(path);
    }
    file.read_to_end(&mut buf).with_context(|| format!("{}: cannot read", path.display()))?;
    if buf.len() as u64 > MAX_REPORT_BYTES {
        anyhow::bail!("{}: more than {MAX_REPORT_BYTES} bytes; not a report", path.display());
    }
    let what = format!("{}: a phq.status/v1 report", path.display());
    let r: crate::report::Report = crate::report::untrusted::parse(&buf, &what)
        .with_context(|| format!("{}: neither a bundle nor a phq.status/v1 report", path.display()))?;
    crate::report::untrusted::check_report(&r, &what)?;
    Ok(r)
}
