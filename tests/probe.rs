//! `phq-agent probe`, the real binary, against the fake CUDA driver (crates/fake-cuda) and the
//! fake NVML: the same machine seen by both. The fake keeps the driver API's rules (events stay
//! in their context, peer access must be enabled, sticky errors poison a device, exclusive mode
//! refuses a second process) and its clocks are virtual, so every figure below is exact.
//!
//! Each test names a defect the first probe had on a real HGX; against that probe (on cudarc)
//! the 8-GPU scenario failed every GPU↔GPU pair with CUDA_ERROR_INVALID_CONTEXT (201).

mod common;

use common::{fake_cuda, fake_nvml, repo};
use serde_json::Value;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A probe over a fixture: sysroot, NVML scenario and CUDA scenario, a private state dir.
struct Run {
    dir: tempfile::TempDir,
    sysroot: &'static str,
    nvml: &'static str,
    cuda: &'static str,
}

impl Run {
    fn new(sysroot: &'static str, nvml: &'static str, cuda: &'static str) -> Run {
        Run::configured(sysroot, nvml, cuda, "")
    }

    /// With more configuration after the `[agent]` table (`[probes]` …).
    fn configured(sysroot: &'static str, nvml: &'static str, cuda: &'static str, more: &str) -> Run {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::write(
            dir.path().join("config.toml"),
            format!("[agent]\nstate_dir = {:?}\n{more}", state.to_str().unwrap()),
        )
        .unwrap();
        Run { dir, sysroot, nvml, cuda }
    }

    /// Every GPU the agent made a context on, one line per context (PCI address).
    fn contexts(&self) -> PathBuf {
        self.dir.path().join("contexts")
    }

    fn command(&self, args: &[&str]) -> Command {
        self.command_of(std::path::Path::new(env!("CARGO_BIN_EXE_phq-agent")), args)
    }

    /// `command` with another copy of the program.
    fn command_of(&self, program: &std::path::Path, args: &[&str]) -> Command {
        let mut c = Command::new(program);
        c.args(["probe", "--json", "--config"])
            .arg(self.dir.path().join("config.toml"))
            .arg("--sysroot")
            .arg(repo().join("tests/fixtures/sysroots").join(self.sysroot))
            .arg("--nvml-lib")
            .arg(fake_nvml())
            .arg("--cuda-lib")
            .arg(fake_cuda())
            .args(args)
            .env("PHQ_FAKE_NVML_SCENARIO", scenario(self.nvml))
            .env("PHQ_FAKE_CUDA_SCENARIO", scenario(self.cuda))
            .env("PHQ_CUBLAS_LIB", fake_cuda())
            .env("PHQ_NCCL_LIB", fake_cuda())
            .env("PHQ_FAKE_CUDA_CONTEXTS", self.contexts())
            .env_remove("CUDA_DEVICE_ORDER")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    fn run(&self, args: &[&str]) -> Probed {
        Probed::of(self.command(args).output().unwrap())
    }

    fn spawn(&self, args: &[&str]) -> Child {
        self.command(args).spawn().unwrap()
    }

    fn contexts_made(&self) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_to_string(self.contexts()).unwrap_or_default().lines().map(str::to_string).collect();
        v.sort();
        v
    }

    /// Runs the probe once and keeps what several tests read: its output and the files it left in
    /// its state directory. The directory goes with the run, so nothing outlives the test binary.
    fn keep(self, args: &[&str]) -> Kept {
        let probed = self.run(args);
        let state = std::fs::read_dir(self.dir.path().join("state"))
            .map(|d| d.flatten().filter(|e| e.path().is_file()).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
            .collect();
        Kept { probed, state }
    }

    /// A run whose state directory starts as `kept` left its own: a later run on the same machine.
    fn after(kept: &Kept, sysroot: &'static str, nvml: &'static str, cuda: &'static str) -> Run {
        let r = Run::new(sysroot, nvml, cuda);
        let state = r.dir.path().join("state");
        std::fs::create_dir_all(&state).unwrap();
        for (name, bytes) in &kept.state {
            std::fs::write(state.join(name), bytes).unwrap();
        }
        r
    }
}

/// A probe run several tests read (each asserts what it asserted when it ran the command
/// itself): made once per test binary, by the first test that asks while the others wait.
struct Kept {
    probed: Probed,
    /// The state directory's files after the run (the baseline it recorded, its lock file).
    state: Vec<(String, Vec<u8>)>,
}

impl Kept {
    fn state_file(&self, name: &str) -> &[u8] {
        let file = self.state.iter().find(|(n, _)| n == name);
        &file.unwrap_or_else(|| panic!("the run left no state/{name}")).1
    }
}

/// `probe` on the single H200 (`cuda-h200`), the quick level, from an empty state directory.
fn h200_quick() -> &'static Kept {
    static RUN: OnceLock<Kept> = OnceLock::new();
    RUN.get_or_init(|| Run::new("h200-single", "h200-vm", "cuda-h200").keep(&[]))
}

/// `probe --gpu 0 --gpu 1` on the healthy HGX (`cuda-hgx-8gpu`), the quick level, from an empty
/// state directory.
fn hgx_gpus_0_and_1() -> &'static Kept {
    static RUN: OnceLock<Kept> = OnceLock::new();
    RUN.get_or_init(|| {
        Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu").keep(&["--gpu", "0", "--gpu", "1"])
    })
}

fn scenario(name: &str) -> PathBuf {
    repo().join("examples/scenarios").join(format!("{name}.json"))
}

struct Probed {
    code: i32,
    report: Value,
    stderr: String,
}

