//! The agent's own server certificate for the vsock listener, kept in its state directory.
//!
//! virt-handler does not verify it (KubeVirt pkg/virt-handler/vsock/dial.go: `tls.Client` with
//! `InsecureSkipVerify: true`): the platform is proven by its client certificate, not the agent
//! by this one. So a self-signed certificate made here is enough, and its one duty is to exist
//! and not expire:
//!
//! 1. Made on first start (ECDSA P-256 through rcgen's ring backend, self-signed), the key file
//!    0600 and written through `durable` (no half-written key after a crash).
//! 2. Valid `VALIDITY`, rotated when within `ROTATE_BEFORE` of its end; the service asks
//!    `Rotating::refresh` once a day, so a running agent rotates too.
//! 3. Its end is kept beside it (`server.not-after`, seconds since the epoch): the certificate
//!    is ours, so we need not parse X.509 to know it; a missing or unreadable note makes a new
//!    certificate, never an old one kept.

use anyhow::{anyhow, Context};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;

/// How long a made certificate is valid: 90 days, the lifetime Let's Encrypt gives, so a key
/// that leaked from a backup of the state directory is not good for long.
pub const VALIDITY: Duration = Duration::from_secs(90 * 24 * 3600);
/// A certificate with less than this left is replaced: 30 days, when certbot renews its 90-day
/// certificates (certbot's `renew_before_expiry` default), which leaves a month of daily checks
/// for a machine that was off or a disk that was full.
pub const ROTATE_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);
/// How often the service asks whether to rotate.
pub const CHECK_EVERY: Duration = Duration::from_secs(24 * 3600);

/// Where a made certificate lives: `<state_dir>/vsock/`.
pub fn paths(state_dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let dir = state_dir.join("vsock");
    (dir.join("server.crt"), dir.join("server.key"), dir.join("server.not-after"))
}

/// Whether a certificate ending at `not_after` must be replaced at `now`.
pub fn due(not_after: SystemTime, now: SystemTime) -> bool {
    not_after.duration_since(now).map_or(true, |left| left < ROTATE_BEFORE)
}

/// The certificate in `state_dir`, made or rotated first when needed; says what it did.
pub fn ensure(
    state_dir: &Path,
    now: SystemTime,
) -> anyhow::Result<(CertificateDer<'static>, PrivateKeyDer<'static>, String)> {
    let (cert, key, note) = paths(state_dir);
    let kept = std::fs::read_to_string(&note)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(|secs| UNIX_EPOCH + Duration::from_secs(secs));
    let said = match kept {
        Some(end) if !due(end, now) && cert.exists() && key.exists() => None,
        Some(_) => Some("rotated (within 30 days of its end)"),
        None => Some("made (none kept)"),
    };
    if let Some(said) = said {
        make(&cert, &key, &note, now)?;
        let (c, k) = load(&cert, &key)?;
        return Ok((c, k, format!("server certificate {said}: {}", cert.display())));
    }
    let (c, k) = load(&cert, &key)?;
    Ok((c, k, format!("server certificate kept: {}", cert.display())))
}

fn make(cert: &Path, key: &Path, note: &Path, now: SystemTime) -> anyhow::Result<()> {
    let dir = cert.parent().ok_or_else(|| anyhow!("{}: no parent directory", cert.display()))?;
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
        .create(dir)
        .with_context(|| format!("{}: cannot create", dir.display()))?;
    let pair = rcgen::KeyPair::generate().context("generating the vsock server key")?;
    let mut params = rcgen::CertificateParams::new(vec!["phq-agent".to_string()]).context("certificate names")?;
    // An hour back for a guest clock a little behind the host's.
    params.not_before = time::OffsetDateTime::from(now - Duration::from_secs(3600));
    let not_after = now + VALIDITY;
    params.not_after = time::OffsetDateTime::from(not_after);
    let made = params.self_signed(&pair).context("signing the vsock server certificate")?;
    let secs = not_after.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    crate::durable::write(key, pair.serialize_pem().as_bytes(), 0o600)
        .with_context(|| format!("{}: cannot write", key.display()))?;
    crate::durable::write(cert, made.pem().as_bytes(), 0o600)
        .with_context(|| format!("{}: cannot write", cert.display()))?;
    crate::durable::write(note, format!("{secs}\n").as_bytes(), 0o600)
        .with_context(|| format!("{}: cannot write", note.display()))?;
    Ok(())
}

