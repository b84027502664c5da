//! Key files as NVIDIA, EPEL and GnuPG write them, and as an attacker would.

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
    assert!(verified(&old, &spaced(&want).to_lowercase()).is_ok());
}

#[test]
fn refuses_a_second_primary_key_and_a_wrong_one() {
    let a = new_format(6, &key_body(1));
    let b = new_format(6, &key_body(2));
    let fa = keys(&a).unwrap()[0].fingerprint.clone();
    let both = [a.clone(), b.clone()].concat();
    assert!(verified(&both, &fa).unwrap_err().to_string().contains("2 primary keys"));
    assert!(verified(&b, &fa).unwrap_err().to_string().contains("expected"));
    // Its short ids are not enough, nor is any suffix.
    assert!(verified(&a, &fa[32..]).unwrap_err().to_string().contains("40 hex digits"));
    assert!(verified(&a, &fa[24..]).unwrap_err().to_string().contains("40 hex digits"));
    // A subkey (bound by the primary), a user id and signatures beside the pinned primary
    // are parts of the key.
    let with_parts = [
        a.clone(),
        new_format(13, b"phq <k@phq.invalid>"),
        new_format(2, &[4, 0x13]),
        new_format(14, &key_body(3)),
        signature(SIG_SUBKEY_BINDING, &fa),
    ]
    .concat();
    assert_eq!(keys(&with_parts).unwrap().len(), 2);
    assert_eq!(verified(&with_parts, &fa).unwrap().binary(), with_parts.as_slice());
}

/// A v4 signature packet of `sig_type` issued by the key with fingerprint `issuer`: its
/// Issuer Fingerprint in the hashed area and its key id in the unhashed one, as GnuPG 2.2
/// writes them; the hash and the signature's value are stand-ins (the agent reads who issued
/// a binding, apt and rpm check its value).
fn signature(sig_type: u8, issuer: &str) -> Vec<u8> {
    let fpr = hex_bytes(issuer).unwrap();
    let mut hashed = vec![22, SUBPACKET_ISSUER_FINGERPRINT, 4];
    hashed.extend(&fpr);
    hashed.extend([5, 2, 0x5f, 0, 0, 0]); // creation time
    let unhashed = [vec![9, SUBPACKET_ISSUER], fpr[12..].to_vec()].concat();
    let mut b = vec![4, sig_type, 22, 8];
    b.extend((hashed.len() as u16).to_be_bytes());
    b.extend(&hashed);
    b.extend((unhashed.len() as u16).to_be_bytes());
    b.extend(&unhashed);
    b.extend([0xab, 0xcd, 0, 8, 0xff]);
    new_format(2, &b)
}

/// Issue 37: a subkey appended to the pinned key without the primary's binding signature
/// (or with one another key issued) is not written to root's keyring; the key still
/// verifies, and its own bound subkey stays, with only the primary's signatures over it.
#[test]
fn a_foreign_subkey_is_stripped_and_a_bound_one_kept() {
    let a = new_format(6, &key_body(1));
    let fa = keys(&a).unwrap()[0].fingerprint.clone();
    let evil = new_format(6, &key_body(8));
    let fevil = keys(&evil).unwrap()[0].fingerprint.clone();
    let uid = new_format(13, b"phq <k@phq.invalid>");
    let own = [new_format(14, &key_body(3)), signature(SIG_SUBKEY_BINDING, &fa)].concat();
    let own_fpr = keys(&own).unwrap()[0].fingerprint.clone();
    let pinned = [a.clone(), uid.clone(), own.clone()].concat();
    let foreign = new_format(14, &key_body(4));
    let foreign_fpr = keys(&foreign).unwrap()[0].fingerprint.clone();
    for (what, appended) in [
        ("bare", foreign.clone()),
        ("bound by another key", [foreign.clone(), signature(SIG_SUBKEY_BINDING, &fevil)].concat()),
        ("with a certification, not a binding", [foreign.clone(), signature(0x13, &fa)].concat()),
    ] {
        for file in
            [[pinned.clone(), appended.clone()].concat(), armor(&[pinned.clone(), appended].concat()).into_bytes()]
        {
            let v = verified(&file, &fa).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(v.binary(), pinned.as_slice(), "{what}");
            assert_eq!(v.unbound_subkeys, std::slice::from_ref(&foreign_fpr), "{what}");
            let written: Vec<String> = keys(v.binary()).unwrap().into_iter().map(|k| k.fingerprint).collect();
            assert_eq!(written, [fa.clone(), own_fpr.clone()], "{what}");
            assert!(verified(v.binary(), &fa).is_ok(), "{what}");
            assert!(verified(v.armored().as_bytes(), &fa).unwrap().unbound_subkeys.is_empty(), "{what}");
        }
    }
    // Its own subkey with another key's signature beside the binding: the subkey stays, the
    // other signature goes.
    let file = [a.clone(), uid.clone(), own.clone(), signature(SIG_SUBKEY_BINDING, &fevil)].concat();
    assert_eq!(verified(&file, &fa).unwrap().binary(), pinned.as_slice());
    // A subkey whose only signature is its revocation by the primary is not bound.
    let revoked_only = [a.clone(), new_format(14, &key_body(5)), signature(SIG_SUBKEY_REVOCATION, &fa)].concat();
    assert_eq!(verified(&revoked_only, &fa).unwrap().binary(), a.as_slice());
    // A binding that names the primary and another issuer at once is not the primary's.
    let mut two = signature(SIG_SUBKEY_BINDING, &fa);
    let unhashed_at = two.len() - 5 - 10;
    two[unhashed_at + 2..unhashed_at + 10].copy_from_slice(&hex_bytes(&fevil).unwrap()[12..]);
    let file = [a.clone(), new_format(14, &key_body(6)), two].concat();
    assert_eq!(verified(&file, &fa).unwrap().binary(), a.as_slice());
}

