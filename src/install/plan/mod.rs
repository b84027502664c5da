//! The plan: a pure function from what the guest is (`Facts`) and what the operator asked
//! (`Settings`) to the list of steps that make it a working GPU guest. Nothing here runs or
//! reads anything, so every distro × GPU layout × Secure Boot × install state is a golden test.
//!
//! Each step is idempotent and says when the machine already has what it does (`done`), so a
//! second run, or a run after a `kill -9`, plans only what is missing.
//!
//! The rules of this room:
//! 1. Pure: no file, command, clock or network. The parent's `gather` read the facts once.
//! 2. A decision more than one step reads is made once, in `choices.rs` (`Choices`), and read
//!    from there: "is the driver being replaced" has one answer.
//! 3. Each kind of step is built in its own room, in plan order: `repository.rs` (the package
//!    manager and its sources), `driver.rs`, `toolkit.rs`, `finish.rs` (holds, reboot,
//!    verification); `preflight.rs` then resolves everything they install. `plan()` below is
//!    that sequence and nothing more.
//! 4. A step is named by its `StepId`, never by a string; the strings are the journal's and the
//!    golden plans' (`StepId::as_str`) and do not change.
//! 5. What `--dry-run` prints and the journal hashes is written in `render.rs` alone: a change
//!    there changes every golden plan and makes every journaled step run again.
//! 6. The rooms use this file (the plan's types, paths and command builders), `guest.rs` and
//!    `choices.rs`; never one another.

mod choices;
mod driver;
mod finish;
mod guest;
mod preflight;
mod render;
mod repository;
#[cfg(test)]
mod tests;
mod toolkit;

pub use choices::{fabric_manager_names, installed_driver, InstalledDriver};
pub use guest::{Distro, Facts, Settings};
pub use render::{render, render_action, render_cmd};
pub use repository::{apt_list_prefix, apt_source};
pub use toolkit::{built_for_cuda, nccl_package, newest_for_cuda};

use crate::checks::Finding;
use choices::Choices;

/// NVIDIA's repository root; each distro lives in `<root>/<dir>/x86_64/`.
pub const NVIDIA_REPO_ROOT: &str = "https://developer.download.nvidia.com/compute/cuda/repos";
/// The keyring package NVIDIA publishes in each Debian/Ubuntu repository directory.
pub const CUDA_KEYRING_DEB: &str = "cuda-keyring_1.1-1_all.deb";
/// Where `cuda-keyring` carries the repository key. The installer takes only this member out of
/// the package, verified, and never installs the package itself: its maintainer scripts and its
/// other files would run and land as root on the word of a key check that did not cover them.
pub const CUDA_KEYRING_MEMBER: &str = "usr/share/keyrings/cuda-archive-keyring.gpg";
/// Where the installer writes the verified key for apt's `signed-by`: a key the machine's
/// administrator manages, not a package, belongs in /etc/apt/keyrings (Debian's wiki,
/// "DebianRepository/UseThirdParty"; apt from 2.4 creates that directory).
pub const NVIDIA_APT_KEYRING: &str = "/etc/apt/keyrings/phq-nvidia-cuda.gpg";
/// The RHEL repository key's file name: NVIDIA names it by the key's short id (the key is
/// still checked against its whole fingerprint).
pub const RHEL_KEY_FILE: &str = "D42D0685.pub";
pub const RHEL_KEY_PATH: &str = "/etc/pki/rpm-gpg/RPM-GPG-KEY-NVIDIA-CUDA";
pub const RHEL_REPO_PATH: &str = "/etc/yum.repos.d/cuda-rhel9.repo";
/// EPEL's root, where its release package and key for RHEL lie (Rocky and Alma carry
/// `epel-release` in their own signed extras repository). The EPEL project's own instructions
/// install the release package by URL from here; `install.epel_url` names a mirror instead.
pub const EPEL_ROOT: &str = "https://dl.fedoraproject.org/pub/epel";
pub const EPEL_RELEASE_FILE: &str = "epel-release-latest-9.noarch.rpm";
pub const EPEL_KEY_FILE: &str = "RPM-GPG-KEY-EPEL-9";
pub const EPEL_KEY_PATH: &str = "/etc/pki/rpm-gpg/RPM-GPG-KEY-EPEL-9";
/// Where the installer downloads what it verifies and installs (the keyring package, the RHEL
/// key). Root's alone (0700), and outside the service's state directory: the service's user
/// owns that directory and could swap a verified file for another between the check and
/// `dpkg -i`, or rename a root-owned subdirectory away and plant its own.
pub const DOWNLOAD_DIR: &str = "/var/cache/phq-agent-install";
pub const NOUVEAU_CONF: &str = "/etc/modprobe.d/blacklist-nouveau.conf";
pub const NOUVEAU_CONF_TEXT: &str = "blacklist nouveau\noptions nouveau modeset=0\n";
pub const DEBIAN_PIN_PATH: &str = "/etc/apt/preferences.d/phq-nvidia-driver-branch";
/// Where the installer adds the Debian archive components NVIDIA's packages need.
pub const DEBIAN_COMPONENTS_PATH: &str = "/etc/apt/sources.list.d/phq-debian-components.sources";
/// The components: `contrib` for the helpers Debian's NVIDIA packaging depends on,
/// `non-free-firmware` for the GSP firmware (install/sources.rs says which and where from).
pub const DEBIAN_COMPONENTS: &[&str] = &["contrib", "non-free-firmware"];
pub const VERSIONLOCK_LIST: &str = "/etc/dnf/plugins/versionlock.list";
/// systemd's wants directory: a unit linked here is enabled.
pub const WANTS_DIR: &str = "/etc/systemd/system/multi-user.target.wants";

