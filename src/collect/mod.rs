//! collect: reads the world and builds a `Snapshot`.
//!
//! The rules of this room:
//! 1. It is the only room that reads the machine: files through `Sysroot` (never a path of its
//!    own), NVML through one `nvml::Session` per process (the probes read through the caller's),
//!    systemd over D-Bus, libcuda's start-up. Others judge, render or act on what it gives.
//! 2. Fetch, then interpret: each reader returns text or a `Fact::Error` naming the file; each
//!    parser is a pure function of text with unit tests over real captured output.
//! 3. A call that can block (NVML) runs on a worker under a deadline (`deadline.rs`), so a
//!    wedged driver costs a deadline and a thread, never the snapshot.
//! 4. Imports go down only: `snapshot`, `sysroot`, `facts`, `cuda`; never `checks` or anything
//!    above it (tests/rooms.rs holds the order).

pub mod bug_report;
pub mod bug_report_helper;
pub mod cuda;
pub mod deadline;
pub mod driver;
pub mod host;
pub mod kmsg;
pub mod nvml;
pub mod packages;
pub mod pci;
pub mod procs;
pub mod units;

use crate::snapshot::{CudaToolkit, Fact, Snapshot, Timestamp};
use crate::sysroot::Sysroot;

/// Where NVML comes from for a snapshot.
#[derive(Debug, Clone)]
pub enum NvmlSource {
    /// Load this library (a path, or a soname for the dynamic loader) for this snapshot alone,
    /// each phase under the default deadlines.
    Library(String),
    /// Read through a session kept across snapshots (the service).
    Session(std::sync::Arc<nvml::Session>),
    /// Do not load NVML, for this reason.
    Skip(String),
}

