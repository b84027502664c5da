//! Golden plans: every supported distro × {1 GPU, 8 GPUs + NVSwitches} × {Secure Boot on, off}
//! × {fresh, half-installed, done}. The plan is what `install --dry-run` prints, so a change to
//! any command the installer runs shows up here as a diff a person reviews.
//! Regenerate with `PHQ_UPDATE_GOLDEN=1 cargo test --test install_plans`.

use phq_agent::install::plan::{self, Distro, Facts, Settings};
use phq_agent::snapshot::{OsRelease, Package, SecureBoot};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// An R580 release: the long-term support branch `install` defaults to.
const DRIVER: &str = "580.82.07";
/// NCCL as NVIDIA's repositories version it, built for the toolkit the plans install (CUDA 12.9).
const NCCL_FOR_12_9: &str = "2.27.3-1+cuda12.9";

struct Guest {
    key: &'static str,
    id: &'static str,
    version: &'static str,
    pretty: &'static str,
    kernel: &'static str,
}

const GUESTS: &[Guest] = &[
    Guest {
        key: "ubuntu2204",
        id: "ubuntu",
        version: "22.04",
        pretty: "Ubuntu 22.04.4 LTS",
        kernel: "5.15.0-113-generic",
    },
    Guest {
        key: "ubuntu2404",
        id: "ubuntu",
        version: "24.04",
        pretty: "Ubuntu 24.04.1 LTS",
        kernel: "6.8.0-45-generic",
    },
    Guest {
        key: "debian12",
        id: "debian",
        version: "12",
        pretty: "Debian GNU/Linux 12 (bookworm)",
        kernel: "6.1.0-27-cloud-amd64",
    },
    Guest {
        key: "rhel9",
        id: "rhel",
        version: "9.4",
        pretty: "Red Hat Enterprise Linux 9.4 (Plow)",
        kernel: "5.14.0-427.13.1.el9_4.x86_64",
    },
    Guest {
        key: "rocky9",
        id: "rocky",
        version: "9.4",
        pretty: "Rocky Linux 9.4 (Blue Onyx)",
        kernel: "5.14.0-427.13.1.el9_4.x86_64",
    },
    Guest {
        key: "alma9",
        id: "almalinux",
        version: "9.4",
        pretty: "AlmaLinux 9.4 (Seafoam Ocelot)",
        kernel: "5.14.0-427.13.1.el9_4.x86_64",
    },
];

#[derive(Clone, Copy, PartialEq)]
enum Stage {
    Fresh,
    Half,
    Done,
}

fn pkg(name: &str, version: &str, state: &str, held: bool) -> Package {
    Package { name: name.into(), version: version.into(), state: state.into(), held }
}

fn os(g: &Guest) -> OsRelease {
    OsRelease { id: g.id.into(), id_like: vec![], version_id: g.version.into(), pretty_name: g.pretty.into() }
}

/// A version-4 Ed25519 public key packet standing for the repository's key (the plans pin its
/// fingerprint, since a machine that is done holds the pinned key, and NVIDIA's own key is not
/// in the repository), and that fingerprint.
fn repo_key() -> (Vec<u8>, String) {
    let mut body =
        vec![4, 0x5f, 0, 0, 0, 22, 9, 0x2b, 0x06, 0x01, 0x04, 0x01, 0xda, 0x47, 0x0f, 0x01, 0x01, 0x07, 0x40];
    body.extend([7u8; 32]);
    let mut p = vec![0xc6, body.len() as u8];
    p.extend(&body);
    let fpr = phq_agent::install::pgp::keys(&p).unwrap()[0].fingerprint.clone();
    (p, fpr)
}

fn settings() -> Settings {
    Settings {
        cuda: "12.9".into(),
        driver_branch: 580,
        repo_url: String::new(),
        key_fingerprint: repo_key().1,
        epel_url: String::new(),
        epel_key_fingerprint: String::new(),
        replace_driver: false,
        allow_plain_http: false,
    }
}

