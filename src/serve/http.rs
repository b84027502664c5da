//! The HTTP endpoint. The cluster has no default-deny NetworkPolicy, so:
//! - only `/healthz` answers without credentials, and says only ok / degraded / unhealthy;
//! - `/v1/status` and `/metrics` need the bearer token (compared in constant time);
//! - every answer comes from the last published snapshot, never computed per request;
//! - headers must arrive within `HEADER_TIMEOUT` and fit in `MAX_HEADER_BYTES`, and a
//!   connection lives at most `CONNECTION_LIFETIME`, so slow or oversized clients cannot hold
//!   the agent. `HEADER_TIMEOUT` is also the keep-alive idle timeout: hyper arms it whenever it
//!   waits for the next request's head, on a new or a kept-alive connection;
//! - a POST is judged on its head first: its credentials are checked before a byte of its body
//!   is read, and an authenticated body has `BODY_TIMEOUT` to arrive. Only an authenticated
//!   request counts as busy, so no client without the token can hold a slot admission must
//!   keep (issue 51: 16 addresses × 16 unauthenticated POSTs once held all 256);
//! - admission (`Admission`) keeps one client from locking out the others, as nginx's
//!   `limit_conn` and Envoy's overload manager do: at most `MAX_PER_PEER` connections per
//!   source address, at most `MAX_CONNECTIONS` in all, and when the table is full a new
//!   connection takes the place of an idle one (no request in flight: a kept-alive or a
//!   half-sent one) of the address that holds the most. A readiness probe from another address
//!   therefore always gets in. The same loop serves vsock (`serve::vsock`), where the peer is a
//!   CID rather than an address (`Peer`).

use super::recheck::{AskedBy, Channel, Desk, Refused};
use super::subset;
use super::{current, Published, Shared};
use crate::config::ProbeLevel;
use crate::report::Health;
use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Notify;

pub const MAX_CONNECTIONS: usize = 256;
/// Connections one source address may hold. The readiness probe, the platform's poller and a
/// Prometheus each need one or two; 16 leaves room for a proxy that funnels several clients.
/// Our own margin: nginx's `limit_conn` and Envoy set no default, each operator picks one.
pub const MAX_PER_PEER: usize = 16;
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What every answer carries: the published bytes themselves (`Bytes` shares them, so a scrape
/// copies nothing and renders nothing), or a short constant.
pub type Reply = Response<Full<Bytes>>;

/// A request body larger than this is refused (413) before it is read whole: the one body the
/// endpoint takes, `POST /v1/probes`'s, is a few bytes of JSON.
pub const MAX_REQUEST_BODY: usize = 1024;
/// How long an authenticated POST's body may take to arrive once its head has: our choice, as
/// `HEADER_TIMEOUT` is — a few bytes of JSON need a round trip, not the connection's whole
/// life. Past it, 408 (RFC 9110 §15.5.9).
pub const BODY_TIMEOUT: Duration = Duration::from_secs(5);

/// What the routes answer from: the published snapshot, and the probe desk that
/// `POST /v1/probes` asks.
#[derive(Clone)]
pub struct Endpoint {
    pub shared: Shared,
    pub desk: Arc<Desk>,
}

/// Answers one request. GET (and HEAD, which hyper answers with the GET's headers and no body)
/// of `/healthz`, `/v1/status`, `/metrics` from the published snapshot and of
/// `/v1/probes/{id}` from the desk; POST of `/v1/probes` with its `body`. The rest is 405 (with
/// `Allow`) or 404.
pub fn answer<B>(e: &Endpoint, req: &Request<B>, cert: &ClientCert, body: &[u8]) -> Reply {
    let path = req.uri().path();
    let run = path.strip_prefix("/v1/probes/").filter(|id| !id.is_empty() && !id.contains('/'));
    let allowed = match path {
        "/healthz" | "/v1/status" | "/metrics" => "GET,HEAD",
        "/v1/probes" => "POST",
        _ if run.is_some() => "GET,HEAD",
        _ => return plain(StatusCode::NOT_FOUND, "not found\n"),
    };
    let method_ok = match allowed {
        "POST" => req.method() == Method::POST,
        _ => req.method() == Method::GET || req.method() == Method::HEAD,
    };
    if !method_ok {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allowed));
        return r;
    }
    match (path, run) {
        (_, Some(id)) => probe_run(e, req.headers(), cert, id),
        ("/healthz", _) => healthz(&e.shared),
        ("/v1/status", _) => status(&e.shared, req.headers(), req.uri().query(), cert),
        ("/v1/probes", _) => request_probes(e, req.headers(), cert, body),
        _ => metrics(&e.shared, req.headers(), req.uri().query(), cert),
    }
}

