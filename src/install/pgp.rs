//! Fingerprints of the OpenPGP keys in a keyring file, binary or ASCII-armored (RFC 4880), and
//! the one gate through which a downloaded key becomes trusted.
//!
//! The installer trusts a repository only after the key it is about to install carries the
//! pinned fingerprint, and only that key: a file holding any other primary key, a second armored
//! block, or anything after the armor's end is refused, since apt trusts every key in a keyring
//! and `rpm --import` imports every block in a file. What is then installed is not the
//! downloaded file but the packets that were read and checked, written out again by the agent
//! (`Verified::binary` for apt's `signed-by`, `Verified::armored` for rpm). Version-4 keys are
//! what NVIDIA and EPEL publish; other versions are reported, never guessed at.
//!
//! Of the subkeys, only those the pinned key binds are written: a subkey is the primary's only
//! through a subkey binding signature (RFC 4880 §5.2.1, type 0x18) that the primary issued
//! (§11.1: "each Subkey packet MUST be followed by one Signature packet, which should be a
//! subkey binding signature issued by the top-level key"). A subkey packet appended by someone
//! else, with no such signature, is dropped with whatever follows it. The agent reads who
//! issued a binding (the Issuer and Issuer Fingerprint subpackets, §5.2.3.5, RFC 9580
//! §5.2.3.35); apt's gpgv and rpm check the signature's mathematics themselves before they use
//! a subkey, so what reaches them is the pinned key and what it claims as its own.

use base64::Engine;

const TAG_SIGNATURE: u8 = 2;
const TAG_PUBLIC_KEY: u8 = 6;
const TAG_TRUST: u8 = 12;
const TAG_USER_ID: u8 = 13;
const TAG_PUBLIC_SUBKEY: u8 = 14;
const TAG_USER_ATTRIBUTE: u8 = 17;

/// Signature types (RFC 4880 §5.2.1) a primary key issues over one of its subkeys: the binding,
/// and its revocation.
const SIG_SUBKEY_BINDING: u8 = 0x18;
const SIG_SUBKEY_REVOCATION: u8 = 0x28;
/// Signature subpackets that name the issuer (RFC 4880 §5.2.3.5: its 8-octet key id; RFC 9580
/// §5.2.3.35: its version and fingerprint).
const SUBPACKET_ISSUER: u8 = 16;
const SUBPACKET_ISSUER_FINGERPRINT: u8 = 33;

/// The packets a transferable public key is made of (RFC 4880 §11.1: a primary key, its
/// revocations, user ids and attributes with their signatures, subkeys with their bindings;
/// GnuPG may add trust packets to an export). Anything else has no place in a key file.
const KEY_PACKETS: &[u8] =
    &[TAG_SIGNATURE, TAG_PUBLIC_KEY, TAG_TRUST, TAG_USER_ID, TAG_PUBLIC_SUBKEY, TAG_USER_ATTRIBUTE];

/// Why a key file is not the pinned key alone, or not a key file at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("{0:?} is not a whole key fingerprint (40 hex digits)")]
    NotAFingerprint(String),
    #[error("no OpenPGP public key in it")]
    NoKey,
    #[error("it holds an OpenPGP packet of type {0}, which is no part of a public key")]
    NotKeyPacket(u8),
    #[error("it starts with an OpenPGP packet of type {0}, not a public key")]
    StartsWith(u8),
    #[error("its key is {} — expected {}", spaced(found), spaced(pinned))]
    OtherKey { found: String, pinned: String },
    #[error(
        "it holds {} primary keys ({}); expected only {}",
        found.len(),
        found.iter().map(|f| spaced(f)).collect::<Vec<_>>().join(", "),
        spaced(pinned)
    )]
    Several { found: Vec<String>, pinned: String },
    #[error("it holds a second armored block after the first; a key file must hold one key alone")]
    SecondBlock,
    #[error("there is more after the armored block's END line; a key file must hold one key alone")]
    AfterEnd,
    /// The armor is not RFC 4880's: what is wrong with it, and where.
    #[error("{0}")]
    Armor(String),
    #[error("not an OpenPGP packet (header byte 0x{0:02x})")]
    NotAPacket(u8),
    /// A packet's framing is wrong, or of a kind no key has.
    #[error("{0}")]
    Packet(&'static str),
    #[error("OpenPGP key version {0} (only version 4 is read)")]
    KeyVersion(u8),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    /// 40 upper-case hex digits.
    pub fingerprint: String,
    /// A primary key (tag 6) rather than a subkey (tag 14).
    pub primary: bool,
}

/// A key file that held exactly the pinned key and nothing else: its packets, as read, less any
/// subkey the pinned key does not bind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub fingerprint: String,
    packets: Vec<u8>,
    /// Fingerprints of the subkeys left out: no binding signature from the pinned key.
    pub unbound_subkeys: Vec<String>,
}