impl Probed {
    fn of(out: std::process::Output) -> Probed {
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let report = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("probe printed no JSON ({e}); stderr:\n{stderr}"));
        Probed { code: out.status.code().unwrap_or(-1), report, stderr }
    }

    /// The run exited 2 and its `probe.allreduce` failed: that finding.
    fn failed_allreduce(&self) -> &Value {
        assert_eq!(self.code, 2, "{}", self.stderr);
        let f = self.machine_finding("probe.allreduce");
        assert_eq!(f["severity"], "fail", "{f}");
        f
    }

    fn finding(&self, id: &str, gpu: &str) -> &Value {
        self.report["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["id"] == id && f["gpu"] == gpu)
            .unwrap_or_else(|| panic!("no {id} for {gpu} in {:#}", self.report["findings"]))
    }

    /// A finding of the whole run (no GPU of its own).
    fn machine_finding(&self, id: &str) -> &Value {
        self.report["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["id"] == id && f["gpu"].is_null())
            .unwrap_or_else(|| panic!("no {id} of the whole run in {:#}", self.report["findings"]))
    }

    fn severity(&self, id: &str, gpu: &str) -> &str {
        self.finding(id, gpu)["severity"].as_str().unwrap()
    }

    fn probed_gpus(&self) -> Vec<String> {
        self.report["probes"]["gpus"].as_array().unwrap().iter().map(|g| g["pci"].as_str().unwrap().into()).collect()
    }

    fn peers(&self) -> &Vec<Value> {
        self.report["probes"]["peers"].as_array().unwrap()
    }
}

fn median(v: &Value) -> f64 {
    v["ok"]["median"].as_f64().unwrap_or_else(|| panic!("no measured median in {v}"))
}

const PCI: [&str; 8] = [
    "0000:09:00.0",
    "0000:0a:00.0",
    "0000:0b:00.0",
    "0000:0c:00.0",
    "0000:0d:00.0",
    "0000:0e:00.0",
    "0000:0f:00.0",
    "0000:10:00.0",
];

/// The 8-GPU HGX, every GPU and every ordered pair: a full pass, 56 pairs over NVLink at the
/// scenario's 375 GB/s. While it runs, a second probe is refused and told who holds the lock
/// (two runs at once would halve each other's bandwidth).
#[test]
fn hgx_passes_with_all_56_pairs_at_the_links_rate_and_one_run_at_a_time() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu");
    let mut first = r.spawn(&[]);
    let lock = r.dir.path().join("state/probe.lock");
    let want = format!("pid {} (phq-agent probe)", first.id());
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&lock).unwrap_or_default().starts_with(&want) {
        assert!(Instant::now() < deadline, "the first probe never took {}", lock.display());
        assert!(first.try_wait().unwrap().is_none(), "the first probe ended before it was seen holding the lock");
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = r.run(&["--gpu", "0"]);
    assert_eq!(second.code, 3, "{}", second.stderr);
    assert!(
        second.stderr.contains("another probe run is in progress") && second.stderr.contains(&want),
        "{}",
        second.stderr
    );
    assert_eq!(second.report["findings"].as_array().unwrap().iter().filter(|f| f["severity"] == "fail").count(), 0);

    let p = Probed::of(first.wait_with_output().unwrap());
    assert_eq!(p.code, 0, "{:#}\n{}", p.report["findings"], p.stderr);
    assert_eq!(p.probed_gpus(), PCI);
    assert_eq!(p.peers().len(), 56);
    for l in p.peers() {
        assert_eq!(l["scope"], "nvlink", "{l}");
        assert!((median(&l["gbps"]) - 375.0).abs() < 0.5, "{l}");
    }
    for gpu in PCI {
        for id in [
            "probe.h2d-bandwidth",
            "probe.d2h-bandwidth",
            "probe.bidir-bandwidth",
            "probe.d2d-bandwidth",
            "probe.memory-integrity",
            "probe.gemm",
            "probe.p2p-bandwidth",
            "probe.sm-copy-bandwidth",
            "probe.latency",
            "probe.baseline",
        ] {
            assert_eq!(p.severity(id, gpu), "pass", "{}", p.finding(id, gpu));
        }
    }
    // The NVLink scope, one line: NVML's P2P status for every pair, links leading to NVSwitch
    // (remote PCI addresses that are none of the GPUs), the fabric NVML reports.
    let scope = p.report["findings"].as_array().unwrap().iter().find(|f| f["id"] == "probe.nvlink-scope").unwrap();
    assert_eq!(
        scope["summary"],
        "8 GPU(s), all-to-all over NVLink through NVSwitch, 18 links each, 56/56 pairs ≥ 335 GB/s (fabric completed, clique 1)",
        "{scope}"
    );
    assert_eq!(p.report["probes"]["nvlink"]["nvlink_pairs"], 56);
    // Each unordered pair once, both directions measured.
    let pairs = p.report["probes"]["nvlink"]["pairs_gbps"].as_array().unwrap();
    assert_eq!(pairs.len(), 28);
    assert!(pairs.iter().all(|x| x["a_to_b"].as_f64().is_some() && x["b_to_a"].as_f64().is_some()), "{pairs:?}");
    // Peer latency by pointer chase through the other GPU's memory, that GPU's L2 emptied before
    // each sample: the scenario's 1,000 ns (without the eviction, the L2 figure: 600 ns).
    let l = &p.peers()[0];
    assert!((median(&l["latency_ns"]) - 1000.0).abs() < 1.0, "{l}");
    let g = &p.report["probes"]["gpus"][0];
    assert!((median(&g["h2d_gbps"]) - 55.0).abs() < 0.1, "{g}");
    // Both directions at once on PCIe: the fake's two copy engines each run at 55 GB/s.
    assert!((median(&g["bidir_gbps"]) - 110.0).abs() < 0.1, "{g}");
    // A device copy counts read + write bytes, as the scenario's HBM rate does.
    assert!((median(&g["d2d_gbps"]) - 2540.0).abs() < 1.0, "{g}");
    assert_eq!(g["gemm"]["ok"]["wrong_entries"], 0);
    // Every entry of every timed result, checked on the GPU by the check kernel.
    assert_eq!(g["gemm"]["ok"]["checked_on"], "device", "{g}");
    assert_eq!(g["gemm"]["ok"]["checked_entries"], 3 * 4096 * 4096, "every timed result is checked: {g}");
    // One context per GPU, each made once.
    assert_eq!(r.contexts_made(), PCI);
}

/// `--gpu N` is what nvidia-smi calls GPU N (PCI order), whatever CUDA's own order; the scenario
/// ranks each pair of GPUs the other way round for CUDA's default FASTEST_FIRST order. No other
/// GPU gets a context.
#[test]
fn gpu_n_is_nvidia_smis_gpu_n_and_no_other_gpu_is_touched() {
    for order in [None, Some("FASTEST_FIRST")] {
        let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu");
        let mut c = r.command(&["--gpu", "1"]);
        if let Some(o) = order {
            c.env("CUDA_DEVICE_ORDER", o);
        }
        let p = Probed::of(c.output().unwrap());
        assert_eq!(p.code, 0, "{order:?}: {:#}", p.report["findings"]);
        assert_eq!(p.probed_gpus(), ["0000:0a:00.0"], "{order:?}");
        assert_eq!(p.report["probes"]["gpus"][0]["ordinal"], 1, "{order:?}: the report calls it GPU 1 too");
        assert_eq!(r.contexts_made(), ["0000:0a:00.0"], "{order:?}");
    }
}

/// A GPU with a compute process (NVML lists pid 48211 on 0000:0e:00.0) is never given a context:
/// its probes are `unknown` naming the process, its neighbour is measured.
#[test]
fn a_busy_gpu_gets_no_context() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-pcie-degraded-thermal", "cuda-hgx-8gpu");
    let p = r.run(&["--gpu", "4", "--gpu", "5"]);
    assert_eq!(r.contexts_made(), ["0000:0d:00.0"]);
    assert_eq!(p.severity("probe.gemm", "0000:0e:00.0"), "unknown");
    assert!(p.finding("probe.gemm", "0000:0e:00.0")["summary"].as_str().unwrap().contains("pid 48211"));
    assert_eq!(p.severity("probe.gemm", "0000:0d:00.0"), "pass");
    assert!(p.peers().is_empty(), "{:?}", p.peers());
}

/// Exclusive-process mode with another process on GPU 5: the driver refuses the context with
/// CUDA_ERROR_DEVICE_UNAVAILABLE. That GPU is `unknown`, not failed, and its neighbours' pairs
/// among themselves still pass.
#[test]
fn an_exclusive_gpu_held_by_another_process_is_unknown_not_failed() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu-exclusive");
    let p = r.run(&["--gpu", "4", "--gpu", "5", "--gpu", "6"]);
    for id in ["probe.h2d-bandwidth", "probe.memory-integrity", "probe.gemm", "probe.p2p-bandwidth"] {
        assert_eq!(p.severity(id, "0000:0e:00.0"), "unknown", "{}", p.finding(id, "0000:0e:00.0"));
    }
    assert!(
        p.finding("probe.gemm", "0000:0e:00.0")["summary"].as_str().unwrap().contains("exclusive"),
        "{}",
        p.finding("probe.gemm", "0000:0e:00.0")
    );
    for gpu in ["0000:0d:00.0", "0000:0f:00.0"] {
        assert_eq!(p.severity("probe.p2p-bandwidth", gpu), "pass", "{}", p.finding("probe.p2p-bandwidth", gpu));
        assert_eq!(p.severity("probe.gemm", gpu), "pass");
    }
    assert_eq!(p.report["findings"].as_array().unwrap().iter().filter(|f| f["severity"] == "fail").count(), 0);
}

/// An uncorrectable ECC error (214, sticky: it poisons GPU 3's context until reset) during the
/// memory test is GPU 3's memory failure, as DCGM counts it; GPU 3 is let go and not used again,
/// and its neighbours' own figures and their pair stand.
#[test]
fn a_sticky_ecc_error_fails_its_gpus_memory_and_spares_its_peers() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu-ecc");
    let p = r.run(&["--gpu", "2", "--gpu", "3", "--gpu", "4"]);
    assert_eq!(p.code, 2, "{:#}", p.report["findings"]);
    let mem = p.finding("probe.memory-integrity", "0000:0c:00.0");
    assert_eq!(mem["severity"], "fail", "{mem}");
    assert!(mem["summary"].as_str().unwrap().contains("uncorrectable ECC"), "{mem}");
    assert_eq!(p.severity("probe.gemm", "0000:0c:00.0"), "unknown");
    for gpu in ["0000:0b:00.0", "0000:0d:00.0"] {
        for id in ["probe.memory-integrity", "probe.gemm", "probe.p2p-bandwidth"] {
            assert_eq!(p.severity(id, gpu), "pass", "{}", p.finding(id, gpu));
        }
    }
    let measured = p.peers().iter().filter(|l| l["gbps"]["ok"].is_object()).count();
    assert_eq!(measured, 2, "only 2↔4 can be measured: {:?}", p.peers());
}

/// A degraded NVLink path (GPU 2 → GPU 6 at 120 GB/s) is a failed NVLink pair of GPU 2, judged
/// against the NVLink floor because NVML says the GPUs have active NVLinks — not a "PCIe pair"
/// because it copied slowly.
#[test]
fn a_slow_nvlink_pair_fails_its_source_gpu() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu-slow-pair");
    let p = r.run(&["--gpu", "2", "--gpu", "6"]);
    assert_eq!(p.code, 2);
    let f = p.finding("probe.p2p-bandwidth", "0000:0b:00.0");
    assert_eq!(f["severity"], "fail", "{f}");
    assert!(f["summary"].as_str().unwrap().contains("120"), "{f}");
    assert_eq!(p.severity("probe.p2p-bandwidth", "0000:0f:00.0"), "pass");
    assert!(p.peers().iter().all(|l| l["scope"] == "nvlink"), "{:?}", p.peers());
}

