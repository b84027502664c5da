//! Black box: the real, unchanged `phq-agent` binary loads the fake libnvidia-ml
//! (crates/fake-nvml) through `--nvml-lib`, which answers from the scenarios in
//! examples/scenarios, and asks a private dbus-daemon's systemd stand-in for unit states.
//! Each test asserts what a GPU engineer would look for.

mod common;

use common::*;
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// doctor over a fixture with a scenario, systemd answering from a private bus with healthy
/// units; None (a skip) without dbus-daemon.
fn run(sysroot: &str, scenario: &str, lib: Option<&Path>) -> Option<(i32, Value, String)> {
    let bus = PrivateBus::start(HEALTHY_UNITS)?;
    Some(doctor(sysroot, scenario, lib, Some(&bus.address), &[]))
}

#[test]
fn healthy_hgx_has_zero_false_alarms() {
    let Some((code, r, _)) = run("hgx-8gpu-healthy", "hgx-8gpu-healthy", None) else { return };
    assert_eq!(bad(&r), vec![]);
    // Every NVML-backed check ran: the only unknowns left are the CUDA ones.
    let unknown: Vec<&str> = r["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == "unknown")
        .map(|f| f["id"].as_str().unwrap())
        .collect();
    assert_eq!(unknown, vec!["cuda.driver-api", "cuda.init"]);
    assert_eq!(code, 3);
    assert_eq!(r["gpus"][0]["uuid"], "GPU-3f1c0b7e-0000-4000-8000-000000000009");
    assert_eq!(findings(&r, "nvlink.links-active").len(), 8);
    assert_eq!(findings(&r, "nvlink.links-active")[0]["summary"], "18/18 NVLinks active");
    assert!(findings(&r, "nvml.init")[0]["summary"].as_str().unwrap().contains("8 GPU(s)"));
    assert_eq!(findings(&r, "fabric.manager-version")[0]["severity"], "pass");
}

#[test]
fn fabric_not_started_explains_error_802() {
    let Some(bus) = PrivateBus::start(&[
        ("nvidia-persistenced.service", "loaded", "active", "running", "enabled"),
        ("nvidia-fabricmanager.service", "loaded", "inactive", "dead", "disabled"),
    ]) else {
        return;
    };
    let (code, r, _) = doctor("hgx-8gpu-healthy", "hgx-8gpu-fabric-not-started", None, Some(&bus.address), &[]);
    assert_eq!(code, 2);
    let m = findings(&r, "fabric.manager-running")[0];
    assert_eq!(m["severity"], "fail");
    assert_eq!(m["summary"], "nvidia-fabricmanager is inactive (dead)");
    assert!(m["detail"].as_str().unwrap().contains("error 802"), "{m}");
    assert!(m["remedy"].as_str().unwrap().contains("systemctl enable --now nvidia-fabricmanager"));
    let states = findings(&r, "fabric.state");
    assert_eq!(states.len(), 8);
    assert!(states.iter().all(|f| f["severity"] == "fail" && f["summary"].as_str().unwrap().contains("802")));
    // The links are down because the fabric is: reported as such, per GPU.
    assert!(findings(&r, "nvlink.links-active").iter().all(|f| f["severity"] == "fail"));
}

/// NVML's recovery action (field 230) read through the real library path: Xid 154 follows it,
/// and it governs the GPU's finding.
#[test]
fn xid_154_follows_the_recovery_action_nvml_reads() {
    let Some((code, r, _)) = run("hgx-8gpu-healthy", "hgx-8gpu-xid154-reset-required", None) else { return };
    assert_eq!(code, 2);
    assert_eq!(bad(&r), vec![row("gpu.xid", "0000:0d:00.0", "fail")]);
    let f = findings(&r, "gpu.xid").into_iter().find(|f| f["gpu"] == "0000:0d:00.0").unwrap();
    assert_eq!(
        f["summary"],
        "Xid 62 (Internal micro-controller halt (newer drivers)) ×1, Xid 154 (GPU Recovery Action Changed) ×1"
    );
    assert_eq!(f["evidence"]["recovery_action"], serde_json::json!({"value": 1}));
    let detail = f["detail"].as_str().unwrap();
    assert!(detail.contains("The action is 1 (GPU reset required), from NVML's current recovery action"), "{detail}");
    assert!(f["remedy"].as_str().unwrap().contains("nvidia-smi -r -i 0000:0d:00.0"));
    // The other GPUs' scenario has no field 230 (an older driver): no action, no alarm.
    let other = findings(&r, "gpu.xid").into_iter().find(|f| f["gpu"] == "0000:09:00.0").unwrap();
    assert_eq!(other["severity"], "pass");
}

#[test]
fn xid_79_names_the_gpu_that_fell_off() {
    let Some((code, r, _)) = run("hgx-8gpu-healthy", "hgx-8gpu-xid79", None) else { return };
    assert_eq!(code, 2);
    assert_eq!(bad(&r), vec![row("gpu.xid", "0000:0c:00.0", "fail")]);
    let f = findings(&r, "gpu.xid").into_iter().find(|f| f["gpu"] == "0000:0c:00.0").unwrap();
    assert!(f["summary"].as_str().unwrap().contains("fallen off the bus"));
    assert_eq!(f["evidence"]["xids"][0]["sources"], serde_json::json!(["nvml"]));
    let gpu = r["gpus"].as_array().unwrap().iter().find(|g| g["pci_address"] == "0000:0c:00.0").unwrap();
    assert_eq!(gpu["status"], "fail");
    // Its other readings fail with GPU_IS_LOST: honest unknowns, not passes.
    assert_eq!(
        findings(&r, "gpu.temperature").into_iter().find(|f| f["gpu"] == "0000:0c:00.0").unwrap()["severity"],
        "unknown"
    );
}

#[test]
fn double_bit_ecc_with_pending_remap() {
    let Some((code, r, _)) = run("hgx-8gpu-healthy", "hgx-8gpu-ecc-dbe-remap-pending", None) else { return };
    assert_eq!(code, 2);
    let g = "0000:0b:00.0";
    assert_eq!(
        bad(&r),
        vec![row("gpu.ecc-uncorrectable", g, "fail"), row("gpu.row-remap", g, "warn"), row("gpu.xid", g, "fail")]
    );
    let remap = findings(&r, "gpu.row-remap").into_iter().find(|f| f["gpu"] == g).unwrap();
    assert!(remap["remedy"].as_str().unwrap().contains("reset"));
}

#[test]
fn degraded_pcie_and_hw_thermal_slowdown() {
    let Some((code, r, _)) = run("hgx-8gpu-healthy", "hgx-8gpu-pcie-degraded-thermal", None) else { return };
    assert_eq!(code, 2);
    let g = "0000:0e:00.0";
    assert_eq!(
        bad(&r),
        vec![row("gpu.pcie-link", g, "fail"), row("gpu.temperature", g, "fail"), row("gpu.throttle", g, "fail")]
    );
    let link = findings(&r, "gpu.pcie-link").into_iter().find(|f| f["gpu"] == g).unwrap();
    assert_eq!(link["summary"], "Gen3 x8 of Gen5 x16: link width at half or less");
    let t = findings(&r, "gpu.throttle").into_iter().find(|f| f["gpu"] == g).unwrap();
    assert!(t["summary"].as_str().unwrap().contains("hw_thermal_slowdown"));
}

#[test]
fn two_inactive_nvlinks_on_one_gpu() {
    let Some((code, r, _)) = run("hgx-8gpu-healthy", "hgx-8gpu-nvlink-down", None) else { return };
    assert_eq!(code, 2);
    let g = "0000:0a:00.0";
    assert_eq!(bad(&r), vec![row("nvlink.errors", g, "warn"), row("nvlink.links-active", g, "fail")]);
    let f = findings(&r, "nvlink.links-active").into_iter().find(|f| f["gpu"] == g).unwrap();
    assert_eq!(f["summary"], "2 of 18 NVLinks inactive (links 4, 11)");
}

#[test]
fn sparse_vm_gives_honest_unknowns_and_no_failure() {
    // No NVSwitch, so no fabric manager installed: systemd knows only persistenced.
    let Some(bus) = PrivateBus::start(&HEALTHY_UNITS[..1]) else { return };
    let (code, r, _) = doctor("h100-pcie-single", "h100-pcie-vm-unsupported", None, Some(&bus.address), &[]);
    assert_eq!(bad(&r), vec![], "NOT_SUPPORTED must never become a failure");
    assert_eq!(code, 3);
    let unknown: Vec<&Value> = r["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == "unknown" && f["id"].as_str().unwrap().starts_with("gpu."))
        .collect();
    assert!(unknown.len() >= 8, "{unknown:#?}");
    assert!(unknown.iter().all(|f| f["summary"].as_str().unwrap().contains("not supported")));
    // What it does support is judged.
    assert_eq!(findings(&r, "gpu.temperature")[0]["severity"], "pass");
    assert_eq!(findings(&r, "driver.persistence")[0]["severity"], "pass");
    // No NVLink on a PCIe card and no NVSwitch in the VM: passes that say why.
    assert_eq!(findings(&r, "nvlink.links-active")[0]["severity"], "pass");
    assert!(findings(&r, "fabric.state")[0]["summary"].as_str().unwrap().contains("NVSwitch"));
}

#[test]
fn nvml_init_failures_are_told_apart() {
    for (scenario, words) in [
        ("init-driver-not-loaded", "kernel driver is not loaded"),
        ("init-version-mismatch", "version mismatch"),
        ("init-no-permission", "no permission"),
    ] {
        let Some((code, r, _)) = run("hgx-8gpu-healthy", scenario, None) else { return };
        assert_eq!(code, 2, "{scenario}");
        let f = findings(&r, "nvml.init")[0];
        assert_eq!(f["severity"], "fail", "{scenario}");
        assert!(f["summary"].as_str().unwrap().contains(words), "{scenario}: {f}");
        assert!(f["remedy"].as_str().is_some_and(|s| !s.is_empty()));
        // Everything NVML would have told is unknown, with the reason.
        let temp = findings(&r, "gpu.temperature")[0];
        assert_eq!(temp["severity"], "unknown");
        assert!(temp["summary"].as_str().unwrap().contains("NVML failed to initialise"));
    }
}

#[test]
fn missing_nvml_library_is_a_clear_failure_not_a_crash() {
    let Some((code, r, _)) =
        run("hgx-8gpu-healthy", "hgx-8gpu-healthy", Some(Path::new("/nonexistent/libnvidia-ml.so.1")))
    else {
        return;
    };
    assert_eq!(code, 2);
    let f = findings(&r, "nvml.init")[0];
    assert_eq!(f["severity"], "fail");
    assert_eq!(f["summary"], "the NVML library is not installed");
    assert!(f["detail"].as_str().unwrap().contains("/nonexistent/libnvidia-ml.so.1"));
}

#[test]
fn corrupt_scenario_is_reported_not_hidden() {
    let dir = tempfile::tempdir().unwrap();
    let bad_scenario = dir.path().join("bad.json");
    std::fs::write(&bad_scenario, "{\"devices\": [{\"nmae\": \"typo\"}]}").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["doctor", "--json", "--config"])
        .arg(repo().join("tests/fixtures/config/empty/config.toml"))
        .arg("--sysroot")
        .arg(repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy"))
        .arg("--nvml-lib")
        .arg(fake_nvml())
        .env("PHQ_FAKE_NVML_SCENARIO", &bad_scenario)
        .output()
        .unwrap();
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(findings(&r, "nvml.init")[0]["severity"], "fail");
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `nmae`"));
}

#[test]
fn bundle_from_an_nvml_run_keeps_the_nvml_view() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("b.tar.gz");
    let root = repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy");
    let cfg = repo().join("tests/fixtures/config/empty/config.toml");
    let scenario = repo().join("examples/scenarios/hgx-8gpu-nvlink-down.json");
    let first = Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["doctor", "--json", "--sysroot"])
        .arg(&root)
        .arg("--config")
        .arg(&cfg)
        .arg("--nvml-lib")
        .arg(fake_nvml())
        .arg("--bundle")
        .arg(&bundle)
        .env("PHQ_FAKE_NVML_SCENARIO", &scenario)
        .output()
        .unwrap();
    let again = Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["doctor", "--json", "--from"])
        .arg(&bundle)
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    let (a, b): (Value, Value) =
        (serde_json::from_slice(&first.stdout).unwrap(), serde_json::from_slice(&again.stdout).unwrap());
    assert_eq!(a["findings"], b["findings"]);
    assert_eq!(
        bad(&b),
        vec![row("nvlink.errors", "0000:0a:00.0", "warn"), row("nvlink.links-active", "0000:0a:00.0", "fail")]
    );
}