/// What each guest looks like once the installer is done with it.
fn done_packages(g: &Guest, sb: bool, switches: bool) -> Vec<Package> {
    let deb = g.id == "ubuntu" || g.id == "debian";
    let mut v = Vec::new();
    if deb {
        v.push(pkg("cuda-keyring", "1.1-1", "installed", false));
    }
    if deb && !(g.id == "ubuntu" && sb) {
        v.push(pkg("nvidia-driver-pinning-580", "580-1", "installed", false));
    }
    match (g.id, sb) {
        ("ubuntu", false) => {
            for p in ["libnvidia-compute-580", "nvidia-dkms-580-open", "nvidia-utils-580", "nvidia-compute-utils-580"] {
                v.push(pkg(p, &format!("{DRIVER}-0ubuntu1"), "installed", true));
            }
        }
        ("ubuntu", true) => {
            let ubuntu = format!("{DRIVER}-0ubuntu0.22.04.1");
            v.push(pkg("nvidia-headless-no-dkms-580-server", &ubuntu, "installed", true));
            v.push(pkg("nvidia-utils-580-server", &ubuntu, "installed", true));
            v.push(pkg(&format!("linux-signatures-nvidia-{}", g.kernel), "5.15.0-113.123", "installed", false));
            v.push(pkg(
                &format!("linux-modules-nvidia-580-server-open-{}", g.kernel),
                "5.15.0-113.123",
                "installed",
                false,
            ));
            v.push(pkg("linux-modules-nvidia-580-server-open-generic", "5.15.0-113.123", "installed", false));
        }
        ("debian", _) => {
            v.push(pkg("nvidia-kernel-open-dkms", &format!("{DRIVER}-1"), "installed", true));
            v.push(pkg("nvidia-driver-cuda", &format!("{DRIVER}-1"), "installed", true));
            v.push(pkg("nvidia-persistenced", &format!("{DRIVER}-1"), "installed", true));
        }
        _ => {
            v.push(pkg("kmod-nvidia-open-dkms", &format!("{DRIVER}-1.el9"), "installed", true));
            v.push(pkg("nvidia-driver-cuda", &format!("{DRIVER}-1.el9"), "installed", true));
        }
    }
    if switches {
        // From 580 on, unversioned names on both families (the hyphen gone on EL).
        let (fm, nscq) = ("nvidia-fabricmanager", "libnvidia-nscq");
        v.push(pkg(fm, &format!("{DRIVER}-1"), "installed", true));
        v.push(pkg(nscq, &format!("{DRIVER}-1"), "installed", true));
    }
    v.push(pkg("cuda-toolkit-12-9", "12.9.1-1", "installed", true));
    if switches {
        // NCCL for the all-reduce probe, on the 8-GPU guest only: the build for CUDA 12.9,
        // held in its own step.
        let nccl = if deb { "libnccl2" } else { "libnccl" };
        v.push(pkg(nccl, NCCL_FOR_12_9, "installed", true));
    }
    // The running kernel, held while a DKMS-built module depends on it (not on Ubuntu's signed path).
    let held = !(g.id == "ubuntu" && sb);
    v.extend(kernel_packages(g, held));
    if deb {
        v.push(pkg(&format!("linux-headers-{}", g.kernel), "1", "installed", held));
        if g.id == "debian" {
            // The flavour's metas, which the installer put in on Debian.
            v.push(pkg("linux-headers-cloud-amd64", "6.1.112-1", "installed", held));
            v.push(pkg("linux-image-cloud-amd64", "6.1.112-1", "installed", held));
        }
    } else {
        v.push(pkg("kernel-devel", g.kernel.trim_end_matches(".x86_64"), "installed", held));
    }
    v
}

/// The running kernel's packages every guest has, whatever the installer did.
fn kernel_packages(g: &Guest, held: bool) -> Vec<Package> {
    if g.id == "ubuntu" || g.id == "debian" {
        vec![pkg(&format!("linux-image-{}", g.kernel), "1", "installed", held)]
    } else {
        ["kernel", "kernel-core", "kernel-modules"]
            .iter()
            .map(|k| pkg(k, g.kernel.trim_end_matches(".x86_64"), "installed", held))
            .collect()
    }
}

