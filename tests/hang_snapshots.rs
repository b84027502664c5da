//! One GPU's memory query blocks forever (a GPU whose GSP stopped answering): the service's own
//! snapshot function, run 100 times over the fake NVML, reports the other seven GPUs every
//! time, says which call on which GPU is blocked and since when, and leaves one stuck worker
//! thread, not one per snapshot. (A file of its own: it sets the scenario in this process's
//! environment and counts this process's threads, which no other test may share.)

mod common;

use common::*;
use phq_agent::collect::nvml::{Deadlines, Session};
use phq_agent::collect::{deadline, NvmlSource};
use phq_agent::serve::{take_snapshot, Inputs};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Threads of this process (/proc/self/task).
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// The thread count once finished workers have exited (a worker that answered ends at once,
/// but the kernel may list it for a moment after): the least seen within `settle`.
fn settled_threads(settle: Duration) -> usize {
    let until = Instant::now() + settle;
    let mut least = threads();
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
        least = least.min(threads());
    }
    least
}

#[test]
fn one_gpu_blocked_forever_leaves_seven_reported_and_one_stuck_worker_after_100_snapshots() {
    let lib = fake_nvml().to_path_buf();
    // This test is alone in its process (its own file), so setting the environment races nothing.
    std::env::set_var("PHQ_FAKE_NVML_SCENARIO", repo().join("examples/scenarios/hgx-8gpu-memory-query-hangs.json"));
    let state = tempfile::tempdir().unwrap();
    let mut config = phq_agent::config::Config::default();
    config.agent.state_dir = state.path().to_path_buf();
    // Long enough that a healthy GPU never misses it on a loaded machine; GPU 3 costs it once.
    let deadlines = Deadlines { gpu: Duration::from_secs(2), ..Deadlines::default() };
    let inputs = Inputs {
        sysroot: repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy"),
        nvml: NvmlSource::Session(Arc::new(Session::new(lib.to_str().unwrap(), deadlines))),
        config,
        token: None,
        control_token: None,
        started_at: phq_agent::snapshot::Timestamp::now(),
        probes: None,
        push: Default::default(),
        events: Default::default(),
        spool: None,
        nvml_budget: None,
        history: None,
        vsock_ca: None,
    };
    let before = settled_threads(Duration::from_millis(200));
    let mut first_since = None;
    for seq in 1..=100 {
        let (p, report) = take_snapshot(&inputs, seq);
        let nvml = p.snapshot.nvml().expect("NVML answered the session's other calls");
        assert_eq!(nvml.devices.len(), 8, "snapshot {seq}");
        let (blocked, answered): (Vec<_>, Vec<_>) = nvml.devices.iter().partition(|g| g.index == 3);
        assert!(answered.iter().all(|g| g.memory.value().is_some() && g.uuid.value().is_some()), "snapshot {seq}");
        let why = blocked[0].memory.why_not();
        assert!(
            why.contains("nvmlDeviceGetMemoryInfo_v2 (GPU 0000:0c:00.0) has not returned"),
            "snapshot {seq}: {why}"
        );
        assert!(blocked[0].uuid.value().is_none(), "no reading of the blocked GPU is shown as fresh");
        // Named once, with the same start every time: "still blocked since …".
        assert_eq!(p.snapshot.nvml_blocked.len(), 1, "snapshot {seq}");
        let b = &p.snapshot.nvml_blocked[0];
        assert_eq!((b.call.as_str(), b.gpu.as_deref()), ("nvmlDeviceGetMemoryInfo_v2", Some("0000:0c:00.0")));
        assert_eq!(*first_since.get_or_insert(b.since), b.since, "snapshot {seq}");
        let f: Vec<_> = report.findings.iter().filter(|f| f.id == "nvml.responsive").collect();
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].severity, f[0].gpu.as_deref()), (phq_agent::checks::Severity::Fail, Some("0000:0c:00.0")));
        assert_eq!(report.gpus.len(), 8, "every GPU is still in the report, from PCI");
    }
    let after = settled_threads(Duration::from_millis(500));
    let stuck = deadline::abandoned_running();
    eprintln!("100 snapshots with one call blocked: threads {before} → {after}; {stuck} worker(s) stuck");
    assert_eq!(stuck, 1, "one worker stuck, not one per snapshot");
    // The stuck worker, and the one worker a returned call leaves parked (deadline rule 1).
    assert!(after <= before + 2, "threads grew from {before} to {after}");
}
