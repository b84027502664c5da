//! The service in a hostile world, attacked over loopback as any pod of a cluster without a
//! default-deny NetworkPolicy could attack it. Every loop here is bounded in count and time,
//! and every address is on 127.0.0.0/8: the attackers bind source addresses of that range
//! (127.0.0.2, 127.0.1.x) so the agent sees other clients than the readiness probe (127.0.0.1).

mod common;

use common::*;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::os::fd::FromRawFd;
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "tok-hostile-0123456789abcdef";

/// The flood and the storm each load both cores of a small machine: they take turns, so that
/// neither judges the agent by the other's load.
static HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());

struct Agent {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
    _bus: PrivateBus,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The service over the healthy 8-GPU fixture and fake NVML, on a port the kernel picks, once
/// `/healthz` answers with a snapshot behind it. None: a skip (no dbus-daemon).
fn start() -> Option<Agent> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = service_config(dir.path(), TOKEN, "[probes]\nat_boot = \"none\"\n");
    let bus = PrivateBus::start(HEALTHY_UNITS)?;
    let mut child = serve_command(&cfg, &repo().join("examples/scenarios/hgx-8gpu-healthy.json"), &bus)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let port = listening_port(&mut child).expect("the agent listens");
    let deadline = Instant::now() + Duration::from_secs(30);
    while healthz(port, Duration::from_secs(2)).is_none_or(|(code, _)| code == 503) {
        assert!(Instant::now() < deadline, "the agent never published a snapshot");
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(Agent { child, port, _dir: dir, _bus: bus })
}

/// A TCP connection to 127.0.0.1:`port` from source address `from` (any of 127.0.0.0/8).
fn connect_from(from: Ipv4Addr, port: u16) -> std::io::Result<TcpStream> {
    let sockaddr = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor this function owns; the sockaddr_in values
    // live across the calls; on failure the descriptor is closed before returning.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let src = sockaddr(SocketAddrV4::new(from, 0));
        let dst = sockaddr(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
        if libc::bind(fd, (&src as *const libc::sockaddr_in).cast(), len) != 0
            || libc::connect(fd, (&dst as *const libc::sockaddr_in).cast(), len) != 0
        {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            return Err(e);
        }
        Ok(TcpStream::from_raw_fd(fd))
    }
}

/// GET /healthz from 127.0.0.1 within `limit`: (status, how long it took), or None.
fn healthz(port: u16, limit: Duration) -> Option<(u16, Duration)> {
    let t = Instant::now();
    let mut s = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), limit).ok()?;
    s.set_read_timeout(Some(limit.saturating_sub(t.elapsed()).max(Duration::from_millis(1)))).ok()?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: vm\r\nConnection: close\r\n\r\n").ok()?;
    let mut r = String::new();
    s.read_to_string(&mut r).ok()?;
    let code = r.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, t.elapsed()))
}

/// The agent's resident memory, from /proc.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

/// What one hostile connection does.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Connects and sends nothing.
    Idle,
    /// Sends half a request head, then nothing (slowloris).
    Partial,
    /// Sends a whole request every 4 s on one kept-alive connection.
    KeepAlive,
}

/// `n` hostile connections from `from`, kept up for `run_for`: each one the agent closes is
/// opened again at once (the churn that kept the old server locked out). Returns how many
/// connections it opened in all.
fn attack(from: Ipv4Addr, port: u16, n: usize, run_for: Duration) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let kinds = [Kind::Idle, Kind::Partial, Kind::KeepAlive];
        let open = |kind: Kind| -> Option<(TcpStream, Instant)> {
            let mut s = connect_from(from, port).ok()?;
            s.set_nonblocking(true).ok()?;
            match kind {
                Kind::Idle => {}
                Kind::Partial => {
                    let _ = s.write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n");
                }
                Kind::KeepAlive => {
                    let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
                }
            }
            Some((s, Instant::now()))
        };
        let mut conns: Vec<(Kind, Option<(TcpStream, Instant)>)> =
            (0..n).map(|i| (kinds[i % 3], open(kinds[i % 3]))).collect();
        let mut opened = n;
        let end = Instant::now() + run_for;
        let mut buf = [0u8; 4096];
        while Instant::now() < end {
            for (kind, conn) in conns.iter_mut() {
                let closed = match conn {
                    None => true,
                    Some((s, last)) => {
                        let closed = match s.read(&mut buf) {
                            Ok(0) => true,
                            Ok(_) => false,
                            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                        };
                        if !closed && *kind == Kind::KeepAlive && last.elapsed() >= Duration::from_secs(4) {
                            let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
                            *last = Instant::now();
                        }
                        closed
                    }
                };
                if closed {
                    *conn = open(*kind);
                    opened += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        opened
    })
}