/// The accept queue the listener asks for. A flood of connections arrives in bursts; once the
/// kernel's queue of finished handshakes is full it drops the next SYN, and that client's retry
/// comes a whole second later — a readiness probe with a 1 s timeout then fails. Rust's standard
/// library (and mio) ask for 128; Go asks for the kernel's `net.core.somaxconn` (4096 on Linux
/// 5.4 and later), which the kernel also caps this at.
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds the endpoint's listener with `LISTEN_BACKLOG` (and `SO_REUSEADDR`, as std does).
///
/// The IPv6 wildcard `[::]` binds both families on one socket (`IPV6_V6ONLY` off, ipv6(7)), so
/// no other user of the guest can take the other family's side of the port and collect the
/// tokens its clients send (issue 51: an IPv4-only `0.0.0.0` left `[::]:9440` to anyone). On a
/// guest whose kernel has no IPv6 (`ipv6.disable=1`: `socket(AF_INET6)` fails with
/// `EAFNOSUPPORT`) it binds `0.0.0.0` on the same port instead, as systemd does for a
/// `ListenStream=` of a port alone (systemd.socket(5)); there is no IPv6 side to take.
pub fn listen(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(v6) => match tokio::net::TcpSocket::new_v6() {
            Ok(s) => {
                if v6.ip().is_unspecified() {
                    dual_stack(&s)?;
                }
                s
            }
            Err(e) if v6.ip().is_unspecified() && e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
                return listen(std::net::SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, addr.port())));
            }
            Err(e) => return Err(e),
        },
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Turns `IPV6_V6ONLY` off on an IPv6 socket, whatever `net.ipv6.bindv6only` says.
fn dual_stack(s: &tokio::net::TcpSocket) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let off: libc::c_int = 0;
    // SAFETY: setsockopt(2) on a socket this function borrows, with a c_int option value.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_V6ONLY,
            (&off as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// How the client on a connection proved itself, if it did: a client certificate the TLS layer
/// verified (its chain, its name and usage: `client_name`), and the channel it came over.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ClientCert {
    #[default]
    None,
    Platform {
        over: Channel,
        name: String,
    },
}

impl ClientCert {
    /// What the handshake on `peer`'s connection proved: the leaf's name when a certificate was
    /// presented (the verifier admitted it only with a configured name).
    fn of(peer: Peer, certs: Option<&[rustls_pki_types::CertificateDer<'_>]>) -> ClientCert {
        let Some(leaf) = certs.and_then(|c| c.first()) else { return ClientCert::None };
        let name = super::client_name::identity(leaf).ok().and_then(|i| i.name).unwrap_or_default();
        let over = if matches!(peer, Peer::Cid(_)) { Channel::Vsock } else { Channel::Tcp };
        ClientCert::Platform { over, name }
    }
}

/// Who made a request, and so what it may do (issue 50, and issue 51's "one token does two
/// jobs"): the platform (a certificate) and the control token's holder may read and start
/// work; the read token's holder (a tenant's Prometheus, often over clear HTTP) may only read.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Who {
    Asker(AskedBy),
    Reader,
}

/// Who is on the other end of a connection, as admission counts it: a source address on TCP,
/// a context id on vsock (the host is CID 2; vsock(7)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    Ip(IpAddr),
    Cid(u32),
}

impl From<IpAddr> for Peer {
    fn from(ip: IpAddr) -> Peer {
        // One address, whichever way it is written (an IPv4-mapped IPv6 address is IPv4).
        Peer::Ip(ip.to_canonical())
    }
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Ip(ip) => write!(f, "{ip}"),
            Peer::Cid(cid) => write!(f, "vsock CID {cid}"),
        }
    }
}

