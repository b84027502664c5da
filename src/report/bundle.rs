//! Support bundles: `doctor --bundle OUT.tar.gz` writes what the agent saw; `doctor --from
//! BUNDLE` judges it again on another machine.
//!
//! Layout (gzip'd tar):
//! - `manifest.json`   format, agent version, when
//! - `snapshot.json`   the Snapshot: `--from` re-runs the checks on exactly this
//! - `report.json`     the Report as it was printed
//! - `nvrm.log`        the kernel log lines from the NVIDIA driver (Xid, BAR, GPU UUIDs)
//! - `files/…`         every raw file and link the snapshot was built from, laid out like `/`,
//!   so `doctor --sysroot files/` re-collects from them
//!
//! Reading a bundle never extracts it: only `snapshot.json` is read, with a size cap.

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

#[derive(Serialize)]
struct Manifest<'a> {
    format: &'a str,
    agent_version: &'a str,
    created_at: String,
    sysroot: &'a str,
}

pub fn write(path: &Path, snapshot: &Snapshot, report: &super::Report, recorded: &[Recorded]) -> Result<()> {
    // Write beside the target and rename, so a crash or a full disk never leaves a truncated
    // bundle under the name the user asked for.
    let tmp = path.with_extension("partial");
    let result = write_to(&tmp, snapshot, report, recorded);
    match result {
        Ok(()) => std::fs::rename(&tmp, path)
            .with_context(|| format!("{}: cannot move the bundle into place", path.display())),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

fn write_to(path: &Path, snapshot: &Snapshot, report: &super::Report, recorded: &[Recorded]) -> Result<()> {
    let file = std::fs::File::create(path).with_context(|| format!("{}: cannot create the bundle", path.display()))?;
    let mut tar = tar::Builder::new(GzEncoder::new(file, flate2::Compression::default()));
    let manifest = Manifest {
        format: FORMAT,
        agent_version: env!("CARGO_PKG_VERSION"),
        created_at: crate::snapshot::Timestamp::now().to_string(),
        sysroot: &snapshot.sysroot,
    };
    add(&mut tar, "manifest.json", &serde_json::to_vec_pretty(&manifest)?)?;
    add(&mut tar, "snapshot.json", &serde_json::to_vec_pretty(snapshot)?)?;
    add(&mut tar, "report.json", &serde_json::to_vec_pretty(report)?)?;
    let mut seen = BTreeSet::new();
    let mut nvrm = String::new();
    for r in recorded {
        match r {
            Recorded::File { path: rel, contents } => {
                if rel.trim_start_matches('/') == "dev/kmsg" {
                    for line in String::from_utf8_lossy(contents).lines().filter(|l| l.contains("NVRM:")) {
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
    let file = std::fs::File::open(path).with_context(|| format!("{}: cannot open the bundle", path.display()))?;
    let mut archive = tar::Archive::new(GzDecoder::new(file));
    let entries = archive.entries().with_context(|| format!("{}: not a gzip'd tar bundle", path.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("{}: corrupt bundle", path.display()))?;
        let name = entry.path().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        if name == "snapshot.json" {
            let mut buf = Vec::new();
            entry
                .take(MAX_SNAPSHOT_BYTES)
                .read_to_end(&mut buf)
                .with_context(|| format!("{}: cannot read snapshot.json", path.display()))?;
            return serde_json::from_slice(&buf)
                .with_context(|| format!("{}: snapshot.json is not a snapshot this agent can read", path.display()));
        }
    }
    bail!("{}: no snapshot.json in it; is this a phq-agent bundle?", path.display())
}