fn load(cert: &Path, key: &Path) -> anyhow::Result<(CertificateDer<'static>, PrivateKeyDer<'static>)> {
    let c = CertificateDer::from_pem_file(cert).map_err(|e| anyhow!("{}: {e}", cert.display()))?;
    let k = PrivateKeyDer::from_pem_file(key).map_err(|e| anyhow!("{}: {e}", key.display()))?;
    Ok((c, k))
}

/// The server certificate rustls presents, swapped in place when `refresh` rotates it.
#[derive(Debug)]
pub struct Rotating {
    state_dir: PathBuf,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<CertifiedKey>>,
}

impl Rotating {
    pub fn new(state_dir: &Path, provider: Arc<CryptoProvider>) -> anyhow::Result<(Arc<Rotating>, String)> {
        let (cert, key, said) = ensure(state_dir, SystemTime::now())?;
        let certified = certified(&provider, cert, key)?;
        Ok((Arc::new(Rotating { state_dir: state_dir.to_path_buf(), provider, current: RwLock::new(certified) }), said))
    }

    /// Rotates when due; says what it did.
    pub fn refresh(&self, now: SystemTime) -> anyhow::Result<String> {
        let (cert, key, said) = ensure(&self.state_dir, now)?;
        let certified = certified(&self.provider, cert, key)?;
        if let Ok(mut c) = self.current.write() {
            *c = certified;
        }
        Ok(said)
    }
}

fn certified(
    provider: &CryptoProvider,
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
) -> anyhow::Result<Arc<CertifiedKey>> {
    Ok(Arc::new(CertifiedKey::from_der(vec![cert], key, provider).map_err(|e| anyhow!("vsock server key: {e}"))?))
}

impl ResolvesServerCert for Rotating {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok().map(|c| c.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    #[test]
    fn made_once_kept_then_rotated_within_thirty_days_of_its_end() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = SystemTime::now();
        let (c0, _, said) = ensure(dir.path(), t0).unwrap();
        assert!(said.contains("made"), "{said}");
        let (crt, key, _) = paths(dir.path());
        for f in [&crt, &key] {
            assert_eq!(std::fs::metadata(f).unwrap().permissions().mode() & 0o777, 0o600, "{}", f.display());
        }
        // 59 days on: 31 days left, kept.
        let (c1, _, said) = ensure(dir.path(), t0 + 59 * DAY).unwrap();
        assert!(said.contains("kept"), "{said}");
        assert_eq!(c0, c1);
        // 61 days on: 29 days left, a new one.
        let (c2, _, said) = ensure(dir.path(), t0 + 61 * DAY).unwrap();
        assert!(said.contains("rotated"), "{said}");
        assert_ne!(c1, c2);
    }

    #[test]
    fn a_lost_note_makes_a_new_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let (c0, _, _) = ensure(dir.path(), SystemTime::now()).unwrap();
        std::fs::write(paths(dir.path()).2, "garbage").unwrap();
        let (c1, _, said) = ensure(dir.path(), SystemTime::now()).unwrap();
        assert!(said.contains("made"), "{said}");
        assert_ne!(c0, c1);
    }

    #[test]
    fn due_is_thirty_days_before_the_end() {
        let now = SystemTime::now();
        assert!(!due(now + 31 * DAY, now));
        assert!(due(now + 29 * DAY, now));
        assert!(due(now - DAY, now), "already expired");
    }
}
