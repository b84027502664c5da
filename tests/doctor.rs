//! End to end: the real binary over fixture sysroots, as a person or a script would run it.
//! Each test asserts what a GPU engineer would check in the output: which check, which GPU,
//! which severity, what remedy, and the exit code.

mod common;

use common::{bad, findings, validate};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn config(name: &str) -> PathBuf {
    fixture("config").join(name).join("config.toml")
}

/// Whether the machine running the tests has an NVIDIA PCI function (vendor 0x10de, class 03).
fn machine_has_nvidia_gpu() -> bool {
    std::fs::read_dir("/sys/bus/pci/devices").into_iter().flatten().flatten().any(|d| {
        let read = |f: &str| std::fs::read_to_string(d.path().join(f)).unwrap_or_default();
        read("vendor").trim() == "0x10de" && read("class").trim().starts_with("0x03")
    })
}

/// Whether libcuda loads here under the names the agent's CUDA loader tries first.
fn libcuda_loads() -> bool {
    ["libcuda.so", "libcuda.so.1"].iter().any(|name| {
        let c = std::ffi::CString::new(*name).unwrap();
        // SAFETY: dlopen with a valid C string; the handle is closed at once.
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            if !h.is_null() {
                libc::dlclose(h);
            }
            !h.is_null()
        }
    })
}

fn phq(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("PHQ_NVML_LIB")
        .output()
        .expect("run phq-agent")
}

