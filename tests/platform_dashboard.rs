//! The platform's fleet dashboard (dashboards/phq-platform-fleet.json) against what it would show:
//! two real agents on the fake NVML with an Xid 79 — a tenant's VM and the platform's validation
//! VM — the poller, and a real Prometheus (Debian's) scraping it. Every panel's query is asked of
//! that Prometheus as Grafana would ask it, and each returns series, except the panels this
//! scenario leaves empty on purpose (`EXPECTED_EMPTY`), which must then be empty.

mod common;

use common::*;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Panels with nothing to show here, by title, and why: both agents answer every poll.
const EXPECTED_EMPTY: &[(&str, &str)] = &[
    ("Agents not answering", "both agents answer every poll: phq_poll_success is 1 for each"),
    ("Unreachable agents", "nothing is unreachable: both agents answer, no phq_poll_age_seconds reaches 900"),
];

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A real agent serving `scenario` on a port of its own: (process, port).
fn agent(dir: &Path, token: &str, scenario: &str, bus: &PrivateBus) -> (Killed, u16) {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = service_config(dir, token, "[probes]\nat_boot = \"none\"\n");
    let mut child = serve_command(&cfg, &repo().join("examples/scenarios").join(scenario), bus).spawn().unwrap();
    let port = listening_port(&mut child).expect("the agent listens");
    (Killed(child), port)
}

fn target(port: u16, namespace: &str, vmi: &str, uid: &str) -> String {
    format!(
        r#"{{"targets":["127.0.0.1:{port}"],"labels":{{"namespace":"{namespace}","vmi":"{vmi}","vmi_uid":"{uid}","transport":"http"}}}}"#
    )
}

/// A started process with its log, to spawn and wait for its port.
fn spawn(cmd: &mut Command, log: &Path, what: &str) -> (Killed, u16) {
    let mut child = Killed(cmd.stdout(Stdio::null()).stderr(std::fs::File::create(log).unwrap()).spawn().expect(what));
    let port = listening_port(&mut child.0)
        .unwrap_or_else(|| panic!("{what} exited: {}", std::fs::read_to_string(log).unwrap_or_default()));
    (child, port)
}

/// GET `path` from 127.0.0.1:`port` as JSON (null when it does not answer yet).
fn get_json(port: u16, path: &str) -> Value {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else { return Value::Null };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut r = String::new();
    let _ = s.read_to_string(&mut r);
    serde_json::from_str(r.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("")).unwrap_or_default()
}

/// Prometheus's answer to an instant query: its series, or what it said instead.
type Answer = Result<Vec<Value>, String>;

fn query(port: u16, expr: &str) -> Answer {
    let q = url::form_urlencoded::Serializer::new(String::new()).append_pair("query", expr).finish();
    let body = get_json(port, &format!("/api/v1/query?{q}"));
    match body["status"].as_str() {
        Some("success") => Ok(body["data"]["result"].as_array().cloned().unwrap_or_default()),
        _ => Err(format!("{expr}: {body}")),
    }
}

/// `expr` as Grafana sends it with every variable at "All" (the dashboard's `allValue`, `.*`).
fn substituted(expr: &str) -> String {
    let mut e = expr.to_string();
    for (var, value) in [
        ("${node}", ".*"),
        ("$node", ".*"),
        ("${namespace}", ".*"),
        ("$namespace", ".*"),
        ("$__rate_interval", "1m"),
        ("$__interval", "15s"),
        ("$__range", "1h"),
    ] {
        e = e.replace(var, value);
    }
    assert!(!e.contains('$'), "a variable this test does not know: {expr}");
    e
}

/// The metric names an expression reads.
fn names(expr: &str) -> Vec<&str> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| w.starts_with("phq_")).collect()
}

