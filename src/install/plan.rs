//! The plan: a pure function from what the guest is (`Facts`) and what the operator asked
//! (`Settings`) to the list of steps that make it a working GPU guest. Nothing here runs or
//! reads anything, so every distro × GPU layout × Secure Boot × install state is a golden test.
//!
//! Each step is idempotent and says when the machine already has what it does (`done`), so a
//! second run, or a run after a `kill -9`, plans only what is missing.

use crate::checks::Finding;
use crate::facts;
use crate::snapshot::{OsRelease, Package, SecureBoot};
use std::collections::BTreeMap;

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

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Distro {
    Ubuntu2204,
    Ubuntu2404,
    Debian12,
    /// RHEL 9 and its rebuilds; the id (`rhel`, `rocky`, `almalinux`) decides EPEL and CRB.
    El9(String),
}

impl Distro {
    pub fn from_os(os: &OsRelease) -> Result<Distro, String> {
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
                // os-release is the guest's text: quoted, so a control character cannot reach
                // the terminal.
                return Err(format!("{this:?} is not a guest phq-agent install supports ({})", supported.join(", ")));
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
    pub id: &'static str,
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

impl Facts {
    fn package(&self, name: &str) -> Option<&Package> {
        self.packages.as_ref().ok()?.iter().find(|p| p.name == name)
    }

    fn installed(&self, name: &str) -> bool {
        self.package(name).is_some_and(|p| p.state == "installed")
    }

    fn unit_enabled(&self, unit: &str) -> bool {
        self.enabled_units.iter().any(|u| u == unit)
    }

    /// The key file at `path` holds the pinned key and nothing else.
    fn key_is(&self, path: &str, fingerprint: &str) -> bool {
        self.keys.get(path).is_some_and(|k| crate::install::pgp::verified(k, fingerprint).is_ok())
    }

    fn file_is(&self, path: &str, contents: &str) -> bool {
        self.files.get(path).is_some_and(|c| c == contents)
    }
}

/// The driver found installed: its package, upstream version, branch, and whether it is the
/// open-module flavour.
#[derive(Debug, Clone, PartialEq)]
pub struct InstalledDriver {
    pub package: String,
    pub version: String,
    pub branch: Option<u32>,
    pub open: bool,
}

/// Package names that carry "the driver" on each family, most specific first.
pub fn installed_driver(packages: &[Package]) -> Option<InstalledDriver> {
    let is_driver = |n: &str| {
        (n.starts_with("nvidia-driver-") && n.chars().nth(14).is_some_and(|c| c.is_ascii_digit()))
            || n == "nvidia-kernel-open-dkms"
            || n == "nvidia-kernel-dkms"
            || n == "kmod-nvidia-open-dkms"
            || n == "nvidia-dkms-open"
            || (n.starts_with("nvidia-dkms-") && n.chars().nth(12).is_some_and(|c| c.is_ascii_digit()))
            || n == "kmod-nvidia-latest-dkms"
            || headless_branch(n).is_some()
    };
    let p = packages.iter().find(|p| is_driver(&p.name))?;
    let version = crate::collect::packages::upstream_version(&p.version).to_string();
    // Ubuntu's signed precompiled driver: user space without DKMS, the kernel module in a
    // per-kernel package whose name says whether it is the open flavour.
    let open = match headless_branch(&p.name) {
        Some(b) => packages.iter().any(|q| q.name.starts_with(&format!("linux-modules-nvidia-{b}-server-open-"))),
        None => p.name.ends_with("-open") || p.name.contains("-open-"),
    };
    Some(InstalledDriver { package: p.name.clone(), branch: facts::driver_branch(&version), open, version })
}

/// The compute-only driver of a branch: the open kernel module built by DKMS and the CUDA user
/// space, without the desktop stack (X driver, GL/Vulkan, nvidia-settings) a compute guest never
/// uses. NVIDIA's Driver Installation Guide (R580 and later, "compute-only" installation):
/// Debian `nvidia-driver-cuda nvidia-kernel-open-dkms`, RHEL and rebuilds `nvidia-driver-cuda
/// kmod-nvidia-open-dkms` (in the branch's module stream), Ubuntu `libnvidia-compute-<branch>
/// nvidia-dkms-<branch>-open`. The desktop metas would bring the rest: Debian's
/// `cuda-drivers-580` depends on `nvidia-driver`, `nvidia-settings` and `nvidia-xconfig` (as an
/// NVIDIA developer forum thread, "Debian cuda-drivers-580 … pulls in v590 components", quotes
/// its Depends line). Beside those: `nvidia-persistenced` on Debian (the unit the plan enables);
/// on Ubuntu `nvidia-utils-<branch>` (nvidia-smi) and `nvidia-compute-utils-<branch>`
/// (nvidia-persistenced), as public HPC cluster guides add them to the same two. From 590 on,
/// Ubuntu's names lose the branch (the guide's "Ubuntu 590 and later packages": the branch
/// designation is removed, `libnvidia-compute-580` → `libnvidia-compute`, `nvidia-dkms-580-open`
/// → `nvidia-dkms-open`), and the pinning package keeps the branch. Returns the packages and
/// the one whose version is the driver's.
fn compute_only(distro: &Distro, b: u32) -> (Vec<String>, String) {
    match distro {
        Distro::Ubuntu2204 | Distro::Ubuntu2404 => {
            let s = if b >= 590 { String::new() } else { format!("-{b}") };
            let module = format!("nvidia-dkms{s}-open");
            let v = vec![
                format!("libnvidia-compute{s}"),
                module.clone(),
                format!("nvidia-utils{s}"),
                format!("nvidia-compute-utils{s}"),
            ];
            (v, module)
        }
        Distro::Debian12 => (
            ["nvidia-driver-cuda", "nvidia-kernel-open-dkms", "nvidia-persistenced"].map(String::from).to_vec(),
            "nvidia-kernel-open-dkms".into(),
        ),
        Distro::El9(_) => {
            (["nvidia-driver-cuda", "kmod-nvidia-open-dkms"].map(String::from).to_vec(), "kmod-nvidia-open-dkms".into())
        }
    }
}

/// `nvidia-headless-no-dkms-580-server` → 580.
fn headless_branch(name: &str) -> Option<u32> {
    name.strip_prefix("nvidia-headless-no-dkms-")?.strip_suffix("-server")?.parse().ok()
}

/// The flavour of a Debian or Ubuntu kernel, what follows its version and ABI number:
/// `5.15.0-113-generic` → `generic`, `6.1.0-27-cloud-amd64` → `cloud-amd64`; EL kernels have none.
fn kernel_flavour(kernel: &str) -> Option<&str> {
    let mut parts = kernel.splitn(3, '-');
    let (_version, abi, flavour) = (parts.next()?, parts.next()?, parts.next()?);
    (abi.chars().all(|c| c.is_ascii_digit()) && !flavour.is_empty()).then_some(flavour)
}

/// The kernel packages to hold while a DKMS-built driver is installed, so an unattended upgrade
/// cannot boot the VM into a kernel the module was never built for: the running kernel's image
/// and headers and its flavour's meta packages (as Google's GPU installer locks
/// `linux-image-<release>`, `linux-headers-<release>` and the `cloud-amd64` metas on Debian).
/// EL: `dnf versionlock` of the kernel packages at their installed versions. Only packages that
/// are there or that the plan installs (`planned`) are held: apt-mark refuses a name it does not
/// know. `via_metas`: the headers come through the flavour's meta packages (Debian).
fn kernel_hold(
    distro: &Distro,
    kernel: &str,
    packages: &[Package],
    planned: &[String],
    via_metas: bool,
) -> Vec<String> {
    let there = |n: &str| packages.iter().any(|p| p.name == n) || planned.iter().any(|p| p == n);
    if distro.is_deb() {
        // Where the headers come through the flavour's metas, the held header meta keeps the
        // running ABI's headers, whichever it brings; naming them here would change the list
        // between a run that installs them and the next.
        let mut v = vec![format!("linux-image-{kernel}")];
        if !via_metas {
            v.push(format!("linux-headers-{kernel}"));
        }
        if let Some(flavour) = kernel_flavour(kernel) {
            v.extend([format!("linux-image-{flavour}"), format!("linux-headers-{flavour}")]);
        }
        v.into_iter().filter(|n| there(n)).collect()
    } else {
        let devel = planned.iter().any(|p| p.starts_with("kernel-devel"));
        ["kernel", "kernel-devel", "kernel-core", "kernel-modules"]
            .into_iter()
            .filter(|n| there(n) || (*n == "kernel-devel" && devel))
            .map(String::from)
            .collect()
    }
}

/// The plan, or why there can be none (an unsupported guest, a CUDA the branch cannot run).
/// CUDA 12.x on a driver older than the toolkit's own minimum: it runs, by minor-version
/// compatibility — any CUDA 12.x toolkit's applications run on a driver of branch 525 or later
/// (NVIDIA's CUDA Compatibility guide, "Minor Version Compatibility": CUDA 12.x ≥ 525) — and
/// what needs the newer driver does not (the same guide: PTX JIT of newer PTX, newer APIs).
fn minor_version_compatible(cuda: &str, cuda_min: &str, min_branch: u32, what: &str) -> Finding {
    Finding::warn("install.cuda-driver", format!("CUDA {cuda} asks for driver {cuda_min}; {what} runs it by minor-version compatibility"))
        .detail(format!("Applications built with any CUDA 12 run on a driver of branch 525 or later, but what needs driver {cuda_min} does not: PTX built by CUDA {cuda} cannot be JIT-compiled by an older driver, and APIs new in {cuda} are not there."))
        .remedy(format!("For all of CUDA {cuda}: driver branch {min_branch} or later (install.driver_branch, with --replace-driver for a kept driver), or cuda-compat-{} for forward compatibility", cuda.replace('.', "-")))
}

/// The packages the steps still to run will install, in order, each once: apt-get's and dnf's
/// `install` arguments, and dnf module streams installed as `@module:stream`.
fn packages_to_install(steps: &[Step]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for step in steps.iter().filter(|st| st.done.is_none()) {
        for a in &step.actions {
            let Action::Run(c) = a else { continue };
            let words: Vec<(&str, bool)> = c
                .args
                .iter()
                .map(|a| match a {
                    Arg::Lit(s) => (s.as_str(), false),
                    Arg::AtDriverVersion(p) => (p.as_str(), true),
                })
                .collect();
            // A stream enabled for a later install is enabled before the pre-flight (`plan`), not
            // resolved as `@module:stream`: that means the stream's default profiles (dnf(8),
            // "Module Command": `module install` without a profile installs the default ones;
            // without defaults dnf says "No default profiles for module"), which for NVIDIA's
            // streams is the whole desktop driver, not the compute-only set the driver step
            // installs. The real-dnf test (tests/install_el9.rs) found it.
            if dnf_module_enable(c) {
                continue;
            }
            let names: Vec<String> = match (c.program.as_str(), words.iter().position(|(w, _)| *w == "install")) {
                ("apt-get", Some(i)) => words[i + 1..].iter().map(|(w, _)| w.to_string()).collect(),
                ("dnf", Some(i)) if i > 0 && words[i - 1].0 == "module" => {
                    words[i + 1..].iter().map(|(w, _)| format!("@{w}")).collect()
                }
                ("dnf", Some(i)) => words[i + 1..].iter().map(|(w, _)| w.to_string()).collect(),
                _ => continue,
            };
            for n in names {
                if !n.starts_with('-') && !out.contains(&n) {
                    out.push(n);
                }
            }
        }
    }
    out
}

/// `dnf module enable <module:stream>`: makes the stream's packages the ones dnf sees, installs
/// nothing.
fn dnf_module_enable(c: &Cmd) -> bool {
    let words: Vec<&str> =
        c.args.iter().filter_map(|a| if let Arg::Lit(s) = a { Some(s.as_str()) } else { None }).collect();
    c.program == "dnf" && words.windows(2).any(|w| w == ["module", "enable"])
}

pub fn plan(f: &Facts, s: &Settings) -> Result<Plan, String> {
    let os = f.os.as_ref().map_err(|e| format!("cannot tell which distribution this is: {e}"))?;
    let distro = Distro::from_os(os)?;
    let kernel = f.kernel.clone().ok_or("cannot tell the running kernel's release (/proc/sys/kernel/osrelease)")?;
    let cuda = facts::major_minor(&s.cuda).filter(|c| c.starts_with("12.")).ok_or_else(|| {
        format!("install.cuda = {:?}: phq-agent installs a CUDA 12 toolkit, such as \"12.4\"", s.cuda)
    })?;
    let cuda_min = facts::cuda_min_driver(&cuda)
        .ok_or_else(|| format!("CUDA {cuda} is not in the driver table (12.0–12.6, 12.8, 12.9)"))?;
    if distro == Distro::Ubuntu2404 && facts::version_cmp(&cuda, facts::UBUNTU2404_FIRST_CUDA).is_lt() {
        return Err(format!(
            "install.cuda = {cuda:?}: NVIDIA has no CUDA {cuda} packages for Ubuntu 24.04 (its ubuntu2404 repository starts at CUDA {}); choose {} or later (the default is {})",
            facts::UBUNTU2404_FIRST_CUDA,
            facts::UBUNTU2404_FIRST_CUDA,
            facts::DEFAULT_CUDA
        ));
    }
    let b = s.driver_branch;
    let min_branch = facts::driver_branch(cuda_min).unwrap_or(0);
    // Only what cannot work is refused: below 525 no CUDA 12 runs at all. Between 525 and the
    // toolkit's own minimum it runs, with what needs the newer driver missing (a warning below).
    if b < facts::MIN_DRIVER_BRANCH {
        return Err(format!("driver branch {b} predates CUDA 12 (needs {} or later)", facts::MIN_DRIVER_BRANCH));
    }
    // Every mirror URL, whichever source of settings it came from, is checked again here: it
    // becomes a line of an apt source or a dnf repository file, written as root.
    crate::config::check_mirror_url("install.repo_url", &s.repo_url, s.allow_plain_http)?;
    crate::config::check_mirror_url("install.epel_url", &s.epel_url, s.allow_plain_http)?;
    let repo_root = if s.repo_url.is_empty() { NVIDIA_REPO_ROOT } else { s.repo_url.trim_end_matches('/') };
    let repo_base = format!("{repo_root}/{}/x86_64/", distro.repo_dir());
    let sb_on = f.secure_boot == Some(SecureBoot::Enabled);
    let mut findings = Vec::new();
    let mut steps = Vec::new();
    let packages: &[Package] = f.packages.as_deref().unwrap_or(&[]);
    let older_driver = |what: String| minor_version_compatible(&cuda, cuda_min, min_branch, &what);
    let install_dir = DOWNLOAD_DIR;
    let cuda_dash = cuda.replace('.', "-");
    let toolkit = format!("cuda-toolkit-{cuda_dash}");

    // What is installed, and whether we may touch it.
    let present = installed_driver(packages);
    let keep = present.as_ref().filter(|d| (d.branch != Some(b) || !d.open) && !s.replace_driver);
    if let Some(d) = keep {
        let flavour = if d.open { "open" } else { "proprietary" };
        findings.push(
            Finding::warn(
                "install.driver-kept",
                format!("driver {} ({flavour} modules, {}) is installed; config asks branch {b}, open modules", d.version, d.package),
            )
            .detail("An installed driver is changed only when asked: it is kept, and fabric manager and holds follow it.")
            .remedy(format!("To replace it: phq-agent install --driver-branch {b} --replace-driver (or install.replace_driver = true)")),
        );
        if let Some(kb) = d.branch {
            if kb < facts::MIN_DRIVER_BRANCH {
                findings.push(
                    Finding::fail(
                        "install.cuda-driver",
                        format!(
                            "no CUDA 12 runs on the kept driver {}: CUDA 12 needs branch {} or later",
                            d.version,
                            facts::MIN_DRIVER_BRANCH
                        ),
                    )
                    .remedy("Replace the driver (--replace-driver)"),
                );
            } else if kb < min_branch {
                findings.push(older_driver(format!("the kept driver {}", d.version)));
            }
        }
    } else if b < min_branch {
        findings.push(older_driver(format!("driver branch {b}")));
    }
    let branch_of_fm = keep.and_then(|d| d.branch).unwrap_or(b);
    // The installed driver is of another branch or flavour and is being replaced.
    let replacing_driver = keep.is_none() && present.as_ref().is_some_and(|d| d.branch != Some(b) || !d.open);

    // 0. A package manager left half-way (a killed dpkg, a failed DKMS build) is finished first.
    let half: Vec<&Package> = packages.iter().filter(|p| p.state != "installed").collect();
    if distro.is_deb() && (!half.is_empty() || f.dpkg_interrupted) {
        let what = if half.is_empty() {
            "dpkg was interrupted".to_string()
        } else {
            half.iter().map(|p| format!("{} {}", p.name, p.state)).collect::<Vec<_>>().join(", ")
        };
        steps.push(Step {
            id: "repair",
            title: format!("finish what dpkg left half-done ({what})"),
            actions: vec![Action::RepairDpkg {
                configure: Cmd { retry: Retry::DpkgLock, ..cmd("dpkg", &["--configure", "-a"]) },
                fix: apt("install", lits(&["-f".into()])),
            }],
            done: None,
            needs_reboot: true,
        });
    }

    // 1. NVIDIA's repository, trusted only once its key is the pinned one.
    steps.push(repo_step(&distro, f, s, &repo_base, install_dir));

    // 1a. Debian: the archive's contrib and non-free-firmware components, without which apt
    // cannot resolve NVIDIA's Debian packages (install/sources.rs).
    if distro == Distro::Debian12 {
        // Computed from the guest's own sources, without the file this step writes, so the file
        // always holds everything they lack (a source added later cannot make it drop another's).
        let own: Vec<(String, String)> =
            f.apt_sources.iter().filter(|(path, _)| path != DEBIAN_COMPONENTS_PATH).cloned().collect();
        match crate::install::sources::missing_components(
            &crate::install::sources::parse_all(&own),
            "bookworm",
            DEBIAN_COMPONENTS,
        ) {
            Ok(add) => {
                let written = f.apt_sources.iter().any(|(path, text)| path == DEBIAN_COMPONENTS_PATH && Some(text) == add.as_ref());
                let update = apt("update", lits(&["--error-on=any".into()]));
                steps.push(Step {
                    id: "components",
                    title: format!("enable Debian's {} components", DEBIAN_COMPONENTS.join(" and ")),
                    actions: vec![
                        Action::Write { path: DEBIAN_COMPONENTS_PATH.into(), contents: add.clone().unwrap_or_default() },
                        Action::Run(update),
                    ],
                    done: (add.is_none() || written)
                        .then(|| format!("{} are enabled", DEBIAN_COMPONENTS.join(" and "))),
                    needs_reboot: false,
                });
            }
            Err(e) => findings.push(
                Finding::warn("install.debian-components", format!("cannot add Debian's contrib and non-free-firmware components: {e}"))
                    .detail("NVIDIA's Debian packages depend on helpers in contrib (nvidia-support, glx-alternative-nvidia, nvidia-kernel-common) and the open modules' GSP firmware is in non-free-firmware; without them the pre-flight names what apt cannot install.")
                    .remedy("Add `contrib non-free-firmware` to the Components of the Debian archive's apt sources, then rerun phq-agent install"),
            ),
        }
    }

    // 1b. NVIDIA's branch lock (`nvidia-driver-pinning-<branch>`, Debian and Ubuntu from the 580
    // era on), installed before anything is resolved, as its guide advises: until it is in
    // place apt resolves the driver to the newest branch (the real-apt test found the pre-flight
    // failing on exactly that when the pin came in the same transaction). Not on Ubuntu's signed
    // path under Secure Boot: it takes branch-named packages from Ubuntu's archive.
    let ubuntu = matches!(distro, Distro::Ubuntu2204 | Distro::Ubuntu2404);
    // Ubuntu under Secure Boot takes Canonical's signed modules; everywhere else DKMS builds the
    // module (signed with DKMS's own key under Secure Boot, which is then enrolled).
    let signed_by_distro = ubuntu && sb_on;
    let pinning = (distro.is_deb() && b >= 580 && !signed_by_distro && keep.is_none())
        .then(|| format!("nvidia-driver-pinning-{b}"));
    if let Some(p) = &pinning {
        steps.push(Step {
            id: "pin",
            title: format!("keep the driver on branch {b} ({p})"),
            actions: vec![Action::Run(apt("install", lits(std::slice::from_ref(p))))],
            done: f.installed(p).then(|| format!("{p} is installed")),
            needs_reboot: false,
        });
    }

    // 2. Kernel headers: DKMS builds the modules against them. Debian's archive carries one ABI
    // of each kernel flavour, the newest: the headers of an older running kernel leave the
    // mirror at the next point release. So on Debian the flavour's meta packages are installed
    // — the newest kernel of the flavour and its headers, which DKMS builds the module for and
    // the next boot starts (Google's GPU installer installs the newest cloud-amd64 kernel and
    // its headers and reboots, for the same reason). Ubuntu's archive keeps each ABI's headers;
    // EL installs the running kernel's own devel package.
    let flavour_metas = match (&distro, kernel_flavour(&kernel)) {
        (Distro::Debian12, Some(fl)) => {
            Some((fl.to_string(), vec![format!("linux-headers-{fl}"), format!("linux-image-{fl}")]))
        }
        _ => None,
    };
    let (headers_pkgs, headers_step) = match &flavour_metas {
        Some((fl, metas)) => {
            let done = metas.iter().all(|m| f.installed(m)).then(|| format!("{} are installed", metas.join(" and ")));
            let step = Step {
                id: "headers",
                title: format!(
                    "kernel headers of the {fl} flavour: its newest kernel and headers ({})",
                    metas.join(", ")
                ),
                actions: vec![Action::Run(apt("install", lits(metas)))],
                done,
                needs_reboot: false,
            };
            (metas.clone(), step)
        }
        None => {
            let (pkgs, action) = if distro.is_deb() {
                let p = vec![format!("linux-headers-{kernel}")];
                (p.clone(), Action::Run(apt("install", lits(&p))))
            } else {
                (
                    vec![format!("kernel-devel-{kernel}"), "kernel-headers".into()],
                    Action::Run(dnf(&["install", &format!("kernel-devel-{kernel}"), "kernel-headers"])),
                )
            };
            let step = Step {
                id: "headers",
                title: format!("kernel headers for {kernel}"),
                actions: vec![action],
                done: f.headers_present.then(|| format!("/lib/modules/{kernel}/build is there")),
                needs_reboot: false,
            };
            (pkgs, step)
        }
    };
    let headers_planned: Vec<String> = if headers_step.done.is_none() { headers_pkgs } else { Vec::new() };
    steps.push(headers_step);

    // 2b. Debian and Ubuntu with a DKMS-built driver: the running kernel is held before the
    // driver is built for it, so unattended-upgrades cannot install another kernel mid-install
    // (its dpkg runs wait on the same lock, DPkg::Lock::Timeout). EL locks the kernel with the
    // other packages at the end (dnf versionlock needs its plugin installed first).
    let kernel_pkgs = if distro.is_deb() && !signed_by_distro {
        kernel_hold(&distro, &kernel, packages, &headers_planned, flavour_metas.is_some())
    } else {
        vec![]
    };
    if !kernel_pkgs.is_empty() {
        let held = kernel_pkgs.iter().all(|k| packages.iter().any(|p| &p.name == k && p.held));
        steps.push(Step {
            id: "kernel-hold",
            title: format!("hold kernel {kernel} while the driver's module is built for it"),
            actions: vec![Action::Run(on(cmd("apt-mark", &["hold"]), &kernel_pkgs))],
            done: held.then(|| format!("kernel {kernel} is held")),
            needs_reboot: false,
        });
    }

    // 3. nouveau off, in the initramfs too.
    // Every installed kernel's initramfs, not only the running one's: a newer kernel booted
    // later must not bring nouveau back (update-initramfs(8): `-k all`; dracut(8):
    // `--regenerate-all`).
    let initramfs = if distro.is_deb() {
        cmd("update-initramfs", &["-u", "-k", "all"])
    } else {
        cmd("dracut", &["--force", "--regenerate-all"])
    };
    steps.push(Step {
        id: "nouveau",
        title: "blacklist nouveau and rebuild the initramfs".into(),
        actions: vec![
            Action::Write { path: NOUVEAU_CONF.into(), contents: NOUVEAU_CONF_TEXT.into() },
            Action::Run(initramfs),
        ],
        done: f.nouveau_off.then(|| "nouveau is blacklisted with modeset=0".into()),
        needs_reboot: f.nouveau_loaded,
    });

    // 4–6. Driver, persistence daemon, fabric manager.
    let (driver_pkgs, driver_package): (Vec<String>, String) = match &distro {
        _ if keep.is_some() => (Vec::new(), keep.map(|d| d.package.clone()).unwrap_or_default()),
        // Canonical-signed precompiled modules, as NVIDIA's precompiled driver container
        // installs them (gpu-driver-container, ubuntu22.04/precompiled): the module for this
        // kernel and its signature, the flavour's meta package so each new kernel brings its
        // module, and user space without DKMS or the desktop stack.
        Distro::Ubuntu2204 | Distro::Ubuntu2404 if sb_on => {
            let mut v = vec![
                format!("nvidia-headless-no-dkms-{b}-server"),
                format!("nvidia-utils-{b}-server"),
                format!("linux-signatures-nvidia-{kernel}"),
                format!("linux-modules-nvidia-{b}-server-open-{kernel}"),
            ];
            if let Some(flavour) = kernel_flavour(&kernel) {
                v.push(format!("linux-modules-nvidia-{b}-server-open-{flavour}"));
            }
            (v, format!("nvidia-headless-no-dkms-{b}-server"))
        }
        _ => compute_only(&distro, b),
    };
    // A driver already at the branch, open flavour, is the one to hold and to match.
    let matching = present.as_ref().filter(|d| d.branch == Some(b) && d.open);
    let (driver_pkgs, driver_package) = match matching {
        Some(d) => {
            let mut v: Vec<String> = vec![d.package.clone()];
            v.extend(driver_pkgs.into_iter().filter(|p| *p != d.package));
            (v, d.package.clone())
        }
        None => (driver_pkgs, driver_package),
    };
    // Secure Boot without a distribution-signed build (Debian, EL): DKMS signs the module with
    // its own key, which the firmware trusts once a person confirms its enrolment at the console
    // (the dkms README, "Secure Boot": `mokutil --import`, reboot, "Enroll MOK" in shim's MOK
    // manager). The install queues the enrolment; the boot-safety gate stops short of the
    // reboot until it is confirmed, and says how. On EL9 NVIDIA's precompiled module streams
    // (`latest`, `<branch>`: `kmod-nvidia-<driver>-<kernel>`) are the proprietary flavour; the
    // open modules come only as DKMS streams (`<branch>-open`: `kmod-nvidia-open-dkms`), as
    // NVIDIA's yum-packaging-dkms-nvidia README lists them, so this is the path there too.
    let dkms_under_sb = sb_on && !signed_by_distro && keep.is_none();
    if dkms_under_sb {
        findings.push(
            Finding::warn(
                "install.secure-boot",
                "Secure Boot is on: DKMS signs the driver's module with its own key, which the firmware trusts only once it is enrolled",
            )
            .detail(format!(
                "{} has no NVIDIA modules signed by a key its shim already trusts. The install queues DKMS's key ({DKMS_MOK}) \
                 for enrolment with a one-time password; a person confirms it once, at the VM console, in the MOK manager \
                 that starts on the next boot.",
                distro.name()
            ))
            .remedy(format!(
                "When the install stops at the reboot: read the password (sudo cat {DOWNLOAD_DIR}/{MOK_PASSWORD_FILE}), open \
                 the VM's console (virtctl vnc), reboot, choose Enroll MOK → Continue → Yes, type the password, reboot; the \
                 install resumes. Or turn Secure Boot off for this VM (KubeVirt: \
                 spec.domain.firmware.bootloader.efi.secureBoot: false)."
            )),
        );
    }
    if keep.is_none() {
        let replacing = present.as_ref().filter(|d| d.branch != Some(b) || !d.open);
        let mut actions = Vec::new();
        if let Some(old) = replacing {
            let old_pkgs: Vec<String> = packages
                .iter()
                .filter(|p| {
                    p.name == old.package
                        || (p.name.starts_with("nvidia-fabricmanager")
                            || p.name.starts_with("libnvidia-nscq")
                            || p.name.starts_with("nvidia-fabric-manager"))
                })
                .map(|p| p.name.clone())
                .collect();
            if distro.is_deb() {
                actions.push(Action::Run(on(cmd("apt-mark", &["unhold"]), &old_pkgs)));
                actions.push(Action::Run(apt("purge", lits(&old_pkgs))));
            } else {
                // The old branch's version locks go, then the module moves to the new stream,
                // erasing what only the old stream allowed (dnf module switch-to, DNF's
                // modularity documentation). Every NVIDIA lock goes, not only the driver's and
                // fabric manager's: real dnf left `nvidia-driver-cuda`'s 580 lock behind after
                // a switch to 590 (tests/install_el9.rs). Only locks that are there: a run
                // killed after the delete finds none and goes on to the switch.
                let locked: Vec<String> = packages
                    .iter()
                    .filter(|p| p.held && ["nvidia", "kmod-nvidia", "libnvidia"].iter().any(|n| p.name.starts_with(n)))
                    .map(|p| p.name.clone())
                    .collect();
                if !locked.is_empty() {
                    actions.push(Action::Run(on(cmd("dnf", &["versionlock", "delete"]), &locked)));
                }
                actions.push(Action::Run(dnf(&[
                    "module",
                    "switch-to",
                    &format!("nvidia-driver:{b}-open"),
                    "--allowerasing",
                ])));
            }
        }
        // EL: rpm records a package before its %post runs (rpm's install order: files, database,
        // then %post), and the DKMS build is in kmod-nvidia-open-dkms's %post (NVIDIA's
        // yum-packaging-dkms-nvidia spec: `dkms add`, `dkms build`, `dkms install`). A %post
        // killed or failed (headers missing) leaves the package installed without a module,
        // which `dnf install` then calls done; `dnf reinstall` runs the %post again (dnf(8):
        // reinstall). Debian's dpkg keeps such a package half-configured instead (the repair
        // step). The real-dnf test's kill inside the %post found it.
        let unbuilt = matching.filter(|d| !distro.is_deb() && f.installed(&d.package) && !f.nvidia_module_built);
        match &distro {
            _ if unbuilt.is_some() => {
                actions.push(Action::Run(dnf(&["reinstall", &driver_package])));
            }
            // NVIDIA's own branch lock is in place from the pin step.
            _ if pinning.is_some() => actions.push(Action::Run(apt("install", lits(&driver_pkgs)))),
            Distro::Debian12 => {
                actions.push(Action::Write { path: DEBIAN_PIN_PATH.into(), contents: debian_pin(b) });
                actions.push(Action::Run(apt("install", lits(&driver_pkgs))));
            }
            // NVIDIA's Driver Installation Guide (R620 edition, "Open GPU Kernel Modules
            // Installation", a specific branch on RHEL 9 and its rebuilds): enable the branch's
            // open stream, then install its packages — the compute-only set, not `nvidia-open`.
            Distro::El9(_) => {
                if replacing.is_none() {
                    actions.push(Action::Run(dnf(&["module", "enable", &format!("nvidia-driver:{b}-open")])));
                }
                actions.push(Action::Run(on(dnf(&["install"]), &driver_pkgs)));
            }
            _ => actions.push(Action::Run(apt("install", lits(&driver_pkgs)))),
        }
        let done = present
            .as_ref()
            .filter(|d| d.branch == Some(b) && d.open && f.installed(&d.package))
            .filter(|_| unbuilt.is_none())
            .filter(|_| {
                pinning.is_some() || !matches!(distro, Distro::Debian12) || f.file_is(DEBIAN_PIN_PATH, &debian_pin(b))
            })
            .map(|d| format!("{} {} is installed", d.package, d.version));
        let title = match (&distro, sb_on) {
            (Distro::Ubuntu2204 | Distro::Ubuntu2404, true) => {
                format!("driver {b} with open kernel modules, Ubuntu's signed build for {kernel} (Secure Boot is on)")
            }
            _ => format!("driver {b} with open kernel modules"),
        };
        steps.push(Step { id: "driver", title, actions, done, needs_reboot: true });
    }
    if dkms_under_sb {
        let mokutil =
            if distro.is_deb() { apt("install", lits(&["mokutil".into()])) } else { dnf(&["install", "mokutil"]) };
        steps.push(Step {
            id: "mok",
            title: format!("queue DKMS's signing key ({DKMS_MOK}) for enrolment, so Secure Boot trusts the module"),
            actions: vec![Action::Run(mokutil), Action::EnrollMok { key: DKMS_MOK.into() }],
            // Under Secure Boot the kernel loads only modules whose signer the firmware or the
            // MOK list trusts (kernel lockdown), so a loaded nvidia module proves the key is in.
            done: f
                .nvidia_loaded
                .as_ref()
                .map(|v| format!("nvidia {v} is loaded under Secure Boot, so its signing key is trusted")),
            needs_reboot: false,
        });
    }

    steps.push(Step {
        id: "persistenced",
        title: "enable nvidia-persistenced".into(),
        actions: vec![Action::Run(cmd("systemctl", &["enable", "nvidia-persistenced.service"]))],
        done: f.unit_enabled("nvidia-persistenced.service").then(|| "nvidia-persistenced is enabled".into()),
        needs_reboot: false,
    });

    let (fm, nscq) = fabric_manager_names(&distro, branch_of_fm);
    let fm_installed = f.package(&fm);
    if f.nvswitches > 0 {
        let driver_version = keep.map(|d| d.version.clone()).or_else(|| present.as_ref().map(|d| d.version.clone()));
        let fm_matches = fm_installed.is_some_and(|p| {
            p.state == "installed"
                && driver_version.as_deref() == Some(crate::collect::packages::upstream_version(&p.version))
        });
        let mut install = if distro.is_deb() { apt("install", Vec::new()) } else { dnf(&["install"]) };
        install.args.push(Arg::AtDriverVersion(fm.clone()));
        install.args.push(Arg::AtDriverVersion(nscq.clone()));
        steps.push(Step {
            id: "fabricmanager",
            title: format!(
                "{fm} at exactly the driver's version, enabled ({} NVSwitch{} visible)",
                f.nvswitches,
                if f.nvswitches == 1 { "" } else { "es" }
            ),
            actions: vec![
                Action::Run(install),
                Action::Run(cmd("systemctl", &["enable", "nvidia-fabricmanager.service"])),
            ],
            // A driver being replaced takes its fabric manager's match with it.
            done: (fm_matches && !replacing_driver && f.unit_enabled("nvidia-fabricmanager.service"))
                .then(|| format!("{fm} matches the driver and is enabled")),
            needs_reboot: false,
        });
    } else if f.nvswitches == 0 && f.unit_enabled("nvidia-fabricmanager.service") {
        steps.push(Step {
            id: "fabricmanager-off",
            title: "disable nvidia-fabricmanager: this VM sees no NVSwitch, so it can only fail".into(),
            actions: vec![Action::Run(cmd("systemctl", &["disable", "nvidia-fabricmanager.service"]))],
            done: None,
            needs_reboot: false,
        });
    }

    // 7. The toolkit, unless no CUDA 12 can run on the driver that stays.
    if !findings.iter().any(|x| x.id == "install.cuda-driver" && x.severity == crate::checks::Severity::Fail) {
        let action = if distro.is_deb() {
            apt("install", lits(std::slice::from_ref(&toolkit)))
        } else {
            dnf(&["install", &toolkit])
        };
        steps.push(Step {
            id: "toolkit",
            title: format!("CUDA {cuda} toolkit ({toolkit}, needs driver ≥ {cuda_min})"),
            actions: vec![Action::Run(action)],
            done: f.installed(&toolkit).then(|| format!("{toolkit} is installed")),
            needs_reboot: false,
        });
        // 7b. NCCL built for that toolkit's CUDA, for the all-reduce probe.
        steps.push(nccl_step(&distro, f, &cuda));
    }

    // 8. Holds, so an unattended upgrade cannot split driver, fabric manager and toolkit.
    let mut hold: Vec<String> = Vec::new();
    if distro.is_deb() {
        // Not the per-kernel module packages: a new kernel brings its own through the meta.
        hold.extend(
            driver_pkgs
                .iter()
                .filter(|p| !p.starts_with("linux-modules-") && !p.starts_with("linux-signatures-"))
                .cloned(),
        );
        if let Some(d) = keep {
            hold.push(d.package.clone());
        }
    } else {
        hold.extend(driver_pkgs.iter().cloned());
        if let Some(d) = keep {
            hold.push(d.package.clone());
        }
    }
    if f.nvswitches > 0 {
        hold.extend([fm.clone(), nscq.clone()]);
    }
    // A DKMS module is built for the kernels present when it is installed (Debian and Ubuntu
    // hold the kernel in their own step, before the driver); Ubuntu's signed path instead
    // brings each new kernel's module through the flavour's meta package.
    if !distro.is_deb() {
        hold.extend(kernel_hold(&distro, &kernel, packages, &headers_planned, flavour_metas.is_some()));
    }
    if steps.iter().any(|s| s.id == "toolkit") {
        hold.push(toolkit.clone());
    }
    if !hold.is_empty() {
        let all_held =
            f.packages.as_ref().is_ok_and(|ps| hold.iter().all(|h| ps.iter().any(|p| &p.name == h && p.held)));
        let actions = if distro.is_deb() {
            vec![Action::Run(on(cmd("apt-mark", &["hold"]), &hold))]
        } else {
            vec![
                Action::Run(dnf(&["install", "python3-dnf-plugin-versionlock"])),
                Action::Run(on(cmd("dnf", &["versionlock", "add"]), &hold)),
            ]
        };
        steps.push(Step {
            id: "hold",
            title: format!("hold versions: {}", hold.join(", ")),
            actions,
            // After a driver is replaced its holds are the old versions' (or gone): hold again.
            done: (all_held && !replacing_driver).then(|| "all held".into()),
            needs_reboot: false,
        });
    }

    // 9–10. Reboot when needed, then verify with the doctor's checks.
    let reboot_reason = match (&present, &f.nvidia_loaded) {
        _ if f.gpus == 0 => None,
        (Some(d), Some(loaded)) if keep.is_some() || d.branch == Some(b) => {
            (crate::collect::packages::upstream_version(loaded) != d.version)
                .then(|| format!("driver {} is installed but {loaded} is loaded", d.version))
        }
        (Some(d), None) => Some(format!("driver {} is installed but not loaded", d.version)),
        _ => None,
    };
    let pending_reboot = steps.iter().any(|s| s.done.is_none() && s.needs_reboot);
    steps.push(Step {
        id: "reboot",
        title: "reboot if a step needs it".into(),
        actions: vec![Action::Reboot],
        done: (!pending_reboot && reboot_reason.is_none())
            .then(|| "no step changes the modules or the initramfs, and the loaded driver is the installed one".into()),
        needs_reboot: false,
    });
    steps.push(Step {
        id: "verify",
        title: "verify with the doctor's checks".into(),
        actions: vec![Action::Verify],
        done: None,
        needs_reboot: false,
    });

    let gpus = match (f.gpus, f.nvswitches) {
        (0, _) => "no GPU seen".to_string(),
        (g, 0) => format!("{g} GPU{}, no NVSwitch", if g == 1 { "" } else { "s" }),
        (g, n) => format!("{g} GPU{}, {n} NVSwitch{}", if g == 1 { "" } else { "s" }, if n == 1 { "" } else { "es" }),
    };
    let sb = match f.secure_boot {
        Some(SecureBoot::Enabled) => "Secure Boot on",
        Some(SecureBoot::Disabled) => "Secure Boot off",
        Some(SecureBoot::NotEfi) => "BIOS boot (no Secure Boot)",
        Some(SecureBoot::Unsupported) => "UEFI without Secure Boot",
        None => "Secure Boot unknown",
    };
    let summary =
        format!("{}, kernel {kernel}, {gpus}, {sb} → driver {b} (open kernel modules), CUDA {cuda}", distro.name());
    if f.gpus == 0 {
        findings.push(
            Finding::warn(
                "install.no-gpu",
                "no NVIDIA GPU is visible: the driver is installed, but nothing will use it yet",
            )
            .remedy("Check the VM spec's gpus[] / hostDevices, then run phq-agent doctor"),
        );
    }
    if let Err(e) = &f.packages {
        findings.push(Finding::unknown(
            "install.packages",
            format!("installed packages unknown ({e}): every package step runs"),
        ));
    }
    // Pre-flight, right after the repository (nothing can be resolved before it): every package
    // the remaining steps install, resolved at once, so a name the repositories do not have
    // stops the install before the first package changes, not half-way through it.
    let at = steps.iter().rposition(|st| st.id == "pin" || st.id == "repo").map_or(0, |i| i + 1);
    let wanted = packages_to_install(&steps[at..]);
    if !wanted.is_empty() {
        // apt resolves as it will install only with the branch pin in place (without it,
        // a newer branch's kernel module is the candidate and the branch's meta package
        // conflicts with it), so the pin the driver step writes is written first here.
        // dnf likewise resolves the driver's packages only once the branch's module stream is
        // enabled (NVIDIA's Driver Installation Guide for RHEL 9: `dnf module enable
        // nvidia-driver:<branch>-open`, then `dnf install`): enabling installs nothing, and the
        // driver step's own `module enable` then finds it done.
        let pin = steps[at..].iter().flat_map(|st| &st.actions).find(|a| {
            matches!(a, Action::Write { path, .. } if path == DEBIAN_PIN_PATH)
                || matches!(a, Action::Run(c) if dnf_module_enable(c))
        });
        let mut actions: Vec<Action> = pin.cloned().into_iter().collect();
        actions.push(Action::Resolve(wanted.clone()));
        steps.insert(
            at,
            Step {
                id: "preflight",
                title: format!("resolve all {} packages before installing any", wanted.len()),
                actions,
                done: None,
                needs_reboot: false,
            },
        );
    }
    Ok(Plan {
        distro,
        kernel,
        summary,
        repo_base,
        driver_package: (!driver_package.is_empty()).then_some(driver_package),
        steps,
        findings,
        reboot_reason,
        boot_check: (f.gpus > 0).then_some(BootCheck { secure_boot: sb_on }),
    })
}

/// NCCL's runtime built for the toolkit's CUDA (`nccl_package`), installed and held.
///
/// Only on a guest that sees two GPUs or more: NCCL is here for the all-reduce probe
/// (`probe.allreduce`), which needs two ranks at least; with one GPU (or none) the step says
/// NCCL is not needed and does nothing. A VM given more GPUs later gets it from the next
/// `phq-agent install`.
///
/// The version is chosen when the step runs (`Action::InstallForCuda`), so the package is held
/// here, once it is installed, and not in the hold step: when the repository has no build for
/// this CUDA nothing is installed, and holding a package that is not installed would lock
/// builds it never chose (`dnf versionlock add` of a name with nothing installed locks what the
/// repositories have) or mark an absent package (apt-mark).
fn nccl_step(distro: &Distro, f: &Facts, cuda: &str) -> Step {
    let pkg = nccl_package(distro);
    if f.gpus < 2 {
        let seen = if f.gpus == 1 { "1 GPU is visible" } else { "no GPU is visible" };
        return Step {
            id: "nccl",
            title: format!("NCCL ({pkg}): not needed, {seen}"),
            actions: Vec::new(),
            done: Some(format!("NCCL serves the all-reduce probe, which needs 2 GPUs or more; {seen}")),
            needs_reboot: false,
        };
    }
    let deb = distro.is_deb();
    let installed = f.package(pkg).filter(|p| p.state == "installed");
    let matching = installed.filter(|p| built_for_cuda(&p.version) == Some(cuda));
    let other = installed.filter(|_| matching.is_none());
    let mut actions = Vec::new();
    // Another CUDA's build held by an earlier install (another install.cuda): its hold goes
    // first, or apt refuses to change a held package and dnf's version lock hides every other
    // build of it.
    if other.is_some_and(|p| p.held) {
        let names = [pkg.to_string()];
        actions.push(Action::Run(if deb {
            on(cmd("apt-mark", &["unhold"]), &names)
        } else {
            on(cmd("dnf", &["versionlock", "delete"]), &names)
        }));
    }
    let (query, install) = if deb {
        // A newer build for another CUDA in its place (CUDA 13's, say): apt-get -y moves down
        // to this CUDA's only when allowed to ("Packages were downgraded and -y was used
        // without --allow-downgrades").
        let allow: Vec<String> = other.map(|_| "--allow-downgrades".to_string()).into_iter().collect();
        (cmd("apt-cache", &["madison", pkg]), apt("install", lits(&allow)))
    } else {
        // dnf installs the exact version asked for whichever one is installed, and removes
        // that one (dnf(8), "Install Command"). repoquery lists every build, version locks
        // notwithstanding (the versionlock plugin's documentation: no excludes outside
        // transactions).
        (dnf(&["repoquery", "--available", "--qf", "%{version}-%{release}", pkg]), dnf(&["install"]))
    };
    actions.push(Action::InstallForCuda { package: pkg.into(), cuda: cuda.into(), query, install });
    let names = [pkg.to_string()];
    if deb {
        actions.push(Action::Run(on(cmd("apt-mark", &["hold"]), &names)));
    } else {
        actions.push(Action::Run(dnf(&["install", "python3-dnf-plugin-versionlock"])));
        actions.push(Action::Run(on(cmd("dnf", &["versionlock", "add"]), &names)));
    }
    let title = match other {
        Some(p) => format!(
            "NCCL built for CUDA {cuda} ({pkg}), held, in place of {} (built for {}): the all-reduce probe loads libnccl.so.2 ({} GPUs)",
            p.version,
            built_for_cuda(&p.version).map(|c| format!("CUDA {c}")).unwrap_or_else(|| "no CUDA it names".into()),
            f.gpus
        ),
        None => format!(
            "NCCL built for CUDA {cuda} ({pkg}), held: the all-reduce probe loads libnccl.so.2 ({} GPUs)",
            f.gpus
        ),
    };
    Step {
        id: "nccl",
        title,
        actions,
        done: matching
            .filter(|p| p.held)
            .map(|p| format!("{pkg} {} (built for CUDA {cuda}) is installed and held", p.version)),
        needs_reboot: false,
    }
}

fn repo_step(distro: &Distro, f: &Facts, s: &Settings, base: &str, install_dir: &str) -> Step {
    if distro.is_deb() {
        let fpr = if s.key_fingerprint.is_empty() { facts::NVIDIA_REPO_KEY_FINGERPRINT } else { &s.key_fingerprint };
        let deb = format!("{install_dir}/{CUDA_KEYRING_DEB}");
        let source = apt_source(base);
        let mut update = apt("update", lits(&["--error-on=any".into()]));
        update.url = Some(base.into());
        // NVIDIA publishes its Debian/Ubuntu key inside `cuda-keyring`; the key alone is taken
        // from it, checked, and written by us, with the source line, as Debian's guidance for
        // third-party repositories has it. The package is never handed to dpkg.
        let actions = vec![
            Action::Fetch { url: format!("{base}{CUDA_KEYRING_DEB}"), to: deb.clone() },
            Action::InstallKey {
                file: deb,
                deb_member: Some(CUDA_KEYRING_MEMBER.into()),
                fingerprint: fpr.into(),
                to: NVIDIA_APT_KEYRING.into(),
                armored: false,
            },
            Action::Write { path: distro.apt_source_path(), contents: source.clone() },
            Action::Run(update),
        ];
        // The index must be there too: a run killed during `apt-get update` left the key and
        // the source in place but nothing to install from.
        let index = apt_list_prefix(base);
        let fetched = f.apt_lists.iter().any(|n| n.starts_with(&index) && n.contains("Packages"));
        let done = (f.key_is(NVIDIA_APT_KEYRING, fpr) && fetched && f.file_is(&distro.apt_source_path(), &source))
            .then(|| "the pinned key, its source and the fetched index are in place".into());
        Step {
            id: "repo",
            title: format!("NVIDIA repository {base}, key {}", crate::install::pgp::spaced(fpr)),
            actions,
            done,
            needs_reboot: false,
        }
    } else {
        let key = format!("{install_dir}/{RHEL_KEY_FILE}");
        let Distro::El9(id) = distro else { unreachable!("is_deb() is false only for El9") };
        // EPEL (DKMS) and CRB (what EPEL's packages build against). Rocky and Alma: both from
        // their own signed repositories (`epel-release` in extras, the `crb` repository id).
        // RHEL: the release package comes by URL, which dnf installs unchecked unless told
        // (dnf.conf(5): `localpkg_gpgcheck`, default off), so EPEL's key is pinned by its whole
        // fingerprint, imported, and the package checked against it.
        let mut epel_crb = Vec::new();
        if id == "rhel" {
            let root = if s.epel_url.is_empty() { EPEL_ROOT } else { s.epel_url.trim_end_matches('/') };
            let epel_key = format!("{install_dir}/{EPEL_KEY_FILE}");
            let epel_fpr =
                if s.epel_key_fingerprint.is_empty() { facts::EPEL9_KEY_FINGERPRINT } else { &s.epel_key_fingerprint };
            let epel_rpm = format!("{install_dir}/{EPEL_RELEASE_FILE}");
            epel_crb.extend([
                Action::Fetch { url: format!("{root}/{EPEL_KEY_FILE}"), to: epel_key.clone() },
                Action::InstallKey {
                    file: epel_key,
                    deb_member: None,
                    fingerprint: epel_fpr.into(),
                    to: EPEL_KEY_PATH.into(),
                    armored: true,
                },
                Action::Run(cmd("rpm", &["--import", EPEL_KEY_PATH])),
                Action::Fetch { url: format!("{root}/{EPEL_RELEASE_FILE}"), to: epel_rpm.clone() },
                Action::Run(dnf(&["install", "--setopt=localpkg_gpgcheck=1", &epel_rpm])),
                Action::EnableCrb,
            ]);
        } else {
            epel_crb.extend([
                Action::Run(dnf(&["install", "epel-release"])),
                Action::Run(cmd("dnf", &["config-manager", "--set-enabled", "crb"])),
            ]);
        }
        let fpr =
            if s.key_fingerprint.is_empty() { facts::NVIDIA_RHEL_REPO_KEY_FINGERPRINT } else { &s.key_fingerprint };
        let repo = rhel_repo(base);
        let mut makecache = dnf(&["makecache"]);
        makecache.url = Some(base.into());
        Step {
            id: "repo",
            title: format!(
                "NVIDIA repository {base} (with EPEL and CRB for DKMS), key {}",
                crate::install::pgp::spaced(fpr)
            ),
            actions: [
                vec![Action::Run(dnf(&["install", "dnf-plugins-core"]))],
                epel_crb,
                vec![
                    Action::Fetch { url: format!("{base}{RHEL_KEY_FILE}"), to: key.clone() },
                    Action::InstallKey {
                        file: key,
                        deb_member: None,
                        fingerprint: fpr.into(),
                        to: RHEL_KEY_PATH.into(),
                        armored: true,
                    },
                    Action::Run(cmd("rpm", &["--import", RHEL_KEY_PATH])),
                    Action::Write { path: RHEL_REPO_PATH.into(), contents: repo.clone() },
                    Action::Run(makecache),
                ],
            ]
            .concat(),
            done: (f.file_is(RHEL_REPO_PATH, &repo) && f.key_is(RHEL_KEY_PATH, fpr))
                .then(|| format!("{RHEL_REPO_PATH} and the pinned key are in place")),
            needs_reboot: false,
        }
    }
}

/// How apt names the index files of a repository in /var/lib/apt/lists (`URItoFileName`): the
/// URI without its scheme, `_` percent-quoted, `/` turned into `_`.
pub fn apt_list_prefix(base: &str) -> String {
    let rest = base.split_once("://").map(|(_, r)| r).unwrap_or(base);
    let mut out = String::new();
    for c in rest.trim_end_matches('/').chars() {
        match c {
            '_' => out.push_str("%5f"),
            '/' => out.push('_'),
            c => out.push(c),
        }
    }
    out.push('_');
    out
}

pub fn apt_source(base: &str) -> String {
    format!("# Written by phq-agent install.\ndeb [signed-by={NVIDIA_APT_KEYRING}] {base} /\n")
}

fn rhel_repo(base: &str) -> String {
    format!(
        "# Written by phq-agent install.\n[cuda-rhel9-x86_64]\nname=cuda-rhel9-x86_64\nbaseurl={base}\nenabled=1\ngpgcheck=1\ngpgkey=file://{RHEL_KEY_PATH}\n"
    )
}

/// Debian's `cuda-drivers` meta package would take the newest branch; this keeps every NVIDIA
/// driver package on the configured one.
fn debian_pin(b: u32) -> String {
    format!(
        "# Written by phq-agent install: keep the NVIDIA driver on branch {b}.\nPackage: nvidia-* libnvidia-* libcuda* libxnvctrl* cuda-drivers* firmware-nvidia-*\nPin: version {b}.*\nPin-Priority: 1000\n"
    )
}

/// Fabric manager and NSCQ package names: branch-suffixed below 580 on Debian/Ubuntu.
pub fn fabric_manager_names(distro: &Distro, branch: u32) -> (String, String) {
    match (distro.is_deb(), branch >= 580) {
        (true, false) => (format!("nvidia-fabricmanager-{branch}"), format!("libnvidia-nscq-{branch}")),
        (true, true) => ("nvidia-fabricmanager".into(), "libnvidia-nscq".into()),
        // EL: NVIDIA dropped the hyphen from 580 on (`nvidia-fabricmanager`), as its own
        // precompiled driver container for RHEL 9 and Azure's HPC images install it.
        (false, false) => ("nvidia-fabric-manager".into(), format!("libnvidia-nscq-{branch}")),
        (false, true) => ("nvidia-fabricmanager".into(), "libnvidia-nscq".into()),
    }
}

/// NCCL's runtime package in NVIDIA's CUDA repository, whose builds carry the CUDA release they
/// were built for at the end of their version (`2.27.3-1+cuda12.9`): `libnccl2` on Debian and
/// Ubuntu (NVIDIA's NCCL Installation Guide, docs.nvidia.com/deeplearning/nccl/install-guide,
/// "Ubuntu": `sudo apt install libnccl2=2.x.y-1+cudaX.Y libnccl-dev=2.x.y-1+cudaX.Y`), `libnccl`
/// on RHEL 9 and its rebuilds (the same guide, "RHEL/CentOS": `sudo yum install
/// libnccl-2.x.y-1+cudaX.Y libnccl-devel-2.x.y-1+cudaX.Y …`; NVIDIA's CUDA container images
/// install `libnccl-2.27.3-1+cuda12.9` from the rhel9 repository). Only the runtime: the
/// all-reduce probe loads `libnccl.so.2` at run time and builds nothing against NCCL's headers,
/// which are what `libnccl-dev` / `libnccl-devel` add.
pub fn nccl_package(distro: &Distro) -> &'static str {
    if distro.is_deb() {
        "libnccl2"
    } else {
        "libnccl"
    }
}

/// The CUDA release a build of NCCL was made for, from its version: `2.27.3-1+cuda12.9` →
/// `12.9` (apt's `version` and dnf's `version-release` end alike). None without the suffix.
pub fn built_for_cuda(version: &str) -> Option<&str> {
    version.rsplit_once("+cuda").map(|(_, c)| c).filter(|c| !c.is_empty())
}

/// The newest of `versions` built for exactly `cuda` (`12.9` takes `+cuda12.9`, never
/// `+cuda12.90` or `+cuda12`): NCCL's own version first (`2.27.3`), then the package revision.
pub fn newest_for_cuda<'a>(versions: &'a [String], cuda: &str) -> Option<&'a String> {
    fn key(v: &str) -> (&str, &str) {
        let v = v.split_once(':').map(|(_, r)| r).unwrap_or(v);
        let v = v.rsplit_once("+cuda").map(|(head, _)| head).unwrap_or(v);
        v.split_once('-').unwrap_or((v, ""))
    }
    versions.iter().filter(|v| built_for_cuda(v) == Some(cuda)).max_by(|a, b| {
        let ((ua, ra), (ub, rb)) = (key(a), key(b));
        facts::version_cmp(ua, ub).then_with(|| facts::version_cmp(ra, rb))
    })
}