/// `doctor --json` over a fixture sysroot: (exit code, report).
fn doctor(sysroot: &str, cfg: &str) -> (i32, Value) {
    let root = fixture("sysroots").join(sysroot);
    let out =
        phq(&["doctor", "--json", "--sysroot", root.to_str().unwrap(), "--config", config(cfg).to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{sysroot}: {stderr}");
    let report: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{sysroot}: not JSON ({e}): {stderr}"));
    validate(&report);
    (out.status.code().unwrap(), report)
}

fn severity_of(r: &Value, id: &str, gpu: Option<&str>) -> String {
    let f = findings(r, id);
    let f = f.iter().find(|f| gpu.is_none_or(|g| f["gpu"] == g)).unwrap_or_else(|| panic!("no {id} for {gpu:?}"));
    f["severity"].as_str().unwrap().to_string()
}

#[test]
fn healthy_hgx_guest_has_no_false_alarm() {
    let (code, r) = doctor("hgx-8gpu-healthy", "expect-8");
    assert_eq!(bad(&r), vec![], "a healthy guest must raise nothing");
    // Only the checks that need NVML/CUDA are left open, so the plugin code is 3 (unknown).
    assert_eq!(code, 3);
    assert_eq!(r["health"], "unknown");
    assert_eq!(r["gpus"].as_array().unwrap().len(), 8);
    assert_eq!(r["host"]["nvswitches"], 4);
    assert_eq!(r["host"]["virtualization"], "kubevirt");
    assert_eq!(r["agent"]["agent_id"], "5d307ca9-b3ef-428c-8861-06e72d69f223");
    assert_eq!(r["driver"]["version"], "580.82.07");
    assert_eq!(r["driver"]["open_kernel_module"], true);
    assert_eq!(r["driver"]["cuda_toolkits"], serde_json::json!(["12.4.1"]));
    assert_eq!(severity_of(&r, "pci.gpu-count", None), "pass");
    for g in r["gpus"].as_array().unwrap() {
        assert_eq!(g["model"], "H100 SXM5 80GB");
        assert_eq!(g["bar1_bytes"], 137438953472u64);
        assert_eq!(g["driver"], "nvidia");
    }
    for f in r["findings"].as_array().unwrap().iter().filter(|f| f["severity"] == "unknown") {
        let why = f["summary"].as_str().unwrap();
        assert!(why.contains("NVML") || why.contains("CUDA"), "unexpected unknown: {f}");
    }
}

#[test]
fn missing_gpu_against_expected_count_fails() {
    let (code, r) = doctor("h100-pcie-vfio-bound", "expect-8");
    assert_eq!(code, 2);
    let f = findings(&r, "pci.gpu-count")[0];
    assert_eq!(f["severity"], "fail");
    assert_eq!(f["summary"], "1 GPU(s) visible, 8 expected");
}

#[test]
fn nouveau_bound_fails_every_gpu_and_says_how_to_blacklist() {
    let (code, r) = doctor("hgx-8gpu-nouveau", "empty");
    assert_eq!(code, 2);
    let bound = findings(&r, "pci.gpu-driver-bound");
    assert_eq!(bound.len(), 8);
    for f in &bound {
        assert_eq!(f["severity"], "fail");
        assert_eq!(f["evidence"]["driver"], "nouveau");
        assert!(f["remedy"].as_str().unwrap().contains("blacklist nouveau"));
    }
    assert_eq!(severity_of(&r, "driver.nouveau-disabled", None), "fail");
    assert_eq!(severity_of(&r, "driver.module-loaded", None), "fail");
    assert_eq!(r["driver"]["loaded"], false);
}

#[test]
fn vfio_pci_in_the_guest_is_named_with_its_cause() {
    let (code, r) = doctor("h100-pcie-vfio-bound", "empty");
    assert_eq!(code, 2);
    assert_eq!(bad(&r), vec![("pci.gpu-driver-bound".into(), "0000:09:00.0".into(), "fail".into())]);
    let f = findings(&r, "pci.gpu-driver-bound")[0];
    assert!(f["detail"].as_str().unwrap().contains("vfio-pci.ids="), "{f}");
    assert!(f["remedy"].as_str().unwrap().contains("/sys/bus/pci/drivers/vfio-pci/unbind"));
    assert_eq!(r["gpus"][0]["model"], "H100 PCIe");
    assert_eq!(r["host"]["os_id"], "debian");
}

#[test]
fn bar1_unassigned_names_the_one_gpu_and_the_mmio_fix() {
    let (code, r) = doctor("hgx-8gpu-bar1-unassigned", "empty");
    assert_eq!(code, 2);
    let mut expected = vec![
        ("pci.gpu-driver-bound".to_string(), "0000:0a:00.0".to_string(), "fail".to_string()),
        ("pci.bar1-assigned".to_string(), "0000:0a:00.0".to_string(), "fail".to_string()),
    ];
    expected.sort();
    let mut got = bad(&r);
    got.sort();
    assert_eq!(got, expected);
    let f = findings(&r, "pci.bar1-assigned").into_iter().find(|f| f["gpu"] == "0000:0a:00.0").unwrap();
    let remedy = f["remedy"].as_str().unwrap();
    assert!(remedy.contains("host-passthrough") && remedy.contains("X-PciMmio64Mb"), "{remedy}");
    assert_eq!(f["evidence"]["kernel_log"][0], "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0a:00.0)");
    let gpu = r["gpus"].as_array().unwrap().iter().find(|g| g["pci_address"] == "0000:0a:00.0").unwrap();
    assert_eq!(gpu["status"], "fail");
    assert_eq!(gpu["bar1_bytes"], 0);
}

#[test]
fn half_installed_driver_points_at_the_build() {
    let (code, r) = doctor("hgx-8gpu-half-installed", "empty");
    assert_eq!(code, 2);
    let f = findings(&r, "driver.module-loaded")[0];
    assert_eq!(f["severity"], "fail");
    assert!(f["detail"].as_str().unwrap().contains("libnvidia-ml.so 580.82.07"));
    assert_eq!(severity_of(&r, "host.kernel-headers", None), "warn");
    assert!(findings(&r, "host.kernel-headers")[0]["remedy"]
        .as_str()
        .unwrap()
        .contains("linux-headers-5.15.0-113-generic"));
}

#[test]
fn xid_79_fails_only_the_gpu_that_fell_off() {
    let (code, r) = doctor("hgx-8gpu-xid79", "empty");
    assert_eq!(code, 2);
    assert_eq!(
        bad(&r),
        vec![
            ("gpu.xid".into(), "0000:0c:00.0".into(), "fail".into()),
            ("gpu.xid".into(), "0000:0d:00.0".into(), "warn".into())
        ]
    );
    // Xid 13 on another GPU is the application's: a warning naming it, the GPU not failed.
    let f = findings(&r, "gpu.xid").into_iter().find(|f| f["gpu"] == "0000:0d:00.0").unwrap();
    assert_eq!(f["summary"], "Xid 13 (Graphics Engine Exception) ×1");
    assert!(f["remedy"].as_str().unwrap().starts_with("Restart python3 (pid 48211)."), "{f:#}");
    let gpu = r["gpus"].as_array().unwrap().iter().find(|g| g["pci_address"] == "0000:0c:00.0").unwrap();
    assert_eq!(gpu["uuid"], "GPU-7e1f0b2c-55c4-c1a4-9b33-2f1d0e4c8a71");
    assert_eq!(gpu["xids"][0]["code"], "79");
    assert_eq!(gpu["xids"][0]["count"], 1);
}

/// Lines any unprivileged user can put into the kernel log (issue 37): a crashing program whose
/// file is named like an Xid (the kernel logs its 15-character `comm` first, its file's name
/// after ` in `), and records a process writes to /dev/kmsg (facility LOG_USER) in the exact
/// shape of a fatal Xid and SXid. doctor answers as for the healthy guest; the same lines with
/// the kernel's facility are the driver's and fail the GPU and the NVSwitch.
#[test]
fn forged_kernel_log_lines_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let root = common::copy_sysroot("hgx-8gpu-healthy", dir.path());
    let kmsg = root.join("dev/kmsg");
    let healthy = std::fs::read_to_string(&kmsg).unwrap();
    let xid79 = "NVRM: Xid (PCI:0000:0c:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.";
    let sxid = "nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30 LTSSM Fault Up";
    let forged = format!(
        "6,9001,9000000000,-;NVRM: Xid (PCI:[4242]: segfault at 0 ip 0000000000401000 sp 00007ffd00000000 error 4 in {xid79}[401000+1000]\n\
         6,9002,9000000001,-;nvidia-nvswit[4243]: segfault at 0 ip 0 sp 0 error 4 in {sxid}[1+1]\n\
         12,9003,9000000002,-;{xid79}\n\
         14,9004,9000000003,-;{sxid}\n"
    );
    std::fs::write(&kmsg, format!("{healthy}{forged}")).unwrap();
    let run = |root: &Path| {
        let out = phq(&[
            "doctor",
            "--json",
            "--sysroot",
            root.to_str().unwrap(),
            "--config",
            config("expect-8").to_str().unwrap(),
        ]);
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        validate(&report);
        (out.status.code().unwrap(), report)
    };
    let (code, r) = run(&root);
    assert_eq!(bad(&r), vec![], "forged lines raised a finding");
    assert_eq!(code, 3, "as the healthy guest");
    assert!(r["gpus"].as_array().unwrap().iter().all(|g| g["xids"].as_array().is_none_or(|x| x.is_empty())), "{r:#}");

    // The same lines as the kernel writes them (facility 0) are the driver's.
    std::fs::write(&kmsg, format!("{healthy}4,9003,9000000002,-;{xid79}\n3,9004,9000000003,-;{sxid}\n")).unwrap();
    let (code, r) = run(&root);
    assert_eq!(code, 2);
    assert_eq!(severity_of(&r, "gpu.xid", Some("0000:0c:00.0")), "fail");
    let sw = findings(&r, "fabric.sxid").into_iter().find(|f| f["gpu"] == "0000:11:00.0").unwrap().clone();
    assert_eq!(sw["severity"], "fail");
}

/// The guide's two kinds of SXid, in a guest's kernel log: the fatal one fails its NVSwitch and
/// the NVLink fabric of every GPU behind it, the non-fatal one warns its NVSwitch only; the
/// driver's lines of detail after each report are not counted as reports.
#[test]
fn nvswitch_sxids_fail_and_warn_the_right_switch() {
    let (code, r) = doctor("hgx-8gpu-sxid", "empty");
    assert_eq!(code, 2);
    let sxid = |dev: &str| findings(&r, "fabric.sxid").into_iter().find(|f| f["gpu"] == dev).unwrap().clone();
    let fatal = sxid("0000:11:00.0");
    assert_eq!(
        (fatal["severity"].as_str(), fatal["summary"].as_str()),
        (Some("fail"), Some("SXid 20034 (LTSSM Fault Up) fatal ×1"))
    );
    assert!(fatal["remedy"].as_str().unwrap().starts_with("Restart the VM"), "{fatal:#}");
    let non_fatal = sxid("0000:14:00.0");
    assert_eq!(
        (non_fatal["severity"].as_str(), non_fatal["summary"].as_str()),
        (Some("warn"), Some("SXid 12028 (egress non-posted PRIV error) non-fatal ×1"))
    );
    for quiet in ["0000:12:00.0", "0000:13:00.0"] {
        assert_eq!(sxid(quiet)["severity"], "pass", "{quiet}");
    }
    // Every GPU's fabric is down (NVML is not read here, so all of the VM's GPUs are behind it).
    let gpus: Vec<&Value> =
        findings(&r, "fabric.sxid").into_iter().filter(|f| f["gpu"].as_str().is_some_and(|g| g < "0000:11")).collect();
    assert_eq!(gpus.len(), 8);
    assert!(gpus.iter().all(|f| f["severity"] == "fail"));
    // The GPU that saw the fatal SXid as Xid 74 says where it came from.
    let x74 = findings(&r, "gpu.xid").into_iter().find(|f| f["gpu"] == "0000:0a:00.0").unwrap();
    assert_eq!(x74["severity"], "fail");
    assert!(x74["detail"].as_str().unwrap().contains("see fabric.sxid"), "{x74:#}");
}

/// Codes the agent's old hand-made table did not know get NVIDIA's catalog action, and the
/// application's Xid 13 names its process.
#[test]
fn xids_are_judged_by_nvidias_catalog() {
    let (code, r) = doctor("hgx-8gpu-xid-catalog", "empty");
    assert_eq!(code, 2);
    let xid = |gpu: &str| findings(&r, "gpu.xid").into_iter().find(|f| f["gpu"] == gpu).unwrap().clone();
    for (gpu, summary, remedy) in [
        ("0000:09:00.0", "Xid 46 (GPU stopped processing) ×1", "nvidia-smi -r -i 0000:09:00.0"),
        ("0000:0a:00.0", "Xid 110 (Security Fault Error) ×1", "nvidia-smi -r -i 0000:0a:00.0"),
        ("0000:0b:00.0", "Xid 151 (Key rotation Error) ×1", "Restart the VM that owns the GPU"),
        ("0000:0c:00.0", "Xid 156 (Resource Retirement Event) ×1", "nvidia-smi -r -i 0000:0c:00.0"),
        ("0000:0d:00.0", "Xid 158 (GPU Fatal Timeout) ×1", "nvidia-smi -r -i 0000:0d:00.0"),
    ] {
        let f = xid(gpu);
        assert_eq!((f["severity"].as_str(), f["summary"].as_str()), (Some("fail"), Some(summary)), "{gpu}");
        assert!(f["remedy"].as_str().unwrap().contains(remedy), "{gpu}: {f:#}");
    }
    let app = xid("0000:0e:00.0");
    assert_eq!(app["severity"], "warn");
    assert!(app["remedy"].as_str().unwrap().starts_with("Restart python3 (pid 48211)."));
    assert_eq!(r["gpus"][5]["xids"][0]["resolution"], "RESTART_APP");
}

#[test]
fn no_gpu_fails_presence_and_exits_2() {
    let (code, r) = doctor("no-gpu", "empty");
    assert_eq!(code, 2);
    assert_eq!(r["health"], "unhealthy");
    assert_eq!(bad(&r), vec![("pci.gpu-present".into(), "".into(), "fail".into())]);
    let f = &findings(&r, "pci.gpu-present")[0];
    assert!(f["remedy"].as_str().unwrap().contains("spec.domain.devices.gpus"));
    // Issue 51: with no expected count the guest cannot tell the spec from the allocation, and
    // says so instead of paging the platform to restart the VM.
    assert!(f["summary"].as_str().unwrap().contains("cannot be told from inside the guest"), "{f:#}");
    assert_eq!((f["action"].as_str(), f["owner"].as_str()), (Some("contact_support"), Some("platform")));
}

#[test]
fn garbage_tree_still_gives_a_report() {
    let (code, r) = doctor("garbage", "empty");
    assert_eq!(code, 2);
    // The absurd Xid numbers are kept and flagged, not dropped or wrapped.
    let xids = &r["gpus"][0]["xids"];
    let codes: Vec<&str> = xids.as_array().unwrap().iter().map(|x| x["code"].as_str().unwrap()).collect();
    assert!(codes.contains(&"99999999999999999999999999"), "{codes:?}");
    assert!(codes.contains(&"4294967296"), "{codes:?}");
    // Unreadable things are unknown with a reason, never silently passed.
    assert_eq!(severity_of(&r, "host.secure-boot", None), "unknown");
    // Every catalogue id that doctor runs is present.
    for id in phq_agent::checks::CATALOG.iter().filter(|id| !phq_agent::checks::is_mode_specific(id)) {
        assert!(!findings(&r, id).is_empty(), "{id} missing from a garbage report");
    }
}

#[test]
fn live_machine_without_gpu_reports_gpu_present_fail() {
    // This runs on the build machine itself (sysroot /). CI machines have no NVIDIA GPU; on a
    // machine that has one this test cannot say what it is for, and says so.
    if machine_has_nvidia_gpu() {
        common::skip("this machine has an NVIDIA GPU; the test is for one without");
        return;
    }
    let out = phq(&["doctor", "--json", "--config", config("empty").to_str().unwrap()]);
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    validate(&r);
    assert_eq!(r["gpus"], Value::Array(vec![]));
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(severity_of(&r, "pci.gpu-present", None), "fail");
}

#[test]
fn bundle_round_trips_to_the_same_findings() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("support.tar.gz");
    let root = fixture("sysroots/hgx-8gpu-bar1-unassigned");
    let cfg = config("empty");
    let bundle_to = |out: &Path| {
        phq(&[
            "doctor",
            "--json",
            "--sysroot",
            root.to_str().unwrap(),
            "--config",
            cfg.to_str().unwrap(),
            "--bundle",
            out.to_str().unwrap(),
        ])
    };
    let first = bundle_to(&bundle);
    assert_eq!(first.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&first.stderr).contains("bundle written to"));
    // It holds the kernel log: the owner's alone.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&bundle).unwrap().permissions().mode() & 0o777, 0o600);
    // Never over an existing file, nor through a link planted at the name.
    let again_to_same = bundle_to(&bundle);
    assert_eq!(again_to_same.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&again_to_same.stderr).contains("already exists"));
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "precious").unwrap();
    let planted = dir.path().join("planted.tar.gz");
    std::os::unix::fs::symlink(&victim, &planted).unwrap();
    let through_link = bundle_to(&planted);
    assert_eq!(through_link.status.code(), Some(3));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    let again = phq(&["doctor", "--json", "--from", bundle.to_str().unwrap(), "--config", cfg.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(2), "{}", String::from_utf8_lossy(&again.stderr));
    let (a, b): (Value, Value) =
        (serde_json::from_slice(&first.stdout).unwrap(), serde_json::from_slice(&again.stdout).unwrap());
    assert_eq!(a["findings"], b["findings"]);
    assert_eq!(a["gpus"], b["gpus"]);
    assert_eq!(a["observed_at"], b["observed_at"], "the bundle keeps the time it was taken");

    // The bundle holds the raw files and the NVIDIA kernel log lines.
    let listing = Command::new("tar").arg("tzf").arg(&bundle).output().unwrap();
    let names = String::from_utf8_lossy(&listing.stdout);
    for want in [
        "manifest.json",
        "snapshot.json",
        "report.json",
        "report.html",
        "nvrm.log",
        "files/etc/os-release",
        "files/sys/bus/pci/devices/0000:0a:00.0/resource",
        "files/sys/bus/pci/devices/0000:09:00.0/driver",
        "files/dev/kmsg",
    ] {
        assert!(names.lines().any(|l| l == want), "{want} missing from bundle: {names}");
    }
    let nvrm = Command::new("tar").arg("xzOf").arg(&bundle).arg("nvrm.log").output().unwrap();
    assert!(String::from_utf8_lossy(&nvrm.stdout).contains("NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0a:00.0)"));
}