/// NVML says GPUs 2 and 6 reach no GPU over NVLink (P2P status), though their links report
/// active; their peer copies run at PCIe rates. Those pairs are PCIe pairs: a warning that the VM
/// lacks NVLink there, not a "slow NVLink" failure, which is what guessing the scope from link
/// states alone made of them.
#[test]
fn nvmls_p2p_status_decides_which_pairs_are_nvlink() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-nvlink-p2p-off", "cuda-hgx-8gpu-pcie-pair");
    let p = r.run(&["--gpu", "2", "--gpu", "3", "--gpu", "4"]);
    for l in p.peers() {
        let pcie = l["src"] == 2 || l["dst"] == 2;
        assert_eq!(l["scope"], if pcie { "pcie" } else { "nvlink" }, "{l}");
    }
    let f = p.finding("probe.p2p-bandwidth", "0000:0b:00.0");
    assert_eq!(
        (f["severity"].as_str(), f["summary"].as_str()),
        (Some("warn"), Some("no NVLink between these GPUs in this VM")),
        "{f}"
    );
    let f = p.finding("probe.p2p-bandwidth", "0000:0c:00.0");
    assert_eq!(
        (f["severity"].as_str(), f["summary"].as_str()),
        (Some("warn"), Some("no NVLink to GPU(s) [2] in this VM")),
        "{f}"
    );
    assert_eq!(p.report["findings"].as_array().unwrap().iter().filter(|f| f["severity"] == "fail").count(), 0);
}

/// A GPU on a degraded link (Gen3 x8) that NVML also reports held back by hardware thermal
/// slowdown: its host copies fail, and beside each figure stands NVML's reading taken right
/// after it, which says the GPU was throttled. The scenario lists a process on it, which
/// `--force` probes beside (then the shortfall is not judged: issue 51); the judged run is the
/// same scenario with the GPU idle.
#[test]
fn each_figure_carries_the_clocks_nvml_read_beside_it() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-pcie-degraded-thermal", "cuda-hgx-8gpu-gen3x8");
    let shared = r.run(&["--gpu", "5", "--force"]);
    let f = shared.finding("probe.h2d-bandwidth", "0000:0e:00.0");
    assert_eq!(f["severity"], "unknown", "{f}");
    assert!(f["summary"].as_str().unwrap().contains("pid 48211"), "{f}");
    assert_eq!(f["evidence"]["conditions"]["sm_clock_mhz"], 990, "{f}");

    let mut sc: Value =
        serde_json::from_str(&std::fs::read_to_string(scenario("hgx-8gpu-pcie-degraded-thermal")).unwrap()).unwrap();
    for d in sc["devices"].as_array_mut().unwrap() {
        d["processes"] = serde_json::json!([]);
        d["utilization"] = serde_json::json!({"gpu": 0, "memory": 0});
    }
    let idle = r.dir.path().join("idle.json");
    std::fs::write(&idle, serde_json::to_vec(&sc).unwrap()).unwrap();
    let p = Probed::of(r.command(&["--gpu", "5"]).env("PHQ_FAKE_NVML_SCENARIO", &idle).output().unwrap());
    let f = p.finding("probe.h2d-bandwidth", "0000:0e:00.0");
    assert_eq!(f["severity"], "fail", "{f}");
    assert!(f["summary"].as_str().unwrap().contains("6.6 GB/s"), "{f}");
    let c = &f["evidence"]["conditions"];
    assert_eq!(c["sm_clock_mhz"], 990, "{f}");
    assert_eq!(c["throttle_reasons"], serde_json::json!(["sw_power_cap", "hw_thermal_slowdown"]), "{f}");
    assert!(
        f["detail"].as_str().unwrap().contains("held back (sw_power_cap, hw_thermal_slowdown; SM clock 990 MHz)"),
        "{f}"
    );
    // Where its pinned buffers went is said too (no NUMA node in this machine's sysfs for it).
    assert!(f["evidence"]["host_memory"].is_string(), "{f}");
    let g = p.finding("probe.gemm", "0000:0e:00.0");
    assert_eq!(g["evidence"]["conditions"]["sm_clock_mhz"], 990, "{g}");
}

/// `doctor --probe` over a `--sysroot` runs the probes too when a CUDA library is named (the fake
/// stands for that machine's GPUs): one report with the machine's checks and the probes'.
#[test]
fn doctor_probe_runs_against_the_named_cuda_library() {
    let r = Run::new("h100-pcie-single", "h100-pcie-vm-unsupported", "cuda-h100-pcie");
    let c = r.command(&[]);
    let args: Vec<std::ffi::OsString> = c.get_args().skip(1).map(|a| a.to_os_string()).collect();
    let mut d = Command::new(env!("CARGO_BIN_EXE_phq-agent"));
    d.arg("doctor").args(&args).args(["--probe", "quick"]);
    for (k, v) in c.get_envs() {
        match v {
            Some(v) => d.env(k, v),
            None => d.env_remove(k),
        };
    }
    let p = Probed::of(d.output().unwrap());
    assert_eq!(p.severity("probe.gemm", "0000:09:00.0"), "pass", "{}", p.stderr);
    assert!(p.report["findings"].as_array().unwrap().iter().any(|f| f["id"] == "driver.nouveau-disabled"));
    assert_eq!(r.contexts_made(), ["0000:09:00.0"]);
}

/// An H100 PCIe VM: judged against that SKU's DCGM floors (device copy 1230 GB/s, GEMM 15.4
/// TFLOP/s), and no peers.
#[test]
fn an_h100_pcie_vm_is_held_to_its_own_floors() {
    let r = Run::new("h100-pcie-single", "h100-pcie-vm-unsupported", "cuda-h100-pcie");
    let p = r.run(&[]);
    assert_eq!(p.code, 0, "{:#}", p.report["findings"]);
    let gpu = "0000:09:00.0";
    assert_eq!(p.finding("probe.d2d-bandwidth", gpu)["evidence"]["floor_gbps"], 1230.0);
    assert!(p.finding("probe.gemm", gpu)["summary"].as_str().unwrap().contains("floor 15.4"));
    assert!(p.peers().is_empty());
}

/// NVML lists the agent's own process on a GPU it holds a context on; that does not make the GPU
/// busy (the agent would otherwise lock itself out of every later probe).
#[test]
fn the_agents_own_process_does_not_make_a_gpu_busy() {
    let r = Run::new("h200-single", "h200-vm-agent-context", "cuda-h200");
    let p = r.run(&[]);
    assert_eq!(p.severity("probe.gemm", "0000:09:00.0"), "pass", "{}", p.finding("probe.gemm", "0000:09:00.0"));
}

/// The memory test's passes by name: (mismatches, first mismatch's read word).
fn passes(f: &Value) -> Vec<(String, u64, Option<u64>)> {
    f["evidence"]["memtest"]["passes"]
        .as_array()
        .unwrap_or_else(|| panic!("no passes in {f}"))
        .iter()
        .map(|p| {
            (p["name"].as_str().unwrap().to_string(), p["mismatches"].as_u64().unwrap(), p["first"][0]["read"].as_u64())
        })
        .collect()
}

fn pass<'a>(all: &'a [(String, u64, Option<u64>)], prefix: &str) -> &'a (String, u64, Option<u64>) {
    all.iter().find(|p| p.0.starts_with(prefix)).unwrap_or_else(|| panic!("no pass {prefix} in {all:?}"))
}

/// Device address of byte `offset` of the fake's GPU 0 (its unified address space starts at
/// 0x7f00_0000_0000).
const GPU0: u64 = 0x7f00_0000_0000;

