//! `phq-agent serve` as systemd runs it: the real binary, real HTTP on 127.0.0.1, sd_notify
//! messages on a datagram socket, signals. Hostile clients are plain TCP sockets.

mod common;

use common::*;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "tok-3f1c0b7e0000400080000000";

struct Agent {
    child: Child,
    port: u16,
    notify: UnixDatagram,
    _dir: tempfile::TempDir,
    bus: PrivateBus,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts serve over the healthy 8-GPU fixture, the fake NVML and a private bus, with a
/// private NOTIFY_SOCKET; `token_mode` is the token file's mode. It listens on a port the
/// kernel picks (`127.0.0.1:0`), read back from /proc. None: a skip (no dbus-daemon).
fn start(token_mode: u32, state_dir: Option<&Path>) -> Option<(Agent, std::path::PathBuf)> {
    start_on(&repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy"), token_mode, state_dir)
}

/// As `start`, over the sysroot `root`.
fn start_on(root: &Path, token_mode: u32, state_dir: Option<&Path>) -> Option<(Agent, std::path::PathBuf)> {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(token_mode)).unwrap();
    let state = state_dir.map(Path::to_path_buf).unwrap_or_else(|| dir.path().join("state"));
    let cfg = dir.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "[agent]\nstate_dir = \"{}\"\n[http]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n",
            state.display(),
            token.display()
        ),
    )
    .unwrap();
    let notify_path = dir.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let bus = PrivateBus::start(HEALTHY_UNITS)?;
    let mut child = serve_command_on(root, &cfg, &repo().join("examples/scenarios/hgx-8gpu-healthy.json"), &bus)
        .env("NOTIFY_SOCKET", &notify_path)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // 0 when it exited before listening (the test then reads why from its stderr).
    let port = listening_port(&mut child).unwrap_or(0);
    Some((Agent { child, port, notify, _dir: dir, bus }, cfg))
}

fn recv(notify: &UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    let n = notify.recv(&mut buf).expect("an sd_notify message");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn wait_ready(a: &Agent) -> String {
    let msg = recv(&a.notify);
    assert!(msg.contains("READY=1"), "{msg}");
    msg
}

/// A raw HTTP/1.1 GET; returns (status, headers+body).
fn get(port: u16, path: &str, extra: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // A server may close before it has read everything (oversize headers): then the status is 0.
    let _ = write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{extra}\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out)
}

fn body(resp: &str) -> &str {
    resp.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("")
}

fn auth() -> String {
    format!("Authorization: Bearer {TOKEN}\r\n")
}

