//! The service's tasks. Each owns one thing and talks to the others over channels; the rule
//! numbers are those at the top of `serve/mod.rs`.
//!
//! | task | owns | hears | tells |
//! |---|---|---|---|
//! | [`run`] (the coordinator) | signals, configuration, start and stop order | SIGTERM, SIGINT, SIGHUP | everyone, through `Config` and stop channels |
//! | [`snapshotter`] | `Inputs` (with the NVML session), the schedule, the Xid watcher (started once NVML answers) | ticks, "snapshot now" (an Xid, NVML answering after a deadline), probe results, new configuration | the HTTP task (publish), the event task (each report), D-Bus (health), the desk (idle probes) |
//! | [`events`] | the Xid and SXid windows, the spool writer, the install and kernel-log marks | Xids from NVML, SXids from the kernel log, reports, the closing of its oldest window | the pusher (status), the snapshotter ("now"), a fatal Xid's bundle thread (`bug_bundle`) |
//! | `http::serve` | the listener | connections | the desk (`POST /v1/probes`) |
//! | `http::serve` over [`start_vsock`] | the vsock listener (the platform's channel), its own certificate's daily rotation | connections | the desk (`POST /v1/probes`) |
//! | `push::Pusher::run` | the platform connection | spool wake-ups, status | — |
//! | [`dbus`] | the bus connection | health changes | D-Bus signals |
//! | [`probes`] | the probe child process (`probe::child`), killed at its deadline | runs the desk queued (`recheck::Desk`: boot, idle, the platform's requests) | the desk (each run's end), the snapshotter (results) |
//! | [`watchdog`] | systemd's watchdog | the heartbeats of the snapshotter and the event task | systemd |
//! | [`follow_sxids`] (a thread) | the kernel log read as it is written | new kernel log records | the event task (SXids) |

use super::recheck::{self, Desk, Source};
use super::{
    dbus as bus, http, push, EventCounters, Inputs, Published, Seen, Seq, Shared, SpoolWriter, XidWindow, HEARTBEAT,
    INSTALL_EVENT_SENT, LOOP_STALL, SNAPSHOT_INTERVAL,
};
use crate::collect::kmsg::Follower;
use crate::collect::nvml::XidWatcher;
use crate::collect::NvmlSource;
use crate::config::{Config, ProbeLevel};
use crate::report::{Event, Report};
use crate::snapshot::{NvmlXid, Snapshot, SxidEvent, Timestamp};
use anyhow::Context;
use bytes::Bytes;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

/// Where the service runs: the machine it reads and the NVML it loads.
pub struct Machine {
    pub sysroot: PathBuf,
    pub nvml_lib: Option<PathBuf>,
}

/// The configuration in force and the token read with it (rule 4: replaced whole on SIGHUP).
#[derive(Clone)]
struct Settings {
    config: Config,
    token: Option<String>,
    control_token: Option<String>,
}

/// What the snapshotter is asked to do besides its schedule.
enum ToSnapshotter {
    /// A first-of-its-kind Xid: judge the GPUs again now (rule 1).
    Now,
    /// Probes finished: carry their findings into every report from now on.
    Probes(Box<super::ProbeResults>),
}

/// A report the snapshotter published, with its snapshot and its JSON (the very bytes
/// /v1/status serves, pushed as they are), for the event task.
struct Taken {
    report: Arc<Report>,
    snapshot: Arc<Snapshot>,
    json: Bytes,
}

/// When each looping task last turned, for the watchdog (rule 7).
#[derive(Clone)]
struct Heartbeat {
    started: Instant,
    at_ms: Arc<AtomicU64>,
}

