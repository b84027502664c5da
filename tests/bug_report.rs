//! NVIDIA's `nvidia-bug-report.sh` log in the support bundle (issue 42), with stand-in scripts
//! this test writes and names through `PHQ_BUG_REPORT_SCRIPT`: a log that fits goes in as
//! `nvidia-bug-report.log.gz`; a script that hangs is killed with everything it started at the
//! deadline, one that fails or writes past the cap is a note; the service writes a bundle with
//! the log for a fatal Xid and none for one that only restarts an application.

mod common;

use common::*;
use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The gzip'd log the stand-in copies into place: `gzip -c` of "stand-in nvidia-bug-report\n".
fn small_gz(dir: &Path) -> (PathBuf, Vec<u8>) {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, b"stand-in nvidia-bug-report\n").unwrap();
    let bytes = gz.finish().unwrap();
    let path = dir.join("prepared.log.gz");
    std::fs::write(&path, &bytes).unwrap();
    (path, bytes)
}

/// A stand-in script: checks it is called as the agent must call it (`--safe-mode
/// --output-file FILE`), then runs `body` with the output file in `$out`.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    let text = format!(
        "#!/bin/sh\n[ \"$1\" = --safe-mode ] && [ \"$2\" = --output-file ] && [ $# -eq 3 ] || {{ echo \"called as: $*\"; exit 2; }}\nout=\"$3\"\n{body}\n"
    );
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// `doctor --bundle` over the healthy fixture and the fake NVML with `script` named (or none).
fn doctor_bundle(dir: &Path, script: Option<&Path>, timeout: &str) -> (PathBuf, Output) {
    let bundle = dir.join("bundle.tar.gz");
    std::fs::write(dir.join("config.toml"), format!("[agent]\nstate_dir = {:?}\n", dir.join("state"))).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_phq-agent"));
    cmd.args(["doctor", "--bundle"])
        .arg(&bundle)
        .arg("--config")
        .arg(dir.join("config.toml"))
        .arg("--sysroot")
        .arg(repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy"))
        .arg("--nvml-lib")
        .arg(fake_nvml())
        .env("PHQ_FAKE_NVML_SCENARIO", repo().join("examples/scenarios/hgx-8gpu-healthy.json"))
        .env("PHQ_BUG_REPORT_TIMEOUT", timeout)
        .env("TMPDIR", dir);
    match script {
        Some(s) => cmd.env("PHQ_BUG_REPORT_SCRIPT", s),
        None => cmd.env_remove("PHQ_BUG_REPORT_SCRIPT"),
    };
    let out = cmd.output().unwrap();
    assert!(bundle.exists(), "no bundle: {}", String::from_utf8_lossy(&out.stderr));
    (bundle, out)
}

/// The bundle's members by name.
fn members(bundle: &Path) -> Vec<(String, Vec<u8>)> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(std::fs::File::open(bundle).unwrap()));
    archive
        .entries()
        .unwrap()
        .map(|e| {
            let mut e = e.unwrap();
            let name = e.path().unwrap().to_string_lossy().into_owned();
            let mut buf = Vec::new();
            e.read_to_end(&mut buf).unwrap();
            (name, buf)
        })
        .collect()
}

fn member(bundle: &Path, name: &str) -> Option<Vec<u8>> {
    members(bundle).into_iter().find(|(n, _)| n == name).map(|(_, b)| b)
}

fn notes(bundle: &Path) -> Vec<String> {
    let manifest: Value = serde_json::from_slice(&member(bundle, "manifest.json").unwrap()).unwrap();
    manifest["notes"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect()
}

/// No private directory of the script's is left in `dir`.
fn no_work_dirs(dir: &Path) {
    let left: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".bug-report-"))
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn a_small_log_goes_into_the_bundle() {
    let dir = tempfile::tempdir().unwrap();
    let (prepared, bytes) = small_gz(dir.path());
    let s = script(dir.path(), "bug.sh", &format!("cp {:?} \"$out.gz\"", prepared));
    let (bundle, _) = doctor_bundle(dir.path(), Some(&s), "60s");
    assert_eq!(member(&bundle, "nvidia-bug-report.log.gz").as_deref(), Some(&bytes[..]), "notes: {:?}", notes(&bundle));
    let notes = notes(&bundle);
    assert!(
        notes.iter().any(|n| n.starts_with("nvidia-bug-report.log.gz: ") && n.contains("--safe-mode")),
        "{notes:?}"
    );
    no_work_dirs(dir.path());
}

