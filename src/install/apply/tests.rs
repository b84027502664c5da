//! The step loop and its actions, driven through the test machine: resuming, failing,
//! retrying, the pre-flight, NCCL, the keys and the downloads.

use super::*;
use crate::install::deb::{MAX_DEB_MEMBER_BYTES, MAX_DEB_TAR_BYTES};
use crate::install::journal::{load_state, Status};
use crate::install::plan::{self, Retry};
use crate::install::test_machine::*;
use crate::install::RebootPolicy;
use crate::snapshot::{OsRelease, SecureBoot};
use std::path::Path;
use std::time::Duration;

#[test]
fn fresh_install_reboots_once_resumes_and_verifies() {
    let (dir, p, mut m) = fresh_install(None);

    let first = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    assert!(first.rebooted);
    assert_eq!(first.state.status, Status::Rebooting);
    // Fabric manager is pinned to the repository version whose upstream equals the driver's.
    assert!(
        m.ran.iter().any(|l| l.contains("install nvidia-fabricmanager-550=550.90.07-1 libnvidia-nscq-550=")),
        "{:#?}",
        m.ran
    );
    assert!(
        m.ran.iter().any(|l| l.starts_with("apt-mark hold libnvidia-compute-550 nvidia-dkms-550-open")),
        "{:#?}",
        m.ran
    );
    // NCCL: the newest build for the toolkit's CUDA (12.4), not the newest there is (13.0's),
    // then held.
    let nccl = m.ran.iter().position(|l| l.ends_with("confold install libnccl2=2.21.5-1+cuda12.4"));
    let held = m.ran.iter().position(|l| l == "apt-mark hold libnccl2");
    assert!(nccl.is_some() && nccl < held, "{:#?}", m.ran);
    // The nouveau file landed, atomically, under the root.
    assert_eq!(
        std::fs::read_to_string(dir.path().join("root/etc/modprobe.d/blacklist-nouveau.conf")).unwrap(),
        plan::NOUVEAU_CONF_TEXT
    );
    let on_disk = load_state(&dir.path().join("journal")).unwrap().unwrap();
    assert_eq!(on_disk.status, Status::Rebooting);
    assert_eq!(on_disk.reboot_pending_since.as_deref(), Some("boot-1"));

    // The resume unit runs again after the reboot: nothing is repeated, verification runs.
    let ran_before = m.ran.len();
    let second = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-2");
    assert!(!second.rebooted);
    assert_eq!(m.ran.len(), ran_before, "nothing may run twice: {:#?}", &m.ran[ran_before..]);
    assert_eq!(second.state.status, Status::Done);
    assert_eq!(second.state.reboots, 1);
    assert!(second.state.findings.iter().any(|f| f.id == "gpu.ecc"));
    assert!(second.progress.iter().any(|l| l.contains("done in an earlier run")));
}

/// A repository without NCCL for the toolkit's CUDA: nothing of NCCL is installed or held
/// (a build for another CUDA is never taken instead), the rest of the install goes on, a
/// warning names the CUDA releases there are builds for, and the step is not journaled: the
/// run after the reboot looks again, so its journal carries the warning too.
#[test]
fn without_a_build_for_the_toolkits_cuda_nccl_is_skipped_with_a_warning() {
    let (dir, p, mut m) = fresh_install(None);
    m.nccl = Some(vec!["2.28.3-1+cuda13.0", "2.27.3-1+cuda12.9", "2.26.5-1+cuda12.8", "2.19.3-1+cuda12.40"]);
    let first = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    assert!(first.rebooted);
    assert!(m.ran.iter().any(|l| l == "apt-cache madison libnccl2"), "{:#?}", m.ran);
    assert!(!m.ran.iter().any(|l| l.contains("install libnccl2") || l.contains("hold libnccl2")), "{:#?}", m.ran);
    // The later steps still ran.
    assert!(m.ran.iter().any(|l| l.starts_with("apt-mark hold libnvidia-compute-550")), "{:#?}", m.ran);
    assert!(first.progress.iter().any(|l| l.contains("skipped: NCCL is not installed")), "{:#?}", first.progress);
    let check = |st: &State| {
        let w = st.findings.iter().find(|f| f.id == "install.nccl").expect("the NCCL warning");
        assert_eq!(w.severity, Severity::Warn);
        assert!(w.summary.contains("no libnccl2 built for CUDA 12.4"), "{w:?}");
        assert!(w.detail.contains("built for CUDA 12.8, 12.9, 12.40, 13.0 only"), "{w:?}");
        // Only CUDA 12 releases the installer knows are offered (not 12.40, nor 13.0).
        assert!(
            w.remedy.as_deref().unwrap_or("").contains("install.cuda the repository has NCCL for (12.8, 12.9)"),
            "{w:?}"
        );
        assert!(!st.steps.contains_key("nccl"), "{:?}", st.steps);
    };
    check(&first.state);
    let second = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-2");
    assert_eq!(second.state.status, Status::Done);
    check(&second.state);
    // A repository with no NCCL at all says so.
    m.nccl = Some(vec![]);
    let third = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-3");
    let w = third.state.findings.iter().find(|f| f.id == "install.nccl").expect("the NCCL warning");
    assert!(w.detail.contains("It has no libnccl2 at all"), "{w:?}");
}

