//! The slow tier: the real `phq-agent install` inside a real Debian 12 root, against a real apt
//! and a signed repository of stand-in packages served on 127.0.0.1.
//!
//! The root comes from `debootstrap --variant=minbase bookworm` (cached under
//! target/phq-apt-root). Its /proc, /sys and /dev/kmsg are the files of the HGX fixture guest
//! (8 H100 SXM, 4 NVSwitches), so the installer plans for that machine while apt and dpkg do
//! their real work on the root. The stand-ins carry NVIDIA's names and versions and nothing
//! else: the keyring, the open DKMS driver (whose postinst takes a second, like a build), the
//! persistence daemon and fabric manager with their units, NSCQ, the toolkit, the headers. A
//! newer branch (560) and a newer 550 fabric manager are in the repository too, to prove the
//! branch pin and the exact fabric-manager match.
//!
//! Needs root and debootstrap; skipped with a note outside CI when either is missing.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const KERNEL: &str = "6.1.0-27-cloud-amd64";
const DRIVER: &str = "550.90.07";

fn target_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/phq-apt-root")
}

fn runnable() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let tools = ["debootstrap", "dpkg-deb", "apt-ftparchive", "gpg", "chroot"].iter().all(|t| which(t));
    if root && tools {
        return true;
    }
    let why = format!("needs root and debootstrap, dpkg-deb, apt-ftparchive, gpg (root: {root}, tools: {tools})");
    assert!(std::env::var_os("CI").is_none(), "the chroot install test must run in CI: {why}");
    eprintln!("SKIPPED install_chroot: {why}");
    false
}

fn which(tool: &str) -> bool {
    std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file())).unwrap_or(false)
        || Path::new("/usr/sbin").join(tool).is_file()
}

fn sh(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The debootstrapped root, built once and kept: tests copy it.
fn base_root() -> PathBuf {
    let dir = target_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let lock = std::fs::File::create(dir.join(".lock")).unwrap();
    lock.lock().unwrap();
    let base = dir.join("bookworm-minbase");
    if !base.join(".phq-complete").exists() {
        let tmp = dir.join("bookworm-minbase.tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        let started = Instant::now();
        let mirror = std::env::var("PHQ_DEBIAN_MIRROR").unwrap_or_else(|_| "http://deb.debian.org/debian".into());
        sh(
            "debootstrap",
            &["--variant=minbase", "--include=systemd,initramfs-tools", "bookworm", tmp.to_str().unwrap(), &mirror],
        );
        std::fs::write(tmp.join(".phq-complete"), "").unwrap();
        let _ = std::fs::remove_dir_all(&base);
        std::fs::rename(&tmp, &base).unwrap();
        eprintln!("timing: debootstrap took {:.0} s", started.elapsed().as_secs_f64());
    }
    base
}

/// A fresh copy of the base root with the HGX guest's /proc, /sys and kmsg, and the agent in it.
fn guest_root(work: &Path, repo_url: &str, fingerprint: &str) -> PathBuf {
    let root = work.join("root");
    let started = Instant::now();
    sh("cp", &["-a", base_root().to_str().unwrap(), root.to_str().unwrap()]);
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sysroots/debian12-hgx-fresh");
    for sub in ["proc", "sys"] {
        sh("cp", &["-a", &format!("{}/{sub}/.", fixture.display()), root.join(sub).to_str().unwrap()]);
    }
    sh("cp", &[fixture.join("dev/kmsg").to_str().unwrap(), root.join("dev/kmsg").to_str().unwrap()]);
    sh("cp", &[env!("CARGO_BIN_EXE_phq-agent"), root.join("usr/bin/phq-agent").to_str().unwrap()]);
    std::fs::create_dir_all(root.join("etc/phq-agent")).unwrap();
    std::fs::write(
        root.join("etc/phq-agent/config.toml"),
        format!("[install]\ncuda = \"12.4\"\ndriver_branch = \"550\"\nrepo_url = \"{repo_url}\"\nrepo_key_fingerprint = \"{fingerprint}\"\n"),
    )
    .unwrap();
    eprintln!("timing: root copied in {:.1} s", started.elapsed().as_secs_f64());
    root
}

/// One stand-in package, built with dpkg-deb.
struct Deb<'a> {
    name: &'a str,
    version: &'a str,
    depends: &'a str,
    files: Vec<(String, Vec<u8>)>,
    postinst: &'a str,
}

fn build_deb(out: &Path, d: &Deb) {
    let dir = tempfile::tempdir().unwrap();
    let debian = dir.path().join("DEBIAN");
    std::fs::create_dir_all(&debian).unwrap();
    let mut control = format!(
        "Package: {}\nVersion: {}\nArchitecture: all\nMaintainer: phq-agent tests <tests@phq.invalid>\nDescription: stand-in for {} (phq-agent install test)\n",
        d.name, d.version, d.name
    );
    if !d.depends.is_empty() {
        control.push_str(&format!("Depends: {}\n", d.depends));
    }
    std::fs::write(debian.join("control"), control).unwrap();
    if !d.postinst.is_empty() {
        let p = debian.join("postinst");
        std::fs::write(&p, format!("#!/bin/sh\nset -e\n{}\n", d.postinst)).unwrap();
        sh("chmod", &["0755", p.to_str().unwrap()]);
    }
    for (path, data) in &d.files {
        let f = dir.path().join(path.trim_start_matches('/'));
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, data).unwrap();
    }
    let file = out.join(format!("{}_{}_all.deb", d.name, d.version));
    sh("dpkg-deb", &["--root-owner-group", "-Zgzip", "--build", dir.path().to_str().unwrap(), file.to_str().unwrap()]);
}