impl Heartbeat {
    fn new(started: Instant) -> Heartbeat {
        Heartbeat { started, at_ms: Arc::new(AtomicU64::new(0)) }
    }
    fn beat(&self) {
        self.at_ms.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
    fn age(&self) -> Duration {
        self.started.elapsed().saturating_sub(Duration::from_millis(self.at_ms.load(Ordering::Relaxed)))
    }
}

/// The service, from start to stop; `load` reads the configuration (at start and on SIGHUP).
pub async fn run(load: impl Fn() -> anyhow::Result<Config>, machine: Machine) -> anyhow::Result<i32> {
    // Signals first: systemd may send SIGHUP or SIGTERM as soon as READY=1 is out.
    let mut signals = Signals::watch()?;
    let config = load()?;
    let (token, control_token) = token_of(&config)?;
    let settings = Settings { token, control_token, config };
    let config = &settings.config;
    let state_dir = config.agent.state_dir.clone();

    let spool = open_spool(config)?;
    let counters = Arc::new(EventCounters::default());
    let root = crate::sysroot::Sysroot::new(&machine.sysroot);
    let deadlines = config.nvml.deadlines();
    // Asks to the snapshotter, made first: NVML answering again after a blocked call asks for
    // a snapshot at once (collect::deadline rule 4).
    let (to_snapshotter, snapshotter_rx) = mpsc::unbounded_channel();
    let mut inputs = Inputs {
        sysroot: machine.sysroot.clone(),
        nvml: service_nvml(&machine, &root, deadlines, &to_snapshotter),
        token: settings.token.clone(),
        control_token: settings.control_token.clone(),
        config: config.clone(),
        started_at: Timestamp::now(),
        probes: None,
        push: Default::default(),
        events: counters.clone(),
        spool: spool.clone(),
        // Rule 3: READY=1 by the init deadline at the latest.
        nvml_budget: Some(deadlines.init),
        history: Some(Arc::new(std::sync::Mutex::new(super::open_history(&config.agent.state_dir)))),
        vsock_ca: None,
    };

    // HTTP from the start: /healthz answers while the first snapshot is taken.
    let shared: Shared = Arc::new(RwLock::new(None));
    // Two stops: the loops first (so the last events reach the spool), then the I/O tasks.
    let (stop_loops, _) = watch::channel(false);
    let (stop_io, _) = watch::channel(false);
    // Every probe run goes through the desk, the platform's re-checks (POST /v1/probes) too.
    let (desk, probe_asks) = Desk::new((&config.probes).into());
    let endpoint = http::Endpoint { shared: shared.clone(), desk: desk.clone() };
    let server = start_tcp(config, &endpoint, &stop_io)?;
    let (vsock_server, vsock_ca) = start_vsock(config, &endpoint, &stop_io)?;
    inputs.vsock_ca = vsock_ca.map(|ca| -> super::VsockCaStatus { Arc::new(move || ca.status()) });

    let seq = Arc::new(Mutex::new(Seq::load(&config.agent.state_dir)));
    // Rule 9: SXids from the kernel log, followed from before the first snapshot.
    let (sxid_rx, _follower) = follow_sxids(&root);
    // Rules 1 and 4: a stop during the first snapshot (NVML attaching eight GPUs, a wedged
    // bus) is not kept waiting for it.
    let first = {
        let (inputs, n) = (inputs.clone(), take(&seq));
        tokio::task::spawn_blocking(move || super::memory::after(super::take_snapshot(&inputs, n)))
    };
    let (published, first_report) = tokio::select! {
        taken = first => taken.context("the first snapshot failed")?,
        _ = signals.term.recv() => return Ok(stopped_before_ready("SIGTERM")),
        _ = signals.int.recv() => return Ok(stopped_before_ready("SIGINT")),
    };
    inputs.nvml_budget = None;
    let first =
        Taken { report: first_report, snapshot: published.snapshot.clone(), json: published.report_json.clone() };
    let status = publish(&shared, published);

    // Push: events through the spool, status latest-wins (rules in serve::push).
    let (status_tx, status_rx) = watch::channel::<Option<(u64, Bytes)>>(None);
    let wake = Arc::new(tokio::sync::Notify::new());
    let (pusher, writer) = match &spool {
        None => (None, None),
        Some(spool) => {
            let to = Pushing { agent_id: &first.report.agent.agent_id, state: inputs.push.clone(), wake: wake.clone() };
            let (task, writer) = start_pusher(config, spool, to, status_rx, stop_io.subscribe(), counters.clone())?;
            (Some(task), Some(writer))
        }
    };

    let (health_tx, health_rx) = mpsc::unbounded_channel();
    let margin = crate::probe::child::Limits::from(&config.probes);
    let dbus = dbus(shared.clone(), desk.clone(), health_rx).await;
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&status)]);
    tracing::info!(%status, "ready");
    super::memory::release_startup_pages();

    let (settings_tx, settings_rx) = watch::channel(settings);
    let (taken_tx, taken_rx) = mpsc::unbounded_channel();
    let started = Instant::now();
    let (snap_beat, event_beat) = (Heartbeat::new(started), Heartbeat::new(started));
    let (xid_rx, xid_tx) = forward_xids()?;

    let event_task = tokio::spawn(events(Events {
        last: first.report.clone(),
        settings: settings_rx.clone(),
        seq: seq.clone(),
        writer,
        counters: counters.clone(),
        status: status_tx,
        xids: xid_rx,
        sxids: sxid_rx,
        taken: taken_rx,
        snapshot_now: to_snapshotter.clone(),
        stop: stop_loops.subscribe(),
        heartbeat: event_beat.clone(),
        first_snapshot: first.snapshot.clone(),
        first_json: first.json.clone(),
        last_snapshot: first.snapshot.clone(),
        bundler: super::bug_bundle::Bundler::new(state_dir.clone(), root.is_live()),
    }));
    let probe_task = tokio::spawn(probes(probe_asks, desk.clone(), to_snapshotter.clone(), state_dir.clone(), margin));
    // Rule 1's probes at boot, before workloads start, when asked — and only on idle GPUs, as
    // every run the service starts (issue 51: a job already running would read as lost
    // hardware). Busy GPUs leave the boot run owed until a snapshot finds them idle.
    let at_boot = settings_rx.borrow().config.probes.at_boot;
    let mut boot_owed = false;
    if at_boot != ProbeLevel::None {
        let busy = super::recheck::busy_gpus(&first.snapshot);
        if busy.is_empty() {
            desk.begin(at_boot, Source::Boot, first.snapshot.clone());
        } else {
            tracing::info!(busy = ?busy, "the boot probes wait until every GPU is idle");
            boot_owed = true;
        }
    }
    let snap_task = tokio::spawn(snapshotter(Snapshotter {
        inputs,
        last: first.report,
        seq,
        shared: shared.clone(),
        settings: settings_rx,
        asks: snapshotter_rx,
        taken: taken_tx,
        health: health_tx,
        desk,
        stop: stop_loops.subscribe(),
        heartbeat: snap_beat.clone(),
        boot_owed,
        xids: xid_tx,
        watcher: None,
    }));
    if let Some(every) = sd_notify::watchdog_enabled().filter(|d| !d.is_zero()) {
        tokio::spawn(watchdog(every / 2, vec![("snapshotter", snap_beat), ("events", event_beat)]));
    }

    signals.until_stopped(&load, &settings_tx).await;
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping, sd_notify::NotifyState::Status("stopping")]);
    let _ = stop_loops.send(true);
    let _ = snap_task.await;
    drop(to_snapshotter);
    // The event task closes every Xid window and waits until each event handed over is on disk.
    let _ = event_task.await;
    probe_task.abort();
    drop(dbus);
    let _ = stop_io.send(true);
    for task in [server, vsock_server].into_iter().flatten() {
        let _ = task.await;
    }
    if let Some(p) = pusher {
        let _ = p.await;
    }
    tracing::info!("stopped");
    Ok(0)
}