/// A command as a person would type it: arguments quoted where a shell would need it.
pub fn render_cmd(c: &Cmd, is_deb: bool) -> String {
    let mut parts: Vec<String> = c.env.iter().map(|(k, v)| format!("{k}={}", quote(v))).collect();
    parts.push(quote(&c.program));
    for a in &c.args {
        parts.push(match a {
            Arg::Lit(s) => quote(s),
            Arg::AtDriverVersion(p) if is_deb => format!("{p}=<driver version>"),
            Arg::AtDriverVersion(p) => format!("{p}-<driver version>"),
        });
    }
    parts.join(" ")
}

fn quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=+,@%<>".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// One line per thing an action does; what `--dry-run` prints and the journal hashes.
pub fn render_action(a: &Action, is_deb: bool) -> Vec<String> {
    match a {
        Action::Run(c) => vec![format!("$ {}", render_cmd(c, is_deb))],
        Action::RepairDpkg { configure, fix } => vec![
            "remove any package whose unpacking was killed (dpkg --remove --force-remove-reinstreq), for its step to install again".into(),
            format!("$ {}", render_cmd(configure, is_deb)),
            format!("$ {}", render_cmd(fix, is_deb)),
        ],
        Action::Write { path, contents } => {
            let mut v = vec![format!("write {path}:")];
            v.extend(contents.lines().map(|l| format!("    | {l}")));
            v
        }
        Action::Fetch { url, to } => vec![format!("fetch {url} → {to}")],
        Action::InstallKey { file, deb_member, fingerprint, to, armored } => {
            let from = match deb_member {
                Some(m) => format!("{m} inside {file} (only that file; the package is not installed)"),
                None => file.clone(),
            };
            vec![format!(
                "verify that {from} is key {} and nothing else, then write the verified key{} to {to}",
                crate::install::pgp::spaced(fingerprint),
                if *armored { ", armored," } else { "" }
            )]
        }
        Action::Resolve(pkgs) if is_deb => vec![format!("$ apt-get -s -q install {} (resolve only; stop with what cannot be installed)", pkgs.join(" "))],
        Action::Resolve(pkgs) => vec![format!("$ dnf -q install --assumeno {} (resolve only; stop with what cannot be installed)", pkgs.join(" "))],
        Action::Reboot => vec!["reboot through logind (systemctl reboot if logind is not there) when a finished step needs it; with --reboot never, report that one is needed".into()],
        Action::Verify => vec!["collect a snapshot and run the doctor's driver, GPU, NVML and CUDA checks".into()],
        Action::EnableCrb => vec![
            "$ dnf -q repolist --all (find the CodeReady Builder repository that matches the enabled BaseOS: Red Hat CDN, EUS or a cloud's RHUI)".into(),
            "$ subscription-manager repos --enable <that id> if subscription-manager defines it (redhat.repo), else dnf config-manager --set-enabled <that id>".into(),
        ],
        Action::EnrollMok { key } => vec![
            format!("$ mokutil --test-key {key} (nothing more if it is enrolled or already queued)"),
            format!("$ mokutil --import {key} (a one-time password on stdin, kept in {DOWNLOAD_DIR}/{MOK_PASSWORD_FILE}, root-only)"),
        ],
        Action::InstallForCuda { package, cuda, query, install } => vec![
            format!("$ {} (the repository's builds of {package}: the newest whose version ends +cuda{cuda} is installed; none: nothing is, the rest of this step is skipped, and a warning says why)", render_cmd(query, is_deb)),
            format!("$ {} {package}{}<its newest +cuda{cuda} build>", render_cmd(install, is_deb), if is_deb { "=" } else { "-" }),
        ],
    }
}