/// A bit stuck at 1 (bit 3 of the word 1 GiB in) is found by the kernels' device-side test over
/// 90% of the GPU's memory, by the pass that writes 0 there (address in address: the address
/// has bit 3 clear) and not by the one that writes 1 (its inverse): a memory failure, with the
/// word's address and what it read.
#[test]
fn a_stuck_bit_is_a_memory_failure() {
    let r = Run::new("h100-pcie-single", "h100-pcie-vm-unsupported", "cuda-h100-pcie-stuck-bit");
    let p = r.run(&[]);
    assert_eq!(p.code, 2, "{:#}", p.report["findings"]);
    let f = p.finding("probe.memory-integrity", "0000:09:00.0");
    assert_eq!(f["severity"], "fail", "{f}");
    let m = &f["evidence"]["memtest"];
    assert_eq!(m["method"], "kernels", "{f}");
    // 90% of the 79.6 GiB scenario GPU's free memory, in 1 GiB chunks.
    assert!(m["bytes_tested"].as_u64().unwrap() > 70 << 30, "{f}");
    let all = passes(f);
    let word = GPU0 + (1 << 30);
    assert_eq!(pass(&all, "address in address"), &("address in address".into(), 1, Some(word | 8)), "{all:?}");
    assert_eq!(pass(&all, "inverse address").1, 0, "{all:?}");
    assert!(!all.iter().any(|p| p.0.starts_with("moving inversions")), "quick runs no moving inversions: {all:?}");
    assert!(f["summary"].as_str().unwrap().contains(&format!("{word:#x}")), "{f}");
    assert_eq!(p.severity("probe.gemm", "0000:09:00.0"), "pass");
}

/// Hopper's L2 is a write-back cache: the last lines a pass writes stay dirty in it, and a pass
/// that starts where the last one ended reads them from the cache, not from HBM. The scenario
/// has a bit stuck at 1 in the first word the standard level tests and one stuck at 0 in the
/// last. Moving inversions down writes zeros from the top down, ending at the first word, and
/// the solid pass then starts there; moving inversions up writes ones ending at the last word,
/// and the down pass starts there. Each is found only because the memory test writes twice the
/// L2 between passes (without that eviction both passes read 0 mismatches).
#[test]
fn the_l2_is_evicted_between_passes_so_the_ends_of_memory_are_read_from_hbm() {
    let r = Run::new("h100-pcie-single", "h100-pcie-vm-unsupported", "cuda-h100-pcie-stuck-at-the-ends");
    let p = r.run(&["--level", "standard"]);
    let f = p.finding("probe.memory-integrity", "0000:09:00.0");
    let m = &f["evidence"]["memtest"];
    let (first, end) = (GPU0 + 0x1_0660_0000, GPU0 + 0x12_CFA0_0000);
    assert_eq!(
        m["ranges"],
        serde_json::json!([[first, end]]),
        "the memory the test covers moved: the scenario's stuck bits must sit at its two ends {f}"
    );
    let all = passes(f);
    // Each read back with its stuck bit, at its own address.
    assert_eq!(pass(&all, "solid 0x0000000000000000"), &("solid 0x0000000000000000".into(), 1, Some(1)), "{all:?}");
    assert_eq!(
        pass(&all, "moving inversions down 0xffffffffffffffff"),
        &("moving inversions down 0xffffffffffffffff".into(), 1, Some(u64::MAX - 1)),
        "{all:?}"
    );
    let at = |name: &str| {
        let ps = m["passes"].as_array().unwrap();
        ps.iter().find(|p| p["name"] == name).map(|p| p["first"][0]["address"].as_u64()).unwrap_or_default()
    };
    assert_eq!(at("solid 0x0000000000000000"), Some(first), "{m}");
    assert_eq!(at("moving inversions down 0xffffffffffffffff"), Some(end - 8), "{m}");
}

/// Two pairs of shorted cells (the scenario's): a near one (bit 6 of a word reads bit 6 of the
/// word 64 bytes below) and a far one (bit 26 of a word reads bit 26 of the word 64 MiB below).
/// Solid patterns fill both cells of a pair alike and see neither. The address patterns see
/// both. Moving inversions see only the far one, and only walking up: the check kernel's
/// threads take one word each per round of their grid-stride loop, so a neighbour 64 bytes
/// away is loaded in the same round as its victim, before either is rewritten, while a cell
/// 64 MiB below was rewritten many rounds earlier (the PTX interpreter executes that order, and
/// the model keeps it). The mismatch named is the lowest address of those kept.
#[test]
fn a_coupled_bit_is_found_by_the_patterns_that_can_see_it_and_only_those() {
    let r = Run::new("h100-pcie-single", "h100-pcie-vm-unsupported", "cuda-h100-pcie-coupled-bit");
    let p = r.run(&["--level", "standard"]);
    let f = p.finding("probe.memory-integrity", "0000:09:00.0");
    assert_eq!(f["severity"], "fail", "{f}");
    let all = passes(f);
    let near = GPU0 + (16 << 30) + 64;
    // Address in address expects bit 6 set (the address has it) and reads the neighbour's, clear;
    // the far victim's bit 26 likewise. The lowest kept is the near one.
    assert_eq!(pass(&all, "address in address"), &("address in address".into(), 2, Some(near & !0x40)), "{all:?}");
    assert_eq!(pass(&all, "inverse address").1, 2, "{all:?}");
    assert_eq!(pass(&all, "moving inversions up 0x0000000000000000").1, 1, "{all:?}");
    assert_eq!(pass(&all, "moving inversions up 0x5555555555555555").1, 1, "{all:?}");
    for blind in ["moving inversions down", "solid"] {
        for p in all.iter().filter(|p| p.0.starts_with(blind)) {
            assert_eq!(p.1, 0, "{} cannot see a coupling it meets before the aggressor is rewritten: {all:?}", p.0);
        }
    }
    assert!(f["summary"].as_str().unwrap().contains("lowest of the 2 kept in address in address"), "{f}");
}

/// `--dry-run` plans the run from the snapshot without loading CUDA: 8 GPUs and 56 pairs, the
/// quick level within its 10 s of GPU time and standard within 2 minutes.
#[test]
fn dry_run_plans_the_gpu_time_and_touches_no_gpu() {
    for (level, budget) in [("quick", 10.0), ("standard", 120.0)] {
        let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu");
        let out = r.command(&["--dry-run", "--level", level]).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        let plan: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(plan["gpus"].as_array().unwrap().len(), 8);
        assert_eq!(plan["pairs"].as_array().unwrap().len(), 56);
        let total = plan["total_s"].as_f64().unwrap();
        assert!(total > 0.0 && total <= budget, "{level}: {total} s");
        assert_eq!(plan["budget_s"], budget);
        assert!(r.contexts_made().is_empty(), "a dry run made a CUDA context");
        assert!(!r.dir.path().join("state/probe.lock").exists(), "a dry run took the run lock");
    }
}

/// An H200 VM: DCGM's H200 floors (device copy 2333 GB/s, GEMM 37.5 TFLOP/s), which a healthy
/// H200 (3110 GB/s in the scenario, DCGM's measured figure) passes.
#[test]
fn an_h200_vm_is_held_to_its_own_floors() {
    let p = &h200_quick().probed;
    assert_eq!(p.code, 0, "{:#}", p.report["findings"]);
    let gpu = "0000:09:00.0";
    let d2d = p.finding("probe.d2d-bandwidth", gpu);
    assert_eq!(d2d["evidence"]["floor_gbps"], 2333.0, "{d2d}");
    assert!((d2d["evidence"]["median_gbps"].as_f64().unwrap() - 3110.0).abs() < 1.0, "{d2d}");
    assert!(p.finding("probe.gemm", gpu)["summary"].as_str().unwrap().contains("floor 37.5"));
    // The SM copy kernel, held to the same DCGM floor (its memory-bandwidth test is a kernel).
    let sm = p.finding("probe.sm-copy-bandwidth", gpu);
    assert_eq!((sm["severity"].as_str(), sm["evidence"]["floor_gbps"].as_f64()), (Some("pass"), Some(2333.0)), "{sm}");
    assert!((sm["evidence"]["median_gbps"].as_f64().unwrap() - 3110.0).abs() < 1.0, "{sm}");
    // The chase through pinned host memory: the scenario's 1,000 ns per dependent load.
    let lat = p.finding("probe.latency", gpu);
    assert_eq!(lat["severity"], "pass", "{lat}");
    assert!((lat["evidence"]["median_ns"].as_f64().unwrap() - 1000.0).abs() < 1.0, "{lat}");
    // Every copy sample ran behind a released spin kernel: none was dropped.
    let h2d = p.finding("probe.h2d-bandwidth", gpu);
    assert_eq!(h2d["evidence"]["samples_gbps"].as_array().unwrap().len(), 3, "{h2d}");
}

