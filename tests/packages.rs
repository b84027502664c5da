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
    let base = debootstrap_cached("bookworm-minbase");
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
        "lib/systemd/system/phq-agent.socket",
        "lib/systemd/system/phq-agent-vsock.socket",
        "lib/systemd/system/phq-agent-bug-report.path",
        "lib/systemd/system/phq-agent-bug-report.service",
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
    // The port is systemd's from sockets.target on (issue 37): the socket is enabled there.
    let sockets = root.join("etc/systemd/system/sockets.target.wants");
    assert!(link_exists(&sockets.join("phq-agent.socket")), "phq-agent.socket is not enabled");
    // The vsock port is systemd's the same way.
    assert!(link_exists(&sockets.join("phq-agent-vsock.socket")), "phq-agent-vsock.socket is not enabled");
    // One socket unit, the service's: cargo-deb looks for `<package>.socket` for every unit it
    // is given, so the installer's unit scripts live in a directory of their own.
    assert!(!root.join("lib/systemd/system/phq-agent-install.socket").exists(), "a second socket unit on 9440");
    // The root helper's doorbell watches from boot on; its service runs only when rung.
    let paths = root.join("etc/systemd/system/paths.target.wants");
    assert!(link_exists(&paths.join("phq-agent-bug-report.path")), "phq-agent-bug-report.path is not enabled");
    let passwd = std::fs::read_to_string(root.join("etc/passwd")).unwrap();
    let user = passwd.lines().find(|l| l.starts_with("phq-agent:")).expect("the phq-agent user");
    let uid: u32 = user.split(':').nth(2).unwrap().parse().unwrap();
    let state = std::fs::metadata(root.join("var/lib/phq-agent")).unwrap();
    assert_eq!((state.uid(), state.permissions().mode() & 0o777), (uid, 0o700));
    // The root helper's directory: root writes, the service's group reads.
    let helper = std::fs::metadata(root.join("var/lib/phq-agent-bug-report")).unwrap();
    assert_eq!((helper.uid(), helper.gid() != 0, helper.permissions().mode() & 0o777), (0, true, 0o750));
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
    assert!(unit.contains("\nEnvironment=CUDA_DEVICE_ORDER=PCI_BUS_ID\n"), "GPU numbering as nvidia-smi's");

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
        "/usr/lib/systemd/system/phq-agent.socket",
        "/usr/lib/systemd/system/phq-agent-vsock.socket",
        "/usr/lib/systemd/system/phq-agent-bug-report.path",
        "/usr/lib/systemd/system/phq-agent-bug-report.service",
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
        scripts.contains("systemd-sysusers phq-agent.conf")
            && scripts.contains("systemctl enable phq-agent.service phq-agent.socket phq-agent-vsock.socket")
            && scripts.contains("phq-agent-bug-report.path"),
        "{scripts}"
    );
    assert!(q(&["--requires"]).contains("systemd"));
}

