//! HTTPS for the endpoint (rustls with the ring provider), and client certificates.
//!
//! `http.tls_cert` + `http.tls_key`: serve HTTPS. `http.client_ca` too: a client certificate
//! signed by that CA authorizes `/v1/status` and `/metrics` without the bearer token. A client
//! without a certificate still gets through the handshake (a KubeVirt readinessProbe presents
//! none), and then needs the token like anyone else; a certificate the CA did not sign fails
//! the handshake.

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
        builder.with_client_cert_verifier(verifier)
    };
    let mut config =
        builder.with_single_cert(certs, key).map_err(|e| anyhow!("{} / {}: {e}", http.tls_cert, http.tls_key))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))))
}
