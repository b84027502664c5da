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
    pub signed_by: Option<String>,
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
                    signed_by = Some(v.to_string());
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
            // A continuation line (leading space) belongs to the field before it (Signed-By may
            // hold an inline key, which is not a path we copy).
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
        let signed_by = get("signed-by").filter(|v| !v.contains('\n') && v.starts_with('/')).map(str::to_string);
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

/// The suites of a release's Debian archive: `bookworm`, `bookworm-updates`,
/// `bookworm-security`, `bookworm-backports`.
fn of_release(suite: &str, codename: &str) -> bool {
    suite == codename || suite.strip_prefix(codename).is_some_and(|r| r.starts_with('-'))
}

/// What to add so every Debian archive source of `codename` has `needed` components: a deb822
/// file with the same URIs, suites and key, and only the missing components. `Ok(None)` when
/// nothing is missing; `Err` when no source of the release's archive is there to extend.
pub fn missing_components(sources: &[Source], codename: &str, needed: &[&str]) -> Result<Option<String>, String> {
    let archive: Vec<&Source> = sources.iter().filter(|s| s.suites.iter().any(|x| of_release(x, codename))).collect();
    if archive.is_empty() {
        return Err(format!("no apt source of Debian's {codename} archive was found (sources.list, sources.list.d)"));
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
            if let Some(k) = &s.signed_by {
                st.push_str(&format!("Signed-By: {k}\n"));
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
        assert_eq!(s[0].signed_by.as_deref(), Some("/usr/share/keyrings/debian-archive-keyring.gpg"));
        let text = missing_components(&s, "bookworm", &["contrib", "non-free-firmware"]).unwrap().unwrap();
        assert_eq!(
            text.lines().skip(1).collect::<Vec<_>>().join("\n"),
            "Types: deb\nURIs: http://debian.mirror.example/debian\nSuites: bookworm\nComponents: non-free-firmware\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg"
        );
    }

    #[test]
    fn disabled_stanzas_and_no_archive_at_all() {
        let off =
            "Types: deb\nURIs: http://debian.mirror.example/debian\nSuites: bookworm\nComponents: main\nEnabled: no\n";
        assert!(parse_deb822(off).is_empty());
        let e = missing_components(&parse_deb822(off), "bookworm", &["contrib"]).unwrap_err();
        assert!(e.contains("no apt source of Debian's bookworm archive"), "{e}");
    }
}
