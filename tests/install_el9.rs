//! The slow tier for the RHEL path: the real `phq-agent install` inside an EL9 root — Debian's
//! own dnf 4.14 (the dnf RHEL 9 ships), its plugins and rpm, dressed as Rocky Linux 9 and as RHEL
//! 9 — against signed stand-in repositories served on 127.0.0.1 (tests/common/el9.rs): NVIDIA's
//! with its driver module streams, EPEL, and the distribution's BaseOS, CodeReady Builder and
//! extras.
//!
//! The root's /proc, /sys and /dev/kmsg are the HGX fixture guest's (8 H100 SXM, 4 NVSwitches)
//! with the EL kernel's release, so the installer plans for that machine while dnf and rpm do
//! their real work on the root. Each variant: the pre-flight refusing a package the repositories
//! lack, in dnf's own words; a clean install; a rerun that changes nothing; SIGKILL inside every
//! step, rerun until it converges with the RPM database and the journal agreeing; the kernel
//! version-locked and the boot-safety gate reading it. Rocky: `--replace-driver` switching the
//! module stream, and without the kernel's lock the gate refusing a newer kernel that has no
//! module. RHEL: CRB through `subscription-manager`; EPEL's release package signed by another key
//! refused by dnf, an EPEL key file of another key and a NVIDIA one refused by the fingerprint
//! check.
//!
//! Needs root, debootstrap, rpmbuild, rpmsign, createrepo_c and modifyrepo_c; skipped with a
//! note outside CI when one is missing.

mod common;

use common::debian::{runnable, serve, sh, target_dir, NCCL_FOR_TOOLKIT};
use common::el9::*;
use common::install::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const TOOLS: &[&str] =
    &["debootstrap", "chroot", "rpmbuild", "rpmsign", "createrepo_c", "modifyrepo_c", "gpg", "objcopy"];

/// The stand-in `subscription-manager`: owns /etc/yum.repos.d/redhat.repo as the real one does
/// (it writes the file from the subscription's repositories and what it was told to enable, so
/// an edit by another tool does not last) and knows `repos --enable <id>` alone.
const SUBSCRIPTION_MANAGER: &str = r#"#!/bin/sh
set -e
state=/var/lib/rhsm/phq-enabled
log=/var/log/phq-subscription-manager.log
echo "$*" >>"$log"
if [ "$1" != repos ] || [ "$2" != --enable ] || [ -z "$3" ]; then
  echo "stand-in subscription-manager knows only: repos --enable <id>" >&2
  exit 64
fi
case "$3" in
  rhel-9-for-x86_64-baseos-rpms|codeready-builder-for-rhel-9-x86_64-rpms) ;;
  *) echo "Error: '$3' does not match a valid repository ID. Use \"subscription-manager repos --list\" to see valid repositories." >&2; exit 1 ;;
esac
mkdir -p /var/lib/rhsm
grep -qx "$3" "$state" 2>/dev/null || echo "$3" >>"$state"
/usr/libexec/phq-write-redhat-repo
echo "Repository '$3' is enabled for this system."
"#;

/// What a grubby of RHEL 9 answers to `--default-kernel` once kernels are installed: the newest
/// (the kernel package's scriptlets make each new kernel the default).
const GRUBBY: &str = r#"#!/bin/sh
[ "$1" = --default-kernel ] || { echo "stand-in grubby knows only --default-kernel" >&2; exit 64; }
ls /boot/vmlinuz-* | sort -V | tail -n 1
"#;

/// dracut is not in a Debian root: this one records that it was asked.
const DRACUT: &str = "#!/bin/sh\necho \"$*\" >>/var/log/phq-dracut.log\n";