fn facts(g: &Guest, switches: bool, sb: bool, stage: Stage) -> Facts {
    let deb = g.id == "ubuntu" || g.id == "debian";
    let distro = Distro::from_os(&os(g)).expect("supported");
    let mut files = BTreeMap::new();
    let mut keys = BTreeMap::new();
    let mut units = Vec::new();
    let (packages, headers, nouveau_off, nouveau_loaded, loaded) = match stage {
        Stage::Fresh => (kernel_packages(g, false), false, false, g.id != "debian", None),
        Stage::Half => {
            // An earlier run was killed: keyring in, driver unpacked but never configured, the
            // headers missing so DKMS could not build; nouveau already off.
            let mut p = kernel_packages(g, false);
            if deb {
                p.push(pkg("cuda-keyring", "1.1-1", "installed", false));
                let driver = if g.id == "debian" { "nvidia-kernel-open-dkms" } else { "nvidia-dkms-580-open" };
                p.push(pkg(driver, &format!("{DRIVER}-1"), "half-configured", false));
            } else {
                p.push(pkg("kmod-nvidia-open-dkms", &format!("{DRIVER}-1.el9"), "installed", false));
            }
            files.insert(plan::NOUVEAU_CONF.to_string(), plan::NOUVEAU_CONF_TEXT.to_string());
            (p, false, true, false, None)
        }
        Stage::Done => {
            files.insert(plan::NOUVEAU_CONF.to_string(), plan::NOUVEAU_CONF_TEXT.to_string());
            if deb {
                let base = format!("{}/{}/x86_64/", plan::NVIDIA_REPO_ROOT, distro.repo_dir());
                files.insert(distro.apt_source_path(), plan::apt_source(&base));
                keys.insert(plan::NVIDIA_APT_KEYRING.to_string(), repo_key().0);
            } else {
                keys.insert(plan::RHEL_KEY_PATH.to_string(), repo_key().0);
                let base = format!("{}/{}/x86_64/", plan::NVIDIA_REPO_ROOT, distro.repo_dir());
                files.insert(
                    plan::RHEL_REPO_PATH.to_string(),
                    format!("# Written by phq-agent install.\n[cuda-rhel9-x86_64]\nname=cuda-rhel9-x86_64\nbaseurl={base}\nenabled=1\ngpgcheck=1\ngpgkey=file://{}\n", plan::RHEL_KEY_PATH),
                );
            }
            units.push("nvidia-persistenced.service".to_string());
            if switches {
                units.push("nvidia-fabricmanager.service".to_string());
            }
            (done_packages(g, sb, switches), true, true, false, Some(DRIVER.to_string()))
        }
    };
    Facts {
        os: Ok(os(g)),
        kernel: Some(g.kernel.into()),
        headers_present: headers,
        secure_boot: Some(if sb { SecureBoot::Enabled } else { SecureBoot::Disabled }),
        gpus: if switches { 8 } else { 1 },
        nvswitches: if switches { 4 } else { 0 },
        packages: Ok(packages),
        nouveau_off,
        nouveau_loaded,
        nvidia_loaded: loaded,
        // DKMS built the module only in a finished install (the half one lacked the headers).
        nvidia_module_built: stage == Stage::Done,
        dpkg_interrupted: false,
        // Fetched by every run that got past the repository step.
        apt_lists: if stage == Stage::Fresh {
            vec![]
        } else {
            let base = format!("{}/{}/x86_64/", plan::NVIDIA_REPO_ROOT, distro.repo_dir());
            vec![format!("{}Packages.lz4", plan::apt_list_prefix(&base)), "lock".into()]
        },
        // Debian: a deb822 source of the archive, main only until the installer adds contrib and
        // non-free-firmware (there from an earlier run when done).
        apt_sources: if g.id == "debian" {
            let components = if stage == Stage::Done { "main contrib non-free-firmware" } else { "main" };
            vec![(
                "/etc/apt/sources.list.d/debian.sources".into(),
                format!("Types: deb\nURIs: http://debian.mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: {components}\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"),
            )]
        } else {
            vec![]
        },
        enabled_units: units,
        files,
        keys,
    }
}

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/plans")
}

#[test]
fn golden_plans() {
    let update = std::env::var_os("PHQ_UPDATE_GOLDEN").is_some();
    let mut mismatches = Vec::new();
    let mut count = 0;
    for g in GUESTS {
        for switches in [false, true] {
            for sb in [false, true] {
                for (stage, sname) in [(Stage::Fresh, "fresh"), (Stage::Half, "half-installed"), (Stage::Done, "done")]
                {
                    let name = format!(
                        "{}-{}-sb-{}-{sname}.txt",
                        g.key,
                        if switches { "8gpu-nvswitch" } else { "1gpu" },
                        if sb { "on" } else { "off" }
                    );
                    let p = plan::plan(&facts(g, switches, sb, stage), &settings()).expect("a plan");
                    let text = plan::render(&p);
                    let path = golden_dir().join(&name);
                    count += 1;
                    if update {
                        std::fs::create_dir_all(golden_dir()).unwrap();
                        std::fs::write(&path, &text).unwrap();
                    } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                        mismatches.push(name);
                    }
                }
            }
        }
    }
    assert_eq!(count, 72);
    assert!(
        mismatches.is_empty(),
        "plans differ from tests/golden/plans (PHQ_UPDATE_GOLDEN=1 to accept): {mismatches:?}"
    );
}

