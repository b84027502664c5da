//! Configuration: `/etc/phq-agent/config.toml`, then `config.d/*.toml` drop-ins in name order,
//! merged key by key (a drop-in overrides only the keys it sets). Every key is optional.
//!
//! Each file is parsed on its own first, so that an unknown key or a value of the wrong type is
//! reported against the file that holds it, with the line; values that are well-typed but
//! wrong (a CUDA version that does not exist) are checked after the merge and reported against
//! the file that set them last.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const DEFAULT_PATH: &str = "/etc/phq-agent/config.toml";

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub agent: AgentConfig,
    pub http: HttpConfig,
    pub vsock: VsockConfig,
    pub platform: PlatformConfig,
    pub probes: ProbesConfig,
    pub metrics: MetricsConfig,
    pub install: InstallConfig,
    pub nvml: NvmlConfig,
}

/// How long NVML may take before a call is given up on (`collect::deadline`): on a GPU that
/// has fallen off the bus (Xid 79) or whose GSP stopped answering (Xid 119), NVML calls block
/// rather than fail.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NvmlConfig {
    /// `nvmlInit_v2`. The service is ready (READY=1) by then at the latest.
    #[serde(deserialize_with = "duration")]
    pub init_timeout: Duration,
    /// Everything read about one GPU, and the system-wide calls.
    #[serde(deserialize_with = "duration")]
    pub gpu_timeout: Duration,
    /// Xid event registration and draining, and the NVLink peer matrix.
    #[serde(deserialize_with = "duration")]
    pub events_timeout: Duration,
}

impl Default for NvmlConfig {
    fn default() -> Self {
        let d = crate::collect::nvml::Deadlines::default();
        NvmlConfig { init_timeout: d.init, gpu_timeout: d.gpu, events_timeout: d.events }
    }
}

impl NvmlConfig {
    pub fn deadlines(&self) -> crate::collect::nvml::Deadlines {
        crate::collect::nvml::Deadlines { init: self.init_timeout, gpu: self.gpu_timeout, events: self.events_timeout }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Empty: the VM firmware UUID (`/sys/class/dmi/id/product_uuid`).
    pub id: String,
    pub expected_gpus: Option<u32>,
    pub state_dir: PathBuf,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig { id: String::new(), expected_gpus: None, state_dir: PathBuf::from("/var/lib/phq-agent") }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// `false`: no TCP listener at all, so only the platform reaches the agent (over `[vsock]`).
    pub enabled: bool,
    pub listen: SocketAddr,
    /// The read token: `/v1/status` and `/metrics` (a tenant's Prometheus sends it, often in
    /// clear HTTP). It starts nothing.
    pub token_file: PathBuf,
    /// The control token: it may start work (`POST /v1/probes`) as well as read, and whoever
    /// uses it is recorded as the tenant. Absent file: no token starts anything (issue 51: the
    /// read token once did both jobs).
    pub control_token_file: PathBuf,
    pub tls_cert: String,
    pub tls_key: String,
    /// The platform's own CA on TCP: a client certificate chained to it and named in
    /// `client_names` is the platform, as virt-handler's is on vsock (docs/vsock.md).
    pub client_ca: String,
    /// The names (the leaf's subject CN) a client certificate from `client_ca` may carry.
    pub client_names: Vec<String>,
}

/// The platform's client name on TCP by default: the poller's (`phq-platform`).
pub const HTTP_CLIENT_NAME: &str = "phq-platform";

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            enabled: true,
            // Both families on one socket (`serve::http::listen`): an IPv4-only wildcard leaves
            // `[::]:9440` to any user of the guest (issue 51).
            listen: SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 9440)),
            token_file: PathBuf::from("/etc/phq-agent/token"),
            control_token_file: PathBuf::from("/etc/phq-agent/control-token"),
            tls_cert: String::new(),
            tls_key: String::new(),
            client_ca: String::new(),
            client_names: vec![HTTP_CLIENT_NAME.to_string()],
        }
    }
}