impl Verified {
    /// The key's packets, for a binary keyring (apt's `signed-by=`).
    pub fn binary(&self) -> &[u8] {
        &self.packets
    }

    /// The key's packets in ASCII armor (RFC 4880 §6.2, with its CRC-24), for `rpm --import`.
    pub fn armored(&self) -> String {
        armor(&self.packets)
    }
}

/// The primary keys and subkeys of `data`, in file order.
pub fn keys(data: &[u8]) -> Result<Vec<Key>, KeyError> {
    let binary = if is_armored(data) { dearmor(data)? } else { data.to_vec() };
    let mut out = Vec::new();
    let mut rest = binary.as_slice();
    while !rest.is_empty() {
        let (tag, body, next) = packet(rest)?;
        if tag == TAG_PUBLIC_KEY || tag == TAG_PUBLIC_SUBKEY {
            out.push(Key { fingerprint: v4_fingerprint(body)?, primary: tag == TAG_PUBLIC_KEY });
        }
        rest = next;
    }
    if out.is_empty() {
        return Err(KeyError::NoKey);
    }
    Ok(out)
}

/// The key in `data` when it is exactly one transferable public key whose primary key has
/// `pinned` as its whole fingerprint (spaces and case ignored): one armored block and nothing
/// around it but white space, or binary packets that are all parts of a key. Only all 40 digits
/// are accepted: a short key id (8 or 16 digits) is cheap to collide with a key of one's own
/// making ("Evil 32", evil32.com), so a suffix match would trust an impostor.
pub fn verified(data: &[u8], pinned: &str) -> Result<Verified, KeyError> {
    let pinned: String = pinned.chars().filter(|c| !c.is_whitespace()).collect::<String>().to_ascii_uppercase();
    if pinned.len() != 40 || !pinned.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(KeyError::NotAFingerprint(pinned));
    }
    let packets = if is_armored(data) { dearmor(data)? } else { data.to_vec() };
    let mut rest = packets.as_slice();
    let mut primaries = Vec::new();
    let mut first = true;
    while !rest.is_empty() {
        let (tag, body, next) = packet(rest)?;
        if !KEY_PACKETS.contains(&tag) {
            return Err(KeyError::NotKeyPacket(tag));
        }
        if first && tag != TAG_PUBLIC_KEY {
            return Err(KeyError::StartsWith(tag));
        }
        if tag == TAG_PUBLIC_KEY {
            primaries.push(v4_fingerprint(body)?);
        }
        first = false;
        rest = next;
    }
    match primaries.as_slice() {
        [one] if *one == pinned => {
            let (packets, unbound_subkeys) = bound_only(&packets, &pinned)?;
            Ok(Verified { fingerprint: pinned, packets, unbound_subkeys })
        }
        [one] => Err(KeyError::OtherKey { found: one.clone(), pinned }),
        [] => Err(KeyError::NoKey),
        many => Err(KeyError::Several { found: many.to_vec(), pinned }),
    }
}

/// The packets of a key whose primary has fingerprint `primary`, with each subkey kept only when
/// a binding signature the primary issued follows it, and then with only the primary's
/// signatures over it; the primary's own packets (user ids, their certifications, direct-key
/// signatures) are kept as they are. Also the fingerprints of the subkeys left out.
fn bound_only(packets: &[u8], primary: &str) -> Result<(Vec<u8>, Vec<String>), KeyError> {
    let mut out = Vec::new();
    let mut unbound = Vec::new();
    // The subkey being read, and the primary's signatures over it so far.
    let mut subkey: Option<(String, Vec<u8>, bool)> = None;
    let mut finish = |subkey: Option<(String, Vec<u8>, bool)>, out: &mut Vec<u8>| match subkey {
        Some((_, raw, true)) => out.extend_from_slice(&raw),
        Some((fpr, _, false)) => unbound.push(fpr),
        None => {}
    };
    let mut rest = packets;
    while !rest.is_empty() {
        let (tag, body, next) = packet(rest)?;
        let raw = &rest[..rest.len() - next.len()];
        rest = next;
        if tag == TAG_PUBLIC_SUBKEY {
            finish(subkey.take(), &mut out);
            subkey = Some((v4_fingerprint(body)?, raw.to_vec(), false));
            continue;
        }
        match &mut subkey {
            None => out.extend_from_slice(raw),
            Some((_, kept, bound)) => {
                let by_primary = (tag == TAG_SIGNATURE).then(|| signature_by(body, primary)).flatten();
                if let Some(sig_type @ (SIG_SUBKEY_BINDING | SIG_SUBKEY_REVOCATION)) = by_primary {
                    *bound |= sig_type == SIG_SUBKEY_BINDING;
                    kept.extend_from_slice(raw);
                }
            }
        }
    }
    finish(subkey.take(), &mut out);
    Ok((out, unbound))
}