/// A hostile bundle: a GNU long-name entry that says it is 256 MiB long (zeros, a few hundred
/// KiB compressed) before snapshot.json. The tar crate would read it whole into memory; the
/// reader refuses it past 1 MiB, at once.
#[test]
fn a_bundle_with_a_huge_tar_header_extension_is_refused_in_bounded_memory() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hostile.tar.gz");
    let gz = flate2::write::GzEncoder::new(std::fs::File::create(&path).unwrap(), flate2::Compression::fast());
    let mut tar = tar::Builder::new(gz);
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::GNULongName);
    const LONG: u64 = 256 << 20;
    h.set_size(LONG);
    h.set_cksum();
    let zeros = std::io::Read::take(std::io::repeat(0), LONG);
    tar.append_data(&mut h, "././@LongLink", zeros).unwrap();
    let mut h = tar::Header::new_gnu();
    h.set_size(2);
    h.set_cksum();
    tar.append_data(&mut h, "snapshot.json", &b"{}"[..]).unwrap();
    tar.into_inner().unwrap().finish().unwrap().flush().unwrap();

    // Reaped by wait4 below, which also gives this child's own resource usage.
    #[allow(clippy::zombie_processes)]
    let mut child = Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["doctor", "--from", path.to_str().unwrap(), "--config", config("empty").to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    let pid = child.id() as libc::pid_t;
    // This child's own peak resident set (wait4), not every child of the test process: other
    // tests running beside this one start children too (`cargo build` of the fake NVML).
    let (mut status, mut usage): (libc::c_int, libc::rusage) = (0, unsafe { std::mem::zeroed() });
    // SAFETY: waits for our own child; both out pointers are locals we own.
    assert_eq!(unsafe { libc::wait4(pid, &mut status, 0, &mut usage) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 3, "{status}: {err}");
    assert!(err.contains("hostile.tar.gz") && err.contains("tar header extension"), "{err}");
    assert!(usage.ru_maxrss < 128 * 1024, "doctor reached {} KiB", usage.ru_maxrss);
}

#[test]
fn bad_bundle_and_bad_config_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.tar.gz");
    std::fs::write(&junk, b"not a bundle").unwrap();
    let out = phq(&["doctor", "--from", junk.to_str().unwrap(), "--config", config("empty").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("junk.tar.gz"), "{err}");

    let out = phq(&["doctor", "--config", config("bad-key").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("config.d/50-probes.toml") && err.contains("probes.when_idl") && err.contains("when_idle"),
        "{err}"
    );

    let out = phq(&["doctor", "--config", dir.path().join("absent.toml").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("absent.toml"));
}

#[test]
fn usage_errors_exit_64() {
    assert_eq!(phq(&["doctor", "--no-such-flag"]).status.code(), Some(64));
    assert_eq!(phq(&["frobnicate"]).status.code(), Some(64));
    assert_eq!(phq(&["doctor", "--probe", "ludicrous"]).status.code(), Some(64));
    assert_eq!(phq(&["--help"]).status.code(), Some(0));
    // Never the real installer here: a bad branch and a foreign sysroot stop it before it plans.
    let out = phq(&["install", "--driver-branch", "five-fifty"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a number such as 550"));
    let root = fixture("sysroots/hgx-8gpu-nouveau");
    let out = phq(&["install", "--sysroot", root.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("only --dry-run can plan for it"));
}

/// A mirror URL with a line or an option of its own is refused from the command line as from
/// the config (a unit test there): before anything is planned, naming the flag, exit 64.
#[test]
fn install_refuses_a_repo_url_that_would_add_a_line_or_an_option() {
    let root = fixture("sysroots/hgx-8gpu-nouveau");
    let cfg = config("empty");
    let base = ["install", "--dry-run", "--sysroot", root.to_str().unwrap(), "--config", cfg.to_str().unwrap()];
    for (url, why) in [
        ("https://mirror.example/cuda/repos\ndeb [trusted=yes] http://evil.example/ ./", "'\\n'"),
        ("https://mirror.example/cuda/repos [trusted=yes]", "' '"),
        ("https://mirror.example/[evil]", "'['"),
        ("http://mirror.example/cuda/repos", "plain http"),
    ] {
        let out = phq(&[&base[..], &["--repo-url", url]].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{url:?}: {stderr}");
        assert!(stderr.contains("--repo-url") && stderr.contains(why), "{url:?}: {stderr}");
        assert!(out.stdout.is_empty(), "nothing planned for {url:?}");
    }
    let out = phq(&[&base[..], &["--repo-url", "https://mirror.example/cuda/repos"]].concat());
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("https://mirror.example/cuda/repos/ubuntu2204/x86_64/"));
}

#[test]
fn install_dry_run_prints_the_plan_for_fixture_guests() {
    let cfg = config("empty");
    for (name, must) in [
        (
            "hgx-8gpu-nouveau",
            &[
                "Ubuntu 22.04",
                "4 NVSwitches",
                "install libnvidia-compute-580 nvidia-dkms-580-open nvidia-utils-580 nvidia-compute-utils-580",
                "nvidia-fabricmanager=<driver version>",
                "(needs a reboot",
            ][..],
        ),
        (
            "rocky9-h100-pcie-fresh",
            &[
                "Rocky Linux 9",
                "dnf -y -q module enable nvidia-driver:580-open",
                "dnf -y -q install nvidia-driver-cuda kmod-nvidia-open-dkms",
                "dracut --force",
                "config-manager --set-enabled crb",
            ][..],
        ),
        (
            "debian12-hgx-fresh",
            &[
                "Debian 12",
                "install nvidia-driver-pinning-580",
                "write /etc/apt/sources.list.d/phq-debian-components.sources",
                "| URIs: http://debian.mirror.example/debian-security",
                "install nvidia-driver-cuda nvidia-kernel-open-dkms nvidia-persistenced",
                "apt-mark hold",
            ][..],
        ),
        (
            "hgx-8gpu-healthy",
            &["✓ already done: nvidia-driver-580-server-open 580.82.07 is installed", "✓ not needed"][..],
        ),
    ] {
        let root = fixture(&format!("sysroots/{name}"));
        let out =
            phq(&["install", "--dry-run", "--sysroot", root.to_str().unwrap(), "--config", cfg.to_str().unwrap()]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        for m in must {
            assert!(text.contains(m), "{name}: no {m:?} in\n{text}");
        }
    }
    let root = fixture("sysroots/garbage");
    let out = phq(&["install", "--dry-run", "--sysroot", root.to_str().unwrap(), "--config", cfg.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("phq-agent install:"));
}

#[test]
fn table_for_people_respects_no_color_and_names_the_problem() {
    let root = fixture("sysroots/hgx-8gpu-nouveau");
    let cfg = config("empty");
    let args = ["doctor", "--sysroot", root.to_str().unwrap(), "--config", cfg.to_str().unwrap()];
    let plain = phq(&args);
    let text = String::from_utf8_lossy(&plain.stdout);
    assert!(!text.contains('\x1b'), "NO_COLOR output has escapes");
    assert!(text.contains("FAIL     pci.gpu-driver-bound"), "{text}");
    assert!(text.contains("bound to nouveau"));
    assert!(text.contains("→ Blacklist nouveau"));
    assert!(text.lines().last().unwrap().starts_with("unhealthy:"));
    let forced = Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(args)
        .env_remove("NO_COLOR")
        .env("CLICOLOR_FORCE", "1")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&forced.stdout).contains("\x1b["), "CLICOLOR_FORCE gives colour");
}

#[test]
fn probe_flag_on_a_fixture_reports_probes_as_unknown() {
    let root = fixture("sysroots/hgx-8gpu-healthy");
    let out = phq(&[
        "doctor",
        "--json",
        "--probe",
        "quick",
        "--sysroot",
        root.to_str().unwrap(),
        "--config",
        config("empty").to_str().unwrap(),
    ]);
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(severity_of(&r, "probe.h2d-bandwidth", None), "unknown");
    assert_eq!(out.status.code(), Some(3));
}

#[test]
fn probe_without_a_gpu_exits_3_naming_libcuda_and_never_panics() {
    // The build and CI machines have no NVIDIA driver; where libcuda loads, this test cannot
    // say what it is for, and says so. Decided by the test's own dlopen, not by the output.
    if libcuda_loads() {
        common::skip("libcuda loads on this machine; the test is for one without the driver");
        return;
    }
    let out = phq(&["probe", "--json", "--config", config("empty").to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    validate(&r);
    let f = findings(&r, "probe.h2d-bandwidth");
    assert_eq!(f[0]["severity"], "unknown");
    assert!(f[0]["summary"].as_str().unwrap().contains("libcuda.so was not found"), "{}", f[0]);
    assert_eq!(r["probes"], Value::Null);
}

#[test]
fn the_binary_links_no_gpu_library() {
    // NVML and CUDA are loaded at run time so the agent starts on a machine without a driver.
    let out = Command::new("ldd").arg(env!("CARGO_BIN_EXE_phq-agent")).output().expect("ldd");
    let libs = String::from_utf8_lossy(&out.stdout);
    for gpu_lib in ["libcuda", "libnvidia-ml", "libcublas", "libcudart"] {
        assert!(!libs.contains(gpu_lib), "{gpu_lib} is linked:\n{libs}");
    }
    assert!(libs.contains("libc.so"), "ldd gave no library list: {libs}");
}

/// A fixture is a machine: one of Debian or Rocky carries no Ubuntu package, kernel or compiler
/// (an Ubuntu name in a Debian fixture would let a check pass for the wrong reason).
#[test]
fn non_ubuntu_fixtures_carry_no_ubuntu_names() {
    let root = common::repo().join("tests/fixtures/sysroots");
    for entry in std::fs::read_dir(&root).unwrap().flatten() {
        let os = std::fs::read_to_string(entry.path().join("etc/os-release")).unwrap_or_default();
        if os.is_empty() || os.contains("ID=ubuntu") {
            continue;
        }
        let mut stack = vec![entry.path()];
        while let Some(dir) = stack.pop() {
            for f in std::fs::read_dir(&dir).unwrap().flatten() {
                let meta = std::fs::symlink_metadata(f.path()).unwrap();
                if meta.is_dir() {
                    stack.push(f.path());
                } else if meta.is_file() {
                    let text = String::from_utf8_lossy(&std::fs::read(f.path()).unwrap()).to_lowercase();
                    assert!(!text.contains("ubuntu"), "{} names Ubuntu", f.path().display());
                }
            }
        }
    }
}

/// An EL9 guest's packages come from its RPM database, read by the real `rpm` (SQLite, as
/// RHEL 9 keeps it at /var/lib/rpm): with the driver and its user space recorded there, the
/// install plan counts the driver as installed. Without reading the database the plan could
/// only say the installed packages are unknown and run every step. The stand-in packages are
/// built with rpmbuild under NVIDIA's names and recorded with `rpm --justdb`.
#[test]
fn an_rpm_guests_packages_are_read_from_its_rpm_database() {
    if !common::needs(&[("rpm", "rpm"), ("rpmbuild", "rpm")]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let copy =
        Command::new("cp").arg("-a").arg(fixture("sysroots/rocky9-h100-pcie-fresh")).arg(&root).status().unwrap();
    assert!(copy.success());
    let top = dir.path().join("rpmbuild");
    let rpm_at = |args: &[&str]| {
        let out = Command::new("rpm")
            .args(["--root", root.to_str().unwrap(), "--dbpath", "/var/lib/rpm"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "rpm {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    rpm_at(&["--initdb"]);
    for name in ["kmod-nvidia-open-dkms", "nvidia-driver-cuda"] {
        let spec = dir.path().join(format!("{name}.spec"));
        std::fs::write(
            &spec,
            format!("Name: {name}\nVersion: 580.82.07\nRelease: 1.el9\nEpoch: 3\nSummary: stand-in\nLicense: none\nBuildArch: noarch\n%description\nstand-in\n%files\n"),
        )
        .unwrap();
        let built = Command::new("rpmbuild")
            .args(["-bb", "--quiet", "--define"])
            .arg(format!("_topdir {}", top.display()))
            .arg(&spec)
            .output()
            .unwrap();
        assert!(built.status.success(), "rpmbuild: {}", String::from_utf8_lossy(&built.stderr));
        let rpm = top.join(format!("RPMS/noarch/{name}-580.82.07-1.el9.noarch.rpm"));
        rpm_at(&["-i", "--justdb", "--nodeps", "--noscripts", rpm.to_str().unwrap()]);
    }
    // The module DKMS built for the running kernel, where DKMS puts it on EL: without it the
    // installed package would be reinstalled to build it.
    let extra = root.join("lib/modules/5.14.0-427.13.1.el9_4.x86_64/extra");
    std::fs::create_dir_all(&extra).unwrap();
    std::fs::write(extra.join("nvidia.ko.xz"), b"").unwrap();
    let cfg = config("empty");
    let out = phq(&["install", "--dry-run", "--sysroot", root.to_str().unwrap(), "--config", cfg.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("✓ already done: kmod-nvidia-open-dkms 580.82.07 is installed"), "{text}");
    assert!(!text.contains("installed packages unknown"), "{text}");

    // No database where RHEL keeps it: said, not taken as "nothing installed", and rpm is not
    // let loose on the directory (it would create an empty database there).
    std::fs::remove_dir_all(root.join("var/lib/rpm")).unwrap();
    std::fs::create_dir(root.join("var/lib/rpm")).unwrap();
    let out = phq(&["install", "--dry-run", "--sysroot", root.to_str().unwrap(), "--config", cfg.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("installed packages unknown (RPM-based guest with no RPM database in /var/lib/rpm"),
        "{text}"
    );
    assert_eq!(std::fs::read_dir(root.join("var/lib/rpm")).unwrap().count(), 0, "nothing written into the sysroot");

    // A database rpm cannot open: rpm's words.
    std::fs::write(root.join("var/lib/rpm/rpmdb.sqlite"), b"not a database").unwrap();
    let out = phq(&["install", "--dry-run", "--sysroot", root.to_str().unwrap(), "--config", cfg.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("installed packages unknown (rpm -qa could not read /var/lib/rpm"), "{text}");
}

/// Issue 39: every warn and fail finding of every guest scenario in examples/ carries the
/// `action` and `owner` docs/checks.md's table gives its check (gpu.xid: its governing Xid's
/// catalog resolution, by the table in the same section), and the verdict is the most urgent
/// action of them all. The table is read from the document, not copied here.
#[test]
fn every_finding_routes_as_the_documented_table_says() {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/checks.md")).unwrap();
    let section = doc.split("## What to do and whose move it is").nth(1).expect("the routing section");
    let urgency: Vec<String> = section
        .split("least urgent\nfirst:")
        .nth(1)
        .expect("the order of actions")
        .split(" (")
        .next()
        .unwrap()
        .split(',')
        .map(|w| w.trim().trim_matches('`').to_string())
        .collect();
    assert_eq!(urgency.len(), 10, "{urgency:?}");
    let mut rules = std::collections::BTreeMap::new();
    for line in section.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() > 5 && cells[1].starts_with('`') && cells[1].contains('.') {
            let w = |i: usize| cells[i].trim_matches('`').to_string();
            rules.insert(w(1), (w(2), w(3), w(4)));
        }
    }
    assert!(rules.len() > 50, "{rules:?}");
    // Each example guest's documented verdict: scenario → (action, owner).
    let verdicts = section.split("## Each example guest's verdict").nth(1).expect("the table of example verdicts");
    let expected: std::collections::BTreeMap<String, (String, String)> = verdicts
        .lines()
        .map(|l| l.split('|').map(|c| c.trim().trim_matches('`').to_string()).collect::<Vec<_>>())
        .filter(|c| c.len() > 4 && !c[1].is_empty() && c[1] != "scenario" && !c[1].starts_with('-'))
        .map(|c| (c[1].clone(), (c[2].clone(), c[3].clone())))
        .collect();
    let bucket = |b: &str| -> (&str, &str) {
        match b {
            "RESTART_APP" | "WORKFLOW_XID_45" => ("restart_app", "tenant"),
            "RESET_GPU" | "XID_154" => ("reset_gpu", "tenant"),
            "WORKFLOW_XID_48" => ("reset_gpu", "platform"),
            "RESTART_VM" | "WORKFLOW_NVLINK_ERR" | "WORKFLOW_NVLINK5_ERR" => ("restart_vm", "platform"),
            "RESTART_BM" => ("reboot_host", "platform"),
            "CHECK_MECHANICALS" => ("inspect_hardware", "platform"),
            "UPDATE_SWFW" | "CHECK_UVM" => ("fix_guest_software", "tenant"),
            "IGNORE" => ("none", "none"),
            _ => ("contact_support", "platform"),
        }
    };
    // The written rule for Xids, checked against the document's sentence for the first two.
    assert!(section.contains("`RESTART_APP` and `WORKFLOW_XID_45` → `restart_app`/tenant"));
    assert!(section.contains("`RESTART_BM` → `reboot_host`/platform"));
    let sysroot_of = |scenario: &str| match scenario {
        s if s.starts_with("h100-pcie") => "h100-pcie-single",
        s if s.starts_with("h100-nvl") => "h100-nvl-pair",
        s if s.starts_with("h200") => "h200-single",
        s if s.starts_with("hgx-8gpu-xid79") => "hgx-8gpu-xid79",
        _ => "hgx-8gpu-healthy",
    };
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    // Short NVML deadlines, so the scenarios where NVML blocks answer in seconds.
    std::fs::write(&config, "[nvml]\ninit_timeout = \"2s\"\ngpu_timeout = \"2s\"\n").unwrap();
    let mut scenarios: Vec<String> = std::fs::read_dir(fixture("../../examples/scenarios"))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".json").map(str::to_string))
        .filter(|n| !n.starts_with("cuda-"))
        .collect();
    scenarios.sort();
    let mut seen = 0;
    let runs: Vec<(String, std::thread::JoinHandle<Output>)> = scenarios
        .iter()
        .map(|sc| {
            let (name, sc, config) = (sc.clone(), sc.clone(), config.clone());
            let handle = std::thread::spawn(move || {
                Command::new(env!("CARGO_BIN_EXE_phq-agent"))
                    .args(["doctor", "--json", "--sysroot"])
                    .arg(fixture("sysroots").join(sysroot_of(&sc)))
                    .arg("--config")
                    .arg(&config)
                    .arg("--nvml-lib")
                    .arg(common::fake_nvml())
                    .env("PHQ_FAKE_NVML_SCENARIO", fixture("../../examples/scenarios").join(format!("{sc}.json")))
                    .env_remove("DBUS_SYSTEM_BUS_ADDRESS")
                    .output()
                    .unwrap()
            });
            (name, handle)
        })
        .collect();
    for (sc, handle) in runs {
        let out = handle.join().unwrap();
        let r: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{sc}: {e}: {}", String::from_utf8_lossy(&out.stderr)));
        validate(&r);
        // The platform's poller reads every example guest's report through the shared view
        // (crates/phq-wire): a field it names that the agent stopped writing fails here.
        let view: phq_wire::view::Status =
            serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{sc}: the platform's view: {e}"));
        assert_eq!((&*view.schema, view.gpus.len()), (phq_wire::SCHEMA, r["gpus"].as_array().unwrap().len()), "{sc}");
        assert_eq!(view.verdict.as_ref().map(|v| v.action.word()), r["verdict"]["action"].as_str(), "{sc}");
        let mut worst = 0;
        for f in r["findings"].as_array().unwrap() {
            let (id, sev) = (f["id"].as_str().unwrap(), f["severity"].as_str().unwrap());
            let got = (f["action"].as_str().unwrap(), f["owner"].as_str().unwrap());
            let want: (String, String) = match sev {
                "warn" | "fail"
                    if id == "gpu.xid" && f["evidence"]["governs"].as_str().is_some_and(|g| g.starts_with("Xid ")) =>
                {
                    let code = f["evidence"]["governs"].as_str().unwrap().trim_start_matches("Xid ");
                    let x = f["evidence"]["xids"].as_array().unwrap().iter().find(|x| x["code"] == code).unwrap();
                    let (a, o) = bucket(x["resolution"].as_str().unwrap());
                    (a.into(), o.into())
                }
                "warn" | "fail" if id == "gpu.xid" => continue, // NVML's recovery action governs: unit-tested
                // One cause, one owner: a finding that names its cause routes as the cause does.
                "warn" | "fail" if f["evidence"]["caused_by"].is_string() => {
                    let cause = f["evidence"]["caused_by"].as_str().unwrap();
                    let (w, fl, o) =
                        rules.get(cause).unwrap_or_else(|| panic!("{sc}: cause {cause} is not in the table"));
                    (if sev == "warn" { w.clone() } else { fl.clone() }, o.clone())
                }
                "warn" | "fail" => {
                    let (w, fl, o) =
                        rules.get(id).unwrap_or_else(|| panic!("{sc}: {id} is not in docs/checks.md's table"));
                    (if sev == "warn" { w.clone() } else { fl.clone() }, o.clone())
                }
                _ => ("none".into(), "none".into()),
            };
            assert_eq!((got.0, got.1), (want.0.as_str(), want.1.as_str()), "{sc}: {id} ({sev})");
            worst = worst.max(urgency.iter().position(|a| a == got.0).unwrap());
            seen += usize::from(sev == "warn" || sev == "fail");
        }
        assert_eq!(r["verdict"]["action"], urgency[worst], "{sc}: the verdict is the most urgent action");
        let (action, owner) = expected
            .get(sc.as_str())
            .unwrap_or_else(|| panic!("{sc}: no row in docs/checks.md's table of example verdicts"));
        assert_eq!(
            (r["verdict"]["action"].as_str().unwrap(), r["verdict"]["owner"].as_str().unwrap()),
            (action.as_str(), owner.as_str()),
            "{sc}: the verdict is not the documented one (docs/checks.md, \"Each example guest's verdict\")"
        );
    }
    assert_eq!(expected.len(), scenarios.len(), "docs/checks.md lists verdicts for scenarios that no longer exist");
    assert!(seen > 30, "only {seen} warn/fail findings across the scenarios");
}

#[test]
fn each_gpu_names_its_physical_part_and_baseboard_module() {
    let (_, report, _) = common::doctor("hgx-8gpu-healthy", "hgx-8gpu-healthy", None, None, &[]);
    let scenario: Value = serde_json::from_str(
        &std::fs::read_to_string(common::repo().join("examples/scenarios/hgx-8gpu-healthy.json")).unwrap(),
    )
    .unwrap();
    for (g, d) in report["gpus"].as_array().unwrap().iter().zip(scenario["devices"].as_array().unwrap()) {
        assert_eq!(g["serial"], d["serial"], "{g:#}");
        assert_eq!(g["board_part_number"], d["board_part_number"]);
        assert_eq!(g["module_id"], d["module_id"], "nvmlDeviceGetModuleId, as NVML answers it");
    }
    // A card whose NVML does not give a module id: the field is absent, not a made-up 0.
    let (_, report, _) = common::doctor("h100-pcie-single", "h100-pcie-vm-unsupported", None, None, &[]);
    assert!(report["gpus"][0].get("module_id").is_none(), "{:#}", report["gpus"][0]);
}

#[test]
fn a_gpu_with_another_vbios_than_its_baseboard_is_named_for_the_platform() {
    let (_, healthy, _) = common::doctor("hgx-8gpu-healthy", "hgx-8gpu-healthy", None, None, &[]);
    let f = findings(&healthy, "gpu.firmware-consistent");
    assert_eq!((f.len(), f[0]["severity"].as_str()), (1, Some("pass")), "{:#}", f[0]);
    assert_eq!(f[0]["evidence"]["gpus_compared"], 8);

    let (_, mixed, _) = common::doctor("hgx-8gpu-healthy", "hgx-8gpu-mixed-vbios", None, None, &[]);
    let f = findings(&mixed, "gpu.firmware-consistent")[0];
    assert_eq!(
        (f["severity"].as_str(), f["action"].as_str(), f["owner"].as_str()),
        (Some("warn"), Some("inspect_hardware"), Some("platform")),
        "{f:#}"
    );
    let summary = f["summary"].as_str().unwrap();
    assert!(summary.contains("2 VBIOS versions") && summary.contains("96.00.89.00.01 on 0000:0e:00.0"), "{summary}");
    assert!(!summary.contains("InfoROM"), "the InfoROM images agree: {summary}");
    assert_eq!(mixed["verdict"]["action"], "inspect_hardware");
}

#[test]
fn an_sram_error_fails_the_gpu_that_the_ecc_totals_call_healed() {
    let (_, healthy, _) = common::doctor("hgx-8gpu-healthy", "hgx-8gpu-healthy", None, None, &[]);
    let f = findings(&healthy, "gpu.sram-ecc");
    assert_eq!(f.len(), 8);
    assert!(f.iter().all(|f| f["severity"] == "pass"), "{f:#?}");

    let (_, r, _) = common::doctor("hgx-8gpu-healthy", "hgx-8gpu-sram-uncorrectable", None, None, &[]);
    let bad: Vec<_> = findings(&r, "gpu.sram-ecc").into_iter().filter(|f| f["severity"] != "pass").collect();
    assert_eq!(bad.len(), 1, "{bad:#?}");
    let f = bad[0];
    assert_eq!((f["gpu"].as_str(), f["severity"].as_str()), (Some("0000:0c:00.0"), Some("fail")));
    assert_eq!((f["action"].as_str(), f["owner"].as_str()), (Some("inspect_hardware"), Some("platform")));
    assert!(f["summary"].as_str().unwrap().contains("1 uncorrectable SRAM ECC error"), "{f:#}");
    assert_eq!(f["evidence"]["sram"]["aggregate"]["uncorrected"], 1);
    assert_eq!(f["evidence"]["dram"]["aggregate"]["corrected"], 40);
    // The totals alone read as an old error, healed: only a warning.
    let totals = findings(&r, "gpu.ecc-uncorrectable").into_iter().find(|f| f["gpu"] == "0000:0c:00.0").unwrap();
    assert_eq!(totals["severity"], "warn");
    assert_eq!(r["verdict"]["action"], "inspect_hardware");
}

#[test]
fn a_process_stuck_in_the_driver_fails_and_a_kernel_hung_task_report_warns() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let root = common::copy_sysroot("hgx-8gpu-healthy", dir.path());
    let run = || {
        let (_, r, _) = common::doctor(root.to_str().unwrap(), "hgx-8gpu-healthy", None, None, &[]);
        findings(&r, "host.hung-tasks")[0].clone()
    };
    assert_eq!(run()["severity"], "pass");

    // A process writes the kernel's words to /dev/kmsg (facility 1, user): not the kernel's.
    let mut kmsg = std::fs::OpenOptions::new().append(true).open(root.join("dev/kmsg")).unwrap();
    writeln!(kmsg, "11,9100,95000000000,-;INFO: task trainer:4242 blocked for more than 122 seconds.").unwrap();
    assert_eq!(run()["severity"], "pass", "a forged report");
    // The kernel's own report (facility 0, level 3): a warning naming the task.
    writeln!(kmsg, "3,9101,95000000100,-;INFO: task trainer:4242 blocked for more than 122 seconds.").unwrap();
    drop(kmsg);
    let f = run();
    assert_eq!((f["severity"].as_str(), f["action"].as_str()), (Some("warn"), Some("reboot_vm")), "{f:#}");
    assert!(f["summary"].as_str().unwrap().contains("trainer (pid 4242) blocked for more than 122 s"), "{f:#}");

    // The task is in uninterruptible sleep holding /dev/nvidia3: blocked in the driver, a failure.
    let proc = root.join("proc/4242");
    std::fs::create_dir_all(proc.join("fd")).unwrap();
    std::fs::write(proc.join("stat"), "4242 (trainer) D 1 4242 4242 0 -1 4194560 12 0 0 0\n").unwrap();
    std::fs::write(
        proc.join("status"),
        "Name:\ttrainer\nState:\tD (disk sleep)\nvoluntary_ctxt_switches:\t812\nnonvoluntary_ctxt_switches:\t9\n",
    )
    .unwrap();
    std::os::unix::fs::symlink("/dev/nvidia3", proc.join("fd/7")).unwrap();
    std::os::unix::fs::symlink("/dev/nvidiactl", proc.join("fd/5")).unwrap();
    std::os::unix::fs::symlink("/tmp/nvidia3", proc.join("fd/9")).unwrap();
    // Another in D state without an NVIDIA device: not the driver's.
    std::fs::create_dir_all(root.join("proc/77/fd")).unwrap();
    std::fs::write(root.join("proc/77/stat"), "77 (jbd2/vda1-8) D 2 0 0 0\n").unwrap();
    let f = run();
    assert_eq!(f["severity"], "fail", "{f:#}");
    assert_eq!(
        f["evidence"]["blocked_in_driver"],
        serde_json::json!([{ "pid": 4242, "comm": "trainer", "devices": ["/dev/nvidia3", "/dev/nvidiactl"] }])
    );
}

#[test]
fn clocks_held_back_between_snapshots_are_counted_and_judged_by_their_share_of_the_uptime() {
    let dir = tempfile::tempdir().unwrap();
    let root = common::copy_sysroot("hgx-8gpu-healthy", dir.path());
    // An hour since boot: 300 s of thermal slowdown is 8.3 % of it.
    std::fs::write(root.join("proc/uptime"), "3600.00 7000.00\n").unwrap();
    let (_, healthy, _) = common::doctor(root.to_str().unwrap(), "hgx-8gpu-healthy", None, None, &[]);
    let f = findings(&healthy, "gpu.throttle-time");
    assert!(f.len() == 8 && f.iter().all(|f| f["severity"] == "pass"), "{f:#?}");
    assert_eq!(f[0]["evidence"]["violations_ns"]["power"], 2_000_000_000u64);

    let (_, hot, _) = common::doctor(root.to_str().unwrap(), "hgx-8gpu-pcie-degraded-thermal", None, None, &[]);
    let bad: Vec<_> = findings(&hot, "gpu.throttle-time").into_iter().filter(|f| f["severity"] != "pass").collect();
    assert_eq!(bad.len(), 1, "{bad:#?}");
    assert_eq!((bad[0]["gpu"].as_str(), bad[0]["severity"].as_str()), (Some("0000:0e:00.0"), Some("warn")));
    let summary = bad[0]["summary"].as_str().unwrap();
    assert!(
        summary.contains("thermal 300 s (8.3 % of the time since boot)") && !summary.contains("power"),
        "{summary}"
    );
}

/// The vsock device is a host fact: its CID (KubeVirt's `status.vsockCID`) in the report and
/// the table, "none" without one. A fixture's `dev/vsock` is a file holding the CID, as its
/// `dev/kmsg` holds the kernel log.
#[test]
fn doctor_reports_the_vsock_cid_or_none() {
    let dir = tempfile::tempdir().unwrap();
    let root = common::copy_sysroot("hgx-8gpu-healthy", dir.path());
    let cfg = config("expect-8");
    let run = |json: bool| {
        let mut args = vec!["doctor", "--sysroot", root.to_str().unwrap(), "--config", cfg.to_str().unwrap()];
        if json {
            args.push("--json");
        }
        String::from_utf8(phq(&args).stdout).unwrap()
    };
    let report: Value = serde_json::from_str(&run(true)).unwrap();
    validate(&report);
    assert_eq!(report["host"]["vsock_cid"], Value::Null, "no dev/vsock: none");
    assert!(run(false).lines().next().unwrap().contains("no vsock"), "{}", run(false));

    std::fs::write(root.join("dev/vsock"), "42\n").unwrap();
    let report: Value = serde_json::from_str(&run(true)).unwrap();
    validate(&report);
    assert_eq!(report["host"]["vsock_cid"], 42);
    let table = run(false);
    assert!(table.lines().next().unwrap().contains("vsock CID 42"), "{table}");
}

/// An H100 NVL pair's bridges wire 12 of the 18 links NVML lists: the six others are inactive by
/// design and no alarm; one wired link down fails its GPU by name; a start where no link trained
/// (Azure/azhpc-images#443) fails both GPUs as the platform's move.
#[test]
fn a_bridged_h100_nvl_pair_is_judged_by_the_links_its_bridge_wires() {
    let finding = |r: &Value, gpu: &str| -> Value {
        r["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["id"] == "nvlink.links-active" && f["gpu"] == gpu)
            .unwrap_or_else(|| panic!("no nvlink.links-active for {gpu}: {r:#}"))
            .clone()
    };
    let (a, b) = ("0000:09:00.0", "0000:0a:00.0");

    let (_, r, _) = common::doctor("h100-nvl-pair", "h100-nvl-pair", None, None, &[]);
    for gpu in [a, b] {
        let f = finding(&r, gpu);
        assert_eq!(f["severity"], "pass", "{f:#}");
        assert_eq!(f["summary"], "12/18 NVLinks active, the 12 an H100 NVL bridge wires", "{f:#}");
    }

    let (code, r, _) = common::doctor("h100-nvl-pair", "h100-nvl-pair-link-down", None, None, &[]);
    assert_eq!(code, 2);
    assert_eq!(finding(&r, a)["severity"], "pass");
    let f = finding(&r, b);
    assert_eq!(f["severity"], "fail", "{f:#}");
    assert_eq!(f["summary"], "1 of the 12 bridged NVLinks down (11/18 active)");
    assert!(f["detail"].as_str().unwrap().contains("links 4, 5, 7, 10, 11, 16, 17"), "{f:#}");
    assert_eq!(f["owner"], "platform");

    let (code, r, _) = common::doctor("h100-nvl-pair", "h100-nvl-pair-links-absent", None, None, &[]);
    assert_eq!(code, 2);
    for (gpu, peer) in [(a, b), (b, a)] {
        let f = finding(&r, gpu);
        assert_eq!(f["severity"], "fail", "{f:#}");
        assert_eq!(f["summary"], format!("no NVLink active to its bridged peer {peer} (12 expected)"));
        assert_eq!(f["owner"], "platform");
        assert!(f["remedy"].as_str().unwrap().starts_with("The platform's move"), "{f:#}");
    }
}

/// Issue 51: a verdict that rests on NVML says so when NVML was a library named on the command
/// line or in PHQ_NVML_LIB rather than the driver's: whoever started the agent chose what it
/// says.
#[test]
fn a_verdict_says_when_its_library_was_named_by_whoever_started_the_agent() {
    let (_, r, _) = common::doctor("hgx-8gpu-healthy", "hgx-8gpu-power-capped", None, None, &[]);
    let v = &r["verdict"];
    assert_eq!(v["basis"], serde_json::json!(["nvml"]), "{v:#}");
    let note = v["note"].as_str().unwrap_or("");
    assert!(
        note.contains("NVML was read from") && note.contains("libfake_nvml.so") && note.contains("PHQ_NVML_LIB"),
        "{v:#}"
    );
}