/// The properties the golden files are reviewed for, asserted so a careless regeneration
/// cannot hide a broken rule.
#[test]
fn plan_rules() {
    for g in GUESTS {
        for sb in [false, true] {
            for switches in [false, true] {
                let fresh = plan::plan(&facts(g, switches, sb, Stage::Fresh), &settings()).unwrap();
                let text = plan::render(&fresh);
                // Fabric manager only when the NVSwitches are visible, and only at the driver's version.
                assert_eq!(text.contains("fabricmanager —"), switches, "{} {text}", g.key);
                if switches {
                    assert!(text.contains("=<driver version>") || text.contains("-<driver version>"));
                }
                // Secure Boot: Ubuntu's signed modules.
                if sb && g.id == "ubuntu" {
                    // Canonical's signed module for this kernel, its signature, the flavour's
                    // meta for later kernels, user space without DKMS; no pinning package
                    // (Ubuntu's archive, not NVIDIA's repository).
                    for p in [
                        format!("linux-modules-nvidia-580-server-open-{}", g.kernel),
                        format!("linux-signatures-nvidia-{}", g.kernel),
                        "linux-modules-nvidia-580-server-open-generic".to_string(),
                        "nvidia-headless-no-dkms-580-server".to_string(),
                        "nvidia-utils-580-server".to_string(),
                    ] {
                        assert!(text.contains(&p), "{p}: {text}");
                    }
                    assert!(!text.contains("nvidia-driver-pinning") && !text.contains("nvidia-dkms"), "{text}");
                }
                // NVIDIA's pinning package, before the driver, on Debian and Ubuntu (not on
                // Ubuntu's signed path).
                let signed_by_ubuntu = sb && g.id == "ubuntu";
                if (g.id == "ubuntu" || g.id == "debian") && !signed_by_ubuntu {
                    let pin = text.find("install nvidia-driver-pinning-580").expect("the pinning package");
                    let driver = text
                        .find("install libnvidia-compute-580 nvidia-dkms-580-open")
                        .or_else(|| text.find("install nvidia-driver-cuda nvidia-kernel-open-dkms"))
                        .expect("the driver");
                    assert!(pin < driver, "{text}");
                }
                // Secure Boot elsewhere: the DKMS-built driver, then DKMS's key queued for
                // enrolment (the dkms README's Secure Boot steps), and a warning that says what
                // the person at the console does.
                if sb && g.id != "ubuntu" {
                    let ids: Vec<&str> = fresh.steps.iter().map(|s| s.id.as_str()).collect();
                    let driver = ids.iter().position(|i| *i == "driver").expect("the driver step");
                    let mok = ids.iter().position(|i| *i == "mok").expect("the MOK step");
                    assert!(driver < mok, "{ids:?}");
                    assert!(text.contains("$ mokutil --import /var/lib/dkms/mok.pub"), "{text}");
                    assert!(fresh.findings.iter().any(|f| f.id == "install.secure-boot"
                        && f.severity == phq_agent::checks::Severity::Warn
                        && f.remedy.as_deref().unwrap_or("").contains("Enroll MOK")));
                } else {
                    assert!(fresh.steps.iter().all(|s| s.id.as_str() != "mok"), "{text}");
                }
                // The running kernel is held with a DKMS-built driver (Google's installer does the
                // same), never on Ubuntu's signed path, where the meta brings each kernel's module.
                if !signed_by_ubuntu {
                    let kernel: Vec<String> = if g.id == "ubuntu" {
                        vec![format!("linux-image-{}", g.kernel), format!("linux-headers-{}", g.kernel)]
                    } else if g.id == "debian" {
                        // The flavour's metas the headers step installs (Debian keeps only the
                        // newest ABI's headers), and the running kernel.
                        vec![
                            format!("linux-image-{}", g.kernel),
                            "linux-image-cloud-amd64".into(),
                            "linux-headers-cloud-amd64".into(),
                        ]
                    } else {
                        ["kernel", "kernel-core", "kernel-modules", "kernel-devel"].map(String::from).to_vec()
                    };
                    // Any hold line: NCCL's own step holds it with a line of its own.
                    let lines: Vec<&str> =
                        text.lines().filter(|l| l.contains("apt-mark hold") || l.contains("versionlock add")).collect();
                    for k in &kernel {
                        assert!(lines.iter().any(|l| l.split(' ').any(|w| w == k)), "{k} not held: {lines:?}");
                    }
                }
                // On Debian and Ubuntu the kernel is held before the driver is built for it.
                if (g.id == "ubuntu" || g.id == "debian") && !signed_by_ubuntu {
                    let hold = text.find("kernel-hold —").expect("the kernel hold step");
                    assert!(hold < text.find(" driver —").expect("the driver step"), "{text}");
                }
                if sb && g.id == "ubuntu" {
                    assert!(
                        !text.contains("hold linux-image") && !text.contains(&format!("linux-image-{}", g.kernel)),
                        "{text}"
                    );
                }
                // Debian: contrib and non-free-firmware added to the archive's own source, before
                // anything is resolved.
                if g.id == "debian" {
                    let ids: Vec<&str> = fresh.steps.iter().map(|s| s.id.as_str()).collect();
                    let c = ids.iter().position(|i| *i == "components").expect("the components step");
                    assert!(c < ids.iter().position(|i| *i == "preflight").unwrap(), "{ids:?}");
                    assert!(
                        text.contains("| URIs: http://debian.mirror.example/debian\n")
                            || text.contains("    | URIs: http://debian.mirror.example/debian"),
                        "{text}"
                    );
                    assert!(text.contains("| Components: contrib non-free-firmware"), "{text}");
                } else {
                    assert!(fresh.steps.iter().all(|s| s.id.as_str() != "components"), "{text}");
                }
                // Debian: headers through the flavour's metas, never the running ABI's own package,
                // which leaves Debian's mirror at the next point release.
                if g.id == "debian" {
                    assert!(text.contains("install linux-headers-cloud-amd64 linux-image-cloud-amd64"), "{text}");
                    let fixed = format!("linux-headers-{}", g.kernel);
                    assert!(
                        !text.lines().any(|l| l.contains(" install ") && l.split(' ').any(|w| w == fixed)),
                        "{text}"
                    );
                }
                // EL's extra repositories: on RHEL, EPEL's release package only after its key is
                // verified by its whole fingerprint and dnf told to check a local package, and
                // CRB found by what the machine subscribes to; the rebuilds' own signed repos.
                if g.id == "rhel" {
                    let key = text
                        .find("is key FF8A D134 4597 106E CE81 3B91 8A38 72BF 3228 467C and nothing else")
                        .expect("EPEL's key");
                    let rpm = text.find("install --setopt=localpkg_gpgcheck=1 /var/cache/phq-agent-install/epel-release-latest-9.noarch.rpm").expect("checked");
                    assert!(key < rpm, "{text}");
                    assert!(
                        text.contains("$ dnf -q repolist --all")
                            && !text.contains("codeready-builder-for-rhel-9-x86_64-rpms"),
                        "{text}"
                    );
                } else if g.id == "rocky" || g.id == "almalinux" {
                    assert!(
                        text.contains("install epel-release") && text.contains("config-manager --set-enabled crb"),
                        "{text}"
                    );
                }
                // Always open kernel modules, and compute-only: no desktop meta package (NVIDIA's
                // compute-only sets), always a hold, always verification last.
                for desktop in [
                    "nvidia-driver-580 ",
                    "nvidia-driver-580-open",
                    "cuda-drivers",
                    "nvidia-open",
                    "kmod-nvidia-latest",
                ] {
                    let words = text.split(|c: char| c.is_whitespace() || c == ',');
                    assert!(!words.clone().any(|w| w == desktop.trim()), "{desktop}: {text}");
                }
                let compute = match g.id {
                    "ubuntu" if sb => "nvidia-headless-no-dkms-580-server",
                    "ubuntu" => {
                        "install libnvidia-compute-580 nvidia-dkms-580-open nvidia-utils-580 nvidia-compute-utils-580"
                    }
                    "debian" => "install nvidia-driver-cuda nvidia-kernel-open-dkms nvidia-persistenced",
                    _ => "install nvidia-driver-cuda kmod-nvidia-open-dkms",
                };
                assert!(text.contains(compute), "{compute}: {text}");
                assert_eq!(fresh.steps.last().map(|s| s.id.as_str()), Some("verify"));
                assert!(fresh.steps.iter().any(|s| s.id.as_str() == "hold"));
                // NCCL after the toolkit, only where the all-reduce probe can run (2 GPUs or
                // more), at the newest build for the toolkit's CUDA and held in its own step.
                let ids: Vec<&str> = fresh.steps.iter().map(|s| s.id.as_str()).collect();
                let nccl = ids.iter().position(|i| *i == "nccl").expect("the NCCL step");
                assert!(ids.iter().position(|i| *i == "toolkit").unwrap() < nccl, "{ids:?}");
                let (pkg, pinned) = if g.id == "ubuntu" || g.id == "debian" {
                    ("libnccl2", "install libnccl2=<its newest +cuda12.9 build>")
                } else {
                    ("libnccl", "install libnccl-<its newest +cuda12.9 build>")
                };
                let step = &fresh.steps[nccl];
                if switches {
                    assert!(step.done.is_none());
                    assert!(text.contains(pinned), "{text}");
                    assert!(
                        text.contains(&format!("apt-mark hold {pkg}\n"))
                            || text.contains(&format!("versionlock add {pkg}\n")),
                        "{text}"
                    );
                } else {
                    assert!(step.actions.is_empty() && step.title.contains("not needed, 1 GPU is visible"), "{text}");
                    assert!(!text.contains(pinned), "{text}");
                }
                // The pre-flight leaves NCCL to its step, which skips it when there is no build
                // for this CUDA instead of stopping the install.
                let preflight = text.lines().find(|l| l.contains("(resolve only")).expect("the pre-flight");
                assert!(!preflight.split(' ').any(|w| w.starts_with("libnccl")), "{preflight}");
                // Done: nothing left to run but the reboot check and verification.
                let done = plan::plan(&facts(g, switches, sb, Stage::Done), &settings()).unwrap();
                let pending: Vec<&str> =
                    done.steps.iter().filter(|s| s.done.is_none()).map(|s| s.id.as_str()).collect();
                assert_eq!(pending, ["verify"], "{} sb={sb} switches={switches}: {}", g.key, plan::render(&done));
                assert_eq!(done.reboot_reason, None);
            }
        }
    }
}

