//! The guest's apt sources, read for one question: which components of the Debian archive are
//! enabled. NVIDIA's Debian packages follow Debian's own NVIDIA packaging, whose helpers live in
//! `contrib` (`nvidia-support`, which `libcuda1` depends on; `glx-alternative-nvidia`, which
//! `nvidia-alternative` depends on; `nvidia-kernel-common` and `nvidia-modprobe`, which
//! `nvidia-kernel-support` depends on — bookworm's `non-free` and `contrib` indexes), and the
//! GSP firmware the open modules load is `firmware-nvidia-gsp` in `non-free-firmware`. A guest
//! whose sources name `main` alone cannot resolve the driver until both are added. NVIDIA's
//! installation instructions for Debian enable `contrib` first.
//!
//! Both formats apt reads (sources.list(5)): one-line `deb [options] uri suite component…`
//! and deb822 stanzas (`Types`, `URIs`, `Suites`, `Components`, `Signed-By`, `Enabled`).

/// One enabled `deb` source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub uris: Vec<String>,
    pub suites: Vec<String>,
    pub components: Vec<String>,
    /// `Signed-By` as written: a keyring's path, fingerprints, or (deb822 only) a whole inline
    /// key, one line per element. It is copied to every stanza written for the same URI and
    /// suite: apt refuses two sources of one URI and suite whose Signed-By differ ("Conflicting
    /// values set for option Signed-By"), so a key dropped or rewritten here stops apt.
    pub signed_by: Option<Vec<String>>,
}

/// One-line sources: `deb [opt=value …] uri suite [component …]`; `deb-src` and comments skipped.
pub fn parse_one_line(text: &str) -> Vec<Source> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let Some(rest) = line.strip_prefix("deb ").or_else(|| line.strip_prefix("deb\t")) else { continue };
        let mut rest = rest.trim_start();
        let mut signed_by = None;
        if let Some(r) = rest.strip_prefix('[') {
            let Some((opts, after)) = r.split_once(']') else { continue };
            for o in opts.split_whitespace() {
                if let Some(v) = o.strip_prefix("signed-by=") {
                    // One-line sources take a path or comma-separated fingerprints
                    // (sources.list(5)); deb822 writes fingerprints space-separated.
                    signed_by = Some(vec![v.replace(',', " ")]);
                }
            }
            rest = after.trim_start();
        }
        let words: Vec<&str> = rest.split_whitespace().collect();
        let [uri, suite, components @ ..] = words.as_slice() else { continue };
        out.push(Source {
            uris: vec![uri.to_string()],
            suites: vec![suite.to_string()],
            components: components.iter().map(|c| c.to_string()).collect(),
            signed_by,
        });
    }
    out
}

/// deb822 stanzas, separated by blank lines; field names are case-insensitive; a stanza with
/// `Enabled: no` or without the `deb` type is skipped.
pub fn parse_deb822(text: &str) -> Vec<Source> {
    let mut out = Vec::new();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim_start().starts_with('#')).collect();
    for stanza in lines.split(|l| l.trim().is_empty()) {
        let mut fields: Vec<(String, String)> = Vec::new();
        for l in stanza {
            // A continuation line (leading space) belongs to the field before it: Signed-By may
            // hold an inline key, one armor line each, an empty one written " ." (deb822(5)).
            if l.starts_with(' ') || l.starts_with('\t') {
                if let Some(last) = fields.last_mut() {
                    last.1.push('\n');
                    last.1.push_str(l.trim());
                }
                continue;
            }
            if let Some((k, v)) = l.split_once(':') {
                fields.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
        }
        let get = |k: &str| fields.iter().find(|(f, _)| f == k).map(|(_, v)| v.as_str());
        let words = |k: &str| get(k).map(|v| v.split_whitespace().map(str::to_string).collect()).unwrap_or_default();
        let types: Vec<String> = words("types");
        if !types.iter().any(|t| t == "deb") || get("enabled").is_some_and(|e| e.eq_ignore_ascii_case("no")) {
            continue;
        }
        let signed_by = get("signed-by").map(|v| v.split('\n').map(str::to_string).collect());
        out.push(Source { uris: words("uris"), suites: words("suites"), components: words("components"), signed_by });
    }
    out
}

/// Every source in the guest's apt configuration: `(path, contents)` of
/// /etc/apt/sources.list and the `.list` and `.sources` files of sources.list.d.
pub fn parse_all(files: &[(String, String)]) -> Vec<Source> {
    files
        .iter()
        .flat_map(|(path, text)| if path.ends_with(".sources") { parse_deb822(text) } else { parse_one_line(text) })
        .collect()
}

