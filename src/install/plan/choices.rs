//! The decisions more than one step reads, made once from the facts and the settings: which
//! guest and CUDA, whether the installed driver is kept, matched or replaced, which packages
//! are "the driver", the kernel packages to hold, the headers to install. The rooms that build
//! steps read `Choices`; none decides any of this again.

use super::{Distro, Facts, PlanError, Settings, NVIDIA_REPO_ROOT};
use crate::checks::Finding;
use crate::facts;
use crate::snapshot::{Package, SecureBoot};

/// Every decision the steps share. Made by `Choices::make`; read-only after.
pub(super) struct Choices {
    pub distro: Distro,
    pub kernel: String,
    /// The CUDA release asked for (`12.9`), and the driver it asks for (`575.51.03`).
    pub cuda: String,
    pub cuda_min: &'static str,
    /// The driver branch asked for, and the oldest that runs all of `cuda`.
    pub branch: u32,
    pub min_branch: u32,
    /// NVIDIA's repository (or its mirror) for this distro, ending in `/`.
    pub repo_base: String,
    pub secure_boot: bool,
    /// The driver installed now, if any.
    pub present: Option<InstalledDriver>,
    /// The installed driver, of another branch or the proprietary flavour, kept because
    /// replacing it was not asked for: fabric manager and holds follow it.
    pub kept: Option<InstalledDriver>,
    /// The installed driver is of another branch or flavour and is being replaced. Decided
    /// here once: the driver step removes it, and the fabric manager and hold steps, though
    /// their packages read the same, are not done while it is.
    pub replacing: Option<InstalledDriver>,
    /// The installed driver is the branch's, open flavour: the one to hold and to match.
    pub matching: Option<InstalledDriver>,
    /// DKMS signs the module under Secure Boot: its key must be enrolled (`install.secure-boot`).
    pub dkms_under_sb: bool,
    /// NVIDIA's branch lock package (`nvidia-driver-pinning-<branch>`), where it applies.
    pub pinning: Option<String>,
    pub headers: Headers,
    /// The kernel packages held while a DKMS-built driver is installed (`kernel_hold`).
    pub kernel_hold: Vec<String>,
    /// The driver's packages, and the one whose version is "the driver's version".
    pub driver_packages: Vec<String>,
    pub driver_package: String,
    /// Fabric manager and NSCQ package names, of the branch that stays.
    pub fabric_manager: (String, String),
    /// `cuda-toolkit-12-9`.
    pub toolkit: String,
    /// Some CUDA 12 runs on the driver that stays: the toolkit and NCCL are installed.
    pub cuda_runs: bool,
}

/// The kernel headers DKMS builds against.
pub(super) struct Headers {
    /// Debian: the kernel's flavour, and its meta packages, which bring its newest kernel and
    /// that kernel's headers.
    pub flavour_metas: Option<(String, Vec<String>)>,
    pub packages: Vec<String>,
    /// Why nothing needs doing, when they are there.
    pub done: Option<String>,
}

