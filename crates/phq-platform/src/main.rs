//! phq-platform: the platform's poller, one per GPU node (docs/platform.md).
//!
//! It reads each of its node's VMs' agents — `/v1/status` and `/metrics`, only the parts it uses
//! (`guest::STATUS_PATH`, `guest::METRICS_PATH`), under a deadline and a byte cap, a bounded
//! number at a time — and serves on its own `/metrics` what it saw (the
//! `phq_poll_*` series, its facts) beside what each guest said (`phq_guest_*`, claims, labelled
//! `source="tenant"` unless the VM is the platform's own validation VM). Prometheus and
//! Alertmanager decide what to do about it; the poller never acts on a node, and never starts
//! work in a tenant's VM.

mod config;
mod expo;
mod guest;
mod kube;
mod poll;
mod state;
mod targets;
mod ws;

use anyhow::{Context, Result};
use bytes::Bytes;
use clap::Parser;
use config::Config;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use poll::{Ask, Credential, Failure};
use state::{Source, TargetState};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use targets::{Target, Transport};
use tokio::sync::Semaphore;

#[derive(Parser)]
#[command(
    name = "phq-platform",
    version,
    about = "The platform's poller of phq-agent, one per GPU node (docs/platform.md)"
)]
struct Cli {
    /// The poller's configuration (TOML).
    #[arg(long, default_value = "/etc/phq-platform/config.toml")]
    config: PathBuf,
    /// Check the configuration and the targets file, print the targets, and exit.
    #[arg(long)]
    check: bool,
}

type Targets = Arc<Mutex<BTreeMap<Target, TargetState>>>;

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("phq-platform: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    let config = Config::load(&cli.config)?;
    if cli.check {
        if let Some(file) = &config.targets_file {
            for t in targets::load(file, &config.node)? {
                let source = Source::of(&t.namespace, &config.validation_namespaces);
                println!(
                    "{}/{} {} {} {} {}",
                    t.namespace,
                    t.vmi,
                    t.vmi_uid,
                    t.address,
                    t.transport.word(),
                    source.word()
                );
            }
        }
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("the runtime")?;
    rt.block_on(serve(Arc::new(config)))
}

async fn serve(config: Arc<Config>) -> Result<()> {
    let listener =
        tokio::net::TcpListener::bind(&config.listen).await.with_context(|| format!("binding {}", config.listen))?;
    eprintln!("phq-platform: serving /metrics on {}", listener.local_addr()?);
    let api = if config.kubernetes.enabled {
        let k = &config.kubernetes;
        Some(Arc::new(kube::Api::new(k.api_server.clone(), &k.ca_file, k.token_file.clone())?))
    } else {
        None
    };
    let targets: Targets = Arc::default();
    let slots = Arc::new(Semaphore::new(config.poll.concurrency));
    let sources = Arc::new(Sources::default());
    if let Some(file) = config.targets_file.clone() {
        tokio::spawn(watch_file(config.clone(), file, sources.clone()));
    }
    if let Some(api) = api.clone() {
        tokio::spawn(watch_kube(config.clone(), api, sources.clone()));
    }
    tokio::spawn(reconcile(config.clone(), sources, targets.clone(), slots, api));
    let stale_after = 3 * (config.poll.interval + config.poll.jitter);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        let (tcp, _) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => { eprintln!("phq-platform: accept: {e}"); tokio::time::sleep(Duration::from_millis(100)).await; continue }
            },
            _ = term.recv() => return Ok(()),
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        let targets = targets.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let targets = targets.clone();
                async move { Ok::<_, std::convert::Infallible>(answer(&req, &targets, stale_after)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .serve_connection(TokioIo::new(tcp), service)
                .await;
        });
    }
}

