//! The boot-safety gate and MOK enrolment, through whole runs of the installer on the test
//! machine.

use crate::checks::Severity;
use crate::install::journal::Status;
use crate::install::plan::{self, DOWNLOAD_DIR, MOK_PASSWORD_FILE};
use crate::install::test_machine::*;
use crate::install::RebootPolicy;
use crate::snapshot::SecureBoot;

/// After its reboot the install checks the VM runs the newest installed kernel, the one it
/// meant to boot; another one (a saved GRUB default) is a warning that says so.
#[test]
fn after_its_reboot_the_install_checks_the_newest_kernel_runs() {
    let (dir, p, mut m) = fresh_install(None);
    assert!(apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1").rebooted);
    let boot = dir.path().join("root/boot");
    std::fs::create_dir_all(&boot).unwrap();
    for k in ["5.15.0-113-generic", "5.15.0-126-generic"] {
        std::fs::write(boot.join(format!("vmlinuz-{k}")), b"").unwrap();
    }
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-2");
    let f = r.state.findings.iter().find(|f| f.id == "install.running-kernel").expect("the finding");
    assert!(
        f.summary.contains("came back on kernel 5.15.0-113-generic, not the newest installed, 5.15.0-126-generic"),
        "{}",
        f.summary
    );
}

/// The boot-safety gate: the newest kernel in /boot (GRUB's default on Ubuntu) has no
/// nvidia module, so the VM would come back without its GPUs. No reboot, a failure that says
/// which kernel and what to do; once the module is built, the rerun reboots.
#[test]
fn no_reboot_into_a_kernel_without_the_driver() {
    let (dir, p, mut m) = fresh_install(None);
    let boot = dir.path().join("root/boot");
    std::fs::create_dir_all(&boot).unwrap();
    for k in ["5.15.0-113-generic", "5.15.0-126-generic", "5.15.0-99-generic"] {
        std::fs::write(boot.join(format!("vmlinuz-{k}")), b"").unwrap();
    }
    m.module = Some(String::new());
    let first = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    assert!(!first.rebooted);
    assert_eq!(first.state.status, Status::RebootRequired);
    let f = first.state.findings.iter().find(|f| f.id == "install.boot-safety").expect("the gate's finding");
    assert_eq!(f.severity, Severity::Fail);
    assert!(f.summary.contains("(5.15.0-126-generic) would start without the GPU driver"), "{}", f.summary);
    assert!(f.detail.contains("Module nvidia not found"), "{}", f.detail);
    assert!(f.remedy.as_deref().unwrap().contains("dkms autoinstall -k 5.15.0-126-generic"));
    assert!(m.ran.iter().any(|l| l == "modinfo -k 5.15.0-126-generic -F version nvidia"), "{:#?}", m.ran);

    // A module of another version is no better.
    m.module = Some("550.54.15".into());
    let second = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    assert!(!second.rebooted);
    let f = second.state.findings.iter().find(|f| f.id == "install.boot-safety").unwrap();
    assert!(f.detail.contains("version 550.54.15, the installed driver 550.90.07"), "{}", f.detail);

    // Built for that kernel: the reboot goes ahead.
    m.module = None;
    let third = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    assert!(third.rebooted, "{:#?}", third.progress);
    assert!(third
        .progress
        .iter()
        .any(|l| l.contains("kernel 5.15.0-126-generic has nvidia 550.90.07; safe to reboot")));
}

/// Under Secure Boot an unsigned module is refused before the reboot; a signed one passes.
#[test]
fn under_secure_boot_the_next_kernels_module_must_be_signed() {
    let dir = tempfile::tempdir().unwrap();
    let (key, fpr) = test_key();
    let (mut f, s) = fresh_ubuntu_hgx(dir.path().to_str().unwrap(), &fpr);
    f.secure_boot = Some(SecureBoot::Enabled);
    let p = plan::plan(&f, &s).unwrap();
    let mut m = FakeMachine { key, ..Default::default() };
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    assert!(!r.rebooted);
    let f = r.state.findings.iter().find(|f| f.id == "install.boot-safety").expect("the gate's finding");
    assert!(f.detail.contains("unsigned and Secure Boot is on"), "{}", f.detail);
    m.signer = "Canonical Ltd. Kernel Module Signing".into();
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    assert!(r.rebooted, "{:#?}", r.progress);
}

/// Debian under Secure Boot: DKMS builds and signs the driver, and the install queues DKMS's
/// key for enrolment — its one-time password on mokutil's stdin, never an argument, kept
/// root-only for the person at the console. The gate does not reboot unattended into the MOK
/// manager (nobody would answer it) but says what to do; a rerun before the console visit
/// queues nothing twice; once the key is enrolled the rerun reboots.
#[test]
fn secure_boot_with_dkms_queues_the_key_and_waits_for_the_console() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (p, mut m) = fresh_debian_sb(dir.path());
    let ids: Vec<&str> = p.steps.iter().map(|s| s.id.as_str()).collect();
    let (driver, mok) = (ids.iter().position(|i| *i == "driver"), ids.iter().position(|i| *i == "mok"));
    assert!(driver.is_some() && mok > driver, "{ids:?}");
    assert!(!p.findings.iter().any(|f| f.severity == Severity::Fail), "{:#?}", p.findings);

    let first = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    assert!(!first.rebooted, "{:#?}", first.progress);
    assert_eq!(first.state.status, Status::RebootRequired);
    let f = first.state.findings.iter().find(|f| f.id == "install.mok-enrolment").expect("the console finding");
    assert!(f.remedy.as_deref().unwrap().contains("Enroll MOK"), "{f:?}");
    let file = dir.path().join("root").join(DOWNLOAD_DIR.trim_start_matches('/')).join(MOK_PASSWORD_FILE);
    assert!(f.detail.contains(&format!("{DOWNLOAD_DIR}/{MOK_PASSWORD_FILE}")), "{}", f.detail);
    let password = std::fs::read_to_string(&file).unwrap().trim().to_string();
    assert_eq!(password.len(), 12);
    assert!(password.bytes().all(|c| b"abcdefghjkmnpqrstuvwxyz23456789".contains(&c)), "{password}");
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(m.stdin, vec![format!("{password}\n{password}\n")]);
    assert!(m.ran.iter().any(|l| l == "mokutil --import /var/lib/dkms/mok.pub"), "{:#?}", m.ran);
    assert!(!m.ran.iter().any(|l| l.contains(&password)), "the password is never an argument");
    assert!(!first.progress.iter().any(|l| l.contains(&password)), "nor printed");

    // Rerun before anyone came to the console: nothing queued twice, still no reboot.
    let second = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    assert!(!second.rebooted);
    assert_eq!(m.ran.iter().filter(|l| l.starts_with("mokutil --import")).count(), 1);

    // Confirmed at the console: the gate lets the reboot happen.
    m.mok = FakeMok::Enrolled;
    let third = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    assert!(third.rebooted, "{:#?}", third.progress);
    // Enrolled: the one-time password has served, and is gone from the disk.
    assert!(!file.exists(), "the MOK password outlived the enrolment");
    assert!(third.progress.iter().any(|l| l.contains("one-time password is deleted")), "{:#?}", third.progress);
}