/// Probes /healthz every 200 ms for `run_for`; returns (probes, the slowest, failures).
fn probe_healthz(port: u16, run_for: Duration) -> (usize, Duration, Vec<String>) {
    let (mut probes, mut slowest, mut failures) = (0, Duration::ZERO, vec![]);
    let end = Instant::now() + run_for;
    while Instant::now() < end {
        let at = Instant::now();
        match healthz(port, Duration::from_secs(1)) {
            Some((200, took)) => slowest = slowest.max(took),
            other => failures.push(format!("probe {probes}: {other:?} after {:.2?}", at.elapsed())),
        }
        probes += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    (probes, slowest, failures)
}

fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit on a local struct.
    unsafe {
        let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

/// The bar of issue #14: 1,000 hostile connections from one address (idle, half-sent and
/// kept-alive, reopened as soon as they are closed) for 60 s; `/healthz` from another address
/// answers 200 within 1 s every time, and the agent's memory stays bounded.
#[test]
fn a_thousand_connections_from_one_address_never_lock_out_healthz() {
    let _turn = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    raise_fd_limit();
    let Some(agent) = start() else { return };
    let rss_before = rss_kib(agent.child.id());
    let run_for = Duration::from_secs(60);
    let attacker = attack(Ipv4Addr::new(127, 0, 0, 2), agent.port, 1000, run_for);
    std::thread::sleep(Duration::from_millis(500)); // the first thousand are in
    let (probes, slowest, failures) = probe_healthz(agent.port, run_for - Duration::from_millis(500));
    let opened = attacker.join().unwrap();
    let rss_after = rss_kib(agent.child.id());
    eprintln!(
        "{probes} probes, slowest {slowest:.2?}; the attacker opened {opened} connections; agent RSS {rss_before} → {rss_after} KiB"
    );
    assert!(failures.is_empty(), "/healthz failed {} of {probes} times: {failures:#?}", failures.len());
    assert!(probes >= 200, "only {probes} probes ran");
    // Bounded: the connection table holds at most MAX_CONNECTIONS, each with a 16 KiB buffer.
    assert!(rss_after < rss_before + 64 * 1024, "RSS grew from {rss_before} to {rss_after} KiB");
}

/// Many addresses together fill the table (a botnet of pods): a newcomer still gets in, in
/// place of an idle connection.
#[test]
fn a_full_table_of_idle_connections_makes_room_for_healthz() {
    raise_fd_limit();
    let Some(agent) = start() else { return };
    let total = phq_agent::serve::http::MAX_CONNECTIONS + 44;
    let mut held = vec![];
    for i in 0..total {
        let from = Ipv4Addr::new(127, 0, 1 + (i / 250) as u8, 1 + (i % 250) as u8);
        if let Ok(s) = connect_from(from, agent.port) {
            held.push(s);
        }
    }
    std::thread::sleep(Duration::from_millis(300)); // all accepted and registered
    for n in 0..10 {
        let got = healthz(agent.port, Duration::from_secs(1));
        assert!(matches!(got, Some((200, _))), "probe {n} with {} idle connections held: {got:?}", held.len());
    }
}

fn mkfifo(path: &std::path::Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo {}", path.display());
}

/// Waits for `child` at most `limit`; kills it and fails if it is still running.
fn wait_at_most(child: &mut Child, limit: Duration, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A FIFO where a file should be (in the tree doctor reads, as the service's token) is a clear
/// error at once: opened blocking, it would wait for a writer that never comes.
#[test]
fn a_fifo_where_a_file_should_be_is_an_error_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy"))
        .arg(&root)
        .status()
        .unwrap();
    assert!(status.success());
    mkfifo(&root.join("proc/uptime")); // the fixture has none; the agent reads it
    std::fs::remove_file(root.join("proc/modules")).unwrap();
    mkfifo(&root.join("proc/modules"));
    let mut doctor = std::process::Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["doctor", "--json", "--sysroot"])
        .arg(&root)
        .arg("--config")
        .arg(repo().join("tests/fixtures/config/empty/config.toml"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_at_most(&mut doctor, Duration::from_secs(30), "doctor over a tree with a FIFO at /proc/uptime");

    let token = dir.path().join("token");
    mkfifo(&token);
    let cfg = dir.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "[agent]\nstate_dir = \"{}\"\n[http]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n",
            dir.path().join("state").display(),
            token.display()
        ),
    )
    .unwrap();
    let mut serve = std::process::Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["serve", "--config"])
        .arg(&cfg)
        .arg("--sysroot")
        .arg(repo().join("tests/fixtures/sysroots/no-gpu"))
        .env_remove("NOTIFY_SOCKET")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_at_most(&mut serve, Duration::from_secs(30), "serve with a FIFO as its token");
    let mut err = String::new();
    serve.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert_eq!(status.code(), Some(3), "{err}");
    assert!(err.contains("token") && err.contains("FIFO"), "{err}");

    // A character device as the token (it once grew the agent to 4 GB reading /dev/zero).
    std::fs::write(&cfg, std::fs::read_to_string(&cfg).unwrap().replace(token.to_str().unwrap(), "/dev/zero")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["serve", "--config"])
        .arg(&cfg)
        .arg("--sysroot")
        .arg(repo().join("tests/fixtures/sysroots/no-gpu"))
        .env_remove("NOTIFY_SOCKET")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("/dev/zero") && err.contains("character device"), "{err}");
}

