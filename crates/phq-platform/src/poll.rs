//! One poll of one agent: connect, TLS with the platform's certificate (or a token on plain
//! HTTP), `GET /v1/status` and `GET /metrics` on one HTTP/1.1 connection, each body read up to a
//! byte cap. The caller puts the whole of it under one deadline, so a guest that stalls, trickles
//! or floods costs its own slot for at most that long.

use crate::targets::{Target, Transport};
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use std::path::Path;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::rustls::{self, client::danger, DigitallySignedStruct, SignatureScheme};

/// Why a poll failed: a closed set, the `reason` label of `phq_poll_failures_total`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    Connect(String),
    Tls(String),
    Timeout,
    /// The body passed `poll.max_bytes`.
    TooLarge,
    /// Not 200 (401/403: the agent does not take our credential).
    Status(u16),
    /// A `Content-Encoding` we did not ask for (we ask for `identity`: no gzip bombs).
    Encoding,
    /// Not a `phq.status/v1` report, or not one the view can read; says which field.
    Schema(String),
    /// The poller's own credentials could not be read.
    Credentials(String),
    Protocol(String),
}

impl Failure {
    pub fn reason(&self) -> &'static str {
        match self {
            Failure::Connect(_) => "connect",
            Failure::Tls(_) => "tls",
            Failure::Timeout => "timeout",
            Failure::TooLarge => "too_large",
            Failure::Status(_) => "http_status",
            Failure::Encoding => "encoding",
            Failure::Schema(_) => "schema",
            Failure::Credentials(_) => "credentials",
            Failure::Protocol(_) => "protocol",
        }
    }

    pub const REASONS: [&'static str; 9] =
        ["connect", "credentials", "encoding", "http_status", "protocol", "schema", "timeout", "tls", "too_large"];
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Connect(e) => write!(f, "connect: {e}"),
            Failure::Tls(e) => write!(f, "TLS: {e}"),
            Failure::Timeout => write!(f, "no complete answer within the poll's deadline"),
            Failure::TooLarge => write!(f, "the answer passed poll.max_bytes"),
            Failure::Status(s) => write!(f, "HTTP {s}"),
            Failure::Encoding => write!(f, "a Content-Encoding other than identity"),
            Failure::Schema(e) => write!(f, "not a phq.status/v1 report: {e}"),
            Failure::Credentials(e) => write!(f, "the poller's credentials: {e}"),
            Failure::Protocol(e) => write!(f, "HTTP: {e}"),
        }
    }
}

/// What a credential gives: a TLS client config, or a bearer token.
pub enum Credential {
    Tls(Arc<rustls::ClientConfig>),
    Bearer(String),
    /// Through the API server to KubeVirt's vsock subresource, to this port of the guest.
    Vsock(Arc<crate::kube::Api>, u16),
}

/// The client config for `transport = "tls"`: the platform's certificate, and no check of the
/// agent's. The agent's certificate is the tenant's to make (it is root in the guest), so it
/// would prove nothing; which VM answered is known from the address the platform assigned, and
/// what it says is a claim whatever the certificate. virt-handler does the same on the vsock
/// path (it presents its certificate and does not verify the agent's: docs/platform.md).
pub fn tls_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ClientConfig>, Failure> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|i| i.collect())
        .map_err(|e| Failure::Credentials(format!("{}: {e}", cert.display())))?;
    if certs.is_empty() {
        return Err(Failure::Credentials(format!("{}: no certificate", cert.display())));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| Failure::Credentials(format!("{}: {e}", key.display())))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Failure::Credentials(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)))
        .with_client_auth_cert(certs, key)
        .map_err(|e| Failure::Credentials(format!("the certificate and key: {e}")))?;
    Ok(Arc::new(config))
}

/// Random bytes from the same source as the TLS handshakes' (ring's system random).
pub fn random(b: &mut [u8]) {
    let _ = rustls::crypto::ring::default_provider().secure_random.fill(b);
}

/// `tls_config`, made again only when the certificate's or the key's file changes (a rotated
/// Secret: the kubelet swaps the files, so their inode, size or time changes), not at each poll.
pub fn tls_config_cached(cert: &Path, key: &Path) -> Result<Arc<rustls::ClientConfig>, Failure> {
    type Cached = ((Stamp, Stamp), Arc<rustls::ClientConfig>);
    static CACHE: std::sync::Mutex<Option<Cached>> = std::sync::Mutex::new(None);
    let now = (stamp(cert), stamp(key));
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((seen, config)) = cache.as_ref() {
        if *seen == now && now.0.is_some() && now.1.is_some() {
            return Ok(config.clone());
        }
    }
    let config = tls_config(cert, key)?;
    *cache = Some((now, config.clone()));
    Ok(config)
}

