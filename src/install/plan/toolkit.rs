//! The CUDA toolkit, and NCCL built for exactly its CUDA release (for the all-reduce probe).

use super::choices::Choices;
use super::{apt, cmd, dnf, lits, on, Action, Distro, Draft, Facts, Step, StepId};
use crate::facts;

/// The toolkit and NCCL, unless no CUDA 12 runs on the driver that stays.
pub(super) fn add(d: &mut Draft, f: &Facts, c: &Choices) {
    let (distro, cuda, cuda_min, toolkit) = (&c.distro, &c.cuda, c.cuda_min, &c.toolkit);
    // 7. The toolkit, unless no CUDA 12 can run on the driver that stays.
    if c.cuda_runs {
        let action = if distro.is_deb() {
            apt("install", lits(std::slice::from_ref(toolkit)))
        } else {
            dnf(&["install", toolkit])
        };
        d.steps.push(Step {
            id: StepId::Toolkit,
            title: format!("CUDA {cuda} toolkit ({toolkit}, needs driver ≥ {cuda_min})"),
            actions: vec![Action::Run(action)],
            done: f.installed(toolkit).then(|| format!("{toolkit} is installed")),
            needs_reboot: false,
        });
        // 7b. NCCL built for that toolkit's CUDA, for the all-reduce probe.
        d.steps.push(nccl_step(distro, f, cuda));
    }
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
            id: StepId::Nccl,
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
        id: StepId::Nccl,
        title,
        actions,
        done: matching
            .filter(|p| p.held)
            .map(|p| format!("{pkg} {} (built for CUDA {cuda}) is installed and held", p.version)),
        needs_reboot: false,
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
