//! The Kubernetes side: this node's VMIs from the API server (a list, then a watch), and the
//! connection through the API server to KubeVirt's vsock subresource.
//!
//! Which VMIs: KubeVirt's VMI CRD declares no selectable fields, and the API server takes only
//! `metadata.name` and `metadata.namespace` as field selectors of a custom resource without them
//! (a `fieldSelector=status.nodeName=…` is answered 400 "field label not supported"). KubeVirt's
//! own node agent selects the VMIs of its node by the label `kubevirt.io/nodeName` that KubeVirt
//! sets on each scheduled VMI (`pkg/controller/virtinformers.go`, `NodeNameLabel` in
//! `api/core/v1/types.go`), and so does this. The label is on an object its namespace's users may
//! edit, so a VMI is taken only when its `status.nodeName` is this node as well.
//!
//! Written by hand, not with kube-rs: the poller needs one list, one watch and one upgrade, and a
//! kube-rs build (its client, k8s-openapi's types, tower) costs minutes of every CI run on 2 cores.

use crate::targets::{Target, Transport};
use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio_rustls::rustls;

/// KubeVirt's label naming the node a VMI runs on (api/core/v1/types.go, NodeNameLabel).
pub const NODE_NAME_LABEL: &str = "kubevirt.io/nodeName";

/// The API server, its CA and the ServiceAccount token (re-read at each request: a projected
/// token is rotated by the kubelet, as client-go's file token source re-reads it).
pub struct Api {
    /// `host:port`.
    pub address: String,
    pub host: String,
    pub tls: Arc<rustls::ClientConfig>,
    pub token_file: PathBuf,
}

impl Api {
    pub fn new(address: String, ca_file: &std::path::Path, token_file: PathBuf) -> Result<Api> {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(ca_file)
            .with_context(|| format!("the API server's CA {}", ca_file.display()))?
        {
            roots.add(c.with_context(|| format!("the API server's CA {}", ca_file.display()))?)?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let host = address.rsplit_once(':').map(|(h, _)| h.trim_matches(['[', ']']).to_string()).unwrap_or_default();
        Ok(Api { address, host, tls: Arc::new(tls), token_file })
    }

    fn token(&self) -> Result<String> {
        let t = std::fs::read_to_string(&self.token_file)
            .with_context(|| format!("the ServiceAccount token {}", self.token_file.display()))?;
        Ok(t.trim().to_string())
    }

    /// A TLS connection to the API server, its name checked against the cluster's CA.
    pub async fn connect(&self) -> Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let tcp = TcpStream::connect(&self.address)
            .await
            .with_context(|| format!("connecting to the API server {}", self.address))?;
        let name =
            ServerName::try_from(self.host.clone()).map_err(|e| anyhow!("the API server's name {}: {e}", self.host))?;
        tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(name, tcp)
            .await
            .with_context(|| format!("TLS with the API server {}", self.address))
    }

    /// A GET whose body is handed over as it comes (a list, or a watch's stream).
    async fn get(&self, path_and_query: &str) -> Result<hyper::Response<hyper::body::Incoming>> {
        let io = self.connect().await?;
        let (mut send, conn) = hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(io)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let req = Request::get(path_and_query)
            .header(hyper::header::HOST, &self.address)
            .header(hyper::header::AUTHORIZATION, format!("Bearer {}", self.token()?))
            .header(hyper::header::ACCEPT, "application/json")
            .header(hyper::header::USER_AGENT, concat!("phq-platform/", env!("CARGO_PKG_VERSION")))
            .body(Empty::new())?;
        Ok(send.send_request(req).await?)
    }

    /// The path and query of this node's VMIs, cluster-wide.
    fn vmis(node: &str, extra: &str) -> String {
        format!(
            "/apis/kubevirt.io/v1/virtualmachineinstances?labelSelector={}{extra}",
            encode(&format!("{NODE_NAME_LABEL}={node}"))
        )
    }

    /// Lists this node's VMIs: the items and the list's resourceVersion (pages of 250).
    pub async fn list(&self, node: &str) -> Result<(Vec<Value>, String)> {
        let mut items = Vec::new();
        let mut cont = String::new();
        loop {
            let extra = if cont.is_empty() {
                "&limit=250".to_string()
            } else {
                format!("&limit=250&continue={}", encode(&cont))
            };
            let resp = self.get(&Self::vmis(node, &extra)).await?;
            let status = resp.status();
            let body = capped(resp.into_body(), 64 << 20).await?;
            if !status.is_success() {
                bail!("listing VMIs: HTTP {status}: {}", status_message(&body));
            }
            let list: Value = serde_json::from_slice(&body).context("the VMI list is not JSON")?;
            items.extend(list["items"].as_array().cloned().unwrap_or_default());
            cont = list["metadata"]["continue"].as_str().unwrap_or("").to_string();
            if cont.is_empty() {
                let rv = list["metadata"]["resourceVersion"].as_str().unwrap_or("").to_string();
                return Ok((items, rv));
            }
        }
    }