/// EL: `dnf repoquery` lists the builds, and dnf installs `libnccl-<version-release>`.
#[test]
fn el_takes_the_build_for_its_cuda_from_repoquery() {
    let (_, fpr) = test_key();
    let (mut f, mut s) = fresh_ubuntu_hgx("", &fpr);
    f.os = Ok(OsRelease { id: "rocky".into(), id_like: vec![], version_id: "9.4".into(), pretty_name: String::new() });
    f.kernel = Some("5.14.0-427.13.1.el9_4.x86_64".into());
    s.cuda = "12.9".into();
    s.driver_branch = 580;
    let p = plan::plan(&f, &s).unwrap();
    let step = p.steps.iter().find(|st| st.id.as_str() == "nccl").expect("the NCCL step");
    let dir = tempfile::tempdir().unwrap();
    let mut m = FakeMachine::default();
    for a in &step.actions {
        let r = with_options(dir.path(), RebootPolicy::Never, None, 1, Duration::from_secs(1), |o| {
            run_action(a, &p, &mut m, o).map_err(|e| e.message)
        })
        .0;
        assert_eq!(r, Ok(None));
    }
    assert_eq!(
        m.ran,
        [
            "dnf -y -q repoquery --available --qf %{version}-%{release} libnccl",
            "dnf -y -q install libnccl-2.27.3-1+cuda12.9",
            "dnf -y -q install python3-dnf-plugin-versionlock",
            "dnf versionlock add libnccl",
        ]
    );
}