/// NCCL follows `install.cuda`: the build the step looks for ends with the toolkit's CUDA; a
/// build for another CUDA installed (and held) by someone else or an earlier install is
/// unheld and replaced, never counted as done; the matching build counts only once it is held.
#[test]
fn nccl_follows_the_toolkits_cuda() {
    for g in GUESTS {
        let deb = g.id == "ubuntu" || g.id == "debian";
        let pkg_name = if deb { "libnccl2" } else { "libnccl" };
        let cuda = if g.key == "ubuntu2404" { "12.6" } else { "12.4" };
        let s = Settings { cuda: cuda.into(), ..settings() };
        let text = plan::render(&plan::plan(&facts(g, true, false, Stage::Fresh), &s).unwrap());
        assert!(text.contains(&format!("whose version ends +cuda{cuda} is installed")), "{text}");
        assert!(!text.contains("+cuda12.9"), "{text}");

        // Done for 12.9, with 12.8's build in place of NCCL's and held: not done, unheld first
        // (apt refuses to change a held package; dnf's lock hides every other build), and on
        // apt allowed to move down (the build wanted may be older than the one there).
        let mut f = facts(g, true, false, Stage::Done);
        let Ok(packages) = &mut f.packages else { unreachable!() };
        let nccl = packages.iter_mut().find(|p| p.name == pkg_name).expect("NCCL in the done guest");
        nccl.version = "2.28.3-1+cuda12.8".into();
        let p = plan::plan(&f, &settings()).unwrap();
        let text = plan::render(&p);
        let step = p.steps.iter().find(|st| st.id.as_str() == "nccl").unwrap();
        assert!(step.done.is_none(), "{text}");
        assert!(step.title.contains("in place of 2.28.3-1+cuda12.8 (built for CUDA 12.8)"), "{text}");
        let unhold = if deb { "$ apt-mark unhold libnccl2" } else { "$ dnf versionlock delete libnccl" };
        let unhold = text.find(unhold).expect("the old build's hold goes");
        let install = text.find("+cuda12.9 build>").unwrap();
        assert!(unhold < install, "{text}");
        assert_eq!(text.contains("install --allow-downgrades libnccl2="), deb, "{text}");

        // The matching build, not held: installed again (the newest for 12.9) and held.
        let mut f = facts(g, true, false, Stage::Done);
        let Ok(packages) = &mut f.packages else { unreachable!() };
        packages.iter_mut().find(|p| p.name == pkg_name).unwrap().held = false;
        let p = plan::plan(&f, &settings()).unwrap();
        let step = p.steps.iter().find(|st| st.id.as_str() == "nccl").unwrap();
        assert!(step.done.is_none() && !plan::render(&p).contains("unhold"), "{}", plan::render(&p));
    }
}