/// `phq-agent token` runs as root before the service starts. A link planted where a token file
/// should be (the directory may be one the service's user can write) is refused, and its target
/// is neither chowned nor chmodded nor written.
#[test]
fn token_never_follows_a_planted_symlink() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
    let token = dir.path().join("token");
    std::os::unix::fs::symlink(&victim, &token).unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "[http]\ntoken_file = \"{}\"\n[platform]\ntoken_file = \"{}\"\n",
            token.display(),
            dir.path().join("platform-token").display()
        ),
    )
    .unwrap();
    // The user running the test owns everything here, so the hand-over would be allowed.
    // SAFETY: getpwuid returns a pointer into static storage, read at once.
    let me =
        unsafe { std::ffi::CStr::from_ptr((*libc::getpwuid(libc::geteuid())).pw_name) }.to_str().unwrap().to_string();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["token", "--owner", &me, "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("symbolic link"), "{err}");
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(&victim).unwrap();
    assert_eq!((meta.mode() & 0o777, std::fs::read_to_string(&victim).unwrap().as_str()), (0o644, "precious\n"));
}

/// A stop asked for while the first snapshot is still being taken (NVML attaching GPUs, here
/// 30 s of it) is obeyed at once, not after the snapshot.
#[test]
fn sigterm_during_a_slow_first_snapshot_stops_at_once() {
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut s: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("examples/scenarios/hgx-8gpu-healthy.json")).unwrap(),
    )
    .unwrap();
    s["init_delay_ms"] = 30_000.into();
    let scenario = dir.path().join("slow.json");
    std::fs::write(&scenario, serde_json::to_vec(&s).unwrap()).unwrap();
    let cfg = service_config(dir.path(), TOKEN, "");
    let mut child = serve_command(&cfg, &scenario, &bus).spawn().unwrap();
    listening_port(&mut child).expect("it listens before the first snapshot");
    std::thread::sleep(Duration::from_millis(300)); // inside nvmlInit_v2 now
    let asked = Instant::now();
    // SAFETY: kill on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = wait_at_most(&mut child, Duration::from_secs(10), "serve after SIGTERM");
    assert_eq!(status.code(), Some(0));
    eprintln!("stopped {:.2?} after SIGTERM, during a 30 s first snapshot", asked.elapsed());
}

/// A TCP port on 127.0.0.1 that refuses every connection for as long as the returned socket is
/// held: bound, never listening, so nothing else can take the port meanwhile.
fn refusing_port() -> (std::os::fd::OwnedFd, u16) {
    use std::os::fd::FromRawFd;
    // SAFETY: socket/bind/getsockname on a descriptor this function owns and hands back.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let mut a = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr { s_addr: u32::from(Ipv4Addr::LOCALHOST).to_be() },
            sin_zero: [0; 8],
        };
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        assert_eq!(libc::bind(fd, (&a as *const libc::sockaddr_in).cast(), len), 0);
        assert_eq!(libc::getsockname(fd, (&mut a as *mut libc::sockaddr_in).cast(), &mut len), 0);
        (std::os::fd::OwnedFd::from_raw_fd(fd), u16::from_be(a.sin_port))
    }
}