/// The signed repositories `scripts/publish-repos` lays out, with a key made for the test: apt
/// in a real Debian root, knowing only that repository and its key (`signed-by=`, as cloud-init
/// pins it), installs the agent; it refuses the repository once its Release is changed after
/// signing, and refuses a package changed in the pool. The dnf side's package and index verify
/// with the same key (`rpmkeys`, `gpgv`), and so does SHA256SUMS.
#[test]
fn signed_repositories_install_with_the_pinned_key_and_refuse_tampering() {
    let (Some(_), Some(_)) = (package("deb"), package("rpm")) else { return };
    let tools = ["debootstrap", "chroot", "gpg", "gpgv", "apt-ftparchive", "createrepo_c", "rpmsign", "rpmkeys"];
    if !runnable("the signed-repository test", &tools) {
        return;
    }
    let work = tempfile::Builder::new().prefix("phq-repo-").tempdir_in(target_dir()).unwrap();
    let w = work.path();
    let key = common::TestKey::new(w);
    let (gnupg, fpr) = (key.home.clone(), key.fpr.clone());
    let repos = w.join("repos");
    // Published now, as a republication would be: the packages' own time (their commit's) may
    // be older than the Release's window (tests/publish_repos.rs checks that window).
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let out = Command::new(common::repo().join("scripts/publish-repos"))
        .arg(target_dir().join("packages"))
        .arg(&repos)
        .env("GNUPGHOME", &gnupg)
        .env("PHQ_SIGNING_KEY", &fpr)
        .env("SOURCE_DATE_EPOCH", now.to_string())
        .env_remove("PHQ_REPO_VALID_DAYS")
        .output()
        .unwrap();
    assert!(out.status.success(), "publish-repos: {}", String::from_utf8_lossy(&out.stderr));
    // The Release expires 30 days after its date, so an old one cannot be replayed for ever.
    let release = std::fs::read_to_string(repos.join("apt/dists/stable/Release")).unwrap();
    let date = |name: &str| {
        let value = release.lines().find_map(|l| l.strip_prefix(&format!("{name}: "))).expect(name);
        sh("date", &["-u", "-d", value, "+%s"]).trim().parse::<u64>().unwrap()
    };
    assert_eq!((date("Date"), date("Valid-Until")), (now, now + 30 * 86_400), "{release}");

    let base = debootstrap_cached("bookworm-minbase");
    let root = w.join("root");
    sh("cp", &["-a", base.to_str().unwrap(), root.to_str().unwrap()]);
    let served = root.join("srv/phq-repo");
    sh("cp", &["-a", repos.join("apt").to_str().unwrap(), served.to_str().unwrap()]);
    sh("chmod", &["-R", "a+rX", served.to_str().unwrap()]);
    std::fs::create_dir_all(root.join("etc/apt/keyrings")).unwrap();
    std::fs::copy(repos.join("phq-agent-archive-keyring.gpg"), root.join("etc/apt/keyrings/phq-agent.gpg")).unwrap();
    let list = "/etc/apt/sources.list.d/phq-agent.list";
    std::fs::write(
        root.join(&list[1..]),
        "deb [signed-by=/etc/apt/keyrings/phq-agent.gpg] file:/srv/phq-repo stable main\n",
    )
    .unwrap();
    // apt knows only this repository: nothing leaves the machine.
    let source_list = format!("Dir::Etc::SourceList={list}");
    let apt = |args: &[&str]| {
        if args[0] == "update" {
            // Each update starts from nothing: what it accepts is what it verified now.
            let _ = std::fs::remove_dir_all(root.join("var/lib/apt/lists"));
        }
        let mut all = vec!["apt-get", "-q", "-o", &source_list];
        all.extend(["-o", "Dir::Etc::SourceParts=-"]);
        all.extend(args);
        let out = chroot(&root, &all);
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    };
    let (ok, log) = apt(&["update"]);
    assert!(ok && !log.contains("W: "), "apt-get update: {log}");
    let (ok, log) = apt(&["install", "-y", "--no-install-recommends", "phq-agent"]);
    assert!(ok, "apt-get install: {log}");
    assert!(root.join("usr/bin/phq-agent").is_file());
    eprintln!("installed from the signed repository:\n{log}");

    // The Release changed after signing (both forms): apt refuses the repository.
    let release = served.join("dists/stable");
    let originals: Vec<(PathBuf, Vec<u8>)> =
        ["InRelease", "Release"].iter().map(|f| (release.join(f), std::fs::read(release.join(f)).unwrap())).collect();
    for (path, bytes) in &originals {
        let text = String::from_utf8(bytes.clone()).unwrap().replace("Codename: stable", "Codename: stablx");
        std::fs::write(path, text).unwrap();
    }
    let (ok, log) = apt(&["update"]);
    assert!(!ok, "a tampered Release was accepted: {log}");
    assert!(log.contains("BADSIG") || log.contains("signatures were invalid"), "{log}");
    eprintln!("tampered Release refused:\n{log}");
    for (path, bytes) in &originals {
        std::fs::write(path, bytes).unwrap();
    }

    // A package changed in the pool after the index was signed: apt refuses to install it.
    let pooled = std::fs::read_dir(served.join("pool/main/p/phq-agent")).unwrap().flatten().next().unwrap().path();
    let mut bytes = std::fs::read(&pooled).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&pooled, &bytes).unwrap();
    let (ok, log) = apt(&["update"]);
    assert!(ok, "{log}");
    let (ok, log) = apt(&["install", "-y", "--reinstall", "--no-install-recommends", "phq-agent"]);
    assert!(!ok && log.contains("Hash Sum mismatch"), "a changed package was installed: {log}");
    eprintln!("tampered package refused:\n{log}");

    // dnf's side, with the same key: the signed package and the signed index.
    let rpmdb = w.join("rpmdb");
    std::fs::create_dir(&rpmdb).unwrap();
    let rpmkeys = |args: &[&str]| Command::new("rpmkeys").arg("--dbpath").arg(&rpmdb).args(args).output().unwrap();
    let imported = rpmkeys(&["--import", repos.join("RPM-GPG-KEY-phq-agent").to_str().unwrap()]);
    assert!(imported.status.success(), "{imported:?}");
    let rpm = std::fs::read_dir(repos.join("rpm"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "rpm"))
        .unwrap();
    let checked = rpmkeys(&["--checksig", rpm.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&checked.stdout).to_string();
    assert!(checked.status.success() && text.contains("signatures OK"), "{text}");
    let keyring = repos.join("phq-agent-archive-keyring.gpg");
    for (sig, file) in [("rpm/repodata/repomd.xml.asc", "rpm/repodata/repomd.xml"), ("SHA256SUMS.asc", "SHA256SUMS")] {
        let v = Command::new("gpgv")
            .arg("--keyring")
            .arg(&keyring)
            .arg(repos.join(sig))
            .arg(repos.join(file))
            .output()
            .unwrap();
        assert!(v.status.success(), "gpgv {file}: {}", String::from_utf8_lossy(&v.stderr));
    }
}

