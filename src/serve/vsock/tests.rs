//! The vsock listener's rules over a Unix socket pair standing in for AF_VSOCK.
use super::*;
use crate::serve::{Published, Shared};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use std::path::Path;
use std::sync::{Arc, RwLock};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;

/// The vsock listener's rules over a Unix socket pair standing in for AF_VSOCK (the VM test
/// drives a real virtio-vsock device): every connection comes from CID 2, the host.
pub(super) struct FromHost(pub(super) tokio::net::UnixListener);

impl Accept for FromHost {
    type Stream = tokio::net::UnixStream;
    async fn accept(&self) -> io::Result<(Self::Stream, Peer)> {
        Ok((self.0.accept().await?.0, Peer::Cid(2)))
    }
}

pub(super) struct Pki {
    pub(super) ca: String,
    pub(super) client: (String, String),
    pub(super) stranger: (String, String),
    /// The stranger's CA: the bundle a rotation would bring.
    pub(super) other_ca: String,
    /// The other clients KubeVirt's CA signs (`secrets.go`), each with its name, and the
    /// vsock client's name on a certificate without the clientAuth usage.
    pub(super) siblings: Vec<(String, (String, String))>,
}

/// A leaf signed by `issuer` named `cn`, with the clientAuth usage when `client_auth`, as
/// KubeVirt's `triple.NewClientKeyPair` issues them.
pub(super) fn named_leaf(issuer: &CertifiedIssuer<'_, KeyPair>, cn: &str, client_auth: bool) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(rcgen::DnType::CommonName, cn);
    if client_auth {
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    }
    let cert = p.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

pub(super) fn pki() -> Pki {
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

pub(super) fn published() -> Shared {
    let bytes = |s: &str| bytes::Bytes::from(s.to_string());
    Arc::new(RwLock::new(Some(Arc::new(Published {
        health: crate::report::Health::Healthy,
        report_json: bytes("{\"schema\":\"phq.status/v1\"}"),
        metrics: crate::serve::Metrics::fixed("phq_up 1\n", "phq_up 1\n# EOF\n"),
        subsets: Default::default(),
        token: Some("tok-vsock".into()),
        control_token: None,
        summary: "healthy".into(),
        reason: None,
        snapshot: Arc::new(crate::checks::testutil::healthy()),
    }))))
}

/// A client as virt-handler is one: TLS 1.3 (or `versions`), the agent's own certificate
/// trusted (virt-handler trusts any), `identity` presented when given.
pub(super) fn client(
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
pub(super) async fn get(
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

pub(super) fn status_of(answer: &str) -> &str {
    answer.lines().next().unwrap_or("")
}

/// Starts the real accept loop with the vsock acceptor `vsock` makes; the socket's path.
pub(super) fn start(
    rt: &tokio::runtime::Runtime,
    dir: &Path,
    vsock: &crate::config::VsockConfig,
) -> std::path::PathBuf {
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

pub(super) const TLS13: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];

/// The accept loop with cloud-init's bundle `ca_pem` in `dir/ca.pem` and virt-handler asked as
/// `ca_refresh` says: the runtime it runs on, its socket, and the agent's own certificate.
pub(super) fn listening(
    dir: &Path,
    ca_pem: &str,
    ca_refresh: Option<std::time::Duration>,
) -> (tokio::runtime::Runtime, std::path::PathBuf, std::path::PathBuf) {
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, ca_pem).unwrap();
    let config = crate::config::VsockConfig { client_ca: ca, ca_refresh, ..Default::default() };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let socket = start(&rt, dir, &config);
    (rt, socket, dir.join("state/vsock/server.crt"))
}

#[test]
fn a_client_certificate_from_the_bundle_is_required_over_tls_1_3() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let (rt, socket, server_cert) = listening(dir.path(), &pki.ca, None);
    let tls13 = TLS13;
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
    let (rt, socket, server_cert) = listening(dir.path(), &pki.ca, None);
    let tls13 = TLS13;
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
    let config = crate::config::VsockConfig { client_ca: ca.clone(), ca_refresh: None, ..Default::default() };
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
    let config = crate::config::VsockConfig { client_ca: ca.clone(), ca_refresh: None, ..Default::default() };
    let said = crate::serve::tls::vsock_acceptor(&config, &dir.path().join("state0")).unwrap().said;
    assert!(said.contains("none yet"), "{said}");
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

/// KubeVirt's CA kept current from virt-handler's CA server, over this harness.
mod ca;
