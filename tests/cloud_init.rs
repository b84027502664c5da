//! Every shipped user-data file is valid cloud-config (`cloud-init schema -c`), and each does
//! what the operator guide says: config and tokens, the package, the service, the installer,
//! the conditional reboot.

mod common;

use phq_agent::install::apply::{journal_bytes, state_path, State, Status};
use std::path::{Path, PathBuf};
use std::process::Command;

const FILES: &[(&str, &str)] = &[
    ("ubuntu-22.04.yaml", "apt-get"),
    ("ubuntu-24.04.yaml", "apt-get"),
    ("debian-12.yaml", "apt-get"),
    ("rhel-9.yaml", "dnf"),
];

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cloud-init")
}

#[test]
fn every_user_data_passes_cloud_init_schema() {
    if !common::needs(&[("cloud-init", "cloud-init")]) {
        return;
    }
    let version = Command::new("cloud-init").arg("--version").output().unwrap();
    eprintln!("{}", String::from_utf8_lossy(&version.stdout).trim());
    for (file, _) in FILES {
        let out = Command::new("cloud-init").args(["schema", "-c"]).arg(dir().join(file)).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("Valid cloud-config"), "{file}: {text}");
    }
}

#[test]
fn every_user_data_installs_configures_and_survives_the_reboot() {
    for (file, installer) in FILES {
        let text = std::fs::read_to_string(dir().join(file)).unwrap();
        assert!(text.starts_with("#cloud-config\n"), "{file}");
        for must in [
            "/etc/phq-agent/config.d/50-cloud-init.toml",
            "path: /etc/phq-agent/token\n    permissions: \"0600\"",
            "path: /etc/phq-agent/platform-token\n    permissions: \"0600\"",
            "systemctl enable --now phq-agent.service",
            "\"${PHQ_PACKAGE_SHA256}\"",
            "phq-agent install --reboot never",
            "power_state:",
            "\"status\": \"reboot-required\"",
            installer,
        ] {
            assert!(text.contains(must), "{file} lacks {must:?}");
        }
        // The reboot's condition greps the installer's real journal, as the installer writes
        // it when a reboot is required (and not when it is done).
        let (pattern, path) = reboot_condition(&text).unwrap_or_else(|| panic!("{file}: no grep condition"));
        let default_state = phq_agent::config::Config::default().agent.state_dir;
        assert_eq!(Path::new(&path), state_path(&default_state), "{file} greps another file than the journal");
        let written = |status| String::from_utf8(journal_bytes(&journal(status)).unwrap()).unwrap();
        assert!(written(Status::RebootRequired).contains(&pattern), "{file}: {pattern:?} is not in the journal");
        assert!(!written(Status::Done).contains(&pattern), "{file}: {pattern:?} would reboot a finished install");
        // Every variable it uses is in the operator guide.
        let guide = std::fs::read_to_string(dir().join("README.md")).unwrap();
        for var in text.split("${").skip(1).map(|s| s.split('}').next().unwrap()) {
            assert!(guide.contains(&format!("`{var}`")), "{file}: {var} is not documented in cloud-init/README.md");
        }
    }
}

