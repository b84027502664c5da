//! The platform's re-check, `POST /v1/probes`, on the real service: the real binary, real HTTP
//! on 127.0.0.1, the fake NVML and the fake CUDA driver running the shipped kernels. One quick
//! run on one H200 (about a minute on the 2-core machine): refused without credentials, then
//! accepted with a run id, refused while it runs and past the rate limit, and its result in
//! `/v1/status`, in `GET /v1/probes/{id}` and in the fault history, which it clears.

mod common;

use common::*;
use serde_json::Value;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

const TOKEN: &str = "tok-8d2e41a90000400080000000";
fn post(port: u16, path: &str, token: Option<&str>, body: &str) -> (u16, String, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    (status, head.to_string(), body.to_string())
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

#[test]
fn the_platform_starts_a_recheck_and_reads_its_result() {
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    // An Xid 79 from the driver in this boot's kernel log: a fault the history keeps until a
    // passing probe of that GPU clears it.
    let root = copy_sysroot("h200-single", dir.path());
    let mut kmsg = std::fs::OpenOptions::new().append(true).open(root.join("dev/kmsg")).unwrap();
    writeln!(kmsg, "4,9001,91004122212,-;NVRM: Xid (PCI:0000:09:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.").unwrap();
    drop(kmsg);
    let cfg = service_config(dir.path(), TOKEN, "[probes]\nat_boot = \"none\"\nmax_requests = 1\n");
    let mut child = serve_command_on(&root, &cfg, &repo().join("examples/scenarios/h200-vm.json"), &bus)
        .arg("--cuda-lib")
        .arg(fake_cuda())
        .env("PHQ_FAKE_CUDA_SCENARIO", repo().join("examples/scenarios/cuda-h200.json"))
        .spawn()
        .unwrap();
    let port = listening_port(&mut child).expect("serve listens");
    let _child = Killed(child);
    let started = Instant::now();
    let report = loop {
        let (code, body) = get_with_token(port, "/v1/status", TOKEN);
        if code == 200 {
            break json(&body);
        }
        assert!(started.elapsed() < Duration::from_secs(60), "no first snapshot: {code} {body}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(findings(&report, "gpu.xid")[0]["severity"], "fail", "{report:#}");
    assert!(report["probes"].is_null() && report.get("probe_run").is_none(), "no probe ran yet");

    // Never unauthenticated, and a body that is not a probe request is said so.
    let (code, head, _) = post(port, "/v1/probes", None, "");
    assert_eq!(code, 401, "{head}");
    assert_eq!(post(port, "/v1/probes", Some("wrong"), "").0, 401);
    // The read token reads; it starts nothing (issue 51: one token did both jobs).
    let (code, _, body) = post(port, "/v1/probes", Some(TOKEN), r#"{"level": "quick"}"#);
    assert!(code == 403 && body.contains("control token"), "{code} {body}");
    let (code, _, body) = post(port, "/v1/probes", Some(&control_token_of(TOKEN)), r#"{"level": "none"}"#);
    assert_eq!(code, 400, "{body}");
    let (code, _, body) = post(port, "/v1/probes", Some(&control_token_of(TOKEN)), r#"{"levle": "quick"}"#);
    assert!(code == 400 && body.contains("unknown field"), "{code} {body}");
    assert_eq!(post(port, "/v1/probes", Some(&control_token_of(TOKEN)), &" ".repeat(4096)).0, 413, "a body past 1 KiB");

    // Accepted: 202, the run's id, where to read it.
    let (code, head, body) = post(port, "/v1/probes", Some(&control_token_of(TOKEN)), r#"{"level": "quick"}"#);
    assert_eq!(code, 202, "{head}\n{body}");
    let run = json(&body);
    let id = run["id"].as_str().unwrap().to_string();
    assert_eq!((run["source"].as_str(), run["level"].as_str()), (Some("request"), Some("quick")));
    assert!(head.to_ascii_lowercase().contains(&format!("location: /v1/probes/{id}")), "{head}");

    // One run at a time: a second request names the run going on.
    let (code, _, body) = post(port, "/v1/probes", Some(&control_token_of(TOKEN)), "");
    assert_eq!(code, 409, "{body}");
    assert_eq!(json(&body)["run"]["id"], id.as_str());
    let (code, body) = get_with_token(port, &format!("/v1/probes/{id}"), TOKEN);
    assert_eq!(code, 200);
    assert!(["queued", "running"].contains(&json(&body)["state"].as_str().unwrap()), "{body}");
    assert_eq!(get_with_token(port, "/v1/probes/0123456789abcdef", TOKEN).0, 404);

    // The result lands in /v1/status, named by the run's id.
    let report = loop {
        let (_, body) = get_with_token(port, "/v1/status", TOKEN);
        let report = json(&body);
        if report["probe_run"]["id"] == id.as_str() {
            break report;
        }
        assert!(started.elapsed() < Duration::from_secs(400), "the re-check's result never reached /v1/status");
        std::thread::sleep(Duration::from_millis(500));
    };
    eprintln!("re-check done {:?} after the start", started.elapsed());
    validate(&report);
    assert_eq!(report["probe_run"]["state"], "done", "{:#}", report["probe_run"]);
    assert!(report["probes"].is_object());
    assert_eq!(findings(&report, "probe.gemm")[0]["severity"], "pass");
    let (_, body) = get_with_token(port, &format!("/v1/probes/{id}"), TOKEN);
    let record = json(&body);
    assert_eq!((record["state"].as_str(), record["failed"].as_u64()), (Some("done"), Some(0)), "{record:#}");

    // The passing run cleared the Xid 79 in the history, and says which run did.
    let history: Value = json(&std::fs::read_to_string(dir.path().join("state/history.json")).unwrap());
    let fault = history["faults"].as_array().unwrap().iter().find(|f| f["code"] == "79").expect("the fault is kept");
    assert_eq!(fault["cleared"]["by_probe_run"], id.as_str(), "{fault:#}");
    // Who asked is named in the run's record, the report and the history (issue 50).
    assert_eq!(report["probe_run"]["asked_by"], serde_json::json!({"who": "tenant"}), "{:#}", report["probe_run"]);
    assert_eq!(record["asked_by"], serde_json::json!({"who": "tenant"}));
    assert_eq!(fault["cleared"]["asked_by"], serde_json::json!({"who": "tenant"}), "{fault:#}");

    // probes.max_requests = 1 per hour: the next is refused with when to come back.
    let (code, head, body) = post(port, "/v1/probes", Some(&control_token_of(TOKEN)), "");
    assert_eq!(code, 429, "{body}");
    let retry: u64 = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("retry-after: ").map(str::to_string))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("Retry-After: {head}"));
    assert!(retry > 3000 && retry <= 3600, "{retry}");
}

/// Issue 51 hole 3: the boot run checks that every GPU is idle, as every other run the service
/// starts does. Here the H200 is busy by NVML's utilisation (80 %) with no process listed, so
/// nothing keeps a probe off it but that check: the boot run waits, makes no CUDA context, and
/// no probe result appears while the GPU stays busy.
#[test]
fn the_boot_run_waits_for_idle_gpus() {
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let root = copy_sysroot("h200-single", dir.path());
    let mut sc: Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("examples/scenarios/h200-vm.json")).unwrap())
            .unwrap();
    sc["devices"][0]["utilization"] = serde_json::json!({"gpu": 80, "memory": 40});
    let scenario = dir.path().join("busy.json");
    std::fs::write(&scenario, serde_json::to_vec(&sc).unwrap()).unwrap();
    let contexts = dir.path().join("contexts");
    let cfg = service_config(dir.path(), TOKEN, "[probes]\nat_boot = \"quick\"\n");
    let mut child = serve_command_on(&root, &cfg, &scenario, &bus)
        .arg("--cuda-lib")
        .arg(fake_cuda())
        .env("PHQ_FAKE_CUDA_SCENARIO", repo().join("examples/scenarios/cuda-h200.json"))
        .env("PHQ_FAKE_CUDA_CONTEXTS", &contexts)
        .spawn()
        .unwrap();
    let port = listening_port(&mut child).expect("serve listens");
    let _child = Killed(child);
    let started = Instant::now();
    while get_with_token(port, "/v1/status", TOKEN).0 != 200 {
        assert!(started.elapsed() < Duration::from_secs(60), "no first snapshot");
        std::thread::sleep(Duration::from_millis(200));
    }
    // A boot run starts at once after the first snapshot; give it time to make its context.
    std::thread::sleep(Duration::from_secs(5));
    let report = json(&get_with_token(port, "/v1/status", TOKEN).1);
    assert!(
        report.get("probe_run").is_none() && report["probes"].is_null(),
        "a boot run started on a busy GPU: {report:#}"
    );
    assert!(!contexts.exists(), "a CUDA context was made on the busy GPU: {:?}", std::fs::read_to_string(&contexts));
}
