//! When the driver hangs, `doctor` still answers: with the fake NVML's `nvmlInit_v2` blocked for
//! 20 s (a GPU fallen off the bus, Xid 79), the real binary over the Xid 79 guest exits within
//! its NVML init deadline plus a second, with every finding that does not come from NVML and
//! `nvml.responsive` failing.

mod common;

use common::*;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// The deadline the test gives `nvmlInit_v2` (`nvml.init_timeout`).
const INIT_TIMEOUT: Duration = Duration::from_secs(3);

/// `doctor --json` over the Xid 79 guest: with the fake NVML and `scenario`, or without NVML.
fn doctor_on(config: &Path, scenario: Option<&str>) -> (i32, Value, Duration) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_phq-agent"));
    cmd.args(["doctor", "--json", "--sysroot"])
        .arg(repo().join("tests/fixtures/sysroots/hgx-8gpu-xid79"))
        .arg("--config")
        .arg(config)
        .env_remove("DBUS_SYSTEM_BUS_ADDRESS");
    if let Some(s) = scenario {
        cmd.arg("--nvml-lib")
            .arg(fake_nvml())
            .env("PHQ_FAKE_NVML_SCENARIO", repo().join("examples/scenarios").join(format!("{s}.json")));
    }
    let started = Instant::now();
    let out = cmd.output().unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stderr}"));
    validate(&report);
    (out.status.code().unwrap_or(-1), report, took)
}

/// (id, gpu, severity, summary) of every finding.
fn rows(r: &Value) -> BTreeSet<(String, String, String, String)> {
    r["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let s = |k: &str| f[k].as_str().unwrap_or("").to_string();
            (s("id"), s("gpu"), s("severity"), s("summary"))
        })
        .collect()
}

#[test]
fn doctor_answers_within_the_init_deadline_when_nvml_init_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(&config, format!("[nvml]\ninit_timeout = \"{}s\"\n", INIT_TIMEOUT.as_secs())).unwrap();
    let fake_nvml = fake_nvml(); // built before the clock starts

    // The findings that do not come from NVML: the same whether NVML answers or is not asked.
    let (_, answering, _) = doctor_on(&config, Some("hgx-8gpu-xid79"));
    let (_, without, _) = doctor_on(&config, None);
    let non_nvml: BTreeSet<_> = rows(&answering).intersection(&rows(&without)).cloned().collect();
    assert!(non_nvml.iter().any(|r| r.0 == "gpu.xid" && r.2 == "fail"), "the kernel log's Xid 79 is among them");
    assert!(non_nvml.iter().any(|r| r.0.starts_with("pci.")) && non_nvml.iter().any(|r| r.0.starts_with("host.")));

    let (code, blocked, took) = doctor_on(&config, Some("hgx-8gpu-xid79-init-hangs"));
    eprintln!("doctor with nvmlInit_v2 blocked: {took:?} (init deadline {INIT_TIMEOUT:?}); {}", fake_nvml.display());
    assert!(took <= INIT_TIMEOUT + Duration::from_secs(1), "doctor took {took:?}");
    assert!(took >= INIT_TIMEOUT, "doctor waited for nvmlInit_v2 its whole deadline, no less: {took:?}");
    assert_eq!(code, 2, "a failed check exits 2");
    let printed = rows(&blocked);
    let missing: Vec<_> = non_nvml.difference(&printed).collect();
    assert!(missing.is_empty(), "every non-NVML finding is printed; missing: {missing:#?}");
    let responsive = findings(&blocked, "nvml.responsive");
    assert_eq!(responsive.len(), 1, "{responsive:#?}");
    assert_eq!(responsive[0]["severity"], "fail");
    let summary = responsive[0]["summary"].as_str().unwrap();
    assert!(summary.starts_with("NVML is not answering: nvmlInit_v2 has not returned for 3 s"), "{summary}");
    assert_eq!(responsive[0]["evidence"]["call"], "nvmlInit_v2");
    assert_eq!(findings(&blocked, "nvml.init")[0]["severity"], "unknown");
    // No GPU figure is made up: NVML gave none.
    assert!(blocked["gpus"].as_array().unwrap().iter().all(|g| g["temperature_c"].is_null()), "{:#}", blocked["gpus"]);
}
