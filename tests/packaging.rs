//! The shipped unit as systemd judges it: `systemd-analyze security --offline` exposure at most
//! 2.0 (issue #7's aim) while the service keeps what it needs.

use std::path::Path;
use std::process::Command;

#[test]
fn unit_exposure_is_at_most_2_0() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/systemd/phq-agent.service");
    let Ok(out) = Command::new("systemd-analyze").args(["security", "--offline=true"]).arg(&unit).output() else {
        eprintln!("systemd-analyze is not installed: skipped");
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or_else(|| panic!("no exposure line: {text}"));
    let level: f64 = line
        .split("phq-agent.service:")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(level <= 2.0, "exposure {level} > 2.0:\n{text}");
    let unit_text = std::fs::read_to_string(&unit).unwrap();
    for needed in [
        "Type=notify",
        "WatchdogSec=",
        "AmbientCapabilities=CAP_SYSLOG",
        "DeviceAllow=char-nvidia-frontend rw",
        "StateDirectory=phq-agent",
    ] {
        assert!(unit_text.contains(needed), "the unit lost {needed}");
    }
}

#[test]
fn install_unit_resumes_once_and_is_measured() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/systemd/phq-agent-install.service");
    let text = std::fs::read_to_string(&unit).unwrap();
    for needed in [
        "Type=oneshot",
        "ExecStart=/usr/bin/phq-agent install --resume",
        "ConditionPathExists=/var/lib/phq-agent/install/state.json",
        "SuccessExitStatus=1",
        "WantedBy=multi-user.target",
    ] {
        assert!(text.contains(needed), "the install unit lost {needed}");
    }
    // Ordering it after cloud-final.service would be a cycle through multi-user.target.
    assert!(!text.lines().any(|l| l.starts_with("After=") && l.contains("cloud-final")));
    let Ok(out) = Command::new("systemd-analyze").args(["security", "--offline=true"]).arg(&unit).output() else {
        eprintln!("systemd-analyze is not installed: skipped");
        return;
    };
    // It installs packages as root: exposed by nature. The number is reported, not judged.
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.contains("Overall exposure level")).unwrap_or_default();
    eprintln!("{line}");
}
