//! The poller's /metrics page (Prometheus text format 0.0.4), rendered at each scrape from the
//! targets' state. Identity labels (`node`, `namespace`, `vmi`, `vmi_uid`) and `source` come from
//! the target; only `guest::Said`'s checked values come from a guest.

use crate::guest::FAMILIES;
use crate::poll::Failure;
use crate::state::{Source, TargetState};
use crate::targets::Target;
use std::fmt::Write;
use std::time::Instant;

pub fn render(targets: &[(&Target, &TargetState)], now: Instant, stale_after: std::time::Duration) -> String {
    let mut out = String::with_capacity(1024 + targets.len() * 4096);
    family(&mut out, "phq_platform_build_info", "gauge", "The poller's version.");
    let _ = writeln!(out, "phq_platform_build_info{{version=\"{}\"}} 1", env!("CARGO_PKG_VERSION"));
    family(&mut out, "phq_platform_targets", "gauge", "The VMs this poller owns.");
    let _ = writeln!(out, "phq_platform_targets {}", targets.len());

    let own = |out: &mut String, name: &str, kind: &str, help: &str, f: &dyn Fn(&mut String, &str, &TargetState)| {
        family(out, name, kind, help);
        for (t, s) in targets {
            let id = identity(t, s.source, true);
            f(out, &id, s);
        }
    };
    own(
        &mut out,
        "phq_poll_success",
        "gauge",
        "1 when the last poll of the VM's agent got a report, 0 when it did not.",
        &|o, id, s| {
            let _ = writeln!(o, "phq_poll_success{{{id}}} {}", u8::from(s.last_ok == Some(true)));
        },
    );
    own(
        &mut out,
        "phq_poll_duration_seconds",
        "gauge",
        "How long the last poll took, from its slot to its end.",
        &|o, id, s| {
            if let Some(d) = s.last_duration {
                let _ = writeln!(o, "phq_poll_duration_seconds{{{id}}} {:.6}", d.as_secs_f64());
            }
        },
    );
    own(
        &mut out,
        "phq_poll_age_seconds",
        "gauge",
        "Seconds since the last successful poll (since the VM became a target, if none).",
        &|o, id, s| {
            let since = s.last_success.unwrap_or(s.first_seen);
            let _ = writeln!(o, "phq_poll_age_seconds{{{id}}} {:.3}", now.duration_since(since).as_secs_f64());
        },
    );
    own(
        &mut out,
        "phq_poll_failures_total",
        "counter",
        "Failed polls by reason, since the VM became a target.",
        &|o, id, s| {
            for reason in Failure::REASONS {
                let _ = writeln!(
                    o,
                    "phq_poll_failures_total{{{id},reason=\"{reason}\"}} {}",
                    s.failures.get(reason).copied().unwrap_or(0)
                );
            }
        },
    );
    own(
        &mut out,
        "phq_poll_probe_requests_total",
        "counter",
        "POST /v1/probes sent to a validation VM's agent, by its answer's status (never to a tenant's VM).",
        &|o, id, s| {
            for (status, n) in &s.probe_requests {
                let _ = writeln!(o, "phq_poll_probe_requests_total{{{id},code=\"{status}\"}} {n}");
            }
        },
    );
    own(&mut out, "phq_guest_series_dropped", "gauge", "The guest's series the last poll left out: beyond poll.max_series_per_vmi (cap), or with a value the agent cannot write (invalid).", &|o, id, s| {
        let _ = writeln!(o, "phq_guest_series_dropped{{{id},reason=\"cap\"}} {}", s.said.dropped_cap);
        let _ = writeln!(o, "phq_guest_series_dropped{{{id},reason=\"invalid\"}} {}", s.said.dropped_invalid);
    });
    for &(name, kind, help) in FAMILIES {
        family(&mut out, name, kind, help);
        for (t, s) in targets {
            // What a guest said stays served while it is fresh; a guest that stops answering
            // loses its claims after `stale_after`, and phq_poll_age_seconds says so.
            if s.last_success.is_none_or(|at| now.duration_since(at) > stale_after) {
                continue;
            }
            let id = identity(t, s.source, false);
            for x in s.said.series.iter().filter(|x| x.family == name) {
                let _ = write!(out, "{name}{{{id}");
                for (k, v) in &x.labels {
                    let _ = write!(out, ",{k}=\"");
                    escape(&mut out, v);
                    out.push('"');
                }
                let _ = writeln!(out, "}} {}", x.value);
            }
        }
    }
    out
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn identity(t: &Target, source: Source, with_transport: bool) -> String {
    let mut s = String::with_capacity(160);
    for (k, v) in [("node", &t.node), ("namespace", &t.namespace), ("vmi", &t.vmi), ("vmi_uid", &t.vmi_uid)] {
        if !s.is_empty() {
            s.push(',');
        }
        let _ = write!(s, "{k}=\"");
        escape(&mut s, v);
        s.push('"');
    }
    let _ = write!(s, ",source=\"{}\"", source.word());
    if with_transport {
        let _ = write!(s, ",transport=\"{}\"", t.transport.word());
    }
    s
}

/// The text format's label-value escapes: backslash, double quote, line feed.
fn escape(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}