#[test]
fn a_script_that_hangs_is_killed_with_its_children_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    // The script and a child it leaves running (in its process group), both sleeping "forever".
    let s = script(dir.path(), "hang.sh", &format!("sleep 1000 &\necho $$ $! > {:?}\nsleep 1000", pids));
    let started = Instant::now();
    let (bundle, _) = doctor_bundle(dir.path(), Some(&s), "2s");
    let took = started.elapsed();
    assert!(member(&bundle, "nvidia-bug-report.log.gz").is_none());
    let notes = notes(&bundle);
    assert!(
        notes.iter().any(|n| n.contains("did not finish within 2s") && n.contains("process group was killed")),
        "{notes:?}"
    );
    // Not a timing assertion: a bundle that waited for the script would have taken 1000 s.
    assert!(took < Duration::from_secs(600), "the bundle waited for the script: {took:?}");
    let pids = std::fs::read_to_string(&pids).unwrap();
    for pid in pids.split_whitespace() {
        // A killed orphan is reaped by init; give it the time that takes, then it must be gone.
        let proc = PathBuf::from(format!("/proc/{pid}"));
        let until = Instant::now() + Duration::from_secs(30);
        while alive(&proc) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(!alive(&proc), "process {pid} of the script is still running");
    }
    no_work_dirs(dir.path());
}