impl Step {
    /// Identifies what the step does; a journal entry counts only for the same hash.
    pub fn hash(&self, is_deb: bool) -> String {
        let mut h = sha1_smol::Sha1::new();
        for a in &self.actions {
            for l in render_action(a, is_deb) {
                h.update(l.as_bytes());
                h.update(b"\n");
            }
        }
        h.digest().to_string()[..16].to_string()
    }
}

/// The plan as a person reads it: every command it would run, and what is already done.
pub fn render(p: &Plan) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "phq-agent install — plan for {}", p.summary);
    let _ = writeln!(out, "repository: {}", p.repo_base);
    if let Some(r) = &p.reboot_reason {
        let _ = writeln!(out, "reboot: {r}");
    }
    let _ = writeln!(out);
    let n = p.steps.len();
    for (i, s) in p.steps.iter().enumerate() {
        let _ = writeln!(out, "{:>2}/{n} {} — {}", i + 1, s.id, s.title);
        match &s.done {
            // A step with nothing to do on this guest (NCCL on one GPU) is not needed either.
            Some(why) if s.id == "reboot" || s.actions.is_empty() => {
                let _ = writeln!(out, "      ✓ not needed: {why}");
            }
            Some(why) => {
                let _ = writeln!(out, "      ✓ already done: {why}");
            }
            None => {
                for a in &s.actions {
                    for l in render_action(a, p.distro.is_deb()) {
                        let _ = writeln!(out, "      {l}");
                    }
                }
                if s.needs_reboot {
                    let _ = writeln!(out, "      (needs a reboot to take effect)");
                }
            }
        }
    }
    if !p.findings.is_empty() {
        let _ = writeln!(out, "\nnot done, and why:");
        for f in &p.findings {
            let _ = writeln!(out, "  {} {}: {}", f.severity.label(), f.id, f.summary);
            if !f.detail.is_empty() {
                let _ = writeln!(out, "      {}", f.detail);
            }
            if let Some(r) = &f.remedy {
                let _ = writeln!(out, "      → {r}");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NCCL's builds differ only in the CUDA release at the end of their version; the newest
    /// build of exactly the toolkit's release is the one, whatever is newer for another.
    #[test]
    fn the_newest_nccl_built_for_exactly_this_cuda() {
        let v = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let there = v(&[
            "2.28.3-1+cuda13.0",
            "2.27.3-1+cuda12.9",
            "2.27.5-1+cuda12.90",
            "2.26.5-1+cuda12.9",
            "2.27.3-2+cuda12.9",
            "2.27.10-1+cuda12.8",
            "2.9.9-1+cuda12.9",
            "2.30.0-1",
        ]);
        assert_eq!(newest_for_cuda(&there, "12.9").map(String::as_str), Some("2.27.3-2+cuda12.9"));
        assert_eq!(newest_for_cuda(&there, "12.8").map(String::as_str), Some("2.27.10-1+cuda12.8"));
        assert_eq!(newest_for_cuda(&there, "12.4"), None);
        assert_eq!(newest_for_cuda(&[], "12.9"), None);
        assert_eq!(built_for_cuda("2.27.3-1+cuda12.9"), Some("12.9"));
        assert_eq!(built_for_cuda("2.27.3-1"), None);
        assert_eq!(built_for_cuda("2.27.3-1+cuda"), None);
        assert_eq!(nccl_package(&Distro::Debian12), "libnccl2");
        assert_eq!(nccl_package(&Distro::El9("rocky".into())), "libnccl");
    }

    #[test]
    fn apt_names_index_files_as_it_does() {
        // As found in /var/lib/apt/lists: on Ubuntu guests with NVIDIA's repository, and in the
        // VM test's guest (`10.0.2.100:8080_repo_debian12_x86%5f64_Packages`).
        assert_eq!(
            apt_list_prefix("https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/"),
            "developer.download.nvidia.com_compute_cuda_repos_ubuntu2204_x86%5f64_"
        );
        assert_eq!(
            apt_list_prefix("http://10.0.2.100:8080/repo/debian12/x86_64/"),
            "10.0.2.100:8080_repo_debian12_x86%5f64_"
        );
    }
}
