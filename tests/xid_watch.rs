//! The blocking Xid watcher against the fake NVML: it starts only once the session's NVML has
//! answered (it shares that handle), an Xid scheduled 300 ms after init arrives on the channel,
//! from its own thread, a snapshot taken while it waits reports what it saw without opening an
//! event set of its own (the real library holds `nvmlEventSetCreate` while another thread
//! waits; so does the fake), and dropping the watcher stops that thread. (Its own test
//! binary, since the scenario is named through the process environment.)

mod common;

use phq_agent::collect::nvml::{Deadlines, Session, XidWatcher};
use phq_agent::snapshot::NvmlStatus;
use std::time::Duration;

#[test]
fn xid_arrives_while_watching_and_the_watcher_stops() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("s.json");
    std::fs::write(
        &scenario,
        r#"{"driver_version": "550.90.07", "devices": [
            {"pci": {"bus_id": "00000000:09:00.0", "pci_device_id": "0x233010DE"}},
            {"pci": {"bus_id": "00000000:0C:00.0", "pci_device_id": "0x233010DE"}, "xid_events": [{"xid": 79, "after_ms": 300}, {"xid": 79, "after_ms": 350}]}
        ]}"#,
    )
    .unwrap();
    // SAFETY (of intent): this test binary has one test, so no other thread reads the environment.
    std::env::set_var("PHQ_FAKE_NVML_SCENARIO", &scenario);
    let lib = common::fake_nvml().to_str().unwrap().to_string();
    // A short events deadline: a snapshot that opened a set beside the waiting watcher would
    // pass it (the fake holds that call for the watcher's whole 15 s wait, as the real one does).
    let deadlines = Deadlines { events: Duration::from_secs(2), ..Default::default() };
    let session = Session::new(&lib, deadlines);
    let (tx, rx) = std::sync::mpsc::channel();
    assert!(XidWatcher::start(&session, tx.clone()).is_none(), "no watcher before NVML has answered");
    assert!(session.read(None).blocked.is_empty());
    let watcher = XidWatcher::start(&session, tx).expect("watch the fake NVML");
    let first = rx.recv_timeout(Duration::from_secs(5)).expect("an Xid within 5 s");
    assert_eq!((first.gpu.as_str(), first.xid), ("0000:0c:00.0", 79));
    let second = rx.recv_timeout(Duration::from_secs(5)).expect("the repeat is not lost");
    assert_eq!(second.xid, 79);
    let reading = session.read(None);
    assert!(reading.blocked.is_empty(), "a snapshot beside the waiting watcher was held: {:?}", reading.blocked);
    let NvmlStatus::Ok(info) = reading.status else { panic!("NVML read: {:?}", reading.status) };
    assert_eq!(info.events_error, None);
    let seen: Vec<_> = info.xid_events.iter().map(|x| (x.gpu.as_str(), x.xid)).collect();
    assert_eq!(seen, [("0000:0c:00.0", 79), ("0000:0c:00.0", 79)], "the snapshot carries what the watcher saw");
    drop(watcher);
    // The thread is gone: its sender was dropped with it.
    assert!(rx.recv_timeout(Duration::from_secs(2)).is_err());
}
