//! What a guest said, as the platform's series: the `phq_guest_*` families, from a whitelist of
//! names, every label value checked against what the agent can write and bounded in length, and
//! at most `max_series` of them per VM. Nothing here becomes an identity label: those are added
//! from the target when the series are served (`expo`).
//!
//! Pure: bytes in, series out.

use phq_wire::view::Status;
use phq_wire::{BASES, SCHEMA};

/// One series of one guest, without its identity labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub family: &'static str,
    pub labels: Vec<(&'static str, String)>,
    pub value: f64,
}

/// A guest's series from one poll, and what was left out.
#[derive(Debug, Clone, Default)]
pub struct Said {
    pub version: String,
    pub series: Vec<Series>,
    /// Series beyond the cap.
    pub dropped_cap: u64,
    /// Series with a label value the agent cannot have written (or a line that is not a sample).
    pub dropped_invalid: u64,
}

/// The families the poller serves from a guest, with their help text and type.
pub const FAMILIES: &[(&str, &str, &str)] = &[
    ("phq_guest_agent_info", "gauge", "The guest's agent version, as the guest says (a claim)."),
    ("phq_guest_verdict", "gauge", "1 for the guest's verdict: action, owner and what backs it, as the guest says (a claim unless source=\"validation\")."),
    ("phq_guest_verdict_gpu", "gauge", "1 for each GPU the guest's verdict is about, with the board serial the guest read (a claim unless source=\"validation\")."),
    ("phq_guest_gpu_info", "gauge", "1 for each GPU the guest sees: PCI address in the guest, UUID, board serial, model (a claim unless source=\"validation\")."),
    ("phq_guest_finding", "gauge", "1 for each finding that did not pass: check id, GPU, severity, action, owner (a claim unless source=\"validation\")."),
    ("phq_guest_gpu_up", "gauge", "The guest agent's phq_gpu_up: 0 for a GPU NVML lost (a claim)."),
    ("phq_guest_gpu_xids_total", "counter", "The guest agent's phq_gpu_xids_total: Xids since the guest booted, per GPU (a claim)."),
    ("phq_guest_nvswitch_sxids_total", "counter", "The guest agent's phq_nvswitch_sxids_total: SXids since the guest booted, per NVSwitch (a claim)."),
];

/// The agent's /metrics families the poller takes, the name it serves each under, and the one
/// label each carries (docs/metrics.md).
const FROM_METRICS: &[(&str, &str, &str)] = &[
    ("phq_gpu_up", "phq_guest_gpu_up", "gpu"),
    ("phq_gpu_xids_total", "phq_guest_gpu_xids_total", "gpu"),
    ("phq_nvswitch_sxids_total", "phq_guest_nvswitch_sxids_total", "nvswitch"),
];

/// What the poller asks an agent for: the report without the findings that passed (it reads only
/// the others), and the samples of `FROM_METRICS` alone (`name[]`, the brackets encoded as Go's
/// url.Values writes them) — 6 KB and 2 KB of an 8-GPU agent's 60 KB and 85 KB. An agent older
/// than these queries ignores them and answers whole; `status` and `said` read either alike.
pub const STATUS_PATH: &str = "/v1/status?findings=not-passed";
pub const METRICS_PATH: &str =
    "/metrics?name%5B%5D=phq_gpu_up&name%5B%5D=phq_gpu_xids_total&name%5B%5D=phq_nvswitch_sxids_total";

/// Reads the report; `Err` says why it is not one (the poll then fails as `schema`).
pub fn status(body: &[u8]) -> Result<Status<'_>, String> {
    // serde's message can quote the guest's own words (an unknown variant): escaped and bounded
    // before it reaches the poller's log, and from there a terminal.
    let s: Status = serde_json::from_slice(body).map_err(|e| bounded_to(&e.to_string(), 200))?;
    if s.schema != SCHEMA {
        return Err(format!("schema {:?}, not {SCHEMA}", bounded(&s.schema)));
    }
    Ok(s)
}

