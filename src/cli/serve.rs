//! `phq-agent serve`: the systemd service (rules at the top of `serve`).

use crate::collect::nvml::XidWatcher;
use crate::report::Event;
use crate::serve::push::{Pusher, Spool};
use crate::serve::{self, http, Inputs, Published, Seq, Shared};
use crate::snapshot::Timestamp;
use anyhow::Context;
use clap::Args;
use std::sync::{Arc, RwLock};

#[derive(Debug, Args)]
pub struct Serve {
    #[command(flatten)]
    pub machine: super::Machine,
}

impl Serve {
    pub fn run(self, g: &super::Global) -> anyhow::Result<i32> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        let code = runtime.block_on(run(g, &self.machine));
        // A snapshot still running on the blocking pool (a stop during the first one) is not
        // waited for: the process is ending.
        runtime.shutdown_background();
        code
    }
}

fn token_of(config: &crate::config::Config) -> anyhow::Result<Option<String>> {
    match serve::read_token(&config.http.token_file) {
        Ok(t) => Ok(Some(t)),
        // Missing: serve /healthz and refuse the rest until a token exists (first-start
        // generation is the package's job). Unsafe (readable by others): refuse to start.
        Err(e) if !config.http.token_file.exists() => {
            tracing::error!(error = %e, "no token: /v1/status and /metrics will answer 503");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

async fn run(g: &super::Global, machine: &super::Machine) -> anyhow::Result<i32> {
    // Signals first: systemd may send SIGHUP or SIGTERM as soon as READY=1 is out.
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut hup =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).context("cannot watch SIGHUP")?;
    let mut int =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).context("cannot watch SIGINT")?;
    let mut config = g.load_config()?;
    // This run's part of every Idempotency-Key (rules in serve::push).
    let epoch = serve::push::new_epoch();
    let spool = if config.platform.url.is_empty() {
        None
    } else {
        Some(
            Spool::open(&config.agent.state_dir, &epoch)
                .with_context(|| format!("{}: cannot open the spool", config.agent.state_dir.display()))?,
        )
    };
    let counters = Arc::new(serve::EventCounters::default());
    let mut inputs = Inputs {
        sysroot: machine.sysroot.clone(),
        // One NVML session for the service's life (reopened only when a reading says it is gone).
        nvml: match crate::collect::NvmlSource::choose(
            machine.nvml_lib.as_deref(),
            &crate::sysroot::Sysroot::new(&machine.sysroot),
        ) {
            crate::collect::NvmlSource::Library(lib) => {
                crate::collect::NvmlSource::Session(Arc::new(crate::collect::nvml::Session::new(&lib)))
            }
            other => other,
        },
        token: token_of(&config)?,
        config: config.clone(),
        started_at: Timestamp::now(),
        probes: None,
        push: Default::default(),
        events: counters.clone(),
        spool: spool.clone(),
    };
    let listener = http::listen(config.http.listen)
        .with_context(|| format!("cannot listen on {} (http.listen)", config.http.listen))?;
    tracing::info!(listen = %config.http.listen, "serving /healthz, /v1/status, /metrics");
    let shared: Shared = Arc::new(RwLock::new(None));
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let tls = serve::tls::acceptor(&config.http)?;
    let server = tokio::spawn(http::serve(listener, shared.clone(), tls, async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    }));

    let mut seq = Seq::load(&config.agent.state_dir);
    let publish = |p: Published| {
        let status = p.summary.clone();
        match shared.write() {
            Ok(mut guard) => *guard = Some(Arc::new(p)),
            Err(poisoned) => *poisoned.into_inner() = Some(Arc::new(p)),
        }
        status
    };
    let snap = |inputs: Inputs, n: u64| tokio::task::spawn_blocking(move || serve::take_snapshot(&inputs, n));

    // Signals are served from the start: a stop during the first snapshot (NVML attaching
    // eight GPUs, a wedged bus) is not kept waiting for it.
    let (first, mut last_report) = tokio::select! {
        taken = snap(inputs.clone(), seq.take()) => taken.context("the first snapshot failed")?,
        _ = term.recv() => return Ok(stopped_before_ready("SIGTERM")),
        _ = int.recv() => return Ok(stopped_before_ready("SIGINT")),
    };
    let status = publish(first);

    // Push: events through the spool, status latest-wins (rules in serve::push).
    let (status_tx, status_rx) = tokio::sync::watch::channel::<Option<(u64, Vec<u8>)>>(None);
    let wake = Arc::new(tokio::sync::Notify::new());
    let writer = match &spool {
        None => None,
        Some(spool) => {
            let agent_id = last_report.agent.agent_id.clone();
            let mut pusher = Pusher::new(&config.platform, &agent_id, spool.clone())?;
            pusher.state = inputs.push.clone();
            tokio::spawn(pusher.run(status_rx, wake.clone(), stop_tx.subscribe()));
            tracing::info!(url = %config.platform.url, spooled = spool.len(), "pushing reports");
            Some(
                serve::SpoolWriter::start(spool.clone(), wake.clone(), counters.clone())
                    .context("cannot start the spool writer")?,
            )
        }
    };
    let push_status = |report: &crate::report::Report| {
        let _ = status_tx.send(Some((report.seq, serde_json::to_vec(report).unwrap_or_default())));
    };
    push_status(&last_report);
    // Periodic status goes every `platform.interval`, at the first snapshot at or after it (so
    // never more often than snapshots are taken); events go as they happen.
    let mut status_pushed = std::time::Instant::now();
    // ch.phoeniqs.Agent1 on the system bus; the agent serves HTTP without it if the bus is away.
    let dbus = {
        let shared = shared.clone();
        let building = tokio::task::spawn_blocking(move || serve::dbus::serve(shared));
        match tokio::time::timeout(std::time::Duration::from_secs(5), building).await {
            Ok(Ok(Ok(conn))) => Some(conn),
            Ok(Ok(Err(e))) => {
                tracing::warn!(error = %e, "D-Bus API not served: {}", serve::dbus::NAME);
                None
            }
            _ => {
                tracing::warn!("D-Bus API not served: the system bus did not answer within 5 s");
                None
            }
        }
    };
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&status)]);
    tracing::info!(%status, "ready");

    // Xids from NVML as they happen, from their own thread.
    let (xid_tx, mut xid_rx) = tokio::sync::mpsc::unbounded_channel();
    let watched = match &inputs.nvml {
        crate::collect::NvmlSource::Library(lib) => Some(lib.clone()),
        crate::collect::NvmlSource::Session(s) => Some(s.library().to_string()),
        crate::collect::NvmlSource::Skip(_) => None,
    };
    let _watcher = match watched {
        Some(lib) => match XidWatcher::start(&lib) {
            Ok((w, rx)) => {
                std::thread::Builder::new()
                    .name("xid-forward".into())
                    .spawn(move || {
                        for x in rx {
                            if xid_tx.send(x).is_err() {
                                return;
                            }
                        }
                    })
                    .context("cannot start the Xid forwarding thread")?;
                Some(w)
            }
            Err(e) => {
                tracing::warn!(error = %e.message, "Xid events are not watched; the kernel log still shows them at each snapshot");
                None
            }
        },
        None => None,
    };

    // Hands an event, with only what it is about, to the spool writer (rules 6 and 7).
    let spool_event = |seq: &mut Seq, base: &crate::report::Report, event: Event| {
        let Some(writer) = &writer else { return };
        if let Event::Xid { count, .. } = &event {
            counters.merged.fetch_add(count.saturating_sub(1), std::sync::atomic::Ordering::Relaxed);
        }
        let mut r = crate::report::event_report(base, event);
        r.seq = seq.take();
        writer.send(r.seq, serde_json::to_vec(&r).unwrap_or_default());
    };

    // The installer's end, once per install state, across restarts and reboots (first at start:
    // the install may have ended while the agent was down).
    let install_marker = config.agent.state_dir.join(serve::INSTALL_EVENT_SENT);
    let mut install_sent = std::fs::read_to_string(&install_marker).ok();
    let mut install_ended = |seq: &mut Seq, report: &crate::report::Report| {
        let Some((event, key)) = serve::install_event(install_sent.as_deref(), report) else { return };
        spool_event(seq, report, event);
        if let Err(e) = crate::durable::write(&install_marker, key.as_bytes(), 0o600) {
            tracing::warn!(path = %install_marker.display(), error = %e, "cannot note the install event as sent; it may be sent again");
        }
        install_sent = Some(key);
    };
    install_ended(&mut seq, &last_report);
    // Rule 8: the kernel log's Xids that no running agent saw, then the mark moves on.
    let mut kmsg_seen = None;
    if let Some(p) = serve::current(&shared) {
        for event in serve::unseen_kernel_xids(&config.agent.state_dir, &p.snapshot) {
            tracing::warn!(?event, "an Xid in the kernel log that no running agent reported");
            spool_event(&mut seq, &last_report, event);
        }
        serve::mark_kernel_log_seen(&config.agent.state_dir, &p.snapshot, &mut kmsg_seen);
    }

    // Probes: at boot (before workloads start) if asked, then whenever every GPU has been idle
    // and `probes.when_idle` has passed; never on a GPU with a compute process.
    let (probe_tx, mut probe_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut last_probe = std::time::Instant::now();
    let start_probes = |snapshot: Arc<crate::snapshot::Snapshot>, level: crate::config::ProbeLevel| {
        let tx = probe_tx.clone();
        tokio::task::spawn_blocking(move || {
            if let Some(p) = serve::run_probes(&snapshot, level) {
                let _ = tx.send(p);
            }
        });
    };
    if config.probes.at_boot != crate::config::ProbeLevel::None {
        if let Some(p) = serve::current(&shared) {
            start_probes(p.snapshot.clone(), config.probes.at_boot);
        }
    }

    // Rule 7: the watchdog on its own task, fed by the loop's heartbeat.
    let started = std::time::Instant::now();
    let heartbeat = Arc::new(std::sync::atomic::AtomicU64::new(0));
    if let Some(every) = sd_notify::watchdog_enabled().filter(|d| !d.is_zero()) {
        tokio::spawn(watchdog(every / 2, started, heartbeat.clone()));
    }
    let mut xids = serve::XidWindow::default();
    let mut beat = tokio::time::interval(std::time::Duration::from_secs(1));
    let mut ticker = tokio::time::interval(serve::SNAPSHOT_INTERVAL);
    ticker.tick().await; // the first tick is immediate; the first snapshot is taken already
    loop {
        heartbeat.store(started.elapsed().as_millis() as u64, std::sync::atomic::Ordering::Relaxed);
        tokio::select! {
            // Signals, then Xids (spooled before anything else), then the schedule.
            biased;
            _ = term.recv() => break,
            _ = int.recv() => break,
            Some(x) = xid_rx.recv() => {
                // Rule 6: the first of a kind goes at once and is judged at once; repeats wait.
                if let Some(event) = xids.note(&x.gpu, x.xid, std::time::Instant::now()) {
                    tracing::warn!(gpu = %x.gpu, xid = x.xid, "Xid");
                    spool_event(&mut seq, &last_report, event);
                    ticker.reset_immediately(); // judge the GPU again now
                }
            }
            _ = beat.tick() => {
                for event in xids.due(std::time::Instant::now()) {
                    if let Event::Xid { gpu, xid, count, .. } = &event {
                        tracing::warn!(%gpu, xid, repeats = count, "Xid repeated within {} s", serve::XID_WINDOW.as_secs());
                    }
                    spool_event(&mut seq, &last_report, event);
                }
            }
            Some(p) = probe_rx.recv() => {
                tracing::info!(findings = p.1.len(), "probes finished");
                inputs.probes = Some(Arc::new(p));
                last_probe = std::time::Instant::now();
                ticker.reset_immediately(); // publish them
            }
            _ = ticker.tick() => {
                match snap(inputs.clone(), seq.take()).await {
                    Ok((p, report)) => {
                        for event in serve::severity_changes(&last_report, &report) {
                            spool_event(&mut seq, &report, event);
                        }
                        install_ended(&mut seq, &report);
                        serve::mark_kernel_log_seen(&config.agent.state_dir, &p.snapshot, &mut kmsg_seen);
                        let status = publish(p);
                        if status_pushed.elapsed() + std::time::Duration::from_secs(1) >= config.platform.interval {
                            push_status(&report);
                            status_pushed = std::time::Instant::now();
                        }
                        if report.health != last_report.health {
                            let (old, new) = (format!("{:?}", last_report.health).to_lowercase(), format!("{:?}", report.health).to_lowercase());
                            tracing::warn!(%old, %new, "health changed");
                            if let Some(conn) = dbus.clone() {
                                let _ = tokio::task::spawn_blocking(move || serve::dbus::health_changed(&conn, &old, &new)).await;
                            }
                        }
                        last_report = report;
                        let level = if config.probes.at_boot == crate::config::ProbeLevel::None { crate::config::ProbeLevel::Quick } else { config.probes.at_boot };
                        if let (Some(every), Some(p)) = (config.probes.when_idle, serve::current(&shared)) {
                            if last_probe.elapsed() >= every && serve::all_gpus_idle(&p.snapshot) {
                                last_probe = std::time::Instant::now();
                                start_probes(p.snapshot.clone(), level);
                            }
                        }
                        let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(&status)]);
                    }
                    Err(e) => tracing::error!(error = %e, "snapshot failed; serving the previous one"),
                }
            }
            _ = hup.recv() => {
                let reloaded = g.load_config().and_then(|new| token_of(&new).map(|token| (new, token)));
                let status = match reloaded {
                    Ok((new, token)) => {
                        let pending = crate::config::restart_needed(&config, &new);
                        config = new;
                        inputs.config = config.clone();
                        inputs.token = token;
                        ticker.reset_immediately(); // judge again under the new configuration
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
                };
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(&status)]);
            }
        }
    }
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping, sd_notify::NotifyState::Status("stopping")]);
    // No counted repeat is left behind, and every event handed over reaches the disk.
    for event in xids.close_all() {
        spool_event(&mut seq, &last_report, event);
    }
    if let Some(w) = writer {
        let _ = tokio::task::spawn_blocking(move || w.finish()).await;
    }
    let _ = stop_tx.send(true);
    let _ = server.await;
    tracing::info!("stopped");
    Ok(0)
}

/// A stop asked for before the first snapshot was ready.
fn stopped_before_ready(signal: &str) -> i32 {
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    tracing::info!("{signal} before the first snapshot was ready; stopping");
    0
}

/// Pings systemd's watchdog every `every` (half `WatchdogSec`) while the loop's heartbeat is
/// younger than `LOOP_STALL`; stops, and says why once, when the loop is stuck.
async fn watchdog(
    every: std::time::Duration,
    started: std::time::Instant,
    heartbeat: Arc<std::sync::atomic::AtomicU64>,
) {
    let mut tick = tokio::time::interval(every);
    let mut stalled = false;
    loop {
        tick.tick().await;
        let last = std::time::Duration::from_millis(heartbeat.load(std::sync::atomic::Ordering::Relaxed));
        let age = started.elapsed().saturating_sub(last);
        if age < serve::LOOP_STALL {
            stalled = false;
            let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
        } else if !stalled {
            stalled = true;
            tracing::error!(stalled_for = ?age, "the service loop has not turned; watchdog pings stop so that systemd restarts the agent");
        }
    }
}