/// Running (a zombie counts as gone: it runs nothing).
fn alive(proc: &Path) -> bool {
    std::fs::read_to_string(proc.join("stat"))
        .is_ok_and(|s| s.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

#[test]
fn a_log_past_the_cap_is_left_out_and_said() {
    let dir = tempfile::tempdir().unwrap();
    // 32 MiB is the cap; one byte more, sparse.
    let s = script(dir.path(), "big.sh", "truncate -s 33554433 \"$out.gz\"");
    let (bundle, _) = doctor_bundle(dir.path(), Some(&s), "60s");
    assert!(member(&bundle, "nvidia-bug-report.log.gz").is_none());
    let notes = notes(&bundle);
    assert!(notes.iter().any(|n| n.contains("left out: 33554433 bytes, more than the 33554432")), "{notes:?}");
    no_work_dirs(dir.path());
}

#[test]
fn a_failing_script_is_a_note_with_its_last_line() {
    let dir = tempfile::tempdir().unwrap();
    let s = script(dir.path(), "fail.sh", "echo 'ERROR: Please run nvidia-bug-report.sh as root.'\nexit 1");
    let (bundle, _) = doctor_bundle(dir.path(), Some(&s), "60s");
    assert!(member(&bundle, "nvidia-bug-report.log.gz").is_none());
    let notes = notes(&bundle);
    assert!(notes.iter().any(|n| n.contains("failed (exit status: 1)") && n.ends_with("as root.")), "{notes:?}");
}

#[test]
fn a_fixtures_script_is_never_run() {
    let dir = tempfile::tempdir().unwrap();
    let (bundle, _) = doctor_bundle(dir.path(), None, "60s");
    assert!(member(&bundle, "nvidia-bug-report.log.gz").is_none());
    let notes = notes(&bundle);
    assert!(notes.iter().any(|n| n.contains("--sysroot names another machine")), "{notes:?}");
}

/// The service: Xid 13 (RESTART_APP in NVIDIA's catalog) on one GPU, then Xid 79 (fallen off
/// the bus, RESTART_BM) on another: one bundle, for the 79, holding the stand-in's log; the 13
/// (earlier, and not rate-limited by anything before it) made none.
#[test]
fn a_fatal_xid_makes_a_bundle_with_the_log_and_a_non_fatal_one_none() {
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let (prepared, bytes) = small_gz(dir.path());
    let ran = dir.path().join("ran");
    let s = script(dir.path(), "bug.sh", &format!("echo run >> {ran:?}\ncp {prepared:?} \"$out.gz\""));
    let mut scenario: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("examples/scenarios/hgx-8gpu-healthy.json")).unwrap(),
    )
    .unwrap();
    scenario["devices"][2]["xid_events"] = serde_json::json!([{"xid": 13, "after_ms": 1500}]);
    scenario["devices"][3]["xid_events"] = serde_json::json!([{"xid": 79, "after_ms": 4000}]);
    let scenario_path = dir.path().join("scenario.json");
    std::fs::write(&scenario_path, serde_json::to_vec(&scenario).unwrap()).unwrap();
    let cfg = service_config(dir.path(), "t0ken-bug-report", "[probes]\nat_boot = \"none\"\n");
    let mut cmd = serve_command(&cfg, &scenario_path, &bus);
    cmd.env("PHQ_BUG_REPORT_SCRIPT", &s).env("PHQ_BUG_REPORT_TIMEOUT", "60s");
    let mut agent = Killed(cmd.spawn().unwrap());
    let port = listening_port(&mut agent.0).expect("the service listens");
    let bundles = dir.path().join("state/bundles");
    let until = Instant::now() + Duration::from_secs(90);
    let found = loop {
        let names: Vec<String> = std::fs::read_dir(&bundles)
            .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        if names.iter().any(|n| n.ends_with(".tar.gz")) || Instant::now() > until {
            break names;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let made: Vec<&String> = found.iter().filter(|n| n.ends_with(".tar.gz")).collect();
    assert_eq!(made.len(), 1, "one bundle, for the fatal Xid: {found:?}");
    assert!(made[0].starts_with("xid79-"), "{found:?}");
    let bundle = bundles.join(made[0]);
    assert_eq!(member(&bundle, "nvidia-bug-report.log.gz").as_deref(), Some(&bytes[..]), "notes: {:?}", notes(&bundle));
    assert!(member(&bundle, "report.json").is_some());
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "run\n", "the script ran once, for the 79 alone");
    // The 13 did reach the service (so "none for it" is not a missed Xid).
    let (_, metrics) = get_with_token(port, "/metrics", "t0ken-bug-report");
    assert!(
        metrics.lines().any(|l| l.starts_with("phq_gpu_xid_errors_total{") && l.contains("xid=\"13\"")),
        "{metrics}"
    );
}

/// The service goes on while the script hangs: Xid 79 starts a bundle whose script sleeps; while
/// it does, /healthz answers and a later Xid still reaches the metrics (the event task is not
/// waiting on the script); at the deadline the bundle is made and says the script timed out.
#[test]
fn a_hanging_script_never_holds_up_the_service() {
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let s = script(dir.path(), "hang.sh", &format!("echo $$ > {started:?}\nsleep 1000"));
    let mut scenario: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("examples/scenarios/hgx-8gpu-healthy.json")).unwrap(),
    )
    .unwrap();
    scenario["devices"][3]["xid_events"] = serde_json::json!([{"xid": 79, "after_ms": 1500}]);
    scenario["devices"][2]["xid_events"] = serde_json::json!([{"xid": 13, "after_ms": 4000}]);
    let scenario_path = dir.path().join("scenario.json");
    std::fs::write(&scenario_path, serde_json::to_vec(&scenario).unwrap()).unwrap();
    let cfg = service_config(dir.path(), "t0ken-bug-report", "[probes]\nat_boot = \"none\"\n");
    let mut cmd = serve_command(&cfg, &scenario_path, &bus);
    // Long enough that the 13 comes while the script still sleeps.
    cmd.env("PHQ_BUG_REPORT_SCRIPT", &s).env("PHQ_BUG_REPORT_TIMEOUT", "20s");
    let mut agent = Killed(cmd.spawn().unwrap());
    let port = listening_port(&mut agent.0).expect("the service listens");
    let until = Instant::now() + Duration::from_secs(60);
    while !started.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(started.exists(), "the fatal Xid did not start the script");
    let script_pid = std::fs::read_to_string(&started).unwrap().trim().to_string();
    let has_13 = |m: &str| m.lines().any(|l| l.starts_with("phq_gpu_xid_errors_total{") && l.contains("xid=\"13\""));
    let mut metrics = String::new();
    while !has_13(&metrics) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
        metrics = get_with_token(port, "/metrics", "t0ken-bug-report").1;
    }
    assert!(has_13(&metrics), "the Xid after the fatal one never reached the metrics");
    assert!(alive(&PathBuf::from(format!("/proc/{script_pid}"))), "the script should still be sleeping");
    // It answers (503: the GPU fell off the bus).
    assert_eq!(get_with_token(port, "/healthz", "").0, 503);
    // Then the deadline: the bundle, saying so, and the script gone.
    let bundles = dir.path().join("state/bundles");
    let bundle = loop {
        let found = std::fs::read_dir(&bundles).ok().and_then(|rd| {
            rd.filter_map(|e| e.ok()).map(|e| e.path()).find(|p| p.to_string_lossy().ends_with(".tar.gz"))
        });
        if let Some(b) = found {
            break b;
        }
        assert!(Instant::now() < until + Duration::from_secs(60), "no bundle after the script's deadline");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(member(&bundle, "nvidia-bug-report.log.gz").is_none());
    let notes = notes(&bundle);
    assert!(notes.iter().any(|n| n.contains("did not finish within 20s")), "{notes:?}");
    assert!(!alive(&PathBuf::from(format!("/proc/{script_pid}"))), "the script outlived its deadline");
}