#[test]
fn systemd_unit_states_come_from_the_bus() {
    // A failed fabric manager (say, a version mismatch) with persistenced missing entirely.
    let Some(bus) = PrivateBus::start(&[("nvidia-fabricmanager.service", "loaded", "failed", "failed", "enabled")])
    else {
        return;
    };
    let (code, r, _) = doctor("hgx-8gpu-healthy", "hgx-8gpu-healthy", None, Some(&bus.address), &[]);
    assert_eq!(code, 2);
    let m = findings(&r, "fabric.manager-running")[0];
    assert_eq!(m["severity"], "fail");
    assert_eq!(m["summary"], "nvidia-fabricmanager is failed (failed)");
    assert_eq!(m["evidence"]["unit"]["load_state"], "loaded");
    assert!(m["remedy"].as_str().unwrap().contains("journalctl -u nvidia-fabricmanager"));
    // persistenced is not-found, but persistence mode is on: the mode is what counts.
    let p = findings(&r, "driver.persistence")[0];
    assert_eq!(p["severity"], "pass");
    assert_eq!(p["evidence"]["unit"]["load_state"], "not-found");
}

#[test]
fn fabric_manager_enabled_without_nvswitches_is_flagged() {
    let Some(bus) = PrivateBus::start(&[("nvidia-fabricmanager.service", "loaded", "failed", "failed", "enabled")])
    else {
        return;
    };
    let (_, r, _) = doctor("h100-pcie-single", "h100-pcie-vm-unsupported", None, Some(&bus.address), &[]);
    let m = findings(&r, "fabric.manager-running")[0];
    assert_eq!(m["severity"], "warn");
    assert!(m["remedy"].as_str().unwrap().contains("systemctl disable --now nvidia-fabricmanager"));
}