fn answer(req: &Request<hyper::body::Incoming>, targets: &Targets, stale_after: Duration) -> Response<Full<Bytes>> {
    let reply = |code: StatusCode, ctype: &'static str, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = code;
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(ctype));
        r
    };
    if req.method() != Method::GET {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n".into());
    }
    match req.uri().path() {
        "/metrics" => {
            let now = Instant::now();
            let body = {
                let map = targets.lock().unwrap_or_else(|p| p.into_inner());
                let list: Vec<(&Target, &TargetState)> = map.iter().collect();
                expo::render(&list, now, stale_after)
            };
            reply(StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", body)
        }
        "/healthz" => reply(StatusCode::OK, "text/plain", "ok\n".into()),
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "/metrics, /healthz\n".into()),
    }
}

/// Where targets come from: the targets file and the API server, each kept whole; the union is
/// what the poller polls (one VM listed by both is polled once, as Kubernetes says).
#[derive(Default)]
struct Sources {
    lists: Mutex<(Vec<Target>, Vec<Target>)>,
    changed: tokio::sync::Notify,
}

impl Sources {
    fn set_file(&self, t: Vec<Target>) {
        self.lists.lock().unwrap_or_else(|p| p.into_inner()).0 = t;
        self.changed.notify_one();
    }
    fn set_kube(&self, t: Vec<Target>) {
        self.lists.lock().unwrap_or_else(|p| p.into_inner()).1 = t;
        self.changed.notify_one();
    }
    fn all(&self) -> std::collections::BTreeSet<Target> {
        let lists = self.lists.lock().unwrap_or_else(|p| p.into_inner());
        let from_kube: std::collections::BTreeSet<(&str, &str)> =
            lists.1.iter().map(|t| (t.namespace.as_str(), t.vmi.as_str())).collect();
        lists
            .1
            .iter()
            .chain(lists.0.iter().filter(|t| !from_kube.contains(&(t.namespace.as_str(), t.vmi.as_str()))))
            .cloned()
            .collect()
    }
}

/// Reads the targets file when it changes (looked at every 2 s). A file that does not parse
/// keeps the targets there were, and says why once per change.
async fn watch_file(config: Arc<Config>, file: PathBuf, sources: Arc<Sources>) {
    let mut seen: Option<(SystemTime, u64)> = None;
    let mut said_missing = false;
    loop {
        let stamp = std::fs::metadata(&file).ok().map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len()));
        if stamp.is_none() && !said_missing {
            eprintln!(
                "phq-platform: the targets file {} is not there (yet); keeping the targets there were",
                file.display()
            );
            said_missing = true;
        }
        if stamp.is_some() && stamp != seen {
            said_missing = false;
            seen = stamp;
            match targets::load(&file, &config.node) {
                Err(e) => eprintln!("phq-platform: {e:#}; keeping the targets there were"),
                Ok(list) => {
                    eprintln!("phq-platform: {} targets from {}", list.len(), file.display());
                    sources.set_file(list);
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// This node's VMIs from the API server: a list, then a watch from its resourceVersion, again
/// from the last one seen when the server ends the watch, a new list when it says the version is
/// gone (410), and after a failure a new list after a pause that doubles to a minute.
async fn watch_kube(config: Arc<Config>, api: Arc<kube::Api>, sources: Arc<Sources>) {
    let k = &config.kubernetes;
    let transport = if k.transport == "vsock" { Transport::Vsock } else { Transport::Tls };
    let mut pause = Duration::from_secs(1);
    loop {
        let (items, mut rv) = match api.list(&config.node).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("phq-platform: {e:#}; again in {pause:?}");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(60));
                continue;
            }
        };
        pause = Duration::from_secs(1);
        let mut vmis: BTreeMap<String, serde_json::Value> = items
            .into_iter()
            .filter_map(|v| {
                Some((format!("{}/{}", v["metadata"]["namespace"].as_str()?, v["metadata"]["name"].as_str()?), v))
            })
            .collect();
        let publish = |vmis: &BTreeMap<String, serde_json::Value>| {
            let list: Vec<Target> =
                vmis.values().filter_map(|v| kube::target_of(v, &config.node, transport, k.agent_port)).collect();
            sources.set_kube(list);
        };
        publish(&vmis);
        eprintln!("phq-platform: {} VMIs on {} from the API server", vmis.len(), config.node);
        loop {
            let r = api
                .watch(&config.node, &rv, |kind, obj| {
                    let Some(key) = (|| {
                        Some(format!(
                            "{}/{}",
                            obj["metadata"]["namespace"].as_str()?,
                            obj["metadata"]["name"].as_str()?
                        ))
                    })() else {
                        return;
                    };
                    if kind == "DELETED" {
                        vmis.remove(&key);
                    } else {
                        vmis.insert(key, obj.clone());
                    }
                    publish(&vmis);
                })
                .await;
            match r {
                Ok(last) => rv = last,
                Err(kube::WatchEnd::Gone) => break,
                Err(kube::WatchEnd::Failed(e)) => {
                    eprintln!("phq-platform: {e}; listing again in {pause:?}");
                    tokio::time::sleep(pause).await;
                    break;
                }
            }
        }
    }
}