/// The TCP listener, unless `http.enabled = false`.
fn start_tcp(
    config: &Config,
    endpoint: &http::Endpoint,
    stop: &watch::Sender<bool>,
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    if !config.http.enabled {
        tracing::info!("http.enabled = false: no TCP listener; only the vsock listener and D-Bus answer");
        if super::port::take_passed(super::port::Purpose::Http)?.is_some() {
            tracing::warn!(
                "systemd passed a TCP socket (phq-agent.socket) that this configuration does not serve: systemd \
                 keeps it bound, so connections are taken and never answered; a drop-in with `ListenStream=` and \
                 `ListenStream=127.0.0.1:9440` keeps it off the network (docs/vsock.md)"
            );
        }
        return Ok(None);
    }
    let (listener, on) = super::port::listener(config.http.listen, http::listen)?;
    tracing::info!(listen = %on, "serving /healthz, /v1/status, /metrics");
    let tls = super::tls::acceptor(&config.http)?;
    Ok(Some(tokio::spawn(http::serve(listener, endpoint.clone(), tls, stopped(stop.subscribe())))))
}

/// KubeVirt's CA bundle behind the vsock listener, kept current (`client_ca`).
type VsockCa = Arc<super::client_ca::ReloadingCa>;

/// The vsock listener (`serve::vsock`'s rules): nothing but a line when the machine has no vsock
/// device or the CA bundle is not there yet; an error for a bundle or a port that is wrong.
fn start_vsock(
    config: &Config,
    endpoint: &http::Endpoint,
    stop: &watch::Sender<bool>,
) -> anyhow::Result<(Option<tokio::task::JoinHandle<()>>, Option<VsockCa>)> {
    use super::port::{take_passed, Purpose};
    use super::vsock;
    let v = &config.vsock;
    // Taken first, so that every way out below closes it (systemd keeps its own copy bound).
    let passed = take_passed(Purpose::Vsock)?;
    let closed = if passed.is_some() { "; the socket systemd passed (phq-agent-vsock.socket) is closed" } else { "" };
    if !v.enabled {
        tracing::info!("vsock.enabled = false: no vsock listener{closed}");
        return Ok((None, None));
    }
    // At warn, which the unit logs: the one line a person reads to learn why the platform's
    // channel is not there.
    let no_device = |why: String| {
        tracing::warn!(
            "no vsock device ({why}): serving without the platform's vsock channel; KubeVirt attaches one with \
             spec.domain.devices.autoattachVSOCK: true{closed}"
        );
        Ok((None, None))
    };
    // Rule 1: a device is one with a guest CID. A /dev/vsock this process may not open (a unit
    // without DeviceAllow=/dev/vsock) leaves the answer to bind.
    if let Ok(None) = vsock::local_cid(std::path::Path::new(VSOCK_DEVICE)) {
        return no_device(format!("{VSOCK_DEVICE} has no guest CID"));
    }
    let tls = super::tls::vsock_acceptor(v, &config.agent.state_dir)?;
    let ca = tls.ca.clone();
    // The bundle kept current and the agent's own certificate rotated, once a listener is
    // (or will be) there to need them.
    let keep = |ca: &Option<VsockCa>| {
        if let Some(ca) = ca {
            tokio::spawn(keep_ca_current(ca.clone(), stop.subscribe()));
        }
        if let Some(own) = tls.own.clone() {
            tokio::spawn(rotate_daily(own));
        }
    };
    // `client_ca` rule 3: no bundle yet (no file, none kept from virt-handler). On KubeVirt the
    // port is bound at once: the first handshake asks virt-handler for the bundle, which is the
    // only way it comes in KubeVirt's "local" vsock mode, where the CA server lives only while
    // virt-handler dials (`kubevirt_ca` rule 2). Elsewhere nothing could be let in, so the port
    // is bound when a bundle comes — the file written — without a restart, and a machine the
    // platform does not reach keeps it free. A socket systemd passed is served at once.
    let defer = ca.clone().filter(|c| c.waiting() && super::kubevirt_ca::askable().is_err());
    if let (Some(ca), None) = (defer, &passed) {
        keep(&Some(ca.clone()));
        tracing::warn!(
            "no KubeVirt CA bundle yet ({} is absent or empty, none kept from virt-handler), and {}: vsock port {} is \
             bound when the file is written{closed}",
            v.client_ca.display(),
            super::kubevirt_ca::askable().err().unwrap_or_default(),
            v.port
        );
        let (port, mut stopping, endpoint, stop) = (v.port, stop.subscribe(), endpoint.clone(), stop.clone());
        let waiting = ca.clone();
        return Ok((
            Some(tokio::spawn(async move {
                while waiting.waiting() {
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                        _ = stopping.changed() => return,
                    }
                }
                match super::port::vsock_listener(None, port, vsock::VsockListener::bind) {
                    Ok((listener, on)) => serve_vsock(listener, on, &tls, endpoint, &stop).await,
                    Err(e) => tracing::error!("a CA bundle came, but vsock port {port} cannot be bound: {e:#}"),
                }
            })),
            Some(ca),
        ));
    }
    let (listener, on) = match super::port::vsock_listener(passed, v.port, vsock::VsockListener::bind) {
        Ok(l) => l,
        Err(e) => match e.downcast::<std::io::Error>() {
            Ok(e) if vsock::means_no_device(&e) => return no_device(e.to_string()),
            Ok(e) => anyhow::bail!("cannot listen on vsock port {} (vsock.port): {e}", v.port),
            Err(e) => return Err(e),
        },
    };
    keep(&ca);
    Ok((Some(tokio::spawn(serve_vsock(listener, on, &tls, endpoint.clone(), stop))), ca))
}

