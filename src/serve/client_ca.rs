//! The vsock listener's client-certificate check against KubeVirt's CA bundle, kept current.
//! KubeVirt renews its CA every 7 days by default, and every 24 hours under OpenShift's HCO
//! (`kubevirt_ca`'s comment), and reissues virt-handler's certificate from the new one; a bundle
//! read once at boot would refuse the platform within two days. So the bundle in force comes
//! from two places: the file cloud-init wrote (`vsock.client_ca`, the starting point), and
//! virt-handler's CA server (`kubevirt_ca`), whose last good answer is kept durably in the state
//! directory (`STORE`).
//!
//! Rules:
//! 1. The bundle in force is the newest usable one: the file's (by its modification time) or the
//!    last one fetched. Every handshake looks at the file's identity (size, modification time,
//!    inode); when it changed, the file is read and checked again before it is used.
//! 2. A changed file or a fetched answer that is not a usable bundle (absent, unreadable, no
//!    certificate, not PEM) leaves the previous bundle in force, said once in the log and in the
//!    status: a half-written or wrong bundle must not lock the platform out, nor let everyone in.
//! 3. No bundle at all (no file, none kept): every client is refused (UnknownCA) until one
//!    comes. The service then starts no listener until one does (`serve::service`), so a machine
//!    the platform does not reach keeps the port free.
//! 4. virt-handler is asked (`vsock.ca_refresh`; "off" never asks): when the bundle in force is
//!    older than `ca_refresh`, or expired (its latest `notAfter` past), or there is
//!    none (`refresh_if_due`, which the service calls every minute); and when a client's chain
//!    does not verify against the bundle in force, once more before refusing it
//!    (`verify_client_cert`), at most once per `RETRY_AFTER` so that a stranger's certificates
//!    cannot make the agent call its host in a loop. A CA server that hangs costs its deadline
//!    (`kubevirt_ca::DEADLINE`), and the last good bundle stays in force.
//! 5. No CA names are hinted to clients (an empty `certificate_authorities`, RFC 8446 §4.2.4):
//!    the hint list would change under a handshake, and a client with one certificate sends it
//!    either way (virt-handler's `GetClientCertificate` answers with its own whatever is asked).
//! 6. `status` says where the bundle in force came from, since when, and the last call's
//!    outcome, for `/v1/status` (`agent.vsock_ca`). Where the firmware does not say KubeVirt
//!    (`kubevirt_ca::askable`), nothing is called, and the status says so once.

use anyhow::anyhow;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, UnixTime};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};
use tokio_rustls::rustls::client::danger::HandshakeSignatureValid;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, Error, RootCertStore, SignatureScheme,
};

/// The last bundle virt-handler gave, under the state directory.
pub const STORE: &str = "vsock/kubevirt-ca.pem";
/// Rule 4: a failed chain asks virt-handler at most this often. Our choice: virt-handler polls
/// a guest every few seconds at most, and a rotation needs one call.
pub const RETRY_AFTER: Duration = Duration::from_secs(10);

/// What identifies one version of the file: size, modification time and inode.
type Stamp = (u64, i64, i64, u64);

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.len(), m.mtime(), m.mtime_nsec(), m.ino()))
}

pub use crate::report::{CaFetch as Fetched, CaSource as Source, VsockCa as Status};

/// A usable bundle: its verifier, and what the status says of it.
#[derive(Debug, Clone)]
struct Bundle {
    verifier: Arc<dyn ClientCertVerifier>,
    source: Source,
    since: SystemTime,
    certificates: usize,
    /// The latest `notAfter` among its certificates: past it, nothing chains to the bundle
    /// (a rotation leaves the old CA beside the new one for a while, and that one expiring
    /// first says nothing).
    expires: Option<SystemTime>,
    pem: Vec<u8>,
}