/// Starts a task for each new target and stops those of targets that left.
async fn reconcile(
    config: Arc<Config>,
    sources: Arc<Sources>,
    targets: Targets,
    slots: Arc<Semaphore>,
    api: Option<Arc<kube::Api>>,
) {
    let mut tasks: BTreeMap<Target, tokio::task::JoinHandle<()>> = BTreeMap::new();
    loop {
        sources.changed.notified().await;
        let keep = sources.all();
        let now = Instant::now();
        tasks.retain(|t, h| {
            let stays = keep.contains(t);
            if !stays {
                h.abort();
            }
            stays
        });
        {
            let mut map = targets.lock().unwrap_or_else(|p| p.into_inner());
            map.retain(|t, _| keep.contains(t));
            for t in &keep {
                map.entry(t.clone())
                    .or_insert_with(|| TargetState::new(Source::of(&t.namespace, &config.validation_namespaces), now));
            }
        }
        for t in keep {
            if let std::collections::btree_map::Entry::Vacant(e) = tasks.entry(t) {
                let t = e.key().clone();
                e.insert(tokio::spawn(poll_loop(config.clone(), t, targets.clone(), slots.clone(), api.clone())));
            }
        }
    }
}

/// A small generator for the jitter, seeded per target; no need for more than spread.
struct Jitter(u64);

impl Jitter {
    fn new(t: &Target) -> Jitter {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        t.hash(&mut h);
        SystemTime::now().hash(&mut h);
        Jitter(h.finish() | 1)
    }
    /// A duration in `[0, max)`.
    fn upto(&mut self, max: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let ms = max.as_millis() as u64;
        Duration::from_millis(if ms == 0 { 0 } else { self.0 % ms })
    }
}

async fn poll_loop(
    config: Arc<Config>,
    target: Target,
    targets: Targets,
    slots: Arc<Semaphore>,
    api: Option<Arc<kube::Api>>,
) {
    let mut jitter = Jitter::new(&target);
    // The first poll comes within one interval, spread, so a restarted poller does not ask all
    // its VMs at once.
    tokio::time::sleep(jitter.upto(config.poll.interval.min(Duration::from_secs(5)))).await;
    loop {
        {
            let Ok(_slot) = slots.acquire().await else { return };
            poll_once(&config, &target, &targets, api.as_ref()).await;
        }
        tokio::time::sleep(config.poll.interval + jitter.upto(config.poll.jitter)).await;
    }
}

fn credential(
    config: &Config,
    transport: Transport,
    control: bool,
    api: Option<&Arc<kube::Api>>,
) -> Result<Credential, Failure> {
    match transport {
        // virt-handler presents KubeVirt's client certificate to the agent; the poller's own
        // credential is its ServiceAccount's token, for `get` on virtualmachineinstances/vsock.
        Transport::Vsock => match api {
            Some(api) => Ok(Credential::Vsock(api.clone(), config.kubernetes.agent_port)),
            None => Err(Failure::Credentials("transport vsock needs kubernetes.enabled".into())),
        },
        Transport::Tls => {
            let (Some(c), Some(k)) = (&config.tls.cert_file, &config.tls.key_file) else {
                return Err(Failure::Credentials("transport tls needs tls.cert_file and tls.key_file".into()));
            };
            Ok(Credential::Tls(poll::tls_config_cached(c, k)?))
        }
        Transport::Http => {
            let file = if control { &config.token.control_token_file } else { &config.token.read_token_file };
            let Some(file) = file else {
                return Err(Failure::Credentials(format!(
                    "transport http needs token.{}_token_file",
                    if control { "control" } else { "read" }
                )));
            };
            Ok(Credential::Bearer(poll::token_cached(file)?))
        }
    }
}

