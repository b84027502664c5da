//! The service keeps one NVML session and one bus connection: `nvmlInit` attaches every GPU,
//! which costs seconds on a real 8-GPU guest, so paying it every 30 s is paying it all day; a
//! bus connection is a handshake and a new name each time. The service's own snapshot function
//! runs 100 times over the fake library, which counts its inits, and a private bus, whose
//! unique names count connections. (A file of its own: it sets the scenario and the bus in this
//! process's environment, which no other test shares.)

mod common;

use common::*;
use phq_agent::collect::{nvml::Session, NvmlSource};
use phq_agent::serve::{take_snapshot, Inputs};
use std::sync::Arc;

/// The fake library's count of `nvmlInit_v2` calls in this process.
fn init_count(lib: &std::path::Path) -> u64 {
    let path = std::ffi::CString::new(lib.to_str().unwrap()).unwrap();
    let name = std::ffi::CString::new("phqFakeNvmlInitCount").unwrap();
    // SAFETY: dlopen of the library the snapshots already loaded (the same handle, reference
    // counted); the symbol is the fake's `extern "C" fn() -> u64`.
    unsafe {
        let handle = libc::dlopen(path.as_ptr(), libc::RTLD_NOW);
        assert!(!handle.is_null(), "dlopen {}", lib.display());
        let sym = libc::dlsym(handle, name.as_ptr());
        assert!(!sym.is_null(), "the fake NVML exports phqFakeNvmlInitCount");
        let f: extern "C" fn() -> u64 = std::mem::transmute(sym);
        let n = f();
        libc::dlclose(handle);
        n
    }
}

/// The serial of a new connection's unique name on the bus (`:1.N`): each connection gets the
/// next N, so the difference between two is how many connected in between.
fn next_connection_serial(address: &str) -> u64 {
    let c = zbus::blocking::connection::Builder::address(address).unwrap().build().unwrap();
    let name = c.unique_name().unwrap().to_string();
    name.rsplit('.').next().unwrap().parse().unwrap()
}

#[test]
fn a_hundred_service_snapshots_initialise_nvml_once_and_connect_to_the_bus_once() {
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    std::env::set_var("DBUS_SYSTEM_BUS_ADDRESS", &bus.address);
    let lib = fake_nvml().to_path_buf();
    // This test is alone in its process (its own file), so setting the environment races nothing.
    std::env::set_var("PHQ_FAKE_NVML_SCENARIO", repo().join("examples/scenarios/hgx-8gpu-healthy.json"));
    let state = tempfile::tempdir().unwrap();
    let mut config = phq_agent::config::Config::default();
    config.agent.state_dir = state.path().to_path_buf();
    let inputs = Inputs {
        sysroot: repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy"),
        nvml: NvmlSource::Session(Arc::new(Session::new(lib.to_str().unwrap(), Default::default()))),
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
    let before = init_count(&lib);
    let serial_before = next_connection_serial(&bus.address);
    // A hundred, not a thousand: each snapshot waits out GPM's 100 ms between its two samples
    // (collect::nvml::GPM_INTERVAL), so a thousand was 100 s of sleep proving what 100 prove.
    for seq in 1..=100 {
        let (p, report) = take_snapshot(&inputs, seq);
        assert_eq!(report.gpus.len(), 8);
        assert!(report.gpus.iter().all(|g| g.uuid.is_some()), "NVML answered snapshot {seq}");
        assert!(p.snapshot.units.value().is_some_and(|u| u.len() == 2), "systemd answered snapshot {seq}");
    }
    let inits = init_count(&lib) - before;
    let connections = next_connection_serial(&bus.address) - serial_before - 1;
    eprintln!("100 snapshots: {inits} nvmlInit_v2 call(s), {connections} bus connection(s)");
    assert_eq!((inits, connections), (1, 1));

    // What the service did before: a reading of its own per snapshot, an init each.
    let before = init_count(&lib);
    for _ in 0..10 {
        let _ = phq_agent::collect::nvml::read(lib.to_str().unwrap(), Default::default());
    }
    assert_eq!(init_count(&lib) - before, 10);
}