/// Serves the endpoint on the vsock listener `on` with `tls`, until `stop`; said in one line.
fn serve_vsock(
    listener: super::vsock::VsockListener,
    on: String,
    tls: &super::tls::VsockTls,
    endpoint: http::Endpoint,
    stop: &watch::Sender<bool>,
) -> impl std::future::Future<Output = ()> {
    tracing::info!(port = listener.port(), listen = %on, tls = %tls.said, "serving /healthz, /v1/status, /metrics over vsock");
    http::serve(listener, endpoint, tls.acceptor.clone(), stopped(stop.subscribe()))
}

/// `client_ca` rule 4: virt-handler asked for the current bundle every minute while it is due,
/// until the service stops.
async fn keep_ca_current(ca: Arc<super::client_ca::ReloadingCa>, mut stop: watch::Receiver<bool>) {
    loop {
        ca.refresh_if_due().await;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(60)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// The live machine's vsock device (vsock(7)); not a sysroot path: this is the running process's.
const VSOCK_DEVICE: &str = "/dev/vsock";

/// `own_cert` rule 2: the agent's own vsock certificate is checked once a day and rotated when due.
async fn rotate_daily(own: Arc<super::own_cert::Rotating>) {
    loop {
        tokio::time::sleep(super::own_cert::CHECK_EVERY).await;
        let own = own.clone();
        match tokio::task::spawn_blocking(move || own.refresh(std::time::SystemTime::now())).await {
            Ok(Ok(said)) if !said.contains("kept") => tracing::info!("vsock: {said}"),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!("vsock: the server certificate could not be rotated: {e:#}"),
            Err(e) => tracing::warn!("vsock: the rotation check stopped: {e}"),
        }
    }
}

/// The signals the coordinator hears (rule 4).
struct Signals {
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn watch() -> anyhow::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("cannot watch SIGTERM")?,
            hup: signal(SignalKind::hangup()).context("cannot watch SIGHUP")?,
            int: signal(SignalKind::interrupt()).context("cannot watch SIGINT")?,
        })
    }

    /// The coordinator's own loop: a new configuration on SIGHUP, until SIGTERM or SIGINT.
    async fn until_stopped(&mut self, load: &impl Fn() -> anyhow::Result<Config>, settings: &watch::Sender<Settings>) {
        loop {
            tokio::select! {
                _ = self.term.recv() => break,
                _ = self.int.recv() => break,
                _ = self.hup.recv() => {
                    let status = reload(load, settings);
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(&status)]);
                }
            }
        }
    }
}

/// The spool events wait in for the platform, when there is a platform to push to; this run's
/// epoch is its part of every Idempotency-Key (rules in serve::push).
fn open_spool(config: &Config) -> anyhow::Result<Option<push::Spool>> {
    if config.platform.url.is_empty() {
        return Ok(None);
    }
    let epoch = push::new_epoch();
    let spool = push::Spool::open(&config.agent.state_dir, &epoch)
        .with_context(|| format!("{}: cannot open the spool", config.agent.state_dir.display()))?;
    Ok(Some(spool))
}

/// One NVML session for the service's life (reopened only when a reading says it is gone); a
/// call that answers after its deadline asks the snapshotter for a snapshot at once.
fn service_nvml(
    machine: &Machine,
    root: &crate::sysroot::Sysroot,
    deadlines: crate::collect::nvml::Deadlines,
    to_snapshotter: &mpsc::UnboundedSender<ToSnapshotter>,
) -> NvmlSource {
    match NvmlSource::choose(machine.nvml_lib.as_deref(), root) {
        NvmlSource::Library(lib) => {
            let session = Arc::new(crate::collect::nvml::Session::new(&lib, deadlines));
            let ask = to_snapshotter.clone();
            session.on_answer(Arc::new(move || {
                tracing::info!("NVML answered a call that had passed its deadline; taking a snapshot now");
                let _ = ask.send(ToSnapshotter::Now);
            }));
            NvmlSource::Session(session)
        }
        other => other,
    }
}

/// What the pusher is started with besides the configuration.
struct Pushing<'a> {
    agent_id: &'a str,
    state: Arc<Mutex<super::agent_checks::PushState>>,
    wake: Arc<tokio::sync::Notify>,
}

