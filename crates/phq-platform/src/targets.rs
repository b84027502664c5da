//! The targets: each VM the poller owns, its identity, its address and how to reach it.
//!
//! Identity (node, namespace, VMI name and UID) comes from the platform — the targets file the
//! platform writes, and later KubeVirt's VMI objects — never from what an agent answers.
//!
//! The file is Prometheus's `file_sd` JSON (a list of `{"targets": [...], "labels": {...}}`,
//! prometheus.io/docs/prometheus/latest/configuration/configuration/#file_sd_config), so the same
//! file a platform already writes for Prometheus serves here, with these labels:
//! `namespace` and `vmi` (required), `vmi_uid`, `node` (default: the poller's), `transport`
//! (`tls`, the default, or `http`).

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Transport {
    /// TCP with the platform's client certificate (mTLS): the supported path on OpenShift.
    Tls,
    /// Plain HTTP with the agent's bearer token: a lab, the README's try-it.
    Http,
    /// KubeVirt's vsock subresource through the API server (targets from Kubernetes only; the
    /// address is `namespace/name`).
    Vsock,
}

impl Transport {
    pub fn word(self) -> &'static str {
        match self {
            Transport::Tls => "tls",
            Transport::Http => "http",
            Transport::Vsock => "vsock",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Target {
    pub node: String,
    pub namespace: String,
    pub vmi: String,
    pub vmi_uid: String,
    /// `host:port`.
    pub address: String,
    pub transport: Transport,
}

#[derive(Deserialize)]
struct Group {
    targets: Vec<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

/// The file's targets, every entry checked; one bad entry fails the file (the caller keeps the
/// targets it had) and the error says which.
pub fn parse(text: &str, node: &str) -> Result<Vec<Target>> {
    let groups: Vec<Group> = serde_json::from_str(text).context("not a file_sd list of {\"targets\", \"labels\"}")?;
    let mut out = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        let at = |what: String| anyhow!("entry {i}: {what}");
        for (k, _) in g.labels.iter() {
            if !["namespace", "vmi", "vmi_uid", "node", "transport"].contains(&k.as_str()) && !k.starts_with("__") {
                return Err(at(format!("unknown label {k:?} (namespace, vmi, vmi_uid, node, transport)")));
            }
        }
        let label = |k: &str| g.labels.get(k).cloned().unwrap_or_default();
        let namespace = label("namespace");
        let vmi = label("vmi");
        if !is_k8s_name(&namespace, 63) {
            return Err(at(format!("namespace {namespace:?} is not a Kubernetes namespace name")));
        }
        if !is_k8s_name(&vmi, 253) {
            return Err(at(format!("vmi {vmi:?} is not a Kubernetes object name")));
        }
        let vmi_uid = label("vmi_uid");
        if !vmi_uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-') || vmi_uid.len() > 36 {
            return Err(at(format!("vmi_uid {vmi_uid:?} is not a UID")));
        }
        let node_label = g.labels.get("node").map(String::as_str).unwrap_or(node).to_string();
        if !node_label.is_empty() && !is_k8s_name(&node_label, 253) {
            return Err(at(format!("node {node_label:?} is not a node name")));
        }
        let transport = match g.labels.get("transport").map(String::as_str) {
            None | Some("tls") => Transport::Tls,
            Some("http") => Transport::Http,
            Some(other) => return Err(at(format!("transport {other:?} is not tls or http"))),
        };
        if g.targets.len() != 1 {
            return Err(at(format!("{} addresses: one VM is one address", g.targets.len())));
        }
        let address = g.targets[0].clone();
        if address.parse::<std::net::SocketAddr>().is_err() {
            return Err(at(format!("address {address:?} is not IP:port")));
        }
        out.push(Target { node: node_label, namespace, vmi, vmi_uid, address, transport });
    }
    let mut seen = std::collections::BTreeSet::new();
    for t in &out {
        if !seen.insert((&t.namespace, &t.vmi)) {
            bail!("{}/{} is listed twice", t.namespace, t.vmi);
        }
    }
    Ok(out)
}

pub fn load(path: &Path, node: &str) -> Result<Vec<Target>> {
    let meta = std::fs::metadata(path).with_context(|| format!("the targets file {}", path.display()))?;
    if !meta.is_file() {
        bail!("the targets file {} is not a regular file", path.display());
    }
    // A file_sd file for one node lists its VMs: 8 GPUs, at most 8 VMs. 16 MiB is a bound, not
    // a size.
    if meta.len() > 16 << 20 {
        bail!("the targets file {} is {} bytes; more than 16 MiB is not a targets file", path.display(), meta.len());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the targets file {}", path.display()))?;
    parse(&text, node).with_context(|| format!("the targets file {}", path.display()))
}

/// A DNS-1123 name as Kubernetes takes it for namespaces (label, ≤ 63) and objects (subdomain,
/// ≤ 253): lower-case letters, digits, `-` and, for subdomains, `.`.
fn is_k8s_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || (max > 63 && b == b'.'))
        && !s.starts_with('-')
        && !s.ends_with('-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_targets_file_is_checked_entry_by_entry() {
        let ok = r#"[{"targets":["10.0.0.5:9440"],"labels":{"namespace":"team-a","vmi":"train-0","vmi_uid":"6f1c-aa","transport":"http"}}]"#;
        let t = parse(ok, "gpu-node-1").unwrap();
        assert_eq!(t[0].node, "gpu-node-1");
        assert_eq!(t[0].transport, Transport::Http);
        for (bad, says) in [
            (r#"[{"targets":["10.0.0.5:9440"],"labels":{"vmi":"a"}}]"#, "namespace"),
            (r#"[{"targets":["10.0.0.5:9440"],"labels":{"namespace":"A B","vmi":"a"}}]"#, "namespace"),
            (r#"[{"targets":["example:9440"],"labels":{"namespace":"a","vmi":"a"}}]"#, "IP:port"),
            (
                r#"[{"targets":["10.0.0.5:9440"],"labels":{"namespace":"a","vmi":"a","source":"validation"}}]"#,
                "unknown label",
            ),
            (
                r#"[{"targets":["10.0.0.5:9440"],"labels":{"namespace":"a","vmi":"a","transport":"vsock"}}]"#,
                "transport",
            ),
            (r#"{"targets":[]}"#, "file_sd"),
        ] {
            let e = format!("{:#}", parse(bad, "n").unwrap_err());
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