/// A listening socket the accept loop can take connections from.
pub trait Accept: Send + 'static {
    type Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static;
    fn accept(&self) -> impl std::future::Future<Output = std::io::Result<(Self::Stream, Peer)>> + Send;
}

impl Accept for TcpListener {
    type Stream = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<(Self::Stream, Peer)> {
        let (stream, addr) = TcpListener::accept(self).await?;
        // An answer is written whole at once; Nagle's algorithm would only hold its last segment
        // back for the client's delayed ACK (nginx sets `tcp_nodelay on` by default for the same
        // reason). Failing to set it costs speed, not correctness.
        let _ = stream.set_nodelay(true);
        Ok((stream, Peer::from(addr.ip())))
    }
}

/// Accepts connections until `shutdown` resolves; HTTPS when `tls` is given.
pub async fn serve<L: Accept>(
    listener: L,
    endpoint: Endpoint,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let admission = Arc::new(Admission::new(MAX_CONNECTIONS, MAX_PER_PEER));
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
        // Refused: closed at once rather than queued, so a flood costs the agent nothing.
        let slot = match Admission::admit(&admission, peer) {
            Ok(slot) => slot,
            Err(why) => {
                tracing::debug!(%peer, "connection refused: {why}");
                drop(stream);
                continue;
            }
        };
        let endpoint = endpoint.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let served = async {
                match tls {
                    None => connection(stream, endpoint, ClientCert::None, slot.busy.clone()).await,
                    Some(acceptor) => match tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls_stream)) => {
                            // With a client CA, a certificate present after the handshake is one it signed.
                            let cert = ClientCert::of(peer, tls_stream.get_ref().1.peer_certificates());
                            connection(tls_stream, endpoint, cert, slot.busy.clone()).await
                        }
                        Ok(Err(e)) => Err(format!("TLS handshake: {e}")),
                        Err(_) => Err("TLS handshake timed out".into()),
                    },
                }
            };
            tokio::select! {
                ended = tokio::time::timeout(CONNECTION_LIFETIME, served) => match ended {
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "connection ended with an error"),
                    Err(_) => tracing::debug!(%peer, "connection lifetime reached; closed"),
                    Ok(Ok(())) => {}
                },
                // Another client needed the slot while this one had no request in flight.
                _ = slot.evicted.notified() => tracing::debug!(%peer, "idle connection closed to admit another"),
            }
            drop(slot);
        });
    }
}

/// One HTTP/1.1 connection with the header limits; `busy` counts its requests in flight.
async fn connection<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static>(
    stream: S,
    endpoint: Endpoint,
    cert: ClientCert,
    busy: Arc<AtomicUsize>,
) -> Result<(), String> {
    let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let endpoint = endpoint.clone();
        let busy = busy.clone();
        let cert = cert.clone();
        async move {
            let cert = &cert;
            // Only POST reads a body, bounded; every other answer is made at once from the
            // published bytes, with nothing to wait for (and so never counts as busy).
            if req.method() != Method::POST {
                return Ok::<_, std::convert::Infallible>(answer(&endpoint, &req, cert, &[]));
            }
            let (parts, body) = req.into_parts();
            let head = Request::from_parts(parts, ());
            // The head decides first: a wrong path, method or credential is answered before a
            // byte of the body is read, and such a connection is never busy, so admission may
            // close it for another client (the rules at the top).
            if let Some(refused) = before_body(&endpoint, &head, cert) {
                return Ok(refused);
            }
            let _in_flight = InFlight::new(busy);
            let limited = http_body_util::BodyExt::collect(http_body_util::Limited::new(body, MAX_REQUEST_BODY));
            let reply = match tokio::time::timeout(BODY_TIMEOUT, limited).await {
                Ok(Ok(b)) => answer(&endpoint, &head, cert, &b.to_bytes()),
                Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                    plain(StatusCode::PAYLOAD_TOO_LARGE, format!("a body over {MAX_REQUEST_BODY} bytes\n"))
                }
                Ok(Err(e)) => plain(StatusCode::BAD_REQUEST, format!("the body could not be read: {e}\n")),
                Err(_) => plain(
                    StatusCode::REQUEST_TIMEOUT,
                    format!("the body did not arrive within {} s\n", BODY_TIMEOUT.as_secs()),
                ),
            };
            Ok(reply)
        }
    });
    hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_HEADER_BYTES)
        .serve_connection(TokioIo::new(stream), service)
        .await
        .map_err(|e| e.to_string())
}