/// The pusher (events through the spool, status latest-wins) and the spool writer that hands it
/// events.
fn start_pusher(
    config: &Config,
    spool: &push::Spool,
    to: Pushing<'_>,
    status: watch::Receiver<Option<(u64, Bytes)>>,
    stop: watch::Receiver<bool>,
    counters: Arc<EventCounters>,
) -> anyhow::Result<(tokio::task::JoinHandle<()>, SpoolWriter)> {
    let mut pusher = push::Pusher::new(&config.platform, to.agent_id, spool.clone())?;
    pusher.state = to.state;
    let task = tokio::spawn(pusher.run(status, to.wake.clone(), stop));
    tracing::info!(url = %config.platform.url, spooled = spool.len(), "pushing reports");
    let writer = SpoolWriter::start(spool.clone(), to.wake, counters).context("cannot start the spool writer")?;
    Ok((task, writer))
}

/// Resolves when `stop` turns true (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

fn take(seq: &Mutex<Seq>) -> u64 {
    seq.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// Rule 2: swaps the published snapshot whole; its status line comes back for systemd.
fn publish(shared: &Shared, p: Published) -> String {
    let status = p.summary.clone();
    match shared.write() {
        Ok(mut guard) => *guard = Some(Arc::new(p)),
        Err(poisoned) => *poisoned.into_inner() = Some(Arc::new(p)),
    }
    status
}

/// The read token and the control token (`http.token_file`, `http.control_token_file`).
fn token_of(config: &Config) -> anyhow::Result<(Option<String>, Option<String>)> {
    let read = match super::read_token(&config.http.token_file) {
        Ok(t) => Some(t),
        // Missing: serve /healthz and refuse the rest until a token exists (first-start
        // generation is the package's job). Unsafe (readable by others): refuse to start.
        Err(e) if !config.http.token_file.exists() => {
            tracing::error!(error = %e, "no token: /v1/status and /metrics will answer 503");
            None
        }
        Err(e) => return Err(e),
    };
    // Missing is the default: no token starts work. Unsafe: refuse to start, as above.
    let control = match config.http.control_token_file.exists() {
        true => Some(super::read_token(&config.http.control_token_file)?),
        false => None,
    };
    if control.is_some() && control == read {
        anyhow::bail!(
            "{} and {} hold the same token: the control token must differ from the read token, which a Prometheus sends in clear",
            config.http.control_token_file.display(),
            config.http.token_file.display()
        );
    }
    Ok((read, control))
}

/// Rule 4's SIGHUP: the new configuration and token, or the old ones kept; the status line says which.
fn reload(load: &impl Fn() -> anyhow::Result<Config>, settings: &watch::Sender<Settings>) -> String {
    match load().and_then(|new| token_of(&new).map(|tokens| (new, tokens))) {
        Ok((config, (token, control_token))) => {
            let pending = crate::config::restart_needed(&settings.borrow().config, &config);
            settings.send_replace(Settings { config, token, control_token });
            if pending.is_empty() {
                tracing::info!("configuration reloaded");
                "configuration reloaded".to_string()
            } else {
                let keys = pending.join(", ");
                tracing::warn!(%keys, "configuration reloaded; these keys take effect at the next restart");
                format!("configuration reloaded; restart to apply {keys}")
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "reload refused: keeping the previous configuration");
            format!("reload refused, previous configuration kept: {e}")
        }
    }
}

/// A stop asked for before the first snapshot was ready.
fn stopped_before_ready(signal: &str) -> i32 {
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    tracing::info!("{signal} before the first snapshot was ready; stopping");
    0
}

struct Snapshotter {
    inputs: Inputs,
    last: Arc<Report>,
    seq: Arc<Mutex<Seq>>,
    shared: Shared,
    settings: watch::Receiver<Settings>,
    asks: mpsc::UnboundedReceiver<ToSnapshotter>,
    taken: mpsc::UnboundedSender<Taken>,
    health: mpsc::UnboundedSender<(String, String)>,
    /// Where the idle probes are started (`recheck::Desk`: one run at a time).
    desk: Arc<Desk>,
    stop: watch::Receiver<bool>,
    heartbeat: Heartbeat,
    /// The boot run was asked for but the GPUs were busy: it runs at the first idle snapshot.
    boot_owed: bool,
    /// Where the Xid watcher sends, and the watcher once NVML has answered (it shares the
    /// session's handle, so it cannot start before).
    xids: std::sync::mpsc::Sender<NvmlXid>,
    watcher: Option<XidWatcher>,
}

impl Snapshotter {
    /// Starts the Xid watcher if NVML has answered and none runs yet.
    fn watch_xids(&mut self) {
        if self.watcher.is_some() {
            return;
        }
        if let NvmlSource::Session(session) = &self.inputs.nvml {
            self.watcher = XidWatcher::start(session, self.xids.clone());
            if self.watcher.is_some() {
                tracing::info!("watching NVML for Xid events");
            }
        }
    }

    /// The longest a snapshot may take while the loop still counts as turning (rule 7): every
    /// NVML phase to its deadline, and a margin for the rest.
    fn snapshot_bound(&self) -> Duration {
        let gpus = self.last.gpus.len().max(8) as u32;
        self.inputs.config.nvml.deadlines().worst_case(gpus) + LOOP_STALL
    }
}

/// Rules 1–3: a snapshot every `SNAPSHOT_INTERVAL`, at once when asked, one at a time on the
/// blocking pool; each published whole. Idle probes are started from here, since only a fresh
/// snapshot says whether every GPU is idle.
async fn snapshotter(mut s: Snapshotter) {
    let mut ticker = tokio::time::interval(SNAPSHOT_INTERVAL);
    ticker.tick().await; // the first tick is immediate; the first snapshot is taken already
    let mut last_probe = Instant::now();
    let mut beat = tokio::time::interval(HEARTBEAT);
    beat.tick().await; // immediate, like the ticker's
    s.watch_xids();
    loop {
        s.heartbeat.beat();
        tokio::select! {
            biased;
            _ = stopped(s.stop.clone()) => return,
            Some(ask) = s.asks.recv() => {
                if let ToSnapshotter::Probes(p) = ask {
                    tracing::info!(run = %p.run.id, findings = p.findings.len(), "probes finished");
                    s.inputs.probes = Some(Arc::new(*p));
                    last_probe = Instant::now();
                }
                ticker.reset_immediately();
            }
            Ok(()) = s.settings.changed() => {
                let new = s.settings.borrow_and_update().clone();
                s.desk.set_limit((&new.config.probes).into());
                s.inputs.config = new.config;
                s.inputs.token = new.token;
                s.inputs.control_token = new.control_token;
                ticker.reset_immediately(); // judge again under the new configuration
            }
            _ = beat.tick() => {}
            _ = ticker.tick() => {
                let (inputs, n) = (s.inputs.clone(), take(&s.seq));
                // Rule 7: the loop keeps turning while a snapshot runs within its bound (every
                // NVML call is under a deadline), and stops beating past it.
                let (bound, began) = (s.snapshot_bound(), Instant::now());
                let mut running = tokio::task::spawn_blocking(move || super::memory::after(super::take_snapshot(&inputs, n)));
                let taken = loop {
                    tokio::select! {
                        taken = &mut running => break taken,
                        _ = stopped(s.stop.clone()) => return,
                        _ = beat.tick() => if began.elapsed() < bound { s.heartbeat.beat() },
                    }
                };
                s.watch_xids();
                let (p, report) = match taken {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::error!(error = %e, "snapshot failed; serving the previous one");
                        continue;
                    }
                };
                let (snapshot, json) = (p.snapshot.clone(), p.report_json.clone());
                let status = publish(&s.shared, p);
                if report.health != s.last.health {
                    let (old, new) = (format!("{:?}", s.last.health).to_lowercase(), format!("{:?}", report.health).to_lowercase());
                    tracing::warn!(%old, %new, "health changed");
                    let _ = s.health.send((old, new));
                }
                let _ = s.taken.send(Taken { report: report.clone(), snapshot: snapshot.clone(), json });
                s.last = report;
                let probes = &s.inputs.config.probes;
                let level = if probes.at_boot == ProbeLevel::None { ProbeLevel::Quick } else { probes.at_boot };
                if s.boot_owed && probes.at_boot != ProbeLevel::None {
                    if super::all_gpus_idle(&snapshot) && s.desk.begin(probes.at_boot, Source::Boot, snapshot).is_some() {
                        s.boot_owed = false;
                        last_probe = Instant::now();
                    }
                } else if let Some(every) = probes.when_idle {
                    // A run already going (the platform's, or the boot's) leaves this for a later tick.
                    if last_probe.elapsed() >= every
                        && super::all_gpus_idle(&snapshot)
                        && s.desk.begin(level, Source::Idle, snapshot).is_some()
                    {
                        last_probe = Instant::now();
                    }
                }
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(&status)]);
            }
        }
    }
}

