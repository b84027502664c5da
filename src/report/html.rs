//! The report as one page (`report.html` in a support bundle, `phq-agent report BUNDLE`): the
//! verdict, every finding with its evidence and remedy, the machine, the GPU↔GPU heat map, the
//! Xid and SXid timeline and the install journal — for the person on the platform side who
//! receives a bundle and should not have to read JSON.
//!
//! Rules the page keeps:
//! 1. It is rendered from the `Report` and nothing else — the very value `report.json` holds —
//!    so the page and the JSON never disagree, and a bundle's page renders the same anywhere.
//! 2. One file: the style is inline, there is no script, font or image from anywhere, and a
//!    Content-Security-Policy forbids fetching any; it reads the same without JavaScript.
//! 3. Every string from the report is escaped (`esc`): a finding's text comes from kernel logs,
//!    file contents and NVML, any of which may hold `<script>`.
//! 4. Deterministic: no clock is read and maps are ordered, so the same report makes the same
//!    bytes (a test holds the bundle's page equal to the one `phq-agent report` makes).

use super::matrix::{Cell, Figure, PeerMatrix};
use super::{Health, Report};
use crate::checks::{Finding, Severity};
use std::fmt::Write as _;

/// The colour of a cell below the floor (Material red 700): kept apart from the verdict's red
/// (red 800), so that a screenshot tells the cell from the banner.
pub const SLOW_RGB: (u8, u8, u8) = (211, 47, 47);

/// Text made safe for HTML text and attribute values (OWASP's five characters).
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

const STYLE: &str = "\
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0 auto;max-width:1100px;padding:1em 1.5em;color:#1b1b1b}\
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ccc}\
.verdict{font-size:1.3em;font-weight:bold;padding:.5em .8em;border-radius:4px;color:#fff}\
.health-unhealthy{background:#c62828}.health-degraded{background:#ef6c00}.health-unknown{background:#6a1b9a}.health-healthy{background:#2e7d32}\
dl.machine{display:grid;grid-template-columns:max-content auto;gap:.2em 1.2em}dl.machine dt{font-weight:bold}dl.machine dd{margin:0}\
table{border-collapse:collapse;margin:.5em 0}th,td{border:1px solid #ccc;padding:.25em .5em;text-align:left;vertical-align:top}\
.finding{border-left:6px solid #999;padding:.3em .8em;margin:.8em 0;background:#fafafa}\
.sev-fail{border-color:#c62828}.sev-warn{border-color:#ef6c00}.sev-unknown{border-color:#6a1b9a}.sev-pass{border-color:#2e7d32}\
.sev{font-weight:bold;font-family:monospace}.finding .id{font-family:monospace}.remedy{font-weight:500}\
pre{white-space:pre-wrap;word-break:break-word;background:#f0f0f0;padding:.4em;font-size:12px;max-height:24em;overflow:auto}\
table.heat td.cell{text-align:right;font-family:monospace;min-width:4.5em}\
table.heat td.slow{background:rgb(211,47,47);color:#fff;font-weight:bold}table.heat td.failed{background:#c62828;color:#fff}table.heat td.pcie{background:#ffe082}\
table.heat td.self{background:#e0e0e0;color:#555;text-align:center}\
table.heat td.none{background:#f5f5f5;color:#555;text-align:center}\
.muted{color:#555}";

/// The whole page.
pub fn render(r: &Report) -> String {
    let mut o = String::new();
    let host = r.host.hostname.clone().unwrap_or_else(|| "(no hostname)".into());
    let verdict = verdict(r);
    let _ = write!(
        o,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>phq-agent report: {} — {}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        esc(&host),
        esc(&verdict)
    );
    let _ = writeln!(o, "<h1>phq-agent report: {}</h1>", esc(&host));
    let _ = writeln!(o, "<p id=\"verdict\" class=\"verdict health-{}\">{}</p>", health_word(r.health), esc(&verdict));
    let _ = writeln!(
        o,
        "<p class=\"muted\">Observed at {} by phq-agent {}.</p>",
        esc(&r.observed_at.to_string()),
        esc(&r.agent.version)
    );
    machine(r, &mut o);
    // Problems first and whole, then what the reader came to see, then what passed.
    findings(r, &mut o, false);
    matrix(r, &mut o);
    timeline(r, &mut o);
    install(r, &mut o);
    findings(r, &mut o, true);
    let _ = writeln!(
        o,
        "<footer class=\"muted\"><p>Rendered from the {} report (report.json in the bundle); \
         <code>phq-agent report BUNDLE</code> renders it again.</p></footer>\n</body>\n</html>",
        esc(&r.schema)
    );
    o
}