    /// Watches this node's VMIs from `rv`, calling `event` with each (type, object) as it comes,
    /// until the server ends the watch. `Err(Gone)` when `rv` is too old (410): list again.
    pub async fn watch(&self, node: &str, rv: &str, mut event: impl FnMut(&str, &Value)) -> Result<String, WatchEnd> {
        let extra = format!("&watch=true&allowWatchBookmarks=true&timeoutSeconds=290&resourceVersion={}", encode(rv));
        let resp = self.get(&Self::vmis(node, &extra)).await.map_err(|e| WatchEnd::Failed(format!("{e:#}")))?;
        let status = resp.status();
        let mut body = resp.into_body();
        if status.as_u16() == 410 {
            return Err(WatchEnd::Gone);
        }
        if !status.is_success() {
            let b = capped(body, 1 << 20).await.unwrap_or_default();
            return Err(WatchEnd::Failed(format!("watching VMIs: HTTP {status}: {}", status_message(&b))));
        }
        let mut rv = rv.to_string();
        let mut line = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| WatchEnd::Failed(e.to_string()))?;
            let Some(data) = frame.data_ref() else { continue };
            for &b in data.iter() {
                if b != b'\n' {
                    line.push(b);
                    // One VMI object is kilobytes; 4 MiB is a bound, not a size.
                    if line.len() > 4 << 20 {
                        return Err(WatchEnd::Failed("a watch event over 4 MiB".into()));
                    }
                    continue;
                }
                let ev: Value =
                    serde_json::from_slice(&line).map_err(|e| WatchEnd::Failed(format!("a watch event: {e}")))?;
                line.clear();
                let kind = ev["type"].as_str().unwrap_or("");
                if kind == "ERROR" {
                    // A Status: 410 Expired when the resourceVersion left the watch cache.
                    if ev["object"]["code"].as_u64() == Some(410) {
                        return Err(WatchEnd::Gone);
                    }
                    return Err(WatchEnd::Failed(format!("the watch said: {}", ev["object"]["message"])));
                }
                if let Some(v) = ev["object"]["metadata"]["resourceVersion"].as_str() {
                    rv = v.to_string();
                }
                if kind != "BOOKMARK" {
                    event(kind, &ev["object"]);
                }
            }
        }
        Ok(rv)
    }
}

#[derive(Debug)]
pub enum WatchEnd {
    /// 410: the resourceVersion is too old; list again.
    Gone,
    Failed(String),
}

/// The target a VMI makes on this node: running here, with GPUs, reachable by `transport`
/// (`Vsock` needs `autoattachVSOCK`; TCP the address of its first interface). `None` otherwise.
pub fn target_of(vmi: &Value, node: &str, transport: Transport, port: u16) -> Option<Target> {
    let meta = &vmi["metadata"];
    let (namespace, name, uid) =
        (meta["namespace"].as_str()?, meta["name"].as_str()?, meta["uid"].as_str().unwrap_or(""));
    if vmi["status"]["nodeName"].as_str() != Some(node) || vmi["status"]["phase"].as_str() != Some("Running") {
        return None;
    }
    let devices = &vmi["spec"]["domain"]["devices"];
    let gpus = |k: &str| devices[k].as_array().is_some_and(|a| !a.is_empty());
    if !gpus("gpus") && !gpus("hostDevices") {
        return None;
    }
    let address = match transport {
        Transport::Vsock => {
            if devices["autoattachVSOCK"].as_bool() != Some(true) {
                return None;
            }
            format!("{namespace}/{name}")
        }
        Transport::Tls | Transport::Http => {
            let ip: std::net::IpAddr =
                vmi["status"]["interfaces"].as_array()?.iter().find_map(|i| i["ipAddress"].as_str()?.parse().ok())?;
            std::net::SocketAddr::new(ip, port).to_string()
        }
    };
    Some(Target {
        node: node.to_string(),
        namespace: namespace.to_string(),
        vmi: name.to_string(),
        vmi_uid: uid.to_string(),
        address,
        transport,
    })
}

