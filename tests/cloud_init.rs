//! Every shipped user-data file is valid cloud-config (`cloud-init schema -c`), and each does
//! what the operator guide says: config and tokens, the package, the service, the installer,
//! the conditional reboot.

use std::path::PathBuf;
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
    let Ok(version) = Command::new("cloud-init").arg("--version").output() else {
        assert!(std::env::var_os("CI").is_none(), "CI must have cloud-init (.ci/run installs it)");
        eprintln!("SKIPPED: cloud-init is not installed");
        return;
    };
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
        // The condition greps what the installer's journal really says.
        let st = serde_json::json!({"status": "reboot-required"});
        assert!(serde_json::to_string_pretty(&st).unwrap().contains("\"status\": \"reboot-required\""));
        // Every variable it uses is in the operator guide.
        let guide = std::fs::read_to_string(dir().join("README.md")).unwrap();
        for var in text.split("${").skip(1).map(|s| s.split('}').next().unwrap()) {
            assert!(guide.contains(&format!("`{var}`")), "{file}: {var} is not documented in cloud-init/README.md");
        }
    }
}
