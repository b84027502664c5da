//! HTTPS for the endpoint (rustls with the ring provider), and client certificates.
//!
//! `http.tls_cert` + `http.tls_key`: serve HTTPS. `http.client_ca` too: a client certificate
//! signed by that CA and named in `http.client_names` (`client_name`) is the platform on TCP,
//! as virt-handler's is on vsock: it reads and may start work. A client without a certificate
//! still gets through the handshake (a KubeVirt readinessProbe presents none, a tenant's
//! Prometheus its token), and then needs a token like anyone else; a certificate the CA did not
//! sign, or with another name, fails the handshake.

use anyhow::{anyhow, Context};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::Arc;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};

pub fn acceptor(http: &crate::config::HttpConfig) -> anyhow::Result<Option<tokio_rustls::TlsAcceptor>> {
    if http.tls_cert.is_empty() {
        return Ok(None);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&http.tls_cert)
        .with_context(|| format!("{} (http.tls_cert)", http.tls_cert))?
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow!("{} (http.tls_cert): {e}", http.tls_cert))?;
    if certs.is_empty() {
        anyhow::bail!("{} (http.tls_cert): no certificate in it", http.tls_cert);
    }
    let key =
        PrivateKeyDer::from_pem_file(&http.tls_key).map_err(|e| anyhow!("{} (http.tls_key): {e}", http.tls_key))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?;
    let builder = if http.client_ca.is_empty() {
        builder.with_no_client_auth()
    } else {
        let mut roots = RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(&http.client_ca)
            .with_context(|| format!("{} (http.client_ca)", http.client_ca))?
        {
            roots
                .add(c.map_err(|e| anyhow!("{} (http.client_ca): {e}", http.client_ca))?)
                .map_err(|e| anyhow!("{} (http.client_ca): {e}", http.client_ca))?;
        }
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .allow_unauthenticated()
            .build()
            .map_err(|e| anyhow!("{} (http.client_ca): {e}", http.client_ca))?;
        builder.with_client_cert_verifier(super::client_name::Named::new(
            verifier,
            &http.client_names,
            "http.client_names",
        ))
    };
    let mut config =
        builder.with_single_cert(certs, key).map_err(|e| anyhow!("{} / {}: {e}", http.tls_cert, http.tls_key))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))))
}

/// What the vsock listener speaks (`serve::vsock` rule 2), and the line that says so.
pub struct VsockTls {
    pub acceptor: Option<tokio_rustls::TlsAcceptor>,
    /// KubeVirt's bundle, kept current (`client_ca`), when the listener speaks TLS.
    pub ca: Option<Arc<super::client_ca::ReloadingCa>>,
    /// The agent's own certificate when it made it, for the daily rotation check.
    pub own: Option<Arc<super::own_cert::Rotating>>,
    pub said: String,
}

/// TLS 1.3 only (virt-handler asks for `MinVersion: tls.VersionTLS13`, KubeVirt
/// pkg/virt-handler/vsock/dial.go), a client certificate required and chained to
/// `vsock.client_ca`, refused in the handshake before any route runs; or plain, when
/// `vsock.tls = false`.
pub fn vsock_acceptor(vsock: &crate::config::VsockConfig, state_dir: &std::path::Path) -> anyhow::Result<VsockTls> {
    if !vsock.tls {
        return Ok(VsockTls {
            acceptor: None,
            ca: None,
            own: None,
            said: "plain (vsock.tls = false): bearer token required".into(),
        });
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let ca = vsock.client_ca.display().to_string();
    // KubeVirt's bundle, read again at the first handshake after the file changes (client_ca.rs).
    let store = state_dir.join(super::client_ca::STORE);
    let verifier =
        super::client_ca::ReloadingCa::new(&vsock.client_ca, Some(store), vsock.ca_refresh, provider.clone())?;
    let waiting = if verifier.waiting() { ", none yet: every client refused until one comes" } else { "" };
    let names = vsock.client_names.join(", ");
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3")?
        .with_client_cert_verifier(super::client_name::Named::new(
            verifier.clone(),
            &vsock.client_names,
            "vsock.client_names",
        ));
    let (mut config, own, said) = if vsock.cert.is_empty() {
        let (own, said) = super::own_cert::Rotating::new(state_dir, provider)?;
        (builder.with_cert_resolver(own.clone()), Some(own), said)
    } else {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&vsock.cert)
            .map_err(|e| anyhow!("{} (vsock.cert): {e}", vsock.cert))?
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow!("{} (vsock.cert): {e}", vsock.cert))?;
        let key = PrivateKeyDer::from_pem_file(&vsock.key).map_err(|e| anyhow!("{} (vsock.key): {e}", vsock.key))?;
        let config =
            builder.with_single_cert(certs, key).map_err(|e| anyhow!("{} / {}: {e}", vsock.cert, vsock.key))?;
        (config, None, format!("server certificate {}", vsock.cert))
    };
    // No session resumption: a resumed TLS 1.3 session skips the client certificate (RFC 8446
    // §2.2, the PSK stands in for it), so a client the bundle no longer trusts (a rotated or
    // replaced CA) would keep its access for the ticket's lifetime. The platform polls every
    // 30 s or so; a full handshake each time costs a few milliseconds.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(VsockTls {
        acceptor: Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))),
        ca: Some(verifier),
        own,
        said: format!("TLS 1.3, client certificate required (CA {ca}{waiting}; named {names}); {said}"),
    })
}
