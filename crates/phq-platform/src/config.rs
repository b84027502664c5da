//! The poller's configuration (TOML), every field with its default; docs/platform.md lists them.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The node this poller serves (the DaemonSet gives it from the downward API as
    /// `NODE_NAME`); the `node` label of every series whose target does not name one.
    pub node: String,
    /// Where the poller serves its own `/metrics` and `/healthz`.
    pub listen: String,
    /// A Prometheus `file_sd` JSON file of targets, re-read when it changes.
    pub targets_file: Option<PathBuf>,
    /// The platform's own namespaces, where it runs validation VMs between tenant leases: what
    /// their agents say is `source="validation"`; everything else is `source="tenant"`.
    pub validation_namespaces: Vec<String>,
    pub poll: Poll,
    pub tls: Tls,
    pub token: Token,
    pub validation: Validation,
    pub kubernetes: Kubernetes,
}

/// Targets from the API server: this node's running VMIs with GPUs (`kube`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Kubernetes {
    pub enabled: bool,
    /// `host:port` of the API server; in a pod, from `KUBERNETES_SERVICE_HOST` and
    /// `KUBERNETES_SERVICE_PORT` (the kubelet sets both).
    pub api_server: String,
    /// The cluster's CA and the ServiceAccount's token, where Kubernetes mounts them in a pod.
    pub ca_file: PathBuf,
    pub token_file: PathBuf,
    /// How the poller reaches those VMIs' agents: `tls` (the pod network, the platform's
    /// certificate) or `vsock` (KubeVirt's vsock subresource; needs the VSOCK feature gate).
    pub transport: String,
    /// The agent's port, on the pod network or vsock.
    pub agent_port: u16,
}