fn guest_root(work: &Path, repos: &Repos, url: &str, variant: Variant) -> PathBuf {
    let root = work.join("root");
    std::fs::create_dir_all(work).unwrap();
    let started = Instant::now();
    sh("cp", &["-a", base_root().to_str().unwrap(), root.to_str().unwrap()]);
    let w = |rel: &str, text: &str, mode: u32| {
        use std::os::unix::fs::PermissionsExt;
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    // Debian enables dnf's `local` plugin (a `_dnf_local` repository of every downloaded
    // package); RHEL 9 does not install it (python3-dnf-plugin-local is an extra package).
    let local = std::fs::read_to_string(root.join("etc/dnf/plugins/local.conf")).unwrap();
    w("etc/dnf/plugins/local.conf", &local.replacen("enabled = true", "enabled = false", 1), 0o644);
    // RHEL's rpm keeps its database in /var/lib/rpm; Debian's in ~/.rpmdb.
    w("etc/rpm/macros.phq-el9", "%_dbpath /var/lib/rpm\n", 0o644);
    let os = match variant {
        Variant::Rocky => "NAME=\"Rocky Linux\"\nVERSION=\"9.4 (Blue Onyx)\"\nID=\"rocky\"\nID_LIKE=\"rhel centos fedora\"\nVERSION_ID=\"9.4\"\nPLATFORM_ID=\"platform:el9\"\nPRETTY_NAME=\"Rocky Linux 9.4 (Blue Onyx)\"\n",
        Variant::Rhel => "NAME=\"Red Hat Enterprise Linux\"\nVERSION=\"9.4 (Plow)\"\nID=\"rhel\"\nID_LIKE=\"fedora\"\nVERSION_ID=\"9.4\"\nPLATFORM_ID=\"platform:el9\"\nPRETTY_NAME=\"Red Hat Enterprise Linux 9.4 (Plow)\"\n",
    };
    let _ = std::fs::remove_file(root.join("etc/os-release"));
    w("etc/os-release", os, 0o644);
    // dnf's module platform (dnf.conf(5): module_platform_id) comes from os-release's PLATFORM_ID.
    w("etc/pki/rpm-gpg/RPM-GPG-KEY-phq-distro", &repos.distro_key, 0o644);
    // Only the stand-ins: Debian's own dnf configuration names no repository.
    let distro_repo = |id: &str, name: &str, path: &str, enabled: bool| {
        format!(
            "[{id}]\nname = {name}\nbaseurl = {url}/el9/{path}/\nenabled = {}\ngpgcheck = 1\ngpgkey = file:///etc/pki/rpm-gpg/RPM-GPG-KEY-phq-distro\n\n",
            enabled as u8
        )
    };
    match variant {
        Variant::Rocky => {
            // As Rocky 9 ships them: `crb` present and disabled.
            let text = [
                distro_repo("baseos", "Rocky Linux 9 - BaseOS", "baseos", true),
                distro_repo("crb", "Rocky Linux 9 - CRB", "crb", false),
                distro_repo("extras", "Rocky Linux 9 - Extras", "extras", true),
            ]
            .concat();
            w("etc/yum.repos.d/rocky.repo", &text, 0o644);
        }
        Variant::Rhel => {
            let writer = format!(
                "#!/bin/sh\n# Writes redhat.repo from the subscription: BaseOS on, CodeReady Builder as enabled.\nstate=/var/lib/rhsm/phq-enabled\ncrb=0\ngrep -qx codeready-builder-for-rhel-9-x86_64-rpms \"$state\" 2>/dev/null && crb=1\ncat >/etc/yum.repos.d/redhat.repo <<EOF\n#\n# Certificate-Based Repositories\n# Managed by (rhsm) subscription-manager\n#\n{}{}EOF\n",
                distro_repo("rhel-9-for-x86_64-baseos-rpms", "Red Hat Enterprise Linux 9 for x86_64 - BaseOS (RPMs)", "baseos", true),
                distro_repo("codeready-builder-for-rhel-9-x86_64-rpms", "Red Hat CodeReady Linux Builder for RHEL 9 x86_64 (RPMs)", "crb", false)
                    .replace("enabled = 0", "enabled = $crb"),
            );
            w("usr/libexec/phq-write-redhat-repo", &writer, 0o755);
            w("usr/sbin/subscription-manager", SUBSCRIPTION_MANAGER, 0o755);
            std::fs::create_dir_all(root.join("etc/yum.repos.d")).unwrap();
            sh("chroot", &[root.to_str().unwrap(), "/usr/libexec/phq-write-redhat-repo"]);
        }
    }
    w("usr/sbin/grubby", GRUBBY, 0o755);
    w("usr/bin/dracut", DRACUT, 0o755);
    // The root's own packages: the running kernel, the release package, the shell.
    let release = if variant == Variant::Rocky { "rocky-release" } else { "redhat-release" };
    let inbox = root.join("tmp/phq-base");
    std::fs::create_dir_all(&inbox).unwrap();
    let mut names = vec![];
    for p in &repos.base {
        let n = p.file_name().unwrap().to_str().unwrap().to_string();
        if n.contains("-release-") && !n.starts_with(release) {
            continue;
        }
        std::fs::copy(p, inbox.join(&n)).unwrap();
        names.push(format!("/tmp/phq-base/{n}"));
    }
    let mut args = vec![root.to_str().unwrap(), "rpm", "-i", "--nosignature"];
    args.extend(names.iter().map(String::as_str));
    sh("chroot", &args);
    std::fs::remove_dir_all(&inbox).unwrap();
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sysroots/debian12-hgx-fresh");
    for sub in ["proc", "sys"] {
        sh("cp", &["-a", &format!("{}/{sub}/.", fixture.display()), root.join(sub).to_str().unwrap()]);
    }
    std::fs::write(root.join("proc/sys/kernel/osrelease"), format!("{KERNEL}\n")).unwrap();
    sh("cp", &[fixture.join("dev/kmsg").to_str().unwrap(), root.join("dev/kmsg").to_str().unwrap()]);
    sh("cp", &[env!("CARGO_BIN_EXE_phq-agent"), root.join("usr/bin/phq-agent").to_str().unwrap()]);
    write_config(&root, url, &format!("{url}/epel"), repos);
    eprintln!("timing: {variant:?} root made in {:.1} s", started.elapsed().as_secs_f64());
    root
}

fn write_config(root: &Path, url: &str, epel_url: &str, repos: &Repos) {
    std::fs::create_dir_all(root.join("etc/phq-agent")).unwrap();
    std::fs::write(
        root.join("etc/phq-agent/config.toml"),
        // The stand-ins are served on loopback over plain http: allowed explicitly, as an
        // operator would for such a mirror (dnf still checks every package's signature).
        format!(
            "[install]\ncuda = \"12.9\"\ndriver_branch = \"580\"\nrepo_url = \"{url}\"\nrepo_key_fingerprint = \"{}\"\nepel_url = \"{epel_url}\"\nepel_key_fingerprint = \"{}\"\nallow_plain_http = true\n",
            repos.nvidia_fpr, repos.epel_fpr
        ),
    )
    .unwrap();
}

fn chroot_out(root: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new("chroot")
        .arg(root)
        .args(args)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("LANG", "C.UTF-8")
        .output()
        .unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// The NVIDIA, CUDA and kernel packages as the RPM database has them, and the version locks.
fn rpm_state(root: &Path) -> Vec<String> {
    let (ok, all) = chroot_out(root, &["rpm", "-qa", "--qf", "%{NAME} %{EPOCH}:%{VERSION}-%{RELEASE}\n"]);
    assert!(ok, "{all}");
    let mut v: Vec<String> = all
        .lines()
        .filter(|l| ["nvidia", "cuda", "kernel", "dkms", "epel", "phq-crb"].iter().any(|p| l.contains(p)))
        .map(|l| l.replace("(none):", ""))
        .collect();
    v.sort();
    let locks = std::fs::read_to_string(root.join("etc/dnf/plugins/versionlock.list")).unwrap_or_default();
    let mut locks: Vec<String> =
        locks.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')).map(|l| format!("lock {l}")).collect();
    locks.sort();
    v.extend(locks);
    v
}

fn journal(root: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(root.join("var/lib/phq-agent-install/state.json")).unwrap()).unwrap()
}

/// The repositories, built once per test and served.
fn repositories(work: &Path) -> (Repos, String) {
    let t = Instant::now();
    let tmp = work.join("repos");
    std::fs::create_dir_all(&tmp).unwrap();
    // The URL is known only once the server listens: serve the directory first, fill it after.
    let www = tmp.join("www");
    std::fs::create_dir_all(&www).unwrap();
    let port = serve(www.clone()).port;
    let url = format!("http://127.0.0.1:{port}");
    let repos = build_repos(&tmp, &url);
    eprintln!("timing: repositories built in {:.1} s", t.elapsed().as_secs_f64());
    (repos, url)
}

/// The proofs both variants share. Returns the clean root (installed, reboot pending).
fn prove(variant: Variant) -> Option<(tempfile::TempDir, PathBuf, Repos, String)> {
    if !runnable(&format!("the EL9 ({variant:?}) install test"), TOOLS) {
        return None;
    }
    let t0 = Instant::now();
    base_root();
    // PHQ_TEST_KEEP=1 keeps the roots and repositories for a look afterwards.
    let work = tempfile::Builder::new()
        .prefix(&format!("phq-el9-{}-", variant.id()))
        .disable_cleanup(std::env::var_os("PHQ_TEST_KEEP").is_some())
        .tempdir_in(target_dir())
        .unwrap();
    let (repos, url) = repositories(work.path());
    let clean = guest_root(&work.path().join("clean"), &repos, &url, variant);

    // A toolkit the repository does not have (12.6; the stand-in has 12.9): the pre-flight asks
    // dnf to resolve everything with --assumeno and stops, naming it from dnf's own words.
    let t = Instant::now();
    let lacking = install(&clean, &["--cuda", "12.6"]);
    assert_eq!(lacking.code, Some(2), "{}", lacking.stderr);
    assert!(
        lacking.stderr.contains("pre-flight: the repositories cannot install cuda-toolkit-12-6; nothing was installed"),
        "{}",
        lacking.stderr
    );
    assert!(
        lacking.stderr.contains("Unable to find a match: cuda-toolkit-12-6"),
        "dnf's own words:\n{}",
        lacking.stderr
    );
    let after = rpm_state(&clean);
    assert!(
        !after.iter().any(|l| l.starts_with("nvidia") || l.starts_with("kmod") || l.starts_with("cuda")),
        "installed before the pre-flight refused: {after:#?}"
    );
    eprintln!("timing: pre-flight refusal after {:.1} s", t.elapsed().as_secs_f64());

    let t = Instant::now();
    let first = install(&clean, &[]);
    let first_s = t.elapsed().as_secs_f64();
    eprintln!("--- {variant:?}: clean install\n{}", first.stderr);
    assert_eq!(first.code, Some(1), "reboot required (exit 1) expected:\n{}", first.stderr);
    assert!(first.stderr.contains("a reboot is required"), "{}", first.stderr);
    let installed = rpm_state(&clean);
    let want = [
        format!("kmod-nvidia-open-dkms 3:{DRIVER}-1.el9"),
        format!("nvidia-driver-cuda 3:{DRIVER}-1.el9"),
        format!("nvidia-persistenced 3:{DRIVER}-1.el9"),
        // The fabric manager at the driver's exact version, not the stream's newest.
        format!("nvidia-fabricmanager {DRIVER}-1"),
        format!("libnvidia-nscq {DRIVER}-1"),
        "cuda-toolkit-12-9 12.9.1-1".into(),
        "cuda-compiler-12-9 12.9.1-1".into(),
        // NCCL: the newest build for the toolkit's CUDA (12.9); not CUDA 13.0's, the newest
        // there is, nor a newer one for 12.4.
        format!("libnccl {NCCL_FOR_TOOLKIT}"),
        format!("kernel-devel {}", KERNEL.trim_end_matches(".x86_64")),
        // EPEL's dkms, whose dependency only CodeReady Builder has.
        "dkms 3.1.5-1.el9".into(),
        "phq-crb-only 1.0-1.el9".into(),
        "epel-release 9-8.el9".into(),
    ];
    for w in &want {
        assert!(installed.contains(w), "missing {w:?} in {installed:#?}\n{}", first.stderr);
    }
    // The branch's stream held the driver on 580: nothing of 590, nor the newer fabric manager.
    assert!(!installed.iter().any(|l| l.contains(NEWER_DRIVER) || l.contains(NEWER_FM)), "{installed:#?}");
    let (_, modules) = chroot_out(&clean, &["dnf", "-q", "module", "list", "--enabled", "nvidia-driver"]);
    assert!(modules.contains("580-open [e]"), "the 580-open stream is not the enabled one:\n{modules}");
    // Version locks: the driver, fabric manager, toolkit, the running kernel, and NCCL (its own step).
    for lock in ["kmod-nvidia-open-dkms-3:580.82.07", "nvidia-fabricmanager-0:580.82.07", "cuda-toolkit-12-9-0:12.9.1"]
        .into_iter()
        .map(String::from)
        .chain([
            format!("kernel-core-0:{}", KERNEL.trim_end_matches(".x86_64")),
            format!("libnccl-0:{NCCL_FOR_TOOLKIT}"),
        ])
    {
        assert!(installed.iter().any(|l| l.starts_with(&format!("lock {lock}"))), "no lock {lock}: {installed:#?}");
    }
    for unit in ["nvidia-persistenced.service", "nvidia-fabricmanager.service"] {
        let link = clean.join("etc/systemd/system/multi-user.target.wants").join(unit);
        assert!(std::fs::symlink_metadata(&link).is_ok(), "{unit} not enabled");
    }
    assert_eq!(
        std::fs::read_to_string(clean.join("etc/modprobe.d/blacklist-nouveau.conf")).unwrap(),
        "blacklist nouveau\noptions nouveau modeset=0\n"
    );
    assert!(std::fs::read_to_string(clean.join("var/log/phq-dracut.log")).unwrap().contains("--regenerate-all"));
    // The boot-safety gate read the kernel grubby names and found the module DKMS built there.
    assert!(first.stderr.contains(&format!("kernel {KERNEL} has nvidia {DRIVER}; safe to reboot")), "{}", first.stderr);
    let j = journal(&clean);
    assert_eq!(j["status"], "reboot-required");

    // A second run changes nothing.
    let t = Instant::now();
    let second = install(&clean, &[]);
    let second_s = t.elapsed().as_secs_f64();
    assert_eq!(second.code, Some(1), "{}", second.stderr);
    assert!(!second.stderr.contains("$ "), "the second run ran commands:\n{}", second.stderr);
    assert_eq!(rpm_state(&clean), installed);

    // The kernel is held: dnf offers the newer kernel in BaseOS, and the lock keeps it out.
    let (ok, upgrade) = chroot_out(&clean, &["dnf", "-y", "upgrade", "kernel", "kernel-core", "kernel-devel"]);
    assert!(ok, "{upgrade}");
    assert_eq!(rpm_state(&clean), installed, "the version lock let a kernel through:\n{upgrade}");

    // --- SIGKILL inside every step, then reruns converge to the same packages. ---
    let killed = guest_root(&work.path().join("killed"), &repos, &url, variant);
    let steps = [
        "repo",
        "preflight",
        "headers",
        "nouveau",
        "driver",
        "persistenced",
        "fabricmanager",
        "toolkit",
        "nccl",
        "hold",
    ];
    let t = Instant::now();
    let mut kills = 0;
    let mut transcript = String::new();
    for (i, step) in steps.iter().enumerate() {
        let marker = killed.join(DKMS_MARKER);
        let (seen, kill) = install_killed_in(&killed, step, (*step == "driver").then_some(marker.as_path()), || ());
        assert_ne!(kill, Kill::NotReached, "never reached step {step}:\n{seen}");
        kills += (kill == Kill::Running) as u32;
        let when = match (kill, *step) {
            (Kill::Running, "driver") => "inside the driver's %post (the DKMS build)",
            (Kill::Running, _) => "while its first command ran",
            _ => "as it said it was already done",
        };
        let line = format!("--- {variant:?} run {} (SIGKILL to the process group in step {step}, {when})\n", i + 1);
        // Past libtest's capture (it takes only the print macros), so every kill point shows in
        // the output of a passing run too.
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        transcript.push_str(&format!("{line}{seen}"));
        if *step == "driver" {
            assert_eq!(kill, Kill::Running, "{seen}");
        }
    }
    let last = install(&killed, &[]);
    transcript.push_str(&format!("--- {variant:?} final run\n{}", last.stderr));
    eprintln!("{transcript}");
    assert_eq!(last.code, Some(1), "after {kills} kills the install must converge:\n{}", last.stderr);
    assert_eq!(rpm_state(&killed), installed, "killed root differs from the clean one\n{}", last.stderr);
    // The journal agrees with the RPM database: what each step it records as finished
    // installs is there, and each such step is recorded or planned as already done.
    let j = journal(&killed);
    assert_eq!(j["status"], "reboot-required", "{j:#}");
    let recorded = j["steps"].as_object().cloned().unwrap_or_default();
    for (step, package) in [
        ("headers", "kernel-devel "),
        ("driver", "kmod-nvidia-open-dkms "),
        ("fabricmanager", "nvidia-fabricmanager "),
        ("toolkit", "cuda-toolkit-12-9 "),
        ("nccl", "lock libnccl-"),
        ("hold", "lock kmod-nvidia-open-dkms-"),
    ] {
        let finished = recorded.contains_key(step) || last.stderr.contains(&format!("] {step}: already done"));
        assert!(finished, "step {step} neither recorded nor done: {j:#}\n{}", last.stderr);
        assert!(installed.iter().any(|l| l.starts_with(package)), "journal has {step}, the RPM database no {package}");
    }
    assert!(killed.join(format!("lib/modules/{KERNEL}/extra/nvidia.ko")).is_file(), "no module was built");
    assert!(last.stderr.contains(&format!("kernel {KERNEL} has nvidia {DRIVER}; safe to reboot")), "{}", last.stderr);
    let again = install(&killed, &[]);
    assert!(!again.stderr.contains("$ "), "{}", again.stderr);
    eprintln!(
        "timing: {variant:?} clean install {first_s:.1} s, idempotent rerun {second_s:.1} s, {kills} kills + converge {:.1} s, total {:.1} s",
        t.elapsed().as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    Some((work, clean, repos, url))
}

#[test]
fn rocky9_real_dnf_installs_idempotently_survives_kill_9_and_switches_streams() {
    let Some((_work, clean, _repos, _url)) = prove(Variant::Rocky) else { return };
    // CRB through dnf config-manager, as Rocky documents it.
    let (_, repolist) = chroot_out(&clean, &["dnf", "-q", "repolist", "--enabled"]);
    assert!(repolist.lines().any(|l| l.starts_with("crb ")), "{repolist}");

    // --replace-driver to branch 590: the versionlocks go, the module switches stream with
    // --allowerasing, and the 590 packages come in.
    let t = Instant::now();
    let switched = install(&clean, &["--driver-branch", "590", "--replace-driver"]);
    eprintln!("--- Rocky: --driver-branch 590 --replace-driver\n{}", switched.stderr);
    assert_eq!(switched.code, Some(1), "{}", switched.stderr);
    assert!(switched.stderr.contains("--allowerasing"), "{}", switched.stderr);
    let state = rpm_state(&clean);
    for w in [
        format!("kmod-nvidia-open-dkms 3:{NEWER_DRIVER}-1.el9"),
        format!("nvidia-driver-cuda 3:{NEWER_DRIVER}-1.el9"),
        format!("nvidia-fabricmanager {NEWER_DRIVER}-1"),
    ] {
        assert!(state.contains(&w), "missing {w:?} in {state:#?}");
    }
    assert!(!state.iter().any(|l| l.contains(DRIVER) && !l.starts_with("lock ")), "{state:#?}");
    let (_, modules) = chroot_out(&clean, &["dnf", "-q", "module", "list", "--enabled", "nvidia-driver"]);
    assert!(modules.contains("590-open [e]"), "{modules}");
    // Held again, at the new versions only.
    let locks: Vec<&String> = state.iter().filter(|l| l.starts_with("lock ")).collect();
    for lock in
        ["kmod-nvidia-open-dkms-3:590.44.01", "nvidia-driver-cuda-3:590.44.01", "nvidia-fabricmanager-0:590.44.01"]
    {
        assert!(locks.iter().any(|l| l.starts_with(&format!("lock {lock}"))), "no lock {lock}: {locks:#?}");
    }
    assert!(!locks.iter().any(|l| l.contains(DRIVER)), "a 580 lock was left: {locks:#?}");
    let again = install(&clean, &["--driver-branch", "590"]);
    assert!(!again.stderr.contains("$ "), "{}", again.stderr);

    // Without the kernel's lock, dnf takes the newer kernel, for which nothing built a module:
    // grubby names it as the next boot's, and the boot-safety gate refuses the reboot.
    let (ok, out) = chroot_out(&clean, &["dnf", "versionlock", "delete", "kernel", "kernel-core", "kernel-devel"]);
    assert!(ok, "{out}");
    let (ok, out) = chroot_out(&clean, &["dnf", "-y", "-q", "upgrade", "kernel", "kernel-core"]);
    assert!(ok, "{out}");
    let newer = format!("{}-{}.x86_64", NEWER_KERNEL.0, NEWER_KERNEL.1);
    let gated = install(&clean, &["--driver-branch", "590"]);
    assert!(
        gated.stderr.contains(&format!(
            "not rebooting: the kernel that boots next ({newer}) would start without the GPU driver"
        )),
        "{}",
        gated.stderr
    );
    eprintln!("timing: stream switch {:.1} s", t.elapsed().as_secs_f64());
}

#[test]
fn rhel9_real_dnf_installs_idempotently_survives_kill_9_and_refuses_another_key() {
    let Some((work, clean, repos, url)) = prove(Variant::Rhel) else { return };
    // CRB through subscription-manager, which owns redhat.repo.
    let log = std::fs::read_to_string(clean.join("var/log/phq-subscription-manager.log")).unwrap_or_default();
    assert_eq!(log, "repos --enable codeready-builder-for-rhel-9-x86_64-rpms\n");

    // EPEL's release package signed by another key than the pinned one: dnf checks it
    // (localpkg_gpgcheck) and refuses, before EPEL is configured.
    let fresh = guest_root(&work.path().join("impostor"), &repos, &url, Variant::Rhel);
    let impostor = work.path().join("repos/www/impostor-epel");
    std::fs::create_dir_all(&impostor).unwrap();
    let other = work.path().join("repos/work/other-key");
    std::fs::create_dir_all(&other).unwrap();
    let other = common::TestKey::new(&other);
    let rpm = impostor.join("epel-release-latest-9.noarch.rpm");
    std::fs::copy(work.path().join("repos/www/epel/epel-release-latest-9.noarch.rpm"), &rpm).unwrap();
    sh("rpmsign", &["--delsign", rpm.to_str().unwrap()]);
    sign_rpms(&other, std::slice::from_ref(&rpm));
    std::fs::copy(work.path().join("repos/www/epel/RPM-GPG-KEY-EPEL-9"), impostor.join("RPM-GPG-KEY-EPEL-9")).unwrap();
    write_config(&fresh, &url, &format!("{url}/impostor-epel"), &repos);
    let refused = install(&fresh, &[]);
    eprintln!("--- RHEL: EPEL's release package signed by another key\n{}", refused.stderr);
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(refused.stderr.contains("epel-release-latest-9.noarch.rpm"), "{}", refused.stderr);
    // dnf's own refusal, not a network retry.
    assert!(refused.stderr.contains("GPG check FAILED"), "{}", refused.stderr);
    assert!(!refused.stderr.contains("trying again"), "{}", refused.stderr);
    let state = rpm_state(&fresh);
    assert!(!state.iter().any(|l| l.starts_with("epel-release")), "{state:#?}");
    assert!(!fresh.join("etc/yum.repos.d/epel.repo").exists());

    // A mirror consistent with itself, but not EPEL: its key file is another key and its
    // release package is signed by it. The whole-fingerprint check refuses the key before rpm
    // imports it.
    std::fs::write(impostor.join("RPM-GPG-KEY-EPEL-9"), armored(&other)).unwrap();
    let imposed = install(&fresh, &[]);
    assert_eq!(imposed.code, Some(2), "{}", imposed.stderr);
    assert!(imposed.stderr.contains("RPM-GPG-KEY-EPEL-9 is not the pinned key"), "{}", imposed.stderr);
    // rpm names an imported key gpg-pubkey-<its short id>.
    let short = other.fpr[other.fpr.len() - 8..].to_lowercase();
    let (imported, _) = chroot_out(&fresh, &["rpm", "-q", &format!("gpg-pubkey-{short}")]);
    assert!(!imported, "rpm imported the other key");
    assert!(!fresh.join("etc/yum.repos.d/epel.repo").exists());

    // NVIDIA's repository with its genuine key file but every package signed by another key:
    // the key is trusted, dnf (gpgcheck=1 in the repository file the installer writes) refuses
    // the packages, and no NVIDIA package is installed.
    write_config(&fresh, &url, &format!("{url}/epel"), &repos);
    let www = work.path().join("repos/www");
    resign_repo(&www.join("rhel9/x86_64"), &www.join("resigned/rhel9/x86_64"), &other);
    let resigned = install(&fresh, &["--repo-url", &format!("{url}/resigned")]);
    eprintln!("--- RHEL: NVIDIA's packages signed by another key\n{}", resigned.stderr);
    assert_eq!(resigned.code, Some(2), "{}", resigned.stderr);
    assert!(resigned.stderr.contains("GPG check FAILED"), "{}", resigned.stderr);
    assert!(!resigned.stderr.contains("trying again"), "a signature is not a network failure:\n{}", resigned.stderr);
    let state = rpm_state(&fresh);
    assert!(!state.iter().any(|l| l.starts_with("kmod-nvidia") || l.starts_with("nvidia-")), "{state:#?}");

    // NVIDIA's key file of another key: not trusted, nothing of NVIDIA's configured.
    let bad = work.path().join("repos/www/impostor-nvidia/rhel9/x86_64");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::write(bad.join("D42D0685.pub"), armored(&other)).unwrap();
    let before = std::fs::read_to_string(fresh.join("etc/yum.repos.d/cuda-rhel9.repo")).unwrap();
    let wrong = install(&fresh, &["--repo-url", &format!("{url}/impostor-nvidia")]);
    assert_eq!(wrong.code, Some(2), "{}", wrong.stderr);
    assert!(wrong.stderr.contains("is not the pinned key"), "{}", wrong.stderr);
    // The repository file still names the mirror of the run before: nothing was rewritten.
    assert_eq!(std::fs::read_to_string(fresh.join("etc/yum.repos.d/cuda-rhel9.repo")).unwrap(), before);
}