/// The series of a report and the agent's /metrics page.
pub fn said(s: &Status, metrics: &[u8], max_series: usize) -> Said {
    let mut out = Said {
        version: if is_version(&s.agent.version) { s.agent.version.to_string() } else { "invalid".into() },
        ..Said::default()
    };
    let push = |out: &mut Said, series: Option<Series>| match series {
        None => out.dropped_invalid += 1,
        Some(_) if out.series.len() >= max_series => out.dropped_cap += 1,
        Some(x) => out.series.push(x),
    };
    let version = out.version.clone();
    push(&mut out, Some(one("phq_guest_agent_info", vec![("version", version)], 1.0)));
    let serial_of = |pci: &str| -> String {
        s.gpus
            .iter()
            .find(|g| g.pci_address == pci)
            .and_then(|g| g.serial.as_deref())
            .filter(|v| is_serial(v))
            .unwrap_or_default()
            .to_string()
    };
    if let Some(v) = &s.verdict {
        let basis: Vec<&str> = BASES.iter().copied().filter(|b| v.basis.iter().any(|x| x == b)).collect();
        let invalid_basis = v.basis.iter().any(|b| !BASES.contains(&&**b));
        push(
            &mut out,
            (!invalid_basis).then(|| {
                one(
                    "phq_guest_verdict",
                    vec![
                        ("action", v.action.word().into()),
                        ("owner", v.owner.word().into()),
                        ("basis", basis.join("+")),
                    ],
                    1.0,
                )
            }),
        );
        for g in &v.gpus {
            let series = is_pci(g).then(|| {
                one(
                    "phq_guest_verdict_gpu",
                    vec![
                        ("gpu", g.to_string()),
                        ("serial", serial_of(g)),
                        ("action", v.action.word().into()),
                        ("owner", v.owner.word().into()),
                    ],
                    1.0,
                )
            });
            push(&mut out, series);
        }
    }
    for g in &s.gpus {
        let ok = is_pci(&g.pci_address)
            && g.uuid.as_deref().is_none_or(is_uuid)
            && g.serial.as_deref().is_none_or(is_serial)
            && is_model(&g.model);
        let series = ok.then(|| {
            one(
                "phq_guest_gpu_info",
                vec![
                    ("gpu", g.pci_address.to_string()),
                    ("uuid", g.uuid.as_deref().unwrap_or_default().to_string()),
                    ("serial", g.serial.as_deref().unwrap_or_default().to_string()),
                    ("model", g.model.to_string()),
                ],
                1.0,
            )
        });
        push(&mut out, series);
    }
    for f in s.findings.iter().filter(|f| f.severity != "pass") {
        let ok = is_check_id(&f.id)
            && ["warn", "fail", "unknown"].contains(&&*f.severity)
            && f.gpu.as_deref().is_none_or(is_pci);
        let series = ok.then(|| {
            one(
                "phq_guest_finding",
                vec![
                    ("check", f.id.to_string()),
                    ("gpu", f.gpu.as_deref().unwrap_or_default().to_string()),
                    ("severity", f.severity.to_string()),
                    ("action", f.action.word().into()),
                    ("owner", f.owner.word().into()),
                ],
                1.0,
            )
        });
        push(&mut out, series);
    }
    for (start, family) in family_lines(metrics) {
        let line = &metrics[start..];
        let line = &line[..memchr::memchr(b'\n', line).unwrap_or(line.len())];
        let (name, served, label) = FROM_METRICS[family];
        // A longer name that begins with the family's (its line was found by the prefix).
        let Some((_, rest)) = metric_name(line).filter(|(n, _)| *n == name.as_bytes()) else { continue };
        push(&mut out, sample(rest, label).map(|(v, value)| one(served, vec![(label, v)], value)));
    }
    out
}

