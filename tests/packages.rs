//! The packages as a user meets them: the .deb installed with `dpkg -i` into a real Debian 12
//! root leaves the binary, the units (enabled), the service's user and state directory, the
//! bus policy and the config (a conffile) in place, and a first start can make the token; a
//! purge takes the units' links away again. The .rpm carries the same files and scripts.
//! `scripts/build-packages.sh` builds both into target/packages/ (CI runs it before the tests).

mod common;

use common::debian::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

fn package(ext: &str) -> Option<PathBuf> {
    let dir = target_dir().join("packages");
    let found =
        std::fs::read_dir(&dir).ok()?.flatten().map(|e| e.path()).find(|p| p.extension().is_some_and(|e| e == ext));
    if found.is_none() {
        common::skip(&format!(
            "no .{ext} in {} (scripts/test builds it with scripts/build-packages.sh)",
            dir.display()
        ));
    }
    found
}

fn chroot(root: &Path, args: &[&str]) -> std::process::Output {
    Command::new("chroot").arg(root).args(args).env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").output().unwrap()
}

fn link_exists(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok()
}

#[test]
fn deb_installs_into_debian_with_units_enabled_and_purges_cleanly() {
    let Some(deb) = package("deb") else { return };
    if !runnable("the .deb install test", &["debootstrap", "chroot", "dpkg-deb"]) {
        return;
    }
    let base = debootstrap_cached("bookworm-minbase", "systemd,initramfs-tools");
    let work = tempfile::Builder::new().prefix("phq-deb-").tempdir_in(target_dir()).unwrap();
    let root = work.path().join("root");
    sh("cp", &["-a", base.to_str().unwrap(), root.to_str().unwrap()]);
    sh("cp", &[deb.to_str().unwrap(), root.join("tmp/phq-agent.deb").to_str().unwrap()]);

    let out = chroot(&root, &["dpkg", "-i", "/tmp/phq-agent.deb"]);
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "dpkg -i failed:\n{log}");
    eprintln!("dpkg -i:\n{log}");

    let version = chroot(&root, &["phq-agent", "--version"]);
    assert!(String::from_utf8_lossy(&version.stdout).starts_with("phq-agent "), "{version:?}");
    for f in [
        "lib/systemd/system/phq-agent.service",
        "lib/systemd/system/phq-agent-install.service",
        "usr/lib/sysusers.d/phq-agent.conf",
        "usr/lib/tmpfiles.d/phq-agent.conf",
        "usr/share/dbus-1/system.d/ch.phoeniqs.Agent1.conf",
        "etc/phq-agent/config.toml",
        "usr/share/doc/phq-agent/README.md",
        "usr/share/man/man1/phq-agent.1.gz",
        "usr/share/man/man1/phq-agent-doctor.1.gz",
        "usr/share/man/man1/phq-agent-install.1.gz",
        "usr/share/bash-completion/completions/phq-agent",
        "usr/share/zsh/vendor-completions/_phq-agent",
        "usr/share/fish/vendor_completions.d/phq-agent.fish",
    ] {
        assert!(root.join(f).is_file(), "{f} is not installed");
    }
    let wants = root.join("etc/systemd/system/multi-user.target.wants");
    assert!(link_exists(&wants.join("phq-agent.service")), "phq-agent.service is not enabled");
    assert!(link_exists(&wants.join("phq-agent-install.service")), "phq-agent-install.service is not enabled");
    let passwd = std::fs::read_to_string(root.join("etc/passwd")).unwrap();
    let user = passwd.lines().find(|l| l.starts_with("phq-agent:")).expect("the phq-agent user");
    let uid: u32 = user.split(':').nth(2).unwrap().parse().unwrap();
    let state = std::fs::metadata(root.join("var/lib/phq-agent")).unwrap();
    assert_eq!((state.uid(), state.permissions().mode() & 0o777), (uid, 0o700));
    let conffiles = chroot(&root, &["dpkg-query", "-W", "-f=${Conffiles}", "phq-agent"]);
    assert!(String::from_utf8_lossy(&conffiles.stdout).contains("/etc/phq-agent/config.toml"));

    // The unit's first-start step, as systemd would run it (root, before the service): it makes
    // the HTTP token and hands over the platform token cloud-init wrote as root.
    std::fs::write(root.join("etc/phq-agent/platform-token"), "platform-secret\n").unwrap();
    std::fs::set_permissions(root.join("etc/phq-agent/platform-token"), std::fs::Permissions::from_mode(0o644))
        .unwrap();
    let token = chroot(&root, &["phq-agent", "token", "--owner", "phq-agent"]);
    assert!(token.status.success(), "{token:?}");
    for t in ["etc/phq-agent/token", "etc/phq-agent/platform-token"] {
        let meta = std::fs::metadata(root.join(t)).unwrap();
        assert_eq!((meta.uid(), meta.permissions().mode() & 0o777), (uid, 0o600), "{t}");
    }
    let unit = std::fs::read_to_string(root.join("lib/systemd/system/phq-agent.service")).unwrap();
    assert!(unit.contains("ExecStartPre=+/usr/bin/phq-agent token --owner phq-agent"));

    let purge = chroot(&root, &["dpkg", "--purge", "phq-agent"]);
    assert!(purge.status.success(), "{purge:?}");
    assert!(!link_exists(&wants.join("phq-agent.service")), "purge left the unit enabled");
    assert!(!root.join("usr/bin/phq-agent").exists());
}

