//! Support bundles: `doctor --bundle OUT.tar.gz` writes what the agent saw; `doctor --from
//! BUNDLE` judges it again on another machine.
//!
//! Layout (gzip'd tar):
//! - `manifest.json`   format, agent version, when
//! - `snapshot.json`   the Snapshot: `--from` re-runs the checks on exactly this
//! - `report.json`     the Report as it was printed
//! - `report.html`     the same Report as a page (`report::html`); `phq-agent report BUNDLE`
//!   renders it again from `report.json`
//! - `nvrm.log`        the kernel log lines from the NVIDIA drivers (Xid, BAR, GPU UUIDs; the
//!   NVSwitch driver's SXids)
//! - `history.json`    the service's fault history across boots (`crate::history`), when the
//!   machine has one
//! - `nvidia-bug-report.log.gz` NVIDIA's own support log (`collect::bug_report`), when the
//!   driver's script ran on the live machine within its deadline and cap; `manifest.json`'s
//!   `notes` say why when it is not there
//! - `files/…`         every raw file and link the snapshot was built from, laid out like `/`,
//!   so `doctor --sysroot files/` re-collects from them
//!
//! Reading a bundle never extracts it: only `snapshot.json` (or `report.json`) is read, with a
//! size cap. A bundle
//! comes from elsewhere, so every size in it is bounded: special entries (GNU long names, PAX
//! headers) are skipped unread and refused past `MAX_SPECIAL_BYTES`, as Go's archive/tar caps
//! them, and no more than `MAX_SCANNED_BYTES` are decompressed looking for the snapshot.
//!
//! A bundle holds the kernel log, which `kernel.dmesg_restrict` keeps from other users: it is
//! created with mode 0600 and never over an existing file (`O_EXCL`, then a hard link to the
//! name asked for, which fails rather than replace a file or follow a planted link).

use crate::collect::bug_report::BugReport;
use crate::snapshot::Snapshot;
use crate::sysroot::Recorded;
use anyhow::{bail, Context, Result};
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use serde::Serialize;
use std::collections::BTreeSet;
use std::io::Read;
use std::path::Path;

pub const FORMAT: &str = "phq.bundle/v1";
const MAX_SNAPSHOT_BYTES: u64 = 64 << 20;
/// Go's archive/tar `maxSpecialFileSize`.
const MAX_SPECIAL_BYTES: u64 = 1 << 20;
/// Decompressed bytes read before giving up on finding `snapshot.json` (a gzip bomb's limit).
const MAX_SCANNED_BYTES: u64 = 256 << 20;

#[derive(Serialize)]
struct Manifest<'a> {
    format: &'a str,
    agent_version: &'a str,
    created_at: String,
    sysroot: &'a str,
    /// What the bundle holds or lacks and why (the bug report's run, among others).
    notes: Vec<String>,
}

pub fn write(
    path: &Path,
    snapshot: &Snapshot,
    report: &super::Report,
    recorded: &[Recorded],
    history: Option<&crate::history::History>,
    bug_report: &BugReport,
) -> Result<()> {
    // Write beside the target and rename, so a crash or a full disk never leaves a truncated
    // bundle under the name the user asked for.
    if std::fs::symlink_metadata(path).is_ok() {
        bail!("{}: already exists; give the bundle a new name", path.display());
    }
    let tmp = path.with_extension("partial");
    let result = write_to(&tmp, snapshot, report, recorded, history, bug_report).and_then(|()| {
        std::fs::hard_link(&tmp, path).with_context(|| format!("{}: cannot put the bundle in place", path.display()))
    });
    let _ = std::fs::remove_file(&tmp);
    result
}