impl PartialEq for NvmlSource {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (NvmlSource::Library(a), NvmlSource::Library(b)) | (NvmlSource::Skip(a), NvmlSource::Skip(b)) => a == b,
            (NvmlSource::Session(a), NvmlSource::Session(b)) => std::sync::Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl NvmlSource {
    /// A library read under `deadlines` (the configuration's `[nvml]`), not the defaults.
    pub fn under(self, deadlines: nvml::Deadlines) -> Self {
        match self {
            NvmlSource::Library(lib) => NvmlSource::Session(std::sync::Arc::new(nvml::Session::new(&lib, deadlines))),
            other => other,
        }
    }

    /// The session a reading goes through, once `under` has made one: the probes read NVML's
    /// conditions beside their figures through it rather than opening a second.
    pub fn session(&self) -> Option<&nvml::Session> {
        match self {
            NvmlSource::Session(s) => Some(s),
            _ => None,
        }
    }

    /// `--nvml-lib` when given; else the system's NVML on a live root; else none, since a
    /// fixture or bundle root stands for another machine whose NVML this one cannot ask.
    pub fn choose(explicit: Option<&std::path::Path>, root: &Sysroot) -> Self {
        match explicit {
            Some(p) => NvmlSource::Library(p.display().to_string()),
            None if root.is_live() => NvmlSource::Library(nvml::DEFAULT_LIBRARY.into()),
            None => NvmlSource::Skip(format!(
                "NVML not read: --sysroot {} stands for another machine (pass --nvml-lib to read one)",
                root.root().display()
            )),
        }
    }
}

/// Reads everything a snapshot holds from `root`.
pub fn snapshot(root: &Sysroot, nvml_source: &NvmlSource) -> Snapshot {
    snapshot_within(root, nvml_source, None)
}

/// As `snapshot`, with NVML's phases all within `nvml_budget` when one is given (the service's
/// first snapshot, which systemd waits for). Whatever NVML does, everything else is read: NVML
/// on a thread of its own while the rest is read here, so a snapshot takes as long as the
/// slower of the two, not their sum.
pub fn snapshot_within(root: &Sysroot, nvml_source: &NvmlSource, nvml_budget: Option<std::time::Duration>) -> Snapshot {
    std::thread::scope(|scope| {
        let nvml = std::thread::Builder::new()
            .name("nvml-read".into())
            .spawn_scoped(scope, || read_nvml(nvml_source, nvml_budget));
        let mut snapshot = read_without_nvml(root);
        let reading = match nvml {
            Ok(handle) => handle.join().unwrap_or_else(|_| nvml::Reading {
                status: crate::snapshot::NvmlStatus::NotRead("the NVML reader panicked".into()),
                blocked: vec![],
            }),
            // No thread to be had: read NVML here (each call still has its worker and deadline).
            Err(_) => read_nvml(nvml_source, nvml_budget),
        };
        snapshot.nvml = reading.status;
        snapshot.nvml_blocked = reading.blocked;
        snapshot
    })
}

fn read_nvml(source: &NvmlSource, budget: Option<std::time::Duration>) -> nvml::Reading {
    match source {
        NvmlSource::Library(lib) => nvml::read(lib, nvml::Deadlines::default()),
        NvmlSource::Session(s) => s.read(budget),
        NvmlSource::Skip(why) => {
            nvml::Reading { status: crate::snapshot::NvmlStatus::NotRead(why.clone()), blocked: vec![] }
        }
    }
}

/// Everything but NVML (left `NotRead` for the caller to fill in).
fn read_without_nvml(root: &Sysroot) -> Snapshot {
    let host = host::read(root);
    let driver =
        driver::read(root, host.kernel_release.value().map(String::as_str), host.cmdline.value().map(String::as_str));
    Snapshot {
        observed_at: Timestamp::now(),
        sysroot: root.root().display().to_string(),
        pci: pci::read_devices(root),
        driver,
        cuda_toolkits: read_cuda_toolkits(root),
        kernel_log: kmsg::read(root),
        packages: packages::read(root),
        units: if units::should_read(root.is_live()) {
            units::read()
        } else {
            Fact::Error(format!(
                "systemd not asked: --sysroot {} stands for another machine (set DBUS_SYSTEM_BUS_ADDRESS to ask a bus)",
                root.root().display()
            ))
        },
        // cuInit is asked on the live machine only (a fixture has no GPU to initialise), or
        // when a CUDA library is named (--cuda-lib): it stands for that machine's GPUs.
        cuda: if root.is_live() || crate::cuda::named_library().is_some() {
            cuda::read()
        } else {
            crate::snapshot::CudaStatus::NotRead(format!(
                "CUDA not asked: --sysroot {} stands for another machine",
                root.root().display()
            ))
        },
        nvml: crate::snapshot::NvmlStatus::NotRead("not read yet".into()),
        nvml_blocked: vec![],
        host,
    }
}

/// `/usr/local/cuda-12.4/version.json` (CUDA ≥ 11.1) for every `/usr/local/cuda*` directory.
fn read_cuda_toolkits(root: &Sysroot) -> Fact<Vec<CudaToolkit>> {
    let names = match root.list_dir("usr/local") {
        Ok(n) => n,
        Err(e) if e.is_not_found() => return Fact::Value(Vec::new()),
        Err(e) => return Fact::Error(e.to_string()),
    };
    let mut toolkits = Vec::new();
    let mut seen = Vec::new();
    // Reverse order visits `cuda-12.4` before the `cuda` link to it, so the versioned path is kept.
    for name in names.iter().rev().filter(|n| n.starts_with("cuda")) {
        let rel = format!("usr/local/{name}/version.json");
        // `/usr/local/cuda` is usually a link to one of the versioned directories: count each
        // toolkit once, and skip links that lead nowhere.
        let Ok(real) = root.resolve(&format!("usr/local/{name}")) else { continue };
        if seen.contains(&real) {
            continue;
        }
        seen.push(real);
        let version = match root.read_string(&rel) {
            Ok(text) => parse_cuda_version_json(&text)
                .map(Fact::Value)
                .unwrap_or_else(|| Fact::Error(format!("{}: no cuda.version in it", Sysroot::display(&rel)))),
            Err(e) if e.is_not_found() => {
                toolkit_version_without_json(root, name).map(Fact::Value).unwrap_or_else(|| {
                    Fact::Error(format!("{e}; no libcudart.so.X.Y.Z or include/cuda.h beside it either"))
                })
            }
            Err(e) => Fact::Error(e.to_string()),
        };
        toolkits.push(CudaToolkit { path: Sysroot::display(&format!("usr/local/{name}")), version });
    }
    toolkits.sort_by(|a, b| a.path.cmp(&b.path));
    Fact::Value(toolkits)
}

/// A toolkit's major.minor where it has no version.json: NVIDIA's container images and the
/// CUDA 13 toolkit of the H200 machine recorded in docs/hardware-validation.md carry none
/// (AnyDSL/runtime#37 met the same in NVIDIA's images). The runtime library's file name
/// (`libcudart.so.13.0.96`: the runtime's version, whose major.minor is the toolkit's, as
/// NVIDIA/DALI#1477 reads it), else `CUDA_VERSION` in `include/cuda.h` (`13000` → `13.0`).
fn toolkit_version_without_json(root: &Sysroot, name: &str) -> Option<String> {
    for lib in ["lib64", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"] {
        let Ok(files) = root.list_dir(&format!("usr/local/{name}/{lib}")) else { continue };
        let found = files.iter().filter_map(|f| f.strip_prefix("libcudart.so.")).find_map(|v| {
            let mut parts = v.split('.');
            let (major, minor) = (parts.next()?, parts.next()?);
            let numeric = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
            (numeric(major) && numeric(minor)).then(|| format!("{major}.{minor}"))
        });
        if found.is_some() {
            return found;
        }
    }
    let header = root.read_string(&format!("usr/local/{name}/include/cuda.h")).ok()?;
    parse_cuda_h_version(&header)
}

/// `#define CUDA_VERSION 13000` → `13.0` (cuda.h: 1000 × major + 10 × minor).
pub fn parse_cuda_h_version(text: &str) -> Option<String> {
    let line = text.lines().find_map(|l| l.trim().strip_prefix("#define CUDA_VERSION"))?;
    let n: u32 = line.trim().parse().ok()?;
    (n >= 1000).then(|| format!("{}.{}", n / 1000, (n % 1000) / 10))
}

/// `{"cuda": {"name": "CUDA SDK", "version": "12.4.1"}, …}` → `12.4.1`.
pub fn parse_cuda_version_json(text: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    v.get("cuda")?.get("version")?.as_str().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cuda_version_json() {
        let text = r#"{"cuda":{"name":"CUDA SDK","version":"12.4.1"},"cuda_cudart":{"name":"CUDA Runtime (cudart)","version":"12.4.127"}}"#;
        assert_eq!(parse_cuda_version_json(text).as_deref(), Some("12.4.1"));
        assert_eq!(parse_cuda_version_json("CUDA Version 10.2.89"), None);
    }

    /// The H200 machine's /usr/local/cuda-13.0 had no version.json (docs/hardware-validation.md);
    /// its libcudart.so.13.0.* says 13.0, and cuda.h says it where no runtime library is.
    #[test]
    fn a_toolkit_without_version_json_is_read_from_its_runtime_or_header() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("usr/local/cuda-13.0/targets/x86_64-linux/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libcudart.so.13.0.96"), b"").unwrap();
        std::os::unix::fs::symlink("targets/x86_64-linux/lib", dir.path().join("usr/local/cuda-13.0/lib64")).unwrap();
        std::os::unix::fs::symlink("cuda-13.0", dir.path().join("usr/local/cuda")).unwrap();
        let inc = dir.path().join("usr/local/cuda-12.8/include");
        std::fs::create_dir_all(&inc).unwrap();
        std::fs::write(inc.join("cuda.h"), b"#ifndef __cuda_cuda_h__\n#define CUDA_VERSION 12080\n").unwrap();
        std::fs::create_dir_all(dir.path().join("usr/local/cuda-11.8")).unwrap();
        let t = read_cuda_toolkits(&Sysroot::new(dir.path())).value().cloned().unwrap();
        let got: Vec<(String, Result<String, String>)> = t
            .iter()
            .map(|t| (t.path.clone(), t.version.value().cloned().ok_or_else(|| format!("{:?}", t.version))))
            .collect();
        assert_eq!(got[0].0, "/usr/local/cuda-11.8");
        assert!(got[0].1.as_ref().is_err_and(|e| e.contains("no libcudart.so")), "{got:?}");
        assert_eq!(got[1], ("/usr/local/cuda-12.8".into(), Ok("12.8".into())));
        assert_eq!(got[2], ("/usr/local/cuda-13.0".into(), Ok("13.0".into())));
        assert_eq!(got.len(), 3, "the cuda link counted once: {got:?}");
        assert_eq!(parse_cuda_h_version("#define CUDA_VERSION 9020"), Some("9.2".into()));
    }

    proptest! {
        #[test]
        fn cuda_version_never_panics(s in ".*") {
            let _ = parse_cuda_version_json(&s);
            let _ = parse_cuda_h_version(&s);
        }
    }
}
