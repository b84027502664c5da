//! The vsock listener's client-certificate check, with KubeVirt's CA bundle read again whenever
//! its file changes. KubeVirt renews its CA every 7 days by default and reissues virt-handler's
//! certificate from the new one (`pkg/virt-operator/resource/apply/certificates.go`); a bundle
//! read once at start would refuse the platform within a week of a rotation, until someone
//! restarted the service. Here a bundle the platform (or the tenant) puts in place is what the
//! next handshake is checked against.
//!
//! Rules:
//! 1. Every handshake looks at the file's identity (size, modification time, inode); when it
//!    changed, the bundle is read and checked again before it is used.
//! 2. A changed file that is not a usable bundle (absent, unreadable, no certificate, not PEM)
//!    leaves the previous bundle in force, said once per change in the log: a half-written or
//!    wrong file must not lock the platform out, nor let everyone in.
//! 3. A bundle absent (or empty) when the verifier is made is not an error: it refuses every
//!    client (UnknownCA) until the file appears, then checks against it (rule 1). The service
//!    starts no vsock listener while the bundle is absent (`serve::service`: on a machine the
//!    platform does not reach over vsock the port stays free); this covers a file removed between
//!    that look and this one. A file present but unusable stays an error.
//! 4. No CA names are hinted to clients (an empty `certificate_authorities`, RFC 8446 §4.2.4):
//!    the hint list would change under a handshake, and a client with one certificate sends it
//!    either way (virt-handler's `GetClientCertificate` answers with its own whatever is asked).

use anyhow::anyhow;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, UnixTime};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use tokio_rustls::rustls::client::danger::HandshakeSignatureValid;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{DigitallySignedStruct, DistinguishedName, Error, RootCertStore, SignatureScheme};

/// What identifies one version of the file: size, modification time and inode.
type Stamp = (u64, i64, i64, u64);

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.len(), m.mtime(), m.mtime_nsec(), m.ino()))
}

/// The CA bundle at `path` as a verifier requiring a certificate chained to it.
fn verifier(path: &Path, provider: &Arc<CryptoProvider>) -> anyhow::Result<Arc<dyn ClientCertVerifier>> {
    let ca = path.display();
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(path).map_err(|e| anyhow!("{ca} (vsock.client_ca): {e}"))? {
        roots
            .add(c.map_err(|e| anyhow!("{ca} (vsock.client_ca): {e}"))?)
            .map_err(|e| anyhow!("{ca} (vsock.client_ca): {e}"))?;
    }
    if roots.is_empty() {
        anyhow::bail!("{ca} (vsock.client_ca): no certificate in it");
    }
    // No `allow_unauthenticated`: a client without a certificate fails the handshake.
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| anyhow!("{ca} (vsock.client_ca): {e}"))
}

/// A client-certificate verifier over the bundle at `path`, read again when the file changes.
#[derive(Debug)]
pub struct ReloadingCa {
    path: PathBuf,
    provider: Arc<CryptoProvider>,
    /// The bundle in force and the file version it came from.
    current: RwLock<Current>,
}

#[derive(Debug)]
struct Current {
    stamp: Option<Stamp>,
    /// None until a usable bundle was read (rule 3): every client refused.
    verifier: Option<Arc<dyn ClientCertVerifier>>,
    /// The last file version refused (`Some(None)`: the file was gone), so a bad file is said
    /// once and not read again at every handshake.
    refused: Option<Option<Stamp>>,
}

impl ReloadingCa {
    /// Reads the bundle once; an unusable one is the caller's error, as at any start; an absent
    /// or empty one refuses every client until it appears (rule 3).
    pub fn new(path: &Path, provider: Arc<CryptoProvider>) -> anyhow::Result<Arc<ReloadingCa>> {
        let stamp = stamp(path);
        // Empty is cloud-init's user-data given no bundle: not yet configured, as absent is.
        let (verifier, refused) = match stamp {
            Some((len, ..)) if len > 0 => (Some(verifier(path, &provider)?), None),
            _ => {
                tracing::warn!(path = %path.display(), "vsock.client_ca is not there yet: every vsock client is refused until it appears");
                (None, Some(stamp))
            }
        };
        Ok(Arc::new(ReloadingCa {
            path: path.to_path_buf(),
            provider,
            current: RwLock::new(Current { stamp, verifier, refused }),
        }))
    }

    /// Whether no usable bundle has been read yet (rule 3).
    pub fn waiting(&self) -> bool {
        self.current.read().unwrap_or_else(|p| p.into_inner()).verifier.is_none()
    }

    /// Rule 1 and 2: the verifier for this handshake; none while no bundle was ever usable.
    fn now(&self) -> Option<Arc<dyn ClientCertVerifier>> {
        let seen = stamp(&self.path);
        {
            let c = self.current.read().unwrap_or_else(|p| p.into_inner());
            if c.stamp == seen || c.refused == Some(seen) {
                return c.verifier.clone();
            }
        }
        let mut c = self.current.write().unwrap_or_else(|p| p.into_inner());
        match seen.map(|_| verifier(&self.path, &self.provider)) {
            Some(Ok(v)) => {
                tracing::info!(path = %self.path.display(), "vsock.client_ca changed: client certificates are checked against the new bundle");
                *c = Current { stamp: seen, verifier: Some(v), refused: None };
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
        c.verifier.clone()
    }
}

impl ClientCertVerifier for ReloadingCa {
    fn client_auth_mandatory(&self) -> bool {
        true
    }

    /// Rule 3.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        match self.now() {
            Some(v) => v.verify_client_cert(end_entity, intermediates, now),
            // Rule 3: no CA to chain to, so no issuer is known.
            None => Err(Error::InvalidCertificate(tokio_rustls::rustls::CertificateError::UnknownIssuer)),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        match &self.current.read().unwrap_or_else(|p| p.into_inner()).verifier {
            Some(v) => v.verify_tls12_signature(message, cert, dss),
            None => Err(Error::InvalidCertificate(tokio_rustls::rustls::CertificateError::UnknownIssuer)),
        }
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        match &self.current.read().unwrap_or_else(|p| p.into_inner()).verifier {
            Some(v) => v.verify_tls13_signature(message, cert, dss),
            None => Err(Error::InvalidCertificate(tokio_rustls::rustls::CertificateError::UnknownIssuer)),
        }
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        match &self.current.read().unwrap_or_else(|p| p.into_inner()).verifier {
            Some(v) => v.supported_verify_schemes(),
            None => self.provider.signature_verification_algorithms.supported_schemes(),
        }
    }
}
