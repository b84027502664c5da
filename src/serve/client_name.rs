//! Who a client certificate names, and a verifier that admits only the names configured.
//!
//! A CA signs more clients than the one meant to reach the agent: KubeVirt's `kubevirt-ca`
//! signs virt-handler's migration, monitoring, virt-handler, synchronization-controller and
//! vsock clients (`pkg/virt-operator/resource/generate/components/secrets.go`), and only the
//! vsock client (`kubevirt.io:system:client:vsock`) is meant to open a guest's port. So a chain
//! to the bundle is not enough (issue 50). Rules:
//!
//! 1. The chain verifies first (the verifier wrapped: `client_ca::ReloadingCa` on vsock, a fixed
//!    bundle on TCP); then the leaf's subject CN must be one of the configured names, and the
//!    leaf must carry the extended key usage `clientAuth` (RFC 5280 §4.2.1.12, id-kp 3.2).
//!    rustls' own check admits a leaf without any EKU extension (webpki's client usage is
//!    "required if present"); KubeVirt issues every client certificate with `clientAuth`
//!    (`pkg/certificates/triple`'s `NewClientKeyPair`), so requiring it refuses nothing
//!    KubeVirt makes.
//! 2. A refusal is a failed handshake (`ApplicationVerificationFailure`, the `access_denied`
//!    alert), logged with the name the certificate carried, so an operator sees which client
//!    knocked.
//! 3. Only a certificate the chain check accepted is parsed here, and the parser reads only the
//!    subject and the extensions, through `yasna` (already in the tree with rcgen).

use std::sync::Arc;
use tokio_rustls::rustls::client::danger::HandshakeSignatureValid;
use tokio_rustls::rustls::pki_types::{CertificateDer, UnixTime};
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, Error, SignatureScheme};
use yasna::models::ObjectIdentifier;
use yasna::Tag;

/// What a leaf certificate says of its holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The subject's common name, when it has one.
    pub name: Option<String>,
    /// Whether its extended key usage names `clientAuth`.
    pub client_auth: bool,
}

/// id-at-commonName (RFC 5280 §4.1.2.6, X.520).
const COMMON_NAME: [u64; 4] = [2, 5, 4, 3];
/// id-ce-extKeyUsage (RFC 5280 §4.2.1.12).
const EXT_KEY_USAGE: [u64; 4] = [2, 5, 29, 37];
/// id-kp-clientAuth (RFC 5280 §4.2.1.12).
const CLIENT_AUTH: [u64; 9] = [1, 3, 6, 1, 5, 5, 7, 3, 2];

/// The identity in a DER certificate; an error says what could not be read.
pub fn identity(der: &[u8]) -> Result<Identity, String> {
    let tbs = tbs_of(der).map_err(|e| format!("not an X.509 certificate: {e}"))?;
    let (subject, extensions) = yasna::parse_der(&tbs, |r| {
        r.read_sequence(|r| {
            r.read_optional(|r| r.read_tagged(Tag::context(0), |r| r.read_der()))?; // version
            for _ in 0..4 {
                r.next().read_der()?; // serialNumber, signature, issuer, validity
            }
            let subject = r.next().read_der()?;
            r.next().read_der()?; // subjectPublicKeyInfo
            let mut extensions = None;
            // issuerUniqueID [1], subjectUniqueID [2], extensions [3]: whatever is there.
            while let Some(v) = r.read_optional(|r| r.read_tagged_der())? {
                if v.tag() == Tag::context(3) {
                    extensions = Some(v.value().to_vec());
                }
            }
            Ok((subject, extensions))
        })
    })
    .map_err(|e| format!("its TBSCertificate cannot be read: {e}"))?;
    Ok(Identity {
        name: common_name(&subject).map_err(|e| format!("its subject cannot be read: {e}"))?,
        client_auth: match extensions {
            Some(ext) => client_auth(&ext).map_err(|e| format!("its extensions cannot be read: {e}"))?,
            None => false,
        },
    })
}

/// A certificate's TBSCertificate: the first of its three parts (RFC 5280 §4.1).
fn tbs_of(der: &[u8]) -> yasna::ASN1Result<Vec<u8>> {
    yasna::parse_der(der, |r| {
        r.read_sequence(|r| {
            let tbs = r.next().read_der()?;
            r.next().read_der()?; // signatureAlgorithm
            r.next().read_der()?; // signatureValue
            Ok(tbs)
        })
    })
}