/// A step's name: what `--dry-run` prints before its title and what the journal records it
/// under. Each variant is spelt once, in `as_str`; serde writes the same words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StepId {
    Repair,
    Repo,
    Components,
    Pin,
    Preflight,
    Headers,
    KernelHold,
    Nouveau,
    Driver,
    Mok,
    Persistenced,
    #[serde(rename = "fabricmanager")]
    FabricManager,
    #[serde(rename = "fabricmanager-off")]
    FabricManagerOff,
    Toolkit,
    Nccl,
    Hold,
    Reboot,
    Verify,
}

impl StepId {
    pub const ALL: [StepId; 18] = [
        StepId::Repair,
        StepId::Repo,
        StepId::Components,
        StepId::Pin,
        StepId::Preflight,
        StepId::Headers,
        StepId::KernelHold,
        StepId::Nouveau,
        StepId::Driver,
        StepId::Mok,
        StepId::Persistenced,
        StepId::FabricManager,
        StepId::FabricManagerOff,
        StepId::Toolkit,
        StepId::Nccl,
        StepId::Hold,
        StepId::Reboot,
        StepId::Verify,
    ];

    /// The step's name in the journal (`steps`), in `--dry-run` and in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            StepId::Repair => "repair",
            StepId::Repo => "repo",
            StepId::Components => "components",
            StepId::Pin => "pin",
            StepId::Preflight => "preflight",
            StepId::Headers => "headers",
            StepId::KernelHold => "kernel-hold",
            StepId::Nouveau => "nouveau",
            StepId::Driver => "driver",
            StepId::Mok => "mok",
            StepId::Persistenced => "persistenced",
            StepId::FabricManager => "fabricmanager",
            StepId::FabricManagerOff => "fabricmanager-off",
            StepId::Toolkit => "toolkit",
            StepId::Nccl => "nccl",
            StepId::Hold => "hold",
            StepId::Reboot => "reboot",
            StepId::Verify => "verify",
        }
    }

    /// The step a journal's name stands for; None for a name no step has.
    pub fn from_name(name: &str) -> Option<StepId> {
        StepId::ALL.into_iter().find(|id| id.as_str() == name)
    }
}

