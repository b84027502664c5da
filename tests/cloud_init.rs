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
            "[systemctl, enable, --now, phq-agent.service]",
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