/// When a DER certificate stops being valid (its `notAfter`, RFC 5280 §4.1.2.5: UTCTime
/// `YYMMDDHHMMSSZ`, years 50–99 being 19xx, or GeneralizedTime `YYYYMMDDHHMMSSZ`).
pub fn not_after(der: &[u8]) -> Option<std::time::SystemTime> {
    let tbs = tbs_of(der).ok()?;
    let end = yasna::parse_der(&tbs, |r| {
        r.read_sequence(|r| {
            r.read_optional(|r| r.read_tagged(Tag::context(0), |r| r.read_der()))?;
            for _ in 0..3 {
                r.next().read_der()?; // serialNumber, signature, issuer
            }
            let end = r.next().read_sequence(|r| {
                r.next().read_tagged_der()?;
                r.next().read_tagged_der()
            })?;
            while r.read_optional(|r| r.read_der())?.is_some() {}
            Ok(end)
        })
    })
    .ok()?;
    let text = std::str::from_utf8(end.value()).ok()?.strip_suffix('Z')?;
    let digits = |s: &str| -> Option<i64> { s.bytes().all(|b| b.is_ascii_digit()).then(|| s.parse().ok())? };
    let (year, rest) = match end.tag() {
        t if t == yasna::tags::TAG_UTCTIME => {
            let yy = digits(text.get(..2)?)?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, text.get(2..)?)
        }
        t if t == yasna::tags::TAG_GENERALIZEDTIME => (digits(text.get(..4)?)?, text.get(4..)?),
        _ => return None,
    };
    if rest.len() != 10 {
        return None;
    }
    let f = |i: usize| digits(rest.get(i..i + 2)?);
    let days = days_from_civil(year, f(0)?, f(2)?);
    let secs = days * 86_400 + f(4)? * 3600 + f(6)? * 60 + f(8)?;
    let secs = u64::try_from(secs).ok()?;
    Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The common name of a Name (RDNSequence: a SEQUENCE OF SET OF AttributeTypeAndValue), when it
/// has exactly one, as a UTF8String or a PrintableString (what Go's crypto/x509 writes, and
/// KubeVirt's certificates are Go's). A subject with two common names has none here: Go's
/// `pkix.Name` keeps the last and another reader the first, so a policy that judged one of
/// them must not see the agent admit the other.
fn common_name(name: &[u8]) -> yasna::ASN1Result<Option<String>> {
    let cn = ObjectIdentifier::from_slice(&COMMON_NAME);
    yasna::parse_der(name, |r| {
        let mut found: Vec<Option<String>> = Vec::new();
        r.read_sequence_of(|r| {
            r.read_set_of(|r| {
                r.read_sequence(|r| {
                    let oid = r.next().read_oid()?;
                    let value = r.next().read_tagged_der()?;
                    if oid == cn {
                        let text = [yasna::tags::TAG_UTF8STRING, yasna::tags::TAG_PRINTABLESTRING]
                            .contains(&value.tag())
                            .then(|| std::str::from_utf8(value.value()).ok().map(str::to_string))
                            .flatten();
                        found.push(text);
                    }
                    Ok(())
                })
            })
        })?;
        Ok(match found.as_slice() {
            [one] => one.clone(),
            _ => None,
        })
    })
}

/// Whether the extensions (`[3]`'s content: a SEQUENCE OF Extension) hold an extended key
/// usage that names `clientAuth`.
fn client_auth(extensions: &[u8]) -> yasna::ASN1Result<bool> {
    let (eku, want) = (ObjectIdentifier::from_slice(&EXT_KEY_USAGE), ObjectIdentifier::from_slice(&CLIENT_AUTH));
    let mut usages: Option<Vec<u8>> = None;
    yasna::parse_der(extensions, |r| {
        r.read_sequence_of(|r| {
            r.read_sequence(|r| {
                let oid = r.next().read_oid()?;
                r.read_optional(|r| r.read_bool())?; // critical
                let value = r.next().read_bytes()?;
                if oid == eku {
                    usages = Some(value);
                }
                Ok(())
            })
        })
    })?;
    let Some(usages) = usages else { return Ok(false) };
    let purposes = yasna::parse_der(&usages, |r| r.collect_sequence_of(|r| r.read_oid()))?;
    Ok(purposes.contains(&want))
}

/// Whether `id` is one of `names` with client-auth usage; the reason it is not, else.
pub fn admitted(id: &Identity, names: &[String]) -> Result<(), String> {
    let name = id.name.as_deref().unwrap_or("");
    if !names.iter().any(|n| n == name) {
        return Err(format!("its name {name:?} is not one of {names:?}"));
    }
    if !id.client_auth {
        return Err(format!("{name:?} carries no clientAuth extended key usage"));
    }
    Ok(())
}