/// Where the lines that begin with one of `FROM_METRICS`' names start, with the family's index,
/// in the page's order. The page is searched for each name after a newline (memmem, a few
/// microseconds for a 8-GPU agent's 80 KB) instead of being split into lines and each line's
/// name compared: that was a tenth of the poller's CPU per poll (perf, 2026-12-06).
fn family_lines(metrics: &[u8]) -> Vec<(usize, usize)> {
    let mut at = Vec::new();
    for (family, (name, _, _)) in FROM_METRICS.iter().enumerate() {
        if metrics.starts_with(name.as_bytes()) {
            at.push((0, family));
        }
        let needle = [b"\n", name.as_bytes()].concat();
        at.extend(memchr::memmem::find_iter(metrics, &needle).map(|p| (p + 1, family)));
    }
    at.sort_unstable();
    at
}

fn one(family: &'static str, labels: Vec<(&'static str, String)>, value: f64) -> Series {
    Series { family, labels, value }
}

/// A sample line's metric name and the rest, when it is not a comment.
fn metric_name(line: &[u8]) -> Option<(&[u8], &[u8])> {
    if line.first().is_none_or(|&b| b == b'#') {
        return None;
    }
    let end = line.iter().position(|&b| b == b'{' || b == b' ')?;
    Some((&line[..end], &line[end..]))
}

/// `{gpu="0000:0a:00.0",uuid="GPU-…"} 12`: the family's one label (a PCI address), the GPU's
/// UUID beside it where the agent writes one (docs/metrics.md: every per-GPU series carries
/// both), nothing else; a finite, non-negative value.
fn sample(rest: &[u8], label: &str) -> Option<(String, f64)> {
    let rest = std::str::from_utf8(rest).ok()?;
    let inner = rest.strip_prefix('{')?;
    let close = inner.find('}')?;
    let (pairs, value) = (&inner[..close], inner[close + 1..].trim());
    let mut found = None;
    for pair in pairs.trim_end_matches(',').split(',') {
        let (k, v) = pair.split_once('=')?;
        let v = v.strip_prefix('"')?.strip_suffix('"')?;
        match k {
            _ if k == label && is_pci(v) && found.is_none() => found = Some(v),
            "uuid" if label == "gpu" && is_uuid(v) => {}
            _ => return None,
        }
    }
    let value: f64 = value.split(' ').next()?.parse().ok()?;
    let found = found?;
    (value.is_finite() && value >= 0.0).then(|| (found.to_string(), value))
}

/// The PCI address as the agent writes it: `0000:0a:00.0` (domain of 4 to 8 hex digits).
pub fn is_pci(s: &str) -> bool {
    let b = s.as_bytes();
    let n = b.len();
    (12..=16).contains(&n)
        && b[n - 2] == b'.'
        && (b'0'..=b'7').contains(&b[n - 1])
        && b[n - 5] == b':'
        && b[n - 8] == b':'
        && s[..n - 8].bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        && s[n - 7..n - 5].bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        && s[n - 4..n - 2].bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
}

/// NVML's board serial: digits on NVIDIA's boards (13 on an H100); letters and `-` allowed, 32 at
/// most (NVML_DEVICE_SERIAL_BUFFER_SIZE is 30 with its NUL).
pub fn is_serial(s: &str) -> bool {
    !s.is_empty() && s.len() <= 32 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// NVML's UUID: `GPU-` and a hex UUID (NVML_DEVICE_UUID_V2_BUFFER_SIZE is 96).
fn is_uuid(s: &str) -> bool {
    s.len() <= 96 && s.starts_with("GPU-") && s[4..].bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// A device name as NVML gives it ("NVIDIA H100 80GB HBM3"), 96 bytes at most
/// (NVML_DEVICE_NAME_V2_BUFFER_SIZE).
fn is_model(s: &str) -> bool {
    s.len() <= 96 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b" ._-()/".contains(&b))
}

/// A check id: `area.name`, lower-case, 64 bytes at most (docs/checks.md).
fn is_check_id(s: &str) -> bool {
    s.len() <= 64
        && s.split_once('.').is_some_and(|(a, n)| {
            !a.is_empty()
                && !n.is_empty()
                && a.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
                && n.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        })
}

/// The agent's version: a Cargo version, 64 bytes at most.
fn is_version(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b".+-~".contains(&b))
}