fn health_word(h: Health) -> &'static str {
    match h {
        Health::Healthy => "healthy",
        Health::Degraded => "degraded",
        Health::Unhealthy => "unhealthy",
        Health::Unknown => "unknown",
    }
}

/// "Unhealthy: 1 failed, 0 warning(s), 0 unknown, 84 passed" — the table's closing line.
fn verdict(r: &Report) -> String {
    let count = |sev: Severity| r.findings.iter().filter(|f| f.severity == sev).count();
    let word = health_word(r.health);
    let mut cap = word.chars();
    let word = cap.next().map(|c| c.to_uppercase().chain(cap).collect::<String>()).unwrap_or_default();
    format!(
        "{word}: {} failed, {} warning(s), {} unknown, {} passed",
        count(Severity::Fail),
        count(Severity::Warn),
        count(Severity::Unknown),
        count(Severity::Pass)
    )
}

fn machine(r: &Report, o: &mut String) {
    let h = &r.host;
    let d = &r.driver;
    let rows: Vec<(&str, String)> = vec![
        ("VM (agent id)", r.agent.agent_id.clone()),
        ("Hostname", h.hostname.clone().unwrap_or_else(|| "unknown".into())),
        ("Virtualization", h.virtualization.clone()),
        ("OS", h.os.clone().unwrap_or_else(|| "unknown".into())),
        ("Kernel", h.kernel.clone().unwrap_or_else(|| "unknown".into())),
        (
            "Driver",
            match (&d.version, d.open_kernel_module) {
                (Some(v), Some(true)) => format!("{v} (open kernel modules)"),
                (Some(v), Some(false)) => format!("{v} (proprietary kernel modules)"),
                (Some(v), None) => v.clone(),
                (None, _) => "not loaded".into(),
            },
        ),
        ("CUDA toolkits", if d.cuda_toolkits.is_empty() { "none found".into() } else { d.cuda_toolkits.join(", ") }),
        ("GPUs", r.gpus.len().to_string()),
        ("NVSwitches", h.nvswitches.to_string()),
        ("vsock", h.vsock_cid.map_or("none".into(), |c| format!("CID {c}"))),
        ("Boot id", r.agent.boot_id.clone().unwrap_or_else(|| "unknown".into())),
    ];
    let _ = writeln!(o, "<section id=\"machine\">\n<h2>Machine</h2>\n<dl class=\"machine\">");
    for (k, v) in rows {
        let _ = writeln!(o, "<dt>{}</dt><dd>{}</dd>", esc(k), esc(&v));
    }
    let _ = writeln!(o, "</dl>");
    if !r.gpus.is_empty() {
        let _ = writeln!(
            o,
            "<table id=\"gpus\"><thead><tr><th>#</th><th>PCI address</th><th>UUID</th><th>Model</th>\
             <th>PCIe link</th><th>Status</th></tr></thead><tbody>"
        );
        for (i, g) in r.gpus.iter().enumerate() {
            let l = &g.link;
            let speed = |gts: Option<f64>, width: Option<u32>| match (gts, width) {
                (Some(s), Some(w)) => format!("{s:.1} GT/s x{w}"),
                (Some(s), None) => format!("{s:.1} GT/s"),
                (None, Some(w)) => format!("x{w}"),
                (None, None) => "?".into(),
            };
            let link = format!("{} (max {})", speed(l.current_gts, l.current_width), speed(l.max_gts, l.max_width));
            let _ = writeln!(
                o,
                "<tr><td>{i}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"sev\">{}</td></tr>",
                esc(&g.pci_address),
                esc(g.uuid.as_deref().unwrap_or("")),
                esc(&g.model),
                esc(&link),
                g.status.label()
            );
        }
        let _ = writeln!(o, "</tbody></table>");
    }
    let _ = writeln!(o, "</section>");
}

/// A JSON value on one line, without the quotes of a bare string.
fn compact(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        v => v.to_string(),
    }
}