/// A service that stops while the script runs leaves nothing of it behind: the script and the
/// child it started are killed with their group.
#[test]
fn a_service_that_stops_takes_the_script_with_it() {
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let s = script(
        dir.path(),
        "hang.sh",
        &format!("sleep 1000 &\necho $$ $! > {pids:?}.tmp\nmv {pids:?}.tmp {pids:?}\nwait"),
    );
    let mut scenario: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("examples/scenarios/hgx-8gpu-healthy.json")).unwrap(),
    )
    .unwrap();
    scenario["devices"][3]["xid_events"] = serde_json::json!([{"xid": 79, "after_ms": 1500}]);
    let scenario_path = dir.path().join("scenario.json");
    std::fs::write(&scenario_path, serde_json::to_vec(&scenario).unwrap()).unwrap();
    let cfg = service_config(dir.path(), "t0ken-bug-report", "[probes]\nat_boot = \"none\"\n");
    let mut cmd = serve_command(&cfg, &scenario_path, &bus);
    cmd.env("PHQ_BUG_REPORT_SCRIPT", &s).env("PHQ_BUG_REPORT_TIMEOUT", "10m");
    let mut agent = Killed(cmd.spawn().unwrap());
    let until = Instant::now() + Duration::from_secs(60);
    while !pids.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    let pids = std::fs::read_to_string(&pids).expect("the fatal Xid started the script");
    // SAFETY (of intent): the pid is our own child's.
    unsafe { libc::kill(agent.0.id() as i32, libc::SIGTERM) };
    let status = agent.0.wait().unwrap();
    assert!(status.success(), "{status}");
    for pid in pids.split_whitespace() {
        let proc = PathBuf::from(format!("/proc/{pid}"));
        let until = Instant::now() + Duration::from_secs(30);
        while alive(&proc) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(!alive(&proc), "process {pid} of the script outlived the service");
    }
}

/// The kernel log's own record of a fatal Xid makes a bundle too (NVML, blocked by the fault, may
/// say nothing): Xid 13 and then Xid 79 as the driver writes them, and a non-fatal SXid after
/// them, whose first-of-its-kind asks for the snapshot that reads them. One bundle, for the 79;
/// the kernel log's Xids from before the start made none.
#[test]
fn a_fatal_xid_in_the_kernel_log_makes_a_bundle() {
    use std::io::Write;
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let root = copy_sysroot("hgx-8gpu-healthy", dir.path());
    // A fatal Xid already in the log at start: the bundle, if any, must not be for it.
    let mut kmsg = std::fs::OpenOptions::new().append(true).open(root.join("dev/kmsg")).unwrap();
    writeln!(kmsg, "3,7000,9000000000,-;NVRM: Xid (PCI:0000:09:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.").unwrap();
    let (prepared, bytes) = small_gz(dir.path());
    let s = script(dir.path(), "bug.sh", &format!("cp {prepared:?} \"$out.gz\""));
    let scenario = repo().join("examples/scenarios/hgx-8gpu-healthy.json");
    let cfg = service_config(dir.path(), "t0ken-bug-report", "[probes]\nat_boot = \"none\"\n");
    let mut cmd = serve_command_on(&root, &cfg, &scenario, &bus);
    cmd.env("PHQ_BUG_REPORT_SCRIPT", &s).env("PHQ_BUG_REPORT_TIMEOUT", "60s");
    let mut agent = Killed(cmd.spawn().unwrap());
    listening_port(&mut agent.0).expect("the service listens");
    writeln!(kmsg, "3,7001,9100000000,-;NVRM: Xid (PCI:0000:0a:00): 13, pid=4242, name=python3, Graphics Exception: ESR 0x404490=0x80000001").unwrap();
    writeln!(kmsg, "3,7002,9100000100,-;NVRM: Xid (PCI:0000:0c:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.").unwrap();
    writeln!(kmsg, "4,7003,9200000000,-;nvidia-nvswitch3: SXid (PCI:0000:14:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)").unwrap();
    let bundles = dir.path().join("state/bundles");
    let until = Instant::now() + Duration::from_secs(90);
    let made = loop {
        let made: Vec<String> = std::fs::read_dir(&bundles)
            .map(|rd| {
                rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect::<Vec<String>>()
            })
            .unwrap_or_default()
            .into_iter()
            .filter(|n: &String| n.ends_with(".tar.gz"))
            .collect();
        if !made.is_empty() || Instant::now() > until {
            break made;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(made.len(), 1, "{made:?}");
    assert!(made[0].starts_with("xid79-"), "{made:?}");
    assert_eq!(member(&bundles.join(&made[0]), "nvidia-bug-report.log.gz").as_deref(), Some(&bytes[..]));
}

/// The log is taken only as the regular file the script wrote: a link in its place (to a file
/// the agent could read and the script's user should not) is left out and said.
#[test]
fn a_link_in_place_of_the_log_is_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, b"not for the bundle").unwrap();
    let s = script(dir.path(), "link.sh", &format!("ln -s {secret:?} \"$out.gz\""));
    let (bundle, _) = doctor_bundle(dir.path(), Some(&s), "60s");
    assert!(member(&bundle, "nvidia-bug-report.log.gz").is_none());
    let notes = notes(&bundle);
    assert!(notes.iter().any(|n| n.contains("left out:")), "{notes:?}");
}

