//! The platform's channel: an AF_VSOCK listener that KubeVirt's `vsock` subresource reaches
//! (virt-handler dials the guest's CID and this port; docs/vsock.md). It serves the same router
//! through the same accept loop as TCP (`http::serve`, rules there), with the peer's CID as the
//! admission key. Rules of its own:
//!
//! 1. No vsock device (the VM has no `autoattachVSOCK`) is not an error: `open` says so in one
//!    line and `serve` runs as without it. A device is one with a guest CID: `/dev/vsock`'s
//!    `IOCTL_VM_SOCKETS_GET_LOCAL_CID` answers `VMADDR_CID_ANY` while no guest transport is
//!    loaded, and a socket can then still be bound, so bind alone cannot tell.
//! 2. TLS 1.3 with a client certificate chained to `vsock.client_ca` is the default
//!    (`tls::vsock_acceptor`): the certificate is what tells the platform from a process in
//!    the guest, which can reach this port too. Plain vsock only when `vsock.tls = false`, and
//!    then the bearer token is required as on TCP (no `ClientCert`).
//! 3. Sockets are made here with libc and driven by tokio's `AsyncFd`: no crate added for two
//!    system calls and a sockaddr.
//!
//! Nothing here reads a sysroot: this is the live process's socket. doctor reads the CID
//! through the sysroot in `collect::host`.

use super::http::{Accept, Peer};
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The live machine's local CID from its vsock device (`path`); `None`: no device, or no guest
/// transport behind it (rule 1).
pub use crate::sysroot::local_cid;

/// Whether a socket or bind error means this machine has no vsock at all (no `vsock` module:
/// EAFNOSUPPORT; no transport behind it: ENODEV; no local CID to bind: EADDRNOTAVAIL).
pub fn means_no_device(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EAFNOSUPPORT | libc::ENODEV | libc::EADDRNOTAVAIL | libc::ESOCKTNOSUPPORT))
}

/// A listening AF_VSOCK stream socket on every local CID.
pub struct VsockListener {
    fd: AsyncFd<OwnedFd>,
    port: u32,
}