impl Bundle {
    /// `pem` as a bundle a client certificate must chain to; `what` names it in errors.
    fn of(
        pem: &[u8],
        source: Source,
        since: SystemTime,
        provider: &Arc<CryptoProvider>,
        what: &str,
    ) -> anyhow::Result<Bundle> {
        let mut roots = RootCertStore::empty();
        let mut expires: Option<SystemTime> = None;
        let mut certificates = 0;
        for c in CertificateDer::pem_slice_iter(pem) {
            let c = c.map_err(|e| anyhow!("{what}: {e}"))?;
            let end = super::client_name::not_after(&c);
            expires = match (expires, end) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            roots.add(c).map_err(|e| anyhow!("{what}: {e}"))?;
            certificates += 1;
        }
        if roots.is_empty() {
            anyhow::bail!("{what}: no certificate in it");
        }
        // No `allow_unauthenticated`: a client without a certificate fails the handshake.
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| anyhow!("{what}: {e}"))?;
        Ok(Bundle { verifier, source, since, certificates, expires, pem: pem.to_vec() })
    }

    fn expired(&self, now: SystemTime) -> bool {
        self.expires.is_some_and(|e| e <= now)
    }
}

/// A client-certificate verifier over KubeVirt's bundle, kept current (the rules above).
#[derive(Debug)]
pub struct ReloadingCa {
    path: PathBuf,
    /// Where the last fetched bundle is kept; `None`: not kept (no state directory).
    store: Option<PathBuf>,
    refresh: Option<Duration>,
    provider: Arc<CryptoProvider>,
    current: RwLock<Current>,
    /// When virt-handler was last asked (rule 4's pace), and what it said.
    asked: Mutex<(Option<Instant>, Option<Fetched>)>,
}

#[derive(Debug)]
struct Current {
    stamp: Option<Stamp>,
    /// None until a usable bundle was read or fetched (rule 3): every client refused.
    bundle: Option<Bundle>,
    /// The last file version refused (`Some(None)`: the file was gone), so a bad file is said
    /// once and not read again at every handshake.
    refused: Option<Option<Stamp>>,
}

impl ReloadingCa {
    /// The file's bundle and the kept one (rule 1); an unusable file is the caller's error, as
    /// at any start; an absent or empty one is not (rule 3). A kept bundle that cannot be read
    /// is said and left aside: virt-handler gives it again.
    pub fn new(
        path: &Path,
        store: Option<PathBuf>,
        refresh: Option<Duration>,
        provider: Arc<CryptoProvider>,
    ) -> anyhow::Result<Arc<ReloadingCa>> {
        let stamp = stamp(path);
        let kept = store.as_deref().and_then(|s| {
            let pem = match crate::sysroot::open_regular(s, true) {
                Ok((f, m)) => {
                    use std::io::Read;
                    let mut buf = Vec::new();
                    f.take(super::kubevirt_ca::MAX_ANSWER as u64).read_to_end(&mut buf).ok()?;
                    (buf, m.modified().unwrap_or(SystemTime::UNIX_EPOCH))
                }
                Err(_) => return None,
            };
            Bundle::of(&pem.0, Source::VirtHandler, pem.1, &provider, &s.display().to_string())
                .map_err(|e| tracing::warn!("the kept bundle is not usable ({e:#}); virt-handler is asked again"))
                .ok()
        });
        let from_file = match stamp {
            // Empty is cloud-init's user-data given no bundle: not yet configured, as absent is.
            Some((len, ..)) if len > 0 => match Self::read_file(path, &provider) {
                Ok(b) => Some(b),
                // A bad file with a good kept bundle beside it: rule 2, as at any later change.
                Err(e) if kept.is_some() => {
                    tracing::warn!("{e:#}; the bundle kept from virt-handler is in force");
                    None
                }
                Err(e) => return Err(e),
            },
            _ => None,
        };
        let bundle = match (from_file, kept) {
            (Some(f), Some(k)) => Some(if k.since > f.since { k } else { f }),
            (f, k) => f.or(k),
        };
        if bundle.is_none() {
            tracing::warn!(path = %path.display(), "no KubeVirt CA bundle yet: every vsock client is refused until one comes");
        }
        let refused = if bundle.is_none() { Some(stamp) } else { None };
        Ok(Arc::new(ReloadingCa {
            path: path.to_path_buf(),
            store,
            refresh,
            provider,
            current: RwLock::new(Current { stamp, bundle, refused }),
            asked: Mutex::new((None, None)),
        }))
    }