/// The first passing run becomes the GPU's baseline in the state directory; the same GPU (its
/// serial) 12% slower host→device later still passes its floor but warns against its baseline,
/// and the run exits 1 (degraded).
#[test]
fn a_gpu_slower_than_its_own_baseline_warns_above_the_floor() {
    let gpu = "0000:09:00.0";
    // The first run is the one `an_h200_vm_is_held_to_its_own_floors` reads; the later one starts
    // from the state directory it left.
    let kept = h200_quick();
    let first = &kept.probed;
    assert_eq!(first.code, 0, "{:#}", first.report["findings"]);
    let b = first.finding("probe.baseline", gpu);
    assert!(b["summary"].as_str().unwrap().starts_with("baseline recorded"), "{b}");
    let file: Value = serde_json::from_slice(kept.state_file("probe-baseline.json")).unwrap();
    let serial = b["evidence"]["serial"].as_str().unwrap();
    assert!((file["gpus"][serial]["quick"]["figures"]["h2d_gbps"].as_f64().unwrap() - 55.0).abs() < 0.1, "{file}");
    let r = Run::after(kept, "h200-single", "h200-vm", "cuda-h200-slower-h2d");
    let later = r.run(&[]);
    assert_eq!(later.severity("probe.h2d-bandwidth", gpu), "pass");
    let b = later.finding("probe.baseline", gpu);
    assert_eq!(b["severity"], "warn", "{b}");
    assert!(b["summary"].as_str().unwrap().contains("host→device (GB/s) -12.0% (55.0 → 48.4)"), "{b}");
    assert_eq!(later.code, 1);
}

/// A VM with the driver but no CUDA toolkit (no cuBLAS) still gets a GEMM verdict: the agent's
/// own PTX GEMM, every entry checked on the GPU, no cuBLAS floor held against it.
#[test]
fn without_cublas_the_ptx_gemm_gives_the_verdict() {
    let r = Run::new("h200-single", "h200-vm", "cuda-h200");
    let out = r
        .command(&["--power-seconds", "1"])
        .env("PHQ_CUBLAS_LIB", r.dir.path().join("no-libcublas.so.12"))
        .output()
        .unwrap();
    let p = Probed::of(out);
    let f = p.finding("probe.gemm", "0000:09:00.0");
    assert_eq!(f["severity"], "pass", "{f}");
    assert_eq!(f["evidence"]["gemm"]["library"], "PTX fallback (phq_sgemm)", "{f}");
    assert_eq!(f["evidence"]["gemm"]["checked_entries"], 3 * 2048 * 2048, "{f}");
    assert!(f["summary"].as_str().unwrap().contains("no floor applies"), "{f}");
    // The scenario's PTX rate: the share of its cuBLAS 55 TFLOP/s an H200 gave phq_sgemm (8.1/50.9).
    assert!((f["evidence"]["median_tflops"].as_f64().unwrap() - 55.0 * 8.1 / 50.9).abs() < 0.1, "{f}");
    // The tensor cores through the agent's own mma.sync kernel, at half the side as well (it
    // ran at 19.6 TFLOP/s on an H200, the fake's default for it), checked the same way.
    let t = p.finding("probe.gemm-tensor", "0000:09:00.0");
    assert_eq!(t["severity"], "pass", "{t}");
    assert_eq!(t["evidence"]["gemm"]["library"], "PTX tensor cores, BF16 (phq_mma_gemm)", "{t}");
    assert_eq!(t["evidence"]["gemm"]["checked_entries"], 3 * 2048 * 2048, "{t}");
    assert!((t["evidence"]["median_tflops"].as_f64().unwrap() - 19.6).abs() < 0.01, "{t}");
    // And with FP16 inputs, the kernel's other `mma` branch.
    let t = p.finding("probe.gemm-tensor-fp16", "0000:09:00.0");
    assert_eq!(t["severity"], "pass", "{t}");
    assert_eq!(t["evidence"]["gemm"]["library"], "PTX tensor cores, FP16 (phq_mma_gemm)", "{t}");
    assert_eq!(t["evidence"]["gemm"]["wrong_entries"], 0, "{t}");
    // FP64 on the agent's own phq_dgemm, at half the side; this VM's NVML reads no board power,
    // so the power test says so rather than judging.
    let d = p.finding("probe.gemm-fp64", "0000:09:00.0");
    assert_eq!(d["severity"], "pass", "{d}");
    assert_eq!(d["evidence"]["gemm"]["library"], "PTX fallback (phq_dgemm)", "{d}");
    assert_eq!(d["evidence"]["gemm"]["n"], 2048, "{d}");
    let w = p.finding("probe.power", "0000:09:00.0");
    assert_eq!(w["severity"], "unknown", "{w}");
    assert!(w["summary"].as_str().unwrap().contains("NVML gave no power reading"), "{w}");
}

/// One wrong entry in a 4096×4096 product is found: the check kernel compares every entry of
/// every timed result on the GPU, where 1,024 sampled entries would almost surely miss it.
#[test]
fn a_single_wrong_gemm_entry_is_found_by_the_device_check() {
    let r = Run::new("h200-single", "h200-vm", "cuda-h200-wrong-gemm-entry");
    let p = r.run(&[]);
    let f = p.finding("probe.gemm", "0000:09:00.0");
    assert_eq!(f["severity"], "fail", "{f}");
    // One wrong entry in each of the three timed samples.
    assert_eq!(f["evidence"]["gemm"]["wrong_entries"], 3, "{f}");
    assert!(f["summary"].as_str().unwrap().contains("first C[4000, 17]"), "{f}");
    // The tensor-core GEMM on the same GPU computes the same wrong entry, and its exact check
    // finds it in each sample too.
    let t = p.finding("probe.gemm-tensor", "0000:09:00.0");
    assert_eq!(t["severity"], "fail", "{t}");
    assert_eq!(t["evidence"]["gemm"]["wrong_entries"], 3, "{t}");
    assert!(t["summary"].as_str().unwrap().starts_with("BF16 tensor-core GEMM"), "{t}");
    let h = p.finding("probe.gemm-tensor-fp16", "0000:09:00.0");
    assert_eq!(h["severity"], "fail", "{h}");
    assert_eq!(h["evidence"]["gemm"]["wrong_entries"], 3, "{h}");
    assert!(h["summary"].as_str().unwrap().starts_with("FP16 tensor-core GEMM"), "{h}");
}

/// The tensor-core GEMM, BF16 in and FP32 out through cuBLAS's `cublasGemmEx` (the toolkit is
/// there), on the GPUs asked for: every entry of every timed product exact, at the scenario's
/// tensor rate. Without cuBLAS the agent's own `mma.sync` kernel computes it
/// (`without_cublas_the_ptx_gemm_gives_the_verdict`).
#[test]
fn the_tensor_core_gemm_is_checked_exactly_on_every_gpu() {
    let p = &hgx_gpus_0_and_1().probed;
    for gpu in &PCI[..2] {
        let f = p.finding("probe.gemm-tensor", gpu);
        assert_eq!(f["severity"], "pass", "{f}");
        let g = &f["evidence"]["gemm"];
        assert_eq!(
            (g["library"].as_str(), g["checked_on"].as_str()),
            (Some("cuBLAS GemmEx, BF16 (tensor cores)"), Some("device")),
            "{f}"
        );
        assert_eq!(g["wrong_entries"], 0, "{f}");
        assert_eq!(g["checked_entries"], 3 * 4096 * 4096, "{f}");
        // The fake's default cuBLAS tensor rate (700 TFLOP/s), exact.
        assert!((f["evidence"]["median_tflops"].as_f64().unwrap() - 700.0).abs() < 0.01, "{f}");
        // FP16 inputs through CUDA_R_16F, checked the same way.
        let h = p.finding("probe.gemm-tensor-fp16", gpu);
        assert_eq!(h["severity"], "pass", "{h}");
        assert_eq!(h["evidence"]["gemm"]["library"], "cuBLAS GemmEx, FP16 (tensor cores)", "{h}");
        assert_eq!(h["evidence"]["gemm"]["checked_entries"], 3 * 4096 * 4096, "{h}");
        assert_eq!(h["evidence"]["gemm"]["wrong_entries"], 0, "{h}");
    }
}