/// More than one reboot when a step needs it: Ubuntu's signed modules are per kernel, so when
/// the VM comes back on another kernel (an upgrade that landed with the first reboot) the
/// plan installs that kernel's module package, and that step reboots again. The journal
/// counts both reboots; the third boot finds nothing to do and verifies.
#[test]
fn a_step_that_needs_a_reboot_after_the_first_gets_a_second() {
    let dir = tempfile::tempdir().unwrap();
    let (key, fpr) = test_key();
    let (mut f, s) = fresh_ubuntu_hgx(dir.path().to_str().unwrap(), &fpr);
    f.secure_boot = Some(SecureBoot::Enabled);
    let mut m = FakeMachine { key, signer: "Canonical Ltd. Kernel Module Signing".into(), ..Default::default() };
    let first = apply_once(&plan::plan(&f, &s).unwrap(), &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    assert!(first.rebooted, "{:#?}", first.progress);

    f.kernel = Some("5.15.0-126-generic".into());
    let p2 = plan::plan(&f, &s).unwrap();
    let second = apply_once(&p2, &mut m, dir.path(), RebootPolicy::Auto, "boot-2");
    assert!(
        m.ran.iter().any(|l| l.contains("linux-modules-nvidia-550-server-open-5.15.0-126-generic")),
        "{:#?}",
        m.ran
    );
    assert!(second.rebooted, "a second reboot: {:#?}", second.progress);
    assert_eq!(second.state.reboots, 1);

    let third = apply_once(&p2, &mut m, dir.path(), RebootPolicy::Auto, "boot-3");
    assert!(!third.rebooted);
    assert_eq!(third.state.status, Status::Done);
    assert_eq!(third.state.reboots, 2);
}

/// The running kernel's headers have left the mirror: the pre-flight stops and says to move
/// to the kernel the mirror carries, instead of a bare "cannot install".
#[test]
fn headers_gone_from_the_mirror_say_to_upgrade_the_kernel() {
    let dir = tempfile::tempdir().unwrap();
    let (key, fpr) = test_key();
    let (mut f, s) = fresh_ubuntu_hgx(dir.path().to_str().unwrap(), &fpr);
    f.headers_present = false;
    let p = plan::plan(&f, &s).unwrap();
    let mut m = FakeMachine { key, missing: Some(format!("linux-headers-{}", p.kernel)), ..Default::default() };
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_eq!(r.state.status, Status::Failed);
    let e = r.state.error.as_deref().unwrap();
    assert!(e.contains(&format!("The headers of the running kernel {} have left the repositories", p.kernel)), "{e}");
    assert!(e.contains("reboot into it, and run phq-agent install again"), "{e}");
}

/// subscription-manager owns redhat.repo's repositories, so those are enabled through it;
/// a RHUI repository through dnf config-manager.
#[test]
fn crb_is_enabled_through_whoever_owns_its_repository() {
    let dir = tempfile::tempdir().unwrap();
    let (_, p, mut m) = fresh_install(None);
    let run = |m: &mut FakeMachine| {
        with_options(dir.path(), RebootPolicy::Never, None, 1, Duration::from_secs(1), |o| {
            run_action(&Action::EnableCrb, &p, m, o).map_err(|e| e.message)
        })
        .0
    };
    m.repolist = repolist(&[("codeready-builder-for-rhel-9-rhui-rpms", false), ("rhel-9-baseos-rhui-rpms", true)]);
    run(&mut m).unwrap();
    assert_eq!(m.ran.last().unwrap(), "dnf config-manager --set-enabled codeready-builder-for-rhel-9-rhui-rpms");

    m.repolist =
        repolist(&[("codeready-builder-for-rhel-9-x86_64-rpms", false), ("rhel-9-for-x86_64-baseos-rpms", true)]);
    let repos = dir.path().join("root/etc/yum.repos.d");
    std::fs::create_dir_all(&repos).unwrap();
    std::fs::write(repos.join("redhat.repo"), "[codeready-builder-for-rhel-9-x86_64-rpms]\nenabled = 0\n").unwrap();
    run(&mut m).unwrap();
    assert_eq!(m.ran.last().unwrap(), "subscription-manager repos --enable codeready-builder-for-rhel-9-x86_64-rpms");

    m.repolist = repolist(&[("rhel-9-for-x86_64-baseos-rpms", true)]);
    let e = run(&mut m).unwrap_err();
    assert!(e.contains("register the machine"), "{e}");
}

#[test]
fn a_failed_step_is_journaled_and_the_rerun_starts_there() {
    let (dir, p, mut m) = fresh_install(None);
    // The toolkit resolves in the pre-flight and fails when installed.
    m.fail_when = Some("confold install cuda-toolkit-12-4".into());
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_eq!(r.state.status, Status::Failed);
    assert!(r.state.error.as_deref().unwrap().starts_with("step toolkit:"), "{:?}", r.state.error);
    let f = r.state.findings.iter().find(|f| f.id == "install.step-failed").unwrap();
    assert!(f.summary.contains("Unable to locate package"), "{}", f.summary);
    assert_eq!(m.ran.iter().filter(|l| l.contains("confold install cuda-toolkit-12-4")).count(), 4, "network retries");

    m.fail_when = None;
    m.ran.clear();
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert!(m.ran[0].contains("install cuda-toolkit-12-4"), "{:#?}", m.ran);
    assert_eq!(r.state.status, Status::RebootRequired);
    assert!(r.state.findings.iter().any(|f| f.id == "install.reboot-required"));
}

/// A step that runs again (here the driver, changed as a replaced branch changes it) makes
/// the steps after it run again too, though the journal recorded them with the same
/// commands: what they did was built on the old driver.
#[test]
fn a_step_that_runs_again_makes_the_later_steps_due() {
    let (dir, mut p, mut m) = fresh_install(None);
    m.fail_when = Some("confold install cuda-toolkit-12-4".into());
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert!(r.state.steps.contains_key("persistenced"), "{:?}", r.state.steps.keys());
    m.fail_when = None;
    m.ran.clear();
    let driver = p.steps.iter_mut().find(|s| s.id.as_str() == "driver").unwrap();
    driver.actions.push(Action::Run(super::super::plan::cmd("true", &[])));
    apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    let at = |needle: &str| m.ran.iter().position(|l| l.contains(needle));
    let (driver, persistenced) = (at("true"), at("systemctl enable nvidia-persistenced.service"));
    assert!(driver.is_some() && persistenced > driver, "{:#?}", m.ran);
}

/// A kill inside dpkg's unpacking leaves a reinst-required package, which neither
/// `dpkg --configure -a` nor `apt-get install -f` (without its archive) repairs; the repair
/// removes it first (for its step to install it again) and goes on.
#[test]
fn a_package_killed_while_unpacking_is_removed_and_installed_again() {
    let (dir, mut p, mut m) = fresh_install(None);
    // The plan's repair step, as the plan makes it for an interrupted dpkg.
    p.steps.insert(
        0,
        plan::Step {
            id: StepId::Repair,
            title: "finish what dpkg left half-done (dpkg was interrupted)".into(),
            actions: vec![Action::RepairDpkg {
                configure: plan::Cmd {
                    program: "dpkg".into(),
                    args: vec![Arg::Lit("--configure".into()), Arg::Lit("-a".into())],
                    env: vec![],
                    retry: Retry::DpkgLock,
                    url: None,
                },
                fix: plan::Cmd {
                    program: "apt-get".into(),
                    args: vec![Arg::Lit("install".into()), Arg::Lit("-f".into())],
                    env: vec![],
                    retry: Retry::Never,
                    url: None,
                },
            }],
            done: None,
            needs_reboot: false,
        },
    );
    m.reinstreq = Some("cuda-keyring".into());
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_eq!(r.state.status, Status::RebootRequired, "{:?} {:#?}", r.state.error, m.ran);
    let removed =
        m.ran.iter().position(|l| l == "dpkg --remove --force-remove-reinstreq cuda-keyring").expect("removed");
    assert!(m.ran[removed + 1] == "dpkg --configure -a", "configured after the removal: {:#?}", m.ran);
    assert!(r.progress.iter().any(|l| l.contains("cuda-keyring was interrupted while unpacking")), "{:#?}", r.progress);
}

#[test]
fn dnf_assumeno_is_a_refusal_only_when_it_says_so() {
    let resolved = "Dependencies resolved.\nTransaction Summary\nInstall  3 Packages\nOperation aborted.\nError: Operation aborted.\n";
    assert!(!dnf_refused(resolved, &unresolvable(resolved)));
    let missing = "No match for argument: cuda-toolkit-12-6\nError: Unable to find a match: cuda-toolkit-12-6\n";
    assert_eq!(unresolvable(missing), ["cuda-toolkit-12-6"]);
    assert!(dnf_refused(missing, &unresolvable(missing)));
    let conflict = "Error: \n Problem: package nvidia-driver-3:580.65.06-1.el9.x86_64 requires nvidia-kmod-common\n";
    assert!(dnf_refused(conflict, &unresolvable(conflict)));
    let apt = "Reading package lists...\nE: Unable to locate package nvidia-open-580\nE: Package 'cuda-toolkit-12-9' has no installation candidate\n";
    assert_eq!(unresolvable(apt), ["nvidia-open-580", "cuda-toolkit-12-9"]);
    // A dependency no repository has: apt's words when Debian's contrib is off (as the
    // real-apt test saw them), and dnf's.
    let dep = "The following packages have unmet dependencies:\n nvidia-driver-cuda : Depends: nvidia-support but it is not installable\nE: Unable to correct problems, you have held broken packages.\n";
    assert_eq!(unresolvable(dep), ["nvidia-support"]);
    let dnf = "Error: \n Problem: cannot install the best candidate for the job\n  - nothing provides dkms needed by kmod-nvidia-open-dkms-3:580.82.07-1.el9.noarch\n";
    assert_eq!(unresolvable(dnf), ["dkms"]);
    // dnf 4.14 -q install --assumeno, as the real-dnf test saw it.
    let quiet = "Error: Unable to find a match: cuda-toolkit-12-6 libnvidia-nscq-999\n";
    assert_eq!(unresolvable(quiet), ["cuda-toolkit-12-6", "libnvidia-nscq-999"]);
    assert!(dnf_refused(quiet, &unresolvable(quiet)));
}

/// A package the repositories lack stops the install in the pre-flight, with its name,
/// before any package is installed; the rerun, once the repositories have it, goes on.
#[test]
fn a_package_the_repositories_lack_stops_the_install_before_any_is_installed() {
    let (dir, p, mut m) = fresh_install(None);
    let steps: Vec<&str> = p.steps.iter().map(|s| s.id.as_str()).collect();
    let at = |id| steps.iter().position(|s| *s == id).unwrap();
    assert!(at("repo") < at("preflight") && at("preflight") < at("headers"), "{steps:?}");
    m.missing = Some("nvidia-fabricmanager-550".into());
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_eq!(r.state.status, Status::Failed);
    let e = r.state.error.as_deref().unwrap();
    assert!(
        e.starts_with("step preflight:")
            && e.contains("cannot install nvidia-fabricmanager-550; nothing was installed"),
        "{e}"
    );
    let simulated = m.ran.iter().position(|l| l.starts_with("apt-get -s -q install")).expect("the pre-flight ran");
    assert!(
        m.ran[simulated].contains("cuda-toolkit-12-4") && m.ran[simulated].contains("nvidia-dkms-550-open"),
        "{}",
        m.ran[simulated]
    );
    let installs_after: Vec<&String> = m.ran[simulated + 1..].iter().filter(|l| l.contains(" install ")).collect();
    assert!(installs_after.is_empty(), "installed after a failed pre-flight: {installs_after:?}");

    m.missing = None;
    m.ran.clear();
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert!(m.ran[0].starts_with("apt-get -s -q install"), "the pre-flight runs again first: {:#?}", m.ran);
    assert_eq!(r.state.status, Status::RebootRequired);
}

#[test]
fn an_unreachable_repository_names_the_url_after_bounded_retries() {
    let (dir, p, mut m) = fresh_install(None);
    m.offline = true;
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_eq!(m.fetched, 4);
    assert_eq!(m.slept, Duration::from_secs(2 + 4 + 8));
    let f = r.state.findings.iter().find(|f| f.id == "install.unreachable").unwrap();
    assert!(f.summary.contains(
        "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/cuda-keyring_1.1-1_all.deb"
    ));
    assert!(m.ran.is_empty(), "nothing may run after the repository step failed");
}

#[test]
fn downloads_go_to_a_directory_only_the_installer_can_write() {
    use std::os::unix::fs::PermissionsExt;
    let (dir, p, mut m) = fresh_install(None);
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_ne!(r.state.status, Status::Failed, "{:?}", r.state.error);
    let downloads = dir.path().join("root").join(plan::DOWNLOAD_DIR.trim_start_matches('/'));
    assert_eq!(std::fs::metadata(&downloads).unwrap().permissions().mode() & 0o777, 0o700);
    assert!(downloads.join(plan::CUDA_KEYRING_DEB).is_file());
    assert!(!plan::DOWNLOAD_DIR.starts_with("/var/lib/phq-agent/"), "never in the service's own directory");

    // A link planted where the directory should be is refused, and nothing is installed.
    let (dir, p, mut m) = fresh_install(None);
    let downloads = dir.path().join("root").join(plan::DOWNLOAD_DIR.trim_start_matches('/'));
    std::fs::create_dir_all(downloads.parent().unwrap()).unwrap();
    std::fs::create_dir_all(dir.path().join("elsewhere")).unwrap();
    std::os::unix::fs::symlink(dir.path().join("elsewhere"), &downloads).unwrap();
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_eq!(r.state.status, Status::Failed);
    assert!(r.state.error.as_deref().unwrap().contains("a symlink, or another user's"), "{:?}", r.state.error);
    assert!(!m.ran.iter().any(|l| l.starts_with("dpkg -i")), "{:#?}", m.ran);
    assert_eq!(std::fs::read_dir(dir.path().join("elsewhere")).unwrap().count(), 0);
}

#[test]
fn a_wrong_key_is_never_trusted() {
    let (dir, p, mut m) = fresh_install(Some(crate::facts::NVIDIA_REPO_KEY_FINGERPRINT));
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_eq!(r.state.status, Status::Failed);
    assert!(r.state.error.as_deref().unwrap().contains("is not the pinned key"), "{:?}", r.state.error);
    assert!(!dir.path().join("root").join(plan::NVIDIA_APT_KEYRING.trim_start_matches('/')).exists());
    assert!(!m.ran.iter().any(|l| l.starts_with("apt-get")), "{:#?}", m.ran);
}

/// A keyring package with NVIDIA's genuine key, a maintainer script and a source of its own
/// (`[trusted=yes]`): only the key is taken out of it, checked, and written by the installer;
/// the package is never given to dpkg, so its script never runs and its source never lands.
#[test]
fn a_keyring_package_gives_its_key_and_nothing_else() {
    let (dir, p, mut m) = fresh_install(None);
    m.deb_extra = vec![
        ("./DEBIAN/postinst".into(), b"#!/bin/sh\ntouch /tmp/owned\n".to_vec()),
        ("./etc/apt/sources.list.d/extra.list".into(), b"deb [trusted=yes] http://evil.example/ ./\n".to_vec()),
    ];
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_eq!(r.state.status, Status::RebootRequired, "{:?}", r.state.error);
    assert!(!m.ran.iter().any(|l| l.starts_with("dpkg -i") || l.starts_with("dpkg --install")), "{:#?}", m.ran);
    let root = dir.path().join("root");
    assert_eq!(std::fs::read(root.join(plan::NVIDIA_APT_KEYRING.trim_start_matches('/'))).unwrap(), m.key);
    assert!(!root.join("etc/apt/sources.list.d/extra.list").exists());
    let source = std::fs::read_to_string(root.join("etc/apt/sources.list.d/cuda-ubuntu2204-x86_64.list")).unwrap();
    assert!(
        source
            .contains(&format!("deb [signed-by={}] https://developer.download.nvidia.com/", plan::NVIDIA_APT_KEYRING)),
        "{source}"
    );
    // A keyring whose key file holds a second key is refused before anything is written.
    let (dir, p, mut m) = fresh_install(None);
    let (other, _) = test_key_seeded(9);
    m.key = [m.key.clone(), other].concat();
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_eq!(r.state.status, Status::Failed);
    assert!(r.state.error.as_deref().unwrap().contains("2 primary keys"), "{:?}", r.state.error);
    assert!(!dir.path().join("root").join(plan::NVIDIA_APT_KEYRING.trim_start_matches('/')).exists());
}

/// Issue 37: a keyring package from a mirror that unpacks without end (a compression bomb)
/// is read only up to the cap, and dpkg-deb stopped; a key file that claims more than a
/// keyring could be is refused without reading it. Either way nothing is trusted, and the
/// error names the package and the cap.
#[test]
fn a_keyring_package_that_unpacks_without_end_is_refused_at_the_cap() {
    for (bomb, says) in [
        (DebBomb::EndlessBefore, format!("run past {MAX_DEB_TAR_BYTES} bytes unpacked")),
        (DebBomb::HugeMember, format!("is 8589934592 bytes, past the {MAX_DEB_MEMBER_BYTES}-byte cap")),
    ] {
        let (dir, p, mut m) = fresh_install(None);
        m.deb_bomb = Some(bomb);
        let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
        assert_eq!(r.state.status, Status::Failed, "{bomb:?}");
        let e = r.state.error.as_deref().unwrap();
        assert!(e.contains(plan::CUDA_KEYRING_DEB) && e.contains(&says), "{bomb:?}: {e}");
        assert!(m.deb_read <= MAX_DEB_TAR_BYTES + 64 * 1024, "{bomb:?}: read {} bytes", m.deb_read);
        assert!(!dir.path().join("root").join(plan::NVIDIA_APT_KEYRING.trim_start_matches('/')).exists());
        assert!(!m.ran.iter().any(|l| l.starts_with("apt-get")), "{:#?}", m.ran);
    }
}

/// Issue 37: the keyring package's key file carries the pinned key and a subkey appended by
/// someone else, unbound: root's keyring gets the pinned key alone, and the run says what
/// it left out.
#[test]
fn a_foreign_subkey_never_reaches_roots_keyring() {
    let (dir, p, mut m) = fresh_install(None);
    let mut foreign = test_key_seeded(9).0;
    foreign[0] = 0xce; // the same key material as a public-subkey packet (tag 14)
    let pinned = m.key.clone();
    m.key = [pinned.clone(), foreign].concat();
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_eq!(r.state.status, Status::RebootRequired, "{:?}", r.state.error);
    let root = dir.path().join("root");
    assert_eq!(std::fs::read(root.join(plan::NVIDIA_APT_KEYRING.trim_start_matches('/'))).unwrap(), pinned);
    assert!(r.progress.iter().any(|l| l.contains("left out subkey")), "{:#?}", r.progress);
}

/// RHEL: EPEL's and NVIDIA's key files each hold exactly their pinned key, or nothing is
/// imported; what rpm imports is the agent's own armor of the verified packets.
#[test]
fn an_el_key_file_with_a_second_block_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (key, fpr) = test_key();
    let (mut f, s) = fresh_ubuntu_hgx("", &fpr);
    f.os = Ok(OsRelease { id: "rhel".into(), id_like: vec![], version_id: "9.4".into(), pretty_name: String::new() });
    f.kernel = Some("5.14.0-427.13.1.el9_4.x86_64".into());
    let p = plan::plan(&f, &s).unwrap();
    // EPEL's pinned key cannot be made here, so the plan's EPEL key step fails with its own
    // fingerprint named; NVIDIA's (the test key) is what the fetches serve.
    let armored = crate::install::pgp::armor(&key);
    let evil = crate::install::pgp::armor(&test_key_seeded(5).0);
    let mut m =
        FakeMachine { key: key.clone(), served: Some(format!("{armored}{evil}").into_bytes()), ..Default::default() };
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_eq!(r.state.status, Status::Failed);
    assert!(r.state.error.as_deref().unwrap().contains("second armored block"), "{:?}", r.state.error);
    assert!(!m.ran.iter().any(|l| l.starts_with("rpm --import")), "{:#?}", m.ran);
    assert!(!dir.path().join("root/etc/pki/rpm-gpg").exists());

    // Rocky (no EPEL key to fetch): the NVIDIA key alone, re-armored by us, is imported.
    let dir = tempfile::tempdir().unwrap();
    f.os = Ok(OsRelease { id: "rocky".into(), id_like: vec![], version_id: "9.4".into(), pretty_name: String::new() });
    let p = plan::plan(&f, &s).unwrap();
    let mut m =
        FakeMachine { key: key.clone(), served: Some(format!("{armored}{evil}").into_bytes()), ..Default::default() };
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert!(
        r.state
            .error
            .as_deref()
            .unwrap()
            .contains("D42D0685.pub is not the pinned key: it holds a second armored block"),
        "{:?}",
        r.state.error
    );
    assert!(!m.ran.iter().any(|l| l.starts_with("rpm --import")), "{:#?}", m.ran);
    let dir = tempfile::tempdir().unwrap();
    let served = format!(
        "-----BEGIN PGP PUBLIC KEY BLOCK-----\nComment: as served\n\n{}",
        armored.split_once("\n\n").unwrap().1
    );
    let mut m = FakeMachine { key, served: Some(served.into_bytes()), ..Default::default() };
    apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert!(m.ran.iter().any(|l| l == &format!("rpm --import {}", plan::RHEL_KEY_PATH)), "{:#?}", m.ran);
    let written =
        std::fs::read_to_string(dir.path().join("root").join(plan::RHEL_KEY_PATH.trim_start_matches('/'))).unwrap();
    assert_eq!(written, armored, "our armor, not the file as served");
}