    fn read_file(path: &Path, provider: &Arc<CryptoProvider>) -> anyhow::Result<Bundle> {
        let what = format!("{} (vsock.client_ca)", path.display());
        let pem = std::fs::read(path).map_err(|e| anyhow!("{what}: {e}"))?;
        let since = std::fs::metadata(path).and_then(|m| m.modified()).unwrap_or_else(|_| SystemTime::now());
        Bundle::of(&pem, Source::CloudInit, since, provider, &what)
    }

    /// Whether no usable bundle is in force yet (rule 3).
    pub fn waiting(&self) -> bool {
        self.now().is_none()
    }

    /// Rules 1 and 2: the bundle for this handshake; none while no bundle was ever usable.
    fn now(&self) -> Option<Bundle> {
        let seen = stamp(&self.path);
        {
            let c = self.current.read().unwrap_or_else(|p| p.into_inner());
            if c.stamp == seen || c.refused == Some(seen) {
                return c.bundle.clone();
            }
        }
        let mut c = self.current.write().unwrap_or_else(|p| p.into_inner());
        match seen.map(|_| Self::read_file(&self.path, &self.provider)) {
            Some(Ok(b)) => {
                tracing::info!(path = %self.path.display(), "vsock.client_ca changed: client certificates are checked against the new bundle");
                *c = Current { stamp: seen, bundle: Some(b), refused: None };
            }
            Some(Err(e)) => {
                tracing::warn!(
                    "vsock.client_ca changed but is not a usable bundle ({e:#}); the previous bundle stays in force"
                );
                c.refused = Some(seen);
            }
            None => {
                tracing::warn!(path = %self.path.display(), "vsock.client_ca is gone; the previous bundle stays in force");
                c.refused = Some(None);
            }
        }
        c.bundle.clone()
    }

    /// Takes virt-handler's answer (rules 2 and 4): a usable bundle is kept durably and in force
    /// from now; anything else leaves the last good one. True when the bundle in force changed.
    pub fn take_fetched(&self, answer: Result<Vec<u8>, String>) -> bool {
        let at = SystemTime::now();
        let server = super::kubevirt_ca::server();
        let taken = answer.and_then(|pem| {
            let b = Bundle::of(&pem, Source::VirtHandler, at, &self.provider, "virt-handler's bundle")
                .map_err(|e| format!("{e:#}"))?;
            if let Some(store) = &self.store {
                crate::durable::write(store, &pem, 0o644)
                    .map_err(|e| format!("{}: cannot keep the bundle: {e}", store.display()))?;
            }
            Ok(b)
        });
        let mut asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
        let fetched = Fetched { at: crate::snapshot::Timestamp(at), server, error: taken.as_ref().err().cloned() };
        let changed = match taken {
            Ok(b) => {
                let mut c = self.current.write().unwrap_or_else(|p| p.into_inner());
                let changed = c.bundle.as_ref().is_none_or(|old| old.pem != b.pem);
                if changed {
                    tracing::info!(certificates = b.certificates, "KubeVirt's CA bundle from virt-handler is in force");
                }
                c.bundle = Some(b);
                changed
            }
            Err(e) => {
                tracing::warn!("virt-handler's CA bundle was not taken: {e}; the last good bundle stays in force");
                false
            }
        };
        asked.1 = Some(fetched);
        changed
    }

    /// Rule 4's pace: whether virt-handler may be asked now (`after` since the last call), and
    /// if so, the call is counted as made.
    fn may_ask(&self, after: Duration) -> bool {
        if self.refresh.is_none() {
            return false;
        }
        let mut asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
        if asked.0.is_some_and(|t| t.elapsed() < after) {
            return false;
        }
        asked.0 = Some(Instant::now());
        true
    }