async fn poll_once(config: &Config, target: &Target, targets: &Targets, api: Option<&Arc<kube::Api>>) {
    let started = Instant::now();
    let asks = [
        Ask { method: Method::GET, path: guest::STATUS_PATH, body: Bytes::new() },
        Ask { method: Method::GET, path: guest::METRICS_PATH, body: Bytes::new() },
    ];
    let result = match credential(config, target.transport, false, api) {
        Err(e) => Err(e),
        Ok(cred) => {
            match tokio::time::timeout(config.poll.timeout, poll::exchange(target, &cred, &asks, config.poll.max_bytes))
                .await
            {
                Err(_) => Err(Failure::Timeout),
                Ok(r) => r,
            }
        }
    };
    let said = result.and_then(|answers| {
        if let Some(bad) = answers.iter().find(|a| a.status != StatusCode::OK) {
            return Err(Failure::Status(bad.status.as_u16()));
        }
        let status = guest::status(&answers[0].body).map_err(Failure::Schema)?;
        Ok(guest::said(&status, &answers[1].body, config.poll.max_series_per_vmi))
    });
    let now = Instant::now();
    let (source, ask_probe) = {
        let mut map = targets.lock().unwrap_or_else(|p| p.into_inner());
        let Some(s) = map.get_mut(target) else { return };
        s.last_duration = Some(now - started);
        match said {
            Ok(said) => {
                s.last_ok = Some(true);
                s.last_success = Some(now);
                s.last_error = None;
                s.said = said;
            }
            Err(e) => {
                if s.last_error.as_deref() != Some(&e.to_string()) {
                    eprintln!("phq-platform: {}/{} at {}: {e}", target.namespace, target.vmi, target.address);
                }
                s.last_ok = Some(false);
                *s.failures.entry(e.reason()).or_default() += 1;
                s.last_error = Some(e.to_string());
            }
        }
        let due = config
            .validation
            .probe_interval
            .is_some_and(|every| s.last_probe_request.is_none_or(|at| now.duration_since(at) >= every));
        (s.source, due && s.last_ok == Some(true))
    };
    // Only the platform's own VMs are asked to probe; a tenant's never.
    if source == Source::Validation && ask_probe {
        let code = ask_for_probes(config, target, api).await;
        let mut map = targets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = map.get_mut(target) {
            s.last_probe_request = Some(Instant::now());
            *s.probe_requests.entry(code).or_default() += 1;
        }
    }
}

/// `POST /v1/probes` at the configured level; the answer's status (0 when none came).
async fn ask_for_probes(config: &Config, target: &Target, api: Option<&Arc<kube::Api>>) -> u16 {
    let body = Bytes::from(format!("{{\"level\":\"{}\"}}", config.validation.probe_level));
    let asks = [Ask { method: Method::POST, path: "/v1/probes", body }];
    let cred = match credential(config, target.transport, true, api) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("phq-platform: {}/{}: no probe request: {e}", target.namespace, target.vmi);
            return 0;
        }
    };
    match tokio::time::timeout(config.poll.timeout, poll::exchange(target, &cred, &asks, 64 << 10)).await {
        Ok(Ok(a)) => {
            let code = a[0].status.as_u16();
            eprintln!(
                "phq-platform: {}/{}: asked for a {} probe run: HTTP {code}",
                target.namespace, target.vmi, config.validation.probe_level
            );
            code
        }
        Ok(Err(e)) => {
            eprintln!("phq-platform: {}/{}: probe request: {e}", target.namespace, target.vmi);
            0
        }
        Err(_) => 0,
    }
}