/// What a POST's head alone decides, before its body is read: the route and method (`answer`
/// says 404 or 405 with no body to read) and the caller's credentials. `None`: read the body.
fn before_body(e: &Endpoint, head: &Request<()>, cert: &ClientCert) -> Option<Reply> {
    if head.uri().path() != "/v1/probes" {
        return Some(answer(e, head, cert, &[]));
    }
    asker_for(&e.shared, head.headers(), cert).err().map(|r| *r)
}

/// Marks a connection busy while one of its authenticated requests is being answered.
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn new(busy: Arc<AtomicUsize>) -> InFlight {
        busy.fetch_add(1, Ordering::SeqCst);
        InFlight(busy)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Who holds the connection table. One lock, taken for a few map operations per accept and
/// per close; never across an await.
pub struct Admission {
    max_total: usize,
    max_per_peer: usize,
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    /// Open connections by id: (peer, requests in flight, the eviction signal).
    open: HashMap<u64, (Peer, Arc<AtomicUsize>, Arc<Notify>)>,
    /// Ids per peer, oldest first.
    by_peer: HashMap<Peer, Vec<u64>>,
}

/// One admitted connection; leaving the table when dropped.
pub struct Slot {
    id: u64,
    peer: Peer,
    pub busy: Arc<AtomicUsize>,
    pub evicted: Arc<Notify>,
    admission: Arc<Admission>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut t) = self.admission.table.lock() {
            t.remove(self.id, self.peer);
        }
    }
}

impl Table {
    fn remove(&mut self, id: u64, peer: Peer) {
        if self.open.remove(&id).is_some() {
            if let Some(ids) = self.by_peer.get_mut(&peer) {
                ids.retain(|i| *i != id);
                if ids.is_empty() {
                    self.by_peer.remove(&peer);
                }
            }
        }
    }

    /// The oldest connection of `peer` with no request in flight.
    fn idle_of(&self, peer: &Peer) -> Option<u64> {
        self.by_peer
            .get(peer)?
            .iter()
            .copied()
            .find(|id| self.open.get(id).is_some_and(|c| c.1.load(Ordering::SeqCst) == 0))
    }

    /// Closes connection `id` (its task drops it) and forgets it at once, so its slot is free now.
    fn evict(&mut self, id: u64) {
        if let Some((peer, _, evicted)) = self.open.get(&id).cloned() {
            evicted.notify_one();
            self.remove(id, peer);
        }
    }
}

impl Admission {
    pub fn new(max_total: usize, max_per_peer: usize) -> Admission {
        Admission { max_total, max_per_peer, table: Mutex::new(Table::default()) }
    }

    /// A slot for a new connection from `peer`, or why there is none.
    pub fn admit(this: &Arc<Admission>, peer: impl Into<Peer>) -> Result<Slot, &'static str> {
        let peer = peer.into();
        let mut t = this.table.lock().map_err(|_| "connection table poisoned")?;
        if t.by_peer.get(&peer).map_or(0, Vec::len) >= this.max_per_peer {
            // The address is at its own limit: it may only trade an idle connection for this one.
            let id = t.idle_of(&peer).ok_or("this address holds its limit of busy connections")?;
            t.evict(id);
        } else if t.open.len() >= this.max_total {
            // Full: the address holding the most gives up an idle connection.
            let mut peers: Vec<(usize, Peer)> = t.by_peer.iter().map(|(p, ids)| (ids.len(), *p)).collect();
            peers.sort_by_key(|p| std::cmp::Reverse(p.0));
            let id = peers.iter().find_map(|(_, p)| t.idle_of(p)).ok_or("every connection is busy")?;
            t.evict(id);
        }
        t.next_id += 1;
        let id = t.next_id;
        let busy = Arc::new(AtomicUsize::new(0));
        let evicted = Arc::new(Notify::new());
        t.open.insert(id, (peer, busy.clone(), evicted.clone()));
        t.by_peer.entry(peer).or_default().push(id);
        Ok(Slot { id, peer, busy, evicted, admission: this.clone() })
    }

    /// Connections open now (for tests and logs).
    pub fn open(&self) -> usize {
        self.table.lock().map(|t| t.open.len()).unwrap_or(0)
    }

    /// Connections `peer` holds now.
    pub fn held_by(&self, peer: impl Into<Peer>) -> usize {
        let peer = peer.into();
        self.table.lock().map(|t| t.by_peer.get(&peer).map_or(0, Vec::len)).unwrap_or(0)
    }
}