/// A verifier that checks the chain with `inner`, then the leaf's name and usage (rule 1).
#[derive(Debug)]
pub struct Named {
    inner: Arc<dyn ClientCertVerifier>,
    names: Vec<String>,
    /// The configuration key that names them, for the log.
    key: &'static str,
}

impl Named {
    pub fn new(inner: Arc<dyn ClientCertVerifier>, names: &[String], key: &'static str) -> Arc<Named> {
        let names = names.iter().map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect();
        Arc::new(Named { inner, names, key })
    }
}

impl ClientCertVerifier for Named {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }
    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        self.inner.verify_client_cert(end_entity, intermediates, now)?;
        let refused = identity(end_entity).and_then(|id| admitted(&id, &self.names));
        match refused {
            Ok(()) => Ok(ClientCertVerified::assertion()),
            Err(why) => {
                tracing::warn!(key = self.key, "a client certificate chained to the CA was refused: {why}");
                Err(Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure))
            }
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(cn: &str, usages: &[rcgen::ExtendedKeyUsagePurpose]) -> Vec<u8> {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::OrganizationName, "kubevirt.io");
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        p.extended_key_usages = usages.to_vec();
        let key = rcgen::KeyPair::generate().unwrap();
        p.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn a_leafs_name_and_client_usage_are_read() {
        use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        let names = vec![crate::config::VSOCK_CLIENT_NAME.to_string()];
        let vsock = identity(&cert("kubevirt.io:system:client:vsock", &[ClientAuth])).unwrap();
        assert_eq!(vsock, Identity { name: Some("kubevirt.io:system:client:vsock".into()), client_auth: true });
        assert!(admitted(&vsock, &names).is_ok());
        let migration = identity(&cert("kubevirt.io:system:client:migration", &[ClientAuth])).unwrap();
        assert!(admitted(&migration, &names).unwrap_err().contains("migration"));
        let server = identity(&cert("kubevirt.io:system:client:vsock", &[ServerAuth])).unwrap();
        assert!(!server.client_auth && admitted(&server, &names).unwrap_err().contains("clientAuth"));
        let none = identity(&cert("kubevirt.io:system:client:vsock", &[])).unwrap();
        assert!(!none.client_auth);
        // Two common names are no name, whichever a reader would take; a BMPString is none.
        let name = |values: &[(u8, &str)]| {
            yasna::construct_der(|w| {
                w.write_sequence(|w| {
                    for (tag, text) in values {
                        w.next().write_set(|w| {
                            w.next().write_sequence(|w| {
                                w.next().write_oid(&ObjectIdentifier::from_slice(&COMMON_NAME));
                                match tag {
                                    12 => w.next().write_utf8string(text),
                                    19 => w.next().write_printable_string(text),
                                    _ => w.next().write_bmp_string(text),
                                }
                            })
                        });
                    }
                })
            })
        };
        let (utf8, printable, bmp) = (12, 19, 30);
        assert_eq!(common_name(&name(&[(utf8, "phq-platform")])).unwrap().as_deref(), Some("phq-platform"));
        assert_eq!(common_name(&name(&[(printable, "phq-platform")])).unwrap().as_deref(), Some("phq-platform"));
        assert_eq!(common_name(&name(&[(utf8, "phq-platform"), (utf8, "tenant-x")])).unwrap(), None);
        assert_eq!(common_name(&name(&[(bmp, "phq-platform")])).unwrap(), None);
        assert!(identity(b"\x30\x03\x02\x01\x01").is_err());
    }

    #[test]
    fn a_certificates_end_is_read() {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.not_after = rcgen::date_time_ymd(2049, 12, 31);
        let der = p.self_signed(&rcgen::KeyPair::generate().unwrap()).unwrap().der().to_vec();
        let end = not_after(&der).unwrap().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        assert_eq!(end, 2_524_521_600, "2049-12-31T00:00:00Z, a UTCTime");
        p.not_after = rcgen::date_time_ymd(2051, 1, 2);
        let der = p.self_signed(&rcgen::KeyPair::generate().unwrap()).unwrap().der().to_vec();
        let end = not_after(&der).unwrap().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        assert_eq!(end, 2_556_230_400, "2051-01-02T00:00:00Z, a GeneralizedTime");
    }
}
