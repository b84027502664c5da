//! What a bundle (or another process's report) says is the tenant's word, and it reaches a
//! support engineer's terminal and browser (issue 37). Before anything renders it:
//!
//! 1. It is bounded: at most `MAX_GPUS` GPUs, `MAX_FINDINGS` findings, `MAX_EVENTS` kernel-log
//!    events, strings of `MAX_STRING_BYTES` and arrays of `MAX_ARRAY_ITEMS`; past a bound the
//!    bundle is refused with an error that names the bound. The work every later step does
//!    (checks, the GPU↔GPU heat maps, n × n) is then bounded too.
//! 2. Every string, keys included, is made printable: C0 and C1 control characters (but the
//!    newline and the tab that details are written with), DEL, and the Unicode bidirectional
//!    controls become U+FFFD, so no escape sequence (a window title, a clipboard write, a
//!    cleared screen) and no reordered text reaches a terminal or a page from a bundle.
//!
//! Parsing goes through `serde_json::Value` first so both rules hold for every field, whatever
//! type it later becomes.

pub use crate::text::printable;
use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// GPUs a bundle may list: the largest VM the platform sells has 8; an HGX or DGX node has 8
/// (16 on the HGX-2 generation); 64 leaves room for any node NVIDIA ships while keeping an
/// n × n heat map at 4,096 cells.
pub const MAX_GPUS: usize = 64;
/// Findings: about 30 checks per GPU and a few dozen for the machine give ~300 at 8 GPUs.
pub const MAX_FINDINGS: usize = 10_000;
/// Kernel-log events (Xids, SXids, BAR lines, GPU lines): the kernel's log buffer holds some
/// thousands of lines (CONFIG_LOG_BUF_SHIFT 17–18 on distribution kernels: 128–256 KiB).
pub const MAX_EVENTS: usize = 20_000;
/// One string: a detail or a kernel log line is at most a few KiB (a kmsg record is at most
/// about 8 KiB).
pub const MAX_STRING_BYTES: usize = 64 << 10;
/// Any one array.
pub const MAX_ARRAY_ITEMS: usize = 100_000;

/// `bytes` as a `T`, bounded and printable (the rules above); `what` names the source in errors.
pub fn parse<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    let mut v: Value = serde_json::from_slice(bytes).with_context(|| format!("{what} is not JSON"))?;
    tidy(&mut v, &mut String::from("$")).with_context(|| format!("{what} is refused"))?;
    serde_json::from_value(v).with_context(|| format!("{what} is not what this agent can read"))
}

