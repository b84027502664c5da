//! What a person reads and the journal hashes: each action as lines (`--dry-run`), each step's
//! hash over those lines (a journal entry counts only for the same hash), the plan's summary.
//! A change here changes every golden plan (tests/golden/plans/) and reruns journaled steps.

use super::choices::Choices;
use super::{Action, Arg, Cmd, Facts, Plan, Step, StepId, DOWNLOAD_DIR, MOK_PASSWORD_FILE};
use crate::snapshot::SecureBoot;

/// The plan's one line: the guest, its GPUs and Secure Boot, and what is installed.
pub(super) fn summary(f: &Facts, c: &Choices) -> String {
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
    format!(
        "{}, kernel {}, {gpus}, {sb} → driver {} (open kernel modules), CUDA {}",
        c.distro.name(),
        c.kernel,
        c.branch,
        c.cuda
    )
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
            Some(why) if s.id == StepId::Reboot || s.actions.is_empty() => {
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