/// `--gemm-seconds`: every GPU of the HGX computes checked GEMMs at once for that much GPU time;
/// each GPU's result is judged like the single GEMM (every entry exact, cuBLAS's floor).
/// `--power-seconds`: then FP64 GEMMs on all of them at once while NVML's board power is read,
/// each board held to 75 % of DCGM's 700 W target for the H100 SXM: GPU 0 reaches its limit and
/// passes, GPU 1's power stage stalls at 420 W (the scenario's weak board) and fails as the
/// platform's hardware, GPU 2's limit was lowered to 450 W in the guest — not judged, and the
/// limit is the tenant's to restore.
#[test]
fn every_gpu_runs_the_checked_gemm_at_once_for_the_time_asked() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-power-capped", "cuda-hgx-8gpu-weak-power");
    let p = r.run(&["--gpu", "0", "--gpu", "1", "--gpu", "2", "--gemm-seconds", "1", "--power-seconds", "1"]);
    for gpu in &PCI[..3] {
        let f = p.finding("probe.gemm-sustained", gpu);
        assert_eq!(f["severity"], "pass", "{f}");
        let g = &f["evidence"]["gemm"];
        assert!(g["seconds"].as_f64().unwrap() >= 1.0, "{f}");
        assert_eq!(g["wrong_entries"], 0, "{f}");
        assert!(f["summary"].as_str().unwrap().ends_with("with 3 GPU(s) loaded at once"), "{f}");
        // FP64 through cuBLAS's DGEMM, checked on the host, no floor.
        let d = p.finding("probe.gemm-fp64", gpu);
        assert_eq!(d["severity"], "pass", "{d}");
        assert_eq!(d["evidence"]["gemm"]["library"], "cuBLAS DGEMM", "{d}");
        assert!(d["evidence"]["gemm"]["seconds"].as_f64().unwrap() >= 1.0, "{d}");
        assert_eq!(d["evidence"]["gemm"]["wrong_entries"], 0, "{d}");
        assert!(d["evidence"]["gemm"]["checked_entries"].as_u64().unwrap() >= 1024, "{d}");
    }
    let power = |gpu: &str| {
        let f = p.finding("probe.power", gpu);
        assert_eq!(f["evidence"]["floor_w"], 525.0, "{f}");
        assert!(f["evidence"]["power"]["samples"].as_u64().unwrap() >= 2, "{f}");
        f
    };
    let ok = power(PCI[0]);
    assert_eq!(ok["severity"], "pass", "{ok}");
    assert_eq!(ok["evidence"]["power"]["max_w"], 700.0, "{ok}");
    let weak = power(PCI[1]);
    assert_eq!((weak["severity"].as_str(), weak["owner"].as_str()), (Some("fail"), Some("platform")), "{weak}");
    assert_eq!(weak["action"], "inspect_hardware", "{weak}");
    assert_eq!(weak["evidence"]["power"]["max_w"], 420.0, "{weak}");
    assert!(weak["summary"].as_str().unwrap().contains("short of the 525 W floor"), "{weak}");
    let capped = power(PCI[2]);
    assert_eq!(capped["severity"], "unknown", "{capped}");
    assert_eq!(capped["evidence"]["power"]["max_w"], 450.0, "{capped}");
    let limit = p.finding("probe.power-limit", PCI[2]);
    assert_eq!((limit["severity"].as_str(), limit["owner"].as_str()), (Some("warn"), Some("tenant")), "{limit}");
    assert_eq!(p.severity("probe.power-limit", PCI[0]), "pass");
    // The GPUs not asked for ran nothing.
    assert_eq!(r.contexts_made(), PCI[..3]);
}

/// A driver too old for the kernels' PTX (CUDA 10.2 against ISA 7.0) refuses the module with
/// CUDA_ERROR_UNSUPPORTED_PTX_VERSION: the kernel probes are unknown and say why, the memory test
/// falls back to patterns read back to the host, the GEMM is checked on the host, and the copies
/// are still measured.
#[test]
fn a_driver_too_old_for_the_kernels_leaves_them_unknown_and_the_rest_measured() {
    let r = Run::new("h200-single", "h200-vm", "cuda-h200-old-driver");
    let p = r.run(&[]);
    let gpu = "0000:09:00.0";
    for id in ["probe.sm-copy-bandwidth", "probe.latency"] {
        let f = p.finding(id, gpu);
        assert_eq!(f["severity"], "unknown", "{f}");
        assert!(f["summary"].as_str().unwrap().contains("CUDA_ERROR_UNSUPPORTED_PTX_VERSION"), "{f}");
    }
    let m = p.finding("probe.memory-integrity", gpu);
    assert_eq!(m["severity"], "pass", "{m}");
    assert_eq!(m["evidence"]["memtest"]["method"], "host read-back", "{m}");
    let g = p.finding("probe.gemm", gpu);
    assert_eq!(
        (g["severity"].as_str(), g["evidence"]["gemm"]["checked_on"].as_str()),
        (Some("pass"), Some("host")),
        "{g}"
    );
    assert_eq!(p.severity("probe.h2d-bandwidth", gpu), "pass");
}

/// NVML's volatile corrected-ECC count rises while the memory test runs (the scenario's GPU
/// corrects errors under load): every word read back right, yet the memory finding warns with
/// the counts before and after.
#[test]
fn ecc_errors_corrected_during_the_memory_test_are_a_warning_without_a_mismatch() {
    let r = Run::new("h200-single", "h200-vm-ecc-rising", "cuda-h200");
    let p = r.run(&[]);
    let f = p.finding("probe.memory-integrity", "0000:09:00.0");
    assert_eq!(f["severity"], "warn", "{f}");
    assert_eq!(f["evidence"]["memtest"]["mismatches"], 0, "{f}");
    assert!(
        f["summary"].as_str().unwrap().contains("NVML counted 2 corrected ECC error(s) while the memory test ran"),
        "{f}"
    );
    let (before, after) = (&f["evidence"]["counters_before"], &f["evidence"]["counters_after"]);
    assert_eq!(
        after["ecc_volatile"]["corrected"].as_u64().unwrap() - before["ecc_volatile"]["corrected"].as_u64().unwrap(),
        2,
        "{f}"
    );
}

/// SMs that reach HBM slower than the copy engines do: the SM copy fails on its own, the copy
/// engines' device copy passes.
#[test]
fn a_slow_sm_copy_fails_beside_a_passing_copy_engine() {
    let r = Run::new("h200-single", "h200-vm", "cuda-h200-slow-sm-copy");
    let p = r.run(&[]);
    let gpu = "0000:09:00.0";
    assert_eq!(p.severity("probe.d2d-bandwidth", gpu), "pass");
    let sm = p.finding("probe.sm-copy-bandwidth", gpu);
    assert_eq!(sm["severity"], "fail", "{sm}");
    assert!(sm["summary"].as_str().unwrap().contains("SM copy 1800.0 GB/s"), "{sm}");
}

/// NCCL's all-reduce over the 8-GPU HGX with Azure's 16 GiB messages (`--allreduce-size 16G`;
/// the quick level runs none of its own): as NCCL chooses, NVLink SHARP at the scenario's 480
/// GB/s bus bandwidth, above Azure's ND H100 v5 floor of 460; with NVLS off the rings at the
/// links' 375. Every word of every GPU's result is the sum, checked on the GPU.
#[test]
fn the_all_reduce_over_the_hgx_passes_at_the_nvls_rate_and_shows_the_rings_with_nvls_off() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu");
    let p = r.run(&["--allreduce-size", "16G"]);
    assert_eq!(p.code, 0, "{}", p.stderr);
    let f = p.machine_finding("probe.allreduce");
    assert_eq!(f["severity"], "pass", "{f}");
    assert_eq!(f["summary"], "all-reduce over 8 GPUs: 480.0 GB/s bus bandwidth; with NVLS off 375.0 (floor 460)");
    let a = &f["evidence"]["allreduce"];
    assert_eq!(a["gpus"].as_array().unwrap().len(), 8);
    let nccl = &a["nccl"]["ok"];
    assert!((nccl["busbw_gbps"]["median"].as_f64().unwrap() - 480.0).abs() < 0.01, "{a}");
    // nccl-tests' relation: algorithm bandwidth × 2(n−1)/n is the bus bandwidth.
    assert!((nccl["algbw_gbps"].as_f64().unwrap() * 1.75 - 480.0).abs() < 0.01, "{a}");
    assert_eq!(nccl["bytes"], 16u64 << 30);
    assert_eq!(nccl["checked_words"], 8 * (16u64 << 30) / 8);
    assert_eq!(nccl["wrong_words"], 0);
    assert!((a["nvls_off"]["ok"]["busbw_gbps"]["median"].as_f64().unwrap() - 375.0).abs() < 0.01, "{a}");
    // Without the option the quick level runs no all-reduce (the same command as the tensor-core
    // test's, run once for both).
    let q = &hgx_gpus_0_and_1().probed;
    assert!(q.report["probes"].get("allreduce").is_none(), "{:#}", q.report["probes"]);
}

