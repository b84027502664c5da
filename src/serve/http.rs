//! The HTTP endpoint. The cluster has no default-deny NetworkPolicy, so:
//! - only `/healthz` answers without credentials, and says only ok / degraded / unhealthy;
//! - `/v1/status` and `/metrics` need the bearer token (compared in constant time);
//! - every answer comes from the last published snapshot, never computed per request;
//! - connections are capped, headers must arrive within `HEADER_TIMEOUT` and fit in
//!   `MAX_HEADER_BYTES`, and a connection lives at most `CONNECTION_LIFETIME`, so slow or
//!   oversized clients cannot hold the agent.

use super::{current, Published, Shared};
use crate::report::Health;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, Response, StatusCode};
use axum::routing::get;
use axum::Extension;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

pub const MAX_CONNECTIONS: usize = 256;
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

pub fn router(shared: Shared) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/v1/status", get(status))
        .route("/metrics", get(metrics))
        .with_state(shared)
}

/// How the client on a connection proved itself, if it did (a verified client certificate).
#[derive(Debug, Clone, Copy, Default)]
pub struct ClientCert(pub bool);

/// Accepts connections until `shutdown` resolves; HTTPS when `tls` is given.
pub async fn serve(
    listener: TcpListener,
    shared: Shared,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let app = router(shared);
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // At the cap, a new connection is closed at once rather than queued: a flood then
        // costs the agent nothing, and the connections already open keep being served.
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "connection limit reached; closing");
            drop(stream);
            continue;
        };
        let app = app.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let served = async {
                match tls {
                    None => connection(stream, app.layer(axum::Extension(ClientCert(false)))).await,
                    Some(acceptor) => match tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls_stream)) => {
                            // With a client CA, a certificate present after the handshake is one it signed.
                            let verified = tls_stream.get_ref().1.peer_certificates().is_some_and(|c| !c.is_empty());
                            connection(tls_stream, app.layer(axum::Extension(ClientCert(verified)))).await
                        }
                        Ok(Err(e)) => Err(format!("TLS handshake: {e}")),
                        Err(_) => Err("TLS handshake timed out".into()),
                    },
                }
            };
            match tokio::time::timeout(CONNECTION_LIFETIME, served).await {
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "connection ended with an error"),
                Err(_) => tracing::debug!(%peer, "connection lifetime reached; closed"),
                Ok(Ok(())) => {}
            }
            drop(permit);
        });
    }
}

/// One HTTP/1.1 connection with the header limits.
async fn connection<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static>(
    stream: S,
    app: Router,
) -> Result<(), String> {
    hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_HEADER_BYTES)
        .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app))
        .await
        .map_err(|e| e.to_string())
}

fn plain(status: StatusCode, body: &'static str) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Body::from(body))
        .unwrap_or_default()
}

async fn healthz(State(shared): State<Shared>) -> Response<Body> {
    match current(&shared) {
        None => plain(StatusCode::SERVICE_UNAVAILABLE, "starting\n"),
        Some(p) => match p.health {
            Health::Healthy => plain(StatusCode::OK, "ok\n"),
            // Could not check everything, or something warns: still usable, so ready.
            Health::Degraded | Health::Unknown => plain(StatusCode::OK, "degraded\n"),
            Health::Unhealthy => plain(StatusCode::SERVICE_UNAVAILABLE, "unhealthy\n"),
        },
    }
}

/// Checks the client certificate or the bearer token; `Some` is the refusal to send instead.
fn refusal(p: &Published, headers: &HeaderMap, cert: ClientCert) -> Option<Response<Body>> {
    if cert.0 {
        return None;
    }
    let Some(expected) = p.token.as_deref() else {
        return Some(plain(StatusCode::SERVICE_UNAVAILABLE, "no token configured: see http.token_file\n"));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if constant_time_eq(given.trim().as_bytes(), expected.as_bytes()) {
        return None;
    }
    let mut r = plain(StatusCode::UNAUTHORIZED, "unauthorized\n");
    r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
    Some(r)
}

/// Compares without an early exit, so the time taken says nothing about where a guess went
/// wrong; the length is not secret.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The published snapshot for a caller that proved itself; else the answer to send instead.
fn published_for(
    shared: &Shared,
    headers: &HeaderMap,
    cert: ClientCert,
) -> Result<Arc<Published>, Box<Response<Body>>> {
    let p = current(shared).ok_or_else(|| Box::new(plain(StatusCode::SERVICE_UNAVAILABLE, "starting\n")))?;
    match refusal(&p, headers, cert) {
        Some(r) => Err(Box::new(r)),
        None => Ok(p),
    }
}

async fn status(
    State(shared): State<Shared>,
    Extension(cert): Extension<ClientCert>,
    headers: HeaderMap,
) -> Response<Body> {
    let p = match published_for(&shared, &headers, cert) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(p.report_json.clone()))
        .unwrap_or_default()
}

async fn metrics(
    State(shared): State<Shared>,
    Extension(cert): Extension<ClientCert>,
    headers: HeaderMap,
) -> Response<Body> {
    let p = match published_for(&shared, &headers, cert) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let wants_openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    let (ct, body) = if wants_openmetrics {
        (OPENMETRICS, p.metrics_openmetrics.clone())
    } else {
        (TEXT_FORMAT, p.metrics_text.clone())
    };
    Response::builder().header(header::CONTENT_TYPE, ct).body(Body::from(body)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