/// A response of `body` with `content_type`; the header value is a constant, so nothing is copied.
fn reply(status: StatusCode, content_type: &'static str, body: Bytes) -> Reply {
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn plain(status: StatusCode, body: impl Into<Bytes>) -> Reply {
    reply(status, "text/plain; charset=utf-8", body.into())
}

fn healthz(shared: &Shared) -> Reply {
    match current(shared) {
        None => plain(StatusCode::SERVICE_UNAVAILABLE, "starting\n"),
        Some(p) => match p.health {
            Health::Healthy => plain(StatusCode::OK, "ok\n"),
            // Could not check everything, or something warns: still usable, so ready.
            Health::Degraded | Health::Unknown => plain(StatusCode::OK, "degraded\n"),
            Health::Unhealthy => match &p.reason {
                Some(why) => plain(StatusCode::SERVICE_UNAVAILABLE, format!("unhealthy: {why}\n")),
                None => plain(StatusCode::SERVICE_UNAVAILABLE, "unhealthy\n"),
            },
        },
    }
}

/// Who the request comes from, by its certificate or its bearer token; `Err` is the refusal
/// to send instead (401, or 503 while no token is configured).
fn who(p: &Published, headers: &HeaderMap, cert: &ClientCert) -> Result<Who, Box<Reply>> {
    if let ClientCert::Platform { over, name } = cert {
        return Ok(Who::Asker(AskedBy::Platform { over: *over, name: name.clone() }));
    }
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer).unwrap_or("");
    let given = given.trim().as_bytes();
    if p.control_token.as_deref().is_some_and(|t| constant_time_eq(given, t.as_bytes())) {
        return Ok(Who::Asker(AskedBy::Tenant));
    }
    let Some(expected) = p.token.as_deref() else {
        return Err(Box::new(plain(StatusCode::SERVICE_UNAVAILABLE, "no token configured: see http.token_file\n")));
    };
    if constant_time_eq(given, expected.as_bytes()) {
        return Ok(Who::Reader);
    }
    let mut r = plain(StatusCode::UNAUTHORIZED, "unauthorized\n");
    r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    Err(Box::new(r))
}

/// The token of an `Authorization: Bearer <token>` value. The scheme is case-insensitive
/// (RFC 9110 §11.1: "bearer", "BEARER" and "Bearer" are one scheme).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

/// Compares without an early exit, so the time taken says nothing about where a guess went
/// wrong; the length is not secret.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The published snapshot for a caller that proved itself, and who it is; else the answer to
/// send instead.
fn published_for(shared: &Shared, headers: &HeaderMap, cert: &ClientCert) -> Result<(Arc<Published>, Who), Box<Reply>> {
    let p = current(shared).ok_or_else(|| Box::new(plain(StatusCode::SERVICE_UNAVAILABLE, "starting\n")))?;
    who(&p, headers, cert).map(|w| (p, w))
}

/// `published_for`, for a request that starts work: the read token is refused (403).
fn asker_for(shared: &Shared, headers: &HeaderMap, cert: &ClientCert) -> Result<(Arc<Published>, AskedBy), Box<Reply>> {
    match published_for(shared, headers, cert)? {
        (p, Who::Asker(a)) => Ok((p, a)),
        (_, Who::Reader) => Err(Box::new(json(
            StatusCode::FORBIDDEN,
            &serde_json::json!({ "error": "the read token starts nothing: use the control token (http.control_token_file) or the platform's client certificate" }),
        ))),
    }
}

