//! The boot-safety gate and MOK: before a reboot that should bring the driver up, the kernel
//! that boots next must have the installed driver's module, signed by a key the firmware trusts
//! under Secure Boot; DKMS's key is queued for enrolment with a one-time password a person types
//! at the console, and that password is deleted once the key is enrolled.
//!
//! The rules of this room:
//! 1. Never reboot into a kernel that would start without the GPU driver: refuse and say how to
//!    fix it (`install.boot-safety`).
//! 2. Never reboot unattended into shim's MOK manager: nobody would answer it
//!    (`install.mok-enrolment` says what to do at the console).
//! 3. The password goes on mokutil's stdin, is kept root-only, and is gone once the firmware
//!    trusts the key.

use super::own_dir::{own_dir, Kind};
use super::plan::{Plan, DKMS_MOK, DOWNLOAD_DIR, MOK_PASSWORD_FILE};
use super::runner::{CommandError, Runner};
use super::{ActionError, Options};
use crate::checks::Finding;
use crate::sysroot::Sysroot;

/// The boot-safety gate: before a reboot that should bring the driver up, the kernel that boots
/// next must have an `nvidia` module of the installed driver's version, and under Secure Boot
/// one signed by a key the firmware trusts; otherwise the VM would come back without its GPUs.
/// None when it is safe (or cannot be checked: said on the progress line), else the finding.
pub fn boot_gate(plan: &Plan, runner: &mut dyn Runner, o: &mut Options, head: &str) -> Option<Finding> {
    let check = plan.boot_check?;
    let kernel = next_boot_kernel(plan, runner, &Sysroot::new(&o.root));
    let modinfo = |runner: &mut dyn Runner, field: &str| {
        runner.run("modinfo", &["-k".into(), kernel.clone(), "-F".into(), field.into(), "nvidia".into()], &[])
    };
    let version = match modinfo(runner, "version") {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            (o.progress)(&format!("{head}: modinfo is not installed, so the module of kernel {kernel} cannot be checked before the reboot"));
            return None;
        }
        Err(e) => return Some(unsafe_boot(&kernel, format!("modinfo: {e}"))),
        Ok(out) if !out.ok() || out.stdout_text().trim().is_empty() => {
            return Some(unsafe_boot(&kernel, format!("kernel {kernel} has no nvidia module ({})", out.stderr.trim())))
        }
        Ok(out) => out.stdout_text().trim().to_string(),
    };
    let want = match query_driver_version(plan, runner) {
        Ok(v) => v,
        Err(e) => return Some(unsafe_boot(&kernel, e.message)),
    };
    if version != want {
        return Some(unsafe_boot(
            &kernel,
            format!("its nvidia module is version {version}, the installed driver {want}"),
        ));
    }
    if check.secure_boot {
        let signer = modinfo(runner, "signer").map(|o| o.stdout_text().trim().to_string()).unwrap_or_default();
        if signer.is_empty() {
            return Some(unsafe_boot(&kernel, "its nvidia module is unsigned and Secure Boot is on".into()));
        }
        // A module DKMS signed loads only once its machine-owner key is enrolled; a
        // distribution's signed build is trusted through shim.
        if signer.contains("DKMS") {
            match mok_state(DKMS_MOK, runner) {
                MokState::Trusted => forget_mok_password(o),
                MokState::Queued => return Some(mok_confirm(&kernel, &Sysroot::new(&o.root))),
                other => {
                    return Some(
                        unsafe_boot(&kernel, format!("its nvidia module is signed by DKMS's key ({signer}), which the firmware does not trust: {}", other.describe()))
                            .remedy(format!("Rerun phq-agent install: it queues the enrolment of {DKMS_MOK} (or by hand: `mokutil --import {DKMS_MOK}`), then confirm it at the VM console on the next boot.")),
                    );
                }
            }
        }
    }
    (o.progress)(&format!("{head}: kernel {kernel} has nvidia {version}; safe to reboot"));
    None
}

/// Whether the firmware trusts a certificate, as `mokutil --test-key` tells (mokutil's
/// `test_key` and `print_skip_message`: "is not enrolled"; "is already in db", "is already
/// enrolled" (MokListRT); "is already in the enrollment request" (MokNew); "is blocked in dbx" /
/// "in MokListX"; on stderr "is already in the built-in trusted keyring" and "Failed to open").
#[derive(Debug, Clone, PartialEq)]
enum MokState {
    Trusted,
    Queued,
    Absent,
    Blocked(String),
    /// The certificate is not there (DKMS has not signed anything yet).
    NoKey,
    Unknown(String),
}

impl MokState {
    fn describe(&self) -> String {
        match self {
            MokState::Trusted => "it is enrolled".into(),
            MokState::Queued => "its enrolment is queued, not yet confirmed".into(),
            MokState::Absent => "it is not enrolled".into(),
            MokState::Blocked(t) | MokState::Unknown(t) => format!("mokutil says {t:?}"),
            MokState::NoKey => "the certificate is not there".into(),
        }
    }
}