impl std::fmt::Display for StepId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arg {
    Lit(String),
    /// This package at exactly the installed driver's version (`pkg=<ver>` for apt, `pkg-<ver>`
    /// for dnf), looked up when the step runs: the driver is installed by then.
    AtDriverVersion(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    Never,
    /// A network fetch: a few tries with backoff, then a finding naming the URL.
    Network,
    /// Waits while another package manager holds the dpkg lock.
    DpkgLock,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cmd {
    pub program: String,
    pub args: Vec<Arg>,
    pub env: Vec<(String, String)>,
    pub retry: Retry,
    /// What the URL of a network command is, for the finding when it keeps failing.
    pub url: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Run(Cmd),
    /// Write a file atomically (0644).
    Write {
        path: String,
        contents: String,
    },
    /// Download to a file, with bounded retries.
    Fetch {
        url: String,
        to: String,
    },
    /// Trust gate: the key file (or the keyring inside a .deb) must be the pinned key and
    /// nothing else (`pgp::verified`); then the packets that were checked, not the downloaded
    /// file, are written to `to` (0644): armored for rpm, binary for apt.
    InstallKey {
        file: String,
        deb_member: Option<String>,
        fingerprint: String,
        to: String,
        armored: bool,
    },
    /// Pre-flight: resolve every package the later steps install, without installing any
    /// (`apt-get -s install`, `dnf install --assumeno`), and stop with the names that cannot be
    /// installed. `@module:stream` names a dnf module stream.
    Resolve(Vec<String>),
    /// Finish what dpkg left half-done: a package whose unpacking was killed (dpkg marks it
    /// reinst-required; neither `dpkg --configure -a` nor `apt-get -f` without its archive
    /// repairs it) is removed with `--force-remove-reinstreq` for its own step to install
    /// again; then `dpkg --configure -a` and `apt-get install -f`.
    RepairDpkg {
        configure: Cmd,
        fix: Cmd,
    },
    /// Reboot if a finished step needs it (logind; `--reboot never` reports instead).
    Reboot,
    /// Run the doctor's checks and keep what is wrong.
    Verify,
    /// Secure Boot with a DKMS-built driver: DKMS signs the module with its own machine-owner
    /// key (`key`, the certificate); queue that key for enrolment (`mokutil --import`, with a
    /// one-time password kept root-only under `DOWNLOAD_DIR`) unless the firmware already
    /// trusts it or the request is already queued. The person at the VM console confirms it
    /// in shim's MOK manager on the next boot; the boot-safety gate says how.
    EnrollMok {
        key: String,
    },
    /// RHEL: enable the CodeReady Linux Builder repository that belongs to how this machine
    /// gets its packages. Its id differs: Red Hat's CDN through subscription-manager
    /// (`codeready-builder-for-rhel-9-x86_64-rpms`), Extended Update Support (`…-eus-rpms`), a
    /// cloud's RHUI (`codeready-builder-for-rhel-9-rhui-rpms`, `rhui-codeready-builder-…`), so
    /// it is read from `dnf repolist --all` when the step runs, matched to the enabled BaseOS.
    EnableCrb,
    /// A package built for one CUDA release (NCCL: `libnccl2` / `libnccl`), whose builds differ
    /// only in the `+cuda<major.minor>` that ends their version. When the step runs, `query`
    /// lists the repository's versions (`apt-cache madison`, `dnf repoquery`) and `install` gets
    /// `package` at the newest one built for `cuda` (`pkg=<version>` for apt, `pkg-<version>`
    /// for dnf). The plan cannot name that version: on a fresh guest the repository's index is
    /// not there until the repository step has run. When the repository has no build for
    /// `cuda`, nothing is installed, the rest of the step is skipped and a warning says so
    /// (`install.nccl`); a build for another CUDA is never taken in its place.
    InstallForCuda {
        package: String,
        cuda: String,
        query: Cmd,
        install: Cmd,
    },
}

/// Where DKMS keeps the certificate of the key it signs modules with: the dkms project's README
/// ("Module signing") says the key and certificate are generated the first time DKMS signs a
/// module and placed in /var/lib/dkms (`mok.key`, `mok.pub`), unless `mok_signing_key` /
/// `mok_certificate` in /etc/dkms/framework.conf name others (Ubuntu's shim-signed MOK, for one).
/// Debian 12's dkms (3.0.10) makes it at the first build; `dkms generate_mok` exists from 3.1.
pub const DKMS_MOK: &str = "/var/lib/dkms/mok.pub";
/// The one-time password of a queued MOK enrolment, for the person at the console (root-only).
pub const MOK_PASSWORD_FILE: &str = "mok-enrolment-password";

#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub id: StepId,
    pub title: String,
    pub actions: Vec<Action>,
    /// Why nothing needs doing, when the machine already has it.
    pub done: Option<String>,
    /// Finishing this step leaves the running kernel on old modules or an old initramfs.
    pub needs_reboot: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub distro: Distro,
    pub kernel: String,
    pub summary: String,
    pub repo_base: String,
    /// The package whose version is "the driver's version" (fabric manager must equal it).
    pub driver_package: Option<String>,
    pub steps: Vec<Step>,
    /// What the plan will not do, and why; each with its remedy.
    pub findings: Vec<Finding>,
    /// Reboot even if no step runs: the installed driver is not the one loaded.
    pub reboot_reason: Option<String>,
    /// Before rebooting a VM with GPUs into the driver: check the kernel that boots next has the
    /// module (`apply`'s boot-safety gate). Whether Secure Boot is on (the module must then be
    /// signed by a key the firmware trusts).
    pub boot_check: Option<BootCheck>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootCheck {
    pub secure_boot: bool,
}

/// Why there is no plan: an unsupported guest, or settings no plan can keep.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("cannot tell which distribution this is: {0}")]
    UnknownDistro(String),
    /// The guest as os-release names it, quoted (its text could hold a control character),
    /// and the guests that are supported.
    #[error("{this:?} is not a guest phq-agent install supports ({supported})")]
    Unsupported { this: String, supported: String },
    #[error("cannot tell the running kernel's release (/proc/sys/kernel/osrelease)")]
    NoKernel,
    #[error("install.cuda = {0:?}: phq-agent installs a CUDA 12 toolkit, such as \"12.4\"")]
    NotCuda12(String),
    #[error("CUDA {0} is not in the driver table (12.0–12.6, 12.8, 12.9)")]
    UnknownCuda(String),
    #[error(
        "install.cuda = {cuda:?}: NVIDIA has no CUDA {cuda} packages for Ubuntu 24.04 (its ubuntu2404 repository starts at CUDA {first}); choose {first} or later (the default is {default})",
        first = crate::facts::UBUNTU2404_FIRST_CUDA,
        default = crate::facts::DEFAULT_CUDA
    )]
    NoCudaForUbuntu2404 { cuda: String },
    #[error("driver branch {0} predates CUDA 12 (needs {min} or later)", min = crate::facts::MIN_DRIVER_BRANCH)]
    BranchTooOld(u32),
    /// A mirror URL refused (`config::check_mirror_url`'s words, naming the setting).
    #[error("{0}")]
    Mirror(String),
}

