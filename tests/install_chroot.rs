//! The slow tier: the real `phq-agent install` inside a real Debian 12 root, against a real apt
//! and a signed repository of stand-in packages served on 127.0.0.1 (tests/common/debian.rs).
//!
//! The root comes from `debootstrap --variant=minbase bookworm` (cached under
//! target/phq-debian). Its /proc, /sys and /dev/kmsg are the files of the HGX fixture guest
//! (8 H100 SXM, 4 NVSwitches), so the installer plans for that machine while apt and dpkg do
//! their real work on the root.
//!
//! Needs root and debootstrap; skipped with a note outside CI when either is missing.

mod common;

use common::debian::*;
use common::install::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const KERNEL: &str = "6.1.0-27-cloud-amd64";
const DRIVER: &str = STANDIN_DRIVER;

fn base_root() -> PathBuf {
    debootstrap_cached("bookworm-minbase")
}

/// A fresh copy of the base root with the HGX guest's /proc, /sys and kmsg, and the agent in it.
fn guest_root(work: &Path, repo_dir: &Path, repo_url: &str, fingerprint: &str) -> PathBuf {
    let root = work.join("root");
    let started = Instant::now();
    sh("cp", &["-a", base_root().to_str().unwrap(), root.to_str().unwrap()]);
    // Only the stand-ins: apt in the root must not reach Debian's mirrors. Its Debian source is
    // the stand-in archive with `main` alone; the installer adds contrib, where the driver's
    // `nvidia-support` is.
    debian_archive_source(&root, repo_dir, repo_url);
    // The running kernel's image is installed, as on any VM (debootstrap's minbase has none).
    let image = repo_dir.join(format!("debian/pool/main/linux-image-{KERNEL}_0~phq-1_all.deb"));
    sh("dpkg", &["--root", root.to_str().unwrap(), "-i", image.to_str().unwrap()]);
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sysroots/debian12-hgx-fresh");
    for sub in ["proc", "sys"] {
        sh("cp", &["-a", &format!("{}/{sub}/.", fixture.display()), root.join(sub).to_str().unwrap()]);
    }
    sh("cp", &[fixture.join("dev/kmsg").to_str().unwrap(), root.join("dev/kmsg").to_str().unwrap()]);
    sh("cp", &[env!("CARGO_BIN_EXE_phq-agent"), root.join("usr/bin/phq-agent").to_str().unwrap()]);
    std::fs::create_dir_all(root.join("etc/phq-agent")).unwrap();
    std::fs::write(
        root.join("etc/phq-agent/config.toml"),
        // The stand-in repository is served on loopback over plain http: allowed explicitly, as
        // an operator would for such a mirror (apt still checks its signed index).
        format!("[install]\ncuda = \"12.9\"\ndriver_branch = \"580\"\nrepo_url = \"{repo_url}\"\nrepo_key_fingerprint = \"{fingerprint}\"\nallow_plain_http = true\n"),
    )
    .unwrap();
    eprintln!("timing: root copied in {:.1} s", started.elapsed().as_secs_f64());
    root
}

/// `org.freedesktop.login1` on a private dbus-daemon listening where the root's system bus
/// lives: records each `Reboot(interactive)` and reboots nothing.
struct Logind {
    calls: std::sync::Arc<std::sync::Mutex<Vec<bool>>>,
    daemon: std::process::Child,
    _service: zbus::blocking::Connection,
}

struct Login1Manager {
    calls: std::sync::Arc<std::sync::Mutex<Vec<bool>>>,
}

#[zbus::interface(name = "org.freedesktop.login1.Manager")]
impl Login1Manager {
    fn reboot(&self, interactive: bool) {
        self.calls.lock().unwrap().push(interactive);
    }
}

impl Logind {
    fn start(root: &Path) -> Logind {
        let socket = root.join("run/dbus/system_bus_socket");
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        let _ = std::fs::remove_file(&socket);
        let (daemon, address) = common::dbus_daemon(&socket);
        let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let service = zbus::blocking::connection::Builder::address(address.as_str())
            .unwrap()
            .name("org.freedesktop.login1")
            .unwrap()
            .serve_at("/org/freedesktop/login1", Login1Manager { calls: calls.clone() })
            .unwrap()
            .build()
            .unwrap();
        Logind { calls, daemon, _service: service }
    }
}

impl Drop for Logind {
    fn drop(&mut self) {
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
    }
}