#[test]
fn refuses_what_is_no_part_of_a_key() {
    let a = new_format(6, &key_body(1));
    let fa = keys(&a).unwrap()[0].fingerprint.clone();
    // A literal data packet (11) after the key; a signature before it; bytes that are no packet.
    let e = verified(&[a.clone(), new_format(11, b"b\0\0\0\0\0x")].concat(), &fa).unwrap_err().to_string();
    assert!(e.contains("type 11"), "{e}");
    let e = verified(&[new_format(2, &[4]), a.clone()].concat(), &fa).unwrap_err().to_string();
    assert!(e.contains("starts with"), "{e}");
    let e = verified(&[a.clone(), b"\n".to_vec()].concat(), &fa).unwrap_err().to_string();
    assert!(e.contains("not an OpenPGP packet"), "{e}");
    // An old-format packet of indeterminate length would swallow whatever follows it.
    let e = keys(&[&[0x9bu8][..], &key_body(1)].concat()).unwrap_err().to_string();
    assert!(e.contains("indeterminate"), "{e}");
}

fn armored(bin: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(bin);
    format!(
        "-----BEGIN PGP PUBLIC KEY BLOCK-----\nComment: test\n\n{}\n{}\n-----END PGP PUBLIC KEY BLOCK-----\n",
        &b64[..40],
        &b64[40..]
    )
}

#[test]
fn reads_armor_and_writes_it_back_with_its_checksum() {
    let bin = new_format(6, &key_body(9));
    let fpr = keys(&bin).unwrap()[0].fingerprint.clone();
    let v = verified(armored(&bin).as_bytes(), &fpr).unwrap();
    assert_eq!(v.binary(), bin.as_slice());
    // Our own armor reads back to the same packets, checksum checked.
    let ours = v.armored();
    assert!(ours.starts_with(ARMOR_BEGIN) && ours.trim_end().ends_with(ARMOR_END), "{ours}");
    assert_eq!(verified(ours.as_bytes(), &fpr).unwrap().binary(), bin.as_slice());
    // RFC 4880 §6.1's CRC-24 of nothing is its initial value.
    assert_eq!(crc24(b""), 0xB704CE);
    // A checksum that does not match is refused.
    let crc_at = ours.rfind("\n=").unwrap() + 2;
    let mut bad = ours.clone();
    bad.replace_range(crc_at..crc_at + 4, if &ours[crc_at..crc_at + 4] == "AAAA" { "BBBB" } else { "AAAA" });
    assert!(verified(bad.as_bytes(), &fpr).unwrap_err().to_string().contains("checksum"), "{bad}");
}

#[test]
fn one_armored_block_and_nothing_after_it() {
    let a = new_format(6, &key_body(1));
    let fa = keys(&a).unwrap()[0].fingerprint.clone();
    let evil = armored(&new_format(6, &key_body(2)));
    // rpm --import would import both blocks; apt would trust both keys.
    let two = format!("{}{evil}", armored(&a));
    assert!(verified(two.as_bytes(), &fa).unwrap_err().to_string().contains("second armored block"));
    let trailing = format!("{}garbage\n", armored(&a));
    assert!(verified(trailing.as_bytes(), &fa).unwrap_err().to_string().contains("more after"));
    let leading = format!("hello\n{}", armored(&a));
    assert!(verified(leading.as_bytes(), &fa).unwrap_err().to_string().contains("starts with"));
    // White space around the block is fine.
    assert!(verified(format!("\n{}\n\n", armored(&a)).as_bytes(), &fa).is_ok());
}

#[test]
fn bad_input_says_what() {
    assert!(keys(b"").unwrap_err().to_string().contains("no OpenPGP public key"));
    assert!(keys(b"hello").unwrap_err().to_string().contains("not an OpenPGP packet"));
    assert!(keys(&[0xc6, 50, 4]).unwrap_err().to_string().contains("truncated"));
    assert!(keys(&new_format(6, &[5, 1, 2])).unwrap_err().to_string().contains("version 5"));
}

proptest! {
    #[test]
    fn never_panics(data in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = keys(&data);
        let mut armored = b"-----BEGIN PGP PUBLIC KEY BLOCK-----\n".to_vec();
        armored.extend_from_slice(&data);
        let _ = keys(&armored);
        let _ = verified(&data, "EB693B3035CD5710E231E123A4B469963BF863CC");
    }
}