fn write_to(
    path: &Path,
    snapshot: &Snapshot,
    report: &super::Report,
    recorded: &[Recorded],
    history: Option<&crate::history::History>,
    bug_report: &BugReport,
) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .with_context(|| format!("{}: cannot create the bundle", path.display()))?;
    let mut tar = tar::Builder::new(GzEncoder::new(file, flate2::Compression::default()));
    let manifest = Manifest {
        format: FORMAT,
        agent_version: env!("CARGO_PKG_VERSION"),
        created_at: crate::snapshot::Timestamp::now().to_string(),
        sysroot: &snapshot.sysroot,
        notes: [bug_report.note.clone()].into_iter().filter(|n| !n.is_empty()).collect(),
    };
    add(&mut tar, "manifest.json", &serde_json::to_vec_pretty(&manifest)?)?;
    add(&mut tar, "snapshot.json", &serde_json::to_vec_pretty(snapshot)?)?;
    add(&mut tar, "report.json", &serde_json::to_vec_pretty(report)?)?;
    add(&mut tar, "report.html", super::html::render(report).as_bytes())?;
    let mut seen = BTreeSet::new();
    let mut nvrm = String::new();
    for r in recorded {
        match r {
            Recorded::File { path: rel, contents } => {
                if rel.trim_start_matches('/') == "dev/kmsg" {
                    for line in String::from_utf8_lossy(contents)
                        .lines()
                        .filter(|l| l.contains("NVRM:") || l.contains(": SXid ("))
                    {
                        nvrm.push_str(line);
                        nvrm.push('\n');
                    }
                }
                if seen.insert(rel.clone()) {
                    add(&mut tar, &format!("files/{}", rel.trim_start_matches('/')), contents)?;
                }
            }
            Recorded::Link { path: rel, target } => {
                if seen.insert(rel.clone()) {
                    let mut h = tar::Header::new_gnu();
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_size(0);
                    h.set_mode(0o777);
                    tar.append_link(&mut h, format!("files/{}", rel.trim_start_matches('/')), target)
                        .with_context(|| format!("{}: cannot add link {rel}", path.display()))?;
                }
            }
        }
    }
    add(&mut tar, "nvrm.log", nvrm.as_bytes())?;
    if let Some(h) = history {
        add(&mut tar, "history.json", &serde_json::to_vec_pretty(h)?)?;
    }
    if let Some(log) = &bug_report.log {
        add(&mut tar, crate::collect::bug_report::LOG_NAME, log)?;
    }
    let gz = tar.into_inner().with_context(|| format!("{}: cannot finish the archive", path.display()))?;
    let file = gz.finish().with_context(|| format!("{}: cannot finish compression", path.display()))?;
    file.sync_all().with_context(|| format!("{}: cannot flush to disk", path.display()))?;
    Ok(())
}

fn add<W: std::io::Write>(tar: &mut tar::Builder<W>, name: &str, data: &[u8]) -> Result<()> {
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_mtime(0);
    tar.append_data(&mut h, name, data).with_context(|| format!("cannot add {name} to the bundle"))
}

/// Reads the snapshot out of a bundle.
pub fn read_snapshot(path: &Path) -> Result<Snapshot> {
    let buf = read_member(path, "snapshot.json", "a snapshot")?;
    let what = format!("{}: snapshot.json", path.display());
    let s: Snapshot = super::untrusted::parse(&buf, &what)?;
    super::untrusted::check_snapshot(&s, &what)?;
    Ok(s)
}

/// Reads the report a bundle was written with (what `doctor` printed, probes included).
pub fn read_report(path: &Path) -> Result<super::Report> {
    let buf = read_member(path, "report.json", "a report")?;
    let what = format!("{}: report.json", path.display());
    let r: super::Report = super::untrusted::parse(&buf, &what)?;
    super::untrusted::check_report(&r, &what)?;
    Ok(r)
}

/// One member of a bundle, by name, at most `MAX_SNAPSHOT_BYTES`.
fn read_member(path: &Path, member: &str, what: &str) -> Result<Vec<u8>> {
    let (file, _) = crate::sysroot::open_regular(path, false)
        .with_context(|| format!("{}: cannot open the bundle", path.display()))?;
    let mut archive = tar::Archive::new(GzDecoder::new(file).take(MAX_SCANNED_BYTES));
    // Raw: the tar crate would read a GNU long name or PAX header whole into memory to apply it
    // to the next entry; this reader needs neither (it writes neither), so it skips them.
    let mut entries = archive.entries().with_context(|| format!("{}: not a gzip'd tar bundle", path.display()))?;
    entries = entries.raw(true);
    for entry in entries {
        let entry = entry.with_context(|| format!("{}: corrupt bundle", path.display()))?;
        let kind = entry.header().entry_type();
        let size = entry.header().size().unwrap_or(u64::MAX);
        if kind.is_gnu_longname()
            || kind.is_gnu_longlink()
            || kind.is_pax_global_extensions()
            || kind.is_pax_local_extensions()
        {
            if size > MAX_SPECIAL_BYTES {
                bail!("{}: a tar header extension of {size} bytes (more than {MAX_SPECIAL_BYTES}); not a phq-agent bundle", path.display());
            }
            continue;
        }
        let name = String::from_utf8_lossy(&entry.header().path_bytes()).into_owned();
        if name == member {
            if size > MAX_SNAPSHOT_BYTES {
                bail!("{}: {member} is {size} bytes, more than {what} can be ({MAX_SNAPSHOT_BYTES})", path.display());
            }
            let mut buf = Vec::new();
            entry
                .take(MAX_SNAPSHOT_BYTES)
                .read_to_end(&mut buf)
                .with_context(|| format!("{}: cannot read {member}", path.display()))?;
            return Ok(buf);
        }
    }
    bail!("{}: no {member} in its first {} MiB; is this a phq-agent bundle?", path.display(), MAX_SCANNED_BYTES >> 20)
}