/// A guest's string in our own messages: 64 characters at most, controls escaped.
pub fn bounded(s: &str) -> String {
    bounded_to(s, 64)
}

fn bounded_to(s: &str, n: usize) -> String {
    let cut: String = s.chars().take(n).collect();
    format!("{}{}", cut.escape_debug(), if s.chars().count() > n { "…" } else { "" })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(verdict: &str, gpus: &str, findings: &str) -> Vec<u8> {
        format!(
            r#"{{"schema":"phq.status/v1","agent":{{"version":"0.1.0"}},"gpus":{gpus},"findings":{findings},"verdict":{verdict}}}"#
        )
        .into_bytes()
    }

    #[test]
    fn the_metrics_path_asks_for_exactly_the_families_taken() {
        let asked: Vec<&str> = METRICS_PATH
            .split_once('?')
            .unwrap()
            .1
            .split('&')
            .map(|p| p.strip_prefix("name%5B%5D=").unwrap())
            .collect();
        let taken: Vec<&str> = FROM_METRICS.iter().map(|f| f.0).collect();
        assert_eq!(asked, taken);
    }

    #[test]
    fn a_report_becomes_whitelisted_series() {
        let body = report(
            r#"{"action":"reboot_host","owner":"platform","findings":["gpu.xid"],"gpus":["0000:0a:00.0"],"basis":["nvml"],"since":null}"#,
            r#"[{"pci_address":"0000:0a:00.0","uuid":"GPU-1f2e","model":"NVIDIA H100 80GB HBM3","serial":"1654922001234"}]"#,
            r#"[{"id":"gpu.xid","severity":"fail","gpu":"0000:0a:00.0","action":"reboot_host","owner":"platform"},{"id":"host.os-supported","severity":"pass"}]"#,
        );
        let s = status(&body).unwrap();
        let said = said(&s, b"# TYPE phq_gpu_xids_total counter\nphq_gpu_xids_total{gpu=\"0000:0a:00.0\"} 3\nphq_gpu_temperature_celsius{gpu=\"0000:0a:00.0\"} 40\n", 100);
        let families: Vec<&str> = said.series.iter().map(|s| s.family).collect();
        assert_eq!(
            families,
            [
                "phq_guest_agent_info",
                "phq_guest_verdict",
                "phq_guest_verdict_gpu",
                "phq_guest_gpu_info",
                "phq_guest_finding",
                "phq_guest_gpu_xids_total"
            ]
        );
        assert_eq!(said.series[2].labels[1], ("serial", "1654922001234".to_string()));
        assert_eq!(said.dropped_invalid, 0);
    }

    /// The families are found wherever their lines stand, in the page's order, the first line
    /// of the page included; a name that only begins like one is another family; a family's
    /// line without its label is counted as invalid, as before the page was searched by name.
    #[test]
    fn the_three_families_are_found_by_name_in_the_pages_order() {
        let body = report("null", "[]", "[]");
        let s = status(&body).unwrap();
        let page = b"phq_gpu_up{gpu=\"0000:0a:00.0\"} 1\n\
            phq_gpu_xids_total{gpu=\"0000:0a:00.0\"} 2\n\
            phq_gpu_up_since{gpu=\"0000:0a:00.0\"} 9\n\
            # HELP phq_gpu_up the GPU answers\n\
            phq_nvswitch_sxids_total{nvswitch=\"0000:05:00.0\"} 4\n\
            phq_gpu_up{gpu=\"0000:0b:00.0\"} 0\n\
            phq_gpu_up 1\n\
            phq_gpu_xids_total{gpu=\"0000:0b:00.0\"} 5";
        let said = said(&s, page, 100);
        let got: Vec<(&str, String, f64)> =
            said.series[1..].iter().map(|x| (x.family, x.labels[0].1.clone(), x.value)).collect();
        assert_eq!(
            got,
            [
                ("phq_guest_gpu_up", "0000:0a:00.0".to_string(), 1.0),
                ("phq_guest_gpu_xids_total", "0000:0a:00.0".to_string(), 2.0),
                ("phq_guest_nvswitch_sxids_total", "0000:05:00.0".to_string(), 4.0),
                ("phq_guest_gpu_up", "0000:0b:00.0".to_string(), 0.0),
                ("phq_guest_gpu_xids_total", "0000:0b:00.0".to_string(), 5.0),
            ]
        );
        assert_eq!(said.dropped_invalid, 1, "phq_gpu_up without its gpu label");
    }

    #[test]
    fn what_the_agent_cannot_write_is_not_a_label() {
        let long = "a".repeat(1 << 20);
        let body = report(
            r#"{"action":"none","owner":"none","findings":[],"gpus":[],"basis":["rumour"],"since":null}"#,
            &format!(
                r#"[{{"pci_address":"0000:0a:00.0","model":"{long}"}},{{"pci_address":"../../etc","model":"x"}}]"#
            ),
            r#"[{"id":"gpu.xid\"} 1\nphq_verdict{","severity":"fail"}]"#,
        );
        let said = said(
            &status(&body).unwrap(),
            "phq_gpu_up{gpu=\"\u{202e}0000:0a:00.0\"} 1\nphq_gpu_up{gpu=\"0000:0a:00.0\",node=\"other\"} 1\n"
                .as_bytes(),
            100,
        );
        assert_eq!(said.series.len(), 1, "{:?}", said.series);
        assert_eq!(said.dropped_invalid, 6);
        // An action the vocabulary does not have is not a report at all.
        let e = status(&report(
            r#"{"action":"drain_node","owner":"platform","findings":[],"gpus":[],"basis":[],"since":null}"#,
            "[]",
            "[]",
        ))
        .unwrap_err();
        assert!(e.contains("drain_node"), "{e}");
        // The guest's words in that message reach the log escaped.
        let e = status(&report(
            "{\"action\":\"\\u001b[2Jx\",\"owner\":\"none\",\"findings\":[],\"gpus\":[],\"basis\":[],\"since\":null}",
            "[]",
            "[]",
        ))
        .unwrap_err();
        assert!(!e.contains('\u{1b}') && e.contains("\\u{1b}"), "{e}");
        assert!(status(br#"{"schema":"phq.status/v2","agent":{"version":"9"}}"#).unwrap_err().contains("v2"));
    }

    #[test]
    fn a_guest_has_at_most_its_cap_of_series() {
        let mut page = String::new();
        for i in 0..10_000 {
            page.push_str(&format!("phq_gpu_up{{gpu=\"0000:{:02x}:{:02x}.0\"}} 1\n", i / 256 % 256, i % 256));
        }
        let said = said(&status(&report("null", "[]", "[]")).unwrap(), page.as_bytes(), 512);
        assert_eq!(said.series.len(), 512);
        assert_eq!(said.dropped_cap, 10_000 + 1 - 512);
    }

    #[test]
    fn pci_addresses_as_the_agent_writes_them() {
        for ok in ["0000:0a:00.0", "00000000:0a:00.7"] {
            assert!(is_pci(ok), "{ok}");
        }
        for bad in ["0000:0A:00.0", "0000:0a:00.8", "0a:00.0", "0000:0a:00.0 ", "../0a:00.0x"] {
            assert!(!is_pci(bad), "{bad}");
        }
    }
}
