//! A probe whose kernel never finishes, under the real service: the boot probe runs in a child
//! process (probe::child), which is killed at its deadline; the probe lock is free again, no
//! probe process is left, the GPU gets `probe.responsive` failing with the step that blocked,
//! and the service keeps answering over HTTP and D-Bus.

mod common;

use common::*;
use serde_json::Value;
use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

const TOKEN: &str = "tok-5b7e3c2a0000400080000000";

/// GET with the service's token: (status, body).
fn get(port: u16, path: &str) -> (u16, String) {
    get_with_token(port, path, TOKEN)
}

/// The pids of `pid`'s children (/proc/<pid>/task/*/children).
fn children(pid: u32) -> Vec<String> {
    let mut out = vec![];
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let text = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        out.extend(text.split_whitespace().map(str::to_string));
    }
    out
}

#[test]
fn a_probe_whose_kernel_never_finishes_ends_at_its_deadline_with_the_lock_free_and_the_service_alive() {
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let cfg = service_config(dir.path(), TOKEN, "[probes]\nat_boot = \"quick\"\ndeadline_margin = \"15s\"\n");
    let state = dir.path().join("state");
    let notify_path = dir.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let cuda = fake_cuda().to_path_buf();
    let mut child = serve_command_on(
        &repo().join("tests/fixtures/sysroots/h200-single"),
        &cfg,
        &repo().join("examples/scenarios/h200-vm.json"),
        &bus,
    )
    .arg("--cuda-lib")
    .arg(&cuda)
    .env("PHQ_FAKE_CUDA_SCENARIO", repo().join("examples/scenarios/cuda-h200-memtest-hangs.json"))
    .env("NOTIFY_SOCKET", &notify_path)
    .spawn()
    .unwrap();
    let port = listening_port(&mut child).expect("serve listens");
    let pid = child.id();
    let mut child = Killed(child);
    let mut buf = [0u8; 4096];
    loop {
        let n = notify.recv(&mut buf).expect("READY=1");
        if String::from_utf8_lossy(&buf[..n]).contains("READY=1") {
            break;
        }
    }
    let ready = Instant::now();

    // The boot probe starts at once and blocks in the memory test's first kernel.
    let finding = loop {
        let (_, body) = get(port, "/v1/status");
        let report: Value = serde_json::from_str(&body).unwrap();
        if let Some(f) = findings(&report, "probe.responsive").first() {
            validate(&report);
            break (*f).clone();
        }
        assert!(ready.elapsed() < Duration::from_secs(90), "no probe.responsive within 90 s");
        std::thread::sleep(Duration::from_millis(250));
    };
    let ended = ready.elapsed();
    let deadline = Duration::from_secs(finding["evidence"]["deadline_s"].as_u64().unwrap());
    eprintln!("probe ended {ended:?} after READY=1 (deadline {deadline:?}): {}", finding["summary"]);
    assert_eq!(finding["severity"], "fail");
    assert_eq!(finding["gpu"], "0000:09:00.0");
    assert!(finding["summary"].as_str().unwrap().contains("blocked at: GPU 0 (0000:09:00.0): memory integrity"));
    assert!(ended <= deadline + Duration::from_secs(5), "killed at its deadline, not later: {ended:?}");

    // The lock is free, and no probe process is left behind.
    let lock = std::fs::OpenOptions::new().read(true).open(state.join("probe.lock")).unwrap();
    lock.try_lock().expect("the probe lock is free");
    drop(lock);
    assert!(children(pid).is_empty(), "probe processes left: {:?}", children(pid));

    // The service is alive and answers.
    assert!(child.0.try_wait().unwrap().is_none(), "the service is still running");
    assert_eq!(get(port, "/healthz").0, 503, "unhealthy: its GPU's probe did not finish");
    let conn = zbus::blocking::connection::Builder::address(bus.address.as_str()).unwrap().build().unwrap();
    let proxy =
        zbus::blocking::Proxy::new(&conn, "ch.phoeniqs.Agent1", "/ch/phoeniqs/Agent1", "ch.phoeniqs.Agent1").unwrap();
    let over_bus: Value = serde_json::from_str(&proxy.call::<_, _, String>("GetReport", &()).unwrap()).unwrap();
    assert_eq!(findings(&over_bus, "probe.responsive")[0]["severity"], "fail");
}