/// The report, whole or without its passed findings (`?findings=not-passed`: `subset`).
fn status(shared: &Shared, headers: &HeaderMap, query: Option<&str>, cert: &ClientCert) -> Reply {
    let p = match published_for(shared, headers, cert) {
        Ok((p, _)) => p,
        Err(r) => return *r,
    };
    match subset::status_query(query) {
        Ok(subset::Findings::All) => reply(StatusCode::OK, "application/json", p.report_json.clone()),
        Ok(subset::Findings::NotPassed) => {
            reply(StatusCode::OK, "application/json", p.subsets.not_passed(&p.report_json))
        }
        Err(e) => plain(StatusCode::BAD_REQUEST, format!("{e}\n")),
    }
}

/// The rendering the client negotiated, as published: only the choice is made per request. With
/// `name[]` in the query, only those samples (`subset`), uncompressed: a few hundred bytes.
fn metrics(shared: &Shared, headers: &HeaderMap, query: Option<&str>, cert: &ClientCert) -> Reply {
    let p = match published_for(shared, headers, cert) {
        Ok((p, _)) => p,
        Err(r) => return *r,
    };
    let names = match subset::metrics_query(query) {
        Ok(n) => n,
        Err(e) => return plain(StatusCode::BAD_REQUEST, format!("{e}\n")),
    };
    let header_str = |name| headers.get(name).and_then(|v: &HeaderValue| v.to_str().ok()).unwrap_or("");
    let openmetrics = prefers_openmetrics(header_str(header::ACCEPT));
    let gzip = accepts_gzip(header_str(header::ACCEPT_ENCODING)) && names.is_empty();
    let ct = if openmetrics { OPENMETRICS } else { TEXT_FORMAT };
    let body = if names.is_empty() {
        p.metrics.body(openmetrics, gzip)
    } else {
        p.subsets.metrics(&p.metrics.body(openmetrics, false), openmetrics, &names)
    };
    let mut r = reply(StatusCode::OK, ct, body);
    let h = r.headers_mut();
    h.insert(header::VARY, HeaderValue::from_static("Accept, Accept-Encoding"));
    if gzip {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    r
}

fn json(status: StatusCode, value: &serde_json::Value) -> Reply {
    let mut body = serde_json::to_vec_pretty(value).unwrap_or_default();
    body.push(b'\n');
    reply(status, "application/json", Bytes::from(body))
}

/// `POST /v1/probes`'s body: `{"level": "quick" | "standard" | "full"}`, or nothing for quick.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ProbeRequest {
    #[serde(default)]
    level: Option<ProbeLevel>,
}

/// The level a request asks for; the error is said to the caller (400).
fn requested_level(body: &[u8]) -> Result<ProbeLevel, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(ProbeLevel::Quick);
    }
    let r: ProbeRequest = serde_json::from_slice(body).map_err(|e| format!("the body is not a probe request: {e}"))?;
    match r.level.unwrap_or(ProbeLevel::Quick) {
        ProbeLevel::None => Err("level \"none\" runs nothing; ask for quick, standard or full".into()),
        level => Ok(level),
    }
}

/// The platform's re-check (`recheck` rules 1–3): 202 and the run, or why not — 409 while a run
/// is going or a GPU is busy, 429 past the configured rate, 403 when requests are off.
fn request_probes(e: &Endpoint, headers: &HeaderMap, cert: &ClientCert, body: &[u8]) -> Reply {
    let (p, who) = match asker_for(&e.shared, headers, cert) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let level = match requested_level(body) {
        Ok(l) => l,
        Err(why) => return json(StatusCode::BAD_REQUEST, &serde_json::json!({ "error": why })),
    };
    match e.desk.request(level, p.snapshot.clone(), who) {
        Ok(run) => {
            let mut r = json(StatusCode::ACCEPTED, &serde_json::json!(run));
            if let Ok(v) = HeaderValue::from_str(&format!("/v1/probes/{}", run.id)) {
                r.headers_mut().insert(header::LOCATION, v);
            }
            r
        }
        Err(Refused::Running(run)) => json(
            StatusCode::CONFLICT,
            &serde_json::json!({ "error": "a probe run is already queued or running", "run": run }),
        ),
        Err(Refused::Busy(gpus)) => json(
            StatusCode::CONFLICT,
            &serde_json::json!({ "error": "not every GPU is idle: the probes would take GPU time from a job", "busy": gpus }),
        ),
        Err(Refused::Limited(wait)) => {
            let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            let mut r = json(
                StatusCode::TOO_MANY_REQUESTS,
                &serde_json::json!({ "error": "past probes.max_requests per probes.request_window", "retry_after_s": secs }),
            );
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
            r
        }
        Err(Refused::Off) => json(
            StatusCode::FORBIDDEN,
            &serde_json::json!({ "error": "re-checks are off on this VM (probes.max_requests = 0)" }),
        ),
        Err(Refused::Stopping) => plain(StatusCode::SERVICE_UNAVAILABLE, "stopping\n"),
    }
}