fn unit(desc: &str) -> Vec<u8> {
    format!("[Unit]\nDescription={desc} (stand-in)\n[Service]\nExecStart=/bin/true\n[Install]\nWantedBy=multi-user.target\n").into_bytes()
}

/// The signed flat repository `<root>/debian12/x86_64/`, as NVIDIA lays it out. Returns the
/// key's fingerprint.
fn build_repo(root: &Path) -> String {
    let repo = root.join("debian12/x86_64");
    std::fs::create_dir_all(&repo).unwrap();
    let gnupg = root.join(".gnupg");
    std::fs::create_dir_all(&gnupg).unwrap();
    sh("chmod", &["0700", gnupg.to_str().unwrap()]);
    let g = gnupg.to_str().unwrap();
    sh(
        "gpg",
        &[
            "--homedir",
            g,
            "--batch",
            "--passphrase",
            "",
            "--quick-gen-key",
            "phq test repository <repo@phq.invalid>",
            "ed25519",
            "sign",
            "never",
        ],
    );
    let colons = sh("gpg", &["--homedir", g, "--with-colons", "--fingerprint"]);
    let fpr = colons.lines().find(|l| l.starts_with("fpr:")).unwrap().split(':').nth(9).unwrap().to_string();
    let key = Command::new("gpg").args(["--homedir", g, "--export", &fpr]).output().unwrap().stdout;
    assert!(!key.is_empty());

    let v = |s: &str| format!("{s}-1");
    let d550 = v(DRIVER);
    let fm_new = v("550.127.05");
    let headers = format!("linux-headers-{KERNEL}");
    let headers_postinst = format!(
        "mkdir -p /lib/modules/{KERNEL} && ln -sfn /usr/src/linux-headers-{KERNEL} /lib/modules/{KERNEL}/build"
    );
    let debs = vec![
        Deb {
            name: "cuda-keyring",
            version: "1.1-1",
            depends: "",
            files: vec![
                ("usr/share/keyrings/cuda-archive-keyring.gpg".into(), key),
                (
                    "etc/apt/sources.list.d/cuda-debian12-x86_64.list".into(),
                    b"deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/ /\n".to_vec(),
                ),
            ],
            postinst: "",
        },
        Deb {
            name: &headers,
            version: "6.1.112-1",
            depends: "",
            files: vec![(format!("usr/src/linux-headers-{KERNEL}/Makefile"), b"# stand-in\n".to_vec())],
            postinst: &headers_postinst,
        },
        Deb {
            name: "nvidia-kernel-open-dkms",
            version: &d550,
            depends: "",
            files: vec![("usr/src/nvidia-550.90.07/dkms.conf".into(), b"PACKAGE_NAME=nvidia\n".to_vec())],
            // A DKMS build takes a while; the test's kill -9 lands in the middle of it, while
            // the marker exists.
            postinst: "touch /tmp/phq-dkms-building; sleep 2; rm -f /tmp/phq-dkms-building",
        },
        Deb { name: "nvidia-kernel-open-dkms", version: "560.35.03-1", depends: "", files: vec![], postinst: "" },
        Deb {
            name: "nvidia-persistenced",
            version: &d550,
            depends: "",
            files: vec![("lib/systemd/system/nvidia-persistenced.service".into(), unit("NVIDIA Persistence Daemon"))],
            postinst: "",
        },
        Deb {
            name: "cuda-drivers-550",
            version: &d550,
            depends: "nvidia-kernel-open-dkms (>= 550), nvidia-kernel-open-dkms (<< 551), nvidia-persistenced",
            files: vec![],
            postinst: "",
        },
        Deb {
            name: "nvidia-fabricmanager-550",
            version: &d550,
            depends: "",
            files: vec![("lib/systemd/system/nvidia-fabricmanager.service".into(), unit("NVIDIA fabric manager"))],
            postinst: "",
        },
        Deb {
            name: "nvidia-fabricmanager-550",
            version: &fm_new,
            depends: "",
            files: vec![("lib/systemd/system/nvidia-fabricmanager.service".into(), unit("NVIDIA fabric manager"))],
            postinst: "",
        },
        Deb { name: "libnvidia-nscq-550", version: &d550, depends: "", files: vec![], postinst: "" },
        Deb { name: "libnvidia-nscq-550", version: &fm_new, depends: "", files: vec![], postinst: "" },
        Deb {
            name: "cuda-toolkit-12-4",
            version: "12.4.1-1",
            depends: "",
            files: vec![("usr/local/cuda-12.4/version.json".into(), br#"{"cuda":{"name":"CUDA SDK","version":"12.4.1"}}"#.to_vec())],
            postinst: "sleep 1",
        },
    ];
    for d in &debs {
        build_deb(&repo, d);
    }
    // The keyring .deb is what the installer fetches by name; NVIDIA serves it beside the index.
    let packages = Command::new("apt-ftparchive").arg("packages").arg(".").current_dir(&repo).output().unwrap();
    std::fs::write(repo.join("Packages"), &packages.stdout).unwrap();
    let release = Command::new("apt-ftparchive").arg("release").arg(".").current_dir(&repo).output().unwrap();
    std::fs::write(repo.join("Release"), &release.stdout).unwrap();
    sh(
        "gpg",
        &[
            "--homedir",
            g,
            "--batch",
            "--yes",
            "--clearsign",
            "-o",
            repo.join("InRelease").to_str().unwrap(),
            repo.join("Release").to_str().unwrap(),
        ],
    );
    fpr
}

/// A static file server on 127.0.0.1: enough HTTP/1.1 for apt and reqwest.
fn serve(dir: PathBuf) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let mut conn = conn;
                let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut first = String::new();
                if reader.read_line(&mut first).is_err() {
                    return;
                }
                loop {
                    let mut l = String::new();
                    if reader.read_line(&mut l).map(|n| n == 0).unwrap_or(true) || l == "\r\n" {
                        break;
                    }
                }
                let path = first.split_whitespace().nth(1).unwrap_or("/").to_string();
                let rel = path.trim_start_matches('/');
                let file = dir.join(rel);
                let head = first.starts_with("HEAD");
                let resp = match (rel.contains(".."), std::fs::read(&file)) {
                    (false, Ok(body)) if file.is_file() => {
                        let mut r =
                            format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len())
                                .into_bytes();
                        if !head {
                            r.extend(body);
                        }
                        r
                    }
                    _ => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec(),
                };
                let _ = conn.write_all(&resp);
            });
        }
    });
    port
}