fn mok_state(key: &str, runner: &mut dyn Runner) -> MokState {
    let out = match runner.run("mokutil", &["--test-key".into(), key.into()], &[]) {
        Ok(out) => out,
        Err(e) => return MokState::Unknown(format!("mokutil: {e}")),
    };
    let text = format!("{}{}", out.stdout_text(), out.stderr);
    let has = |s: &str| text.contains(s);
    if has("is already enrolled") || has("is already in db") || has("is already in the built-in trusted keyring") {
        MokState::Trusted
    } else if has("is already in the enrollment request") {
        MokState::Queued
    } else if has("is blocked in") {
        MokState::Blocked(text.trim().to_string())
    } else if has("is not enrolled") {
        MokState::Absent
    } else if has("Failed to open") {
        MokState::NoKey
    } else {
        MokState::Unknown(text.trim().to_string())
    }
}

/// The one-time password of an enrolment: 12 characters a person can read off one screen and
/// type into the MOK manager's prompt (mokutil takes 1 to 256), without look-alikes (0/o, 1/l).
fn mok_password() -> std::io::Result<String> {
    const ALPHABET: &[u8] = b"abcdefghjkmnpqrstuvwxyz23456789";
    // Bytes at or above the largest multiple of the alphabet's size are skipped, so every
    // character is equally likely.
    let limit = (256 / ALPHABET.len() * ALPHABET.len()) as u8;
    // The kernel's random source, not a file of the machine under `Options::root`.
    let mut urandom = std::fs::File::open("/dev/urandom")?;
    let mut out = String::new();
    while out.len() < 12 {
        let mut bytes = [0u8; 32];
        std::io::Read::read_exact(&mut urandom, &mut bytes)?;
        out.extend(bytes.iter().filter(|b| **b < limit).map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char));
    }
    out.truncate(12);
    Ok(out)
}

/// Queue `key` for enrolment unless the firmware trusts it or it is queued already.
pub fn enroll_mok(key: &str, runner: &mut dyn Runner, o: &mut Options) -> Result<(), ActionError> {
    match mok_state(key, runner) {
        MokState::Trusted => {
            (o.progress)(&format!("      {key} is enrolled already"));
            forget_mok_password(o);
            return Ok(());
        }
        MokState::Queued => {
            (o.progress)(&format!("      {key} is queued for enrolment already; it is confirmed at the console on the next boot"));
            return Ok(());
        }
        MokState::Absent => {}
        MokState::NoKey => {
            return Err(ActionError::new(format!(
                "{key} is not there: DKMS made no signing key while building the driver (see /etc/dkms/framework.conf, mok_signing_key and mok_certificate, and `dkms status`)"
            )))
        }
        other @ (MokState::Blocked(_) | MokState::Unknown(_)) => {
            return Err(ActionError::new(format!("cannot enrol {key}: {}", other.describe())))
        }
    }
    let dir = Sysroot::new(&o.root).host_path(DOWNLOAD_DIR);
    own_dir(&dir, Kind::Private)?;
    let password = mok_password().map_err(|e| ActionError::new(format!("/dev/urandom: {e}")))?;
    let file = dir.join(MOK_PASSWORD_FILE);
    crate::durable::write(&file, format!("{password}\n").as_bytes(), 0o600)
        .map_err(|e| ActionError::new(format!("{}: {e}", file.display())))?;
    // mokutil reads the password twice from stdin (`get_password`: "input password:", "input
    // password again:"; `read_hidden_line` takes each line with getline, turning echo off only
    // when stdin is a terminal, so a pipe works).
    let input = format!("{password}\n{password}\n");
    let args: Vec<String> = vec!["--import".into(), key.into()];
    let out = runner
        .run_input("mokutil", &args, input.as_bytes())
        .map_err(|e| ActionError::new(format!("mokutil --import {key}: {e}")))?;
    if !out.ok() {
        return Err(CommandError::new("mokutil", &args, &out).into());
    }
    (o.progress)(&format!(
        "      {key} is queued for enrolment; its one-time password is in {DOWNLOAD_DIR}/{MOK_PASSWORD_FILE} (root-only)"
    ));
    Ok(())
}