fn chroot_out(root: &Path, args: &[&str]) -> String {
    let out =
        Command::new("chroot").arg(root).args(args).env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Installed packages and their hold marks, as dpkg has them: what a person would compare.
fn dpkg_state(root: &Path) -> String {
    let mut s = chroot_out(root, &["dpkg-query", "-W", "-f=${db:Status-Abbrev} ${Package} ${Version}\\n"]);
    s.push_str(&chroot_out(root, &["apt-mark", "showhold"]));
    s
}

fn nvidia_state(root: &Path) -> Vec<String> {
    let s = dpkg_state(root);
    let mut v: Vec<String> = s
        .lines()
        .filter(|l| ["nvidia", "libnvidia", "cuda", "linux-headers"].iter().any(|p| l.contains(p)))
        .map(str::to_string)
        .collect();
    v.sort();
    v
}

fn journal(root: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(root.join("var/lib/phq-agent-install/state.json")).unwrap()).unwrap()
}

/// The installer runs as root; the service's user owns `/var/lib/phq-agent`. Links planted at
/// every path root once wrote there (the install journal, its lock and log) and in root's own
/// journal directory leave their target untouched, and a journal the service's user writes
/// there never starts an install: the real binary, as root, in a real root.
#[test]
fn install_as_root_follows_no_link_planted_where_another_user_writes() {
    if !runnable("the planted-link install test", &["debootstrap", "chroot"]) {
        return;
    }
    let work = tempfile::Builder::new().prefix("phq-links-").tempdir_in(target_dir()).unwrap();
    let root = work.path().join("root");
    sh("cp", &["-a", base_root().to_str().unwrap(), root.to_str().unwrap()]);
    sh("cp", &[env!("CARGO_BIN_EXE_phq-agent"), root.join("usr/bin/phq-agent").to_str().unwrap()]);
    std::fs::write(root.join("etc/victim"), "precious\n").unwrap();
    let victim = || std::fs::read_to_string(root.join("etc/victim")).unwrap();
    let service = root.join("var/lib/phq-agent");
    std::fs::create_dir_all(service.join("install")).unwrap();
    for planted in ["install/lock", "install/log", "probe.lock"] {
        std::os::unix::fs::symlink("/etc/victim", service.join(planted)).unwrap();
    }
    // Where the old unit looked, a journal that asks for a resume, as the service's user could
    // write it: not root's, so nothing is resumed.
    std::fs::write(service.join("install/state.json"), "{\"schema\": \"phq.install/v1\", \"status\": \"rebooting\"}\n")
        .unwrap();
    let resume = install(&root, &["--resume"]);
    assert_eq!(resume.code, Some(0), "{}", resume.stderr);
    assert!(resume.stderr.contains("no install has run here; nothing to resume"), "{}", resume.stderr);
    assert_eq!(victim(), "precious\n");

    // Root's own directory, with links planted in it (as if it had been left open): refused,
    // named, and the target untouched.
    let journal = root.join("var/lib/phq-agent-install");
    for name in ["lock", "log"] {
        let _ = std::fs::remove_file(journal.join(name));
        std::os::unix::fs::symlink("/etc/victim", journal.join(name)).unwrap();
    }
    let refused = install(&root, &["--resume"]);
    assert_eq!(refused.code, Some(3), "{}", refused.stderr);
    assert!(refused.stderr.contains("lock: is a symbolic link"), "{}", refused.stderr);
    assert_eq!(victim(), "precious\n");
    // A directory others can write is refused whole.
    std::fs::remove_file(journal.join("lock")).unwrap();
    sh("chmod", &["0777", journal.to_str().unwrap()]);
    let open = install(&root, &["--resume"]);
    assert_eq!(open.code, Some(3), "{}", open.stderr);
    assert!(open.stderr.contains("open to others"), "{}", open.stderr);
    assert_eq!(victim(), "precious\n");
}

