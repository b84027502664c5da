//! Fingerprints of the OpenPGP keys in a keyring file, binary or ASCII-armored (RFC 4880).
//!
//! The installer trusts NVIDIA's repository only after the key it is about to install carries
//! the pinned fingerprint, and only that key: a keyring holding any other primary key is
//! refused, since apt would trust every key in it. Version-4 keys are what NVIDIA publishes;
//! other versions are reported, never guessed at.

use base64::Engine;

const TAG_PUBLIC_KEY: u8 = 6;
const TAG_PUBLIC_SUBKEY: u8 = 14;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    /// 40 upper-case hex digits.
    pub fingerprint: String,
    /// A primary key (tag 6) rather than a subkey (tag 14).
    pub primary: bool,
}

/// The primary keys and subkeys of `data`, in file order.
pub fn keys(data: &[u8]) -> Result<Vec<Key>, String> {
    let binary = if data.starts_with(b"-----BEGIN PGP") { dearmor(data)? } else { data.to_vec() };
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
        return Err("no OpenPGP public key in it".into());
    }
    Ok(out)
}

/// Ok when `data` holds exactly one primary key and it has `pinned` as its whole fingerprint
/// (spaces and case ignored). Only all 40 digits are accepted: a short key id (8 or 16 digits)
/// is cheap to collide with a key of one's own making ("Evil 32", evil32.com), so a suffix
/// match would trust an impostor.
pub fn verify(data: &[u8], pinned: &str) -> Result<(), String> {
    let pinned: String = pinned.chars().filter(|c| !c.is_whitespace()).collect::<String>().to_ascii_uppercase();
    if pinned.len() != 40 || !pinned.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!("{pinned:?} is not a whole key fingerprint (40 hex digits)"));
    }
    let primaries: Vec<String> = keys(data)?.into_iter().filter(|k| k.primary).map(|k| k.fingerprint).collect();
    match primaries.as_slice() {
        [one] if *one == pinned => Ok(()),
        [one] => Err(format!("its key is {} — expected {}", spaced(one), spaced(&pinned))),
        [] => Err("it holds subkeys but no primary key".into()),
        many => Err(format!(
            "it holds {} primary keys ({}); expected only {}",
            many.len(),
            many.iter().map(|f| spaced(f)).collect::<Vec<_>>().join(", "),
            spaced(&pinned)
        )),
    }
}

/// `EB693B30…` → `EB69 3B30 …`, as gpg prints fingerprints.
pub fn spaced(fpr: &str) -> String {
    fpr.as_bytes().chunks(4).map(|c| String::from_utf8_lossy(c).into_owned()).collect::<Vec<_>>().join(" ")
}