    /// Whether the bundle in force is due a call (rule 4): none, expired, or older than
    /// `ca_refresh`.
    fn due(&self) -> bool {
        let Some(every) = self.refresh else { return false };
        let now = SystemTime::now();
        match self.now() {
            None => true,
            Some(b) => b.expired(now) || now.duration_since(b.since).unwrap_or_default() >= every,
        }
    }

    /// Rule 4, from the service's minute tick: asks virt-handler when the bundle is due and
    /// the last call was a minute ago or more. True when the bundle in force changed.
    pub async fn refresh_if_due(&self) -> bool {
        if !self.due() {
            return false;
        }
        if let Err(why) = super::kubevirt_ca::askable() {
            // Said once in the status; nothing to call, so no warning every minute.
            let mut asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
            if asked.1.is_none() {
                let server = super::kubevirt_ca::server();
                asked.1 = Some(Fetched { at: crate::snapshot::Timestamp::now(), server, error: Some(why) });
            }
            return false;
        }
        if !self.may_ask(Duration::from_secs(60)) {
            return false;
        }
        let answer = super::kubevirt_ca::fetch().await;
        self.take_fetched(answer)
    }

    /// Rule 6.
    pub fn status(&self) -> Status {
        let bundle = self.now();
        let ts = crate::snapshot::Timestamp;
        Status {
            source: bundle.as_ref().map(|b| b.source),
            since: bundle.as_ref().map(|b| ts(b.since)),
            certificates: bundle.as_ref().map_or(0, |b| b.certificates),
            expires: bundle.as_ref().and_then(|b| b.expires).map(ts),
            last_fetch: self.asked.lock().unwrap_or_else(|p| p.into_inner()).1.clone(),
            age_s: bundle.as_ref().map(|b| SystemTime::now().duration_since(b.since).unwrap_or_default().as_secs()),
        }
    }

    /// The verifier in force, for the signature checks.
    fn verifier(&self) -> Option<Arc<dyn ClientCertVerifier>> {
        self.current.read().unwrap_or_else(|p| p.into_inner()).bundle.as_ref().map(|b| b.verifier.clone())
    }
}

/// A refusal that a newer bundle could turn around: the chain, not the client's name or
/// usage (those are `client_name`'s, after this).
fn chain_refused(e: &Error) -> bool {
    !matches!(e, Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure))
}

impl ClientCertVerifier for ReloadingCa {
    fn client_auth_mandatory(&self) -> bool {
        true
    }

    /// Rule 5.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        // Rule 3: no CA to chain to, so no issuer is known.
        let unknown = Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let first = match self.now() {
            Some(b) => b.verifier.verify_client_cert(end_entity, intermediates, now),
            None => Err(unknown.clone()),
        };
        match first {
            Err(e) if chain_refused(&e) && self.may_ask(RETRY_AFTER) => {
                // Rule 4: once more against what virt-handler serves now (a rotated CA). The call
                // blocks this handshake for at most its deadline; on the service's multi-thread
                // runtime the worker is handed over meanwhile (`block_in_place`), so other
                // connections are not held up by it.
                let fetch = || super::kubevirt_ca::fetch_blocking();
                let answer = match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
                    Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(fetch),
                    _ => fetch(),
                };
                if !self.take_fetched(answer) {
                    return Err(e);
                }
                match self.verifier() {
                    Some(v) => v.verify_client_cert(end_entity, intermediates, now),
                    None => Err(unknown),
                }
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        match self.verifier() {
            Some(v) => v.verify_tls12_signature(message, cert, dss),
            None => Err(Error::InvalidCertificate(CertificateError::UnknownIssuer)),
        }
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        match self.verifier() {
            Some(v) => v.verify_tls13_signature(message, cert, dss),
            None => Err(Error::InvalidCertificate(CertificateError::UnknownIssuer)),
        }
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        match self.verifier() {
            Some(v) => v.supported_verify_schemes(),
            None => self.provider.signature_verification_algorithms.supported_schemes(),
        }
    }
}