/// The AF_VSOCK listener the platform reaches through KubeVirt's `vsock` subresource
/// (docs/vsock.md). Same routes, limits and timeouts as `[http]`; the peer is a CID.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VsockConfig {
    pub enabled: bool,
    /// The guest's vsock port. vsock ports are their own 32-bit space (vsock(7)), apart from
    /// TCP's, so the HTTP port's number is reused: one number for an operator to remember.
    pub port: u32,
    /// TLS 1.3 with a client certificate required, as virt-handler dials with `tls=true`.
    /// `false`: plain HTTP over vsock, and the bearer token is required as on TCP.
    pub tls: bool,
    /// The CA bundle a client certificate must chain to: KubeVirt's, written by cloud-init, the
    /// starting point until virt-handler's CA server gives the current one (`serve::kubevirt_ca`).
    pub client_ca: PathBuf,
    /// The names (the leaf's subject CN) a client certificate may carry: KubeVirt's CA signs
    /// several clients, and only virt-handler's vsock client is meant to reach a guest port.
    pub client_names: Vec<String>,
    /// Ask virt-handler's CA server (host CID 2, port 1) for the current bundle when the one in
    /// force is older than this, and whenever a client's chain does not verify; "off": never
    /// ask, the file alone.
    #[serde(deserialize_with = "duration_or_off")]
    pub ca_refresh: Option<Duration>,
    /// The agent's own server certificate and key; empty: `<state_dir>/vsock/server.crt` and
    /// `server.key`, generated on first start and rotated before they expire.
    pub cert: String,
    pub key: String,
}

/// `vsock.client_ca` by default: where the shipped cloud-init user-data writes the bundle.
pub const VSOCK_CLIENT_CA: &str = "/etc/phq-agent/vsock-ca.pem";
/// The name of virt-handler's vsock client certificate: KubeVirt's
/// `pkg/virt-operator/resource/generate/components/secrets.go` issues it
/// (`VirtHandlerVsockClientCertSecretName`) from the same CA as the migration, monitoring,
/// virt-handler and synchronization clients.
pub const VSOCK_CLIENT_NAME: &str = "kubevirt.io:system:client:vsock";
/// How old the bundle in force may grow before virt-handler is asked again: our choice, a
/// small part of the CA's renewal period — OpenShift's HCO renews KubeVirt's CA every 24 hours
/// (`api/v1beta1/hyperconverged_types.go`: 48 h lifetime, 24 h renewBefore) and KubeVirt's own
/// default is 7 days; a chain that fails to verify asks at once anyway.
pub const VSOCK_CA_REFRESH: Duration = Duration::from_secs(3600);

impl Default for VsockConfig {
    fn default() -> Self {
        VsockConfig {
            enabled: true,
            port: DEFAULT_PORT,
            tls: true,
            client_ca: PathBuf::from(VSOCK_CLIENT_CA),
            client_names: vec![VSOCK_CLIENT_NAME.to_string()],
            ca_refresh: Some(VSOCK_CA_REFRESH),
            cert: String::new(),
            key: String::new(),
        }
    }
}

/// The service's port, TCP and vsock alike.
pub const DEFAULT_PORT: u32 = 9440;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlatformConfig {
    pub url: String,
    pub token_file: PathBuf,
    pub ca_file: String,
    #[serde(deserialize_with = "duration")]
    pub interval: Duration,
}

