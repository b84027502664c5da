//! `scripts/publish-repos` on stand-in packages (a .deb from dpkg-deb, an .rpm from rpmbuild), so
//! that it runs without the release build: the Release it signs carries a Valid-Until the chosen
//! number of days after its Date, apt takes the repository while that holds and refuses a signed
//! Release once it has passed (an old Release replayed), and publish-repos refuses a window that
//! is malformed or already over. `tests/packages.rs` publishes the real packages and installs
//! them in a Debian root.

mod common;

use common::debian::{build_deb, sh, Deb};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

const DAY: u64 = 86_400;

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

/// A Release field's value.
fn field(release: &str, name: &str) -> String {
    let prefix = format!("{name}: ");
    release
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {name} in the Release:\n{release}"))
        .to_string()
}

/// A Release date (RFC 1123, as apt reads it) in seconds since the epoch, read by date(1).
fn epoch_of(date: &str) -> u64 {
    sh("date", &["-u", "-d", date, "+%s"]).trim().parse().unwrap()
}

/// The same, the other way: apt's form of `epoch`.
fn rfc(epoch: u64) -> String {
    sh("date", &["-u", "-d", &format!("@{epoch}"), "+%a, %d %b %Y %H:%M:%S UTC"]).trim().to_string()
}

#[test]
fn the_signed_release_expires_after_its_window_and_apt_refuses_it_then() {
    if !common::needs(&[
        ("gpg", "gpg"),
        ("apt-ftparchive", "apt-utils"),
        ("createrepo_c", "createrepo-c"),
        ("rpmsign", "rpm"),
        ("rpmbuild", "rpm"),
        ("dpkg-deb", "dpkg"),
        ("apt-get", "apt"),
    ]) {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let key = common::TestKey::new(w);
    let (gnupg, fpr) = (key.home.clone(), key.fpr.clone());
    let gpg = |args: &[&str]| key.gpg(args);

    // The stand-ins: one .deb, one .rpm, each with no files.
    let packages = w.join("packages");
    std::fs::create_dir(&packages).unwrap();
    build_deb(&packages, &Deb { name: "phq-agent", version: "0.0.1-1", depends: "", files: vec![], postinst: "" });
    let rpmbuild = w.join("rpmbuild");
    std::fs::create_dir(&rpmbuild).unwrap();
    let spec = rpmbuild.join("phq-agent.spec");
    std::fs::write(
        &spec,
        "Name: phq-agent\nVersion: 0.0.1\nRelease: 1\nSummary: stand-in\nLicense: MIT\nBuildArch: noarch\n\
         %description\nstand-in for the publish-repos test\n%files\n",
    )
    .unwrap();
    let topdir = format!("_topdir {}", rpmbuild.display());
    sh("rpmbuild", &["-bb", "--quiet", "--nodeps", "--define", &topdir, spec.to_str().unwrap()]);
    std::fs::copy(rpmbuild.join("RPMS/noarch/phq-agent-0.0.1-1.noarch.rpm"), packages.join("phq-agent.rpm")).unwrap();

    let repos = w.join("repos");
    let publish = |env: &[(&str, String)]| {
        let mut c = Command::new(common::repo().join("scripts/publish-repos"));
        c.arg(&packages)
            .arg(&repos)
            .env("GNUPGHOME", &gnupg)
            .env("PHQ_SIGNING_KEY", &fpr)
            .env_remove("SOURCE_DATE_EPOCH")
            .env_remove("PHQ_REPO_VALID_DAYS");
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), log)
    };
    let release = || std::fs::read_to_string(repos.join("apt/dists/stable/Release")).unwrap();

    // The default window, 30 days from the date the script is given.
    let now = now();
    let (ok, log) = publish(&[("SOURCE_DATE_EPOCH", now.to_string())]);
    assert!(ok, "publish-repos: {log}");
    let text = release();
    assert_eq!(epoch_of(&field(&text, "Date")), now, "{text}");
    assert_eq!(epoch_of(&field(&text, "Valid-Until")), now + 30 * DAY, "{text}");
    assert_eq!(field(&text, "Valid-Until"), rfc(now + 30 * DAY));
    let inline = std::fs::read_to_string(repos.join("apt/dists/stable/InRelease")).unwrap();
    assert!(inline.contains(&format!("\nValid-Until: {}\n", rfc(now + 30 * DAY))), "{inline}");
    assert!(log.contains(&format!("valid until {}", rfc(now + 30 * DAY))), "it says until when: {log}");

    // Another window; and without SOURCE_DATE_EPOCH the date is the .deb's time stamp, as before.
    let (ok, log) = publish(&[("SOURCE_DATE_EPOCH", now.to_string()), ("PHQ_REPO_VALID_DAYS", "7".into())]);
    assert!(ok, "publish-repos: {log}");
    assert_eq!(epoch_of(&field(&release(), "Valid-Until")), now + 7 * DAY);
    let (ok, log) = publish(&[]);
    assert!(ok, "publish-repos: {log}");
    let deb =
        std::fs::read_dir(&packages).unwrap().flatten().find(|e| e.path().extension().is_some_and(|x| x == "deb"));
    let mtime = deb.unwrap().metadata().unwrap().modified().unwrap().duration_since(UNIX_EPOCH).unwrap().as_secs();
    let text = release();
    assert_eq!(epoch_of(&field(&text, "Date")), mtime, "{text}");
    assert_eq!(epoch_of(&field(&text, "Valid-Until")), mtime + 30 * DAY, "{text}");

    // Refused before anything is written: the last publication stays as it was.
    let published = release();
    let old = now - 40 * DAY;
    for (env, says) in [
        (vec![("PHQ_REPO_VALID_DAYS", "0".to_string())], "PHQ_REPO_VALID_DAYS"),
        (vec![("PHQ_REPO_VALID_DAYS", "7d".to_string())], "PHQ_REPO_VALID_DAYS"),
        (vec![("PHQ_REPO_VALID_DAYS", "-1".to_string())], "PHQ_REPO_VALID_DAYS"),
        (vec![("PHQ_REPO_VALID_DAYS", "366".to_string())], "PHQ_REPO_VALID_DAYS"),
        (vec![("PHQ_REPO_VALID_DAYS", "a[$(touch /tmp/x)]".to_string())], "PHQ_REPO_VALID_DAYS"),
        (vec![("SOURCE_DATE_EPOCH", "yesterday".to_string())], "SOURCE_DATE_EPOCH"),
        (vec![("SOURCE_DATE_EPOCH", old.to_string())], "has passed"),
        (vec![("SOURCE_DATE_EPOCH", old.to_string()), ("PHQ_REPO_VALID_DAYS", "40".to_string())], "has passed"),
    ] {
        let (ok, log) = publish(&env);
        assert!(!ok, "{env:?} was published: {log}");
        assert!(log.contains(says), "{env:?}: {log}");
        assert_eq!(release(), published, "{env:?}: the publication changed");
        eprintln!("{env:?}: {}", log.trim());
    }

    // apt (this machine's, on its own lists and this source alone) takes the repository while its
    // Release is valid.
    let (ok, log) = publish(&[("SOURCE_DATE_EPOCH", now.to_string())]);
    assert!(ok, "publish-repos: {log}");
    // apt's own defaults (Acquire::Check-Valid-Until among them, apt.conf(5)), not this machine's:
    // APT_CONFIG is read first and points the configuration directory and file elsewhere.
    let apt_dir = w.join("apt");
    for d in ["state/lists/partial", "cache/archives/partial", "etc/apt.conf.d"] {
        std::fs::create_dir_all(apt_dir.join(d)).unwrap();
    }
    let d = apt_dir.display();
    std::fs::write(apt_dir.join("status"), "").unwrap();
    std::fs::write(apt_dir.join("etc/apt.conf"), "").unwrap();
    std::fs::write(
        apt_dir.join("etc/sources.list"),
        format!(
            "deb [signed-by={}] file:{}/apt stable main\n",
            repos.join("phq-agent-archive-keyring.gpg").display(),
            repos.display()
        ),
    )
    .unwrap();
    std::fs::write(
        apt_dir.join("config"),
        format!(
            "Dir::Etc::Parts \"{d}/etc/apt.conf.d\";\nDir::Etc::Main \"{d}/etc/apt.conf\";\n\
             Dir::Etc::SourceList \"{d}/etc/sources.list\";\nDir::Etc::SourceParts \"-\";\n\
             Dir::State \"{d}/state\";\nDir::State::status \"{d}/status\";\nDir::Cache \"{d}/cache\";\n\
             APT::Architecture \"amd64\";\nAPT::Architectures \"amd64\";\n\
             // The files belong to the test, not to apt's sandbox user.\nAPT::Sandbox::User \"root\";\n"
        ),
    )
    .unwrap();
    let update = || {
        let _ = std::fs::remove_dir_all(apt_dir.join("state/lists"));
        std::fs::create_dir_all(apt_dir.join("state/lists/partial")).unwrap();
        let out =
            Command::new("apt-get").args(["-q", "update"]).env("APT_CONFIG", apt_dir.join("config")).output().unwrap();
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    };
    let config = Command::new("apt-config").arg("dump").env("APT_CONFIG", apt_dir.join("config")).output().unwrap();
    let config = String::from_utf8_lossy(&config.stdout).to_string();
    assert!(!config.contains("Check-Valid-Until"), "apt's default is not in force here:\n{config}");
    let (ok, log) = update();
    assert!(ok && !log.contains("expired") && !log.contains("E: "), "apt-get update: {log}");

    // The same Release as it would have been published 40 days ago with the 30-day window,
    // signed by the same key: apt refuses it.
    let stable = repos.join("apt/dists/stable");
    let text = release()
        .replace(&field(&release(), "Date"), &rfc(old))
        .replace(&field(&release(), "Valid-Until"), &rfc(old + 30 * DAY));
    std::fs::write(stable.join("Release"), &text).unwrap();
    let signed = |args: &[&str]| gpg(&[&["--yes", "--local-user", &fpr], args].concat());
    signed(&[
        "--clearsign",
        "--output",
        stable.join("InRelease").to_str().unwrap(),
        stable.join("Release").to_str().unwrap(),
    ]);
    signed(&[
        "--armor",
        "--detach-sign",
        "--output",
        stable.join("Release.gpg").to_str().unwrap(),
        stable.join("Release").to_str().unwrap(),
    ]);
    let (ok, log) = update();
    assert!(!ok && log.contains("is expired"), "apt-get update took an expired Release: {log}");
    eprintln!("an expired Release refused:\n{log}");
}