struct Events {
    last: Arc<Report>,
    settings: watch::Receiver<Settings>,
    seq: Arc<Mutex<Seq>>,
    writer: Option<SpoolWriter>,
    counters: Arc<EventCounters>,
    status: watch::Sender<Option<(u64, Bytes)>>,
    xids: mpsc::UnboundedReceiver<NvmlXid>,
    sxids: mpsc::UnboundedReceiver<SxidEvent>,
    taken: mpsc::UnboundedReceiver<Taken>,
    snapshot_now: mpsc::UnboundedSender<ToSnapshotter>,
    stop: watch::Receiver<bool>,
    heartbeat: Heartbeat,
    first_snapshot: Arc<Snapshot>,
    first_json: Bytes,
    /// The snapshot `last` was judged from, for a fatal Xid's support bundle.
    last_snapshot: Arc<Snapshot>,
    bundler: super::bug_bundle::Bundler,
}

impl Events {
    /// Hands an event, with only what it is about, to the spool writer (rules 6 and 7).
    fn spool(&self, base: &Report, event: Event) {
        let Some(writer) = &self.writer else { return };
        if let Event::Xid { count, .. } | Event::Sxid { count, .. } = &event {
            self.counters.merged.fetch_add(count.saturating_sub(1), Ordering::Relaxed);
        }
        let mut r = crate::report::event_report(base, event);
        r.seq = take(&self.seq);
        writer.send(r.seq, serde_json::to_vec(&r).unwrap_or_default());
    }

    /// The periodic status: the published report's own bytes, serialised once per snapshot.
    fn push_status(&self, seq: u64, json: &Bytes) {
        let _ = self.status.send(Some((seq, json.clone())));
    }
}