impl Choices {
    pub fn make(f: &Facts, s: &Settings) -> Result<Choices, PlanError> {
        let os = f.os.as_ref().map_err(|e| PlanError::UnknownDistro(e.clone()))?;
        let distro = Distro::from_os(os)?;
        let kernel = f.kernel.clone().ok_or(PlanError::NoKernel)?;
        let cuda = facts::major_minor(&s.cuda)
            .filter(|c| c.starts_with("12."))
            .ok_or_else(|| PlanError::NotCuda12(s.cuda.clone()))?;
        let cuda_min = facts::cuda_min_driver(&cuda).ok_or_else(|| PlanError::UnknownCuda(cuda.clone()))?;
        if distro == Distro::Ubuntu2404 && facts::version_cmp(&cuda, facts::UBUNTU2404_FIRST_CUDA).is_lt() {
            return Err(PlanError::NoCudaForUbuntu2404 { cuda });
        }
        let b = s.driver_branch;
        let min_branch = facts::driver_branch(cuda_min).unwrap_or(0);
        // Only what cannot work is refused: below 525 no CUDA 12 runs at all. Between 525 and
        // the toolkit's own minimum it runs, with what needs the newer driver missing (a
        // warning, `findings`).
        if b < facts::MIN_DRIVER_BRANCH {
            return Err(PlanError::BranchTooOld(b));
        }
        // Every mirror URL, whichever source of settings it came from, is checked again here:
        // it becomes a line of an apt source or a dnf repository file, written as root.
        crate::config::check_mirror_url("install.repo_url", &s.repo_url, s.allow_plain_http)
            .map_err(PlanError::Mirror)?;
        crate::config::check_mirror_url("install.epel_url", &s.epel_url, s.allow_plain_http)
            .map_err(PlanError::Mirror)?;
        let repo_root = if s.repo_url.is_empty() { NVIDIA_REPO_ROOT } else { s.repo_url.trim_end_matches('/') };
        let repo_base = format!("{repo_root}/{}/x86_64/", distro.repo_dir());
        let secure_boot = f.secure_boot == Some(SecureBoot::Enabled);
        let packages: &[Package] = f.packages.as_deref().unwrap_or(&[]);

        // What is installed, and whether we may touch it.
        let present = installed_driver(packages);
        let other = |d: &&InstalledDriver| d.branch != Some(b) || !d.open;
        let kept = present.as_ref().filter(other).filter(|_| !s.replace_driver).cloned();
        let replacing = present.as_ref().filter(other).filter(|_| kept.is_none()).cloned();
        let matching = present.as_ref().filter(|d| d.branch == Some(b) && d.open).cloned();

        // Ubuntu under Secure Boot takes Canonical's signed modules; everywhere else DKMS builds
        // the module (signed with DKMS's own key under Secure Boot, which is then enrolled).
        let ubuntu = matches!(distro, Distro::Ubuntu2204 | Distro::Ubuntu2404);
        let signed_by_distro = ubuntu && secure_boot;
        // NVIDIA's branch lock (Debian and Ubuntu from the 580 era on); not on Ubuntu's signed
        // path under Secure Boot, which takes branch-named packages from Ubuntu's archive.
        let pinning = (distro.is_deb() && b >= 580 && !signed_by_distro && kept.is_none())
            .then(|| format!("nvidia-driver-pinning-{b}"));

        let headers = headers(f, &distro, &kernel);
        let headers_planned: &[String] = if headers.done.is_none() { &headers.packages } else { &[] };
        // Ubuntu's signed path brings each new kernel's module through the flavour's meta
        // package instead: nothing to hold there.
        let kernel_hold = if distro.is_deb() && signed_by_distro {
            Vec::new()
        } else {
            kernel_hold(&distro, &kernel, packages, headers_planned, headers.flavour_metas.is_some())
        };

        let (driver_packages, driver_package) =
            driver_packages(&distro, &kernel, b, secure_boot, kept.as_ref(), matching.as_ref());
        let branch_of_fm = kept.as_ref().and_then(|d| d.branch).unwrap_or(b);
        Ok(Choices {
            fabric_manager: fabric_manager_names(&distro, branch_of_fm),
            toolkit: format!("cuda-toolkit-{}", cuda.replace('.', "-")),
            cuda_runs: kept.as_ref().and_then(|d| d.branch).is_none_or(|kb| kb >= facts::MIN_DRIVER_BRANCH),
            dkms_under_sb: secure_boot && !signed_by_distro && kept.is_none(),
            distro,
            kernel,
            cuda,
            cuda_min,
            branch: b,
            min_branch,
            repo_base,
            secure_boot,
            present,
            kept,
            replacing,
            matching,
            pinning,
            headers,
            kernel_hold,
            driver_packages,
            driver_package,
        })
    }

    /// What the choices leave undone or half-done: a kept driver, and a CUDA it (or the branch
    /// asked for) runs only in part or not at all.
    pub fn findings(&self) -> Vec<Finding> {
        let (b, cuda) = (self.branch, &self.cuda);
        let older_driver = |what: String| minor_version_compatible(cuda, self.cuda_min, self.min_branch, &what);
        let mut findings = Vec::new();
        if let Some(d) = &self.kept {
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
                } else if kb < self.min_branch {
                    findings.push(older_driver(format!("the kept driver {}", d.version)));
                }
            }
        } else if b < self.min_branch {
            findings.push(older_driver(format!("driver branch {b}")));
        }
        findings
    }
}