#[test]
fn without_a_system_bus_unit_checks_are_unknown_with_the_reason() {
    let (_, r, _) = doctor("hgx-8gpu-healthy", "hgx-8gpu-healthy", None, Some("unix:path=/nonexistent/bus"), &[]);
    let m = findings(&r, "fabric.manager-running")[0];
    assert_eq!(m["severity"], "unknown");
    let why = m["summary"].as_str().unwrap();
    assert!(why.contains("cannot ask systemd") && why.contains("no system D-Bus"), "{why}");
    assert_eq!(bad(&r), vec![]);
}

#[test]
fn a_bus_that_never_answers_does_not_hang_doctor() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("silent-bus");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    // Accept and hold connections without a word, like a wedged dbus-daemon.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming() {
            held.push(c);
        }
    });
    let address = format!("unix:path={}", socket.display());
    let (_, r, _) = doctor("hgx-8gpu-healthy", "hgx-8gpu-healthy", None, Some(&address), &[]);
    let m = findings(&r, "fabric.manager-running")[0];
    assert_eq!(m["severity"], "unknown");
    assert!(m["summary"].as_str().unwrap().contains("did not answer"), "{m}");
}

/// The service's /metrics with dcgm-exporter's names, over the fake: NVML's figures as NVML
/// defines them. Free memory leaves the driver's reservation out (the fake keeps v2's
/// total = reserved + used + free, as the real driver does), and the NVLink total sums every
/// link (`scopeId` = UINT_MAX), where a reader asking with scope 0 would get link 0 alone.
#[test]
fn dcgm_names_carry_nvmls_own_figures() {
    use std::io::{Read, Write};
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let token = "tok-dcgm-figures-0123456789abcdef";
    let cfg = service_config(dir.path(), token, "[metrics]\ndcgm_compat = true\n[probes]\nat_boot = \"none\"\n");
    let scenario = repo().join("examples/scenarios/hgx-8gpu-healthy.json");
    let mut agent = serve_command(&cfg, &scenario, &bus).spawn().unwrap();
    let port = listening_port(&mut agent).expect("the agent listens");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let metrics = loop {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut r = String::new();
        s.read_to_string(&mut r).unwrap();
        if r.starts_with("HTTP/1.1 200") {
            break r;
        }
        assert!(std::time::Instant::now() < deadline, "no /metrics within 30 s: {r}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let _ = agent.kill();
    let _ = agent.wait();
    let value = |name: &str| -> f64 {
        let line = metrics
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{gpu=\"0\"")))
            .unwrap_or_else(|| panic!("{name} for GPU 0 is not in /metrics"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let (total, reserved, used) = (85520809984u64, 947912704u64, 8388608u64);
    assert_eq!(
        value("DCGM_FI_DEV_FB_FREE"),
        ((total - reserved - used) >> 20) as f64,
        "free leaves the reservation out"
    );
    assert_eq!(value("DCGM_FI_DEV_FB_RESERVED"), (reserved >> 20) as f64);
    assert_eq!(value("DCGM_FI_DEV_FB_USED"), (used >> 20) as f64);
    // Links 0..17 carry (link + 1) MiB out and (link + 1) / 2 MiB in: 171 × 1.5 MiB, in KiB.
    assert_eq!(value("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"), (171 * (1048576 + 524288)) as f64, "all links, not link 0");
    assert_eq!(value("DCGM_FI_DEV_MEMORY_TEMP"), 35.0);
    assert_eq!(value("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"), (71000 * 3600) as f64);
    assert_eq!(value("DCGM_FI_DEV_ENC_UTIL"), 0.0);
    // nvmlDeviceGetViolationStatus's ns, under DCGM's names and unit, and the agent's seconds.
    assert_eq!(value("DCGM_FI_DEV_POWER_VIOLATION"), 2e9);
    assert_eq!(value("DCGM_FI_DEV_LOW_UTIL_VIOLATION"), 3e12);
    assert_eq!(value("DCGM_FI_DEV_THERMAL_VIOLATION"), 0.0);
    assert!(metrics.contains("# TYPE DCGM_FI_DEV_THERMAL_VIOLATION counter"), "typed as dcgm-exporter's CSV types it");
    assert!(
        metrics.lines().any(|l| l.starts_with("phq_gpu_clock_events_seconds_total{")
            && l.contains("reason=\"power\"")
            && l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) == Some(2.0)),
        "phq_gpu_clock_events_seconds_total{{reason=\"power\"}} 2"
    );
    assert_eq!(value("DCGM_FI_DEV_DEC_UTIL"), 0.0);
    assert!(metrics.contains("# TYPE DCGM_FI_DEV_PCIE_REPLAY_COUNTER counter"), "classic text, as dcgm-exporter");
    // Profiling from NVML's GPM, converted as DCGM converts it: a percentage ÷ 100 is the
    // activity ratio, MiB/s × 1,048,576 is bytes/s (the scenario's GPU 0: graphics 12.5 %,
    // tensor 5 %, DRAM 7.5 %, PCIe 12 MiB/s out and 48 in, NVLink 200 out and 100 in).
    assert_eq!(value("DCGM_FI_PROF_GR_ENGINE_ACTIVE"), 0.125);
    assert_eq!(value("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"), 0.05);
    assert_eq!(value("DCGM_FI_PROF_DRAM_ACTIVE"), 0.075);
    assert_eq!(value("DCGM_FI_PROF_PCIE_TX_BYTES"), 12.0 * 1_048_576.0);
    assert_eq!(value("DCGM_FI_PROF_PCIE_RX_BYTES"), 48.0 * 1_048_576.0);
    assert_eq!(value("DCGM_FI_PROF_NVLINK_TX_BYTES"), 200.0 * 1_048_576.0);
    assert_eq!(value("DCGM_FI_PROF_SM_OCCUPANCY"), 0.08);
    // GPU 7 reported its FP16 pipe as NaN: left out, never served as 0; its other fields stay.
    let gpu7 = |name: &str| metrics.lines().any(|l| l.starts_with(&format!("{name}{{gpu=\"7\"")));
    assert!(!gpu7("DCGM_FI_PROF_PIPE_FP16_ACTIVE"), "a NaN is left out");
    assert!(gpu7("DCGM_FI_PROF_PIPE_FP32_ACTIVE"));
    // The agent's own names, and GPM's presence said per GPU.
    assert!(
        metrics.lines().any(|l| l.starts_with("phq_gpu_gpm_activity_ratio{") && l.contains("metric=\"tensor\"")),
        "{metrics}"
    );
    assert!(metrics.lines().any(|l| l.starts_with("phq_gpu_gpm_supported{") && l.ends_with(" 1.0")), "{metrics}");
}