#[test]
fn every_fleet_panel_has_data_in_prometheus() {
    if !needs(&[("prometheus", "prometheus")]) {
        return;
    }
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dash: Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("dashboards/phq-platform-fleet.json")).unwrap())
            .unwrap();
    let panels = dash["panels"].as_array().unwrap();
    for (title, _) in EXPECTED_EMPTY {
        assert!(panels.iter().any(|p| p["title"] == *title), "EXPECTED_EMPTY names no panel titled {title:?}");
    }
    // Only the poller's series: the platform's Prometheus has no agent to scrape.
    for p in panels {
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            for n in names(expr) {
                assert!(
                    n.starts_with("phq_guest_") || n.starts_with("phq_poll_"),
                    "{}: {n} is not the poller's",
                    p["title"].as_str().unwrap()
                );
            }
        }
    }

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let token = "tok-fleet-dashboard-0123456789";
    let (_a, tenant) = agent(&d.join("a"), token, "hgx-8gpu-xid79.json", &bus);
    let (_b, validation) = agent(&d.join("b"), token, "hgx-8gpu-xid79.json", &bus);
    let targets = d.join("targets.json");
    std::fs::write(
        &targets,
        format!(
            "[{},{}]",
            target(tenant, "team-b", "infer-3", "0b9d1c2e-0000-4000-8000-000000000002"),
            target(validation, "gpu-validation", "validate-node-1", "0b9d1c2e-0000-4000-8000-000000000003"),
        ),
    )
    .unwrap();
    let cfg = d.join("platform.toml");
    std::fs::write(
        &cfg,
        format!(
            "node = \"gpu-node-1\"\nlisten = \"127.0.0.1:0\"\ntargets_file = \"{}\"\nvalidation_namespaces = [\"gpu-validation\"]\n[poll]\ninterval = \"1s\"\njitter = \"200ms\"\ntimeout = \"1s\"\n[token]\nread_token_file = \"{}\"\n",
            targets.display(),
            d.join("a/token").display()
        ),
    )
    .unwrap();
    let (_p, port) =
        spawn(Command::new(platform_bin()).arg("--config").arg(&cfg), &d.join("platform.log"), "the poller");
    let prom_cfg = d.join("prometheus.yml");
    std::fs::write(
        &prom_cfg,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: phq-platform\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
        ),
    )
    .unwrap();
    let (_prom, prom) = spawn(
        Command::new("prometheus")
            .arg(format!("--config.file={}", prom_cfg.display()))
            .arg(format!("--storage.tsdb.path={}", d.join("tsdb").display()))
            .arg("--web.listen-address=127.0.0.1:0"),
        &d.join("prometheus.log"),
        "prometheus",
    );

    // Each panel's targets as Prometheus answers them, once every panel that should show data
    // does (rates and increases need two scrapes), or after 60 s.
    let expected_empty = |title: &str| EXPECTED_EMPTY.iter().find(|(t, _)| *t == title).map(|(_, why)| *why);
    let ask = || -> Vec<(String, Vec<Answer>)> {
        panels
            .iter()
            .map(|p| {
                let title = p["title"].as_str().unwrap().to_string();
                let answers = p["targets"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| query(prom, &substituted(t["expr"].as_str().unwrap())))
                    .collect();
                (title, answers)
            })
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let answers = loop {
        let answers = ask();
        let ready = answers.iter().all(|(title, a)| {
            expected_empty(title).is_some() || a.iter().all(|r| r.as_ref().is_ok_and(|s| !s.is_empty()))
        });
        if ready || Instant::now() > deadline {
            break answers;
        }
        std::thread::sleep(Duration::from_millis(500));
    };

    let mut wrong = vec![];
    for (title, a) in &answers {
        let n: usize = a.iter().map(|r| r.as_ref().map_or(0, Vec::len)).sum();
        for r in a {
            if let Err(e) = r {
                wrong.push(format!("{title}: Prometheus refused {e}"));
            }
        }
        match expected_empty(title) {
            Some(why) if n == 0 => println!("empty  {title}  (expected: {why})"),
            Some(why) => wrong.push(format!("{title}: {n} series, but expected empty: {why}")),
            None if a.iter().all(|r| r.as_ref().is_ok_and(|s| !s.is_empty())) => {
                println!("data   {title}  {n} series")
            }
            None => wrong.push(format!("{title}: a query returned no series: {a:?}")),
        }
    }
    // A table's columns are labels its series carry (or the value).
    for (p, (title, a)) in panels.iter().zip(&answers) {
        let columns = p["transformations"][0]["options"]["indexByName"].as_object().into_iter().flatten();
        for (column, _) in columns.filter(|(c, _)| *c != "Value") {
            for s in a.iter().flatten().flatten() {
                if s["metric"][column].is_null() {
                    wrong.push(format!("{title}: column {column} is no label of {}", s["metric"]));
                }
            }
        }
    }
    // Every name a panel reads is one Prometheus stored: an empty panel is empty for its
    // reason, not for a misspelt metric.
    let stored = get_json(prom, "/api/v1/label/__name__/values");
    let stored: Vec<&str> = stored["data"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    for p in panels {
        for t in p["targets"].as_array().unwrap() {
            for n in names(t["expr"].as_str().unwrap()) {
                if !stored.contains(&n) {
                    wrong.push(format!("{}: reads {n}, which the poller does not serve", p["title"].as_str().unwrap()));
                }
            }
        }
    }
    // The template variables' queries list values too.
    for v in dash["templating"]["list"].as_array().unwrap().iter().filter(|v| v["type"] == "query") {
        let q = v["query"].as_str().unwrap();
        let (selector, label) = q
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .and_then(|r| r.rsplit_once(", "))
            .unwrap_or_else(|| panic!("not label_values(selector, label): {q}"));
        match query(prom, &substituted(&format!("count by ({label}) ({selector})"))) {
            Ok(s) if !s.is_empty() => println!("data   ${}  {} values", v["name"].as_str().unwrap(), s.len()),
            other => wrong.push(format!("variable ${}: {q} lists nothing: {other:?}", v["name"].as_str().unwrap())),
        }
    }
    assert!(
        wrong.is_empty(),
        "{}\npoller log:\n{}",
        wrong.join("\n"),
        std::fs::read_to_string(d.join("platform.log")).unwrap_or_default()
    );
}