#[test]
fn installs_on_a_real_apt_is_idempotent_and_survives_kill_9_at_every_step() {
    if !runnable("the chroot install test", &["debootstrap", "dpkg-deb", "apt-ftparchive", "gpg", "chroot", "objcopy"])
    {
        return;
    }
    let t0 = Instant::now();
    base_root();
    eprintln!("timing: base root ready after {:.1} s", t0.elapsed().as_secs_f64());
    let work = tempfile::Builder::new().prefix("phq-chroot-").tempdir_in(target_dir()).unwrap();
    let repo_dir = work.path().join("repo");
    let fpr = build_repo(&repo_dir, KERNEL);
    let port = serve(repo_dir.clone()).port;
    let url = format!("http://127.0.0.1:{port}");

    // --- A clean install. ---
    std::fs::create_dir_all(work.path().join("clean")).unwrap();
    std::fs::create_dir_all(work.path().join("killed")).unwrap();
    let clean = guest_root(&work.path().join("clean"), &repo_dir, &url, &fpr);

    // First with the repository unreachable: bounded retries, then the URL in a finding.
    let t = Instant::now();
    let offline = install(&clean, &["--repo-url", "http://127.0.0.1:9"]);
    assert_eq!(offline.code, Some(2), "{}", offline.stderr);
    assert!(offline.stderr.contains("install.unreachable"), "{}", offline.stderr);
    assert!(
        offline.stderr.contains("http://127.0.0.1:9/debian12/x86_64/cuda-keyring_1.1-1_all.deb"),
        "{}",
        offline.stderr
    );
    assert!(offline.stderr.contains("tried 4 times"), "{}", offline.stderr);
    eprintln!("timing: unreachable repository reported after {:.1} s", t.elapsed().as_secs_f64());

    // A toolkit the repository does not have (CUDA 12.6; the stand-in has 12.9): the pre-flight
    // resolves every package with apt-get -s and stops, naming it, before any is installed.
    let t = Instant::now();
    let lacking = install(&clean, &["--cuda", "12.6"]);
    assert_eq!(lacking.code, Some(2), "{}", lacking.stderr);
    assert!(
        lacking.stderr.contains("pre-flight: the repositories cannot install cuda-toolkit-12-6; nothing was installed"),
        "{}",
        lacking.stderr
    );
    // The repository's key and the branch lock come before the pre-flight (it resolves with
    // the pin in place); nothing else may be installed.
    let after: Vec<String> =
        nvidia_state(&clean).into_iter().filter(|l| !l.contains("nvidia-driver-pinning-580")).collect();
    assert!(after.is_empty(), "installed before the pre-flight refused: {after:?}");
    eprintln!("timing: pre-flight refusal after {:.1} s", t.elapsed().as_secs_f64());

    let t = Instant::now();
    let first = install(&clean, &[]);
    let first_s = t.elapsed().as_secs_f64();
    assert_eq!(first.code, Some(1), "reboot required (exit 1) expected:\n{}", first.stderr);
    assert!(first.stderr.contains("a reboot is required"), "{}", first.stderr);
    let installed = nvidia_state(&clean);
    let want = [
        "hi  nvidia-driver-cuda 580.82.07-1".to_string(),
        "hi  cuda-toolkit-12-9 12.9.1-1".into(),
        "hi  libnvidia-nscq 580.82.07-1".into(),
        "hi  nvidia-fabricmanager 580.82.07-1".into(),
        "hi  nvidia-kernel-open-dkms 580.82.07-1".into(),
        "hi  nvidia-persistenced 580.82.07-1".into(),
        // NCCL: the newest build for the toolkit's CUDA (12.9), held; not CUDA 13.0's, the
        // newest there is, nor a newer one for 12.4.
        format!("hi  libnccl2 {NCCL_FOR_TOOLKIT}"),
        // NVIDIA's branch lock, installed before the driver.
        "ii  nvidia-driver-pinning-580 580-1".into(),
        // From the Debian archive's contrib, which the installer enabled.
        "ii  nvidia-support 20220217+3~deb12u1".into(),
        // Held with the driver: DKMS built the module for this kernel only.
        format!("ii  linux-headers-{KERNEL} 6.1.112-1"),
        // The flavour's metas: Debian's way to the headers (one ABI per flavour in its archive).
        "hi  linux-headers-cloud-amd64 6.1.112-1".into(),
    ];
    for w in &want {
        assert!(installed.contains(w), "missing {w:?} in {installed:#?}\n{}", first.stderr);
    }
    // The keyring package gave its key and nothing else: never installed, its postinst never
    // run, its extra `[trusted=yes]` source never written; apt trusts the verified key alone,
    // written by the installer where the source it wrote names it.
    assert!(!installed.iter().any(|l| l.contains("cuda-keyring")), "{installed:#?}");
    assert!(!clean.join(KEYRING_POSTINST_MARKER).exists(), "the keyring package's postinst ran");
    assert!(!clean.join(KEYRING_EXTRA_SOURCE).exists(), "the keyring package's extra source landed");
    let key = std::fs::read(clean.join("etc/apt/keyrings/phq-nvidia-cuda.gpg")).unwrap();
    assert!(phq_agent::install::pgp::verified(&key, &fpr).is_ok());
    let source = std::fs::read_to_string(clean.join("etc/apt/sources.list.d/cuda-debian12-x86_64.list")).unwrap();
    assert!(
        source.contains(&format!("deb [signed-by=/etc/apt/keyrings/phq-nvidia-cuda.gpg] {url}/debian12/x86_64/ /")),
        "{source}"
    );
    // contrib and non-free-firmware were added beside the archive's own main-only source.
    let components =
        std::fs::read_to_string(clean.join("etc/apt/sources.list.d/phq-debian-components.sources")).unwrap();
    assert!(components.contains(&format!("URIs: {url}/debian\nSuites: bookworm\nComponents: contrib non-free-firmware\nSigned-By: /{ARCHIVE_KEYRING}\n")), "{components}");
    // The pinning package beat the 590 driver; fabric manager is the driver's version, not the newest.
    assert!(!installed.iter().any(|l| l.contains("590.") || l.contains("580.95")), "{installed:#?}");
    for unit in ["nvidia-persistenced.service", "nvidia-fabricmanager.service"] {
        // The link points into the root, so it is read, not followed, from here.
        let link = clean.join("etc/systemd/system/multi-user.target.wants").join(unit);
        assert!(std::fs::symlink_metadata(&link).is_ok(), "{unit} not enabled");
    }
    assert_eq!(
        std::fs::read_to_string(clean.join("etc/modprobe.d/blacklist-nouveau.conf")).unwrap(),
        "blacklist nouveau\noptions nouveau modeset=0\n"
    );
    let j = journal(&clean);
    assert_eq!(j["status"], "reboot-required");
    assert_eq!(j["schema"], "phq.install/v1");

    // A second run changes nothing.
    let before = dpkg_state(&clean);
    let t = Instant::now();
    let second = install(&clean, &[]);
    let second_s = t.elapsed().as_secs_f64();
    assert_eq!(second.code, Some(1), "{}", second.stderr);
    assert!(!second.stderr.contains("$ "), "the second run ran commands:\n{}", second.stderr);
    assert_eq!(dpkg_state(&clean), before);

    // With --reboot auto the pending reboot goes to logind: a stand-in on a system bus whose
    // socket is the root's /run/dbus/system_bus_socket takes the call.
    let logind = Logind::start(&clean);
    let rebooting = install(&clean, &["--reboot", "auto"]);
    assert_eq!(rebooting.code, Some(0), "{}", rebooting.stderr);
    assert!(rebooting.stderr.contains("rebooting; the install resumes after it"), "{}", rebooting.stderr);
    assert_eq!(*logind.calls.lock().unwrap(), [false], "Reboot(interactive=false), once");
    assert_eq!(journal(&clean)["status"], "rebooting");
    drop(logind);

    // "Reboot": a new boot id and the driver loaded. The resumed install verifies and is done.
    std::fs::write(clean.join("proc/sys/kernel/random/boot_id"), "0b7e1d2c-3a4f-4b5e-8c6d-7e8f9a0b1c2d\n").unwrap();
    let modules = std::fs::read_to_string(clean.join("proc/modules")).unwrap();
    std::fs::write(clean.join("proc/modules"), format!("nvidia 56799232 0 - Live 0x0000000000000000 (OE)\n{modules}"))
        .unwrap();
    std::fs::create_dir_all(clean.join("proc/driver/nvidia")).unwrap();
    std::fs::write(
        clean.join("proc/driver/nvidia/version"),
        format!("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {DRIVER}  Release Build  (dvs-builder@U16-I3-B03-4-3)  Fri May 31 09:38:15 UTC 2024\n"),
    )
    .unwrap();
    let third = install(&clean, &[]);
    let j = journal(&clean);
    assert_eq!(j["status"], "done", "{}", third.stderr);
    assert_eq!(j["reboots"], 1);
    assert!(third.stderr.contains("verify"), "{}", third.stderr);
    assert!(!third.stderr.contains("$ "), "nothing may be reinstalled after the reboot:\n{}", third.stderr);
    // The doctor shows the install in its report.
    let doctor = chroot_out(&clean, &["/usr/bin/phq-agent", "doctor", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&doctor).unwrap();
    assert_eq!(report["install"]["status"], "done");

    // --- kill -9 at every step, then a rerun converges to the same packages. ---
    let killed = guest_root(&work.path().join("killed"), &repo_dir, &url, &fpr);
    let steps = ["repo", "headers", "nouveau", "driver", "persistenced", "fabricmanager", "toolkit", "nccl", "hold"];
    let t = Instant::now();
    let mut kills = 0;
    let mut transcript = String::new();
    for (i, step) in steps.iter().enumerate() {
        let marker = killed.join("tmp/phq-dkms-building");
        let mut refused = None;
        let (seen, kill) = install_killed_in(&killed, step, (*step == "driver").then_some(marker.as_path()), || {
            // A second installer while the first holds the lock (inside dpkg) is refused.
            refused = Some(install(&killed, &[]));
        });
        assert_ne!(kill, Kill::NotReached, "never reached step {step}:\n{seen}");
        kills += (kill == Kill::Running) as u32;
        let when = match (kill, *step) {
            (Kill::Running, "driver") => "inside the driver's postinst (the DKMS build)",
            (Kill::Running, _) => "while its first command ran",
            _ => "as it said it was already done",
        };
        transcript
            .push_str(&format!("--- run {} (SIGKILL to the process group in step {step}, {when})\n{seen}", i + 1));
        if *step == "driver" {
            // Every earlier run was killed inside an earlier step, so the driver step runs here.
            assert_eq!(kill, Kill::Running, "{seen}");
            let r = refused.expect("the second installer ran");
            assert_eq!(r.code, Some(3), "{}", r.stderr);
            assert!(r.stderr.contains("another phq-agent install is running"), "{}", r.stderr);
        }
    }
    let last = install(&killed, &[]);
    transcript.push_str(&format!("--- final run\n{}", last.stderr));
    eprintln!("{transcript}");
    assert_eq!(last.code, Some(1), "after {kills} kills the install must converge:\n{}", last.stderr);
    // A kill inside dpkg (the driver's postinst) left a package half-configured; a later run
    // saw it and repaired it first.
    assert!(transcript.contains("] repair: finish what dpkg left half-done"), "no run had to repair:\n{transcript}");
    assert_eq!(nvidia_state(&killed), installed, "killed root differs from the clean one\n{}", last.stderr);
    let again = install(&killed, &[]);
    assert!(!again.stderr.contains("$ "), "{}", again.stderr);

    // --- A toolkit the repository has no NCCL build for (CUDA 12.8): everything else is
    // installed, NCCL is not (no other CUDA's build in its place), and a warning says why. ---
    std::fs::create_dir_all(work.path().join("no-nccl")).unwrap();
    let no_nccl = guest_root(&work.path().join("no-nccl"), &repo_dir, &url, &fpr);
    let skipped = install(&no_nccl, &["--cuda", "12.8"]);
    eprintln!("--- CUDA 12.8, no NCCL build for it\n{}", skipped.stderr);
    assert_eq!(skipped.code, Some(1), "{}", skipped.stderr);
    assert!(
        skipped.stderr.contains("skipped: NCCL is not installed: the repository has no libnccl2 built for CUDA 12.8"),
        "{}",
        skipped.stderr
    );
    assert!(skipped.stderr.contains("WARN install.nccl:"), "{}", skipped.stderr);
    assert!(skipped.stderr.contains("install.cuda the repository has NCCL for (12.4, 12.9)"), "{}", skipped.stderr);
    let state = nvidia_state(&no_nccl);
    assert!(state.contains(&"hi  cuda-toolkit-12-8 12.8.1-1".to_string()), "{state:#?}");
    assert!(!state.iter().any(|l| l.contains("libnccl")), "{state:#?}");
    let j = journal(&no_nccl);
    let findings = j["findings"].as_array().cloned().unwrap_or_default();
    let w = findings.iter().find(|f| f["id"] == "install.nccl").expect("the NCCL warning in the journal");
    assert!(w["detail"].as_str().unwrap_or("").contains("built for CUDA 12.4, 12.9, 13.0 only"), "{w:#}");
    assert!(j["steps"].get("nccl").is_none(), "{j:#}");
    eprintln!(
        "timing: clean install {first_s:.1} s, idempotent rerun {second_s:.1} s, {kills} kills + converge {:.1} s, total {:.1} s",
        t.elapsed().as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}
