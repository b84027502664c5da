//! Pushing to the platform: a real HTTP platform double on 127.0.0.1 that accepts, refuses
//! connections, stalls, answers 500 and drops connections; the real agent killed with SIGKILL
//! at random moments while 200 Xid events arrive. Every event must arrive at least once, and
//! events in seq order.

mod common;

use common::*;
use serde_json::Value;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Mode {
    Accept = 0,
    Error500 = 1,
    Drop = 2,
    Stall = 3,
    Refuse = 4,
}

#[derive(Debug, Clone)]
struct Received {
    key: String,
    auth: String,
    path: String,
    body: Value,
}

/// The platform double. Connection refusal is done by closing the listener.
struct Platform {
    port: u16,
    mode: Arc<AtomicU8>,
    got: Arc<Mutex<Vec<Received>>>,
}

impl Platform {
    fn start() -> Platform {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mode = Arc::new(AtomicU8::new(Mode::Accept as u8));
        let got = Arc::new(Mutex::new(Vec::new()));
        let (m, g) = (mode.clone(), got.clone());
        std::thread::spawn(move || {
            let mut listener = Some(listener);
            loop {
                if m.load(Ordering::SeqCst) == Mode::Refuse as u8 {
                    listener = None; // connections are refused while there is no listener
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                let l = listener
                    .get_or_insert_with(|| TcpListener::bind(("127.0.0.1", port)).expect("rebind the platform port"));
                l.set_nonblocking(true).unwrap();
                match l.accept() {
                    Ok((s, _)) => {
                        let (m, g) = (m.clone(), g.clone());
                        std::thread::spawn(move || handle(s, &m, &g));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Platform { port, mode, got }
    }

    fn received(&self) -> Vec<Received> {
        self.got.lock().unwrap().clone()
    }
}

fn handle(s: TcpStream, mode: &AtomicU8, got: &Mutex<Vec<Received>>) {
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut request_line = String::new();
    if r.read_line(&mut request_line).is_err() {
        return;
    }
    let (mut len, mut key, mut auth) = (0usize, String::new(), String::new());
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).is_err() || line == "\r\n" || line.is_empty() {
            break;
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        } else if lower.starts_with("idempotency-key:") {
            key = line["idempotency-key:".len()..].trim().to_string();
        } else if lower.starts_with("authorization:") {
            auth = line["authorization:".len()..].trim().to_string();
        }
    }
    let mut body = vec![0u8; len];
    if r.read_exact(&mut body).is_err() {
        return;
    }
    let mut s = s;
    match mode.load(Ordering::SeqCst) {
        m if m == Mode::Error500 as u8 => {
            let _ =
                s.write_all(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
        m if m == Mode::Drop as u8 => {} // read it all, answer nothing, hang up
        m if m == Mode::Stall as u8 => std::thread::sleep(Duration::from_secs(12)),
        _ => {
            let path = request_line.split_whitespace().nth(1).unwrap_or("").to_string();
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            got.lock().unwrap().push(Received { key, auth, path, body });
            let _ = s.write_all(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    }
}

struct Setup {
    dir: tempfile::TempDir,
    cfg: PathBuf,
    scenario: PathBuf,
    quiet_scenario: PathBuf,
}

/// `xids` Xid events on GPU 0000:0c:00.0, codes 1000…, `spacing_ms` apart from 100 ms after
/// NVML starts.
fn setup(platform_port: u16, xids: usize, spacing_ms: usize) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "tok-0123456789abcdef-local\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let ptoken = dir.path().join("platform-token");
    std::fs::write(&ptoken, "platform-secret-0123456789\n").unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "[agent]\nid = \"vm-push-test\"\nstate_dir = \"{}\"\n[http]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n[platform]\nurl = \"http://127.0.0.1:{platform_port}\"\ntoken_file = \"{}\"\n",
            dir.path().join("state").display(),
            token.display(),
            ptoken.display()
        ),
    )
    .unwrap();
    // The healthy HGX scenario with `xids` Xid events on GPU 0000:0c:00.0, codes 1000…, one
    // every 20 ms from 100 ms after NVML starts.
    let mut s: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("examples/scenarios/hgx-8gpu-healthy.json")).unwrap(),
    )
    .unwrap();
    let quiet_scenario = dir.path().join("quiet.json");
    std::fs::write(&quiet_scenario, serde_json::to_vec(&s).unwrap()).unwrap();
    s["devices"][3]["xid_events"] =
        (0..xids).map(|i| serde_json::json!({"xid": 1000 + i, "after_ms": 100 + spacing_ms * i})).collect();
    let scenario = dir.path().join("scenario.json");
    std::fs::write(&scenario, serde_json::to_vec(&s).unwrap()).unwrap();
    Setup { dir, cfg, scenario, quiet_scenario }
}

fn spawn(s: &Setup, scenario: &Path, bus: &PrivateBus) -> Child {
    serve_command(&s.cfg, scenario, bus).spawn().unwrap()
}

fn spool_len(dir: &Path) -> usize {
    std::fs::read_dir(dir.join("state/spool"))
        .map(|rd| rd.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".json")).count())
        .unwrap_or(0)
}

fn xid_events(got: &[Received]) -> Vec<(u64, u64)> {
    got.iter()
        .filter(|r| r.body["event"]["kind"] == "xid")
        .map(|r| (r.key.rsplit(':').next().unwrap().parse().unwrap(), r.body["event"]["xid"].as_u64().unwrap()))
        .collect()
}

#[test]
fn status_reports_arrive_with_token_and_idempotency_key() {
    let platform = Platform::start();
    let s = setup(platform.port, 3, 20);
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let mut agent = spawn(&s, &s.scenario, &bus);
    let deadline = Instant::now() + Duration::from_secs(20);
    // Events go first; the periodic status follows once the spool is empty.
    let has_status = |got: &[Received]| got.iter().any(|r| r.body.get("event").is_none());
    while (xid_events(&platform.received()).len() < 3 || !has_status(&platform.received())) && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = agent.kill();
    let _ = agent.wait();
    let got = platform.received();
    assert!(!got.is_empty(), "nothing reached the platform");
    for r in &got {
        assert_eq!(r.path, "/v1/agents/vm-push-test/reports");
        assert_eq!(r.auth, "Bearer platform-secret-0123456789");
        // {agent_id}:{epoch}:{seq}, the epoch 16 hex digits, new at each start of the agent.
        let parts: Vec<&str> = r.key.split(':').collect();
        assert_eq!(parts.len(), 3, "{}", r.key);
        assert_eq!(parts[0], "vm-push-test");
        assert!(parts[1].len() == 16 && parts[1].bytes().all(|b| b.is_ascii_hexdigit()), "{}", r.key);
        assert_eq!(parts[2], r.body["seq"].to_string());
        validate(&r.body);
    }
    assert!(has_status(&got), "a periodic status arrived");
    let xids: Vec<u64> = xid_events(&got).into_iter().map(|(_, x)| x).collect();
    assert_eq!(xids, vec![1000, 1001, 1002]);
}

#[test]
fn kill_9_with_a_flapping_platform_loses_no_event() {
    const EVENTS: usize = 200;
    let platform = Platform::start();
    // A run sees all 200 events within 0.5 s of starting (2 ms apart).
    let s = setup(platform.port, EVENTS, 2);
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    // Flap the platform through every failure while the agent runs.
    let flapping = Arc::new(AtomicU8::new(1));
    let (mode, on) = (platform.mode.clone(), flapping.clone());
    let flapper = std::thread::spawn(move || {
        let modes = [
            Mode::Accept,
            Mode::Error500,
            Mode::Accept,
            Mode::Drop,
            Mode::Refuse,
            Mode::Accept,
            Mode::Stall,
            Mode::Accept,
        ];
        let mut i = 0;
        while on.load(Ordering::SeqCst) == 1 {
            mode.store(modes[i % modes.len()] as u8, Ordering::SeqCst);
            i += 1;
            std::thread::sleep(Duration::from_millis(if modes[i % modes.len()] == Mode::Stall { 300 } else { 150 }));
        }
        mode.store(Mode::Accept as u8, Ordering::SeqCst);
    });
    // Kill -9 at pseudo-random moments (a fixed LCG: reproducible), restarting each time. The
    // first run lives long enough to see every event, so each of them is spooled at least once;
    // the later runs die at random, with events spooled and not yet accepted.
    let _ = fake_nvml(); // built before the clock starts
    let mut rng: u64 = 0x2545_f491_4f6c_dd1d;
    let mut kills = 0;
    for run in 0..10 {
        let mut agent = spawn(&s, &s.scenario, &bus);
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let life = if run == 0 { 2500 } else { 300 + (rng >> 33) % 1200 };
        std::thread::sleep(Duration::from_millis(life));
        agent.kill().unwrap(); // SIGKILL
        agent.wait().unwrap();
        kills += 1;
    }
    flapping.store(0, Ordering::SeqCst);
    flapper.join().unwrap();
    let during: BTreeSet<u64> = xid_events(&platform.received()).into_iter().map(|(_, x)| x).collect();
    let spooled = spool_len(s.dir.path());
    // A last, undisturbed run whose NVML reports no Xid at all: whatever is still missing can
    // only come out of the spool the killed runs left behind.
    let mut agent = spawn(&s, &s.quiet_scenario, &bus);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen: BTreeSet<u64> = xid_events(&platform.received()).into_iter().map(|(_, x)| x).collect();
        if seen.len() == EVENTS && spool_len(s.dir.path()) == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after {kills} kills ({} arrived during them, {spooled} left spooled): {} of {EVENTS} events arrived, {} still spooled",
            during.len(),
            seen.len(),
            spool_len(s.dir.path())
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = agent.kill();
    let _ = agent.wait();
    eprintln!("kill -9 test: {kills} kills; {} distinct events arrived during them; {spooled} events left in the spool; {} POSTs of events in all", during.len(), xid_events(&platform.received()).len());
    assert!(kills >= 5, "only {kills} kills");
    assert!(spooled > 0, "the kills left nothing in the spool: the test did not test the spool");

    let events = xid_events(&platform.received());
    let seen: BTreeSet<u64> = events.iter().map(|(_, x)| *x).collect();
    assert_eq!(seen, (1000..1000 + EVENTS as u64).collect::<BTreeSet<_>>(), "every event arrived at least once");
    // In order: taking each Idempotency-Key's first arrival, seqs only grow.
    let mut firsts = Vec::new();
    let mut keys = BTreeSet::new();
    for (seq, _) in &events {
        if keys.insert(*seq) {
            firsts.push(*seq);
        }
    }
    assert!(firsts.windows(2).all(|w| w[0] < w[1]), "events out of order: {firsts:?}");
}

/// Periodic status goes every `platform.interval`, not at every snapshot: with an hour's
/// interval, snapshots taken on SIGHUP push nothing more after the first status.
#[test]
fn periodic_status_follows_platform_interval() {
    let platform = Platform::start();
    let s = setup(platform.port, 0, 20);
    let text = std::fs::read_to_string(&s.cfg).unwrap().replace("[platform]\n", "[platform]\ninterval = \"1h\"\n");
    std::fs::write(&s.cfg, text).unwrap();
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let mut agent = spawn(&s, &s.quiet_scenario, &bus);
    let statuses = |p: &Platform| p.received().iter().filter(|r| r.body.get("event").is_none()).count();
    let deadline = Instant::now() + Duration::from_secs(20);
    while statuses(&platform) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(statuses(&platform), 1, "the first status, at start");
    for _ in 0..3 {
        // SAFETY: kill on our own child's pid; SIGHUP takes a snapshot at once.
        unsafe { libc::kill(agent.id() as i32, libc::SIGHUP) };
        std::thread::sleep(Duration::from_millis(700));
    }
    let _ = agent.kill();
    let _ = agent.wait();
    assert_eq!(statuses(&platform), 1, "three snapshots within the hour pushed no status");
}

/// Xids in the kernel log that no running agent saw (here: the boot log of a guest whose GPU
/// fell off the bus before the agent started) reach the platform as events, once: a restart
/// does not send them again.
/// Issue 37: lines anyone can put into the kernel log — a crashing program named like an Xid
/// (its `comm` comes first in the segfault line), records written to /dev/kmsg with facility
/// LOG_USER in the exact shape of an Xid and a fatal SXid — are pushed as nothing, while the
/// driver's own Xids in the same log are pushed as before.
#[test]
fn forged_kernel_log_lines_are_never_pushed() {
    let platform = Platform::start();
    let s = setup(platform.port, 0, 20);
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let root = copy_sysroot("hgx-8gpu-xid79", s.dir.path());
    let mut kmsg = std::fs::OpenOptions::new().append(true).open(root.join("dev/kmsg")).unwrap();
    let xid48 = "NVRM: Xid (PCI:0000:0e:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error";
    writeln!(kmsg, "6,7001,95000000000,-;NVRM: Xid (PCI:[4242]: segfault at 0 ip 0 sp 0 error 4 in {xid48}[1+1]")
        .unwrap();
    writeln!(kmsg, "12,7002,95000000001,-;{xid48}").unwrap();
    writeln!(
        kmsg,
        "14,7003,95000000002,-;nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"
    )
    .unwrap();
    drop(kmsg);
    let mut agent = std::process::Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["serve", "--config"])
        .arg(&s.cfg)
        .arg("--sysroot")
        .arg(&root)
        .arg("--nvml-lib")
        .arg(fake_nvml())
        .env("PHQ_FAKE_NVML_SCENARIO", &s.quiet_scenario)
        .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
        .env_remove("NOTIFY_SOCKET")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let events =
        |p: &Platform| -> Vec<Value> { p.received().iter().filter_map(|r| r.body.get("event").cloned()).collect() };
    let statuses = |p: &Platform| p.received().iter().filter(|r| r.body.get("event").is_none()).count();
    // The two real Xids, then a periodic status after them: everything the log held was judged.
    let deadline = Instant::now() + Duration::from_secs(30);
    while (events(&platform).len() < 2 || statuses(&platform) == 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = agent.kill();
    let _ = agent.wait();
    let got = events(&platform);
    let mut xids: Vec<(String, u64)> = got
        .iter()
        .filter(|e| e["kind"] == "xid")
        .map(|e| (e["gpu"].as_str().unwrap().to_string(), e["xid"].as_u64().unwrap()))
        .collect();
    xids.sort();
    assert_eq!(xids, vec![("0000:0c:00.0".into(), 79), ("0000:0d:00.0".into(), 13)], "{got:#?}");
    assert!(got.iter().all(|e| e["kind"] != "sxid"), "a forged SXid was pushed: {got:#?}");
    let status = platform.received().into_iter().rev().find(|r| r.body.get("event").is_none()).unwrap();
    let e = status.body["findings"].as_array().unwrap();
    assert!(
        !e.iter().any(|f| f["gpu"] == "0000:0e:00.0" && f["id"] == "gpu.xid" && f["severity"] != "pass"),
        "the forged Xid 48 reached the pushed status"
    );
}

#[test]
fn kernel_log_xids_from_before_the_agent_are_sent_once() {
    let platform = Platform::start();
    let s = setup(platform.port, 0, 20);
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let run = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_phq-agent"))
            .args(["serve", "--config"])
            .arg(&s.cfg)
            .arg("--sysroot")
            .arg(repo().join("tests/fixtures/sysroots/hgx-8gpu-xid79"))
            .arg("--nvml-lib")
            .arg(fake_nvml())
            .env("PHQ_FAKE_NVML_SCENARIO", &s.quiet_scenario)
            .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
            .env_remove("NOTIFY_SOCKET")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    let kernel_events = |p: &Platform| -> Vec<(String, u64, u64)> {
        p.received()
            .iter()
            .filter(|r| r.body["event"]["source"] == "kernel-log")
            .map(|r| {
                let e = &r.body["event"];
                (e["gpu"].as_str().unwrap().to_string(), e["xid"].as_u64().unwrap(), e["count"].as_u64().unwrap())
            })
            .collect()
    };
    let mut agent = run();
    let deadline = Instant::now() + Duration::from_secs(20);
    while kernel_events(&platform).len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = agent.kill();
    let _ = agent.wait();
    let mut got = kernel_events(&platform);
    got.sort();
    assert_eq!(got, vec![("0000:0c:00.0".into(), 79, 1), ("0000:0d:00.0".into(), 13, 1)]);

    let mut again = run();
    let statuses = |p: &Platform| p.received().iter().filter(|r| r.body.get("event").is_none()).count();
    let before = statuses(&platform);
    let deadline = Instant::now() + Duration::from_secs(20);
    while statuses(&platform) == before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = again.kill();
    let _ = again.wait();
    assert_eq!(kernel_events(&platform).len(), 2, "a restart sent them again");
}