/// The findings that did not pass (worst first), or those that did.
fn findings(r: &Report, o: &mut String, passed: bool) {
    let sevs: &[Severity] =
        if passed { &[Severity::Pass] } else { &[Severity::Fail, Severity::Warn, Severity::Unknown] };
    let of: Vec<&Finding> = sevs.iter().flat_map(|s| r.findings.iter().filter(move |f| f.severity == *s)).collect();
    let (id, title) = if passed { ("passed", "Passed") } else { ("findings", "Findings") };
    let _ = writeln!(o, "<section id=\"{id}\">\n<h2>{title} ({})</h2>", of.len());
    if of.is_empty() && !passed {
        let _ = writeln!(o, "<p>Every check passed.</p>");
    }
    for f in of {
        finding(f, o);
    }
    let _ = writeln!(o, "</section>");
}

fn finding(f: &Finding, o: &mut String) {
    let sev = health_class(f.severity);
    let _ = write!(
        o,
        "<article class=\"finding sev-{sev}\" data-id=\"{}\" data-severity=\"{sev}\">\n\
         <p><span class=\"sev\">{}</span> <span class=\"id\">{}</span>",
        esc(&f.id),
        f.severity.label(),
        esc(&f.id)
    );
    if let Some(g) = &f.gpu {
        let _ = write!(o, " <span class=\"gpu\">{}</span>", esc(g));
    }
    let _ = writeln!(o, "</p>\n<p class=\"summary\">{}</p>", esc(&f.summary));
    if !f.detail.is_empty() {
        let _ = writeln!(o, "<p class=\"detail\">{}</p>", esc(&f.detail));
    }
    if let Some(rem) = &f.remedy {
        let _ = writeln!(o, "<p class=\"remedy\">→ {}</p>", esc(rem));
    }
    if !f.evidence.is_empty() {
        let text = serde_json::to_string_pretty(&f.evidence).unwrap_or_default();
        // Passed findings fold their evidence away (a <details> opens without JavaScript).
        let open = if f.severity == Severity::Pass { "" } else { " open" };
        let _ = writeln!(o, "<details{open}><summary>evidence</summary><pre>{}</pre></details>", esc(&text));
    }
    let _ = writeln!(o, "</article>");
}

fn health_class(s: Severity) -> &'static str {
    match s {
        Severity::Fail => "fail",
        Severity::Warn => "warn",
        Severity::Unknown => "unknown",
        Severity::Pass => "pass",
    }
}

fn matrix(r: &Report, o: &mut String) {
    let _ = writeln!(o, "<section id=\"matrix\">\n<h2>GPU↔GPU</h2>");
    let Some(m) = PeerMatrix::of(r) else {
        let why = match &r.probes {
            None => "No probe ran.",
            Some(p) if serde_json::from_value::<crate::probe::ProbeReport>(p.clone()).is_err() => {
                "The report holds probe results this agent cannot read (another agent version?): see report.json."
            }
            Some(_) => "Fewer than two GPUs were probed: no peer copies.",
        };
        let _ = writeln!(o, "<p class=\"muted\">{why}</p></section>");
        return;
    };
    let floor = match m.floor() {
        Some(fl) => format!(" Red: below the NVLink floor of {fl:.0} GB/s."),
        None => " Red: below the source GPU's NVLink floor.".into(),
    };
    let _ = writeln!(
        o,
        "<p>Peer copy bandwidth in GB/s, rows the source GPU, columns the destination (nvbandwidth's \
         layout); GPU numbers as nvidia-smi's.{}</p>",
        esc(&floor)
    );
    let max = m
        .cells
        .values()
        .filter_map(|c| match c.gbps {
            Figure::Measured(v) => Some(v),
            _ => None,
        })
        .fold(0.0_f64, f64::max);
    heat(o, &m, "bandwidth", |c| bandwidth_cell(c, max));
    let _ = writeln!(
        o,
        "<p class=\"muted\">Green: NVLink at or above the floor, deeper the faster; amber: PCIe only, no NVLink; \
         red: below the floor; grey: the GPU itself, no peer access, or not measured.</p>"
    );
    let _ = writeln!(o, "<p>Latency in ns: a kernel on the row's GPU reads the column's GPU memory.</p>");
    heat(o, &m, "latency", |c| match &c.latency_ns {
        Figure::Measured(v) => (format!("{v:.0}"), "cell".into(), String::new(), String::new()),
        f => plain(f),
    });
    if let Some(line) = &m.scope_line {
        let _ = writeln!(o, "<p id=\"nvlink-scope\">NVLink scope: {}</p>", esc(line));
    }
    let _ = writeln!(o, "<table><thead><tr><th>GPU</th><th>PCI address</th></tr></thead><tbody>");
    for (n, pci) in &m.gpus {
        let _ = writeln!(o, "<tr><td>{n}</td><td>{}</td></tr>", esc(pci));
    }
    let _ = writeln!(o, "</tbody></table>\n</section>");
}

