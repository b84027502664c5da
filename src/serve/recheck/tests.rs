use super::*;
use crate::checks::testutil::healthy;
use crate::checks::Finding;
use crate::snapshot::{Nv, NvmlStatus, ProcessInfo};

fn desk(max: u32) -> (Arc<Desk>, mpsc::UnboundedReceiver<Ask>) {
    Desk::new(Limit { max, window: Duration::from_secs(3600) })
}

fn idle() -> Arc<Snapshot> {
    let s = healthy();
    assert!(busy_gpus(&s).is_empty(), "the healthy snapshot is idle: {:?}", busy_gpus(&s));
    Arc::new(s)
}

fn finish(d: &Desk, run: &ProbeRun) {
    d.started(&run.id);
    d.finished(&run.id, Ok(&[Finding::pass("probe.gemm", "ok")])).expect("the current run");
}

#[test]
fn a_request_is_queued_for_the_probe_task_and_its_record_follows_the_run() {
    let (d, mut asks) = desk(6);
    let run = d.request(ProbeLevel::Full, idle(), AskedBy::Tenant).expect("accepted");
    assert_eq!((run.state, run.source, run.level), (State::Queued, Source::Request, ProbeLevel::Full));
    assert_eq!(run.id.len(), 16);
    let ask = asks.try_recv().expect("the probe task is asked");
    assert_eq!((ask.id.as_str(), ask.level), (run.id.as_str(), ProbeLevel::Full));

    d.started(&run.id);
    assert_eq!(d.run(&run.id).map(|r| r.state), Some(State::Running));
    let fail = Finding::fail("probe.gemm", "wrong results");
    let done = d.finished(&run.id, Ok(&[fail, Finding::pass("probe.h2d", "ok")])).expect("current");
    assert_eq!((done.state, done.findings, done.failed), (State::Done, Some(2), Some(1)));
    assert!(done.finished_at.is_some() && done.started_at.is_some());
    assert_eq!(d.run(&run.id), Some(done), "kept after it ended");
    assert!(d.finished(&run.id, Ok(&[])).is_none(), "a run ends once");
}

#[test]
fn one_run_at_a_time_whoever_asked() {
    let (d, _asks) = desk(6);
    let boot = d.begin(ProbeLevel::Quick, Source::Boot, idle()).expect("the boot run");
    match d.request(ProbeLevel::Quick, idle(), AskedBy::Tenant) {
        Err(Refused::Running(r)) => assert_eq!(r.id, boot.id),
        other => panic!("a request during the boot run: {other:?}"),
    }
    assert!(d.begin(ProbeLevel::Quick, Source::Idle, idle()).is_none(), "nor an idle run");
    finish(&d, &boot);
    assert!(d.request(ProbeLevel::Quick, idle(), AskedBy::Tenant).is_ok(), "free again once it ended");
}

#[test]
fn a_busy_or_unknown_gpu_refuses_a_request_and_names_the_gpu() {
    let (d, mut asks) = desk(6);
    let mut s = healthy();
    if let NvmlStatus::Ok(n) = &mut s.nvml {
        n.devices[2].processes = Nv::Value(vec![ProcessInfo { pid: 4242, used_bytes: Some(1 << 30) }]);
        n.devices[5].utilization = Nv::NotSupported;
    }
    match d.request(ProbeLevel::Quick, Arc::new(s), AskedBy::Tenant) {
        Err(Refused::Busy(why)) => {
            assert_eq!(why.len(), 2, "{why:?}");
            assert!(why[0].contains("1 compute process"), "{why:?}");
            assert!(why[1].contains("utilisation is unknown"), "{why:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(asks.try_recv().is_err(), "nothing was queued");
    let mut no_nvml = healthy();
    no_nvml.nvml = NvmlStatus::NotRead("a sysroot".into());
    assert!(
        matches!(d.request(ProbeLevel::Quick, Arc::new(no_nvml), AskedBy::Tenant), Err(Refused::Busy(_))),
        "unknown is busy"
    );
}

#[test]
fn requests_past_the_limit_wait_for_the_window_and_service_runs_do_not_count() {
    let (d, _asks) = desk(2);
    for _ in 0..2 {
        let run = d.request(ProbeLevel::Quick, idle(), AskedBy::Tenant).expect("within the limit");
        finish(&d, &run);
    }
    let boot = d.begin(ProbeLevel::Quick, Source::Boot, idle()).expect("the service's own run is not limited");
    finish(&d, &boot);
    match d.request(ProbeLevel::Quick, idle(), AskedBy::Tenant) {
        Err(Refused::Limited(wait)) => assert!(wait > Duration::from_secs(3500) && wait <= Duration::from_secs(3600)),
        other => panic!("the third within the hour: {other:?}"),
    }
    d.set_limit(Limit { max: 0, window: Duration::from_secs(3600) });
    assert_eq!(d.request(ProbeLevel::Quick, idle(), AskedBy::Tenant), Err(Refused::Off));
    d.set_limit(Limit { max: 3, window: Duration::from_secs(3600) });
    assert!(d.request(ProbeLevel::Quick, idle(), AskedBy::Tenant).is_ok(), "a raised limit applies at once");
}

#[test]
fn a_run_that_could_not_start_is_kept_as_failed_with_why() {
    let (d, _asks) = desk(6);
    let run = d.request(ProbeLevel::Quick, idle(), AskedBy::Tenant).unwrap();
    let failed = d.finished(&run.id, Err("the probe lock is held by pid 77")).unwrap();
    assert_eq!((failed.state, failed.error.as_deref()), (State::Failed, Some("the probe lock is held by pid 77")));
    assert_eq!(failed.findings, None);
}

#[test]
fn only_the_last_runs_are_kept() {
    let (d, _asks) = desk(u32::MAX);
    let first = d.begin(ProbeLevel::Quick, Source::Idle, idle()).unwrap();
    finish(&d, &first);
    for _ in 0..KEPT_RUNS {
        let r = d.begin(ProbeLevel::Quick, Source::Idle, idle()).unwrap();
        finish(&d, &r);
    }
    assert!(d.run(&first.id).is_none());
    assert!(d.run("0123456789abcdef").is_none());
}

#[test]
fn a_stopped_probe_task_refuses_requests() {
    let (d, asks) = desk(6);
    drop(asks);
    assert_eq!(d.request(ProbeLevel::Quick, idle(), AskedBy::Tenant), Err(Refused::Stopping));
    assert!(d.begin(ProbeLevel::Quick, Source::Boot, idle()).is_none());
    assert!(d.request(ProbeLevel::Quick, idle(), AskedBy::Tenant).is_err(), "and nothing is left marked as running");
}
