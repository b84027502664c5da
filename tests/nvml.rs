//! Black box: the real, unchanged `phq-agent` binary loads the fake libnvidia-ml
//! (crates/fake-nvml) through `--nvml-lib`, which answers from the scenarios in
//! examples/scenarios. Each test asserts what a GPU engineer would look for.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The fake library, built once per test binary (cargo does not build a workspace member's
/// cdylib for another package's tests).
fn fake_nvml() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        if let Ok(p) = std::env::var("PHQ_FAKE_NVML_LIB") {
            return PathBuf::from(p);
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--quiet", "-p", "fake-nvml"])
            .current_dir(repo())
            .status()
            .expect("run cargo build -p fake-nvml");
        assert!(status.success(), "cargo build -p fake-nvml failed");
        let target = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| repo().join("target"));
        target.join("debug/libfake_nvml.so")
    })
}

fn run(sysroot: &str, scenario: &str, lib: Option<&Path>) -> (i32, Value, String) {
    let root = repo().join("tests/fixtures/sysroots").join(sysroot);
    let cfg = repo().join("tests/fixtures/config/empty/config.toml");
    let lib = lib.unwrap_or_else(|| fake_nvml());
    let out: Output = Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["doctor", "--json", "--sysroot"])
        .arg(&root)
        .arg("--config")
        .arg(&cfg)
        .arg("--nvml-lib")
        .arg(lib)
        .env("PHQ_FAKE_NVML_SCENARIO", repo().join("examples/scenarios").join(format!("{scenario}.json")))
        .output()
        .expect("run phq-agent");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{scenario}: {stderr}");
    let report: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{scenario}: not JSON ({e}): {stderr}"));
    validate(&report);
    (out.status.code().unwrap_or(-1), report, stderr)
}

fn validate(report: &Value) {
    let schema: Value = serde_json::from_str(include_str!("../schema/phq.status.v1.json")).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> =
        validator.iter_errors(report).map(|e| format!("{} at {}", e, e.instance_path())).collect();
    assert!(errors.is_empty(), "{errors:#?}");
}

fn findings<'a>(r: &'a Value, id: &str) -> Vec<&'a Value> {
    r["findings"].as_array().unwrap().iter().filter(|f| f["id"] == id).collect()
}

/// (id, gpu, severity) of every warning and failure, sorted.
fn bad(r: &Value) -> Vec<(String, String, String)> {
    let mut v: Vec<_> = r["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == "fail" || f["severity"] == "warn")
        .map(|f| {
            (
                f["id"].as_str().unwrap().to_string(),
                f["gpu"].as_str().unwrap_or("").to_string(),
                f["severity"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    v.sort();
    v
}

fn row(id: &str, gpu: &str, sev: &str) -> (String, String, String) {
    (id.into(), gpu.into(), sev.into())
}

#[test]
fn healthy_hgx_has_zero_false_alarms() {
    let (code, r, _) = run("hgx-8gpu-healthy", "hgx-8gpu-healthy", None);
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
    let (code, r, _) = run("hgx-8gpu-healthy", "hgx-8gpu-fabric-not-started", None);
    assert_eq!(code, 2);
    let m = findings(&r, "fabric.manager-running")[0];
    assert_eq!(m["severity"], "fail");
    assert!(m["detail"].as_str().unwrap().contains("error 802"), "{m}");
    assert!(m["remedy"].as_str().unwrap().contains("systemctl enable --now nvidia-fabricmanager"));
    let states = findings(&r, "fabric.state");
    assert_eq!(states.len(), 8);
    assert!(states.iter().all(|f| f["severity"] == "fail" && f["summary"].as_str().unwrap().contains("802")));
    // The links are down because the fabric is: reported as such, per GPU.
    assert!(findings(&r, "nvlink.links-active").iter().all(|f| f["severity"] == "fail"));
}

#[test]
fn xid_79_names_the_gpu_that_fell_off() {
    let (code, r, _) = run("hgx-8gpu-healthy", "hgx-8gpu-xid79", None);
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
    let (code, r, _) = run("hgx-8gpu-healthy", "hgx-8gpu-ecc-dbe-remap-pending", None);
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
    let (code, r, _) = run("hgx-8gpu-healthy", "hgx-8gpu-pcie-degraded-thermal", None);
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
    let (code, r, _) = run("hgx-8gpu-healthy", "hgx-8gpu-nvlink-down", None);
    assert_eq!(code, 2);
    let g = "0000:0a:00.0";
    assert_eq!(bad(&r), vec![row("nvlink.errors", g, "warn"), row("nvlink.links-active", g, "fail")]);
    let f = findings(&r, "nvlink.links-active").into_iter().find(|f| f["gpu"] == g).unwrap();
    assert_eq!(f["summary"], "2 of 18 NVLinks inactive (links 4, 11)");
}

#[test]
fn sparse_vm_gives_honest_unknowns_and_no_failure() {
    let (code, r, _) = run("h100-pcie-single", "h100-pcie-vm-unsupported", None);
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
        let (code, r, _) = run("hgx-8gpu-healthy", scenario, None);
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
    let (code, r, _) = run("hgx-8gpu-healthy", "hgx-8gpu-healthy", Some(Path::new("/nonexistent/libnvidia-ml.so.1")));
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