/// The storm of issue #14: 12,000 Xids in 12 s on two GPUs (three codes each) while the
/// platform refuses every connection. The watchdog keeps being pinged, the spool stays small,
/// the reports say how many Xids were merged, and every one of the 12,000 is accounted for in
/// the spooled events' counts once their windows close.
#[test]
fn an_xid_storm_with_the_platform_down_keeps_the_watchdog_and_loses_no_xid() {
    const XIDS: u64 = 12_000;
    let _turn = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let (_held, platform_port) = refusing_port();
    let dir = tempfile::tempdir().unwrap();
    let mut s: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("examples/scenarios/hgx-8gpu-healthy.json")).unwrap(),
    )
    .unwrap();
    for (device, codes) in [(3usize, [13u64, 31, 43]), (4, [13, 31, 94])] {
        s["devices"][device]["xid_events"] = (0..XIDS / 2)
            .map(|i| serde_json::json!({"xid": codes[(i % 3) as usize], "after_ms": 500 + 2 * i}))
            .collect();
    }
    let scenario = dir.path().join("storm.json");
    std::fs::write(&scenario, serde_json::to_vec(&s).unwrap()).unwrap();
    std::fs::write(dir.path().join("platform-token"), "platform-secret-0123456789\n").unwrap();
    let state = dir.path().join("state");
    let cfg = service_config(
        dir.path(),
        TOKEN,
        &format!(
            "[platform]\nurl = \"http://127.0.0.1:{platform_port}\"\ntoken_file = \"{}\"\n[probes]\nat_boot = \"none\"\n",
            dir.path().join("platform-token").display()
        ),
    );
    let notify_path = dir.path().join("notify");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    const WATCHDOG: Duration = Duration::from_secs(4);
    let mut child = serve_command(&cfg, &scenario, &bus)
        .env("NOTIFY_SOCKET", &notify_path)
        .env("WATCHDOG_USEC", WATCHDOG.as_micros().to_string())
        .spawn()
        .unwrap();
    let _agent = Agent {
        port: listening_port(&mut child).expect("listens"),
        child,
        _dir: tempfile::tempdir().unwrap(),
        _bus: bus,
    };

    // Spooled Xids and their counts, as the platform would get them.
    let spooled = || -> (u64, usize, u64) {
        let mut counted = 0;
        let (mut files, mut bytes) = (0, 0);
        for e in std::fs::read_dir(state.join("spool")).into_iter().flatten().flatten() {
            if !e.file_name().to_string_lossy().ends_with(".json") {
                continue;
            }
            let body = std::fs::read(e.path()).unwrap_or_default();
            files += 1;
            bytes += body.len() as u64;
            let r: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            if r["event"]["kind"] == "xid" {
                counted += r["event"]["count"].as_u64().unwrap_or(1);
            }
        }
        (counted, files, bytes)
    };
    let (mut ready_at, mut last_ping, mut worst_gap) = (None, None::<Instant>, Duration::ZERO);
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        if let Ok(n) = notify.recv(&mut buf) {
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            if msg.contains("READY=1") {
                ready_at = Some(Instant::now());
                last_ping = ready_at;
            }
            if msg.contains("WATCHDOG=1") {
                if let Some(prev) = last_ping {
                    worst_gap = worst_gap.max(prev.elapsed());
                }
                last_ping = Some(Instant::now());
            }
        }
        if let Some(prev) = last_ping {
            worst_gap = worst_gap.max(prev.elapsed());
        }
        if spooled().0 >= XIDS {
            break;
        }
    }
    let (counted, files, bytes) = spooled();
    assert!(ready_at.is_some(), "never ready");
    let xid_events = std::fs::read_dir(state.join("spool"))
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_to_string(e.path()).is_ok_and(|t| t.contains("\"kind\":\"xid\"")))
        .count() as u64;
    // A report from after the storm (SIGHUP takes a snapshot at once) says what was merged.
    // SAFETY: kill on our own child's pid.
    unsafe { libc::kill(_agent.child.id() as i32, libc::SIGHUP) };
    let status = || -> serde_json::Value {
        let mut s = TcpStream::connect(("127.0.0.1", _agent.port)).unwrap();
        write!(s, "GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut r = String::new();
        s.read_to_string(&mut r).unwrap();
        serde_json::from_str(r.split_once("\r\n\r\n").unwrap().1).unwrap()
    };
    let settled = Instant::now() + Duration::from_secs(15);
    let mut report = status();
    while report["agent"]["events"]["merged"] != XIDS - xid_events && Instant::now() < settled {
        std::thread::sleep(Duration::from_millis(200));
        report = status();
    }
    validate(&report);
    let events = &report["agent"]["events"];
    eprintln!(
        "{XIDS} Xids → {files} spooled events ({xid_events} of them Xids), {bytes} bytes; counts sum to {counted}; merged {}, dropped {}; worst watchdog gap {worst_gap:.2?}",
        events["merged"], events["dropped"]
    );
    assert_eq!(counted, XIDS, "every Xid is in some event's count");
    assert!(files < 200, "{files} events for a storm of repeats");
    assert!(bytes < 4 << 20, "{bytes} bytes spooled (the bound is 64 MiB; a storm of repeats needs a few KB)");
    assert_eq!(events["dropped"], 0);
    assert_eq!(events["merged"], XIDS - xid_events, "each Xid without an event of its own is counted as merged");
    assert!(worst_gap < WATCHDOG, "the watchdog went {worst_gap:?} without a ping (WatchdogSec {WATCHDOG:?})");
}