/// (text, class, inline style, title) of a bandwidth cell: red below the floor, else green, the
/// deeper the faster (relative to the fastest pair measured).
fn bandwidth_cell(c: &Cell, max: f64) -> (String, String, String, String) {
    match &c.gbps {
        Figure::Measured(v) if c.slow() => (
            format!("{v:.1}"),
            "cell slow".into(),
            String::new(),
            format!("below the floor of {:.0} GB/s ({})", c.floor_gbps.unwrap_or(0.0), c.scope),
        ),
        // A PCIe pair is not slow NVLink but no NVLink at all (probe.p2p-bandwidth warns).
        Figure::Measured(v) if c.scope != "nvlink" => {
            (format!("{v:.1}"), "cell pcie".into(), String::new(), format!("{}: no NVLink between these GPUs", c.scope))
        }
        Figure::Measured(v) => {
            let t = if max > 0.0 { (v / max).clamp(0.0, 1.0) } else { 0.0 };
            // From a pale green (232,245,233) to Material green 800 (46,125,50).
            let mix = |a: f64, b: f64| (a + (b - a) * t).round() as u8;
            let (r, g, b) = (mix(232.0, 46.0), mix(245.0, 125.0), mix(233.0, 50.0));
            let fg = if t > 0.6 { "#fff" } else { "#1b1b1b" };
            (format!("{v:.1}"), "cell".into(), format!("background:rgb({r},{g},{b});color:{fg}"), c.scope.clone())
        }
        f => plain(f),
    }
}

fn plain(f: &Figure) -> (String, String, String, String) {
    match f {
        Figure::Measured(v) => (format!("{v:.1}"), "cell".into(), String::new(), String::new()),
        Figure::NoAccess => ("none".into(), "cell none".into(), String::new(), "no peer access".into()),
        Figure::Failed(e) => ("err".into(), "cell failed".into(), String::new(), e.clone()),
        Figure::NotMeasured => ("-".into(), "cell none".into(), String::new(), "not measured".into()),
    }
}

type CellView = (String, String, String, String);

fn heat(o: &mut String, m: &PeerMatrix, id: &str, view: impl Fn(&Cell) -> CellView) {
    let _ = write!(o, "<table class=\"heat\" id=\"{id}\"><thead><tr><th>src \\ dst</th>");
    for (n, _) in &m.gpus {
        let _ = write!(o, "<th>{n}</th>");
    }
    let _ = writeln!(o, "</tr></thead><tbody>");
    for (src, _) in &m.gpus {
        let _ = write!(o, "<tr><th>{src}</th>");
        for (dst, _) in &m.gpus {
            let (text, class, style, title) = match m.cells.get(&(*src, *dst)) {
                _ if src == dst => ("N/A".into(), "cell self".into(), String::new(), "the GPU itself".into()),
                Some(c) => view(c),
                None => plain(&Figure::NotMeasured),
            };
            let style = if style.is_empty() { String::new() } else { format!(" style=\"{}\"", esc(&style)) };
            let _ = write!(
                o,
                "<td class=\"{}\" data-src=\"{src}\" data-dst=\"{dst}\" title=\"{}\"{style}>{}</td>",
                esc(&class),
                esc(&title),
                esc(&text)
            );
        }
        let _ = writeln!(o, "</tr>");
    }
    let _ = writeln!(o, "</tbody></table>");
}