/// The run after the console's reboot asks mokutil nothing in its steps (the enrolment step
/// is journaled, the reboot is behind it): the password is deleted all the same, once the
/// firmware trusts the key, and kept while it does not.
#[test]
fn the_mok_password_goes_once_the_key_is_enrolled() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mut m) = fresh_debian_sb(dir.path());
    apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    let file = dir.path().join("root").join(DOWNLOAD_DIR.trim_start_matches('/')).join(MOK_PASSWORD_FILE);
    assert!(file.is_file());
    // Still queued on the next boot (nobody came to the console): kept.
    apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "boot-2");
    assert!(file.is_file());
    m.mok = FakeMok::Enrolled;
    apply_once(&p, &mut m, dir.path(), RebootPolicy::Never, "boot-3");
    assert!(!file.exists());
}

/// DKMS made no key (a framework.conf pointing elsewhere): the step fails saying so, and
/// nothing is imported.
#[test]
fn secure_boot_without_a_dkms_key_says_where_it_looked() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mut m) = fresh_debian_sb(dir.path());
    m.mok = FakeMok::NoKey;
    let r = apply_once(&p, &mut m, dir.path(), RebootPolicy::Auto, "boot-1");
    assert_eq!(r.state.status, Status::Failed);
    let e = r.state.error.unwrap();
    assert!(e.starts_with("step mok: /var/lib/dkms/mok.pub is not there: DKMS made no signing key"), "{e}");
    assert!(!m.ran.iter().any(|l| l.starts_with("mokutil --import")));
}