/// `GET /v1/probes/{id}`: a run's record while it is current or among the last kept.
fn probe_run(e: &Endpoint, headers: &HeaderMap, cert: &ClientCert, id: &str) -> Reply {
    if let Err(r) = published_for(&e.shared, headers, cert) {
        return *r;
    }
    match e.desk.run(id) {
        Some(run) => json(StatusCode::OK, &serde_json::json!(run)),
        None => {
            let why = format!("no such probe run (the last {} are kept)", super::recheck::KEPT_RUNS);
            json(StatusCode::NOT_FOUND, &serde_json::json!({ "error": why }))
        }
    }
}

/// `(media range or coding, q)` of an Accept-style header (RFC 9110 §12.4.2): q defaults to 1;
/// an unreadable q counts as 0, which refuses, rather than as 1.
fn weighted(header: &str) -> impl Iterator<Item = (String, f32)> + '_ {
    header.split(',').filter(|p| !p.trim().is_empty()).map(|part| {
        let mut fields = part.split(';');
        let name = fields.next().unwrap_or("").trim().to_ascii_lowercase();
        let q = fields
            .filter_map(|f| f.trim().strip_prefix("q=").or_else(|| f.trim().strip_prefix("Q=")))
            .map(|v| v.trim().parse::<f32>().unwrap_or(0.0))
            .next()
            .unwrap_or(1.0);
        (name, q)
    })
}

/// Whether `Accept` prefers OpenMetrics to the classic text format, as Prometheus (which sends
/// `application/openmetrics-text;version=1.0.0;q=0.5,…,text/plain;version=0.0.4;q=0.3,*/*;q=0.2`)
/// and client_golang negotiate it: OpenMetrics when it is acceptable (q > 0) and weighted at
/// least as high as text/plain.
fn prefers_openmetrics(accept: &str) -> bool {
    let (mut om, mut text) = (0.0f32, 0.0f32);
    for (range, q) in weighted(accept) {
        match range.as_str() {
            "application/openmetrics-text" => om = om.max(q),
            "text/plain" | "text/*" | "*/*" => text = text.max(q),
            _ => {}
        }
    }
    om > 0.0 && om >= text
}