/// The crates in `Cargo.lock`, as (name, version).
fn locked_crates() -> std::collections::BTreeSet<(String, String)> {
    let lock = std::fs::read_to_string(common::repo().join("Cargo.lock")).unwrap();
    let mut out = std::collections::BTreeSet::new();
    let mut name = None;
    for line in lock.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = Some(n.trim_matches('"').to_string());
        } else if let (Some(v), Some(n)) = (line.strip_prefix("version = "), name.take()) {
            out.insert((n, v.trim_matches('"').to_string()));
        }
    }
    out
}

/// The shipped binary says what is in it: the dependency list `cargo auditable` embeds (the
/// `.dep-v0` section, zlib-compressed JSON — what `cargo audit bin`, Trivy and Syft read), taken
/// here from the binary inside the .deb, names the crates of the build at their Cargo.lock
/// versions; the CycloneDX SBOM beside the packages lists every one the binary runs; and
/// SHA256SUMS vouches for the packages and the SBOM.
#[test]
fn the_shipped_binary_and_the_sbom_list_its_crates() {
    use std::io::Read;
    let Some(deb) = package("deb") else { return };
    if !common::needs(&[("objcopy", "binutils"), ("dpkg-deb", "dpkg"), ("sha256sum", "coreutils")]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    sh("dpkg-deb", &["-x", deb.to_str().unwrap(), dir.path().to_str().unwrap()]);
    let section = dir.path().join("dep-v0");
    let bin = dir.path().join("usr/bin/phq-agent");
    let copy = dir.path().join("copy");
    let dump = format!(".dep-v0={}", section.display());
    sh("objcopy", &["--dump-section", &dump, bin.to_str().unwrap(), copy.to_str().unwrap()]);
    let packed = std::fs::read(&section).unwrap();
    assert!(!packed.is_empty(), "the shipped binary has no .dep-v0 section: not built with cargo auditable");
    let mut json = String::new();
    flate2::read::ZlibDecoder::new(&packed[..]).read_to_string(&mut json).unwrap();
    let deps: serde_json::Value = serde_json::from_str(&json).unwrap();
    let embedded = deps["packages"].as_array().unwrap();
    let locked = locked_crates();
    let mut runtime = std::collections::BTreeSet::new();
    for p in embedded {
        let (name, version) = (p["name"].as_str().unwrap().to_string(), p["version"].as_str().unwrap().to_string());
        assert!(locked.contains(&(name.clone(), version.clone())), "{name} {version} is not in Cargo.lock");
        if p["kind"].as_str() != Some("build") && p["root"].as_bool() != Some(true) {
            runtime.insert((name, version));
        }
    }
    for must in ["tokio", "hyper", "nvml-wrapper", "rustls", "zbus", "serde_json"] {
        assert!(runtime.iter().any(|(n, _)| n == must), "{must} is not in the binary's dependency list");
    }
    assert!(embedded.iter().any(|p| p["name"] == "phq-agent" && p["root"] == true));
    eprintln!("the binary lists {} crates ({} it runs)", embedded.len(), runtime.len());

    let packages = target_dir().join("packages");
    let sbom_path = std::fs::read_dir(&packages)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with(".cdx.json"))
        .expect("the CycloneDX SBOM beside the packages");
    let sbom: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&sbom_path).unwrap()).unwrap();
    assert_eq!(sbom["bomFormat"], "CycloneDX");
    let listed: std::collections::BTreeSet<(String, String)> = sbom["components"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["name"].as_str().unwrap().to_string(), c["version"].as_str().unwrap().to_string()))
        .collect();
    let missing: Vec<_> = runtime.difference(&listed).collect();
    assert!(missing.is_empty(), "crates in the binary but not in the SBOM: {missing:?}");

    let sums = Command::new("sha256sum")
        .arg("--check")
        .arg("--strict")
        .arg("SHA256SUMS")
        .current_dir(&packages)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&sums.stdout).to_string();
    assert!(sums.status.success(), "{text}{}", String::from_utf8_lossy(&sums.stderr));
    for kind in [".deb: OK", ".rpm: OK", ".cdx.json: OK"] {
        assert!(text.contains(kind), "SHA256SUMS lacks the {kind} line: {text}");
    }
}