#[test]
fn unsupported_guests_and_impossible_settings_say_what_is_supported() {
    let mut f = facts(&GUESTS[0], false, false, Stage::Fresh);
    f.os = Ok(OsRelease {
        id: "centos".into(),
        id_like: vec![],
        version_id: "7".into(),
        pretty_name: "CentOS Linux 7 (Core)".into(),
    });
    let e = plan::plan(&f, &settings()).unwrap_err().to_string();
    assert!(e.contains("CentOS Linux 7") && e.contains("Ubuntu 22.04") && e.contains("Rocky Linux 9"), "{e}");

    let f = facts(&GUESTS[0], false, false, Stage::Fresh);
    // CUDA 12.9 on branch 570 runs by minor-version compatibility: installed, with a warning
    // that names what needs 575.51.03. Below 525 no CUDA 12 runs: refused.
    let p = plan::plan(&f, &Settings { driver_branch: 570, ..settings() }).unwrap();
    let w = p.findings.iter().find(|x| x.id == "install.cuda-driver").expect("the minor-version warning");
    assert_eq!(w.severity, phq_agent::checks::Severity::Warn);
    assert!(w.summary.contains("575.51.03") && w.summary.contains("minor-version compatibility"), "{w:?}");
    assert!(p.steps.iter().any(|s| s.id.as_str() == "toolkit"), "{}", plan::render(&p));
    let e = plan::plan(&f, &Settings { driver_branch: 520, ..settings() }).unwrap_err().to_string();
    assert!(e.contains("predates CUDA 12"), "{e}");
    let e = plan::plan(&f, &Settings { cuda: "11.8".into(), ..settings() }).unwrap_err().to_string();
    assert!(e.contains("CUDA 12"), "{e}");
    // Ubuntu 24.04 has CUDA packages from 12.5 on: 12.4 is refused before anything is planned,
    // 12.5 is fine; 12.4 on 22.04 too.
    let noble = GUESTS.iter().find(|g| g.key == "ubuntu2404").unwrap();
    let f24 = facts(noble, false, false, Stage::Fresh);
    let e = plan::plan(&f24, &Settings { cuda: "12.4".into(), ..settings() }).unwrap_err().to_string();
    assert!(e.contains("no CUDA 12.4 packages for Ubuntu 24.04") && e.contains("starts at CUDA 12.5"), "{e}");
    assert!(plan::plan(&f24, &Settings { cuda: "12.5".into(), ..settings() }).is_ok());
    assert!(plan::plan(&f, &Settings { cuda: "12.4".into(), ..settings() }).is_ok());
}