/// Rules 6–9 and the installer's end: every event goes to the spool writer in the order it
/// happened; the status goes to the pusher every `platform.interval`.
async fn events(mut e: Events) {
    let state_dir = e.settings.borrow().config.agent.state_dir.clone();
    e.push_status(e.last.seq, &e.first_json);
    let mut status_pushed = Instant::now();
    // The installer's end, once per install state, across restarts and reboots (first at
    // start: the install may have ended while the agent was down).
    let install_marker = state_dir.join(INSTALL_EVENT_SENT);
    let mut install_sent = std::fs::read_to_string(&install_marker).ok();
    let mut install_ended = |e: &Events, report: &Report| {
        let Some((event, key)) = super::install_event(install_sent.as_deref(), report) else { return };
        e.spool(report, event);
        if let Err(err) = crate::durable::write(&install_marker, key.as_bytes(), 0o600) {
            tracing::warn!(path = %install_marker.display(), error = %err, "cannot note the install event as sent; it may be sent again");
        }
        install_sent = Some(key);
    };
    install_ended(&e, &e.last.clone());
    // Rule 8: the kernel log's Xids that no running agent saw, then the mark moves on.
    let mut kmsg_seen = None;
    for event in super::unseen_kernel_xids(&state_dir, &e.first_snapshot) {
        tracing::warn!(?event, "an Xid in the kernel log that no running agent reported");
        e.spool(&e.last.clone(), event);
    }
    super::mark_kernel_log_seen(&state_dir, &e.first_snapshot, &mut kmsg_seen);

    let mut xids = XidWindow::default();
    let mut kernel_xids_seen = None;
    super::bug_bundle::new_kernel_xids(&e.first_snapshot, &mut kernel_xids_seen);
    loop {
        e.heartbeat.beat();
        // Awake when the oldest Xid window closes, else only for the heartbeat (rest is rest).
        let wake =
            xids.next_close().map_or(HEARTBEAT, |at| at.saturating_duration_since(Instant::now()).min(HEARTBEAT));
        tokio::select! {
            // The stop, then Xids (spooled before anything else), then reports.
            biased;
            _ = stopped(e.stop.clone()) => break,
            Some(x) = e.xids.recv() => {
                // A fatal Xid's support bundle, on a thread of its own (bug_bundle's rules).
                e.bundler.on_xid(&x.gpu, x.xid, e.last_snapshot.clone(), e.last.clone());
                // Rule 6: the first of a kind goes at once and is judged at once; repeats wait.
                if let Some(event) = xids.note(Seen::Xid { gpu: x.gpu.clone(), xid: x.xid }, Instant::now()) {
                    tracing::warn!(gpu = %x.gpu, xid = x.xid, "Xid");
                    e.spool(&e.last.clone(), event);
                    let _ = e.snapshot_now.send(ToSnapshotter::Now);
                }
            }
            Some(x) = e.sxids.recv() => {
                // A fatal SXid's support bundle, as a fatal Xid's (bug_bundle's rules).
                e.bundler.on_sxid(&x.pci, x.sxid, x.fatal, e.last_snapshot.clone(), e.last.clone());
                // Rule 9: as rule 6, per NVSwitch and code.
                let Some(code) = x.sxid else { continue };
                let seen = Seen::Sxid { nvswitch: x.pci.clone(), sxid: u64::from(code), fatal: x.fatal };
                if let Some(event) = xids.note(seen, Instant::now()) {
                    tracing::warn!(nvswitch = %x.pci, sxid = code, fatal = x.fatal, "SXid: {}", x.message);
                    e.spool(&e.last.clone(), event);
                    let _ = e.snapshot_now.send(ToSnapshotter::Now);
                }
            }
            _ = tokio::time::sleep(wake) => {
                for event in xids.due(Instant::now()) {
                    match &event {
                        Event::Xid { gpu, xid, count, .. } => tracing::warn!(%gpu, xid, repeats = count, "Xid repeated within {} s", super::XID_WINDOW.as_secs()),
                        Event::Sxid { nvswitch, sxid, count, .. } => tracing::warn!(%nvswitch, sxid, repeats = count, "SXid repeated within {} s", super::XID_WINDOW.as_secs()),
                        _ => {}
                    }
                    e.spool(&e.last.clone(), event);
                }
            }
            Some(t) = e.taken.recv() => {
                for event in super::severity_changes(&e.last, &t.report) {
                    e.spool(&t.report, event);
                }
                install_ended(&e, &t.report);
                super::mark_kernel_log_seen(&state_dir, &t.snapshot, &mut kmsg_seen);
                // Periodic status at the first snapshot at or after `platform.interval` (so
                // never more often than snapshots are taken); events go as they happen.
                let interval = e.settings.borrow().config.platform.interval;
                if status_pushed.elapsed() + Duration::from_secs(1) >= interval {
                    e.push_status(t.report.seq, &t.json);
                    status_pushed = Instant::now();
                }
                // A fatal Xid the kernel log shows (NVML may be too blocked to say it).
                for (gpu, xid) in super::bug_bundle::new_kernel_xids(&t.snapshot, &mut kernel_xids_seen) {
                    e.bundler.on_xid(&gpu, xid, t.snapshot.clone(), t.report.clone());
                }
                e.last = t.report;
                e.last_snapshot = t.snapshot;
            }
        }
    }
    // Xids NVML delivered before the stop are not dropped with the channel; then no counted
    // repeat is left behind, and every event handed over reaches the disk.
    while let Ok(x) = e.xids.try_recv() {
        if let Some(event) = xids.note(Seen::Xid { gpu: x.gpu.clone(), xid: x.xid }, Instant::now()) {
            e.spool(&e.last.clone(), event);
        }
    }
    while let Ok(x) = e.sxids.try_recv() {
        let Some(code) = x.sxid else { continue };
        if let Some(event) =
            xids.note(Seen::Sxid { nvswitch: x.pci, sxid: u64::from(code), fatal: x.fatal }, Instant::now())
        {
            e.spool(&e.last.clone(), event);
        }
    }
    for event in xids.close_all() {
        e.spool(&e.last.clone(), event);
    }
    if let Some(w) = e.writer.take() {
        let _ = tokio::task::spawn_blocking(move || w.finish()).await;
    }
}