/// A platform double for the upgrade test: accepts every report, keeps its body.
fn accepting_platform() -> (u16, std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>) {
    use std::io::{BufRead, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let g = got.clone();
    std::thread::spawn(move || {
        for s in listener.incoming().flatten() {
            let mut r = std::io::BufReader::new(s.try_clone().unwrap());
            let mut len = 0usize;
            loop {
                let mut line = String::new();
                if r.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0u8; len];
            if r.read_exact(&mut body).is_ok() {
                g.lock().unwrap().push(serde_json::from_slice(&body).unwrap_or_default());
            }
            let _ = (&s).write_all(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    (port, got)
}

/// Version N of the .deb, repacked as N+1 (the same files, a higher version): what an
/// `apt upgrade` brings, for dpkg's upgrade path (maintainer scripts, conffiles).
fn repack_with_version(deb: &Path, dir: &Path, version: &str) -> PathBuf {
    let tree = dir.join(format!("tree-{version}"));
    sh("dpkg-deb", &["-R", deb.to_str().unwrap(), tree.to_str().unwrap()]);
    let control = tree.join("DEBIAN/control");
    let text = std::fs::read_to_string(&control).unwrap();
    let old = text.lines().find(|l| l.starts_with("Version: ")).unwrap().to_string();
    std::fs::write(&control, text.replace(&old, &format!("Version: {version}"))).unwrap();
    let out = dir.join(format!("phq-agent_{version}_amd64.deb"));
    sh("dpkg-deb", &["--root-owner-group", "-b", tree.to_str().unwrap(), out.to_str().unwrap()]);
    out
}

/// An upgrade as `apt upgrade` does it: version N is installed and configured, spools events
/// while the platform is down, and is upgraded to N+1 with dpkg; the operator's edited config,
/// the drop-in, both tokens, the install journal and every spooled event are as they were, and
/// N+1 delivers every one of those events once the platform answers. A downgrade is refused
/// with the reason, and leaves N+1 installed. (Restarting the unit is systemd's part, through
/// the package's `restart-after-upgrade`; the VM test runs under systemd.)
#[test]
fn an_upgrade_keeps_config_tokens_journal_and_spool_and_delivers_every_event() {
    let Some(deb) = package("deb") else { return };
    if !runnable("the upgrade test", &["debootstrap", "chroot", "dpkg-deb"]) {
        return;
    }
    let base = debootstrap_cached("bookworm-minbase");
    let work = tempfile::Builder::new().prefix("phq-upgrade-").tempdir_in(target_dir()).unwrap();
    let w = work.path();
    let root = w.join("root");
    sh("cp", &["-a", base.to_str().unwrap(), root.to_str().unwrap()]);
    let installed = |root: &Path| {
        let q = chroot(root, &["dpkg-query", "-W", "-f=${Version}", "phq-agent"]);
        String::from_utf8_lossy(&q.stdout).to_string()
    };
    let dpkg_i = |file: &Path, env: &[(&str, &str)]| {
        std::fs::copy(file, root.join("tmp/pkg.deb")).unwrap();
        let mut c = Command::new("chroot");
        c.arg(&root).args(["dpkg", "-i", "/tmp/pkg.deb"]).env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin");
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    };
    let (ok, log) = dpkg_i(&deb, &[]);
    assert!(ok, "{log}");
    let n = installed(&root);
    let next = repack_with_version(&deb, w, &format!("{n}+upgrade1"));

    // Configured as an operator and cloud-init would: an edit to the conffile, a drop-in, tokens,
    // and an install journal.
    let etc = root.join("etc/phq-agent");
    let mut conf = std::fs::read_to_string(etc.join("config.toml")).unwrap();
    conf.push_str("\n# edited by the operator\n");
    std::fs::write(etc.join("config.toml"), conf).unwrap();
    std::fs::write(etc.join("platform-token"), "platform-secret-0123456789\n").unwrap();
    let token = chroot(&root, &["phq-agent", "token", "--owner", "phq-agent"]);
    assert!(token.status.success(), "{token:?}");
    let state = root.join("var/lib/phq-agent");
    std::fs::create_dir_all(root.join("var/lib/phq-agent-install")).unwrap();
    std::fs::write(
        root.join("var/lib/phq-agent-install/state.json"),
        "{\"status\": \"done\", \"kept\": \"across upgrades\"}\n",
    )
    .unwrap();
    let dropin = |platform_port: u16| {
        std::fs::create_dir_all(etc.join("config.d")).unwrap();
        // The service is run from outside the root (no systemd in it), so its paths are the root's.
        std::fs::write(
            etc.join("config.d/90-test.toml"),
            format!(
                "[agent]\nstate_dir = \"{}\"\n[http]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n\
                 [platform]\nurl = \"http://127.0.0.1:{platform_port}\"\ntoken_file = \"{}\"\n[probes]\nat_boot = \"none\"\n",
                state.display(),
                etc.join("token").display(),
                etc.join("platform-token").display()
            ),
        )
        .unwrap();
    };
    let scenario = w.join("xids.json");
    let mut s: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::repo().join("examples/scenarios/hgx-8gpu-healthy.json")).unwrap(),
    )
    .unwrap();
    s["devices"][3]["xid_events"] = serde_json::json!([{"xid": 79, "after_ms": 0}, {"xid": 13, "after_ms": 0}]);
    std::fs::write(&scenario, serde_json::to_vec(&s).unwrap()).unwrap();
    let serve = || {
        Command::new(root.join("usr/bin/phq-agent"))
            .args(["serve", "--config"])
            .arg(etc.join("config.toml"))
            .arg("--sysroot")
            .arg(common::repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy"))
            .arg("--nvml-lib")
            .arg(common::fake_nvml())
            .env("PHQ_FAKE_NVML_SCENARIO", &scenario)
            .env("DBUS_SYSTEM_BUS_ADDRESS", format!("unix:path={}/no-bus", w.display()))
            .env_remove("NOTIFY_SOCKET")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    let stop = |mut c: std::process::Child| {
        // SIGTERM, as systemd stops the unit before dpkg replaces the binary.
        let _ = Command::new("kill").arg("-TERM").arg(c.id().to_string()).status();
        let status = c.wait().unwrap();
        assert!(status.success(), "the service did not stop cleanly: {status:?}");
    };
    let spooled = || -> std::collections::BTreeMap<String, Vec<u8>> {
        std::fs::read_dir(state.join("spool"))
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
                    .map(|e| (e.file_name().to_string_lossy().to_string(), std::fs::read(e.path()).unwrap()))
                    .collect()
            })
            .unwrap_or_default()
    };

    // N spools with the platform down (a port nothing listens on).
    let down = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    dropin(down);
    let agent = serve();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while spooled().len() < 2 {
        assert!(std::time::Instant::now() < deadline, "version {n} spooled {} events in 30 s", spooled().len());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    stop(agent);
    let events = spooled();

    let keep = [
        "etc/phq-agent/config.toml",
        "etc/phq-agent/config.d/90-test.toml",
        "etc/phq-agent/token",
        "etc/phq-agent/platform-token",
        "var/lib/phq-agent-install/state.json",
        "var/lib/phq-agent/seq",
    ];
    let before: Vec<(Vec<u8>, u32, u32)> = keep
        .iter()
        .map(|f| {
            let m = std::fs::metadata(root.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
            (std::fs::read(root.join(f)).unwrap(), m.uid(), m.permissions().mode() & 0o777)
        })
        .collect();

    let (ok, log) = dpkg_i(&next, &[]);
    assert!(ok, "upgrade: {log}");
    assert_eq!(installed(&root), format!("{n}+upgrade1"));
    for (f, was) in keep.iter().zip(&before) {
        let m = std::fs::metadata(root.join(f)).unwrap();
        let now = (std::fs::read(root.join(f)).unwrap(), m.uid(), m.permissions().mode() & 0o777);
        assert_eq!(&now, was, "{f} changed in the upgrade");
    }
    assert_eq!(spooled(), events, "the spool changed in the upgrade");

    // N+1 delivers every event N spooled, once the platform answers.
    let (port, got) = accepting_platform();
    dropin(port);
    let agent = serve();
    let want: std::collections::BTreeSet<u64> = events
        .values()
        .map(|b| serde_json::from_slice::<serde_json::Value>(b).unwrap()["seq"].as_u64().unwrap())
        .collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let seen: std::collections::BTreeSet<u64> =
            got.lock().unwrap().iter().filter_map(|b| b["seq"].as_u64()).collect();
        if want.is_subset(&seen) && spooled().is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "after the upgrade, delivered {seen:?} of {want:?}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    stop(agent);
    eprintln!("{} events spooled by {n}, kept through the upgrade, delivered by {n}+upgrade1", want.len());

    // Back to N: refused with the reason, N+1 stays; allowed when asked for.
    let (ok, log) = dpkg_i(&deb, &[]);
    assert!(!ok, "a downgrade went through: {log}");
    assert!(log.contains(&format!("refusing to downgrade from {n}+upgrade1 to {n}")), "{log}");
    assert_eq!(installed(&root), format!("{n}+upgrade1"));
    let (ok, log) = dpkg_i(&deb, &[("PHQ_ALLOW_DOWNGRADE", "1")]);
    assert!(ok, "{log}");
    assert_eq!(installed(&root), n);
}
