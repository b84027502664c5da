//! The report for people: a header that says what machine this is, then problems first (each
//! with what to do), then what passed, compactly. Colour only where the terminal wants it
//! (`anstream` honours `NO_COLOR`, `CLICOLOR_FORCE` and non-terminals).

use super::Report;
use crate::checks::{Finding, Severity};
use anstyle::{AnsiColor, Style};
use std::fmt::Write as _;

const BOLD: Style = Style::new().bold();
const DIM: Style = Style::new().dimmed();

fn style(sev: Severity) -> Style {
    match sev {
        Severity::Fail => AnsiColor::Red.on_default().bold(),
        Severity::Warn => AnsiColor::Yellow.on_default().bold(),
        Severity::Unknown => AnsiColor::Magenta.on_default(),
        Severity::Pass => AnsiColor::Green.on_default(),
    }
}

/// One printed row: the findings of one check that say the same thing, on one or more GPUs.
struct Row<'a> {
    first: &'a Finding,
    gpus: Vec<&'a str>,
}

/// Groups findings of the same check and the same words: eight GPUs bound to nouveau are one
/// row naming the eight, a GPU that differs gets its own.
fn rows<'a>(findings: &[&'a Finding]) -> Vec<Row<'a>> {
    let mut out: Vec<Row> = Vec::new();
    for f in findings {
        let same = |r: &&mut Row| {
            r.first.id == f.id
                && r.first.summary == f.summary
                && r.first.detail == f.detail
                && r.first.remedy == f.remedy
        };
        match out.iter_mut().find(|r| same(r)) {
            Some(row) => row.gpus.extend(f.gpu.as_deref()),
            None => out.push(Row { first: f, gpus: f.gpu.as_deref().into_iter().collect() }),
        }
    }
    out
}

fn who(gpus: &[&str]) -> String {
    match gpus {
        [] => String::new(),
        [one] => one.to_string(),
        many => format!("{} GPUs", many.len()),
    }
}

pub fn render(r: &Report, title: &str, width: usize) -> String {
    let mut o = String::new();
    header(r, title, &mut o);
    let id_w = r.findings.iter().map(|f| f.id.len()).max().unwrap_or(10);
    for sev in [Severity::Fail, Severity::Warn, Severity::Unknown, Severity::Pass] {
        let of_sev: Vec<&Finding> = r.findings.iter().filter(|f| f.severity == sev).collect();
        let rows = rows(&of_sev);
        // Checks that share one reason and name no GPU ("needs NVML", "no NVIDIA GPU") are one
        // line listing their ids: twelve checks waiting for NVML are one fact, not twelve.
        let mut shared: Vec<(&str, Vec<&str>)> = Vec::new();
        for row in &rows {
            if row.gpus.is_empty() && row.first.detail.is_empty() && sev <= Severity::Unknown {
                match shared.iter_mut().find(|(s, _)| *s == row.first.summary) {
                    Some((_, ids)) => ids.push(&row.first.id),
                    None => shared.push((&row.first.summary, vec![&row.first.id])),
                }
            }
        }
        let grouped = |row: &Row| {
            shared.iter().any(|(s, ids)| {
                ids.len() > 1 && *s == row.first.summary && row.gpus.is_empty() && row.first.detail.is_empty()
            })
        };
        for row in rows.iter().filter(|r| !grouped(r)) {
            let f = row.first;
            line(&mut o, sev, &f.id, id_w, &who(&row.gpus), &f.summary);
            if sev == Severity::Pass {
                continue;
            }
            if row.gpus.len() > 1 {
                wrap_into(&mut o, &format!("GPUs: {}", row.gpus.join(", ")), 10, width, "");
            }
            if !f.detail.is_empty() {
                wrap_into(&mut o, &f.detail, 10, width, "");
            }
            if let Some(rem) = &f.remedy {
                wrap_into(&mut o, rem, 10, width, "→ ");
            }
            if matches!(sev, Severity::Fail | Severity::Warn) {
                // Whose move (docs/checks.md, "What to do and whose move it is").
                let whose = match f.owner {
                    crate::checks::route::Owner::Tenant => "the tenant's move (the guest's software or the VM spec)",
                    crate::checks::route::Owner::Platform => {
                        "the platform's move (hardware, host, fabric or allocation)"
                    }
                    crate::checks::route::Owner::None => "nobody's move",
                };
                wrap_into(&mut o, &format!("{whose}: {}", f.action.word()), 10, width, "⇒ ");
            }
        }
        for (summary, ids) in shared.iter().filter(|(_, ids)| ids.len() > 1) {
            let st = style(sev);
            let _ = writeln!(
                o,
                "{st}{:<7}{st:#}  {:<id_w$}  {:<12}  {summary}",
                sev.label(),
                format!("{} checks", ids.len()),
                ""
            );
            wrap_into(&mut o, &ids.join(", "), 10, width, "");
        }
    }
    // The GPU↔GPU matrices after the findings, so the pair a finding names is there to see.
    o.push_str(&super::matrix::terminal(r));
    footer(r, &mut o);
    o
}

