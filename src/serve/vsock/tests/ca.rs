//! KubeVirt's CA kept current from virt-handler's CA server (`client_ca`, `kubevirt_ca`): a
//! stand-in for that server generated from KubeVirt's `system.proto` and served by grpcio
//! (`tests/fixtures/kubevirt/ca-server.py`) on a Unix socket named by `PHQ_KUBEVIRT_CA_SERVER`,
//! the vsock listener's accept loop over a Unix socket as in `tests`. The VM test reaches the
//! same server from a real guest through vhost-device-vsock.

use super::{client, listening, named_leaf, pki, status_of, Pki, TLS13};
use crate::serve::client_ca::{ReloadingCa, Source};
use crate::serve::kubevirt_ca::SERVER_ENV;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use tokio_rustls::rustls;

/// `SERVER_ENV` is the process's: one test at a time names its server.
static ENV: Mutex<()> = Mutex::new(());

/// The stand-in CA server; killed when dropped.
struct CaServer {
    child: std::process::Child,
    socket: PathBuf,
    bundle: PathBuf,
    mode: PathBuf,
}

impl Drop for CaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl CaServer {
    /// What the server answers from now on.
    fn serve(&self, pem: &str) {
        std::fs::write(&self.bundle, pem).unwrap();
        std::fs::write(&self.mode, "serve").unwrap();
    }
    fn mode(&self, mode: &str) {
        std::fs::write(&self.mode, mode).unwrap();
    }
    /// Calls it has answered (or begun to).
    fn calls(&self) -> usize {
        std::fs::read_to_string(format!("{}.calls", self.socket.display())).map_or(0, |s| s.lines().count())
    }
}