/// ch.phoeniqs.Agent1 on the system bus, and its HealthChanged signal; the agent serves HTTP
/// without it if the bus is away. The connection lives as long as the returned task.
async fn dbus(
    shared: Shared,
    desk: Arc<Desk>,
    mut health: mpsc::UnboundedReceiver<(String, String)>,
) -> Option<tokio::task::JoinHandle<()>> {
    let building = tokio::task::spawn_blocking(move || bus::serve(shared, desk));
    let conn = match tokio::time::timeout(Duration::from_secs(5), building).await {
        Ok(Ok(Ok(conn))) => conn,
        Ok(Ok(Err(e))) => {
            tracing::warn!(error = %e, "D-Bus API not served: {}", bus::NAME);
            return None;
        }
        _ => {
            tracing::warn!("D-Bus API not served: the system bus did not answer within 5 s");
            return None;
        }
    };
    Some(tokio::spawn(async move {
        while let Some((old, new)) = health.recv().await {
            let conn = conn.clone();
            let _ = tokio::task::spawn_blocking(move || bus::health_changed(&conn, &old, &new)).await;
        }
    }))
}

/// Runs the probes the desk queued, one run at a time, each in a child process under its
/// deadline (`probe::child`); never on a GPU with a compute process (the desk queues a run only
/// when every GPU is idle, or at boot, and the child checks again). Each run's end is told to
/// the desk (its record) and its results to the snapshotter (the next report carries them).
async fn probes(
    mut asks: mpsc::UnboundedReceiver<recheck::Ask>,
    desk: Arc<Desk>,
    results: mpsc::UnboundedSender<ToSnapshotter>,
    state_dir: std::path::PathBuf,
    margin: crate::probe::child::Limits,
) {
    while let Some(recheck::Ask { snapshot, level, id }) = asks.recv().await {
        desk.started(&id);
        let (dir, who) = (state_dir.clone(), format!("phq-agent serve (probe run {id})"));
        let ran = tokio::task::spawn_blocking(move || super::run_probes(&snapshot, level, &dir, margin, &who))
            .await
            .unwrap_or_else(|e| Err(format!("the probe run's task ended: {e}")));
        let run = desk.finished(&id, ran.as_ref().map(|r| r.1.as_slice()).map_err(String::as_str));
        if let (Ok((probes, findings)), Some(run)) = (ran, run) {
            let _ = results.send(ToSnapshotter::Probes(Box::new(super::ProbeResults { probes, findings, run })));
        }
    }
}

/// Rule 9: SXids from the kernel log as the NVSwitch driver writes them, read by a thread of its
/// own (it lives as long as the returned value); a kernel log that cannot be followed is said
/// once, and its SXids still show at each snapshot.
fn follow_sxids(root: &crate::sysroot::Sysroot) -> (mpsc::UnboundedReceiver<SxidEvent>, Option<Follower>) {
    let (tx, rx) = mpsc::unbounded_channel();
    match Follower::start(root, move |x| tx.send(x).is_ok()) {
        Ok(f) => (rx, Some(f)),
        Err(e) => {
            tracing::warn!(error = %e, "the kernel log is not followed; SXids show at each snapshot");
            (rx, None)
        }
    }
}

/// Xids from NVML as they happen: the watcher (started by the snapshotter once NVML answers)
/// sends on the returned std sender, and a thread forwards to the event task's channel.
fn forward_xids() -> anyhow::Result<(mpsc::UnboundedReceiver<NvmlXid>, std::sync::mpsc::Sender<NvmlXid>)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let (from_tx, from_nvml) = std::sync::mpsc::channel::<NvmlXid>();
    std::thread::Builder::new()
        .name("xid-forward".into())
        .spawn(move || {
            for x in from_nvml {
                if tx.send(x).is_err() {
                    return;
                }
            }
        })
        .context("cannot start the Xid forwarding thread")?;
    Ok((rx, from_tx))
}

/// Rule 7: pings systemd's watchdog every `every` (half `WatchdogSec`) while every looping
/// task's heartbeat is younger than `LOOP_STALL`; stops, and says which task once, when one is
/// stuck.
async fn watchdog(every: Duration, beats: Vec<(&'static str, Heartbeat)>) {
    let mut tick = tokio::time::interval(every);
    let mut stalled = false;
    loop {
        tick.tick().await;
        match beats.iter().find(|(_, b)| b.age() >= LOOP_STALL) {
            None => {
                stalled = false;
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
            }
            Some((task, b)) if !stalled => {
                stalled = true;
                tracing::error!(task, stalled_for = ?b.age(), "a service task has not turned; watchdog pings stop so that systemd restarts the agent");
            }
            Some(_) => {}
        }
    }
}