impl Default for PlatformConfig {
    fn default() -> Self {
        PlatformConfig {
            url: String::new(),
            token_file: PathBuf::from("/etc/phq-agent/platform-token"),
            ca_file: String::new(),
            interval: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ProbeLevel {
    /// No probes (configuration only: `probes.at_boot = "none"`).
    #[value(skip)]
    None,
    /// 64 MiB copies, memory test with 3 patterns, 4096² GEMM: seconds per GPU.
    Quick,
    /// nvbandwidth's 512 MiB copies, moving inversions added, 8192² GEMM.
    Standard,
    /// More samples, bit fade added, 16384² GEMM, a minute of all GPUs at once: minutes.
    Full,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProbesConfig {
    pub at_boot: ProbeLevel,
    /// `None` is "off".
    #[serde(deserialize_with = "duration_or_off")]
    pub when_idle: Option<Duration>,
    /// The service's probes run in a child process, killed past twice their planned GPU time
    /// plus this (CUDA's start, JIT compilation, the host's own work).
    #[serde(deserialize_with = "duration")]
    pub deadline_margin: Duration,
    /// Each NCCL all-reduce runs in a child process, killed past twice its planned transfers
    /// plus this (NCCL's start: topology search and a connection per pair of GPUs).
    #[serde(deserialize_with = "duration")]
    pub nccl_allowance: Duration,
    /// `POST /v1/probes`: at most this many accepted requests per `request_window`; 0 turns
    /// the platform's re-checks off (`serve::recheck` rule 3).
    pub max_requests: u32,
    #[serde(deserialize_with = "duration")]
    pub request_window: Duration,
}

/// What NCCL's start is allowed by default (`probes.nccl_allowance`), beyond an all-reduce's
/// planned transfers: our choice, above the longest starts reported for one node of 8 GPUs —
/// 7 communicators in 31 s (NVIDIA/nccl#534), 55 s for one, 52 s of it loading kernels
/// (NVIDIA/nccl#1646, DGX B200) — and short enough that a hang is reported within minutes.
pub const NCCL_ALLOWANCE: Duration = Duration::from_secs(180);

/// The platform's re-checks allowed per hour by default (`probes.max_requests`). Our choice: a
/// re-check before each hand-over to a new tenant needs one; six leave room for retries, and
/// six full levels (about 300 s each with cuBLAS) still hold the GPUs for under half the hour.
pub const MAX_REQUESTS: u32 = 6;

impl Default for ProbesConfig {
    fn default() -> Self {
        ProbesConfig {
            at_boot: ProbeLevel::Quick,
            when_idle: Some(Duration::from_secs(24 * 3600)),
            deadline_margin: Duration::from_secs(120),
            nccl_allowance: NCCL_ALLOWANCE,
            max_requests: MAX_REQUESTS,
            request_window: Duration::from_secs(3600),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    pub dcgm_compat: bool,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InstallConfig {
    pub cuda: String,
    pub driver_branch: String,
    pub repo_url: String,
    pub repo_key_fingerprint: String,
    /// A mirror of EPEL's root (`…/pub/epel`), for RHEL guests; empty for Fedora's own.
    pub epel_url: String,
    /// The key EPEL's release package and its key file must be, by whole fingerprint; empty for
    /// Fedora's EPEL 9 key. Only for a mirror that re-signs EPEL with its own key.
    pub epel_key_fingerprint: String,
    /// Replace an installed driver of another branch (or the proprietary flavour).
    pub replace_driver: bool,
    /// Allow `http://` mirrors (`repo_url`, `epel_url`). Off: only `https://` and `file://`.
    pub allow_plain_http: bool,
}

impl Default for InstallConfig {
    fn default() -> Self {
        InstallConfig {
            cuda: crate::facts::DEFAULT_CUDA.into(),
            driver_branch: crate::facts::DEFAULT_DRIVER_BRANCH.to_string(),
            repo_url: String::new(),
            repo_key_fingerprint: String::new(),
            epel_url: String::new(),
            epel_key_fingerprint: String::new(),
            replace_driver: false,
            allow_plain_http: false,
        }
    }
}

fn duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    let v = humantime::parse_duration(&s)
        .map_err(|e| serde::de::Error::custom(format!("{e}: expected a duration such as \"60s\" or \"5m\"")))?;
    if v.is_zero() {
        return Err(serde::de::Error::custom("expected a duration above zero, such as \"60s\""));
    }
    Ok(v)
}

fn duration_or_off<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let s = String::deserialize(d)?;
    if s == "off" {
        return Ok(None);
    }
    humantime::parse_duration(&s)
        .map(Some)
        .map_err(|e| serde::de::Error::custom(format!("{e}: expected a duration such as \"24h\", or \"off\"")))
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The keys a running service cannot take over on SIGHUP (they shape what it set up at start:
/// its listener, its TLS acceptor, its push client, its state), that differ between `old` and
/// `new`. The service says them, so a reload never seems to apply what it did not.
pub fn restart_needed(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut keys = Vec::new();
    let mut check = |changed: bool, key: &'static str| {
        if changed {
            keys.push(key);
        }
    };
    check(old.agent.id != new.agent.id, "agent.id");
    check(old.agent.state_dir != new.agent.state_dir, "agent.state_dir");
    check(old.http.enabled != new.http.enabled, "http.enabled");
    check(old.http.listen != new.http.listen, "http.listen");
    check(old.http.tls_cert != new.http.tls_cert, "http.tls_cert");
    check(old.http.tls_key != new.http.tls_key, "http.tls_key");
    check(old.http.client_ca != new.http.client_ca, "http.client_ca");
    check(old.http.client_names != new.http.client_names, "http.client_names");
    check(old.vsock != new.vsock, "vsock");
    check(old.platform.url != new.platform.url, "platform.url");
    check(old.platform.ca_file != new.platform.ca_file, "platform.ca_file");
    check(old.nvml.init_timeout != new.nvml.init_timeout, "nvml.init_timeout");
    check(old.nvml.gpu_timeout != new.nvml.gpu_timeout, "nvml.gpu_timeout");
    check(old.nvml.events_timeout != new.nvml.events_timeout, "nvml.events_timeout");
    keys
}

/// A configuration file is text of at most this size.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// A configuration file's text: a regular file (a FIFO would hang the agent), at most
/// `MAX_CONFIG_BYTES`, UTF-8.
fn read_file(path: &Path) -> std::io::Result<String> {
    let bytes = crate::sysroot::read_regular(path, false, MAX_CONFIG_BYTES)?;
    String::from_utf8(bytes).map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "is not UTF-8 text"))
}

/// Loads `path` and the drop-ins beside it. A missing file is fine when `path` is the default
/// (a fresh machine has none); a missing file named on the command line is an error.
pub fn load(path: &Path, must_exist: bool) -> Result<Config, ConfigError> {
    let mut files = Vec::new();
    match read_file(path) {
        Ok(text) => files.push((path.to_path_buf(), text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !must_exist => {}
        Err(source) => return Err(ConfigError::Read { path: path.to_path_buf(), source }),
    }
    let dropins = path.parent().unwrap_or(Path::new(".")).join("config.d");
    match std::fs::read_dir(&dropins) {
        Ok(entries) => {
            // As systemd reads its drop-in directories (conf-files.c): `*.toml` names only,
            // hidden and backup files skipped, and anything that is not a regular file (a FIFO,
            // a device, a link to /dev/null) passed over rather than read.
            let mut names: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "toml"))
                .filter(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
                .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file()))
                .collect();
            names.sort();
            for p in names {
                let text = read_file(&p).map_err(|source| ConfigError::Read { path: p.clone(), source })?;
                files.push((p, text));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(ConfigError::Read { path: dropins, source }),
    }
    from_files(&files)
}

/// Parses and merges already-read files, in order. Separate from `load` so tests need no disk.
pub fn from_files(files: &[(PathBuf, String)]) -> Result<Config, ConfigError> {
    let mut merged = toml::Table::new();
    let mut origins: BTreeMap<String, PathBuf> = BTreeMap::new();
    for (path, text) in files {
        let table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::Invalid { path: path.clone(), message: describe(text, &e) })?;
        // Validate the file on its own so errors point at it.
        toml::from_str::<Config>(text)
            .map_err(|e| ConfigError::Invalid { path: path.clone(), message: describe(text, &e) })?;
        merge(&mut merged, table, "", path, &mut origins);
    }
    let config = Config::deserialize(toml::Value::Table(merged)).map_err(|e| ConfigError::Invalid {
        path: files.last().map(|f| f.0.clone()).unwrap_or_default(),
        message: e.to_string(),
    })?;
    validate(&config).map_err(|(key, message)| ConfigError::Invalid {
        path: origins.get(key).cloned().unwrap_or_else(|| PathBuf::from("(defaults)")),
        message: format!("{key}: {message}"),
    })?;
    Ok(config)
}

fn merge(
    into: &mut toml::Table,
    from: toml::Table,
    prefix: &str,
    path: &Path,
    origins: &mut BTreeMap<String, PathBuf>,
) {
    for (key, value) in from {
        let full = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        match (into.get_mut(&key), value) {
            (Some(toml::Value::Table(existing)), toml::Value::Table(new)) => merge(existing, new, &full, path, origins),
            (_, value) => {
                if let toml::Value::Table(t) = &value {
                    for k in t.keys() {
                        origins.insert(format!("{full}.{k}"), path.to_path_buf());
                    }
                }
                origins.insert(full, path.to_path_buf());
                into.insert(key, value);
            }
        }
    }
}

/// toml's message, with the dotted key the error is about when it can be found from the span.
fn describe(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim().to_string();
    let Some(span) = e.span() else { return message };
    let before = &text[..span.start.min(text.len())];
    let line_no = before.matches('\n').count() + 1;
    let section = before
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('[') && l.ends_with(']'))
        .map(|l| l.trim_matches(|c| c == '[' || c == ']').trim().to_string());
    let line = text.lines().nth(line_no - 1).unwrap_or("").trim();
    let key = line.split('=').next().unwrap_or("").trim();
    match (section, key.is_empty() || line.starts_with('[')) {
        (Some(s), false) => format!("line {line_no}: key `{s}.{key}`: {message}"),
        (None, false) => format!("line {line_no}: key `{key}`: {message}"),
        _ => format!("line {line_no}: {message}"),
    }
}

/// A mirror of a package repository (`install.repo_url`, `install.epel_url`, `--repo-url`), or
/// empty. It becomes part of an apt source line or a dnf repository file that root writes, so
/// it must be one URL and nothing else: `check_url`'s rules, and `http://` only when
/// `install.allow_plain_http` says so (then only signed metadata and packages are trusted from
/// it, as from any mirror). The message names `setting`.
pub fn check_mirror_url(setting: &str, url: &str, allow_plain_http: bool) -> Result<(), String> {
    mirror_url(url, allow_plain_http).map_err(|e| format!("{setting}: {e}"))
}

fn mirror_url(url: &str, allow_plain_http: bool) -> Result<(), String> {
    if url.is_empty() {
        return Ok(());
    }
    let parsed = check_url(url, &["https", "http", "file"])?;
    if parsed.scheme() == "http" && !allow_plain_http {
        return Err(format!(
            "{url:?} is plain http: anyone on the path can withhold or replay what it serves; use https://, or set install.allow_plain_http = true to accept it (signatures are still checked)"
        ));
    }
    Ok(())
}

/// One URL of the given schemes and nothing else. The text is checked before it is parsed, since
/// a URL parser forgives what an apt source or an INI file does not: the WHATWG parser that
/// `url` follows drops tabs and newlines and percent-encodes spaces. Refused: white space and
/// control characters (a newline starts a new line of the file it lands in), `[` and `]` (an
/// apt source's options: `[trusted=yes]`; an INI section header), `#` (a comment, or a fragment
/// a repository never has), quotes, backslashes and the like, and credentials in the URL.
pub fn check_url(text: &str, schemes: &[&str]) -> Result<url::Url, String> {
    no_space(text)?;
    if let Some(c) = text.chars().find(|c| matches!(c, '[' | ']')) {
        return Err(format!("{text:?} holds {c:?}, which has no place in a repository URL"));
    }
    check_any_url(text, schemes)
}

/// `check_url` without its refusal of `[` and `]`, for a URL that is only ever requested, never
/// written into a file (`platform.url`, whose host may be an IPv6 literal).
fn check_any_url(text: &str, schemes: &[&str]) -> Result<url::Url, String> {
    no_space(text)?;
    if let Some(c) =
        text.chars().find(|c| matches!(c, '#' | '"' | '\'' | '\\' | '`' | '<' | '>' | '{' | '}' | '|' | '^'))
    {
        return Err(format!("{text:?} holds {c:?}, which has no place in a URL here"));
    }
    let u = url::Url::parse(text).map_err(|e| format!("{text:?} is not a URL: {e}"))?;
    if !schemes.contains(&u.scheme()) {
        let list: Vec<String> = schemes.iter().map(|s| format!("{s}://")).collect();
        return Err(format!("{text:?}: expected a {} URL", list.join(" or ")));
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err(format!("{text:?} carries credentials; give a URL without them"));
    }
    if u.scheme() != "file" && u.host_str().is_none_or(str::is_empty) {
        return Err(format!("{text:?} names no host"));
    }
    if u.query().is_some() {
        return Err(format!("{text:?} has a query (?…); a repository root has none"));
    }
    Ok(u)
}

fn no_space(text: &str) -> Result<(), String> {
    match text.chars().find(|c| c.is_whitespace() || c.is_control()) {
        Some(c) => Err(format!("{text:?} holds {c:?}: a URL has no white space or control characters")),
        None => Ok(()),
    }
}

/// Checks values that parse but make no sense. Returns the dotted key and what was expected.
/// The longest `nvml.init_timeout`: the unit's `TimeoutStartSec=90` waits for READY=1, which
/// the service sends by the init deadline at the latest; the rest is for the non-NVML readings.
pub const MAX_NVML_INIT_TIMEOUT: Duration = Duration::from_secs(60);

fn validate(c: &Config) -> Result<(), (&'static str, String)> {
    if c.nvml.init_timeout > MAX_NVML_INIT_TIMEOUT {
        return Err((
            "nvml.init_timeout",
            format!(
                "{} is longer than {} s: systemd (TimeoutStartSec=90) would stop the service before it is ready",
                humantime::format_duration(c.nvml.init_timeout),
                MAX_NVML_INIT_TIMEOUT.as_secs()
            ),
        ));
    }
    if crate::facts::cuda_min_driver(&c.install.cuda).is_none() || !c.install.cuda.starts_with("12.") {
        let known: Vec<&str> =
            crate::facts::CUDA_MIN_DRIVER.iter().map(|(v, _)| *v).filter(|v| v.starts_with("12.")).collect();
        return Err((
            "install.cuda",
            format!(
                "{:?} is not a CUDA 12 release this agent knows; expected one of {}",
                c.install.cuda,
                known.join(", ")
            ),
        ));
    }
    match c.install.driver_branch.parse::<u32>() {
        Ok(b) if b >= crate::facts::MIN_DRIVER_BRANCH => {}
        _ => {
            return Err((
                "install.driver_branch",
                format!(
                    "{:?}: expected a driver branch number of at least {} (for example \"550\")",
                    c.install.driver_branch,
                    crate::facts::MIN_DRIVER_BRANCH
                ),
            ))
        }
    }
    for (key, value) in [
        ("install.repo_key_fingerprint", &c.install.repo_key_fingerprint),
        ("install.epel_key_fingerprint", &c.install.epel_key_fingerprint),
    ] {
        let fp: String = value.chars().filter(|c| !c.is_whitespace()).collect();
        if !fp.is_empty() && (fp.len() != 40 || !fp.bytes().all(|b| b.is_ascii_hexdigit())) {
            return Err((key, "expected a 40-hex-digit OpenPGP fingerprint (spaces allowed)".into()));
        }
    }
    let plain = c.install.allow_plain_http;
    mirror_url(&c.install.repo_url, plain).map_err(|e| ("install.repo_url", e))?;
    mirror_url(&c.install.epel_url, plain).map_err(|e| ("install.epel_url", e))?;
    if !c.platform.url.is_empty() {
        check_any_url(&c.platform.url, &["https", "http"])
            .map_err(|e| ("platform.url", format!("{e}, or empty for no push")))?;
    }
    if c.http.tls_cert.is_empty() != c.http.tls_key.is_empty() {
        return Err(("http.tls_key", "tls_cert and tls_key go together: set both or neither".into()));
    }
    if !c.http.client_ca.is_empty() && c.http.tls_cert.is_empty() {
        return Err(("http.client_ca", "client certificates need TLS: set tls_cert and tls_key too".into()));
    }
    if !c.http.client_ca.is_empty() && c.http.client_names.iter().all(|n| n.trim().is_empty()) {
        return Err((
            "http.client_names",
            "a client certificate must carry one of these names: name at least one".into(),
        ));
    }
    if c.agent.expected_gpus == Some(0) {
        return Err(("agent.expected_gpus", "expected at least 1 (leave it out to skip the count check)".into()));
    }
    validate_vsock(&c.vsock)
}

/// vsock(7): ports above 1023 need no privilege, and `VMADDR_PORT_ANY` (-1U) is not a port.
fn validate_vsock(v: &VsockConfig) -> Result<(), (&'static str, String)> {
    if v.port == 0 || v.port == u32::MAX {
        return Err(("vsock.port", format!("{} is not a port to listen on; expected 1 to 4294967294", v.port)));
    }
    if v.cert.is_empty() != v.key.is_empty() {
        // Named by the one that is set, so the message points at the file that set it.
        let key = if v.cert.is_empty() { "vsock.key" } else { "vsock.cert" };
        return Err((key, "cert and key go together: set both or neither (neither: generated)".into()));
    }
    if v.tls && v.client_names.iter().all(|n| n.trim().is_empty()) {
        return Err((
            "vsock.client_names",
            format!("a client certificate must carry one of these names: name at least one (KubeVirt's is {VSOCK_CLIENT_NAME:?})"),
        ));
    }
    if v.tls && v.client_ca.as_os_str().is_empty() {
        return Err(("vsock.client_ca", "TLS over vsock requires client certificates: name the CA bundle".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(text: &str) -> Result<Config, ConfigError> {
        from_files(&[(PathBuf::from("/etc/phq-agent/config.toml"), text.to_string())])
    }

    #[test]
    fn empty_is_all_defaults() {
        assert_eq!(one("").unwrap(), Config::default());
    }

    #[test]
    fn design_example_parses() {
        let text = include_str!("../packaging/config.toml");
        let c = one(text).unwrap();
        assert_eq!(c.http.listen.port(), 9440);
        assert_eq!(c.platform.interval, Duration::from_secs(60));
        assert_eq!(c.probes.when_idle, Some(Duration::from_secs(86400)));
        assert_eq!(c.nvml, NvmlConfig::default(), "the shipped file says the defaults");
        assert_eq!(c.probes, ProbesConfig::default());
        assert_eq!(c.vsock, VsockConfig::default(), "the shipped file says the defaults");
        assert!(c.http.enabled);
    }

    #[test]
    fn vsock_settings_are_checked() {
        let c = one("[http]\nenabled = false\n[vsock]\nport = 5000\ntls = false\n").unwrap();
        assert!(!c.http.enabled);
        assert_eq!((c.vsock.port, c.vsock.tls), (5000, false));
        for (text, key) in [
            ("[vsock]\nport = 0\n", "vsock.port"),
            ("[vsock]\nport = 4294967295\n", "vsock.port"),
            ("[vsock]\ncert = \"/c.pem\"\n", "vsock.cert"),
            ("[vsock]\nclient_ca = \"\"\n", "vsock.client_ca"),
        ] {
            let e = one(text).unwrap_err().to_string();
            assert!(e.starts_with("/etc/phq-agent/config.toml: ") && e.contains(key), "{text}: {e}");
        }
        let e = one("[vsock]\nport = -1\n").unwrap_err().to_string();
        assert!(e.contains("vsock.port"), "{e}");
    }

    #[test]
    fn an_nvml_init_deadline_past_what_systemd_waits_for_is_refused() {
        let c = one("[nvml]\ninit_timeout = \"5s\"\ngpu_timeout = \"2s\"\n").unwrap();
        assert_eq!(c.nvml.deadlines().init, Duration::from_secs(5));
        assert_eq!(c.nvml.deadlines().gpu, Duration::from_secs(2));
        let e = one("[nvml]\ninit_timeout = \"2m\"\n").unwrap_err().to_string();
        assert!(e.contains("nvml.init_timeout") || e.contains("TimeoutStartSec"), "{e}");
        assert!(one("[nvml]\ngpu_timeout = \"0s\"\n").is_err(), "a zero deadline is no deadline");
    }

    #[test]
    fn unknown_key_names_file_key_and_line() {
        let e = one("[agent]\nid = \"x\"\nexpectd_gpus = 8\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/phq-agent/config.toml: line 3: key `agent.expectd_gpus`"), "{e}");
        assert!(e.contains("unknown field `expectd_gpus`"), "{e}");
        assert!(e.contains("expected_gpus"), "{e}");
    }

    #[test]
    fn bad_type_says_what_was_expected() {
        let e = one("[agent]\nexpected_gpus = \"eight\"\n").unwrap_err().to_string();
        assert!(e.contains("key `agent.expected_gpus`"), "{e}");
        assert!(e.contains("u32") || e.contains("integer"), "{e}");
        let e = one("[platform]\ninterval = \"soon\"\n").unwrap_err().to_string();
        assert!(e.contains("platform.interval") && e.contains("duration"), "{e}");
    }

    #[test]
    fn a_reload_names_the_keys_that_need_a_restart() {
        let old = Config::default();
        let mut new = old.clone();
        new.platform.interval = Duration::from_secs(120);
        new.agent.expected_gpus = Some(8);
        assert!(restart_needed(&old, &new).is_empty(), "these apply at once");
        new.http.listen = "127.0.0.1:9441".parse().unwrap();
        new.platform.url = "https://platform.invalid".into();
        assert_eq!(restart_needed(&old, &new), vec!["http.listen", "platform.url"]);
    }

    #[test]
    fn hidden_and_non_regular_dropins_are_passed_over_and_a_fifo_config_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let main = dir.path().join("config.toml");
        std::fs::write(&main, "[agent]\nexpected_gpus = 2\n").unwrap();
        let d = dir.path().join("config.d");
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("10-real.toml"), "[agent]\nexpected_gpus = 4\n").unwrap();
        std::fs::write(d.join(".20-hidden.toml"), "[agent]\nexpected_gpus = 5\n").unwrap();
        let fifo = |p: &Path| {
            let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
            // SAFETY: mkfifo with a valid C string.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        };
        fifo(&d.join("30-fifo.toml"));
        std::os::unix::fs::symlink("/dev/null", d.join("40-masked.toml")).unwrap();
        let c = load(&main, true).unwrap();
        assert_eq!(c.agent.expected_gpus, Some(4));
        // The main file itself must be one: a FIFO there is a clear error, at once.
        let other = dir.path().join("other.toml");
        fifo(&other);
        let e = load(&other, true).unwrap_err().to_string();
        assert!(e.contains("other.toml") && e.contains("FIFO"), "{e}");
    }

    #[test]
    fn dropins_override_key_by_key_and_errors_name_the_dropin() {
        let files = vec![
            (PathBuf::from("/c/config.toml"), "[agent]\nexpected_gpus = 8\nid = \"a\"\n".to_string()),
            (PathBuf::from("/c/config.d/10-gpus.toml"), "[agent]\nexpected_gpus = 4\n".to_string()),
        ];
        let c = from_files(&files).unwrap();
        assert_eq!(c.agent.expected_gpus, Some(4));
        assert_eq!(c.agent.id, "a");

        let files = vec![
            (PathBuf::from("/c/config.toml"), "[install]\ncuda = \"12.4\"\n".to_string()),
            (PathBuf::from("/c/config.d/20-cuda.toml"), "[install]\ncuda = \"12.7\"\n".to_string()),
        ];
        let e = from_files(&files).unwrap_err().to_string();
        assert!(e.starts_with("/c/config.d/20-cuda.toml: install.cuda: \"12.7\""), "{e}");
    }

    #[test]
    fn syntax_error_names_file_and_line() {
        let e = one("[agent\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/phq-agent/config.toml: line 1"), "{e}");
    }

    #[test]
    fn tls_pairs_and_bad_listen() {
        assert!(one("[http]\ntls_cert = \"/c.pem\"\n").unwrap_err().to_string().contains("http.tls_key"));
        let e = one("[http]\nlisten = \"everywhere\"\n").unwrap_err().to_string();
        assert!(e.contains("http.listen"), "{e}");
    }

    #[test]
    fn install_urls_must_be_urls() {
        for key in ["repo_url", "epel_url"] {
            let e = one(&format!("[install]\n{key} = \"mirror.internal/epel\"\n")).unwrap_err().to_string();
            assert!(e.contains(&format!("install.{key}")) && e.contains("is not a URL"), "{e}");
            assert!(one(&format!("[install]\n{key} = \"https://mirror.internal.example/x\"\n")).is_ok());
        }
    }

    /// A mirror URL is written into an apt source or a dnf repository file by root: one TOML
    /// escape (`\n`) would add a repository of its own. Refused from the main file and from a
    /// drop-in alike, naming the file and the setting; plain http only when allowed explicitly.
    #[test]
    fn a_mirror_url_that_would_add_a_line_is_refused_from_every_file() {
        for (value, why) in [
            ("https://mirror.example/cuda\\ndeb [trusted=yes] http://evil.example/ ./", "'\\n'"),
            ("https://mirror.example/cuda\\r[evil]", "'\\r'"),
            ("https://mirror.example/cuda [trusted=yes]", "' '"),
            ("https://mirror.example/[evil]", "'['"),
            ("https://mirror.example/cuda#frag", "'#'"),
            ("https://mirror.example/cuda?x=1", "query"),
            ("http://mirror.example/cuda", "plain http"),
        ] {
            for key in ["repo_url", "epel_url"] {
                let text = format!("[install]\n{key} = \"{value}\"\n");
                let e = one(&text).unwrap_err().to_string();
                assert!(e.contains(&format!("install.{key}")) && e.contains(why), "{value:?}: {e}");
                let e = from_files(&[
                    (PathBuf::from("/etc/phq-agent/config.toml"), String::new()),
                    (PathBuf::from("/etc/phq-agent/config.d/50-cloud-init.toml"), text),
                ])
                .unwrap_err()
                .to_string();
                assert!(e.starts_with("/etc/phq-agent/config.d/50-cloud-init.toml: install."), "{e}");
            }
        }
        assert!(one("[install]\nrepo_url = \"http://mirror.example/cuda\"\nallow_plain_http = true\n").is_ok());
        // The platform's URL is only ever requested: an IPv6 literal is fine, a newline is not.
        assert!(one("[platform]\nurl = \"https://[fd00::1]:8443/\"\n").is_ok());
        assert!(one("[platform]\nurl = \"https://p.example/\\nX\"\n")
            .unwrap_err()
            .to_string()
            .contains("platform.url"));
    }

    #[test]
    fn missing_default_file_is_fine_missing_named_file_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.toml");
        assert_eq!(load(&p, false).unwrap(), Config::default());
        let e = load(&p, true).unwrap_err().to_string();
        assert!(e.contains("config.toml") && e.contains("No such file"), "{e}");
    }

    #[test]
    fn when_idle_off() {
        assert_eq!(one("[probes]\nwhen_idle = \"off\"\nat_boot = \"none\"\n").unwrap().probes.when_idle, None);
        assert!(one("[probes]\nat_boot = \"fast\"\n").unwrap_err().to_string().contains("quick"));
    }
}