/// One degraded NVLink path (GPU 2 → 6 at 120 of 375 GB/s) slows every algorithm: NVLS's share
/// through that GPU and the rings through that pair. The all-reduce fails its floor and says
/// that NVLS is in use and still short, pointing at the link.
#[test]
fn a_slow_link_fails_the_all_reduce_under_nvls_and_the_rings() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu-slow-pair");
    let p = r.run(&["--allreduce-size", "16G"]);
    let f = p.failed_allreduce();
    assert_eq!(
        f["summary"],
        "all-reduce over 8 GPUs: 153.6 GB/s bus bandwidth; with NVLS off 120.0, below the floor of 460 GB/s"
    );
    assert!(f["detail"].as_str().unwrap().contains("NVLS is in use and still short"), "{f}");
}

/// GPUs 2 and 6, joined by NVLink, have no peer access to each other. NCCL refuses to start on
/// that ("P2P is disabled between NVLINK connected GPUs": ncclUnhandledCudaError), and the
/// finding names the pair. With NCCL_IGNORE_DISABLED_P2P=1 NCCL's SHM transport carries the pair
/// through host memory instead: no hang, but the whole all-reduce at the host-staged rate, far
/// below the floor, the pair and the setting named.
#[test]
fn a_pair_without_peer_access_stops_nccls_start_or_goes_through_host_memory() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu-no-peer-pair");
    let p = r.run(&["--allreduce-size", "1G"]);
    let f = p.failed_allreduce();
    assert!(f["summary"].as_str().unwrap().contains("failed: ncclCommInitAll"), "{f}");
    assert!(f["summary"].as_str().unwrap().contains("ncclUnhandledCudaError"), "{f}");
    let detail = f["detail"].as_str().unwrap();
    assert!(detail.contains("GPUs 2↔6 have no peer access") && detail.contains("NVLINK connected"), "{f}");
    assert!(p.stderr.contains("P2P is disabled between NVLINK connected GPUs"), "{}", p.stderr);

    let out = r.command(&["--allreduce-size", "16G"]).env("NCCL_IGNORE_DISABLED_P2P", "1").output().unwrap();
    let p = Probed::of(out);
    let f = p.failed_allreduce();
    // The pair's staged rate is 55 GB/s (each GPU's device↔host rate): NVLS 480 × 55 / 375.
    assert_eq!(
        f["summary"],
        "all-reduce over 8 GPUs: 70.4 GB/s bus bandwidth; with NVLS off 55.0, below the floor of 460 GB/s"
    );
    let detail = f["detail"].as_str().unwrap();
    assert!(detail.contains("GPUs 2↔6 have no peer access"), "{f}");
    assert!(detail.contains("NCCL_IGNORE_DISABLED_P2P=1 (environment)"), "{f}");
}

/// GPUs 2 and 6 report peer access, but their P2P writes never land: NCCL's rings through that
/// pair never complete and `ncclAllReduce` never returns. The all-reduce's process is killed at
/// its deadline (twice its planned transfers plus `nccl_allowance`), the finding names the step it
/// blocked in, the NVLS-off run is not attempted, and no process is left behind.
#[test]
fn lost_p2p_writes_hang_nccl_and_the_deadline_reports_it() {
    let r = Run::configured(
        "hgx-8gpu-healthy",
        "hgx-8gpu-healthy",
        "cuda-hgx-8gpu-p2p-lost",
        "[probes]\nnccl_allowance = \"3s\"\n",
    );
    let started = Instant::now();
    // The lost pair and one GPU more, whose copies must pass (nvidia-smi's numbers: the scenario
    // lists its GPUs in PCI order).
    let p = r.run(&["--allreduce-size", "1G", "--gpu", "1", "--gpu", "2", "--gpu", "6"]);
    eprintln!("probe took {:?}", started.elapsed());
    let f = p.failed_allreduce();
    let summary = f["summary"].as_str().unwrap();
    assert!(summary.starts_with("NCCL's all-reduce over 3 GPUs did not finish within its"), "{f}");
    assert!(summary.contains("blocked at: 5 warm-up all-reduces of 1073741824 bytes"), "{f}");
    assert!(f["detail"].as_str().unwrap().contains("dropping peer writes"), "{f}");
    let a = &f["evidence"]["allreduce"];
    assert!(a["nccl"]["error"]["Hung"]["deadline_s"].as_u64().unwrap() >= 3, "{a}");
    assert!(a["nvls_off"].is_null(), "{a}");
    assert!(
        p.stderr.contains("fake-nccl: a ring runs from GPU 2 to GPU 6, whose P2P writes never land"),
        "{}",
        p.stderr
    );
    assert!(allreduce_children(&r).is_empty(), "{:?}", allreduce_children(&r));
    // The peer copies over that pair run at their rate and deliver nothing: their data check
    // says so, for the pair's two GPUs only.
    let copies: Vec<&Value> = p.report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["id"] == "probe.p2p-bandwidth" && f["severity"] == "fail")
        .collect();
    assert_eq!(copies.len(), 2, "{copies:#?}");
    for f in copies {
        assert!(f["summary"].as_str().unwrap().contains("the copies' data did not arrive"), "{f}");
    }
}

/// The all-reduce processes started by this test's runs (their environment names its directory).
fn allreduce_children(r: &Run) -> Vec<String> {
    let ours = r.dir.path().to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let text =
                |f: &str| std::fs::read(e.path().join(f)).map(|c| String::from_utf8_lossy(&c).replace('\0', " "));
            Some((text("cmdline").ok()?, text("environ").ok()?))
        })
        .filter(|(cmd, env)| cmd.contains("allreduce-child") && env.contains(&ours))
        .map(|(cmd, _)| cmd)
        .collect()
}