/// The suites of a release's Debian archive, as Debian names them (the archive's `dists/` and
/// Debian's wiki "SourcesList"): `bookworm`, `-updates`, `-security`, `-backports`,
/// `-backports-sloppy`, `-proposed-updates`. Another suite that starts with the codename is a
/// third party's (`bookworm-pgdg`, PostgreSQL's): its archive has no `contrib` to add.
fn of_release(suite: &str, codename: &str) -> bool {
    const DEBIAN: &[&str] = &["", "-updates", "-security", "-backports", "-backports-sloppy", "-proposed-updates"];
    suite.strip_prefix(codename).is_some_and(|rest| DEBIAN.contains(&rest))
}

/// No apt source of the release's own archive: there is nothing to extend with components.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no apt source of Debian's {codename} archive was found (sources.list, sources.list.d)")]
pub struct NoArchiveSource {
    pub codename: String,
}

/// What to add so every Debian archive source of `codename` has `needed` components: a deb822
/// file with the same URIs, suites and key, and only the missing components. `Ok(None)` when
/// nothing is missing; `Err` when no source of the release's archive is there to extend.
pub fn missing_components(
    sources: &[Source],
    codename: &str,
    needed: &[&str],
) -> Result<Option<String>, NoArchiveSource> {
    let archive: Vec<&Source> = sources.iter().filter(|s| s.suites.iter().any(|x| of_release(x, codename))).collect();
    if archive.is_empty() {
        return Err(NoArchiveSource { codename: codename.into() });
    }
    // A URI and suite has a component when any source (ours from an earlier run included) has it.
    let has = |uri: &str, suite: &str, c: &str| {
        sources.iter().any(|s| {
            s.uris.iter().any(|u| u == uri)
                && s.suites.iter().any(|x| x == suite)
                && s.components.iter().any(|x| x == c)
        })
    };
    let mut stanzas: Vec<String> = Vec::new();
    for s in archive {
        for uri in &s.uris {
            let suites: Vec<&String> = s.suites.iter().filter(|x| of_release(x, codename)).collect();
            let lacking: Vec<&str> =
                needed.iter().copied().filter(|c| suites.iter().any(|x| !has(uri, x, c))).collect();
            if lacking.is_empty() {
                continue;
            }
            let mut st = format!(
                "Types: deb\nURIs: {uri}\nSuites: {}\nComponents: {}\n",
                suites.iter().map(|x| x.as_str()).collect::<Vec<_>>().join(" "),
                lacking.join(" ")
            );
            if let Some((first, rest)) = s.signed_by.as_deref().and_then(<[String]>::split_first) {
                // The first element on the field's line, the rest (an inline key's lines) as
                // continuation lines, an empty one as " ." (deb822(5)).
                match first.as_str() {
                    "" => st.push_str("Signed-By:\n"),
                    first => st.push_str(&format!("Signed-By: {first}\n")),
                }
                for line in rest {
                    st.push_str(&format!(" {}\n", if line.is_empty() { "." } else { line }));
                }
            }
            if !stanzas.contains(&st) {
                stanzas.push(st);
            }
        }
    }
    if stanzas.is_empty() {
        return Ok(None);
    }
    Ok(Some(format!(
        "# Written by phq-agent install: the Debian components NVIDIA's packages need ({}).\n{}",
        needed.join(", "),
        stanzas.join("\n")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deb822 file shaped like a Debian 12 cloud image's (mirror+file URIs), with main only.
    const CLOUD: &str = "Types: deb deb-src\nURIs: mirror+file:///etc/apt/mirrors/debian.list\nSuites: bookworm bookworm-updates bookworm-backports\nComponents: main\n\nTypes: deb deb-src\nURIs: mirror+file:///etc/apt/mirrors/debian-security.list\nSuites: bookworm-security\nComponents: main\n";

    #[test]
    fn a_main_only_image_gets_contrib_and_firmware_for_each_archive() {
        let files = vec![("/etc/apt/sources.list.d/debian.sources".to_string(), CLOUD.to_string())];
        let text =
            missing_components(&parse_all(&files), "bookworm", &["contrib", "non-free-firmware"]).unwrap().unwrap();
        assert!(text.contains("URIs: mirror+file:///etc/apt/mirrors/debian.list\nSuites: bookworm bookworm-updates bookworm-backports\nComponents: contrib non-free-firmware\n"), "{text}");
        assert!(text.contains("URIs: mirror+file:///etc/apt/mirrors/debian-security.list\nSuites: bookworm-security\nComponents: contrib non-free-firmware\n"), "{text}");
        // With that file read back, nothing is missing.
        let mut again = files.clone();
        again.push(("/etc/apt/sources.list.d/phq.sources".into(), text));
        assert_eq!(missing_components(&parse_all(&again), "bookworm", &["contrib", "non-free-firmware"]), Ok(None));
    }

    #[test]
    fn one_line_sources_with_options_and_what_is_already_there() {
        let list = "# comment\ndeb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://debian.mirror.example/debian bookworm main contrib\ndeb-src http://debian.mirror.example/debian bookworm main\ndeb http://debian.mirror.example/debian bookworm-updates main contrib non-free-firmware\n# deb http://x/ bookworm main\ndeb [signed-by=/k.gpg] https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/ /\n";
        let s = parse_one_line(list);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].signed_by, Some(vec!["/usr/share/keyrings/debian-archive-keyring.gpg".to_string()]));
        let text = missing_components(&s, "bookworm", &["contrib", "non-free-firmware"]).unwrap().unwrap();
        assert_eq!(
            text.lines().skip(1).collect::<Vec<_>>().join("\n"),
            "Types: deb\nURIs: http://debian.mirror.example/debian\nSuites: bookworm\nComponents: non-free-firmware\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg"
        );
    }

    /// The archive's source may carry its key inline (deb822) or as fingerprints: the added
    /// stanza carries the same Signed-By, or apt stops with "Conflicting values set for option
    /// Signed-By". Before, an inline key or a fingerprint was dropped.
    #[test]
    fn signed_by_is_kept_as_written_inline_keys_and_fingerprints_too() {
        let inline = "Types: deb\nURIs: http://debian.mirror.example/debian\nSuites: bookworm\nComponents: main\nSigned-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n mDMEZabc\n =AbCd\n -----END PGP PUBLIC KEY BLOCK-----\n";
        let text = missing_components(&parse_deb822(inline), "bookworm", &["contrib"]).unwrap().unwrap();
        assert!(text.ends_with("Components: contrib\nSigned-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n mDMEZabc\n =AbCd\n -----END PGP PUBLIC KEY BLOCK-----\n"), "{text}");
        // Read back, the written stanza has the very same key as the archive's own.
        let both = parse_all(&[("/a.sources".into(), inline.into()), ("/b.sources".into(), text.clone())]);
        assert_eq!(both[0].signed_by, both[1].signed_by);

        let fpr = "Types: deb\nURIs: http://debian.mirror.example/debian\nSuites: bookworm\nComponents: main\nSigned-By: 4CB50190207B4758A3F73A796ED0E7B82643E131\n";
        let text = missing_components(&parse_deb822(fpr), "bookworm", &["contrib"]).unwrap().unwrap();
        assert!(text.ends_with("Signed-By: 4CB50190207B4758A3F73A796ED0E7B82643E131\n"), "{text}");
        let one = "deb [signed-by=4CB50190207B4758A3F73A796ED0E7B82643E131,B8E5F13176D2A7A75220028078DBA3BC47EF2265] http://debian.mirror.example/debian bookworm main\n";
        let text = missing_components(&parse_one_line(one), "bookworm", &["contrib"]).unwrap().unwrap();
        assert!(
            text.ends_with(
                "Signed-By: 4CB50190207B4758A3F73A796ED0E7B82643E131 B8E5F13176D2A7A75220028078DBA3BC47EF2265\n"
            ),
            "{text}"
        );
    }

    /// Only Debian's own suites are extended: PostgreSQL's `bookworm-pgdg` starts with the
    /// codename too, but its repository has no contrib (apt would fail to fetch it).
    #[test]
    fn a_third_partys_suite_named_after_the_release_is_left_alone() {
        let list = "deb http://debian.mirror.example/debian bookworm main\ndeb [signed-by=/usr/share/keyrings/pgdg.gpg] http://apt.postgresql.example/pub/repos/apt bookworm-pgdg main\ndeb http://debian.mirror.example/debian-security bookworm-security main\n";
        let text = missing_components(&parse_one_line(list), "bookworm", &["contrib"]).unwrap().unwrap();
        assert!(!text.contains("pgdg") && !text.contains("postgresql"), "{text}");
        assert!(text.contains("Suites: bookworm\n") && text.contains("Suites: bookworm-security\n"), "{text}");
        assert!(!of_release("bookworm-pgdg", "bookworm") && !of_release("bookwormy", "bookworm"));
        assert!(of_release("bookworm-backports-sloppy", "bookworm"));
    }

    #[test]
    fn disabled_stanzas_and_no_archive_at_all() {
        let off =
            "Types: deb\nURIs: http://debian.mirror.example/debian\nSuites: bookworm\nComponents: main\nEnabled: no\n";
        assert!(parse_deb822(off).is_empty());
        let e = missing_components(&parse_deb822(off), "bookworm", &["contrib"]).unwrap_err().to_string();
        assert!(e.contains("no apt source of Debian's bookworm archive"), "{e}");
    }
}