#[test]
fn deb_passes_lintian_without_errors_or_warnings() {
    let Some(deb) = package("deb") else { return };
    if !common::needs(&[("lintian", "lintian")]) {
        return;
    }
    let out = Command::new("lintian").args(["--no-tag-display-limit", "--info"]).arg(&deb).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("lintian {}:\n{text}", deb.display());
    // Every warning the project could fix is fixed; the one it cannot is overridden with the
    // reason (packaging/debian/lintian-overrides).
    let errors: Vec<&str> = text.lines().filter(|l| l.starts_with("E: ") || l.starts_with("W: ")).collect();
    assert!(errors.is_empty(), "lintian errors and warnings:\n{}", errors.join("\n"));
}

#[test]
fn rpm_carries_the_same_files_and_scripts() {
    let Some(rpm) = package("rpm") else { return };
    if !common::needs(&[("rpm", "rpm")]) {
        return;
    }
    let q = |args: &[&str]| {
        let out = Command::new("rpm").arg("-qp").args(args).arg(&rpm).output().unwrap();
        assert!(out.status.success(), "rpm -qp {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let files = q(&["-l"]);
    for f in [
        "/usr/bin/phq-agent",
        "/usr/lib/systemd/system/phq-agent.service",
        "/usr/lib/systemd/system/phq-agent-install.service",
        "/usr/share/man/man1/phq-agent.1.gz",
        "/usr/share/man/man1/phq-agent-probe.1.gz",
        "/usr/share/bash-completion/completions/phq-agent",
        "/usr/share/zsh/site-functions/_phq-agent",
        "/usr/share/fish/vendor_completions.d/phq-agent.fish",
        "/usr/lib/sysusers.d/phq-agent.conf",
        "/usr/lib/tmpfiles.d/phq-agent.conf",
        "/usr/share/dbus-1/system.d/ch.phoeniqs.Agent1.conf",
        "/etc/phq-agent/config.toml",
    ] {
        assert!(files.lines().any(|l| l == f), "{f} not in the rpm:\n{files}");
    }
    assert_eq!(q(&["-c"]).trim(), "/etc/phq-agent/config.toml");
    let scripts = q(&["--scripts"]);
    assert!(
        scripts.contains("systemd-sysusers phq-agent.conf") && scripts.contains("systemctl enable phq-agent.service"),
        "{scripts}"
    );
    assert!(q(&["--requires"]).contains("systemd"));
}