/// The type of a signature packet when every issuer it names is the key with fingerprint
/// `issuer` (and it names one); None otherwise, or when it cannot be read.
fn signature_by(body: &[u8], issuer: &str) -> Option<u8> {
    let fpr = hex_bytes(issuer)?;
    // A v4 key's id is the low 64 bits of its fingerprint (RFC 4880 §12.2).
    let key_id = fpr.get(fpr.len().checked_sub(8)?..)?;
    let (sig_type, issuers) = match body.first()? {
        // v3 (RFC 4880 §5.2.2): version, 5, type, time (4), the issuer's key id (8), …
        3 => (*body.get(2)?, vec![(SUBPACKET_ISSUER, body.get(7..15)?)]),
        // v4 (§5.2.3): version, type, algorithms (2), then the hashed and the unhashed
        // subpackets, each area after its two-octet length.
        4 => {
            let hashed_len = be(body.get(4..6)?);
            let hashed = body.get(6..6 + hashed_len)?;
            let at = 6 + hashed_len;
            let unhashed_len = be(body.get(at..at + 2)?);
            let unhashed = body.get(at + 2..at + 2 + unhashed_len)?;
            let mut issuers = subpackets(hashed)?;
            issuers.extend(subpackets(unhashed)?);
            issuers.retain(|(t, _)| *t == SUBPACKET_ISSUER || *t == SUBPACKET_ISSUER_FINGERPRINT);
            (*body.get(1)?, issuers)
        }
        _ => return None,
    };
    let names_issuer = |(t, data): &(u8, &[u8])| match *t {
        SUBPACKET_ISSUER => *data == key_id,
        // The key's version, then its fingerprint.
        _ => data.first() == Some(&4) && data.get(1..) == Some(fpr.as_slice()),
    };
    (!issuers.is_empty() && issuers.iter().all(names_issuer)).then_some(sig_type)
}

/// The subpackets of one area (RFC 4880 §5.2.3.1): (type, without its critical bit; data).
fn subpackets(mut area: &[u8]) -> Option<Vec<(u8, &[u8])>> {
    let mut out = Vec::new();
    while let Some(&first) = area.first() {
        let (len, header): (usize, usize) = match first {
            0..=191 => (first as usize, 1),
            192..=254 => ((((first as usize) - 192) << 8) + *area.get(1)? as usize + 192, 2),
            255 => (be(area.get(1..5)?), 5),
        };
        let sub = area.get(header..header.checked_add(len)?)?;
        let (&sub_type, data) = sub.split_first()?;
        out.push((sub_type & 0x7f, data));
        area = &area[header + len..];
    }
    Some(out)
}

/// `0A1B…` → its bytes; None for anything that is not hex digits in pairs.
fn hex_bytes(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect()
}

/// `EB693B30…` → `EB69 3B30 …`, as gpg prints fingerprints.
pub fn spaced(fpr: &str) -> String {
    fpr.as_bytes().chunks(4).map(|c| String::from_utf8_lossy(c).into_owned()).collect::<Vec<_>>().join(" ")
}

/// Text that holds an armor line is read as armor (and refused for whatever else it holds);
/// binary keyrings are not text (a packet's first byte has its top bit set).
fn is_armored(data: &[u8]) -> bool {
    std::str::from_utf8(data).is_ok_and(|t| t.contains("-----BEGIN PGP"))
}

const ARMOR_BEGIN: &str = "-----BEGIN PGP PUBLIC KEY BLOCK-----";
const ARMOR_END: &str = "-----END PGP PUBLIC KEY BLOCK-----";

/// RFC 4880 §6.1: CRC-24 with generator 0x864CFB, initialised to 0xB704CE.
fn crc24(data: &[u8]) -> u32 {
    let mut crc: u32 = 0xB7_04CE;
    for b in data {
        crc ^= (*b as u32) << 16;
        for _ in 0..8 {
            crc <<= 1;
            if crc & 0x100_0000 != 0 {
                crc ^= 0x186_4CFB;
            }
        }
    }
    crc & 0xFF_FFFF
}

/// ASCII armor of a public key block (RFC 4880 §6.2): 64-character lines, then the checksum.
pub fn armor(packets: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    let body = b64.encode(packets);
    let mut out = format!("{ARMOR_BEGIN}\n\n");
    for chunk in body.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(chunk));
        out.push('\n');
    }
    let crc = crc24(packets).to_be_bytes();
    out.push_str(&format!("={}\n{ARMOR_END}\n", b64.encode(&crc[1..])));
    out
}

