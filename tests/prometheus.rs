//! The agent's metrics as a real Prometheus sees them: Debian's `prometheus` scrapes the real
//! service every second (with the bearer token, negotiating its formats and gzip as it does),
//! and the dashboard's own queries are asked of it.

mod common;

use common::*;
use serde_json::Value;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "tok-prometheus-0123456789abcdef";

/// Waits until the Prometheus on `port` says it is ready (`/-/ready` answers 200). It listens
/// before its storage is open and answers 503 until then — longer on a loaded machine.
fn wait_ready(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = std::net::TcpStream::connect(("127.0.0.1", port)).ok().and_then(|mut s| {
            s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
            write!(s, "GET /-/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
            let mut r = String::new();
            s.read_to_string(&mut r).ok()?;
            Some(r.starts_with("HTTP/1.1 200"))
        });
        if ready == Some(true) {
            return;
        }
        assert!(Instant::now() < deadline, "Prometheus was not ready within 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A PromQL instant query against the Prometheus on `port`: the result vector.
fn query(port: u16, promql: &str) -> Vec<Value> {
    let encoded: String = promql
        .bytes()
        .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /api/v1/query?query={encoded} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    let body: Value = serde_json::from_str(r.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("")).unwrap_or_default();
    assert_eq!(body["status"], "success", "{promql}: {r}");
    body["data"]["result"].as_array().cloned().unwrap_or_default()
}

/// The dashboard's Xid panel finds an Xid that happens while Prometheus watches: the per-GPU
/// total is 0 from the first scrape, so `increase()` sees the first Xid. The per-code series,
/// born at that Xid's count, cannot show it that way (checked too, so the difference is seen).
#[test]
fn the_dashboards_xid_panel_sees_the_first_xid_on_a_real_prometheus() {
    if !needs(&[("prometheus", "prometheus")]) {
        return;
    }
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut s: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("examples/scenarios/hgx-8gpu-healthy.json")).unwrap(),
    )
    .unwrap();
    // One Xid 79 on GPU 0000:0c:00.0, 20 s after the agent starts: scrapes before it (checked
    // below, so a slow Prometheus start is a clear failure, not a silent miss).
    s["devices"][3]["xid_events"] = serde_json::json!([{"xid": 79, "after_ms": 20000}]);
    let scenario = dir.path().join("xid-later.json");
    std::fs::write(&scenario, serde_json::to_vec(&s).unwrap()).unwrap();
    let cfg = service_config(dir.path(), TOKEN, "[probes]\nat_boot = \"none\"\n");
    let token = dir.path().join("token");
    let mut agent = Killed(serve_command(&cfg, &scenario, &bus).spawn().unwrap());
    let agent_port = listening_port(&mut agent.0).expect("the agent listens");

    let prom_cfg = dir.path().join("prometheus.yml");
    std::fs::write(
        &prom_cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: phq-agent\n    authorization:\n      credentials_file: {}\n    static_configs:\n      - targets: ['127.0.0.1:{agent_port}']\n",
            token.display()
        ),
    )
    .unwrap();
    let mut prom = Killed(
        Command::new("prometheus")
            .arg(format!("--config.file={}", prom_cfg.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()))
            .arg("--web.listen-address=127.0.0.1:0")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus"),
    );
    let prom_port = listening_port(&mut prom.0).expect("prometheus listens");
    wait_ready(prom_port);

    // The dashboard's query, as Grafana would send it for all instances.
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("dashboards/phq-agent.json")).unwrap()).unwrap();
    let panel_query = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_string))
        .find(|e| e.starts_with("increase(") && e.contains("xid"))
        .expect("the dashboard has an Xid increase panel")
        .replace("$instance", ".*");

    // Prometheus has the per-GPU totals at 0 before the Xid arrives.
    let deadline = Instant::now() + Duration::from_secs(15);
    while query(prom_port, "phq_gpu_xids_total == 0").len() < 8 {
        assert!(Instant::now() < deadline, "Prometheus scraped no zero-valued Xid totals within 15 s of starting");
        std::thread::sleep(Duration::from_millis(200));
    }
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut found = vec![];
    while Instant::now() < deadline {
        found = query(prom_port, &panel_query);
        if !found.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(found.len(), 1, "{panel_query}: {found:?}");
    assert_eq!(found[0]["metric"]["gpu"], "0000:0c:00.0");
    let scrapes = query(prom_port, "count_over_time(up{job=\"phq-agent\"}[1m])");
    eprintln!("{panel_query} → {found:?} after {:?} scrapes", scrapes.first().map(|s| &s["value"][1]));
    // The per-code series was born at 1: increase() over it sees nothing.
    let born_at_one = query(prom_port, "increase(phq_gpu_xid_errors_total[1h]) > 0");
    assert!(born_at_one.is_empty(), "{born_at_one:?}");
    assert_eq!(query(prom_port, "phq_gpu_xid_errors_total{xid=\"79\"}").len(), 1);

    // docs/metrics.md's join: every GPU's temperature with its model and NVML index.
    let joined =
        query(prom_port, "phq_gpu_temperature_celsius * on (instance, gpu) group_left (model, index) phq_gpu_info");
    assert_eq!(joined.len(), 8, "{joined:?}");
    assert!(joined.iter().all(|s| s["metric"]["model"].is_string() && s["metric"]["index"].is_string()));
}

/// Both dashboards, panel by panel, on a real Prometheus (scripts/check-dashboards): every panel
/// has data, NVIDIA's Tensor Core panel too (its profiling field comes from NVML's GPM).
#[test]
fn every_panel_of_both_dashboards_has_data() {
    if !needs(&[("prometheus", "prometheus"), ("python3", "python3")]) {
        return;
    }
    let out = Command::new(repo().join("scripts/check-dashboards"))
        .env("PHQ_AGENT_BIN", env!("CARGO_BIN_EXE_phq-agent"))
        .env("PHQ_FAKE_NVML_LIB", fake_nvml())
        .output()
        .expect("run scripts/check-dashboards");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "a panel has no data");
    assert!(text.contains("0 expected empty, 0 unexpectedly empty"), "{text}");
    let tensor = text.lines().find(|l| l.contains("Tensor Core Utilization")).unwrap_or_default();
    assert!(tensor.trim_start().starts_with("data"), "{tensor}");
    assert!(text.lines().filter(|l| l.trim_start().starts_with("data ")).count() >= 24, "{text}");
}