impl Default for Kubernetes {
    fn default() -> Self {
        let env = |k: &str| std::env::var(k).unwrap_or_default();
        let api_server = match (env("KUBERNETES_SERVICE_HOST"), env("KUBERNETES_SERVICE_PORT")) {
            (h, p) if !h.is_empty() && !p.is_empty() && h.contains(':') => format!("[{h}]:{p}"),
            (h, p) if !h.is_empty() && !p.is_empty() => format!("{h}:{p}"),
            _ => String::new(),
        };
        Kubernetes {
            enabled: false,
            api_server,
            ca_file: PathBuf::from("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"),
            token_file: PathBuf::from("/var/run/secrets/kubernetes.io/serviceaccount/token"),
            transport: "tls".to_string(),
            agent_port: 9440,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Poll {
    /// Each target is polled every `interval` plus a random part of `jitter`.
    #[serde(with = "humantime_serde_compat")]
    pub interval: Duration,
    #[serde(with = "humantime_serde_compat")]
    pub jitter: Duration,
    /// One poll (connect, TLS, both requests, both bodies) ends by then, whatever the guest does.
    #[serde(with = "humantime_serde_compat")]
    pub timeout: Duration,
    /// The most bytes read from one answer's body; past it the poll fails as `too_large`.
    pub max_bytes: usize,
    /// How many polls run at once; the rest wait for a slot.
    pub concurrency: usize,
    /// The most `phq_guest_*` series one VM may have; the rest are counted, not served.
    pub max_series_per_vmi: usize,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tls {
    /// The platform's client certificate and key (PEM) for `transport = "tls"`: the agent
    /// lets it read and start work when it chains to the agent's `http.client_ca` and carries
    /// a name in `http.client_names` (docs/vsock.md). Read again when the files change, so a
    /// rotated Secret is used without a restart.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Token {
    /// The agent's read token for `transport = "http"` (a lab, the README's try-it).
    pub read_token_file: Option<PathBuf>,
    /// The agent's control token, for `POST /v1/probes` to validation VMs over `http`.
    pub control_token_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Validation {
    /// Ask each validation VM's agent for a probe run this often (none when unset). Never a
    /// tenant's VM.
    #[serde(with = "humantime_serde_opt")]
    pub probe_interval: Option<Duration>,
    /// `quick`, `standard` or `full` (the agent's levels).
    pub probe_level: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            node: String::new(),
            // The poller's port: 9441, next to the agent's 9440.
            listen: "0.0.0.0:9441".to_string(),
            targets_file: None,
            validation_namespaces: Vec::new(),
            poll: Poll::default(),
            tls: Tls::default(),
            token: Token::default(),
            validation: Validation::default(),
            kubernetes: Kubernetes::default(),
        }
    }
}

impl Default for Poll {
    fn default() -> Self {
        Poll {
            // 30–60 s between polls of one VM: the agent's snapshot is 30 s old at most.
            interval: Duration::from_secs(30),
            jitter: Duration::from_secs(30),
            timeout: Duration::from_secs(10),
            // An 8-GPU report is about 60 KB and its /metrics about 50 KB; 4 MiB is room for
            // growth and a bound on what one guest can make the poller hold.
            max_bytes: 4 << 20,
            concurrency: 16,
            max_series_per_vmi: 512,
        }
    }
}

impl Default for Validation {
    fn default() -> Self {
        Validation { probe_interval: None, probe_level: "full".to_string() }
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading the config {}", path.display()))?;
        let mut c: Config = toml::from_str(&text).with_context(|| format!("the config {}", path.display()))?;
        if c.node.is_empty() {
            c.node = std::env::var("NODE_NAME").unwrap_or_default();
        }
        c.check().with_context(|| format!("the config {}", path.display()))?;
        Ok(c)
    }

    fn check(&self) -> Result<()> {
        if self.poll.interval.is_zero() || self.poll.timeout.is_zero() {
            bail!("poll.interval and poll.timeout must be more than 0");
        }
        if self.poll.timeout > self.poll.interval {
            bail!(
                "poll.timeout ({:?}) must not be longer than poll.interval ({:?})",
                self.poll.timeout,
                self.poll.interval
            );
        }
        if self.poll.concurrency == 0 || self.poll.max_bytes == 0 {
            bail!("poll.concurrency and poll.max_bytes must be more than 0");
        }
        if !["quick", "standard", "full"].contains(&self.validation.probe_level.as_str()) {
            bail!("validation.probe_level {:?} is not quick, standard or full", self.validation.probe_level);
        }
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            bail!("tls.cert_file and tls.key_file go together");
        }
        if self.targets_file.is_none() && !self.kubernetes.enabled {
            bail!("neither targets_file nor kubernetes.enabled: the poller has nothing to poll");
        }
        if self.kubernetes.enabled {
            if self.node.is_empty() {
                bail!("kubernetes.enabled needs the node's name: node, or NODE_NAME from the downward API");
            }
            if self.kubernetes.api_server.is_empty() {
                bail!("kubernetes.api_server is not set and KUBERNETES_SERVICE_HOST is not in the environment");
            }
            if !["tls", "vsock"].contains(&self.kubernetes.transport.as_str()) {
                bail!("kubernetes.transport {:?} is not tls or vsock", self.kubernetes.transport);
            }
        }
        Ok(())
    }
}

/// Durations as humantime writes them ("30s", "1h 30m").
mod humantime_serde_compat {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}

mod humantime_serde_opt {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map(Some).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_names_what_is_wrong() {
        let bad: Result<Config, _> = toml::from_str("[poll]\ninterval = \"soon\"\n");
        assert!(format!("{:#}", bad.unwrap_err()).contains("interval"));
        let c: Config =
            toml::from_str("targets_file = \"t.json\"\n[poll]\ninterval = \"5s\"\ntimeout = \"10s\"\n").unwrap();
        assert!(c.check().unwrap_err().to_string().contains("must not be longer"));
        let unknown: Result<Config, _> = toml::from_str("[poll]\nintervall = \"5s\"\n");
        assert!(format!("{:#}", unknown.unwrap_err()).contains("intervall"));
    }
}