/// What tells a file's new contents from its old without reading it: its inode, size and
/// modification time. A rotated Secret's files are new ones: the kubelet writes them into a new
/// timestamped directory and renames the `..data` symlink over the old one (Kubernetes'
/// pkg/volume/util/atomic_writer.go, `AtomicWriter.Write`), so the mounted path, followed
/// through the links, names another inode. None when the file cannot be read.
type Stamp = Option<FileStamp>;
type FileStamp = (u64, u64, std::time::SystemTime);

fn stamp(p: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).ok()?;
    Some((m.ino(), m.len(), m.modified().ok()?))
}

/// A bearer token's file, trimmed, read again only when the file changes (as
/// `tls_config_cached`): opening and reading it at every poll was a twentieth of the poller's
/// CPU (perf, 2026-12-06), one stat is what is left.
pub fn token_cached(file: &Path) -> Result<String, Failure> {
    type Cached = std::collections::HashMap<std::path::PathBuf, (FileStamp, String)>;
    static CACHE: std::sync::Mutex<Option<Cached>> = std::sync::Mutex::new(None);
    let now = stamp(file);
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    let cache = cache.get_or_insert_with(Default::default);
    if let (Some(now), Some((seen, token))) = (now, cache.get(file)) {
        if *seen == now {
            return Ok(token.clone());
        }
    }
    let token = std::fs::read_to_string(file).map_err(|e| Failure::Credentials(format!("{}: {e}", file.display())))?;
    let token = token.trim().to_string();
    match now {
        Some(now) => cache.insert(file.to_path_buf(), (now, token.clone())),
        None => cache.remove(file),
    };
    Ok(token)
}