#[test]
fn a_held_dpkg_lock_is_waited_for_then_given_up_on() {
    let (dir, p, mut m) = fresh_install_interrupted();
    m.lock_busy = 3;
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "b");
    assert_eq!(r.state.status, Status::RebootRequired, "{:?}", r.state.error);
    assert_eq!(m.ran.iter().filter(|l| l.starts_with("dpkg --configure -a")).count(), 4);
    assert!(r.progress.iter().any(|l| l.contains("holds the dpkg lock; waiting")));

    // Held past lock_wait: a clear failure that names the holder.
    let dir = tempfile::tempdir().unwrap();
    let mut m = FakeMachine { key: m.key.clone(), lock_busy: u32::MAX, ..Default::default() };
    let (st, _, _) =
        with_options(dir.path(), RebootPolicy::Never, None, 1, Duration::ZERO, |o| apply(&p, &mut m, o).unwrap());
    assert_eq!(st.status, Status::Failed);
    assert!(st.error.as_deref().unwrap().contains("locked by another process with pid 4242"), "{:?}", st.error);
}

#[test]
fn madison_output() {
    let v = parse_madison(" nvidia-fabricmanager-550 | 550.90.07-1 | http://r/ Packages\n\ngarbage\n");
    assert_eq!(v, ["550.90.07-1"]);
}