/// `phq-agent bug-report --out DIR`, the root helper's command, with the stand-in `script`.
fn helper(out: &Path, script: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["bug-report", "--reader", "root", "--out"])
        .arg(out)
        .env("PHQ_BUG_REPORT_SCRIPT", script)
        .env("PHQ_BUG_REPORT_TIMEOUT", "60s")
        .output()
        .unwrap()
}

/// The root side: the log written into its directory (0640, through no link planted at its
/// name), the status saying so; a second request within 30 minutes refused without running the
/// script; a link in the directory's own place refused outright.
#[test]
fn the_root_helper_writes_the_log_refuses_a_second_run_and_never_follows_a_link() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (prepared, bytes) = small_gz(dir.path());
    let ran = dir.path().join("ran");
    let s = script(dir.path(), "bug.sh", &format!("echo run >> {ran:?}\ncp {prepared:?} \"$out.gz\""));
    let out = dir.path().join("helper");
    std::fs::create_dir(&out).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o750)).unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    std::os::unix::fs::symlink(&victim, out.join("nvidia-bug-report.log.gz")).unwrap();

    let first = helper(&out, &s);
    assert_eq!(first.status.code(), Some(0), "{}", String::from_utf8_lossy(&first.stderr));
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious", "written through the planted link");
    let log = std::fs::symlink_metadata(out.join("nvidia-bug-report.log.gz")).unwrap();
    assert!(log.is_file() && log.permissions().mode() & 0o777 == 0o640, "{log:?}");
    assert_eq!(std::fs::read(out.join("nvidia-bug-report.log.gz")).unwrap(), bytes);
    assert!(std::fs::read_to_string(out.join("status")).unwrap().starts_with("ok\n"));
    no_work_dirs(&out);

    let second = helper(&out, &s);
    assert_eq!(second.status.code(), Some(2), "{}", String::from_utf8_lossy(&second.stderr));
    let status = std::fs::read_to_string(out.join("status")).unwrap();
    assert!(status.starts_with("refused\n") && status.contains("at most once per 30 min"), "{status}");
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "run\n", "the script ran again within the interval");

    let linked = dir.path().join("linked");
    std::os::unix::fs::symlink(dir.path().join("elsewhere"), &linked).unwrap();
    std::fs::create_dir(dir.path().join("elsewhere")).unwrap();
    let third = helper(&linked, &s);
    assert_eq!(third.status.code(), Some(3), "{}", String::from_utf8_lossy(&third.stderr));
    assert!(String::from_utf8_lossy(&third.stderr).contains("a symbolic link"), "{third:?}");
    assert_eq!(std::fs::read_dir(dir.path().join("elsewhere")).unwrap().count(), 0);
}