#[test]
fn ready_after_the_first_snapshot_then_serves_with_credentials_only() {
    let Some((a, _)) = start(0o600, None) else { return };
    let ready = wait_ready(&a);
    assert!(ready.contains("STATUS=8 GPU(s)"), "a STATUS= line a person can read: {ready}");

    let (code, r) = get(a.port, "/healthz", "");
    assert_eq!(code, 200, "{r}");
    assert_eq!(body(&r), "degraded\n"); // healthy fixture, but the CUDA checks are unknown here

    for path in ["/v1/status", "/metrics"] {
        assert_eq!(get(a.port, path, "").0, 401, "{path} without a token");
        let (code, r) = get(a.port, path, "Authorization: Bearer wrong-token-of-some-length\r\n");
        assert_eq!(code, 401, "{path} with a wrong token");
        assert!(r.to_ascii_lowercase().contains("www-authenticate: bearer"));
    }
    // gzip when asked, rendered once per snapshot; OpenMetrics when Accept weighs it highest.
    let gz = {
        let mut c = TcpStream::connect(("127.0.0.1", a.port)).unwrap();
        write!(c, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{}Accept-Encoding: gzip\r\n\r\n", auth())
            .unwrap();
        let mut raw = Vec::new();
        c.read_to_end(&mut raw).unwrap();
        raw
    };
    let split = gz.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&gz[..split]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200") && head.contains("content-encoding: gzip"), "{head}");
    let mut text = String::new();
    flate2::read::GzDecoder::new(&gz[split + 4..]).read_to_string(&mut text).unwrap();
    assert!(text.contains("phq_gpu_temperature_celsius{"), "the gzipped body is the metrics");
    let (_, r) = get(
        a.port,
        "/metrics",
        &format!(
            "{}Accept: text/plain;version=0.0.4;q=0.3,application/openmetrics-text;version=1.0.0;q=0.5\r\n",
            auth()
        ),
    );
    assert!(r.contains("application/openmetrics-text") && r.contains("# UNIT phq_gpu_temperature_celsius celsius"));
    let (_, r) = get(a.port, "/metrics", &format!("{}Accept: application/openmetrics-text;q=0,text/plain\r\n", auth()));
    assert!(r.contains("text/plain; version=0.0.4") && !r.contains("# EOF"), "q=0 refuses OpenMetrics");
    // The scheme is case-insensitive (RFC 9110 §11.1).
    assert_eq!(get(a.port, "/metrics", &format!("Authorization: bearer {TOKEN}\r\n")).0, 200);
    let (code, r) = get(a.port, "/v1/status", &auth());
    assert_eq!(code, 200);
    let report: Value = serde_json::from_str(body(&r)).unwrap();
    validate(&report);
    assert_eq!(report["gpus"].as_array().unwrap().len(), 8);
    assert!(report["seq"].as_u64().unwrap() >= 1);
    // The service judges itself too: every catalogue id but the probes (none ran) is reported.
    for id in phq_agent::checks::CATALOG.iter().filter(|id| !id.starts_with("probe.")) {
        assert!(!findings(&report, id).is_empty(), "{id} missing from the service's report");
    }
    let auth_finding = findings(&report, "agent.endpoint-auth")[0];
    assert_eq!(auth_finding["severity"], "pass");
    assert_eq!(auth_finding["summary"], "bearer token required; loopback only");

    let (code, r) = get(a.port, "/metrics", &auth());
    assert_eq!(code, 200);
    assert!(r.contains("text/plain; version=0.0.4"));
    assert!(body(&r).contains("phq_gpu_temperature_celsius{"));
    assert!(!body(&r).contains("# EOF"));
    let (_, r) = get(a.port, "/metrics", &format!("{}Accept: application/openmetrics-text;version=1.0.0\r\n", auth()));
    assert!(r.contains("application/openmetrics-text; version=1.0.0"));
    assert!(body(&r).trim_end().ends_with("# EOF"));
    assert_eq!(get(a.port, "/nothing-here", &auth()).0, 404);
}

/// The Fabric Manager guide's two kinds of SXid, written to the kernel log of a running
/// service (the first line in two writes, and each report followed by the driver's lines of
/// detail): both reach /metrics, counted per NVSwitch and code from a total born at 0, and
/// fail and warn the right NVSwitch in /v1/status, as they arrive rather than at the next
/// 30-second snapshot.
#[test]
fn sxids_reach_metrics_and_status_as_the_driver_writes_them() {
    let dir = tempfile::tempdir().unwrap();
    let root = copy_sysroot("hgx-8gpu-healthy", dir.path());
    let Some((a, _)) = start_on(&root, 0o600, None) else { return };
    wait_ready(&a);
    let metrics = || body(&get(a.port, "/metrics", &auth()).1).to_string();
    let zero = r#"phq_nvswitch_sxids_total{nvswitch="0000:11:00.0"} 0"#;
    assert!(metrics().contains(zero), "every NVSwitch's total is there from the start");
    let started = Instant::now();
    let mut kmsg = std::fs::OpenOptions::new().append(true).open(root.join("dev/kmsg")).unwrap();
    write!(kmsg, "3,5001,9100000000,-;nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30").unwrap();
    kmsg.flush().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    writeln!(kmsg, " LTSSM Fault Up").unwrap();
    writeln!(kmsg, "3,5002,9100000100,-;nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Severity 1 Engine instance 30 Sub-engine instance 00").unwrap();
    writeln!(kmsg, "4,5003,9200000000,-;nvidia-nvswitch3: SXid (PCI:0000:14:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)").unwrap();
    writeln!(kmsg, "4,5004,9200000100,-;nvidia-nvswitch3: SXid (PCI:0000:14:00.0): 12028, Data {{0x00000000, 0x00000010, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000}}").unwrap();
    kmsg.flush().unwrap();
    let want = [
        r#"phq_nvswitch_sxids_total{nvswitch="0000:11:00.0"} 1"#,
        r#"phq_nvswitch_sxid_errors_total{nvswitch="0000:11:00.0",sxid="20034",severity="fatal"} 1"#,
        r#"phq_nvswitch_sxids_total{nvswitch="0000:14:00.0"} 1"#,
        r#"phq_nvswitch_sxid_errors_total{nvswitch="0000:14:00.0",sxid="12028",severity="non_fatal"} 1"#,
    ];
    let mut m = metrics();
    while !want.iter().all(|w| m.contains(w)) {
        assert!(
            started.elapsed() < Duration::from_secs(25),
            "not in /metrics: {:?}\n{m}",
            want.iter().filter(|w| !m.contains(*w)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(200));
        m = metrics();
    }
    // Sooner than the next scheduled snapshot: the first SXid of its kind asked for one.
    assert!(started.elapsed() < serve_interval(), "took {:?}", started.elapsed());
    let (_, r) = get(a.port, "/v1/status", &auth());
    let report: Value = serde_json::from_str(body(&r)).unwrap();
    validate(&report);
    let sxid =
        |dev: &str| findings(&report, "fabric.sxid").into_iter().find(|f| f["gpu"] == dev).unwrap()["severity"].clone();
    assert_eq!(
        (sxid("0000:11:00.0"), sxid("0000:14:00.0"), sxid("0000:12:00.0")),
        ("fail".into(), "warn".into(), "pass".into())
    );
    the_parts_asked_for_are_cut_from_the_whole(a.port);
}

/// `?findings=not-passed` and `?name[]=` (src/serve/subset.rs) on an agent with findings that did
/// not pass: each part is the whole with the rest left out, from the same snapshot, and a query
/// the agent cannot read is refused with what was wrong.
fn the_parts_asked_for_are_cut_from_the_whole(port: u16) {
    let names = ["phq_gpu_up", "phq_nvswitch_sxids_total"];
    let metrics_path = format!("/metrics?name%5B%5D={}&name[]={}", names[0], names[1]);
    // The whole and the part of one snapshot: the whole read before and after the part is the same.
    let (whole, part, whole_metrics, part_metrics) = (0..5)
        .find_map(|_| {
            let before = (get(port, "/v1/status", &auth()).1, get(port, "/metrics", &auth()).1);
            let part = (get(port, "/v1/status?findings=not-passed", &auth()).1, get(port, &metrics_path, &auth()).1);
            let after = (get(port, "/v1/status", &auth()).1, get(port, "/metrics", &auth()).1);
            (body(&before.0) == body(&after.0))
                .then(|| (body(&before.0).to_string(), body(&part.0).to_string(), body(&before.1).to_string(), part.1))
        })
        .expect("five tries without two reads of one snapshot");
    let mut expected: Value = serde_json::from_str(&whole).unwrap();
    let all = expected["findings"].as_array().unwrap().len();
    expected["findings"].as_array_mut().unwrap().retain(|f| f["severity"] != "pass");
    let part: Value = serde_json::from_str(&part).unwrap();
    validate(&part);
    assert_eq!(part, expected, "the not-passed report is not the whole without its passes");
    let kept = part["findings"].as_array().unwrap().len();
    assert!(kept >= 2 && kept < all / 4, "{kept} of {all} findings kept");
    let (w, p) = (whole.len(), serde_json::to_string(&part).unwrap().len());
    assert!(w > 3 * p, "the part is not much smaller: {p} bytes of {w}");

    assert!(!part_metrics.to_ascii_lowercase().contains("content-encoding"), "a part is sent as it is");
    let part_metrics = body(&part_metrics);
    let sample_of = |l: &str| !l.starts_with('#') && names.iter().any(|n| l.starts_with(&format!("{n}{{")));
    let want: Vec<&str> = whole_metrics.lines().filter(|l| sample_of(l)).collect();
    let got: Vec<&str> = part_metrics.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(got, want, "the part's samples are not those of the names asked");
    assert_eq!(want.len(), 8 + 4, "8 GPUs, 4 NVSwitches");
    for n in names {
        assert!(part_metrics.contains(&format!("# TYPE {n} ")), "{n}'s TYPE line is missing:\n{part_metrics}");
    }
    assert_eq!(part_metrics.lines().filter(|l| l.starts_with('#')).count(), 4, "{part_metrics}");

    for (path, says) in [
        ("/v1/status?findings=failing", "findings=\"failing\": ask for all or not-passed"),
        ("/metrics?name[]=1abc", "name[]=\"1abc\": not a metric name"),
    ] {
        let (code, r) = get(port, path, &auth());
        assert_eq!((code, body(&r)), (400, format!("{says}\n").as_str()), "{path}");
    }
    // Credentials first: a query does not let anyone past them.
    assert_eq!(get(port, "/v1/status?findings=not-passed", "").0, 401);
}

/// Issue 37: what an unprivileged user can put into the kernel log while the service runs — a
/// crashing program named like an Xid (the kernel logs its `comm` first), records written to
/// /dev/kmsg with facility LOG_USER in the exact shapes of a fatal Xid and a fatal SXid — leaves
/// /healthz at 200 and the report clean, through the snapshot that a real SXid after them asks
/// for. The driver's own lines then still turn /healthz to 503.
#[test]
fn forged_kernel_log_lines_do_not_move_healthz() {
    let dir = tempfile::tempdir().unwrap();
    let root = copy_sysroot("hgx-8gpu-healthy", dir.path());
    let Some((a, _)) = start_on(&root, 0o600, None) else { return };
    wait_ready(&a);
    assert_eq!(get(a.port, "/healthz", "").0, 200);
    let xid79 = "NVRM: Xid (PCI:0000:0c:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.";
    let fatal = "nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30 LTSSM Fault Up";
    let mut kmsg = std::fs::OpenOptions::new().append(true).open(root.join("dev/kmsg")).unwrap();
    writeln!(kmsg, "6,6001,9100000000,-;NVRM: Xid (PCI:[4242]: segfault at 0 ip 0 sp 0 error 4 in {xid79}[1+1]")
        .unwrap();
    writeln!(kmsg, "12,6002,9100000001,-;{xid79}").unwrap();
    writeln!(kmsg, "14,6003,9100000002,-;{fatal}").unwrap();
    // A real non-fatal SXid: the first of its kind asks for a snapshot at once, which reads the
    // whole kernel log, forged lines included.
    writeln!(kmsg, "4,6004,9200000000,-;nvidia-nvswitch3: SXid (PCI:0000:14:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)").unwrap();
    kmsg.flush().unwrap();
    let started = Instant::now();
    let report = loop {
        let (_, r) = get(a.port, "/v1/status", &auth());
        let report: Value = serde_json::from_str(body(&r)).unwrap();
        let seen =
            findings(&report, "fabric.sxid").into_iter().any(|f| f["gpu"] == "0000:14:00.0" && f["severity"] == "warn");
        if seen {
            break report;
        }
        assert!(started.elapsed() < Duration::from_secs(25), "the real SXid never reached the report");
        std::thread::sleep(Duration::from_millis(200));
    };
    validate(&report);
    assert_eq!(bad(&report), vec![row("fabric.sxid", "0000:14:00.0", "warn")], "only the real, non-fatal SXid counts");
    assert_eq!(get(a.port, "/healthz", "").0, 200);

    // The driver's lines, written by the kernel (facility 0), fail the GPU and the switch.
    writeln!(kmsg, "4,6005,9300000000,-;{xid79}").unwrap();
    writeln!(kmsg, "3,6006,9300000001,-;{fatal}").unwrap();
    kmsg.flush().unwrap();
    let started = Instant::now();
    while get(a.port, "/healthz", "").0 != 503 {
        assert!(started.elapsed() < Duration::from_secs(25), "a real fatal SXid did not make /healthz 503");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Issue 39: the fault history across boots. Xid 79 on the same GPU (the same board serial) in
/// two boots — the boot id changed between two `serve` runs on one state directory — is
/// `inspect_hardware`/`platform`, names the serial and both boots, and stays so after a third
/// boot without the Xid: a reboot alone clears nothing (a passing probe does: history.rs's
/// unit test walks that).
#[test]
fn an_xid_in_two_boots_escalates_to_the_platform() {
    let dir = tempfile::tempdir().unwrap();
    let root = copy_sysroot("hgx-8gpu-xid79", dir.path());
    let state = dir.path().join("state");
    let boot_id = root.join("proc/sys/kernel/random/boot_id");
    let xid_on_0c = |boot: &str| -> (Value, Value, String) {
        std::fs::write(&boot_id, format!("{boot}\n")).unwrap();
        let (a, _) = start_on(&root, 0o600, Some(&state)).expect("serve");
        wait_ready(&a);
        let (code, r) = get(a.port, "/v1/status", &auth());
        assert_eq!(code, 200, "{r}");
        let report: Value = serde_json::from_str(body(&r)).unwrap();
        validate(&report);
        let f = findings(&report, "gpu.xid").into_iter().find(|f| f["gpu"] == "0000:0c:00.0").unwrap().clone();
        let metrics = body(&get(a.port, "/metrics", &auth()).1).to_string();
        (f, report["verdict"].clone(), metrics)
    };
    let (first, _, _) = xid_on_0c("boot-a");
    assert_eq!((first["action"].as_str(), first["evidence"]["boots"].as_u64()), (Some("reboot_host"), Some(1)));
    let serial = first["evidence"]["serial"].as_str().unwrap().to_string();
    assert!(!serial.starts_with("pci:"), "NVML gives the board serial: {serial}");

    let (second, verdict, metrics) = xid_on_0c("boot-b");
    assert_eq!((second["action"].as_str(), second["owner"].as_str()), (Some("inspect_hardware"), Some("platform")));
    assert_eq!(second["evidence"]["boot_ids"], serde_json::json!(["boot-a", "boot-b"]));
    assert!(second["summary"].as_str().unwrap().contains(&format!("serial {serial}")), "{second:#}");
    assert_eq!((verdict["action"].as_str(), verdict["owner"].as_str()), (Some("inspect_hardware"), Some("platform")));
    assert!(verdict["gpus"].as_array().unwrap().contains(&"0000:0c:00.0".into()));
    // The verdict's basis (issue 51): the kernel log's Xid, escalated by the history.
    assert_eq!(verdict["basis"], serde_json::json!(["history", "kernel_log"]), "{verdict:#}");
    assert_eq!(verdict["boots"], serde_json::json!(["boot-a", "boot-b"]), "{verdict:#}");
    assert!(
        metrics.contains("phq_verdict{action=\"inspect_hardware\",owner=\"platform\",basis=\"history+kernel_log\"} 1"),
        "{metrics}"
    );
    assert_eq!(metrics.matches("phq_verdict{").count(), 1);
    assert!(metrics.contains(&format!("serial=\"{serial}\"")), "phq_gpu_info carries the serial");

    // A third boot, the same kernel log (the fixture keeps its Xid line): still open, three boots;
    // the history file holds the fault by serial.
    let (third, _, _) = xid_on_0c("boot-c");
    assert_eq!((third["action"].as_str(), third["evidence"]["boots"].as_u64()), (Some("inspect_hardware"), Some(3)));
    let history: Value = serde_json::from_slice(&std::fs::read(state.join("history.json")).unwrap()).unwrap();
    let fault = history["faults"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["serial"] == serial.as_str() && f["code"] == "79")
        .unwrap();
    assert!(fault.get("cleared").is_none(), "a reboot alone cleared it: {fault:#}");
    // `phq-agent history` shows it: the serial, Xid 79, three boots, open.
    let cfg = dir.path().join("history.toml");
    std::fs::write(&cfg, format!("[agent]\nstate_dir = \"{}\"\n", state.display())).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_phq-agent")).args(["history", "--config"]).arg(&cfg).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.contains("gpu.xid 79")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.starts_with(&serial) && line.contains("    3  ") && line.contains("inspect_hardware"), "{line}");
}

/// The service's snapshot interval (serve rule 1).
fn serve_interval() -> Duration {
    phq_agent::serve::SNAPSHOT_INTERVAL
}

#[test]
fn sigterm_stops_cleanly_and_seq_survives_a_restart() {
    let state = tempfile::tempdir().unwrap();
    let Some((mut a, _)) = start(0o600, Some(state.path())) else { return };
    wait_ready(&a);
    let (_, r) = get(a.port, "/v1/status", &auth());
    let first: u64 = serde_json::from_str::<Value>(body(&r)).unwrap()["seq"].as_u64().unwrap();
    unsafe { libc::kill(a.child.id() as i32, libc::SIGTERM) };
    let stopping = recv(&a.notify);
    assert!(stopping.contains("STOPPING=1"), "{stopping}");
    let status = a.child.wait().unwrap();
    assert_eq!(status.code(), Some(0));

    let Some((b, _)) = start(0o600, Some(state.path())) else { return };
    wait_ready(&b);
    let (_, r) = get(b.port, "/v1/status", &auth());
    let second: u64 = serde_json::from_str::<Value>(body(&r)).unwrap()["seq"].as_u64().unwrap();
    assert!(second > first, "seq must keep growing across restarts: {first} then {second}");
}

#[test]
fn a_token_file_others_can_read_is_refused() {
    let Some((mut a, _)) = start(0o644, None) else { return };
    let status = a.child.wait().unwrap();
    assert_ne!(status.code(), Some(0));
    let mut err = String::new();
    a.child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(err.contains("mode 0644") && err.contains("chmod 600"), "{err}");
}

#[test]
fn hostile_clients_do_not_stop_healthz() {
    let Some((a, _)) = start(0o600, None) else { return };
    wait_ready(&a);
    // slowloris: a request line, then nothing.
    let mut slow: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", a.port)).unwrap();
            s.write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n").unwrap();
            s
        })
        .collect();
    // oversize headers
    let huge = format!("X-Junk: {}\r\n", "a".repeat(64 * 1024));
    let (code, _) = get(a.port, "/healthz", &huge);
    assert!(code == 431 || code == 0 || code == 400, "oversize headers got {code}");
    // healthz keeps answering meanwhile
    let t = Instant::now();
    assert_eq!(get(a.port, "/healthz", "").0, 200);
    assert!(t.elapsed() < Duration::from_secs(5));
    // and the slow connections are cut once the header timeout passes
    std::thread::sleep(phq_agent::serve::http::HEADER_TIMEOUT + Duration::from_secs(1));
    let mut closed = 0;
    for s in slow.iter_mut() {
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut buf = [0u8; 256];
        match s.read(&mut buf) {
            Ok(0) => closed += 1,
            Ok(_) => closed += 1, // an error response, then close
            // Past MAX_PER_PEER, a newer connection from this address took the place of an idle
            // one; closed with the half-sent head unread, the kernel resets it.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => closed += 1,
            Err(_) => {}
        }
    }
    assert_eq!(closed, 20, "slow clients must be cut after the header timeout");
}

#[test]
fn sighup_reloads_and_a_bad_reload_keeps_the_old_config() {
    let Some((a, cfg)) = start(0o600, None) else { return };
    wait_ready(&a);
    let good = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, format!("{good}[agent]\n")).unwrap(); // duplicate table: invalid
    unsafe { libc::kill(a.child.id() as i32, libc::SIGHUP) };
    let msg = recv(&a.notify);
    assert!(msg.contains("STATUS=reload refused, previous configuration kept"), "{msg}");
    assert_eq!(get(a.port, "/healthz", "").0, 200, "still serving after a bad reload");
    assert_eq!(get(a.port, "/v1/status", &auth()).0, 200);
}

#[test]
fn metrics_pass_promtool() {
    // promtool comes with Debian's `prometheus` package; .ci/run installs it.
    if !needs(&[("promtool", "prometheus")]) {
        return;
    }
    let Some((a, _)) = start(0o600, None) else { return };
    wait_ready(&a);
    let (_, r) = get(a.port, "/metrics", &auth());
    let mut p = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    p.stdin.take().unwrap().write_all(body(&r).as_bytes()).unwrap();
    let out = p.wait_with_output().unwrap();
    let complaints = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool check metrics: {complaints}");
    assert!(complaints.trim().is_empty(), "promtool: {complaints}");
}

#[test]
fn dbus_api_answers_and_signals_health_changes() {
    let Some((a, cfg)) = start(0o600, None) else { return };
    wait_ready(&a);
    let conn = zbus::blocking::connection::Builder::address(a.bus.address.as_str()).unwrap().build().unwrap();
    let proxy =
        zbus::blocking::Proxy::new(&conn, "ch.phoeniqs.Agent1", "/ch/phoeniqs/Agent1", "ch.phoeniqs.Agent1").unwrap();
    let json: String = proxy.call("GetReport", &()).unwrap();
    let report: Value = serde_json::from_str(&json).unwrap();
    validate(&report);
    assert_eq!(report["gpus"].as_array().unwrap().len(), 8);

    let bad: Result<String, _> = proxy.call("RunProbes", &("ludicrous",));
    assert!(bad.unwrap_err().to_string().contains("expected quick, standard or full"));
    // RunProbes goes through the probe desk as root's request and answers at once with the
    // run's record; GetReport answers while the run goes (issue 51), and the report that follows
    // the run names it, with who asked (issue 50).
    // The service's own boot run goes first (one run at a time): RunProbes is refused, naming it,
    // until it ends.
    let until = std::time::Instant::now() + Duration::from_secs(120);
    let run: Value = loop {
        match proxy.call::<_, _, String>("RunProbes", &("quick",)) {
            Ok(json) => break serde_json::from_str(&json).unwrap(),
            Err(e) => {
                assert!(e.to_string().contains("already queued or running") && std::time::Instant::now() < until, "{e}")
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(
        (run["asked_by"]["who"].as_str(), run["source"].as_str()),
        (Some("local_root"), Some("request")),
        "{run:#}"
    );
    let id = run["id"].as_str().unwrap().to_string();
    let t = std::time::Instant::now();
    let _: String = proxy.call("GetReport", &()).unwrap();
    eprintln!("GetReport answered {:.2?} after RunProbes", t.elapsed());
    let again: Result<String, _> = proxy.call("RunProbes", &("quick",));
    let refused = again.map(|_| String::new()).unwrap_or_else(|e| e.to_string());
    assert!(refused.contains(&id) || refused.is_empty(), "{refused}");
    let until = std::time::Instant::now() + Duration::from_secs(120);
    let ended = loop {
        let run: Value =
            serde_json::from_str(&proxy.call::<_, _, String>("GetProbeRun", &(id.as_str(),)).unwrap()).unwrap();
        if run["state"] == "done" || run["state"] == "failed" {
            break run;
        }
        assert!(std::time::Instant::now() < until, "the run never ended: {run:#}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(ended["asked_by"], serde_json::json!({"who": "local_root"}), "{ended:#}");
    let none: Result<String, _> = proxy.call("GetProbeRun", &("0123456789abcdef",));
    assert!(none.unwrap_err().to_string().contains("no such probe run"));

    // Expect 4 GPUs where there are 8: the next snapshot (SIGHUP takes one at once) is unhealthy.
    let signals = zbus::blocking::MessageIterator::for_match_rule(
        zbus::MatchRule::builder()
            .msg_type(zbus::message::Type::Signal)
            .interface("ch.phoeniqs.Agent1")
            .unwrap()
            .member("HealthChanged")
            .unwrap()
            .build(),
        &conn,
        Some(16),
    )
    .unwrap();
    let text = std::fs::read_to_string(&cfg).unwrap().replace("[agent]\n", "[agent]\nexpected_gpus = 4\n");
    std::fs::write(&cfg, text).unwrap();
    unsafe { libc::kill(a.child.id() as i32, libc::SIGHUP) };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for m in signals {
            let Ok(m) = m else { continue };
            if let Ok((old, new)) = m.body().deserialize::<(String, String)>() {
                let _ = tx.send((old, new));
                return;
            }
        }
    });
    let (old, new) = rx.recv_timeout(Duration::from_secs(20)).expect("HealthChanged within 20 s");
    assert_eq!(new, "unhealthy");
    assert_ne!(old, "unhealthy");
}

#[test]
fn status_asks_dbus_only_and_sends_no_token_to_the_port() {
    let Some((a, cfg)) = start(0o600, None) else { return };
    wait_ready(&a);
    let status = |cfg: &Path, bus: &str| {
        Command::new(env!("CARGO_BIN_EXE_phq-agent"))
            .args(["status", "--json", "--config"])
            .arg(cfg)
            .env("DBUS_SYSTEM_BUS_ADDRESS", bus)
            .output()
            .unwrap()
    };
    let over_dbus = status(&cfg, &a.bus.address);
    let r: Value = serde_json::from_slice(&over_dbus.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&over_dbus.stderr)));
    validate(&r);
    assert_eq!(r["gpus"].as_array().unwrap().len(), 8);

    // Issue 37: with the service off the bus, a squatter on the configured port gets nothing:
    // no connection, so no token; `status` fails and says why.
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    squatter.set_nonblocking(true).unwrap();
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("127.0.0.1:0", &format!("127.0.0.1:{}", squatter.local_addr().unwrap().port()));
    let client_cfg = cfg.with_file_name("client.toml");
    std::fs::write(&client_cfg, text).unwrap();
    let out = status(&client_cfg, "unix:path=/nonexistent/bus");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(out.stdout.is_empty());
    assert!(stderr.contains("did not answer on D-Bus") && stderr.contains("never sends the token"), "{stderr}");
    match squatter.accept() {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        other => panic!("status connected to the squatter: {other:?}"),
    }
}

/// Issue 37: a port another process holds stops `serve` at once with who holds it and the exit
/// code the unit does not restart on (69), instead of a restart loop that says nothing.
#[test]
fn a_squatter_on_the_port_stops_serve_with_who_holds_it() {
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = squatter.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let cfg = service_config(dir.path(), TOKEN, "");
    let text = std::fs::read_to_string(&cfg).unwrap().replace("127.0.0.1:0", &format!("127.0.0.1:{port}"));
    std::fs::write(&cfg, text).unwrap();
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let out = serve_command(&cfg, &repo().join("examples/scenarios/hgx-8gpu-healthy.json"), &bus)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let me = format!("process {} (", std::process::id());
    assert!(
        stderr.contains(&format!("port {port}")) && stderr.contains(&format!("uid {uid}")) && stderr.contains(&me),
        "{stderr}"
    );
}

/// Issue 37: under systemd the port is bound by PID 1 (phq-agent.socket) and `serve` takes that
/// socket. systemd's own `systemd-socket-activate` passes it as systemd does (LISTEN_FDS,
/// LISTEN_PID); `http.listen` names a port a squatter holds, so only the passed socket can
/// answer — and it does.
#[test]
fn serve_takes_the_socket_systemd_passes() {
    if !needs(&[("systemd-socket-activate", "systemd")]) {
        return;
    }
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = service_config(dir.path(), TOKEN, "");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("127.0.0.1:0", &format!("127.0.0.1:{}", squatter.local_addr().unwrap().port()));
    std::fs::write(&cfg, text).unwrap();
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let serve = serve_command(&cfg, &repo().join("examples/scenarios/hgx-8gpu-healthy.json"), &bus);
    // A free port for systemd-socket-activate to bind (released at once; it binds it next).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut activate = Command::new("systemd-socket-activate");
    activate.arg(format!("--listen=127.0.0.1:{port}"));
    // It hands the child only TERM, PATH, USER, HOME and what --setenv names.
    for (k, v) in serve.get_envs() {
        if let Some(v) = v {
            activate.arg(format!("--setenv={}={}", k.to_string_lossy(), v.to_string_lossy()));
        }
    }
    let started = Instant::now();
    let child = activated(activate.arg(serve.get_program()).args(serve.get_args()).stderr(Stdio::null()));
    // The first connection starts the service, which then accepts it on the passed socket.
    let (code, resp) = get(port, "/healthz", "");
    assert!(code == 200 || code == 503, "{resp}");
    // /v1/status once the first snapshot is taken.
    loop {
        let (code, resp) = get(port, "/v1/status", &auth());
        if code == 200 {
            validate(&serde_json::from_str(body(&resp)).unwrap());
            break;
        }
        assert!(code == 503 && started.elapsed() < Duration::from_secs(30), "{resp}");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(child);
}

/// A vsock port no one holds: one the kernel picks (VMADDR_PORT_ANY), released at once for
/// systemd-socket-activate to bind next, as the TCP port above is. `None` where this machine
/// cannot make an AF_VSOCK socket.
fn free_vsock_port() -> Option<u32> {
    // SAFETY: plain socket(2); checked before use, closed below.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: sockaddr_vm is plain data; zeroes are its reserved fields' required value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = libc::VMADDR_CID_ANY;
    addr.svm_port = libc::VMADDR_PORT_ANY;
    let mut len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
    // SAFETY: `addr` is a whole sockaddr_vm and `len` says so; getsockname writes no more.
    let ok = unsafe {
        libc::bind(fd, (&addr as *const libc::sockaddr_vm).cast(), len) == 0
            && libc::getsockname(fd, (&mut addr as *mut libc::sockaddr_vm).cast(), &mut len) == 0
    };
    // SAFETY: `fd` is this function's own.
    unsafe { libc::close(fd) };
    ok.then_some(addr.svm_port)
}

/// Both ports bound by systemd (phq-agent.socket and phq-agent-vsock.socket), passed with their
/// names as systemd passes them (`systemd-socket-activate --fdname`, LISTEN_FDNAMES): `serve`
/// answers on the TCP socket named `http`, and says in one line what it did with the one named
/// `vsock` — served it where this machine has a vsock device (the config's other vsock.port is
/// said and not used), closed it where it has none.
#[test]
fn serve_takes_both_sockets_systemd_passes_by_name() {
    if !needs(&[("systemd-socket-activate", "systemd")]) {
        return;
    }
    let Some(vport) = free_vsock_port() else {
        skip("socket(AF_VSOCK) fails on this machine (modprobe vsock)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let other = vport.wrapping_add(1);
    let cfg = service_config(dir.path(), TOKEN, &format!("[vsock]\nport = {other}\ntls = false\n"));
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let serve = serve_command(&cfg, &repo().join("examples/scenarios/hgx-8gpu-healthy.json"), &bus);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut activate = Command::new("systemd-socket-activate");
    activate
        .arg(format!("--listen=127.0.0.1:{port}"))
        .arg(format!("--listen=vsock:4294967295:{vport}"))
        .arg("--fdname=http:vsock");
    for (k, v) in serve.get_envs() {
        if let Some(v) = v {
            activate.arg(format!("--setenv={}={}", k.to_string_lossy(), v.to_string_lossy()));
        }
    }
    let log = dir.path().join("serve.log");
    let child = activated(
        activate.arg(serve.get_program()).args(serve.get_args()).arg("-v").stderr(std::fs::File::create(&log).unwrap()),
    );
    let (code, resp) = get(port, "/healthz", "");
    assert!(code == 200 || code == 503, "{resp}");
    let said = |needle: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains(needle) || Instant::now() > deadline {
                return text;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let has_device = phq_agent::serve::vsock::local_cid(Path::new("/dev/vsock")).ok().flatten().is_some();
    let err = said(if has_device { "over vsock" } else { "no vsock device" });
    drop(child);
    assert!(err.contains(&format!("the socket systemd passed (127.0.0.1:{port}, phq-agent.socket)")), "{err}");
    if has_device {
        assert!(
            err.contains(&format!("the socket systemd passed (vsock port {vport}, phq-agent-vsock.socket)")),
            "{err}"
        );
        assert!(err.contains(&format!("vsock.port ({other}) names another port and is not used")), "{err}");
    } else {
        assert_eq!(err.matches("no vsock device").count(), 1, "one line: {err}");
        assert!(err.contains("the socket systemd passed (phq-agent-vsock.socket) is closed"), "{err}");
    }
}

#[test]
fn grafana_dashboard_queries_only_metrics_the_agent_serves() {
    let Some((a, _)) = start(0o600, None) else { return };
    wait_ready(&a);
    let (_, r) = get(a.port, "/metrics", &auth());
    let served: std::collections::HashSet<String> = body(&r)
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .flat_map(|l| {
            // A counter family is typed by its name; its samples carry `_total`.
            let mut w = l.split_whitespace();
            let name = w.next().unwrap_or_default().to_string();
            let total = (w.next() == Some("counter") && !name.ends_with("_total")).then(|| format!("{name}_total"));
            std::iter::once(name).chain(total)
        })
        .collect();
    // Counters of events (Xids) have no series until the first event; they count as served
    // when the agent declares them.
    let source = std::fs::read_to_string(common::repo().join("src/serve/metrics/mod.rs")).unwrap();
    let event_counters: Vec<&str> = source
        .split("fam.counter(")
        .skip(1)
        .filter_map(|r| r.trim_start().strip_prefix('"').and_then(|r| r.split('"').next()))
        .collect();
    let path = common::repo().join("dashboards/phq-agent.json");
    let dash: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut used = 0;
    for panel in dash["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("phq_") {
                    used += 1;
                    assert!(
                        served.contains(word) || event_counters.contains(&word),
                        "panel {:?} queries {word}, which /metrics does not serve: {served:?}",
                        panel["title"]
                    );
                }
            }
        }
    }
    assert!(used >= 20, "{used}");
}

/// `http.enabled = false`: the real service runs, ready, with no TCP socket at all, and says in
/// one line what became of its vsock listener: on a machine with a vsock device (a guest CID
/// from /dev/vsock) it listens there; on one without, it says so and runs. (The listener's
/// handshake rules are `serve::vsock`'s unit tests; the VM test drives a real device.)
#[test]
fn tcp_off_serves_no_tcp_and_says_what_became_of_vsock() {
    let dir = tempfile::tempdir().unwrap();
    // A port of this test's own: tests in parallel on a machine with a vsock device each bind one.
    let port = 20_000 + std::process::id() % 40_000;
    let cfg = service_config(dir.path(), TOKEN, &format!("enabled = false\n[vsock]\nport = {port}\ntls = false\n"));
    let notify_path = dir.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let mut child = serve_command(&cfg, &repo().join("examples/scenarios/hgx-8gpu-healthy.json"), &bus)
        .arg("-v")
        .env("NOTIFY_SOCKET", &notify_path)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let msg = recv(&notify);
    assert!(msg.contains("READY=1"), "{msg}");
    assert_eq!(listening_ports(child.id()), Vec::<u16>::new(), "no TCP listener with http.enabled = false");
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert_eq!(child.wait().unwrap().code(), Some(0));
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(err.contains("http.enabled = false: no TCP listener"), "{err}");
    let has_device = phq_agent::serve::vsock::local_cid(Path::new("/dev/vsock")).ok().flatten().is_some();
    if has_device {
        assert!(err.contains("over vsock") && err.contains(&format!("port={port}")), "{err}");
        assert!(err.contains("plain (vsock.tls = false): bearer token required"), "{err}");
    } else {
        assert_eq!(err.matches("no vsock device").count(), 1, "one line: {err}");
    }
}

/// `systemd-socket-activate` (and the service it starts), killed when dropped.
struct Activated(std::process::Child);

impl Drop for Activated {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `activate` and waits until it listens on the socket it will pass.
fn activated(activate: &mut Command) -> Activated {
    let mut child = activate.stdout(Stdio::null()).spawn().unwrap();
    let started = Instant::now();
    while listening_ports(child.id()).is_empty() {
        assert!(child.try_wait().unwrap().is_none(), "systemd-socket-activate exited");
        assert!(started.elapsed() < Duration::from_secs(10), "systemd-socket-activate did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    Activated(child)
}