impl VsockListener {
    /// Binds `port` on `VMADDR_CID_ANY` and listens with the TCP side's backlog.
    pub fn bind(port: u32) -> io::Result<VsockListener> {
        // SAFETY: plain socket(2); the result is checked before it is owned.
        let raw =
            unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor socket(2) just returned to this thread alone.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let addr = sockaddr(libc::VMADDR_CID_ANY, port);
        // SAFETY: `addr` is a whole sockaddr_vm and the length says so.
        let r = unsafe {
            libc::bind(fd.as_raw_fd(), (&addr as *const libc::sockaddr_vm).cast(), size_of::<libc::sockaddr_vm>() as _)
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: listen(2) on the bound socket.
        if unsafe { libc::listen(fd.as_raw_fd(), super::http::LISTEN_BACKLOG as libc::c_int) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(VsockListener { fd: register(fd)?, port })
    }

    /// Takes a listening AF_VSOCK stream socket made elsewhere (`phq-agent-vsock.socket`, checked
    /// by `port::adopt_vsock`): its port is the one it is bound to (getsockname(2)), and it is
    /// made non-blocking for the reactor.
    pub fn adopt(fd: OwnedFd) -> io::Result<VsockListener> {
        let mut addr = sockaddr(0, 0);
        let mut len = size_of::<libc::sockaddr_vm>() as libc::socklen_t;
        // SAFETY: `addr` and `len` are valid for writes of a sockaddr_vm and its length.
        let r = unsafe { libc::getsockname(fd.as_raw_fd(), (&mut addr as *mut libc::sockaddr_vm).cast(), &mut len) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        if addr.svm_family != libc::AF_VSOCK as libc::sa_family_t {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not bound to a vsock address"));
        }
        // SAFETY: fcntl(2) on a descriptor this function owns; it fails cleanly if it cannot.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(VsockListener { fd: register(fd)?, port: addr.svm_port })
    }

    pub fn port(&self) -> u32 {
        self.port
    }
}

/// Hands a socket to tokio's reactor.
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an `OwnedFd` stays open until dropped and always answers `as_raw_fd` with the one
    // descriptor it owns; the `AsyncFd` owns it from here on.
    Ok(unsafe { AsyncFd::register(fd) }?)
}

fn sockaddr(cid: u32, port: u32) -> libc::sockaddr_vm {
    // SAFETY: sockaddr_vm is plain data; all zeroes is its reserved fields' required value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    addr
}

impl Accept for VsockListener {
    type Stream = VsockStream;
    async fn accept(&self) -> io::Result<(VsockStream, Peer)> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.try_io(|fd| accept(fd.get_ref().as_raw_fd())) {
                Ok(Ok((stream, cid))) => return Ok((VsockStream { fd: register(stream)? }, Peer::Cid(cid))),
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }
}

/// accept4(2) with the peer's address; the new socket non-blocking, closed on exec.
fn accept(listener: RawFd) -> io::Result<(OwnedFd, u32)> {
    let mut addr = sockaddr(0, 0);
    let mut len = size_of::<libc::sockaddr_vm>() as libc::socklen_t;
    // SAFETY: `addr` and `len` are valid for writes of a sockaddr_vm and its length.
    let raw = unsafe {
        libc::accept4(
            listener,
            (&mut addr as *mut libc::sockaddr_vm).cast(),
            &mut len,
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: accept4 just returned this descriptor to this thread alone.
    Ok((unsafe { OwnedFd::from_raw_fd(raw) }, addr.svm_cid))
}

/// One accepted vsock connection.
pub struct VsockStream {
    fd: AsyncFd<OwnedFd>,
}

fn read_fd(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn write_fd(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for reads of its length.
    let n = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

impl AsyncRead for VsockStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| read_fd(fd.get_ref().as_raw_fd(), unfilled)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for VsockStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            match guard.try_io(|fd| write_fd(fd.get_ref().as_raw_fd(), buf)) {
                Ok(result) => return Poll::Ready(result),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // SAFETY: shutdown(2) on our own open socket.
        let r = unsafe { libc::shutdown(self.fd.get_ref().as_raw_fd(), libc::SHUT_WR) };
        if r < 0 {
            let e = io::Error::last_os_error();
            // The peer is already gone: nothing left to shut.
            if e.raw_os_error() != Some(libc::ENOTCONN) {
                return Poll::Ready(Err(e));
            }
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::{Published, Shared};
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    use std::path::Path;
    use std::sync::{Arc, RwLock};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls;

    /// The vsock listener's rules over a Unix socket pair standing in for AF_VSOCK (the VM test
    /// drives a real virtio-vsock device): every connection comes from CID 2, the host.
    struct FromHost(tokio::net::UnixListener);

    impl Accept for FromHost {
        type Stream = tokio::net::UnixStream;
        async fn accept(&self) -> io::Result<(Self::Stream, Peer)> {
            Ok((self.0.accept().await?.0, Peer::Cid(2)))
        }
    }

    struct Pki {
        ca: String,
        client: (String, String),
        stranger: (String, String),
        /// The stranger's CA: the bundle a rotation would bring.
        other_ca: String,
        /// The other clients KubeVirt's CA signs (`secrets.go`), each with its name, and the
        /// vsock client's name on a certificate without the clientAuth usage.
        siblings: Vec<(String, (String, String))>,
    }

    /// A leaf signed by `issuer` named `cn`, with the clientAuth usage when `client_auth`, as
    /// KubeVirt's `triple.NewClientKeyPair` issues them.
    fn named_leaf(issuer: &CertifiedIssuer<'_, KeyPair>, cn: &str, client_auth: bool) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        if client_auth {
            p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        }
        let cert = p.signed_by(&key, issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn pki() -> Pki {
        let ca_of = |name: &str| {
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.distinguished_name.push(rcgen::DnType::CommonName, name);
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap()
        };
        let leaf = |issuer: &CertifiedIssuer<'_, KeyPair>| named_leaf(issuer, crate::config::VSOCK_CLIENT_NAME, true);
        let (ca, other) = (ca_of("KubeVirt test CA"), ca_of("another CA"));
        let mut siblings: Vec<(String, (String, String))> =
            ["migration", "monitoring", "virt-handler", "virt-synchronization-controller"]
                .iter()
                .map(|n| {
                    let cn = format!("kubevirt.io:system:client:{n}");
                    (cn.clone(), named_leaf(&ca, &cn, true))
                })
                .collect();
        siblings.push(("vsock without clientAuth".into(), named_leaf(&ca, crate::config::VSOCK_CLIENT_NAME, false)));
        Pki { ca: ca.pem(), client: leaf(&ca), stranger: leaf(&other), other_ca: other.pem(), siblings }
    }

    fn published() -> Shared {
        let bytes = |s: &str| bytes::Bytes::from(s.to_string());
        Arc::new(RwLock::new(Some(Arc::new(Published {
            health: crate::report::Health::Healthy,
            report_json: bytes("{\"schema\":\"phq.status/v1\"}"),
            metrics: crate::serve::Metrics::fixed("phq_up 1\n", "phq_up 1\n# EOF\n"),
            token: Some("tok-vsock".into()),
            control_token: None,
            summary: "healthy".into(),
            reason: None,
            snapshot: Arc::new(crate::checks::testutil::healthy()),
        }))))
    }

    /// A client as virt-handler is one: TLS 1.3 (or `versions`), the agent's own certificate
    /// trusted (virt-handler trusts any), `identity` presented when given.
    fn client(
        server_cert: &Path,
        identity: Option<&(String, String)>,
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> tokio_rustls::TlsConnector {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from_pem_file(server_cert).unwrap()).unwrap();
        let b = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(versions)
            .unwrap()
            .with_root_certificates(roots);
        let config = match identity {
            None => b.with_no_client_auth(),
            Some((c, k)) => b
                .with_client_auth_cert(
                    vec![CertificateDer::from_pem_slice(c.as_bytes()).unwrap()],
                    PrivateKeyDer::from_pem_slice(k.as_bytes()).unwrap(),
                )
                .unwrap(),
        };
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }

    /// One request on a new connection; the whole answer, or the error that ended it.
    async fn get(
        socket: &Path,
        tls: Option<&tokio_rustls::TlsConnector>,
        path: &str,
        auth: &str,
    ) -> Result<String, String> {
        let stream = tokio::net::UnixStream::connect(socket).await.map_err(|e| e.to_string())?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: agent\r\n{auth}Connection: close\r\n\r\n");
        let mut answer = Vec::new();
        match tls {
            None => {
                let mut s = stream;
                s.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
                s.read_to_end(&mut answer).await.map_err(|e| e.to_string())?;
            }
            Some(connector) => {
                let name = rustls_pki_types::ServerName::try_from("phq-agent").unwrap();
                let mut s = connector.connect(name, stream).await.map_err(|e| format!("handshake: {e}"))?;
                // In TLS 1.3 the client's handshake ends before the server has judged its
                // certificate (RFC 8446 §4.4.2), so a refusal arrives as an alert after it, and
                // when the server has already closed, the write fails first (EPIPE). The alert
                // is then waiting unread: read it, so the error names the refusal, not the pipe.
                if let Err(write) = s.write_all(request.as_bytes()).await {
                    return Err(match s.read_to_end(&mut answer).await {
                        Err(e) => format!("{e} (after the write failed: {write})"),
                        Ok(_) => write.to_string(),
                    });
                }
                s.read_to_end(&mut answer).await.map_err(|e| e.to_string())?;
            }
        }
        Ok(String::from_utf8_lossy(&answer).into_owned())
    }

    fn status_of(answer: &str) -> &str {
        answer.lines().next().unwrap_or("")
    }

    /// Starts the real accept loop with the vsock acceptor `vsock` makes; the socket's path.
    fn start(rt: &tokio::runtime::Runtime, dir: &Path, vsock: &crate::config::VsockConfig) -> std::path::PathBuf {
        let tls = crate::serve::tls::vsock_acceptor(vsock, &dir.join("state")).unwrap();
        let socket = dir.join("vsock.sock");
        let _guard = rt.enter();
        let listener = FromHost(tokio::net::UnixListener::bind(&socket).unwrap());
        let (desk, _asks) = crate::serve::recheck::Desk::new(crate::serve::recheck::Limit {
            max: 0,
            window: std::time::Duration::from_secs(3600),
        });
        let endpoint = crate::serve::http::Endpoint { shared: published(), desk };
        rt.spawn(crate::serve::http::serve(listener, endpoint, tls.acceptor, std::future::pending()));
        socket
    }

    #[test]
    fn a_client_certificate_from_the_bundle_is_required_over_tls_1_3() {
        let pki = pki();
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, &pki.ca).unwrap();
        let config = crate::config::VsockConfig { client_ca: ca, ..Default::default() };
        let rt = tokio::runtime::Runtime::new().unwrap();
        let socket = start(&rt, dir.path(), &config);
        let server_cert = dir.path().join("state/vsock/server.crt");
        let tls13: &[&'static rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];
        rt.block_on(async {
            let platform = client(&server_cert, Some(&pki.client), tls13);
            for path in ["/healthz", "/v1/status", "/metrics"] {
                let answer = get(&socket, Some(&platform), path, "").await.unwrap();
                assert_eq!(status_of(&answer), "HTTP/1.1 200 OK", "{path}: {answer}");
            }
            let answer = get(&socket, Some(&platform), "/v1/status", "").await.unwrap();
            assert!(answer.ends_with("{\"schema\":\"phq.status/v1\"}"), "{answer}");

            // Refused in the handshake, before any route: not even /healthz, and no token helps.
            let refused = [
                ("no certificate", client(&server_cert, None, tls13), "CertificateRequired"),
                ("another CA's certificate", client(&server_cert, Some(&pki.stranger), tls13), "UnknownCA"),
                ("TLS 1.2", client(&server_cert, Some(&pki.client), &[&rustls::version::TLS12]), "ProtocolVersion"),
            ];
            for (who, connector, alert) in refused {
                for path in ["/healthz", "/v1/status"] {
                    let got = get(&socket, Some(&connector), path, "Authorization: Bearer tok-vsock\r\n").await;
                    match got {
                        Err(e) => assert!(e.contains(alert), "{who} {path}: {e}"),
                        Ok(answer) => panic!("{who} {path}: answered {answer:?}"),
                    }
                }
            }
            // Plain HTTP on the TLS port is not HTTP to it either.
            let plain = get(&socket, None, "/healthz", "").await;
            assert!(plain.as_ref().map_or(true, |a| !a.starts_with("HTTP/1.1 200")), "{plain:?}");
        });
    }

    /// Issue 50: KubeVirt's CA signs more clients than virt-handler's vsock client; each of the
    /// others is refused in the handshake, as is the vsock name without the clientAuth usage,
    /// while the vsock client gets in.
    #[test]
    fn only_kubevirts_vsock_client_is_the_platform() {
        let pki = pki();
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, &pki.ca).unwrap();
        let config = crate::config::VsockConfig { client_ca: ca, ..Default::default() };
        let rt = tokio::runtime::Runtime::new().unwrap();
        let socket = start(&rt, dir.path(), &config);
        let server_cert = dir.path().join("state/vsock/server.crt");
        let tls13: &[&'static rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];
        rt.block_on(async {
            let vsock = get(&socket, Some(&client(&server_cert, Some(&pki.client), tls13)), "/healthz", "").await;
            assert_eq!(status_of(&vsock.unwrap()), "HTTP/1.1 200 OK");
            for (name, identity) in &pki.siblings {
                let got = get(&socket, Some(&client(&server_cert, Some(identity), tls13)), "/healthz", "").await;
                match got {
                    Err(e) => assert!(e.contains("AccessDenied"), "{name}: {e}"),
                    Ok(answer) => panic!("{name}: answered {answer:?}"),
                }
            }
        });
    }

    /// KubeVirt's CA rotates: a bundle put in place of the old one is what the next handshake is
    /// checked against, without a restart; a broken or missing file leaves the last good bundle
    /// in force (client_ca.rs).
    #[test]
    fn a_replaced_ca_bundle_is_in_force_at_the_next_handshake() {
        let pki = pki();
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        // As a platform replaces it: a new file renamed over the old one.
        let put = |text: &str| {
            let tmp = dir.path().join("ca.pem.new");
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, &ca).unwrap();
        };
        put(&pki.ca);
        let config = crate::config::VsockConfig { client_ca: ca.clone(), ..Default::default() };
        let rt = tokio::runtime::Runtime::new().unwrap();
        let socket = start(&rt, dir.path(), &config);
        let server_cert = dir.path().join("state/vsock/server.crt");
        let tls13: &[&'static rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];
        rt.block_on(async {
            let (platform, rotated) =
                (client(&server_cert, Some(&pki.client), tls13), client(&server_cert, Some(&pki.stranger), tls13));
            let status = |got: Result<String, String>| match got {
                Ok(a) => status_of(&a).to_string(),
                Err(e) => e,
            };
            assert_eq!(status(get(&socket, Some(&platform), "/healthz", "").await), "HTTP/1.1 200 OK");
            assert!(status(get(&socket, Some(&rotated), "/healthz", "").await).contains("UnknownCA"));

            put(&pki.other_ca);
            assert_eq!(status(get(&socket, Some(&rotated), "/healthz", "").await), "HTTP/1.1 200 OK", "the new CA");
            assert!(status(get(&socket, Some(&platform), "/healthz", "").await).contains("UnknownCA"), "the old CA");

            for broken in ["not a certificate\n", ""] {
                put(broken);
                assert_eq!(status(get(&socket, Some(&rotated), "/healthz", "").await), "HTTP/1.1 200 OK", "{broken:?}");
            }
            std::fs::remove_file(&ca).unwrap();
            assert_eq!(status(get(&socket, Some(&rotated), "/healthz", "").await), "HTTP/1.1 200 OK", "file gone");
            assert!(status(get(&socket, Some(&platform), "/healthz", "").await).contains("UnknownCA"));
        });
    }

    /// A bundle absent when the service starts (KubeVirt puts it in place later): the listener is
    /// up and refuses every client as of an unknown CA, and the bundle, once there, is in force
    /// at the next handshake (client_ca.rs, rule 3).
    #[test]
    fn a_ca_bundle_that_appears_after_the_start_is_in_force_without_a_restart() {
        let pki = pki();
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let config = crate::config::VsockConfig { client_ca: ca.clone(), ..Default::default() };
        let said = crate::serve::tls::vsock_acceptor(&config, &dir.path().join("state0")).unwrap().said;
        assert!(said.contains("not there yet"), "{said}");
        let rt = tokio::runtime::Runtime::new().unwrap();
        let socket = start(&rt, dir.path(), &config);
        let server_cert = dir.path().join("state/vsock/server.crt");
        let tls13: &[&'static rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];
        rt.block_on(async {
            let platform = client(&server_cert, Some(&pki.client), tls13);
            let status = |got: Result<String, String>| match got {
                Ok(a) => status_of(&a).to_string(),
                Err(e) => e,
            };
            assert!(status(get(&socket, Some(&platform), "/healthz", "").await).contains("UnknownCA"));
            let none = client(&server_cert, None, tls13);
            assert!(status(get(&socket, Some(&none), "/healthz", "").await).contains("CertificateRequired"));
            std::fs::write(&ca, &pki.ca).unwrap();
            assert_eq!(status(get(&socket, Some(&platform), "/healthz", "").await), "HTTP/1.1 200 OK");
            let stranger = client(&server_cert, Some(&pki.stranger), tls13);
            assert!(status(get(&socket, Some(&stranger), "/healthz", "").await).contains("UnknownCA"));
        });
    }

    #[test]
    fn plain_vsock_wants_the_bearer_token_as_tcp_does() {
        let dir = tempfile::tempdir().unwrap();
        let config = crate::config::VsockConfig { tls: false, ..Default::default() };
        let rt = tokio::runtime::Runtime::new().unwrap();
        let socket = start(&rt, dir.path(), &config);
        rt.block_on(async {
            assert_eq!(status_of(&get(&socket, None, "/healthz", "").await.unwrap()), "HTTP/1.1 200 OK");
            for path in ["/v1/status", "/metrics"] {
                let answer = get(&socket, None, path, "").await.unwrap();
                assert_eq!(status_of(&answer), "HTTP/1.1 401 Unauthorized", "{path}: {answer}");
                let answer = get(&socket, None, path, "Authorization: Bearer tok-vsock\r\n").await.unwrap();
                assert_eq!(status_of(&answer), "HTTP/1.1 200 OK", "{path}: {answer}");
            }
        });
        assert!(!dir.path().join("state/vsock").exists(), "no certificate made for plain vsock");
    }

    #[test]
    fn the_ioctl_number_is_linuxs() {
        // _IO(7, 0xb9) as Linux's asm-generic/ioctl.h builds it: dir 0, size 0, type 7, nr 0xb9.
        assert_eq!(crate::sysroot::IOCTL_VM_SOCKETS_GET_LOCAL_CID, 0x7b9);
    }

    #[test]
    fn no_file_is_no_device() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(local_cid(&dir.path().join("vsock")).unwrap(), None);
        // A regular file is not the device: the ioctl is refused, and that is an error, not "none".
        let f = dir.path().join("file");
        std::fs::write(&f, "3\n").unwrap();
        assert!(local_cid(&f).is_err());
    }

    #[test]
    fn device_errors_are_told_apart() {
        for errno in [libc::EAFNOSUPPORT, libc::ENODEV, libc::EADDRNOTAVAIL] {
            assert!(means_no_device(&io::Error::from_raw_os_error(errno)), "{errno}");
        }
        assert!(!means_no_device(&io::Error::from_raw_os_error(libc::EADDRINUSE)));
        assert!(!means_no_device(&io::Error::from_raw_os_error(libc::EACCES)));
    }
}