struct Outcome {
    code: Option<i32>,
    stderr: String,
}

fn install_command(root: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new("chroot");
    c.arg(root).arg("/usr/bin/phq-agent").arg("install").arg("--reboot").arg("never").args(extra);
    c.env_clear().env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin").env("LANG", "C.UTF-8");
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // Its own process group: a kill reaches apt and dpkg too, as when systemd stops a unit
    // or the VM loses power.
    c.process_group(0);
    c
}

fn install(root: &Path, extra: &[&str]) -> Outcome {
    let out = install_command(root, extra).output().unwrap();
    Outcome { code: out.status.code(), stderr: String::from_utf8_lossy(&out.stderr).into_owned() }
}

/// Starts an install and SIGKILLs its whole process group once the progress line naming `step`
/// has appeared and `wait` has returned. Returns what it printed, and whether it killed.
fn install_killed_in(root: &Path, step: &str, wait: impl FnOnce(), during: impl FnOnce()) -> (String, bool) {
    let mut child = install_command(root, &[]).spawn().unwrap();
    let pgid = child.id() as i32;
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = String::new();
    let mut during = Some(during);
    let deadline = Instant::now() + Duration::from_secs(300);
    let needle = format!("] {step}: ");
    while Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(line) => {
                seen.push_str(&line);
                seen.push('\n');
                if line.contains(&needle) {
                    wait();
                    if let Some(f) = during.take() {
                        f();
                    }
                    // SAFETY: kill(2) on a process group we created; no memory is touched.
                    unsafe { libc::kill(-pgid, libc::SIGKILL) };
                    let _ = child.wait();
                    return (seen, true);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let _ = child.wait();
    (seen, false)
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
    serde_json::from_slice(&std::fs::read(root.join("var/lib/phq-agent/install/state.json")).unwrap()).unwrap()
}

#[test]
fn installs_on_a_real_apt_is_idempotent_and_survives_kill_9_at_every_step() {
    if !runnable() {
        return;
    }
    let t0 = Instant::now();
    base_root();
    eprintln!("timing: base root ready after {:.1} s", t0.elapsed().as_secs_f64());
    let work = tempfile::Builder::new().prefix("phq-chroot-").tempdir_in(target_dir()).unwrap();
    let repo_dir = work.path().join("repo");
    let fpr = build_repo(&repo_dir);
    let port = serve(repo_dir.clone());
    let url = format!("http://127.0.0.1:{port}");

    // --- A clean install. ---
    std::fs::create_dir_all(work.path().join("clean")).unwrap();
    std::fs::create_dir_all(work.path().join("killed")).unwrap();
    let clean = guest_root(&work.path().join("clean"), &url, &fpr);

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

    let t = Instant::now();
    let first = install(&clean, &[]);
    let first_s = t.elapsed().as_secs_f64();
    assert_eq!(first.code, Some(1), "reboot required (exit 1) expected:\n{}", first.stderr);
    assert!(first.stderr.contains("a reboot is required"), "{}", first.stderr);
    let installed = nvidia_state(&clean);
    let want = [
        "hi  cuda-drivers-550 550.90.07-1".to_string(),
        "hi  cuda-toolkit-12-4 12.4.1-1".into(),
        "hi  libnvidia-nscq-550 550.90.07-1".into(),
        "hi  nvidia-fabricmanager-550 550.90.07-1".into(),
        "hi  nvidia-kernel-open-dkms 550.90.07-1".into(),
        "hi  nvidia-persistenced 550.90.07-1".into(),
        "ii  cuda-keyring 1.1-1".into(),
        format!("ii  linux-headers-{KERNEL} 6.1.112-1"),
    ];
    for w in &want {
        assert!(installed.contains(w), "missing {w:?} in {installed:#?}\n{}", first.stderr);
    }
    // The branch pin beat the 560 driver; fabric manager is the driver's version, not the newest.
    assert!(!installed.iter().any(|l| l.contains("560.") || l.contains("550.127")), "{installed:#?}");
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
    let killed = guest_root(&work.path().join("killed"), &url, &fpr);
    let steps = ["repo", "headers", "nouveau", "driver", "persistenced", "fabricmanager", "toolkit", "hold"];
    let t = Instant::now();
    let mut kills = 0;
    let mut transcript = String::new();
    for (i, step) in steps.iter().enumerate() {
        // Alternate between killing at once and a moment in, inside apt or dpkg; in the driver
        // step, inside its maintainer script (the stand-in DKMS build).
        let marker = killed.join("tmp/phq-dkms-building");
        let (after, when) = match (*step, i % 2) {
            ("driver", _) => (Duration::ZERO, "inside the driver's postinst".to_string()),
            (_, 0) => (Duration::ZERO, "at once".to_string()),
            _ => (Duration::from_millis(700), "700 ms in".to_string()),
        };
        let wait = || {
            if *step == "driver" {
                let deadline = Instant::now() + Duration::from_secs(120);
                while !marker.exists() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            std::thread::sleep(after);
        };
        let mut refused = None;
        let (seen, did) = install_killed_in(&killed, step, wait, || {
            if *step == "driver" {
                // A second installer while the first holds the lock is refused.
                refused = Some(install(&killed, &[]));
            }
        });
        kills += did as u32;
        assert!(did, "never reached step {step}:\n{seen}");
        transcript.push_str(&format!("--- run {} (SIGKILL to the process group {when}, step {step})\n{seen}", i + 1));
        if let Some(r) = refused {
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
    eprintln!(
        "timing: clean install {first_s:.1} s, idempotent rerun {second_s:.1} s, {kills} kills + converge {:.1} s, total {:.1} s",
        t.elapsed().as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}