/// Checks the bounds of every array and string below `v` and makes its strings printable.
fn tidy(v: &mut Value, at: &mut String) -> Result<()> {
    match v {
        Value::String(s) => {
            if s.len() > MAX_STRING_BYTES {
                bail!("{at} is a string of {} bytes (at most {MAX_STRING_BYTES})", s.len());
            }
            if let std::borrow::Cow::Owned(clean) = printable(s) {
                *s = clean;
            }
        }
        Value::Array(items) => {
            if items.len() > MAX_ARRAY_ITEMS {
                bail!("{at} has {} items (at most {MAX_ARRAY_ITEMS})", items.len());
            }
            let len = at.len();
            for (i, item) in items.iter_mut().enumerate() {
                at.push_str(&format!("[{i}]"));
                tidy(item, at)?;
                at.truncate(len);
            }
        }
        Value::Object(map) => {
            let dirty: Vec<String> =
                map.keys().filter(|k| matches!(printable(k), std::borrow::Cow::Owned(_))).cloned().collect();
            for k in dirty {
                if let Some(value) = map.remove(&k) {
                    map.insert(printable(&k).into_owned(), value);
                }
            }
            let len = at.len();
            for (k, item) in map.iter_mut() {
                if k.len() > MAX_STRING_BYTES {
                    bail!("{at} has a key of {} bytes (at most {MAX_STRING_BYTES})", k.len());
                }
                at.push('.');
                at.push_str(k);
                tidy(item, at)?;
                at.truncate(len);
            }
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => {}
    }
    Ok(())
}

/// A snapshot from a bundle, bounded in GPUs and kernel-log events.
pub fn check_snapshot(s: &crate::snapshot::Snapshot, what: &str) -> Result<()> {
    let gpus = s.gpus().len().max(s.nvml().map_or(0, |n| n.devices.len()));
    if gpus > MAX_GPUS {
        bail!("{what} lists {gpus} GPUs; a bundle may list at most {MAX_GPUS}");
    }
    if let Some(log) = s.kernel_log.value() {
        let events = log.xids.len() + log.sxids.len() + log.bar_errors.len() + log.gpu_uuids.len();
        if events > MAX_EVENTS {
            bail!("{what} has {events} kernel-log events; a bundle may carry at most {MAX_EVENTS}");
        }
    }
    Ok(())
}

/// A report from a bundle or another process, bounded in GPUs (its own and its probes') and
/// findings.
pub fn check_report(r: &super::Report, what: &str) -> Result<()> {
    let probe_gpus = r.probes.as_ref().and_then(|p| p.get("gpus")).and_then(Value::as_array).map_or(0, Vec::len);
    let gpus = r.gpus.len().max(probe_gpus);
    if gpus > MAX_GPUS {
        bail!("{what} lists {gpus} GPUs; a report may list at most {MAX_GPUS}");
    }
    let peers = r.probes.as_ref().and_then(|p| p.get("peers")).and_then(Value::as_array).map_or(0, Vec::len);
    if peers > MAX_GPUS * MAX_GPUS {
        bail!("{what} has {peers} GPU pairs; a report may have at most {}", MAX_GPUS * MAX_GPUS);
    }
    if r.findings.len() > MAX_FINDINGS {
        bail!("{what} has {} findings; a report may have at most {MAX_FINDINGS}", r.findings.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::unprintable;
    use proptest::prelude::*;

    #[test]
    fn escapes_and_bidi_controls_become_replacement_characters() {
        let hostile = "gpu\u{1b}]0;owned\u{7}\u{1b}]52;c;ZXZpbA==\u{7}\u{1b}[2J\u{9b}31m\u{202e}txt.exe\u{2066}";
        let clean = printable(hostile);
        assert!(!clean.chars().any(unprintable), "{clean:?}");
        assert!(clean.starts_with("gpu\u{fffd}]0;owned"), "{clean:?}");
        assert_eq!(printable("line one\n\tline two"), "line one\n\tline two");
        assert!(matches!(printable("plain"), std::borrow::Cow::Borrowed(_)));
    }

    #[test]
    fn every_string_and_key_is_tidied_and_bounds_are_enforced() {
        let v: Value = parse(br#"{"host\u001b[2J":{"name":["a\u001b]0;x\u0007"]}}"#, "x").unwrap();
        assert_eq!(v, serde_json::json!({"host\u{fffd}[2J": {"name": ["a\u{fffd}]0;x\u{fffd}"]}}));
        let long = format!("[\"{}\"]", "a".repeat(MAX_STRING_BYTES + 1));
        let e = parse::<Value>(long.as_bytes(), "the bundle's report.json").unwrap_err();
        assert!(format!("{e:#}").contains("$[0] is a string of 65537 bytes"), "{e:#}");
        let many = format!("[{}0]", "0,".repeat(MAX_ARRAY_ITEMS));
        assert!(format!("{:#}", parse::<Value>(many.as_bytes(), "x").unwrap_err()).contains("items (at most"));
    }

    proptest! {
        /// Whatever a bundle's strings hold, nothing unprintable is left and parsing neither
        /// panics nor grows the text by more than the replacement character's three bytes per
        /// character.
        #[test]
        fn nothing_unprintable_survives(s in proptest::collection::vec(prop_oneof![
            any::<char>(),
            (0u32..0xa0).prop_map(|c| char::from_u32(c).unwrap_or('x')),
            Just('\u{202e}'),
            Just('\u{2066}'),
            Just('\u{200f}'),
        ], 0..64).prop_map(|v| v.into_iter().collect::<String>())) {
            let doc = serde_json::to_vec(&serde_json::json!({ s.clone(): [s.clone()] })).unwrap();
            let v: Value = parse(&doc, "x").unwrap();
            let esc = '\u{1b}';
            prop_assert!(!v.to_string().contains(esc));
            let (k, items) = v.as_object().unwrap().iter().next().unwrap();
            prop_assert!(!k.chars().any(unprintable));
            prop_assert!(!items[0].as_str().unwrap().chars().any(unprintable));
            prop_assert!(items[0].as_str().unwrap().len() <= s.len() * 3);
        }
    }
}