#[test]
fn another_branch_is_kept_unless_asked() {
    let g = &GUESTS[0];
    let mut f = facts(g, true, false, Stage::Done);
    f.packages = Ok(vec![
        pkg("cuda-keyring", "1.1-1", "installed", false),
        pkg("nvidia-driver-535", "535.183.01-0ubuntu1", "installed", false),
        pkg("nvidia-fabricmanager-535", "535.183.01-1", "installed", false),
    ]);
    f.nvidia_loaded = Some("535.183.01".into());
    let kept = plan::plan(&f, &settings()).unwrap();
    let text = plan::render(&kept);
    assert!(kept.findings.iter().any(|x| x.id == "install.driver-kept"), "{text}");
    assert!(kept.steps.iter().all(|s| s.id.as_str() != "driver"), "{text}");
    // 535 is older than CUDA 12.9 asks for, and runs it by minor-version compatibility: said,
    // and the toolkit is installed.
    let w = kept.findings.iter().find(|x| x.id == "install.cuda-driver").expect("the minor-version warning");
    assert_eq!(w.severity, phq_agent::checks::Severity::Warn, "{text}");
    assert!(kept.steps.iter().any(|s| s.id.as_str() == "toolkit"), "{text}");
    assert!(text.contains("hold versions: nvidia-driver-535, nvidia-fabricmanager-535"), "{text}");

    let replaced = plan::plan(&f, &Settings { replace_driver: true, ..settings() }).unwrap();
    let text = plan::render(&replaced);
    assert!(text.contains("purge nvidia-driver-535 nvidia-fabricmanager-535"), "{text}");
    assert!(text.contains("install libnvidia-compute-580 nvidia-dkms-580-open"), "{text}");
}

/// EL9: another branch's driver is replaced by switching the module stream (its version locks
/// dropped first), never by installing a second stream beside it.
#[test]
fn el9_changes_branch_by_switching_the_module_stream() {
    let g = GUESTS.iter().find(|g| g.id == "rocky").expect("a Rocky guest");
    let mut f = facts(g, false, false, Stage::Done);
    f.packages = Ok(vec![
        pkg("kmod-nvidia-open-dkms", "570.195.03-1.el9", "installed", true),
        pkg("nvidia-driver", "570.195.03-1.el9", "installed", true),
    ]);
    f.nvidia_loaded = Some("570.195.03".into());
    let text = plan::render(&plan::plan(&f, &Settings { replace_driver: true, ..settings() }).unwrap());
    let unlock = text.find("dnf versionlock delete kmod-nvidia-open-dkms").expect("the old locks go");
    let switch = text.find("module switch-to nvidia-driver:580-open --allowerasing").expect("the stream switch");
    let install = text.find("dnf -y -q install nvidia-driver-cuda kmod-nvidia-open-dkms").expect("the driver");
    assert!(unlock < switch && switch < install, "{text}");
    assert!(!text.contains("module enable"), "{text}");
}

#[test]
fn a_mirror_replaces_the_source_and_keeps_the_pin() {
    let f = facts(&GUESTS[2], false, false, Stage::Fresh);
    let s = Settings {
        repo_url: "https://mirror.example/cuda/repos/".into(),
        key_fingerprint: String::new(),
        ..settings()
    };
    let text = plan::render(&plan::plan(&f, &s).unwrap());
    assert!(
        text.contains("fetch https://mirror.example/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb"),
        "{text}"
    );
    assert!(text.contains("write /etc/apt/sources.list.d/cuda-debian12-x86_64.list"), "{text}");
    assert!(text.contains(
        "| deb [signed-by=/etc/apt/keyrings/phq-nvidia-cuda.gpg] https://mirror.example/cuda/repos/debian12/x86_64/ /"
    ));
    assert!(text.contains("EB69 3B30 35CD 5710 E231 E123 A4B4 6996 3BF8 63CC"));
}

/// The keyring package is a carrier for NVIDIA's key and nothing more: the plan takes the key
/// out of it, and no step hands the package to dpkg (its maintainer scripts would run as root
/// on the word of a check that covered only the key). The same on every Debian and Ubuntu guest.
#[test]
fn the_keyring_package_is_never_installed_only_its_verified_key() {
    for g in GUESTS.iter().filter(|g| g.id == "ubuntu" || g.id == "debian") {
        let p = plan::plan(&facts(g, true, false, Stage::Fresh), &settings()).unwrap();
        let text = plan::render(&p);
        assert!(!text.contains("dpkg -i"), "{}: {text}", g.key);
        let repo = p.steps.iter().find(|s| s.id.as_str() == "repo").unwrap();
        let Some(plan::Action::InstallKey { deb_member, to, armored, .. }) =
            repo.actions.iter().find(|a| matches!(a, plan::Action::InstallKey { .. }))
        else {
            panic!("{}: no key step: {text}", g.key)
        };
        assert_eq!(deb_member.as_deref(), Some(plan::CUDA_KEYRING_MEMBER));
        assert_eq!((to.as_str(), *armored), (plan::NVIDIA_APT_KEYRING, false));
        // The source line is written by the installer, for NVIDIA's repository too.
        assert!(repo.actions.iter().any(|a| matches!(a, plan::Action::Write { path, .. } if *path == Distro::from_os(&os(g)).unwrap().apt_source_path())), "{text}");
    }
    // EL: the key files are written from the verified packets, never copied with `install`.
    for g in GUESTS.iter().filter(|g| g.id == "rhel") {
        let text = plan::render(&plan::plan(&facts(g, false, false, Stage::Fresh), &settings()).unwrap());
        assert!(!text.contains("$ install -m"), "{text}");
        assert!(
            text.contains("then write the verified key, armored, to /etc/pki/rpm-gpg/RPM-GPG-KEY-EPEL-9"),
            "{text}"
        );
        assert!(
            text.contains("then write the verified key, armored, to /etc/pki/rpm-gpg/RPM-GPG-KEY-NVIDIA-CUDA"),
            "{text}"
        );
    }
}

