//! The parts of `/v1/status` and `/metrics` a client may ask for alone, cut from the snapshot's
//! published bodies:
//!
//! - `/v1/status?findings=not-passed`: the report without its passed findings. An 8-GPU report
//!   is about 60 KB, nine tenths of it the two hundred checks that passed; the platform's poller
//!   reads only the others (and the GPUs and the verdict), at every poll of every VM.
//! - `/metrics?name[]=a&name[]=b`: only the samples of those names, with their families' `# HELP`
//!   and `# TYPE` lines — the convention of Prometheus' Python client, whose handler passes the
//!   `name[]` values to `restricted_registry`, which collects "only samples with the given
//!   names" (prometheus/client_python, prometheus_client/exposition.py `_bake_output` and
//!   registry.py `RestrictedRegistry`). The poller wants three families of about a hundred.
//!
//! An agent older than this ignores both (it routes on the path alone) and answers whole, and
//! the poller reads a whole answer the same way, so either side can be upgraded first.
//!
//! Each cut is made at most once per snapshot for what was last asked (`Subsets`), like the
//! metrics' renderings (`Metrics`): a client that asks the same thing at every poll costs the
//! agent one cut per snapshot, not one per request.

use crate::report::Report;
use bytes::Bytes;
use std::sync::{Arc, Mutex, OnceLock};

/// At most this many `name[]` values in one request, each at most `MAX_NAME` bytes: a bound on
/// what a request can make the agent hold and compare, far above the poller's three.
pub const MAX_NAMES: usize = 32;
pub const MAX_NAME: usize = 128;

/// What `/v1/status`'s query asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Findings {
    All,
    NotPassed,
}

/// `/v1/status`'s query: `findings=all` (the default) or `findings=not-passed`; other keys are
/// ignored, as the agent ignored every query before. `Err` is said to the client (400).
pub fn status_query(query: Option<&str>) -> Result<Findings, String> {
    let mut findings = Findings::All;
    for (key, value) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        if key == "findings" {
            findings = match &*value {
                "all" => Findings::All,
                "not-passed" => Findings::NotPassed,
                other => return Err(format!("findings={}: ask for all or not-passed", bounded(other))),
            };
        }
    }
    Ok(findings)
}

/// `/metrics`'s query: the `name[]` values, sorted and without repeats; empty for the whole
/// page. Each must be a metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`, Prometheus' data model).
pub fn metrics_query(query: Option<&str>) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    for (key, value) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        if key != "name[]" {
            continue;
        }
        if names.len() == MAX_NAMES {
            return Err(format!("more than {MAX_NAMES} name[] values"));
        }
        if !is_metric_name(&value) {
            return Err(format!("name[]={}: not a metric name", bounded(&value)));
        }
        names.push(value.into_owned());
    }
    names.sort_unstable();
    names.dedup();
    Ok(names)
}

fn is_metric_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_NAME
        && !b[0].is_ascii_digit()
        && b.iter().all(|&c| c.is_ascii_alphanumeric() || c == b'_' || c == b':')
}

/// A client's words, quoted back: at most 64 characters, under the project's one rule for text
/// from others (`text::printable`), then quoted and escaped.
fn bounded(s: &str) -> String {
    let cut: String = s.chars().take(64).collect();
    format!("{:?}{}", crate::text::printable(&cut), if cut.len() < s.len() { "…" } else { "" })
}

/// One snapshot's cuts, made when first asked for and kept for the snapshot's life.
#[derive(Debug, Default)]
pub struct Subsets {
    /// The report the not-passed cut is made from; `None` (a stand-in's fixed bodies): every
    /// cut is the whole.
    report: Option<Arc<Report>>,
    not_passed: OnceLock<Bytes>,
    /// The last `/metrics` cut.
    metrics: Mutex<Option<Cut>>,
}

/// A `/metrics` cut: what was asked (OpenMetrics?, the names) and its bytes.
type Cut = ((bool, Vec<String>), Bytes);

/// A copy keeps the report and its not-passed cut; its `/metrics` cut starts empty.
impl Clone for Subsets {
    fn clone(&self) -> Subsets {
        Subsets { report: self.report.clone(), not_passed: self.not_passed.clone(), metrics: Mutex::new(None) }
    }
}

impl Subsets {
    pub fn of(report: Arc<Report>) -> Subsets {
        Subsets { report: Some(report), ..Default::default() }
    }

    /// The report without its passed findings (`whole` when there is no report to cut).
    pub fn not_passed(&self, whole: &Bytes) -> Bytes {
        let Some(report) = &self.report else { return whole.clone() };
        self.not_passed
            .get_or_init(|| {
                let mut cut = (**report).clone();
                cut.findings.retain(|f| f.severity != crate::checks::Severity::Pass);
                Bytes::from(serde_json::to_vec(&cut).unwrap_or_default())
            })
            .clone()
    }

    /// `page` (the rendering `openmetrics` names) cut to the samples named in `names`.
    pub fn metrics(&self, page: &Bytes, openmetrics: bool, names: &[String]) -> Bytes {
        let mut last = self.metrics.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(((om, seen), cut)) = last.as_ref() {
            if *om == openmetrics && seen == names {
                return cut.clone();
            }
        }
        let cut = Bytes::from(only_samples(page, names));
        *last = Some(((openmetrics, names.to_vec()), cut.clone()));
        cut
    }
}