/// Takes any server certificate (see `tls_config`) but still checks the handshake's signatures,
/// so the session is with whoever holds the key it presented.
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<danger::ServerCertVerified, rustls::Error> {
        Ok(danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// One request's answer: its status and its body, whole, under the cap.
pub struct Answer {
    pub status: StatusCode,
    pub body: Bytes,
}

/// A request to send: method, path, body.
pub struct Ask<'a> {
    pub method: hyper::Method,
    pub path: &'a str,
    pub body: Bytes,
}

/// Connects to the target and sends each request in turn on the one connection.
pub async fn exchange(
    target: &Target,
    cred: &Credential,
    asks: &[Ask<'_>],
    max_bytes: usize,
) -> Result<Vec<Answer>, Failure> {
    if let (Transport::Vsock, Credential::Vsock(api, port)) = (target.transport, cred) {
        let (upgraded, first) = crate::kube::vsock(api, target, *port, random).await.map_err(Failure::Connect)?;
        // The HTTP client writes and reads a byte stream; the pipe carries it in WebSocket
        // frames (ws::pipe). Both ends go when the exchange is over.
        let (near, far) = tokio::io::duplex(64 << 10);
        let pipe = tokio::spawn(crate::ws::pipe(upgraded, far, first, max_bytes, random));
        let r = over(near, None, &target.address, asks, max_bytes).await;
        pipe.abort();
        return r;
    }
    let tcp = TcpStream::connect(&target.address).await.map_err(|e| Failure::Connect(e.to_string()))?;
    let _ = tcp.set_nodelay(true);
    match (target.transport, cred) {
        (Transport::Tls, Credential::Tls(config)) => {
            let name = ServerName::IpAddress(tcp.peer_addr().map_err(|e| Failure::Connect(e.to_string()))?.ip().into());
            let tls = tokio_rustls::TlsConnector::from(config.clone())
                .connect(name, tcp)
                .await
                .map_err(|e| Failure::Tls(e.to_string()))?;
            over(tls, None, &target.address, asks, max_bytes).await
        }
        (Transport::Http, Credential::Bearer(token)) => over(tcp, Some(token), &target.address, asks, max_bytes).await,
        _ => Err(Failure::Credentials(format!("no credential for transport {}", target.transport.word()))),
    }
}

async fn over<S>(
    io: S,
    bearer: Option<&str>,
    host: &str,
    asks: &[Ask<'_>],
    max_bytes: usize,
) -> Result<Vec<Answer>, Failure>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut send, conn) = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(io))
        .await
        .map_err(|e| Failure::Protocol(e.to_string()))?;
    // The connection's task ends with the exchange: dropping `send` closes it.
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut out = Vec::with_capacity(asks.len());
    for ask in asks {
        let mut req = Request::builder()
            .method(ask.method.clone())
            .uri(ask.path)
            .header(hyper::header::HOST, host)
            .header(hyper::header::USER_AGENT, concat!("phq-platform/", env!("CARGO_PKG_VERSION")))
            .header(hyper::header::ACCEPT_ENCODING, "identity");
        if let Some(t) = bearer {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        if !ask.body.is_empty() {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        let req = req.body(Full::new(ask.body.clone())).map_err(|e| Failure::Protocol(e.to_string()))?;
        send.ready().await.map_err(|e| Failure::Protocol(e.to_string()))?;
        let resp = send.send_request(req).await.map_err(|e| Failure::Protocol(e.to_string()))?;
        let status = resp.status();
        if resp.headers().get(hyper::header::CONTENT_ENCODING).is_some_and(|v| v.as_bytes() != b"identity") {
            return Err(Failure::Encoding);
        }
        let length =
            resp.headers().get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if length.is_some_and(|n| n > max_bytes as u64) {
            return Err(Failure::TooLarge);
        }
        // Within the cap (above), so the length said ahead reserves at most `max_bytes`.
        let body = capped(resp.into_body(), max_bytes, length.unwrap_or(0) as usize).await?;
        out.push(Answer { status, body });
    }
    drop(send);
    conn.abort();
    Ok(out)
}

/// Reads a body frame by frame and stops at the cap: a 1 GB answer costs `max_bytes` at most.
/// `expected` (the Content-Length, within the cap) is reserved at once: a report grown by
/// doubling was copied several times over, and its last step (128 KiB: glibc serves a request
/// that large with mmap, `M_MMAP_THRESHOLD`'s default in mallopt(3)) was mapped and unmapped at
/// every poll. The reservation is address space: pages count only once the guest's bytes arrive.
async fn capped(mut body: Incoming, max_bytes: usize, expected: usize) -> Result<Bytes, Failure> {
    let mut buf = BytesMut::with_capacity(expected.min(max_bytes));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Failure::Protocol(e.to_string()))?;
        if let Some(data) = frame.data_ref() {
            if buf.len() + data.len() > max_bytes {
                return Err(Failure::TooLarge);
            }
            buf.extend_from_slice(data);
        }
    }
    Ok(buf.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_pair(dir: &Path) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, "phq-platform");
        let cert = p.self_signed(&key).unwrap();
        // Written beside and renamed over, as the kubelet swaps a Secret's files.
        std::fs::write(dir.join("tls.crt.new"), cert.pem()).unwrap();
        std::fs::write(dir.join("tls.key.new"), key.serialize_pem()).unwrap();
        std::fs::rename(dir.join("tls.crt.new"), dir.join("tls.crt")).unwrap();
        std::fs::rename(dir.join("tls.key.new"), dir.join("tls.key")).unwrap();
    }

    #[test]
    fn a_token_is_read_again_only_when_its_file_changes() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "first-token\n").unwrap();
        assert_eq!(token_cached(&file).unwrap(), "first-token");
        // Other bytes under the same inode, size and time: only a read would see them.
        let when = std::fs::metadata(&file).unwrap().modified().unwrap();
        std::fs::write(&file, "other-token\n").unwrap();
        std::fs::File::options().write(true).open(&file).unwrap().set_modified(when).unwrap();
        assert_eq!(token_cached(&file).unwrap(), "first-token", "read again without a change");
        // Rotated as the kubelet rotates a Secret's file: a new one renamed over it.
        std::fs::write(dir.path().join("token.new"), "rotated-token\n").unwrap();
        std::fs::rename(dir.path().join("token.new"), &file).unwrap();
        assert_eq!(token_cached(&file).unwrap(), "rotated-token", "a rotated token was not read");
        std::fs::remove_file(&file).unwrap();
        assert!(matches!(token_cached(&file), Err(Failure::Credentials(_))), "a token that is gone still served");
    }

    #[test]
    fn the_certificate_is_read_again_only_when_its_files_change() {
        let dir = tempfile::tempdir().unwrap();
        let (c, k) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        write_pair(dir.path());
        let first = tls_config_cached(&c, &k).unwrap();
        assert!(Arc::ptr_eq(&first, &tls_config_cached(&c, &k).unwrap()), "made again without a change");
        write_pair(dir.path());
        let rotated = tls_config_cached(&c, &k).unwrap();
        assert!(!Arc::ptr_eq(&first, &rotated), "a rotated Secret was not read");
        std::fs::remove_file(&k).unwrap();
        assert!(matches!(tls_config_cached(&c, &k), Err(Failure::Credentials(_))), "a key that is gone still served");
    }
}