/// The packets of exactly one armored public key block. Refused: anything but white space
/// before its BEGIN line or after its END line (a second block would be imported too), another
/// kind of block, and a checksum line that does not match (RFC 4880 §6.1).
fn dearmor(data: &[u8]) -> Result<Vec<u8>, KeyError> {
    let text = std::str::from_utf8(data).map_err(|_| KeyError::Armor("armored key is not text".into()))?;
    let mut lines = text.lines().map(str::trim);
    match lines.find(|l| !l.is_empty()) {
        Some(l) if l == ARMOR_BEGIN => {}
        Some(l) => return Err(KeyError::Armor(format!("armored key: it starts with {l:?}, not {ARMOR_BEGIN}"))),
        None => return Err(KeyError::NoKey),
    }
    let mut in_headers = true;
    let mut b64 = String::new();
    let mut crc: Option<String> = None;
    for line in lines.by_ref() {
        if line.starts_with("-----") {
            if line != ARMOR_END {
                return Err(KeyError::Armor(format!("armored key: {line:?} where {ARMOR_END} was expected")));
            }
            let packets = base64::engine::general_purpose::STANDARD
                .decode(b64.as_bytes())
                .map_err(|e| KeyError::Armor(format!("armored key: bad base64: {e}")))?;
            if let Some(c) = crc {
                let want = base64::engine::general_purpose::STANDARD.encode(&crc24(&packets).to_be_bytes()[1..]);
                if c != want {
                    return Err(KeyError::Armor(format!(
                        "armored key: its checksum ={c} does not match its contents (={want})"
                    )));
                }
            }
            return match lines.find(|l| !l.is_empty()) {
                None => Ok(packets),
                Some(l) if l.starts_with("-----BEGIN") => Err(KeyError::SecondBlock),
                Some(_) => Err(KeyError::AfterEnd),
            };
        }
        if in_headers {
            // Armor headers ("Version: …") end at the first empty line; some files have none.
            if line.is_empty() || !line.contains(": ") {
                in_headers = false;
            }
            if line.is_empty() || line.contains(": ") {
                continue;
            }
        }
        if let Some(c) = line.strip_prefix('=') {
            crc = Some(c.to_string());
            continue;
        }
        if crc.is_some() {
            return Err(KeyError::Armor("armored key: text after its checksum line".into()));
        }
        b64.push_str(line);
    }
    Err(KeyError::Armor("armored key: no END line".into()))
}

/// One packet: (tag, body, the rest of the input).
fn packet(data: &[u8]) -> Result<(u8, &[u8], &[u8]), KeyError> {
    let h = data[0];
    if h & 0x80 == 0 {
        return Err(KeyError::NotAPacket(h));
    }
    let (tag, len, header_len): (u8, usize, usize) = if h & 0x40 != 0 {
        let tag = h & 0x3f;
        match data.get(1).copied() {
            Some(o @ 0..=191) => (tag, o as usize, 2),
            Some(o @ 192..=223) => {
                let o2 = *data.get(2).ok_or(KeyError::Packet("truncated packet length"))? as usize;
                (tag, ((o as usize - 192) << 8) + o2 + 192, 3)
            }
            Some(255) => (tag, be(data.get(2..6).ok_or(KeyError::Packet("truncated packet length"))?), 6),
            Some(_) => return Err(KeyError::Packet("partial-length packets do not occur in keys")),
            None => return Err(KeyError::Packet("truncated packet header")),
        }
    } else {
        let tag = (h >> 2) & 0x0f;
        match h & 3 {
            0 => (tag, *data.get(1).ok_or(KeyError::Packet("truncated packet length"))? as usize, 2),
            1 => (tag, be(data.get(1..3).ok_or(KeyError::Packet("truncated packet length"))?), 3),
            2 => (tag, be(data.get(1..5).ok_or(KeyError::Packet("truncated packet length"))?), 5),
            _ => return Err(KeyError::Packet("indeterminate-length packets do not occur in keys")),
        }
    };
    let end = header_len.checked_add(len).filter(|e| *e <= data.len()).ok_or(KeyError::Packet("truncated packet"))?;
    Ok((tag, &data[header_len..end], &data[end..]))
}

fn be(bytes: &[u8]) -> usize {
    bytes.iter().fold(0usize, |acc, b| (acc << 8) | *b as usize)
}

/// RFC 4880 §12.2: SHA-1 over 0x99, the two-octet body length, and the key packet body.
fn v4_fingerprint(body: &[u8]) -> Result<String, KeyError> {
    match body.first() {
        Some(4) => {}
        Some(v) => return Err(KeyError::KeyVersion(*v)),
        None => return Err(KeyError::Packet("empty key packet")),
    }
    let len = u16::try_from(body.len()).map_err(|_| KeyError::Packet("key packet too long"))?;
    let mut h = sha1_smol::Sha1::new();
    h.update(&[0x99]);
    h.update(&len.to_be_bytes());
    h.update(body);
    Ok(h.digest().to_string().to_ascii_uppercase())
}

#[cfg(test)]
mod tests;