/// The upgrade to KubeVirt's vsock subresource for `target` (`address` is `namespace/name`):
/// returns the upgraded connection and the bytes read past the `101` head.
pub async fn vsock(
    api: &Api,
    target: &Target,
    port: u16,
    random: fn(&mut [u8]),
) -> Result<(tokio_rustls::client::TlsStream<TcpStream>, Vec<u8>), String> {
    use tokio::io::AsyncWriteExt;
    let (ns, name) = target.address.split_once('/').ok_or("not a namespace/name")?;
    let mut io = api.connect().await.map_err(|e| format!("{e:#}"))?;
    let key = crate::ws::new_key(&|b| random(b));
    let token = api.token().map_err(|e| format!("{e:#}"))?;
    // GET …/vsock?port=&tls=true (pkg/virt-api/rest/vsock.go: tls=true has virt-handler speak TLS
    // to the agent with its client certificate).
    let head = format!(
        "GET /apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances/{name}/vsock?port={port}&tls=true HTTP/1.1\r\n\
         Host: {}\r\nAuthorization: Bearer {token}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Protocol: {}\r\n\
         User-Agent: phq-platform/{}\r\n\r\n",
        api.address,
        crate::ws::PLAIN,
        env!("CARGO_PKG_VERSION")
    );
    io.write_all(head.as_bytes()).await.map_err(|e| e.to_string())?;
    let first = crate::ws::read_upgrade(&mut io, &key).await?;
    Ok((io, first))
}

async fn capped(mut body: hyper::body::Incoming, max: usize) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    while let Some(f) = body.frame().await {
        if let Some(d) = f?.data_ref() {
            if out.len() + d.len() > max {
                bail!("an answer over {max} bytes");
            }
            out.extend_from_slice(d);
        }
    }
    Ok(out)
}

/// A Kubernetes Status body's message, or the body's first bytes.
fn status_message(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(200)]).to_string())
}

/// Percent-encodes a query value (RFC 3986's unreserved characters stay).
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(node: &str, phase: &str, gpus: bool, vsock: bool) -> Value {
        serde_json::json!({
            "metadata": {"namespace": "team-a", "name": "train-0", "uid": "6f1c0000-0000-4000-8000-000000000001",
                         "labels": {NODE_NAME_LABEL: node}},
            "spec": {"domain": {"devices": {"gpus": if gpus { serde_json::json!([{"name": "gpu0", "deviceName": "nvidia.com/GH100_H100_SXM5_80GB"}]) } else { serde_json::json!([]) },
                                            "autoattachVSOCK": vsock}}},
            "status": {"nodeName": node, "phase": phase, "interfaces": [{"name": "default", "ipAddress": "10.128.2.17"}]}
        })
    }

    #[test]
    fn a_vmi_is_a_target_when_it_runs_here_with_gpus() {
        let t = target_of(&vmi("gpu-node-1", "Running", true, false), "gpu-node-1", Transport::Tls, 9440).unwrap();
        assert_eq!(
            (t.address.as_str(), t.vmi.as_str(), t.node.as_str()),
            ("10.128.2.17:9440", "train-0", "gpu-node-1")
        );
        assert!(target_of(&vmi("gpu-node-2", "Running", true, false), "gpu-node-1", Transport::Tls, 9440).is_none());
        assert!(target_of(&vmi("gpu-node-1", "Scheduling", true, false), "gpu-node-1", Transport::Tls, 9440).is_none());
        assert!(target_of(&vmi("gpu-node-1", "Running", false, false), "gpu-node-1", Transport::Tls, 9440).is_none());
        assert!(target_of(&vmi("gpu-node-1", "Running", true, false), "gpu-node-1", Transport::Vsock, 9440).is_none());
        let v = target_of(&vmi("gpu-node-1", "Running", true, true), "gpu-node-1", Transport::Vsock, 9440).unwrap();
        assert_eq!(v.address, "team-a/train-0");
        // The label says this node, the status another: not this node's.
        let mut moved = vmi("gpu-node-1", "Running", true, false);
        moved["status"]["nodeName"] = "gpu-node-9".into();
        assert!(target_of(&moved, "gpu-node-1", Transport::Tls, 9440).is_none());
    }

    #[test]
    fn the_selector_is_the_label_kubevirt_sets() {
        assert_eq!(
            Api::vmis("gpu-node-1", ""),
            "/apis/kubevirt.io/v1/virtualmachineinstances?labelSelector=kubevirt.io%2FnodeName%3Dgpu-node-1"
        );
    }
}