/// The lines of an exposition page (text format 0.0.4 or OpenMetrics) that a client naming
/// `names` keeps: each sample line whose metric name is one of them, and the `# HELP`, `# TYPE`
/// and `# UNIT` lines of a family with a sample kept, in the page's order; `# EOF` stays.
pub fn only_samples(page: &[u8], names: &[String]) -> Vec<u8> {
    let mut out = Vec::new();
    // The current family's comment lines, written out before its first kept sample.
    let mut pending: Vec<&[u8]> = Vec::new();
    let mut in_samples = false;
    for line in page.split_inclusive(|&b| b == b'\n') {
        if line.starts_with(b"# EOF") {
            out.extend_from_slice(line);
        } else if line.starts_with(b"#") {
            if in_samples {
                pending.clear();
                in_samples = false;
            }
            pending.push(line);
        } else {
            in_samples = true;
            let end = line.iter().position(|&b| b == b'{' || b == b' ' || b == b'\n').unwrap_or(line.len());
            if names.iter().any(|n| n.as_bytes() == &line[..end]) {
                for c in pending.drain(..) {
                    out.extend_from_slice(c);
                }
                out.extend_from_slice(line);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# HELP phq_agent_info The agent.\n# TYPE phq_agent_info gauge\nphq_agent_info{version=\"0.1.0\"} 1\n\
# HELP phq_gpu_up Up.\n# TYPE phq_gpu_up gauge\nphq_gpu_up{gpu=\"0000:09:00.0\"} 1\nphq_gpu_up{gpu=\"0000:0a:00.0\"} 0\n\
# HELP phq_gpu_xids Xids.\n# TYPE phq_gpu_xids counter\nphq_gpu_xids_total{gpu=\"0000:09:00.0\"} 3\nphq_gpu_xids_created{gpu=\"0000:09:00.0\"} 1.7e9\n\
# HELP phq_gpu_up_seconds A longer name.\n# TYPE phq_gpu_up_seconds gauge\nphq_gpu_up_seconds 5\n# EOF\n";

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_cut_keeps_the_named_samples_and_their_families_comments_only() {
        let cut =
            String::from_utf8(only_samples(PAGE.as_bytes(), &names(&["phq_gpu_up", "phq_gpu_xids_total"]))).unwrap();
        assert_eq!(
            cut,
            "# HELP phq_gpu_up Up.\n# TYPE phq_gpu_up gauge\nphq_gpu_up{gpu=\"0000:09:00.0\"} 1\nphq_gpu_up{gpu=\"0000:0a:00.0\"} 0\n\
# HELP phq_gpu_xids Xids.\n# TYPE phq_gpu_xids counter\nphq_gpu_xids_total{gpu=\"0000:09:00.0\"} 3\n# EOF\n"
        );
        // A name no sample has: the page's end alone.
        assert_eq!(only_samples(PAGE.as_bytes(), &names(&["phq_nothing"])), b"# EOF\n");
        // An unlabelled sample, and no `# EOF` in the text format.
        let text = PAGE.replace("# EOF\n", "");
        let cut = only_samples(text.as_bytes(), &names(&["phq_gpu_up_seconds"]));
        assert_eq!(
            cut,
            b"# HELP phq_gpu_up_seconds A longer name.\n# TYPE phq_gpu_up_seconds gauge\nphq_gpu_up_seconds 5\n"
        );
    }

    #[test]
    fn the_queries_are_read_as_a_form_and_bad_ones_refused() {
        assert_eq!(status_query(None), Ok(Findings::All));
        assert_eq!(status_query(Some("findings=not-passed")), Ok(Findings::NotPassed));
        assert_eq!(status_query(Some("x=1&findings=all")), Ok(Findings::All));
        let e = status_query(Some("findings=failing")).unwrap_err();
        assert!(e.contains("\"failing\"") && e.contains("not-passed"), "{e}");
        // Encoded brackets (as Go's url.Values and curl --data-urlencode write them) or not.
        assert_eq!(
            metrics_query(Some("name%5B%5D=phq_gpu_up&name[]=phq_gpu_xids_total&name[]=phq_gpu_up&other=1")),
            Ok(names(&["phq_gpu_up", "phq_gpu_xids_total"]))
        );
        assert_eq!(metrics_query(Some("")), Ok(vec![]));
        for bad in ["name[]=", "name[]=1abc", "name[]=a%20b", "name[]=a%0Ab"] {
            assert!(metrics_query(Some(bad)).unwrap_err().contains("not a metric name"), "{bad}");
        }
        let long = format!("name[]={}", "a".repeat(MAX_NAME + 1));
        assert!(metrics_query(Some(&long)).is_err());
        let many: Vec<String> = (0..=MAX_NAMES).map(|i| format!("name[]=m{i}")).collect();
        assert!(metrics_query(Some(&many.join("&"))).unwrap_err().contains("more than"));
    }
}