/// Whether `Accept-Encoding` takes gzip (q > 0), as Prometheus's scraper asks for it.
fn accepts_gzip(accept_encoding: &str) -> bool {
    weighted(accept_encoding).any(|(coding, q)| (coding == "gzip" || coding == "x-gzip") && q > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn one_address_cannot_take_the_table_and_idle_connections_make_room() {
        let a = Arc::new(Admission::new(4, 2));
        let (x, y, z) = (ip("10.0.0.1"), ip("10.0.0.2"), ip("10.0.0.3"));
        let x1 = Admission::admit(&a, x).unwrap();
        let x2 = Admission::admit(&a, x).unwrap();
        // x is at its own limit: a third connection takes the place of its oldest idle one.
        x1.busy.store(1, Ordering::SeqCst);
        let x3 = Admission::admit(&a, x).unwrap();
        assert_eq!((a.open(), a.held_by(x)), (2, 2), "x2 made room for x3");
        // With both of x's connections busy, x gets no more; others still get in.
        x3.busy.store(1, Ordering::SeqCst);
        assert_eq!(Admission::admit(&a, x).err(), Some("this address holds its limit of busy connections"));
        let y1 = Admission::admit(&a, y).unwrap();
        let y2 = Admission::admit(&a, y).unwrap();
        assert_eq!(a.open(), 4);
        // Full: z takes the place of the idle connection (y's oldest), not a busy one of x.
        let z1 = Admission::admit(&a, z).unwrap();
        assert_eq!((a.open(), a.held_by(x), a.held_by(y), a.held_by(z)), (4, 2, 1, 1));
        // A slot already evicted leaves nothing behind when its task ends.
        drop((x2, y1));
        assert_eq!(a.open(), 4);
        // Everyone busy: the newcomer is refused.
        z1.busy.store(1, Ordering::SeqCst);
        y2.busy.store(1, Ordering::SeqCst);
        assert_eq!(Admission::admit(&a, ip("10.0.0.9")).err(), Some("every connection is busy"));
        // A request finishing makes its connection evictable again.
        y2.busy.store(0, Ordering::SeqCst);
        assert!(Admission::admit(&a, ip("10.0.0.9")).is_ok());
    }

    #[test]
    fn a_closed_connection_leaves_the_table_and_mapped_addresses_count_as_v4() {
        let a = Arc::new(Admission::new(8, 2));
        let s = Admission::admit(&a, ip("::ffff:127.0.0.1")).unwrap();
        assert_eq!(a.open(), 1);
        drop(s);
        assert_eq!(a.open(), 0);
        let v6 = Admission::admit(&a, ip("::ffff:127.0.0.1")).unwrap();
        let v4 = Admission::admit(&a, ip("127.0.0.1")).unwrap();
        v6.busy.store(1, Ordering::SeqCst);
        v4.busy.store(1, Ordering::SeqCst);
        assert!(Admission::admit(&a, ip("127.0.0.1")).is_err(), "one address, whichever way it is written");
        assert_eq!(a.held_by(ip("127.0.0.1")), 2);
    }

    #[test]
    fn vsock_peers_are_counted_by_cid() {
        let a = Arc::new(Admission::new(8, 1));
        let host = Admission::admit(&a, Peer::Cid(2)).unwrap();
        host.busy.store(1, Ordering::SeqCst);
        assert_eq!(Admission::admit(&a, Peer::Cid(2)).err(), Some("this address holds its limit of busy connections"));
        // Another CID, and an address that happens to share nothing with a CID, get in.
        assert!(Admission::admit(&a, Peer::Cid(3)).is_ok());
        assert!(Admission::admit(&a, ip("0.0.0.2")).is_ok());
        assert_eq!(a.held_by(Peer::Cid(2)), 1);
    }

    /// Issue 51 hole 5: the default listener holds the port in both families, so no other
    /// user binds the IPv6 side (or the IPv4 side) of it and hears the clients' tokens.
    #[test]
    fn the_default_listener_leaves_neither_family_free() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _guard = rt.enter();
        let default = crate::config::HttpConfig::default().listen;
        assert!(default.ip().is_unspecified() && default.is_ipv6(), "{default}");
        let held = listen(std::net::SocketAddr::new(default.ip(), 0)).unwrap();
        let port = held.local_addr().unwrap().port();
        for other in ["[::]", "[::1]", "0.0.0.0", "127.0.0.1"] {
            let addr: std::net::SocketAddr = format!("{other}:{port}").parse().unwrap();
            let e = std::net::TcpListener::bind(addr).err();
            assert_eq!(e.map(|e| e.kind()), Some(std::io::ErrorKind::AddrInUse), "{addr} was free beside {default}");
        }
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("BEARER  abc"), Some(" abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearerabc"), None);
    }

    #[test]
    fn accept_is_negotiated_with_its_weights() {
        // What Prometheus 2.x sends.
        let prom = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(prefers_openmetrics(prom));
        assert!(!prefers_openmetrics("text/plain;version=0.0.4;q=1,application/openmetrics-text;q=0.5"));
        assert!(!prefers_openmetrics("application/openmetrics-text;q=0"), "q=0 refuses it");
        assert!(!prefers_openmetrics(""));
        assert!(!prefers_openmetrics("*/*"));
        assert!(prefers_openmetrics("application/openmetrics-text"));
        assert!(accepts_gzip("gzip"));
        assert!(accepts_gzip("identity;q=0.5, GZIP;q=0.8"));
        assert!(!accepts_gzip("gzip;q=0"));
        assert!(!accepts_gzip("br, deflate"));
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