/// Kernel headers: DKMS builds the modules against them. Debian's archive carries one ABI of
/// each kernel flavour, the newest: the headers of an older running kernel leave the mirror at
/// the next point release. So on Debian the flavour's meta packages are installed — the newest
/// kernel of the flavour and its headers, which DKMS builds the module for and the next boot
/// starts (Google's GPU installer installs the newest cloud-amd64 kernel and its headers and
/// reboots, for the same reason). Ubuntu's archive keeps each ABI's headers; EL installs the
/// running kernel's own devel package.
fn headers(f: &Facts, distro: &Distro, kernel: &str) -> Headers {
    let flavour_metas = match (distro, kernel_flavour(kernel)) {
        (Distro::Debian12, Some(fl)) => {
            Some((fl.to_string(), vec![format!("linux-headers-{fl}"), format!("linux-image-{fl}")]))
        }
        _ => None,
    };
    let (packages, done) = match &flavour_metas {
        Some((_, metas)) => {
            let done = metas.iter().all(|m| f.installed(m)).then(|| format!("{} are installed", metas.join(" and ")));
            (metas.clone(), done)
        }
        None if distro.is_deb() => (
            vec![format!("linux-headers-{kernel}")],
            f.headers_present.then(|| format!("/lib/modules/{kernel}/build is there")),
        ),
        None => (
            vec![format!("kernel-devel-{kernel}"), "kernel-headers".into()],
            f.headers_present.then(|| format!("/lib/modules/{kernel}/build is there")),
        ),
    };
    Headers { flavour_metas, packages, done }
}

/// The driver's packages, and the one whose version is "the driver's version": none of a kept
/// driver's but itself, Ubuntu's signed build under Secure Boot, else the compute-only set;
/// an installed driver of the branch first.
fn driver_packages(
    distro: &Distro,
    kernel: &str,
    b: u32,
    secure_boot: bool,
    kept: Option<&InstalledDriver>,
    matching: Option<&InstalledDriver>,
) -> (Vec<String>, String) {
    let (driver_packages, driver_package): (Vec<String>, String) = match distro {
        _ if kept.is_some() => (Vec::new(), kept.map(|d| d.package.clone()).unwrap_or_default()),
        // Canonical-signed precompiled modules, as NVIDIA's precompiled driver container
        // installs them (gpu-driver-container, ubuntu22.04/precompiled): the module for this
        // kernel and its signature, the flavour's meta package so each new kernel brings its
        // module, and user space without DKMS or the desktop stack.
        Distro::Ubuntu2204 | Distro::Ubuntu2404 if secure_boot => {
            let mut v = vec![
                format!("nvidia-headless-no-dkms-{b}-server"),
                format!("nvidia-utils-{b}-server"),
                format!("linux-signatures-nvidia-{kernel}"),
                format!("linux-modules-nvidia-{b}-server-open-{kernel}"),
            ];
            if let Some(flavour) = kernel_flavour(kernel) {
                v.push(format!("linux-modules-nvidia-{b}-server-open-{flavour}"));
            }
            (v, format!("nvidia-headless-no-dkms-{b}-server"))
        }
        _ => compute_only(distro, b),
    };
    // A driver already at the branch, open flavour, is the one to hold and to match.
    match matching {
        Some(d) => {
            let mut v: Vec<String> = vec![d.package.clone()];
            v.extend(driver_packages.into_iter().filter(|p| *p != d.package));
            (v, d.package.clone())
        }
        None => (driver_packages, driver_package),
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

/// CUDA 12.x on a driver older than the toolkit's own minimum: it runs, by minor-version
/// compatibility — any CUDA 12.x toolkit's applications run on a driver of branch 525 or later
/// (NVIDIA's CUDA Compatibility guide, "Minor Version Compatibility": CUDA 12.x ≥ 525) — and
/// what needs the newer driver does not (the same guide: PTX JIT of newer PTX, newer APIs).
fn minor_version_compatible(cuda: &str, cuda_min: &str, min_branch: u32, what: &str) -> Finding {
    Finding::warn("install.cuda-driver", format!("CUDA {cuda} asks for driver {cuda_min}; {what} runs it by minor-version compatibility"))
        .detail(format!("Applications built with any CUDA 12 run on a driver of branch 525 or later, but what needs driver {cuda_min} does not: PTX built by CUDA {cuda} cannot be JIT-compiled by an older driver, and APIs new in {cuda} are not there."))
        .remedy(format!("For all of CUDA {cuda}: driver branch {min_branch} or later (install.driver_branch, with --replace-driver for a kept driver), or cuda-compat-{} for forward compatibility", cuda.replace('.', "-")))
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