fn header(r: &Report, title: &str, o: &mut String) {
    let h = &r.host;
    let mut parts: Vec<String> = Vec::new();
    parts.push(h.hostname.clone().unwrap_or_else(|| "(no hostname)".into()));
    if let Some(os) = &h.os {
        parts.push(os.clone());
    }
    if let Some(k) = &h.kernel {
        parts.push(format!("kernel {k}"));
    }
    parts.push(match h.virtualization.as_str() {
        "kubevirt" => "KubeVirt VM".into(),
        "vm" => "VM".into(),
        "bare-metal" => "bare metal".into(),
        _ => "virtualization unknown".into(),
    });
    parts.push(h.vsock_cid.map_or("no vsock".into(), |c| format!("vsock CID {c}")));
    let _ = writeln!(o, "{BOLD}{title}{BOLD:#}  {}", parts.join(" · "));
    let mut gpu_line: Vec<String> = Vec::new();
    let mut models: Vec<(String, usize)> = Vec::new();
    for g in &r.gpus {
        match models.iter_mut().find(|(m, _)| *m == g.model) {
            Some((_, n)) => *n += 1,
            None => models.push((g.model.clone(), 1)),
        }
    }
    gpu_line.push(if models.is_empty() {
        "no NVIDIA GPU".into()
    } else {
        models.iter().map(|(m, n)| format!("{n} × {m}")).collect::<Vec<_>>().join(", ")
    });
    if h.nvswitches > 0 {
        gpu_line.push(format!("{} NVSwitch", h.nvswitches));
    }
    gpu_line.push(match (&r.driver.version, r.driver.open_kernel_module) {
        (Some(v), Some(true)) => format!("driver {v} (open)"),
        (Some(v), _) => format!("driver {v}"),
        (None, _) => "no driver loaded".into(),
    });
    if !r.driver.cuda_toolkits.is_empty() {
        gpu_line.push(format!("CUDA {}", r.driver.cuda_toolkits.join(", ")));
    }
    let _ = writeln!(o, "{DIM}{}  ·  agent {}{DIM:#}", gpu_line.join(" · "), r.agent.agent_id);
    o.push('\n');
}

fn line(o: &mut String, sev: Severity, id: &str, id_w: usize, gpu: &str, summary: &str) {
    let s = style(sev);
    let _ = writeln!(o, "{s}{:<7}{s:#}  {id:<id_w$}  {gpu:<12}  {summary}", sev.label());
}

fn footer(r: &Report, o: &mut String) {
    let count = |sev: Severity| r.findings.iter().filter(|f| f.severity == sev).count();
    let (f, w, u, p) = (count(Severity::Fail), count(Severity::Warn), count(Severity::Unknown), count(Severity::Pass));
    let health = format!("{:?}", r.health).to_lowercase();
    let s = match r.health {
        super::Health::Unhealthy => style(Severity::Fail),
        super::Health::Degraded => style(Severity::Warn),
        super::Health::Unknown => style(Severity::Unknown),
        super::Health::Healthy => style(Severity::Pass),
    };
    let v = &r.verdict;
    if v.action != crate::checks::route::Action::None {
        let gpus = if v.gpus.is_empty() { String::new() } else { format!(" on {}", v.gpus.join(", ")) };
        let _ = writeln!(
            o,
            "\nverdict: {} ({}'s move) from {}{gpus}; backed by {}",
            v.action.word(),
            v.owner.word(),
            v.findings.join(", "),
            v.basis.join(" and ")
        );
        if !v.note.is_empty() {
            let _ = writeln!(o, "  {}", v.note);
        }
    }
    let _ = writeln!(
        o,
        "{}{s}{health}{s:#}: {f} failed, {w} warning(s), {u} unknown, {p} passed   (exit {})",
        if r.verdict.action == crate::checks::route::Action::None { "\n" } else { "" },
        super::exit_code(&r.findings)
    );
}

/// Word-wraps `text` at `width`, indented, the first line prefixed (`→ ` for remedies).
fn wrap_into(o: &mut String, text: &str, indent: usize, width: usize, prefix: &str) {
    let avail = width.saturating_sub(indent + prefix.chars().count()).max(30);
    let mut line = String::new();
    let mut first = true;
    let flush = |o: &mut String, line: &str, first: bool| {
        let pad = if first { prefix.to_string() } else { " ".repeat(prefix.chars().count()) };
        let _ = writeln!(o, "{}{pad}{line}", " ".repeat(indent));
    };
    for word in text.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > avail {
            flush(o, &line, first);
            first = false;
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        flush(o, &line, first);
    }
}

/// Width to wrap at: `COLUMNS` when set (shells export it to children only sometimes), else 100.
pub fn terminal_width() -> usize {
    std::env::var("COLUMNS").ok().and_then(|c| c.parse().ok()).filter(|w: &usize| *w >= 40).unwrap_or(100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_and_prefixes() {
        let mut o = String::new();
        wrap_into(&mut o, "one two three four five six seven eight nine ten eleven twelve", 2, 40, "→ ");
        let lines: Vec<&str> = o.lines().collect();
        assert!(lines.len() >= 2);
        assert!(lines[0].starts_with("  → one"));
        assert!(lines[1].starts_with("    "));
    }
}