/// The service as the shipped unit runs it (not root: `PHQ_BUG_REPORT_VIA=helper`): a fatal Xid
/// rings the helper's doorbell; this test plays `phq-agent-bug-report.path` (it watches the
/// request and runs the real `phq-agent bug-report` as root), and the bundle holds the log the
/// helper's stand-in wrote. The service itself is given no script: the log can only be the
/// helper's.
#[test]
fn a_service_that_is_not_root_takes_the_log_from_the_root_helper() {
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let (prepared, bytes) = small_gz(dir.path());
    let s = script(dir.path(), "bug.sh", &format!("cp {prepared:?} \"$out.gz\""));
    // The helper's directory, as the package's tmpfiles entry makes it.
    let out = dir.path().join("helper");
    std::fs::create_dir(&out).unwrap();
    let mut scenario: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("examples/scenarios/hgx-8gpu-healthy.json")).unwrap(),
    )
    .unwrap();
    scenario["devices"][3]["xid_events"] = serde_json::json!([{"xid": 79, "after_ms": 1000}]);
    let scenario_path = dir.path().join("scenario.json");
    std::fs::write(&scenario_path, serde_json::to_vec(&scenario).unwrap()).unwrap();
    let cfg = service_config(dir.path(), "t0ken-bug-report", "[probes]\nat_boot = \"none\"\n");
    let mut cmd = serve_command(&cfg, &scenario_path, &bus);
    cmd.env_remove("PHQ_BUG_REPORT_SCRIPT")
        .env("PHQ_BUG_REPORT_VIA", "helper")
        .env("PHQ_BUG_REPORT_HELPER_DIR", &out)
        .env("PHQ_BUG_REPORT_TIMEOUT", "60s");
    let mut agent = Killed(cmd.spawn().unwrap());
    listening_port(&mut agent.0).expect("the service listens");
    // systemd's part: the request appears (or changes), the helper runs.
    let request = dir.path().join("state/bug-report.request");
    let until = Instant::now() + Duration::from_secs(60);
    while !request.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(request.exists(), "the fatal Xid did not ring the helper");
    let answered = helper(&out, &s);
    assert_eq!(answered.status.code(), Some(0), "{}", String::from_utf8_lossy(&answered.stderr));
    let bundles = dir.path().join("state/bundles");
    let bundle = loop {
        let found = std::fs::read_dir(&bundles).ok().and_then(|rd| {
            rd.filter_map(|e| e.ok()).map(|e| e.path()).find(|p| p.to_string_lossy().ends_with(".tar.gz"))
        });
        if let Some(b) = found {
            break b;
        }
        assert!(Instant::now() < until, "no bundle after the helper answered");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(member(&bundle, "nvidia-bug-report.log.gz").as_deref(), Some(&bytes[..]), "notes: {:?}", notes(&bundle));
    let notes = notes(&bundle);
    assert!(notes.iter().any(|n| n.contains("from the root helper")), "{notes:?}");
}