/// Issue 51 hole 4: 16 addresses × 16 connections, each the head of an unauthenticated
/// `POST /v1/probes` that promises a body and sends none. Once they held all 256 slots as busy
/// (the body was read before the token was checked, for up to the connection's 60 s life) and
/// `/healthz` went unanswered. Now each is refused on its head (401) and never busy, so
/// `/healthz` and an authenticated `/v1/status` answer beside them; and the control token's holder who
/// promises a body and stalls gets 408 after `BODY_TIMEOUT`, not the connection's whole life.
#[test]
fn unauthenticated_posts_never_hold_the_table() {
    raise_fd_limit();
    let Some(agent) = start() else { return };
    let head = "POST /v1/probes HTTP/1.1\r\nHost: vm\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n";
    let mut held = vec![];
    for a in 0..16u8 {
        for _ in 0..phq_agent::serve::http::MAX_PER_PEER {
            let mut s = connect_from(Ipv4Addr::new(127, 0, 2, 1 + a), agent.port).unwrap();
            s.write_all(head.as_bytes()).unwrap();
            held.push(s);
        }
    }
    std::thread::sleep(Duration::from_millis(500)); // every head read
    for n in 0..10 {
        let got = healthz(agent.port, Duration::from_secs(1));
        assert!(matches!(got, Some((200, _))), "probe {n} beside {} unauthenticated POSTs: {got:?}", held.len());
    }
    let mut first = String::new();
    held[0].set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = held[0].read_to_string(&mut first);
    assert!(first.starts_with("HTTP/1.1 401"), "an unauthenticated POST was not refused on its head: {first:?}");
    let mut s = TcpStream::connect(("127.0.0.1", agent.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET /v1/status HTTP/1.1\r\nHost: vm\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut r = String::new();
    let _ = s.read_to_string(&mut r);
    assert!(r.starts_with("HTTP/1.1 200"), "{}", r.lines().next().unwrap_or(""));

    // The control token's holder who stalls its body: 408 at BODY_TIMEOUT.
    let mut s = TcpStream::connect(("127.0.0.1", agent.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let t = Instant::now();
    let control = control_token_of(TOKEN);
    write!(
        s,
        "POST /v1/probes HTTP/1.1\r\nHost: vm\r\nAuthorization: Bearer {control}\r\nContent-Length: 20\r\n\r\n{{"
    )
    .unwrap();
    let mut r = String::new();
    let _ = s.read_to_string(&mut r);
    assert!(r.starts_with("HTTP/1.1 408"), "{r:?} after {:.1?}", t.elapsed());
}

/// Issue 51 hole 7: the guest's root can write the history file; `phq-agent history --json`
/// prints its strings with every control character (C1, DEL, the bidirectional overrides) as a
/// JSON escape, so the values survive and no terminal acts on them, as the table mode does.
#[test]
fn history_json_prints_no_terminal_controls() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let hostile = "GPU\u{9b}2J\u{1b}]0;owned\u{7}\u{7f}\u{202e}lairesgnp\u{2066}x";
    let history = serde_json::json!({
        "schema": "phq.history/v1",
        "faults": [{
            "serial": hostile, "gpu": "0000:0c:00.0", "check": "gpu.xid", "code": "79",
            "boots": [{"boot_id": "b\u{85}1", "first": "2026-12-06T00:00:00Z", "last": "2026-12-06T00:00:00Z", "count": 1}],
            "first_seen": "2026-12-06T00:00:00Z", "last_seen": "2026-12-06T00:00:00Z"
        }]
    });
    std::fs::write(state.join("history.json"), serde_json::to_vec(&history).unwrap()).unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, format!("[agent]\nstate_dir = {:?}\n", state)).unwrap();
    for json in [true, false] {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_phq-agent"));
        cmd.args(["history", "--config"]).arg(&cfg);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        let bad: Vec<char> = text.chars().filter(|c| phq_agent::text::unprintable(*c) && *c != '\n').collect();
        assert!(bad.is_empty(), "--json {json}: {bad:?} reached stdout: {text}");
        if json {
            let back: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(back["faults"][0]["serial"], hostile, "the value itself survives");
        }
    }
}