/// The one-time password of a MOK enrolment is needed only until the key is enrolled: then it
/// goes, so no root-only secret lingers on the disk (or in a backup of it).
fn forget_mok_password(o: &mut Options) {
    let file = Sysroot::new(&o.root).host_path(&format!("{DOWNLOAD_DIR}/{MOK_PASSWORD_FILE}"));
    // Unlinked by its path under the root (`Sysroot` only reads): a link planted at its name is
    // removed itself, never what it points at.
    match std::fs::remove_file(&file) {
        Ok(()) => (o.progress)(&format!(
            "      DKMS's key is enrolled: its one-time password is deleted ({})",
            file.display()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => (o.progress)(&format!("      cannot delete {}: {e}", file.display())),
    }
}

/// At every run: a password kept from an earlier enrolment is deleted once the firmware trusts
/// the key (the run after the console's reboot asks nothing else of mokutil).
pub fn forget_mok_password_once_enrolled(runner: &mut dyn Runner, o: &mut Options) {
    let file = Sysroot::new(&o.root).host_path(&format!("{DOWNLOAD_DIR}/{MOK_PASSWORD_FILE}"));
    // Whatever is at its name, a link too (`Sysroot::exists` would follow one): it all goes.
    if std::fs::symlink_metadata(&file).is_ok() && mok_state(DKMS_MOK, runner) == MokState::Trusted {
        forget_mok_password(o);
    }
}

/// The reboot that confirms a queued enrolment needs a person at the console: shim's MOK
/// manager waits for a key press a few seconds, then boots on without enrolling, and the module
/// would not load. So no automatic reboot: what to do, and where the password is.
fn mok_confirm(kernel: &str, root: &Sysroot) -> Finding {
    let file = format!("{DOWNLOAD_DIR}/{MOK_PASSWORD_FILE}");
    let have = root.resolve(&file).is_ok_and(|p| p.is_file());
    let password = if have {
        format!("the one-time password is in {file} (sudo cat {file})")
    } else {
        format!("the request was queued by someone else; if its password is lost, `mokutil --revoke-import` and rerun phq-agent install to queue it again with one kept in {file}")
    };
    Finding::warn(
        "install.mok-enrolment",
        format!("reboot at the VM console to confirm DKMS's signing key: kernel {kernel} has the driver, signed by a key whose enrolment waits for a person"),
    )
    .detail(format!(
        "Secure Boot is on and the nvidia module is signed by DKMS's key ({DKMS_MOK}). Its enrolment is queued; shim's MOK manager asks for it on the next boot, only at the console, and boots on without it if nobody answers. Not rebooting unattended; {password}."
    ))
    .remedy("Open the VM's console (virtctl vnc <vm>), reboot (sudo systemctl reboot), press a key when the MOK manager appears, choose Enroll MOK → Continue → Yes, type the password, then Reboot; phq-agent-install.service resumes the install.")
}

fn unsafe_boot(kernel: &str, why: String) -> Finding {
    Finding::fail("install.boot-safety", format!("not rebooting: the kernel that boots next ({kernel}) would start without the GPU driver"))
        .detail(why)
        .remedy(format!("Rebuild the module for that kernel (`dkms autoinstall -k {kernel}`; `dkms status` shows what is built), or install the kernel's headers and rerun phq-agent install."))
}

/// The kernel the next boot starts: on EL what grubby names as the default; on Debian and
/// Ubuntu the newest `/boot/vmlinuz-*`, because GRUB's `util/grub.d/10_linux.in` lists the
/// kernels it finds in /boot newest first (`version_sort -r`, the `.old` ones last) and the
/// default entry is the first (`GRUB_DEFAULT=0`, the GRUB manual's default and what Debian and
/// Ubuntu ship in /etc/default/grub; a machine set to `saved` or another entry is not covered);
/// the running one when neither tells.
pub fn next_boot_kernel(plan: &Plan, runner: &mut dyn Runner, root: &Sysroot) -> String {
    if !plan.distro.is_deb() {
        if let Ok(out) = runner.run("grubby", &["--default-kernel".into()], &[]) {
            if let Some(k) = out.stdout_text().trim().strip_prefix("/boot/vmlinuz-").filter(|k| !k.is_empty()) {
                return k.to_string();
            }
        }
    }
    let numbers =
        |k: &str| -> Vec<u64> { k.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse().ok()).collect() };
    root.list_dir("boot")
        .unwrap_or_default()
        .into_iter()
        .filter_map(|name| name.strip_prefix("vmlinuz-").map(str::to_string))
        .max_by(|a, b| numbers(a).cmp(&numbers(b)))
        .unwrap_or_else(|| plan.kernel.clone())
}

/// The installed driver's upstream version, as the package manager has it.
pub fn query_driver_version(plan: &Plan, runner: &mut dyn Runner) -> Result<String, ActionError> {
    let pkg =
        plan.driver_package.as_deref().ok_or_else(|| ActionError::new("no driver package to take the version from"))?;
    let (program, args): (&str, Vec<String>) = if plan.distro.is_deb() {
        ("dpkg-query", vec!["-W".into(), "-f=${Version}".into(), pkg.into()])
    } else {
        ("rpm", vec!["-q".into(), "--qf".into(), "%{VERSION}".into(), pkg.into()])
    };
    let out = runner.run(program, &args, &[]).map_err(|e| ActionError::new(format!("{program}: {e}")))?;
    let text = out.stdout_text();
    let v = text.trim();
    if !out.ok() || v.is_empty() {
        return Err(ActionError::new(format!("cannot read the installed version of {pkg}: {}", out.stderr.trim())));
    }
    Ok(crate::collect::packages::upstream_version(v).to_string())
}

#[cfg(test)]
mod tests;