/// Xids per GPU (from the report's GPU summaries) and SXids per NVSwitch (from `fabric.sxid`),
/// in order of first report where the log carried times.
fn timeline(r: &Report, o: &mut String) {
    let _ = writeln!(o, "<section id=\"timeline\">\n<h2>Xid and SXid timeline</h2>");
    let mut rows: Vec<(Option<f64>, String)> = Vec::new();
    for g in &r.gpus {
        for x in &g.xids {
            let secs = |s: Option<f64>| s.map(|v| format!("{v:.1}")).unwrap_or_else(|| "?".into());
            rows.push((
                x.first_seen_s,
                format!(
                    "<tr class=\"xid\"><td>{}</td><td>{}</td><td>Xid {}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                    esc(&secs(x.first_seen_s)),
                    esc(&secs(x.last_seen_s)),
                    esc(&x.code),
                    esc(&g.pci_address),
                    x.count,
                    esc(&x.meaning),
                    esc(&x.resolution),
                    esc(&x.last_message)
                ),
            ));
        }
    }
    for f in r.findings.iter().filter(|f| f.id == "fabric.sxid") {
        let Some(sxids) = f.evidence.get("sxids").and_then(|v| v.as_array()) else { continue };
        for s in sxids {
            let field = |k: &str| s.get(k).map(compact).unwrap_or_default();
            let count = s.get("fatal").and_then(|v| v.as_u64()).unwrap_or(0)
                + s.get("non_fatal").and_then(|v| v.as_u64()).unwrap_or(0);
            rows.push((
                None,
                format!(
                    "<tr class=\"sxid\"><td>?</td><td>?</td><td>SXid {}</td><td>{}</td><td>{count}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                    esc(&field("code")),
                    esc(f.gpu.as_deref().unwrap_or("NVSwitch")),
                    esc(&field("name")),
                    esc(&field("table")),
                    esc(&field("last_message"))
                ),
            ));
        }
    }
    if rows.is_empty() {
        let _ = writeln!(o, "<p>No Xid or SXid in the kernel log or from NVML.</p></section>");
        return;
    }
    // Timed first, by first report; untimed after, in the report's order.
    rows.sort_by(|a, b| match (a.0, b.0) {
        (Some(x), Some(y)) => x.total_cmp(&y),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => std::cmp::Ordering::Equal,
    });
    let _ = writeln!(
        o,
        "<table><thead><tr><th>first (s since boot)</th><th>last</th><th>code</th><th>on</th><th>count</th>\
         <th>meaning</th><th>resolution</th><th>last message</th></tr></thead><tbody>"
    );
    for (_, row) in rows {
        let _ = writeln!(o, "{row}");
    }
    let _ = writeln!(o, "</tbody></table>\n</section>");
}

fn install(r: &Report, o: &mut String) {
    let _ = writeln!(o, "<section id=\"install\">\n<h2>Install journal</h2>");
    let Some(state) = &r.install else {
        let _ = writeln!(
            o,
            "<p>No install has run on this machine (or the report was made from another root).</p></section>"
        );
        return;
    };
    let _ = writeln!(o, "<dl class=\"machine\">");
    if let Some(map) = state.as_object() {
        for (k, v) in map.iter().filter(|(k, v)| *k != "steps" && *k != "findings" && !v.is_null()) {
            let _ = writeln!(o, "<dt>{}</dt><dd>{}</dd>", esc(k), esc(&compact(v)));
        }
    }
    let _ = writeln!(o, "</dl>");
    if let Some(steps) = state.get("steps").and_then(|s| s.as_object()) {
        let _ = writeln!(o, "<table id=\"install-steps\"><thead><tr><th>step</th><th>record</th></tr></thead><tbody>");
        for (id, rec) in steps {
            let _ = writeln!(o, "<tr><td>{}</td><td>{}</td></tr>", esc(id), esc(&compact(rec)));
        }
        let _ = writeln!(o, "</tbody></table>");
    }
    if let Some(fs) = state.get("findings").and_then(|f| f.as_array()) {
        for f in fs.iter().filter_map(|f| serde_json::from_value::<Finding>(f.clone()).ok()) {
            finding(&f, o);
        }
    }
    let _ = writeln!(o, "</section>");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_the_five_characters() {
        assert_eq!(esc(r#"<a href="x">'&'</a>"#), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
    }

    #[test]
    fn the_slow_colour_is_the_styles() {
        let (r, g, b) = SLOW_RGB;
        assert!(STYLE.contains(&format!("td.slow{{background:rgb({r},{g},{b})")));
    }
}