/// Starts the stand-in serving `pem`, or says why it cannot (a failure under `CI=true`, which
/// installs Debian's python3-grpcio and python3-grpc-tools).
fn ca_server(dir: &Path, pem: &str) -> Option<CaServer> {
    let python = "/usr/bin/python3";
    let ok = std::process::Command::new(python)
        .args(["-c", "import grpc, grpc_tools.protoc"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let why = "the CA server stand-in needs python3-grpcio and python3-grpc-tools (scripts/test installs them)";
        assert!(std::env::var("CI").map_or(true, |v| v.is_empty() || v == "false" || v == "0"), "{why}");
        eprintln!("SKIPPED: {why}");
        return None;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kubevirt/ca-server.py");
    let (socket, bundle, mode) = (dir.join("ca.sock"), dir.join("served.pem"), dir.join("mode"));
    std::fs::write(&bundle, pem).unwrap();
    let child = std::process::Command::new(python)
        .arg(&script)
        .args([&socket, &bundle, &mode])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let server = CaServer { child, socket, bundle, mode };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !server.socket.exists() {
        assert!(std::time::Instant::now() < until, "the CA server made no socket");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Some(server)
}

/// `/healthz` over a new connection with `identity`: the status line, or the error.
fn healthz(rt: &tokio::runtime::Runtime, socket: &Path, server_cert: &Path, identity: &(String, String)) -> String {
    rt.block_on(async {
        match super::get(socket, Some(&client(server_cert, Some(identity), TLS13)), "/healthz", "").await {
            Ok(a) => status_of(&a).to_string(),
            Err(e) => e,
        }
    })
}

/// The vsock listener with cloud-init's bundle `file_pem`, virt-handler asked as by default.
fn listener(dir: &Path, file_pem: &str) -> (tokio::runtime::Runtime, PathBuf, PathBuf) {
    listening(dir, file_pem, crate::config::VsockConfig::default().ca_refresh)
}

/// The rotation: virt-handler's CA is replaced while the agent runs. The next
/// handshake with a certificate from the new CA asks virt-handler once, takes its bundle and
/// gets in, without a restart; one from the retired CA is refused. The new bundle is kept, and
/// a restart starts from it, not from cloud-init's older file.
#[test]
fn a_rotated_ca_is_fetched_at_the_handshake_and_kept() {
    let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let Pki { ca, client: old_leaf, stranger: new_leaf, other_ca: new_ca, .. } = pki();
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = ca_server(dir.path(), &ca) else { return };
    std::env::set_var(SERVER_ENV, &server.socket);
    let (rt, socket, server_cert) = listener(dir.path(), &ca);
    assert_eq!(healthz(&rt, &socket, &server_cert, &old_leaf), "HTTP/1.1 200 OK");
    let before = server.calls();

    server.serve(&new_ca);
    assert_eq!(
        healthz(&rt, &socket, &server_cert, &new_leaf),
        "HTTP/1.1 200 OK",
        "the new CA's client after the rotation"
    );
    assert_eq!(server.calls(), before + 1, "one call to virt-handler, at the handshake");
    let retired = healthz(&rt, &socket, &server_cert, &old_leaf);
    assert!(retired.contains("UnknownCA"), "the retired CA's client: {retired}");
    let kept = std::fs::read_to_string(dir.path().join("state").join(crate::serve::client_ca::STORE)).unwrap();
    assert_eq!(kept, new_ca);

    // A restart: cloud-init's file (the old CA) is older than the bundle kept from virt-handler.
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let store = dir.path().join("state").join(crate::serve::client_ca::STORE);
    let again = ReloadingCa::new(&dir.path().join("ca.pem"), Some(store), None, provider).unwrap();
    assert_eq!(again.status().source, Some(Source::VirtHandler));
    std::env::remove_var(SERVER_ENV);
}

/// A CA server that answers garbage, an error, or nothing at all: the handshake is refused
/// within the call's deadline, the last good bundle stays in force, and the status says why.
#[test]
fn a_broken_or_hanging_ca_server_leaves_the_last_good_bundle() {
    let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let Pki { ca, client: good, stranger, .. } = pki();
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = ca_server(dir.path(), &ca) else { return };
    std::env::set_var(SERVER_ENV, &server.socket);
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let file = dir.path().join("vsock-ca.pem");
    std::fs::write(&file, &ca).unwrap();
    for (mode, said) in
        [("garbage", "no certificate"), ("unavailable", "gRPC status 14"), ("hang", "did not answer within")]
    {
        let ca_now =
            ReloadingCa::new(&file, None, Some(std::time::Duration::from_secs(3600)), provider.clone()).unwrap();
        server.mode(mode);
        let t = std::time::Instant::now();
        let changed = ca_now.take_fetched(crate::serve::kubevirt_ca::fetch_blocking());
        eprintln!("{mode}: answered in {:.1?}", t.elapsed());
        assert!(!changed, "{mode}");
        let status = ca_now.status();
        assert_eq!(status.source, Some(Source::CloudInit), "{mode}: the last good bundle stays");
        let error = status.last_fetch.and_then(|f| f.error).unwrap_or_default();
        assert!(error.contains(said), "{mode}: {error}");
    }
    // Through the listener: a certificate the bundle does not know is refused even as the call
    // fails, and the known one still gets in.
    server.mode("garbage");
    let (rt, socket, server_cert) = listener(dir.path(), &ca);
    assert!(healthz(&rt, &socket, &server_cert, &stranger).contains("UnknownCA"));
    assert_eq!(healthz(&rt, &socket, &server_cert, &good), "HTTP/1.1 200 OK");
    std::env::remove_var(SERVER_ENV);
}

/// A bundle whose certificates have all expired is due at once, whatever its age; a current
/// one within `ca_refresh` is not. (The service asks every minute: `refresh_if_due`.)
#[test]
fn an_expired_bundle_is_replaced_from_virt_handler() {
    let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let Pki { ca, .. } = pki();
    let expired = {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, "KubeVirt CA that expired");
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(2021, 1, 1);
        let issuer = rcgen::CertifiedIssuer::self_signed(p, rcgen::KeyPair::generate().unwrap()).unwrap();
        let _ = named_leaf(&issuer, crate::config::VSOCK_CLIENT_NAME, true);
        issuer.pem()
    };
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = ca_server(dir.path(), &ca) else { return };
    std::env::set_var(SERVER_ENV, &server.socket);
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let hour = Some(std::time::Duration::from_secs(3600));
    let file = dir.path().join("vsock-ca.pem");

    std::fs::write(&file, &ca).unwrap();
    let current = ReloadingCa::new(&file, None, hour, provider.clone()).unwrap();
    assert!(!rt.block_on(current.refresh_if_due()));
    assert_eq!(server.calls(), 0, "a current bundle within ca_refresh is not due");

    std::fs::write(&file, &expired).unwrap();
    let old = ReloadingCa::new(&file, None, hour, provider).unwrap();
    assert!(old.status().expires.is_some());
    assert!(rt.block_on(old.refresh_if_due()), "an expired bundle is due");
    assert_eq!((server.calls(), old.status().source), (1, Some(Source::VirtHandler)));
    std::env::remove_var(SERVER_ENV);
}
