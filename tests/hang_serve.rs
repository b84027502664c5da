//! When the driver hangs, `serve` stays a good systemd citizen: the real binary over the Xid 79
//! guest, with the fake NVML's `nvmlInit_v2` blocked for 20 s, real HTTP on 127.0.0.1, a
//! private bus and sd_notify messages on a datagram socket. It is ready by its init deadline
//! with a report that says why it is unhealthy, keeps feeding the watchdog and serving, and
//! once NVML answers the next snapshot is complete again, without a restart.

mod common;

use common::*;
use serde_json::Value;
use std::os::unix::net::UnixDatagram;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const TOKEN: &str = "tok-9d2e4a1c0000400080000000";
/// `nvml.init_timeout` for the test, and how long the fake's `nvmlInit_v2` blocks (the
/// scenario's `until_ms`, counted from the first call).
const INIT_TIMEOUT: Duration = Duration::from_secs(3);
/// Shorter than the service's 30 s tick, so "at once" and "at the next tick" are 10 s apart;
/// longer than the init deadline many times over.
const BLOCKED_FOR: Duration = Duration::from_secs(20);

/// GET with the service's token: (status, body).
fn get(port: u16, path: &str) -> (u16, String) {
    get_with_token(port, path, TOKEN)
}

/// The value of the unlabelled series `name` in a metrics text.
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Every sd_notify message, read as it comes by a thread of its own: systemd always reads, and
/// a socket left full would block the service's next notification.
fn drain(notify: UnixDatagram) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = notify.recv(&mut buf) {
            if tx.send(String::from_utf8_lossy(&buf[..n]).into_owned()).is_err() {
                return;
            }
        }
    });
    rx
}

#[test]
fn serve_is_ready_by_the_init_deadline_says_why_and_resumes_when_nvml_answers() {
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let cfg = service_config(dir.path(), TOKEN, &format!("[nvml]\ninit_timeout = \"{}s\"\n", INIT_TIMEOUT.as_secs()));
    let notify_path = dir.path().join("notify");
    let notify = drain(UnixDatagram::bind(&notify_path).unwrap());
    let root = repo().join("tests/fixtures/sysroots/hgx-8gpu-xid79");
    let scenario = repo().join("examples/scenarios/hgx-8gpu-xid79-init-hangs.json");
    let _ = fake_nvml(); // built before the clock starts
    let started = Instant::now();
    let mut child = serve_command_on(&root, &cfg, &scenario, &bus)
        .env("NOTIFY_SOCKET", &notify_path)
        // Watchdog pings every second: they must keep coming while NVML is blocked.
        .env("WATCHDOG_USEC", "2000000")
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let port = listening_port(&mut child).expect("serve listens");
    let _child = Killed(child);

    // READY=1 by the init deadline, with a STATUS= line that says why.
    let ready = loop {
        let msg = notify.recv_timeout(Duration::from_secs(20)).expect("READY=1 within 20 s");
        if msg.contains("READY=1") {
            break msg;
        }
    };
    let ready_after = started.elapsed();
    eprintln!("READY=1 after {ready_after:?} (init deadline {INIT_TIMEOUT:?}): {ready}");
    assert!(ready_after <= INIT_TIMEOUT + Duration::from_secs(1), "READY=1 after {ready_after:?}");
    assert!(ready.contains("STATUS=NVML has not answered for 3 s (nvmlInit_v2); "), "{ready}");

    // /healthz: 503 with the reason, not "starting".
    let (code, body) = get(port, "/healthz");
    assert_eq!(code, 503);
    assert!(body.starts_with("unhealthy: NVML has not answered for "), "{body}");
    assert!(body.contains("(nvmlInit_v2)"), "{body}");
    // /metrics answers, says NVML is not answering, and shows no GPU figure as fresh.
    let (code, metrics) = get(port, "/metrics");
    assert_eq!(code, 200);
    assert_eq!(sample(&metrics, "phq_nvml_responsive"), Some(0.0), "{metrics}");
    assert!(metrics.contains(r#"phq_nvml_blocked_seconds{call="nvmlInit_v2",gpu=""}"#), "{metrics}");
    assert!(!metrics.contains("phq_gpu_temperature_celsius{"), "no stale GPU figures");
    // /v1/status and D-Bus GetReport answer, with the finding.
    let (_, status) = get(port, "/v1/status");
    let report: Value = serde_json::from_str(&status).unwrap();
    validate(&report);
    assert_eq!(findings(&report, "nvml.responsive")[0]["severity"], "fail");
    let xid = findings(&report, "gpu.xid");
    assert!(xid.iter().any(|f| f["severity"] == "fail"), "the kernel log's Xid 79 is reported meanwhile: {xid:#?}");
    let conn = zbus::blocking::connection::Builder::address(bus.address.as_str()).unwrap().build().unwrap();
    let proxy =
        zbus::blocking::Proxy::new(&conn, "ch.phoeniqs.Agent1", "/ch/phoeniqs/Agent1", "ch.phoeniqs.Agent1").unwrap();
    let over_bus: Value = serde_json::from_str(&proxy.call::<_, _, String>("GetReport", &()).unwrap()).unwrap();
    assert_eq!(findings(&over_bus, "nvml.responsive")[0]["severity"], "fail");

    // The watchdog is fed by the service's own loops while NVML stays blocked.
    let mut pings = 0;
    let watch_until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < watch_until {
        if notify.recv_timeout(Duration::from_millis(200)).is_ok_and(|m| m.contains("WATCHDOG=1")) {
            pings += 1;
        }
    }
    assert!(pings >= 2, "{pings} watchdog ping(s) in 4 s while NVML was blocked");

    // Once nvmlInit_v2 returns, the next snapshot is complete again (taken at once: the
    // worker's answer asks for it, rather than the next 30 s tick).
    let resumed = loop {
        let (_, m) = get(port, "/metrics");
        if sample(&m, "phq_nvml_responsive") == Some(1.0) {
            break started.elapsed();
        }
        assert!(started.elapsed() < BLOCKED_FOR + Duration::from_secs(30), "NVML answered, the service did not resume");
        std::thread::sleep(Duration::from_millis(500));
    };
    eprintln!("complete again {resumed:?} after start (nvmlInit_v2 blocked {BLOCKED_FOR:?})");
    assert!(resumed >= BLOCKED_FOR - Duration::from_secs(1), "{resumed:?}");
    // The ticks fall about 3 s after each half minute (the first snapshot takes the init
    // deadline): a resumption left to the next tick would come after 33 s.
    assert!(
        resumed <= BLOCKED_FOR + Duration::from_millis(2500),
        "a snapshot at once, not at the next tick: {resumed:?}"
    );
    let (_, status) = get(port, "/v1/status");
    let report: Value = serde_json::from_str(&status).unwrap();
    validate(&report);
    assert_eq!(findings(&report, "nvml.responsive")[0]["severity"], "pass");
    assert_eq!(findings(&report, "nvml.init")[0]["severity"], "pass");
    let gpus = report["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8);
    assert!(gpus.iter().all(|g| g["uuid"].is_string()), "every GPU read through NVML again");
    assert!(get(port, "/metrics").1.contains("phq_gpu_temperature_celsius{"));
    let statuses: Vec<String> = notify.try_iter().filter(|m| m.contains("STATUS=")).collect();
    let last = statuses.last().expect("a STATUS= line after the complete snapshot");
    assert!(!last.contains("NVML has not answered"), "{last}");
    assert_eq!(get(port, "/healthz").0, 503, "still unhealthy: the guest's GPU fell off the bus (Xid 79)");
    assert!(!get(port, "/healthz").1.contains("NVML has not answered"));
}