/// The plan as its rooms build it, in plan order.
struct Draft {
    steps: Vec<Step>,
    findings: Vec<Finding>,
}

/// The plan, or why there can be none (an unsupported guest, a CUDA the branch cannot run).
pub fn plan(f: &Facts, s: &Settings) -> Result<Plan, PlanError> {
    let c = Choices::make(f, s)?;
    let mut d = Draft { steps: Vec::new(), findings: c.findings() };
    repository::add(&mut d, f, s, &c);
    driver::add(&mut d, f, &c);
    toolkit::add(&mut d, f, &c);
    let reboot_reason = finish::add(&mut d, f, &c);
    preflight::insert(&mut d.steps);
    Ok(Plan {
        summary: render::summary(f, &c),
        repo_base: c.repo_base.clone(),
        driver_package: (!c.driver_package.is_empty()).then(|| c.driver_package.clone()),
        boot_check: (f.gpus > 0).then_some(BootCheck { secure_boot: c.secure_boot }),
        distro: c.distro,
        kernel: c.kernel,
        steps: d.steps,
        findings: d.findings,
        reboot_reason,
    })
}

pub const DEB_ENV: &[(&str, &str)] = &[("DEBIAN_FRONTEND", "noninteractive")];

pub(crate) fn cmd(program: &str, args: &[&str]) -> Cmd {
    Cmd {
        program: program.into(),
        args: args.iter().map(|a| Arg::Lit(a.to_string())).collect(),
        env: Vec::new(),
        retry: Retry::Never,
        url: None,
    }
}

/// `apt-get` as an unattended installer runs it: no prompts, keep local config files, and wait
/// up to ten minutes for a dpkg lock that someone else (unattended-upgrades, a person) holds.
fn apt(verb: &str, packages: Vec<Arg>) -> Cmd {
    let mut c = cmd(
        "apt-get",
        &[
            "-y",
            "-q",
            "-o",
            "DPkg::Lock::Timeout=600",
            "-o",
            "Dpkg::Options::=--force-confdef",
            "-o",
            "Dpkg::Options::=--force-confold",
            verb,
        ],
    );
    c.args.extend(packages);
    c.env = DEB_ENV.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    c.retry = Retry::Network;
    c
}

fn dnf(args: &[&str]) -> Cmd {
    let mut c = cmd("dnf", &[&["-y", "-q"][..], args].concat());
    c.retry = Retry::Network;
    c
}

fn lits(v: &[String]) -> Vec<Arg> {
    v.iter().map(|s| Arg::Lit(s.clone())).collect()
}

/// `c` with the package names appended to its arguments.
fn on(mut c: Cmd, packages: &[String]) -> Cmd {
    c.args.extend(lits(packages));
    c
}