/// A probe killed while its all-reduce child hangs takes the child with it (PR_SET_PDEATHSIG):
/// no NCCL process is left holding the GPUs.
#[test]
fn killing_the_probe_ends_its_all_reduce_child() {
    let r = Run::configured(
        "hgx-8gpu-healthy",
        "hgx-8gpu-healthy",
        "cuda-hgx-8gpu-p2p-lost",
        "[probes]\nnccl_allowance = \"600s\"\n",
    );
    // Nothing reads its output here: none is kept, so a full pipe cannot stop it.
    // The lost pair alone (nvidia-smi's GPUs 2 and 6: the scenario lists its GPUs in PCI order).
    let mut probe = r
        .command(&["--allreduce-size", "1G", "--gpu", "2", "--gpu", "6"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The probes before the all-reduce take minutes on a loaded 2-core machine: a bound on the
    // wait, not a timing assertion.
    let until = Instant::now() + Duration::from_secs(900);
    while allreduce_children(&r).is_empty() {
        assert!(probe.try_wait().unwrap().is_none(), "the probe ended before its all-reduce child started");
        assert!(Instant::now() < until, "no all-reduce child started");
        std::thread::sleep(Duration::from_millis(50));
    }
    probe.kill().unwrap();
    probe.wait().unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while !allreduce_children(&r).is_empty() {
        assert!(Instant::now() < until, "left behind: {:?}", allreduce_children(&r));
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// NCCL prints its debug lines on stdout (NCCL_DEBUG=VERSION: its version line). They reach the
/// person running the probe, on stderr, instead of vanishing into the child's protocol pipe; the
/// run is judged as before and records the setting.
#[test]
fn nccl_debug_output_reaches_stderr_and_the_setting_is_recorded() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu");
    // Three GPUs are enough for NCCL's output, and cheaper than eight.
    let out = r
        .command(&["--allreduce-size", "1G", "--gpu", "0", "--gpu", "1", "--gpu", "2"])
        .env("NCCL_DEBUG", "VERSION")
        .output()
        .unwrap();
    let p = Probed::of(out);
    assert_eq!(p.code, 0, "{}", p.stderr);
    assert!(p.stderr.contains("NCCL version 2.27.3+cuda12.9"), "{}", p.stderr);
    let f = p.machine_finding("probe.allreduce");
    assert_eq!(f["severity"], "pass", "{f}");
    let settings = &f["evidence"]["allreduce"]["nccl"]["ok"]["settings"];
    assert!(
        settings.as_array().unwrap().iter().any(|s| s["name"] == "NCCL_DEBUG" && s["value"] == "VERSION"),
        "{settings}"
    );
    assert_eq!(f["evidence"]["allreduce"]["nccl"]["ok"]["multicast"], true, "{f}");
}

/// Without NCCL (no libnccl.so.2 where the loader looks) the all-reduce is unknown and says how
/// to get it; the rest of the run stands.
#[test]
fn without_nccl_the_all_reduce_is_unknown_and_says_how_to_install_it() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu");
    let p = Probed::of(
        r.command(&["--gpu", "0", "--gpu", "1", "--allreduce-size", "64M"])
            .env("PHQ_NCCL_LIB", r.dir.path().join("no-libnccl.so.2"))
            .output()
            .unwrap(),
    );
    assert_eq!(p.code, 3, "{}", p.stderr);
    let f = p.machine_finding("probe.allreduce");
    assert_eq!(f["severity"], "unknown", "{f}");
    let s = f["summary"].as_str().unwrap();
    assert!(s.contains("no-libnccl.so.2") && s.contains("phq-agent install"), "{f}");
    assert_eq!(p.severity("probe.gemm", PCI[0]), "pass");
}

/// A toolkit built for a newer CUDA than the driver supports (`cuda-hgx-8gpu-toolkit-too-new`:
/// driver CUDA 12.8, cuBLAS 12.9.1 and NCCL carrying a 12.9 runtime). cuBLAS loads and its
/// `cublasCreate` answers CUBLAS_STATUS_NOT_INITIALIZED: the GEMMs run on the agent's own kernels
/// and pass, and `probe.cublas` says why with both versions, for the tenant to fix — never a GEMM
/// failure telling them to restart a healthy VM. NCCL's communicators do not start with every
/// pair reachable: `probe.nccl-start` says so with NCCL's and the driver's versions, and the
/// all-reduce is unknown, not a fault of the links.
#[test]
fn a_toolkit_newer_than_the_driver_falls_back_to_the_agents_kernels_and_says_why() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu-toolkit-too-new");
    let p = r.run(&["--gpu", "0", "--gpu", "1", "--allreduce-size", "64M"]);
    for gpu in &PCI[..2] {
        let f = p.finding("probe.gemm", gpu);
        assert_eq!(f["severity"], "pass", "{f}");
        assert_eq!(f["evidence"]["gemm"]["library"], "PTX fallback (phq_sgemm)", "{f}");
        let t = p.finding("probe.gemm-tensor", gpu);
        assert_eq!(t["severity"], "pass", "{t}");
        assert_eq!(t["evidence"]["gemm"]["library"], "PTX tensor cores, BF16 (phq_mma_gemm)", "{t}");
        assert_eq!(p.severity("probe.gemm-tensor-fp16", gpu), "pass");
    }
    let c = p.machine_finding("probe.cublas");
    assert_eq!(c["severity"], "warn", "{c}");
    let why = c["detail"].as_str().unwrap();
    assert!(why.contains("cuBLAS 12.9.1") && why.contains("CUBLAS_STATUS_NOT_INITIALIZED"), "{c}");
    assert!(why.contains("the driver supports CUDA 12.8"), "{c}");
    assert_eq!(c["action"], "fix_guest_software", "{c}");
    assert_eq!(c["owner"], "tenant", "{c}");

    let n = p.machine_finding("probe.nccl-start");
    assert_eq!(n["severity"], "warn", "{n}");
    let summary = n["summary"].as_str().unwrap();
    assert!(summary.contains("NCCL 2.27.3") && summary.contains("ncclCommInitAll: ncclUnhandledCudaError"), "{n}");
    let detail = n["detail"].as_str().unwrap();
    assert!(detail.contains("The driver supports CUDA 12.8"), "{n}");
    // NCCL's own reason, read back with ncclGetLastError.
    assert!(detail.contains("NCCL's last warning: \"Cuda failure 'CUDA driver version is insufficient"), "{n}");
    assert_eq!(n["owner"], "tenant", "{n}");
    assert_eq!(p.machine_finding("probe.allreduce")["severity"], "unknown");
    assert!(p.stderr.contains("NCCL WARN Cuda failure"), "{}", p.stderr);
    // Warnings only: the tenant's move, nothing failed.
    assert_eq!(p.code, 1, "{}", p.stderr);
}

/// A bridged H100 NVL pair is held to the bridge's floor (223 GB/s: the NVSwitch floor for its 12
/// of 18 links), not the SXM board's 335: the 257 GB/s healthy pairs copy at passes, a pair at
/// the share of 8 links fails.
#[test]
fn a_bridged_h100_nvl_pair_is_held_to_the_bridges_floor() {
    let r = Run::new("h100-nvl-pair", "h100-nvl-pair", "cuda-h100-nvl-pair");
    let p = r.run(&[]);
    for gpu in ["0000:09:00.0", "0000:0a:00.0"] {
        let f = p.finding("probe.p2p-bandwidth", gpu);
        assert_eq!(f["severity"], "pass", "{f}");
    }
    assert!(p.peers().iter().all(|l| l["scope"] == "nvlink"), "{:?}", p.peers());
    let r = Run::new("h100-nvl-pair", "h100-nvl-pair", "cuda-h100-nvl-pair-slow");
    let p = r.run(&[]);
    let f = p.finding("probe.p2p-bandwidth", "0000:09:00.0");
    assert_eq!(f["severity"], "fail", "{f}");
    assert!(f["summary"].as_str().unwrap().contains("below the floor of 223 GB/s"), "{f}");
}

/// Issue 51 hole 3: a job that starts on the GPU after the snapshot found it idle (the fake
/// NVML lists it from the second look on, `from_query`). Alone, the slow SM copy of this H200
/// fails as hardware; beside the job the same figure is `unknown`, names the job's pid, routes
/// to no one, and sets no baseline. A pass stays a pass.
#[test]
fn a_job_that_starts_during_the_probe_makes_a_shortfall_unknown_not_hardware() {
    let pci = "0000:09:00.0";
    let alone = Run::new("h200-single", "h200-vm", "cuda-h200-slow-sm-copy").run(&[]);
    assert_eq!(alone.severity("probe.sm-copy-bandwidth", pci), "fail", "{}", alone.stderr);

    let r = Run::new("h200-single", "h200-vm", "cuda-h200-slow-sm-copy");
    let mut sc: Value = serde_json::from_str(&std::fs::read_to_string(scenario("h200-vm")).unwrap()).unwrap();
    sc["devices"][0]["processes"] = serde_json::json!([{"pid": 4190001, "used_bytes": 8u64 << 30, "from_query": 2}]);
    let path = r.dir.path().join("nvml.json");
    std::fs::write(&path, serde_json::to_vec(&sc).unwrap()).unwrap();
    let shared = Probed::of(r.command(&[]).env("PHQ_FAKE_NVML_SCENARIO", &path).output().unwrap());
    assert!(shared.probed_gpus().contains(&pci.to_string()), "the snapshot found it idle: it is probed");
    let f = shared.finding("probe.sm-copy-bandwidth", pci);
    assert_eq!(f["severity"], "unknown", "{f:#}");
    assert!(f["summary"].as_str().unwrap().contains("pid 4190001"), "{f:#}");
    assert_eq!((f["action"].as_str(), f["owner"].as_str()), (Some("none"), Some("none")));
    assert_eq!(shared.report["probes"]["gpus"][0]["contended_by"][0]["pid"], 4190001);
    assert_eq!(shared.severity("probe.h2d-bandwidth", pci), "pass", "a figure that met its floor stays a pass");
    assert_ne!(shared.report["verdict"]["owner"], "platform", "{:#}", shared.report["verdict"]);
    let baseline = r.dir.path().join("state/probe-baseline.json");
    assert!(
        !baseline.exists() || !std::fs::read_to_string(&baseline).unwrap().contains(pci),
        "a shared run set the baseline"
    );
}

/// Issue 51: the all-reduce's child is started from the running image, not the program's path.
/// The copy of the binary that runs the probe is removed as soon as it has started (as a
/// package upgrade replaces /usr/bin/phq-agent under a running probe); the all-reduce, which
/// starts its child seconds later, still runs and passes. From `current_exe()` it failed:
/// "cannot start the probe process: No such file or directory".
#[test]
fn a_binary_replaced_during_the_run_still_starts_the_all_reduce() {
    let r = Run::new("hgx-8gpu-healthy", "hgx-8gpu-healthy", "cuda-hgx-8gpu");
    let copy = r.dir.path().join("phq-agent-old");
    std::fs::copy(env!("CARGO_BIN_EXE_phq-agent"), &copy).unwrap();
    let child = r.command_of(&copy, &["--allreduce-size", "1G", "--gpu", "0", "--gpu", "1"]).spawn().unwrap();
    // execve(2) has read the file once the child's /proc/PID/exe names it.
    let exe = std::path::PathBuf::from(format!("/proc/{}/exe", child.id()));
    let until = Instant::now() + Duration::from_secs(10);
    while std::fs::read_link(&exe).map(|l| l != copy).unwrap_or(true) {
        assert!(Instant::now() < until, "the copy never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::fs::remove_file(&copy).unwrap();
    let p = Probed::of(child.wait_with_output().unwrap());
    let f = p.machine_finding("probe.allreduce");
    assert_eq!(f["severity"], "pass", "{f:#}");
}