/// An NVSwitch's SXid the Fabric Manager guide lists as fatal makes a bundle as a fatal Xid does;
/// one it lists as non-fatal makes none. The non-fatal 12028 comes first: had it made a bundle,
/// the rate limit would have refused the fatal 12001's, and the one bundle would be 12028's.
#[test]
fn a_fatal_sxid_makes_a_bundle_and_a_non_fatal_one_none() {
    use std::io::Write;
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let root = copy_sysroot("hgx-8gpu-healthy", dir.path());
    let mut kmsg = std::fs::OpenOptions::new().append(true).open(root.join("dev/kmsg")).unwrap();
    let (prepared, bytes) = small_gz(dir.path());
    let s = script(dir.path(), "bug.sh", &format!("cp {prepared:?} \"$out.gz\""));
    let scenario = repo().join("examples/scenarios/hgx-8gpu-healthy.json");
    let cfg = service_config(dir.path(), "t0ken-bug-report", "[probes]\nat_boot = \"none\"\n");
    let mut cmd = serve_command_on(&root, &cfg, &scenario, &bus);
    cmd.env("PHQ_BUG_REPORT_SCRIPT", &s).env("PHQ_BUG_REPORT_TIMEOUT", "60s").env("PHQ_BUG_REPORT_VIA", "self");
    let mut agent = Killed(cmd.spawn().unwrap());
    listening_port(&mut agent.0).expect("the service listens");
    writeln!(kmsg, "4,7003,9200000000,-;nvidia-nvswitch3: SXid (PCI:0000:14:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)").unwrap();
    writeln!(kmsg, "2,7004,9300000000,-;nvidia-nvswitch1: SXid (PCI:0000:12:00.0): 12001, Fatal, Link 08 egress crossbar overflow (First)").unwrap();
    let bundles = dir.path().join("state/bundles");
    let until = Instant::now() + Duration::from_secs(60);
    let made = loop {
        let made: Vec<String> = std::fs::read_dir(&bundles)
            .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_else(|_| Vec::new())
            .into_iter()
            .filter(|n: &String| n.ends_with(".tar.gz"))
            .collect();
        if !made.is_empty() || Instant::now() > until {
            break made;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(made.len(), 1, "{made:?}");
    assert!(made[0].starts_with("sxid12001-"), "{made:?}");
    assert_eq!(member(&bundles.join(&made[0]), "nvidia-bug-report.log.gz").as_deref(), Some(&bytes[..]));
}

/// The home-directory walk of NVIDIA's `nvidia-bug-report.sh` as the R580 script has it
/// (580.126.09, `$Change: 37062940 $`, MIT licence), with the functions it reads each file
/// through, around this stand-in's own start and end. Each `[ -f ]` and `[ -r ]` follows a link,
/// and `cat` reads it as root.
const NVIDIA_HOME_WALK: &str = r#"
report_file() {
    echo "____________________________________________"
    echo ""
    if [ ! -f "$1" ]; then
        echo "*** $1 does not exist"
    elif [ ! -r "$1" ]; then
        echo "*** $1 is not readable"
    else
        echo "*** $1"
        echo_metadata "$1"
        cat  "$1"
    fi
    echo ""
}
append() {
    report_file "$1" | $GZIP_CMD >> $LOG_FILENAME
}
append_silent() {
    (
        if [ -f "$1" -a -r "$1" ]; then
            echo "____________________________________________"
            echo ""
            echo "*** $1"
            echo_metadata "$1"
            cat  "$1"
            echo ""
        fi
    ) | $GZIP_CMD >> $LOG_FILENAME
}
append_glob() {
    for append_glob_iterator in `ls $1 2> /dev/null;`; do
        report_file "$append_glob_iterator"
    done | $GZIP_CMD >> $LOG_FILENAME
}
append_file_or_dir_silent() {
    if [ -f "$1" ]; then
        append "$1"
    elif [ -d "$1" ]; then
        append_glob "$1/*"
    fi
}
echo_metadata() {
    printf "*** ls: "
    /bin/ls -l --full-time "$1" 2> /dev/null
}

# Append any config files found in home directories
cat /etc/passwd \
    | cut -d : -f 6 \
    | sort | uniq \
    | while read DIR; do
        append_file_or_dir_silent "$DIR/.nv/nvidia-application-profiles-rc"
        append_file_or_dir_silent "$DIR/.nv/nvidia-application-profiles-rc.backup"
        append_file_or_dir_silent "$DIR/.nv/nvidia-application-profiles-rc.d"
        append_file_or_dir_silent "$DIR/.nv/nvidia-application-profiles-rc.d.backup"
        append_silent "$DIR/.nv/nvidia-application-profile-globals-rc"
        append_silent "$DIR/.nv/nvidia-application-profile-globals-rc.backup"
        append_silent "$DIR/.nvidia-settings-rc"

        for f in "$DIR/.config/vulkan/icd.d/*" \
                 "$DIR/.config/vulkansc/icd.d/*" \
                 "$DIR/.local/share/vulkan/icd.d/*" \
                 "$DIR/.local/share/vulkansc/icd.d/*"; do
            append_silent $f
        done
    done
"#;

/// Every place in a home that NVIDIA's walk reads (`NVIDIA_HOME_WALK`), as a link to a secret of
/// its own; the rc.d directories hold a link, and the rc.d.backup is a link to such a directory.
fn plant_links(home: &Path, secrets: &Path) -> Vec<String> {
    let mut planted = vec![];
    let mut link = |at: &str| {
        let name = at.replace('/', "_");
        let secret = secrets.join(&name);
        std::fs::write(&secret, format!("SECRET{name}\n")).unwrap();
        let path = home.join(at);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&secret, &path).unwrap();
        planted.push(format!("SECRET{name}"));
    };
    for at in [
        ".nv/nvidia-application-profiles-rc",
        ".nv/nvidia-application-profiles-rc.backup",
        ".nv/nvidia-application-profiles-rc.d/a",
        ".nv/nvidia-application-profile-globals-rc",
        ".nv/nvidia-application-profile-globals-rc.backup",
        ".nvidia-settings-rc",
        ".config/vulkan/icd.d/a",
        ".config/vulkansc/icd.d/a",
        ".local/share/vulkan/icd.d/a",
        ".local/share/vulkansc/icd.d/a",
    ] {
        link(at);
    }
    let elsewhere = secrets.join("rc.d.backup");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::write(elsewhere.join("b"), "SECRET_rc.d.backup\n").unwrap();
    std::os::unix::fs::symlink(&elsewhere, home.join(".nv/nvidia-application-profiles-rc.d.backup")).unwrap();
    planted.push("SECRET_rc.d.backup".into());
    planted
}

/// Hole 1 of issue 51: the root helper runs NVIDIA's script for the service, whose user owns its
/// home; that user (and any other) plants links in every place the script's home walk reads, to
/// files only root may read. The guest here is this machine with its own `/etc/passwd` (bound
/// over the real one in a mount namespace of the test's making) naming the service's user and a
/// tenant's user with those homes. The log the helper leaves for the service holds none of the
/// secrets: the script saw a passwd of root alone.
#[test]
fn the_root_helper_walks_no_users_home_for_the_service() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if unsafe { libc::geteuid() } != 0 {
        return skip("needs root: a mount namespace, and the script's own root check");
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let secrets = dir.path().join("secrets");
    std::fs::create_dir(&secrets).unwrap();
    std::fs::set_permissions(&secrets, std::fs::Permissions::from_mode(0o700)).unwrap();
    let (service_home, tenant_home) = (dir.path().join("var-lib-phq-agent"), dir.path().join("home-tenant"));
    let mut planted = plant_links(&service_home, &secrets);
    std::fs::create_dir(&tenant_home).unwrap();
    std::fs::write(tenant_home.join("secret"), "SECRET_tenant\n").unwrap();
    std::os::unix::fs::symlink(tenant_home.join("secret"), tenant_home.join(".nvidia-settings-rc")).unwrap();
    planted.push("SECRET_tenant".into());
    let real = std::fs::read_to_string("/etc/passwd").unwrap();
    let guest_passwd = dir.path().join("passwd");
    std::fs::write(
        &guest_passwd,
        format!(
            "{real}phq-agent:x:998:998:phq-agent GPU health agent:{}:/usr/sbin/nologin\ntenant:x:1000:1000::{}:/bin/bash\n",
            service_home.display(),
            tenant_home.display()
        ),
    )
    .unwrap();
    let body = format!(
        "[ `id -u` -ne 0 ] && {{ echo \"ERROR: Please run $(basename $0) as root.\"; exit 1; }}\nLOG_FILENAME=\"$out\"\nGZIP_CMD=cat\n: > \"$LOG_FILENAME\"\n{NVIDIA_HOME_WALK}\necho \"homes: $(cut -d : -f 6 /etc/passwd | sort | uniq | tr '\\n' ' ')\" >> \"$LOG_FILENAME\"\ngzip -c \"$LOG_FILENAME\" > \"$out.gz\""
    );
    let s = script(dir.path(), "nvidia-bug-report.sh", &body);
    let out = dir.path().join("helper");
    std::fs::create_dir(&out).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o750)).unwrap();

    let passwd = std::ffi::CString::new(guest_passwd.to_str().unwrap()).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_phq-agent"));
    cmd.args(["bug-report", "--reader", "root", "--out"])
        .arg(&out)
        .env("PHQ_BUG_REPORT_SCRIPT", &s)
        .env("PHQ_BUG_REPORT_TIMEOUT", "60s");
    // SAFETY: system calls only, on C strings made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let none = std::ptr::null();
            if libc::unshare(libc::CLONE_NEWNS) != 0
                || libc::mount(none, c"/".as_ptr(), none, libc::MS_REC | libc::MS_PRIVATE, none.cast()) != 0
                || libc::mount(passwd.as_ptr(), c"/etc/passwd".as_ptr(), none, libc::MS_BIND, none.cast()) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let ran = cmd.output().unwrap();
    assert_eq!(ran.status.code(), Some(0), "{}", String::from_utf8_lossy(&ran.stderr));
    let status = std::fs::read_to_string(out.join("status")).unwrap();
    assert!(status.starts_with("ok\n"), "{status}");
    let mut log = String::new();
    flate2::read::GzDecoder::new(&std::fs::read(out.join("nvidia-bug-report.log.gz")).unwrap()[..])
        .read_to_string(&mut log)
        .unwrap();
    let homes = log.lines().find(|l| l.starts_with("homes: ")).unwrap_or_else(|| panic!("{log}"));
    let leaked: Vec<&String> = planted.iter().filter(|p| log.contains(p.as_str())).collect();
    assert!(leaked.is_empty(), "the root script copied {leaked:?} into the service's log; it walked {homes}\n{log}");
    assert!(!homes.contains(&*service_home.to_string_lossy()), "{homes}");
    assert!(homes.contains("/root"), "root's own home is still walked: {homes}");
}
