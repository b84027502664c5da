//! What the guest is (`Facts`, `Distro`) and what the operator asked (`Settings`): the plan's
//! inputs, read by the parent's `gather` and by tests, never by the plan itself.

use super::PlanError;
use crate::facts;
use crate::snapshot::{OsRelease, Package, SecureBoot};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Distro {
    Ubuntu2204,
    Ubuntu2404,
    Debian12,
    /// RHEL 9 and its rebuilds; the id (`rhel`, `rocky`, `almalinux`) decides EPEL and CRB.
    El9(String),
}

impl Distro {
    pub fn from_os(os: &OsRelease) -> Result<Distro, PlanError> {
        let major = os.version_id.split('.').next().unwrap_or("");
        let d = match (os.id.as_str(), os.version_id.as_str()) {
            ("ubuntu", "22.04") => Distro::Ubuntu2204,
            ("ubuntu", "24.04") => Distro::Ubuntu2404,
            ("debian", v) if v.split('.').next() == Some("12") => Distro::Debian12,
            (id @ ("rhel" | "rocky" | "almalinux"), _) if major == "9" => Distro::El9(id.into()),
            _ => {
                let supported: Vec<&str> = facts::SUPPORTED_OS.iter().map(|(_, _, name)| *name).collect();
                let this = if os.pretty_name.is_empty() {
                    format!("{} {}", os.id, os.version_id)
                } else {
                    os.pretty_name.clone()
                };
                // os-release is the guest's text: quoted (by `PlanError`'s message), so a control
                // character cannot reach the terminal.
                return Err(PlanError::Unsupported { this, supported: supported.join(", ") });
            }
        };
        Ok(d)
    }

    pub fn name(&self) -> String {
        match self {
            Distro::Ubuntu2204 => "Ubuntu 22.04".into(),
            Distro::Ubuntu2404 => "Ubuntu 24.04".into(),
            Distro::Debian12 => "Debian 12".into(),
            Distro::El9(id) => {
                facts::SUPPORTED_OS.iter().find(|(i, _, _)| i == id).map(|(_, _, n)| n.to_string()).unwrap_or_default()
            }
        }
    }

    /// The directory of NVIDIA's repository for this distro.
    pub fn repo_dir(&self) -> &'static str {
        match self {
            Distro::Ubuntu2204 => "ubuntu2204",
            Distro::Ubuntu2404 => "ubuntu2404",
            Distro::Debian12 => "debian12",
            Distro::El9(_) => "rhel9",
        }
    }

    pub fn is_deb(&self) -> bool {
        !matches!(self, Distro::El9(_))
    }

    /// The apt source `cuda-keyring` installs; a mirror replaces its contents.
    pub fn apt_source_path(&self) -> String {
        format!("/etc/apt/sources.list.d/cuda-{}-x86_64.list", self.repo_dir())
    }
}

/// What the guest is, as far as installing is concerned. Built from a snapshot plus the few
/// files the plan itself writes (`gather` in the parent module).
#[derive(Debug, Clone, PartialEq)]
pub struct Facts {
    pub os: Result<OsRelease, String>,
    pub kernel: Option<String>,
    pub headers_present: bool,
    pub secure_boot: Option<SecureBoot>,
    pub gpus: usize,
    pub nvswitches: usize,
    /// Installed packages; an error when they could not be listed (then nothing counts as done).
    pub packages: Result<Vec<Package>, String>,
    /// nouveau is blacklisted and `modeset=0` is set.
    pub nouveau_off: bool,
    pub nouveau_loaded: bool,
    /// Version of the loaded `nvidia` module, if one is loaded.
    pub nvidia_loaded: Option<String>,
    /// An `nvidia` module is installed for the running kernel (`/lib/modules/<kernel>`, where
    /// DKMS puts what it builds).
    pub nvidia_module_built: bool,
    /// dpkg was stopped in the middle (`/var/lib/dpkg/updates` is not empty): apt refuses to
    /// work until `dpkg --configure -a` has run.
    pub dpkg_interrupted: bool,
    /// File names in /var/lib/apt/lists: whether a repository's index was ever fetched.
    pub apt_lists: Vec<String>,
    /// apt's source files, `(path, contents)`: /etc/apt/sources.list and sources.list.d's
    /// `.list` and `.sources` (which components of the Debian archive are enabled).
    pub apt_sources: Vec<(String, String)>,
    /// Units linked in multi-user.target.wants.
    pub enabled_units: Vec<String>,
    /// The present contents of the files the plan writes (absent: not there).
    pub files: BTreeMap<String, String>,
    /// The present bytes of the key files the plan writes (absent: not there).
    pub keys: BTreeMap<String, Vec<u8>>,
}

/// What the operator asked for: the `[install]` config with the command line on top.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub cuda: String,
    pub driver_branch: u32,
    /// A mirror of NVIDIA's repository root (`…/compute/cuda/repos`); empty for NVIDIA's own.
    pub repo_url: String,
    /// The pinned key fingerprint; empty for NVIDIA's (facts.rs).
    pub key_fingerprint: String,
    /// A mirror of EPEL's root (`…/pub/epel`), for RHEL; empty for Fedora's own.
    pub epel_url: String,
    /// The pinned EPEL key fingerprint; empty for EPEL 9's (facts.rs).
    pub epel_key_fingerprint: String,
    /// Replace a driver of another branch (or the proprietary flavour) that is installed.
    pub replace_driver: bool,
    /// Mirrors may be plain `http://` (`install.allow_plain_http`): only signed metadata and
    /// signed packages are trusted from them, as from any mirror.
    pub allow_plain_http: bool,
}

impl Facts {
    pub(super) fn package(&self, name: &str) -> Option<&Package> {
        self.packages.as_ref().ok()?.iter().find(|p| p.name == name)
    }

    pub(super) fn installed(&self, name: &str) -> bool {
        self.package(name).is_some_and(|p| p.state == "installed")
    }

    pub(super) fn unit_enabled(&self, unit: &str) -> bool {
        self.enabled_units.iter().any(|u| u == unit)
    }

    /// The key file at `path` holds the pinned key and nothing else.
    pub(super) fn key_is(&self, path: &str, fingerprint: &str) -> bool {
        self.keys.get(path).is_some_and(|k| crate::install::pgp::verified(k, fingerprint).is_ok())
    }

    pub(super) fn file_is(&self, path: &str, contents: &str) -> bool {
        self.files.get(path).is_some_and(|c| c == contents)
    }
}