/// The first runcmd entry, `[sh, -ec, SCRIPT, NAME, URL, SHA256]`, as JSON; None (a skip) without
/// python3's yaml module.
fn first_runcmd(file: &str) -> Option<Vec<String>> {
    let python = Path::new("/usr/bin/python3");
    let has_yaml =
        python.is_file() && Command::new(python).args(["-c", "import yaml"]).output().is_ok_and(|o| o.status.success());
    if !has_yaml {
        common::skip("needs /usr/bin/python3 with its yaml module (apt-get install python3-yaml)");
        return None;
    }
    let out = Command::new(python)
        .args(["-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))['runcmd'][0]))"])
        .arg(dir().join(file))
        .output()
        .unwrap();
    assert!(out.status.success(), "{file}: {}", String::from_utf8_lossy(&out.stderr));
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

/// The user-data's own first-boot script, run with stand-ins for the package manager,
/// systemctl and the agent (each writes its arguments to a log): the package is installed
/// only when its SHA-256 is the one given, and otherwise nothing runs and the reason is said.
#[test]
fn the_package_is_installed_only_when_its_sha256_matches() {
    use std::os::unix::fs::PermissionsExt;
    if !common::needs(&[("curl", "curl"), ("sha256sum", "coreutils")]) {
        return;
    }
    for (file, installer) in FILES {
        let Some(cmd) = first_runcmd(file) else { return };
        assert_eq!(&cmd[..2], ["sh", "-ec"], "{file}");
        assert_eq!(
            &cmd[4..],
            ["${PHQ_PACKAGE_URL}", "${PHQ_PACKAGE_SHA256}"],
            "{file}: URL and checksum are arguments"
        );
        let tmp = tempfile::tempdir().unwrap();
        let bin = tmp.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let log = tmp.path().join("calls");
        for tool in [*installer, "systemctl", "phq-agent"] {
            let stub = bin.join(tool);
            std::fs::write(&stub, format!("#!/bin/sh\necho \"$(basename \"$0\") $*\" >> '{}'\n", log.display()))
                .unwrap();
            std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        // The script as shipped, downloading into the test's directory instead of /run.
        let script = cmd[2].replace("/run/phq-agent.", &format!("{}/phq-agent.", tmp.path().display()));
        let package = tmp.path().join("served-package");
        std::fs::write(&package, b"the package's bytes").unwrap();
        // Well formed, but another package's.
        let other = "cc1ff1c2a2a7c0f8f2d5b0b9e8a9c3ac6c1ab1b2ab54bd6d12a2c76b15f8f0f9";
        let out = Command::new("sha256sum").arg(&package).output().unwrap();
        let actual = String::from_utf8_lossy(&out.stdout).split(' ').next().unwrap().to_string();
        let run = |sha: &str| {
            let _ = std::fs::remove_file(&log);
            let out = Command::new("sh")
                .arg("-ec")
                .arg(&script)
                .arg("phq-agent-first-boot")
                .arg(format!("file://{}", package.display()))
                .arg(sha)
                .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
                .output()
                .unwrap();
            let calls = std::fs::read_to_string(&log).unwrap_or_default();
            (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string(), calls)
        };
        let (code, err, calls) = run(&actual);
        assert_eq!(code, Some(0), "{file}: {err}");
        assert!(
            calls.starts_with(&format!("{installer} install -y -q {}/phq-agent.", tmp.path().display())),
            "{file}: {calls}"
        );
        assert!(
            calls.contains("systemctl enable --now phq-agent.service\nphq-agent install --reboot never"),
            "{file}: {calls}"
        );

        let (code, err, calls) = run(other);
        assert_eq!(code, Some(1), "{file}: a wrong checksum must stop the install");
        assert!(
            err.contains(&format!("has SHA-256 {actual}, not PHQ_PACKAGE_SHA256 {other}; nothing installed")),
            "{file}: {err}"
        );
        assert!(calls.is_empty(), "{file}: ran {calls}");
        assert!(
            std::fs::read_dir(tmp.path())
                .unwrap()
                .flatten()
                .all(|e| !e.file_name().to_string_lossy().starts_with("phq-agent.")),
            "{file}: the refused package is removed"
        );

        for bad in ["", "not-a-checksum", &actual.to_uppercase()] {
            let (code, err, calls) = run(bad);
            assert_eq!(code, Some(1), "{file}: {bad:?}");
            assert!(err.contains("PHQ_PACKAGE_SHA256 must be the package's SHA-256"), "{file}: {err}");
            assert!(calls.is_empty(), "{file}: {calls}");
        }
        eprintln!("{file}: refused a wrong checksum with: {}", err_line(&run(other).1));
    }
}

fn err_line(s: &str) -> String {
    s.lines().last().unwrap_or_default().to_string()
}

/// `condition: [grep, -q, 'PATTERN', PATH]` of the user-data's power_state.
fn reboot_condition(text: &str) -> Option<(String, String)> {
    let line = text.lines().find(|l| l.trim_start().starts_with("condition: [grep, -q, "))?;
    let rest = line.split_once("[grep, -q, ")?.1.trim_end().strip_suffix(']')?;
    let (pattern, path) = rest.strip_prefix('\'')?.split_once("', ")?;
    Some((pattern.to_string(), path.trim().to_string()))
}

fn journal(status: Status) -> State {
    State {
        schema: phq_agent::install::apply::STATE_SCHEMA.into(),
        status,
        plan: "test".into(),
        started_at: "2026-12-01T00:00:00Z".into(),
        updated_at: "2026-12-01T00:00:00Z".into(),
        steps: Default::default(),
        reboot_pending_since: None,
        reboot_reason: None,
        reboots: 0,
        error: None,
        findings: vec![],
    }
}
