//! The package manager and the sources it installs from: dpkg's half-done work finished first,
//! NVIDIA's repository trusted only through its pinned key, Debian's contrib and
//! non-free-firmware components, and NVIDIA's branch lock before anything is resolved.

use super::choices::Choices;
use super::{
    apt, cmd, dnf, lits, Action, Cmd, Distro, Draft, Facts, Retry, Settings, Step, StepId, CUDA_KEYRING_DEB,
    CUDA_KEYRING_MEMBER, DEBIAN_COMPONENTS, DEBIAN_COMPONENTS_PATH, DOWNLOAD_DIR, EPEL_KEY_FILE, EPEL_KEY_PATH,
    EPEL_RELEASE_FILE, EPEL_ROOT, NVIDIA_APT_KEYRING, RHEL_KEY_FILE, RHEL_KEY_PATH, RHEL_REPO_PATH,
};
use crate::checks::Finding;
use crate::facts;
use crate::snapshot::Package;

/// The repair (when dpkg is half-done), the repository, Debian's components and the pin.
pub(super) fn add(d: &mut Draft, f: &Facts, s: &Settings, c: &Choices) {
    let distro = &c.distro;
    // 0. A package manager left half-way (a killed dpkg, a failed DKMS build) is finished first.
    let packages: &[Package] = f.packages.as_deref().unwrap_or(&[]);
    let half: Vec<&Package> = packages.iter().filter(|p| p.state != "installed").collect();
    if distro.is_deb() && (!half.is_empty() || f.dpkg_interrupted) {
        let what = if half.is_empty() {
            "dpkg was interrupted".to_string()
        } else {
            half.iter().map(|p| format!("{} {}", p.name, p.state)).collect::<Vec<_>>().join(", ")
        };
        d.steps.push(Step {
            id: StepId::Repair,
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
    d.steps.push(repo_step(distro, f, s, &c.repo_base, DOWNLOAD_DIR));

    // 1a. Debian: the archive's contrib and non-free-firmware components, without which apt
    // cannot resolve NVIDIA's Debian packages (install/sources.rs).
    if *distro == Distro::Debian12 {
        components(d, f);
    }

    // 1b. NVIDIA's branch lock (`nvidia-driver-pinning-<branch>`, Debian and Ubuntu from the 580
    // era on), installed before anything is resolved, as its guide advises: until it is in
    // place apt resolves the driver to the newest branch (the real-apt test found the pre-flight
    // failing on exactly that when the pin came in the same transaction). Not on Ubuntu's signed
    // path under Secure Boot: it takes branch-named packages from Ubuntu's archive.
    if let Some(p) = &c.pinning {
        d.steps.push(Step {
            id: StepId::Pin,
            title: format!("keep the driver on branch {} ({p})", c.branch),
            actions: vec![Action::Run(apt("install", lits(std::slice::from_ref(p))))],
            done: f.installed(p).then(|| format!("{p} is installed")),
            needs_reboot: false,
        });
    }
}

/// Debian's contrib and non-free-firmware components, added where the guest's sources lack them.
fn components(d: &mut Draft, f: &Facts) {
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
            d.steps.push(Step {
                id: StepId::Components,
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
        Err(e) => d.findings.push(
            Finding::warn("install.debian-components", format!("cannot add Debian's contrib and non-free-firmware components: {e}"))
                .detail("NVIDIA's Debian packages depend on helpers in contrib (nvidia-support, glx-alternative-nvidia, nvidia-kernel-common) and the open modules' GSP firmware is in non-free-firmware; without them the pre-flight names what apt cannot install.")
                .remedy("Add `contrib non-free-firmware` to the Components of the Debian archive's apt sources, then rerun phq-agent install"),
        ),
    }
}

fn repo_step(distro: &Distro, f: &Facts, s: &Settings, base: &str, install_dir: &str) -> Step {
    match distro {
        Distro::El9(id) => el_repo_step(id, f, s, base, install_dir),
        _ => apt_repo_step(distro, f, s, base, install_dir),
    }
}

/// Debian and Ubuntu: the key out of `cuda-keyring`, the source, the index.
fn apt_repo_step(distro: &Distro, f: &Facts, s: &Settings, base: &str, install_dir: &str) -> Step {
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
        id: StepId::Repo,
        title: format!("NVIDIA repository {base}, key {}", crate::install::pgp::spaced(fpr)),
        actions,
        done,
        needs_reboot: false,
    }
}

/// RHEL 9 and its rebuilds (`id`): EPEL and CRB, NVIDIA's key and repository file.
fn el_repo_step(id: &str, f: &Facts, s: &Settings, base: &str, install_dir: &str) -> Step {
    let key = format!("{install_dir}/{RHEL_KEY_FILE}");
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
    let fpr = if s.key_fingerprint.is_empty() { facts::NVIDIA_RHEL_REPO_KEY_FINGERPRINT } else { &s.key_fingerprint };
    let repo = rhel_repo(base);
    let mut makecache = dnf(&["makecache"]);
    makecache.url = Some(base.into());
    Step {
        id: StepId::Repo,
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