/// Puts a directory where the journal should be, so the next save cannot rename onto it.
fn make_journal_unwritable(state: &Path) {
    let _ = std::fs::remove_file(state);
    std::fs::create_dir_all(state.join("in-the-way")).unwrap();
}

/// A journal that cannot be written stops the install with an error naming the file: before
/// the first step; before a reboot (one asked for with the journal unsaved would resume from a
/// state that never was); and after a reboot that failed, whose journal must say so.
#[test]
fn a_journal_that_cannot_be_written_stops_the_install() {
    let (dir, p, mut m) = fresh_install(None);
    let state = dir.path().join("journal/state.json");
    make_journal_unwritable(&state);
    let (r, _, rebooted) =
        with_options(dir.path(), RebootPolicy::Auto, Some("b"), 1, Duration::ZERO, |o| apply(&p, &mut m, o));
    let e = r.unwrap_err().to_string();
    assert!(e.starts_with(&format!("{}: cannot write the journal", state.display())), "{e}");
    assert!(m.ran.is_empty() && !rebooted, "{:#?}", m.ran);

    for fail_the_reboot in [false, true] {
        let (dir, p, mut m) = fresh_install(None);
        let state = dir.path().join("journal/state.json");
        let asked = std::cell::Cell::new(false);
        // Before the reboot: as the run says it is rebooting. After: as the reboot fails.
        let mut progress = |l: &str| {
            if !fail_the_reboot && l.contains(": rebooting (") {
                make_journal_unwritable(&state);
            }
        };
        let mut verify = Vec::new;
        let mut reboot_now = || {
            asked.set(true);
            if fail_the_reboot {
                make_journal_unwritable(&state);
                anyhow::bail!("logind: the bus is gone");
            }
            Ok(())
        };
        let mut o = Options {
            journal_dir: dir.path().join("journal"),
            root: dir.path().join("root"),
            reboot: RebootPolicy::Auto,
            boot_id: Some("b".into()),
            network_tries: 1,
            lock_wait: Duration::ZERO,
            progress: &mut progress,
            verify: &mut verify,
            reboot_now: &mut reboot_now,
        };
        let e = apply(&p, &mut m, &mut o).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}: cannot write the journal", state.display())), "{e}");
        assert_eq!(asked.get(), fail_the_reboot, "a reboot asked for with the journal unsaved");
    }
}