fn dearmor(data: &[u8]) -> Result<Vec<u8>, String> {
    let text = std::str::from_utf8(data).map_err(|_| "armored key is not text".to_string())?;
    let mut lines = text.lines().map(str::trim);
    lines.find(|l| l.starts_with("-----BEGIN PGP PUBLIC KEY BLOCK"));
    let mut in_headers = true;
    let mut b64 = String::new();
    for line in lines {
        if line.starts_with("-----END PGP") {
            return base64::engine::general_purpose::STANDARD
                .decode(b64.as_bytes())
                .map_err(|e| format!("armored key: bad base64: {e}"));
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
        if line.starts_with('=') {
            continue; // the CRC-24 line
        }
        b64.push_str(line);
    }
    Err("armored key: no END line".into())
}

/// One packet: (tag, body, the rest of the input).
fn packet(data: &[u8]) -> Result<(u8, &[u8], &[u8]), String> {
    let h = data[0];
    if h & 0x80 == 0 {
        return Err(format!("not an OpenPGP packet (header byte 0x{h:02x})"));
    }
    let (tag, len, header_len): (u8, usize, usize) = if h & 0x40 != 0 {
        let tag = h & 0x3f;
        match data.get(1).copied() {
            Some(o @ 0..=191) => (tag, o as usize, 2),
            Some(o @ 192..=223) => {
                let o2 = *data.get(2).ok_or("truncated packet length")? as usize;
                (tag, ((o as usize - 192) << 8) + o2 + 192, 3)
            }
            Some(255) => (tag, be(data.get(2..6).ok_or("truncated packet length")?), 6),
            Some(_) => return Err("partial-length packets do not occur in keys".into()),
            None => return Err("truncated packet header".into()),
        }
    } else {
        let tag = (h >> 2) & 0x0f;
        match h & 3 {
            0 => (tag, *data.get(1).ok_or("truncated packet length")? as usize, 2),
            1 => (tag, be(data.get(1..3).ok_or("truncated packet length")?), 3),
            2 => (tag, be(data.get(1..5).ok_or("truncated packet length")?), 5),
            _ => (tag, data.len() - 1, 1),
        }
    };
    let end = header_len.checked_add(len).filter(|e| *e <= data.len()).ok_or("truncated packet")?;
    Ok((tag, &data[header_len..end], &data[end..]))
}

fn be(bytes: &[u8]) -> usize {
    bytes.iter().fold(0usize, |acc, b| (acc << 8) | *b as usize)
}

/// RFC 4880 §12.2: SHA-1 over 0x99, the two-octet body length, and the key packet body.
fn v4_fingerprint(body: &[u8]) -> Result<String, String> {
    match body.first() {
        Some(4) => {}
        Some(v) => return Err(format!("OpenPGP key version {v} (only version 4 is read)")),
        None => return Err("empty key packet".into()),
    }
    let len = u16::try_from(body.len()).map_err(|_| "key packet too long".to_string())?;
    let mut h = sha1_smol::Sha1::new();
    h.update(&[0x99]);
    h.update(&len.to_be_bytes());
    h.update(body);
    Ok(h.digest().to_string().to_ascii_uppercase())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A version-4 Ed25519 public key packet body (algorithm 22) with a fixed creation time.
    fn key_body(seed: u8) -> Vec<u8> {
        let mut b = vec![4, 0x5f, 0x00, 0x00, 0x00, 22, 9, 0x2b, 0x06, 0x01, 0x04, 0x01, 0xda, 0x47, 0x0f, 0x01];
        b.extend_from_slice(&[0x01, 0x07, 0x40]);
        b.extend(std::iter::repeat_n(seed, 32));
        b
    }

    fn new_format(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut p = vec![0xc0 | tag, body.len() as u8];
        p.extend_from_slice(body);
        p
    }

    #[test]
    fn fingerprint_matches_the_rfc_formula_in_both_packet_formats() {
        let body = key_body(7);
        let mut h = sha1_smol::Sha1::new();
        h.update(&[0x99, 0, body.len() as u8]);
        h.update(&body);
        let want = h.digest().to_string().to_ascii_uppercase();
        let old = [&[0x99u8, 0, body.len() as u8][..], &body].concat(); // old format, tag 6, 2-byte length
        assert_eq!(keys(&new_format(6, &body)).unwrap()[0].fingerprint, want);
        assert_eq!(keys(&old).unwrap()[0].fingerprint, want);
        assert!(verify(&old, &spaced(&want).to_lowercase()).is_ok());
    }

    #[test]
    fn refuses_a_second_primary_key_and_a_wrong_one() {
        let a = new_format(6, &key_body(1));
        let b = new_format(6, &key_body(2));
        let fa = keys(&a).unwrap()[0].fingerprint.clone();
        let both = [a.clone(), b.clone()].concat();
        assert!(verify(&both, &fa).unwrap_err().contains("2 primary keys"));
        assert!(verify(&b, &fa).unwrap_err().contains("expected"));
        // Its short ids are not enough, nor is any suffix.
        assert!(verify(&a, &fa[32..]).unwrap_err().contains("40 hex digits"));
        assert!(verify(&a, &fa[24..]).unwrap_err().contains("40 hex digits"));
        // A subkey beside the pinned primary is fine.
        let with_sub = [a, new_format(14, &key_body(3))].concat();
        assert_eq!(keys(&with_sub).unwrap().len(), 2);
        assert!(verify(&with_sub, &fa).is_ok());
    }

    #[test]
    fn reads_armor() {
        let bin = new_format(6, &key_body(9));
        let fpr = keys(&bin).unwrap()[0].fingerprint.clone();
        let b64 = base64::engine::general_purpose::STANDARD.encode(&bin);
        let armored = format!(
            "-----BEGIN PGP PUBLIC KEY BLOCK-----\nComment: test\n\n{}\n{}\n=abcd\n-----END PGP PUBLIC KEY BLOCK-----\n",
            &b64[..40],
            &b64[40..]
        );
        assert!(verify(armored.as_bytes(), &fpr).is_ok());
    }

    #[test]
    fn bad_input_says_what() {
        assert!(keys(b"").unwrap_err().contains("no OpenPGP public key"));
        assert!(keys(b"hello").unwrap_err().contains("not an OpenPGP packet"));
        assert!(keys(&[0xc6, 50, 4]).unwrap_err().contains("truncated"));
        assert!(keys(&new_format(6, &[5, 1, 2])).unwrap_err().contains("version 5"));
    }

    proptest! {
        #[test]
        fn never_panics(data in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = keys(&data);
            let mut armored = b"-----BEGIN PGP PUBLIC KEY BLOCK-----\n".to_vec();
            armored.extend_from_slice(&data);
            let _ = keys(&armored);
        }
    }
}