/// A mirror URL becomes a line of a file root writes: it must be one URL and nothing else, and
/// plain http only when the config says so, whichever way it reached the plan.
#[test]
fn a_mirror_url_that_would_add_a_line_or_an_option_is_refused() {
    let f = facts(&GUESTS[0], false, false, Stage::Fresh);
    for (url, why) in [
        ("https://mirror.example/cuda/repos\ndeb [trusted=yes] http://evil.example/ ./", "'\\n'"),
        ("https://mirror.example/cuda/repos [trusted=yes]", "' '"),
        ("[trusted=yes]https://mirror.example/", "'['"),
        ("https://mirror.example/repos#x", "'#'"),
        ("https://mirror.example/r\u{0}", "'\\0'"),
        ("http://mirror.example/cuda/repos", "plain http"),
        ("ftp://mirror.example/cuda/repos", "expected a https:// or http:// or file:// URL"),
        ("https://user:pw@mirror.example/", "credentials"),
    ] {
        for s in [Settings { repo_url: url.into(), ..settings() }, Settings { epel_url: url.into(), ..settings() }] {
            let e = plan::plan(&f, &s).unwrap_err().to_string();
            let setting = if s.repo_url.is_empty() { "install.epel_url" } else { "install.repo_url" };
            assert!(e.contains(setting) && e.contains(why), "{url:?}: {e}");
        }
    }
    // Allowed: http when asked for explicitly; https; a file:// mirror on a disk.
    let http = Settings { repo_url: "http://mirror.example/cuda/repos".into(), allow_plain_http: true, ..settings() };
    assert!(plan::plan(&f, &http).is_ok());
    assert!(plan::plan(&f, &Settings { repo_url: "file:///srv/cuda/repos".into(), ..settings() }).is_ok());
}

/// Debian's components file holds everything the guest's own sources lack, computed without it:
/// once written it counts as done; a source added later makes it rewritten whole, never with
/// the earlier stanza dropped.
#[test]
fn debian_components_file_is_whole_and_stable() {
    let g = GUESTS.iter().find(|g| g.id == "debian").expect("the Debian guest");
    let mut f = facts(g, false, false, Stage::Fresh);
    let first = plan::plan(&f, &settings()).unwrap();
    let step = first.steps.iter().find(|s| s.id.as_str() == "components").expect("the step");
    let Some(plan::Action::Write { contents, .. }) = step.actions.first() else { panic!("a write first") };
    assert!(step.done.is_none());
    f.apt_sources.push((plan::DEBIAN_COMPONENTS_PATH.into(), contents.clone()));
    let again = plan::plan(&f, &settings()).unwrap();
    assert!(again.steps.iter().find(|s| s.id.as_str() == "components").unwrap().done.is_some(), "written: done");

    f.apt_sources.push((
        "/etc/apt/sources.list.d/backports.list".into(),
        "deb http://debian.mirror.example/debian bookworm-backports main\n".into(),
    ));
    let later = plan::plan(&f, &settings()).unwrap();
    let step = later.steps.iter().find(|s| s.id.as_str() == "components").unwrap();
    assert!(step.done.is_none());
    let Some(plan::Action::Write { contents: whole, .. }) = step.actions.first() else { panic!() };
    assert!(
        whole.contains("Suites: bookworm bookworm-updates\n") && whole.contains("Suites: bookworm-backports\n"),
        "{whole}"
    );
}

/// RHEL with an EPEL mirror (`install.epel_url`): key and release package come from it, and the
/// key is still checked against EPEL's own fingerprint.
#[test]
fn an_epel_mirror_replaces_fedoras_host_but_not_the_key() {
    let g = GUESTS.iter().find(|g| g.id == "rhel").expect("the RHEL guest");
    let s = Settings { epel_url: "https://mirror.internal.example/epel/".into(), ..settings() };
    let text = plan::render(&plan::plan(&facts(g, false, false, Stage::Fresh), &s).unwrap());
    assert!(text.contains("fetch https://mirror.internal.example/epel/RPM-GPG-KEY-EPEL-9 →"), "{text}");
    assert!(text.contains("fetch https://mirror.internal.example/epel/epel-release-latest-9.noarch.rpm →"), "{text}");
    assert!(text.contains("is key FF8A D134 4597 106E CE81 3B91 8A38 72BF 3228 467C and nothing else"), "{text}");
    assert!(!text.contains(plan::EPEL_ROOT), "{text}");
}
