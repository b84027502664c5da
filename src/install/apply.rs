//! Apply a plan: every command through a `Runner` (program + arguments, never a shell), every
//! finished step journaled in `JOURNAL_DIR/state.json` (written whole to a temporary file,
//! fsynced, renamed), one installer at a time under a `flock` (`lock.rs`).
//!
//! The journal, its lock and the log live in a directory that root owns and nobody else can
//! write (`own_dir.rs`), never in the service's state directory: the service's user owns that
//! one, and whatever it can write it could turn into a link that root follows, or into a
//! journal that starts a root install at the next boot.
//!
//! Resuming is planning again: a step the machine already has is skipped by the plan, and one
//! whose effect the plan cannot see (a hold, an enabled unit in a chroot) is skipped when the
//! journal holds it with the same hash. A step killed half-way is not journaled, so it runs
//! again — each is idempotent.
//!
//! This room is the step loop and the actions; the journal's statuses move only through its
//! transitions (`journal.rs`), and every save that fails stops the run with the file named.

use super::boot_gate::{
    boot_gate, enroll_mok, forget_mok_password_once_enrolled, next_boot_kernel, query_driver_version,
};
use super::crb::enable_crb;
use super::deb::deb_member_bytes;
use super::journal::{load_state, save, JournalError, State};
use super::own_dir::{own_dir, Kind};
use super::plan::{built_for_cuda, newest_for_cuda, Action, Arg, Cmd, Plan, Step, StepId, DEB_ENV};
use super::runner::{lit_args, run_cmd, run_cmd_output, tail_lines, Runner};
use super::{ActionError, Options, RebootPolicy};
use crate::checks::{Finding, Severity};
use crate::sysroot::Sysroot;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

/// Runs the plan to its end, a failure, or a reboot; returns the journal as it was left. An
/// error only when the journal cannot be written (or would say what did not happen).
pub fn apply(plan: &Plan, runner: &mut dyn Runner, o: &mut Options) -> Result<State, JournalError> {
    let mut st = match load_state(&o.journal_dir) {
        Ok(Some(st)) => st,
        Ok(None) => State::new(&plan.summary),
        Err(e) => {
            (o.progress)(&format!("the journal is unreadable ({e}); starting it afresh — every step is idempotent"));
            State::new(&plan.summary)
        }
    };
    forget_mok_password_once_enrolled(runner, o);
    st.begin(&plan.summary, plan.findings.clone(), o.boot_id.as_deref())?;
    save(&o.journal_dir, &mut st)?;

    let n = plan.steps.len();
    for (i, step) in plan.steps.iter().enumerate() {
        let head = format!("[{}/{n}] {}", i + 1, step.id);
        let flow = if step.actions.iter().any(|a| matches!(a, Action::Reboot)) {
            reboot_step(plan, runner, o, &mut st, &head)?
        } else if let Some(why) = &step.done {
            let said = if step.actions.is_empty() { "not needed" } else { "already done" };
            (o.progress)(&format!("{head}: {said} ({why})"));
            ControlFlow::Continue(())
        // The repair is planned only when dpkg is half-done now, so a repair finished in an
        // earlier run says nothing about this one (a later kill can leave dpkg half-done again).
        } else if step.id != StepId::Repair && st.has_step(step.id, &step.hash(plan.distro.is_deb())) {
            (o.progress)(&format!("{head}: done in an earlier run"));
            ControlFlow::Continue(())
        } else if step.actions.iter().any(|a| matches!(a, Action::Verify)) {
            verify_step(step, plan, runner, o, &mut st, &head)?
        } else {
            run_step(i, plan, runner, o, &mut st, &head)?
        };
        if flow.is_break() {
            return Ok(st);
        }
    }
    st.complete(Vec::new())?;
    save(&o.journal_dir, &mut st)?;
    Ok(st)
}

/// The reboot, decided by the journal as much as by the plan: a step of an earlier run in this
/// same boot may be waiting for it. Behind the boot-safety gate; the run ends here when one is
/// due.
fn reboot_step(
    plan: &Plan,
    runner: &mut dyn Runner,
    o: &mut Options,
    st: &mut State,
    head: &str,
) -> Result<ControlFlow<()>, JournalError> {
    // The installed driver is not the one loaded, and this install has not rebooted yet.
    if st.reboots == 0 {
        if let Some(r) = &plan.reboot_reason {
            st.need_reboot(o.boot_id.as_deref(), r.clone())?;
        }
    }
    let Some(reason) = st.reboot_pending().map(str::to_string) else {
        (o.progress)(&format!("{head}: not needed"));
        return Ok(ControlFlow::Continue(()));
    };
    match boot_gate(plan, runner, o, head) {
        Some(unsafe_boot) => {
            st.await_reboot(Some(unsafe_boot.summary.clone()), unsafe_boot)?;
            save(&o.journal_dir, st)?;
        }
        None => reboot(st, o, head, &reason)?,
    }
    Ok(ControlFlow::Break(()))
}

/// Reboots (`--reboot auto`) or says one is required (`--reboot never`), and saves what it
/// changed. The journal says "rebooting" on disk before the reboot is asked for: a reboot with
/// an unsaved journal would resume from a state that never was, so a failed save stops short of
/// it; after the reboot is asked for, nothing is left to write.
fn reboot(st: &mut State, o: &mut Options, head: &str, reason: &str) -> Result<(), JournalError> {
    match o.reboot {
        RebootPolicy::Never => {
            (o.progress)(&format!("{head}: a reboot is required ({reason}); not rebooting (--reboot never)"));
            st.await_reboot(
                None,
                Finding::warn("install.reboot-required", format!("reboot required: {reason}")).remedy(
                    "Reboot the VM; phq-agent-install.service resumes the install (or run phq-agent install again)",
                ),
            )?;
            save(&o.journal_dir, st)?;
        }
        RebootPolicy::Auto => {
            (o.progress)(&format!("{head}: rebooting ({reason}); phq-agent-install.service resumes after it"));
            st.start_reboot()?;
            save(&o.journal_dir, st)?;
            if let Err(e) = (o.reboot_now)() {
                st.await_reboot(
                    Some(format!("could not reboot: {e:#}")),
                    Finding::fail(
                        "install.reboot-required",
                        format!("reboot required ({reason}), and rebooting failed: {e:#}"),
                    )
                    .remedy("Reboot the VM by hand; the install resumes after it"),
                )?;
                save(&o.journal_dir, st)?;
            }
        }
    }
    Ok(())
}

/// The doctor's checks, and after the install's own reboot the kernel it meant to boot.
fn verify_step(
    step: &Step,
    plan: &Plan,
    runner: &mut dyn Runner,
    o: &mut Options,
    st: &mut State,
    head: &str,
) -> Result<ControlFlow<()>, JournalError> {
    (o.progress)(&format!("{head}: {}", step.title));
    let mut wrong: Vec<Finding> = (o.verify)().into_iter().filter(|f| f.severity >= Severity::Warn).collect();
    // After the install's own reboot the VM should run the kernel it meant to boot, the
    // newest installed (the gate checked that one has the module).
    if st.reboots > 0 {
        let next = next_boot_kernel(plan, runner, &Sysroot::new(&o.root));
        if next != plan.kernel {
            wrong.push(
                Finding::warn(
                    "install.running-kernel",
                    format!("the VM came back on kernel {}, not the newest installed, {next}", plan.kernel),
                )
                .detail("The install rebooted expecting the newest kernel, the one GRUB's default entry starts and the boot-safety gate checked; the boot loader chose another (GRUB_DEFAULT set to a saved or named entry, or a choice at the console).")
                .remedy(format!("Check GRUB_DEFAULT in /etc/default/grub (0 boots the newest), or boot {next} once with `grub-reboot`; `phq-agent doctor` shows whether each kernel has the module.")),
            );
        }
    }
    for f in &wrong {
        (o.progress)(&format!("      {} {}: {}", f.severity.label(), f.id, f.summary));
    }
    st.complete(wrong)?;
    save(&o.journal_dir, st)?;
    Ok(ControlFlow::Break(()))
}

/// Runs step `i`'s actions and journals it; the run ends when one fails.
fn run_step(
    i: usize,
    plan: &Plan,
    runner: &mut dyn Runner,
    o: &mut Options,
    st: &mut State,
    head: &str,
) -> Result<ControlFlow<()>, JournalError> {
    let step = &plan.steps[i];
    // A step that runs (again) may change what the later steps built on: a replaced driver
    // takes its fabric manager's match and its version locks with it, though the later
    // steps' commands read the same (real dnf showed the locks gone and the journal calling
    // the hold done). Their records go, so they are judged afresh. Not for the dpkg repair,
    // which finishes earlier work rather than changing it, nor for the pre-flight, which
    // runs whenever anything is left and only resolves.
    let later: Vec<StepId> = if matches!(step.id, StepId::Repair | StepId::Preflight) {
        Vec::new()
    } else {
        plan.steps[i + 1..].iter().map(|s| s.id).collect()
    };
    st.start_step(&later)?;
    (o.progress)(&format!("{head}: {}", step.title));
    let started = Instant::now();
    for action in &step.actions {
        match run_action(action, plan, runner, o) {
            Ok(None) => {}
            // Skipped with a warning (NCCL with no build for this CUDA): the install goes on,
            // and the step is not journaled, so the next run looks at the repository again.
            Ok(Some(why)) => {
                (o.progress)(&format!("      skipped: {}", why.summary));
                st.skip_step(why)?;
                save(&o.journal_dir, st)?;
                return Ok(ControlFlow::Continue(()));
            }
            Err(e) => {
                st.fail(format!("step {}: {}", step.id, e.message), e.finding(step.id))?;
                save(&o.journal_dir, st)?;
                return Ok(ControlFlow::Break(()));
            }
        }
    }
    let seconds = (started.elapsed().as_secs_f64() * 10.0).round() / 10.0;
    (o.progress)(&format!("      ok ({seconds} s)"));
    st.finish_step(step.id, step.hash(plan.distro.is_deb()), seconds, step.needs_reboot, o.boot_id.as_deref())?;
    save(&o.journal_dir, st)?;
    Ok(ControlFlow::Continue(()))
}

/// Runs one action. `Ok(Some(finding))`: the action found there is nothing it may do on this
/// guest (`Action::InstallForCuda` without a build for the CUDA); the rest of its step is
/// skipped, and the finding says why.
fn run_action(
    a: &Action,
    plan: &Plan,
    runner: &mut dyn Runner,
    o: &mut Options,
) -> Result<Option<Finding>, ActionError> {
    match a {
        Action::InstallForCuda { package, cuda, query, install } => {
            install_for_cuda(package, cuda, query, install, plan, runner, o)
        }
        a => run_plain_action(a, plan, runner, o).map(|()| None),
    }
}

fn run_plain_action(a: &Action, plan: &Plan, runner: &mut dyn Runner, o: &mut Options) -> Result<(), ActionError> {
    match a {
        Action::Run(c) => {
            let args = resolve_args(c, plan, runner)?;
            run_cmd(c, &args, runner, o)
        }
        Action::Write { path, contents } => {
            let target = Sysroot::new(&o.root).host_path(path);
            (o.progress)(&format!("      write {path}"));
            crate::durable::write(&target, contents.as_bytes(), 0o644)
                .map_err(|e| ActionError::new(format!("{}: {e}", target.display())))
        }
        Action::Fetch { url, to } => {
            let target = Sysroot::new(&o.root).host_path(to);
            if let Some(dir) = target.parent() {
                own_dir(dir, Kind::Private)?;
            }
            (o.progress)(&format!("      fetch {url}"));
            let mut last = String::new();
            for attempt in 1..=o.network_tries.max(1) {
                match runner.fetch(url, &target) {
                    Ok(()) => return Ok(()),
                    Err(e) => last = format!("{e:#}"),
                }
                if attempt < o.network_tries {
                    runner.sleep(Duration::from_secs(1 << attempt.min(5)));
                }
            }
            Err(ActionError {
                message: format!("{last} (tried {} times)", o.network_tries.max(1)),
                url: Some(url.clone()),
            })
        }
        Action::InstallKey { file, deb_member, fingerprint, to, armored } => {
            install_key(file, deb_member.as_deref(), fingerprint, to, *armored, runner, o)
        }
        Action::Resolve(pkgs) => resolve(pkgs, plan, runner, o),
        Action::RepairDpkg { configure, fix } => {
            // First the packages whose unpacking was killed: dpkg leaves them out of
            // --configure -a, and apt-get -f cannot reinstall one without its archive (the
            // keyring, whose own repository is not set up yet, is the usual one).
            let broken = reinst_required(runner)?;
            if !broken.is_empty() {
                (o.progress)(&format!(
                    "      {} was interrupted while unpacking: removing it for its step to install again",
                    broken.join(", ")
                ));
                let mut remove = vec!["--remove".to_string(), "--force-remove-reinstreq".to_string()];
                remove.extend(broken);
                let c = Cmd { args: remove.into_iter().map(Arg::Lit).collect(), ..configure.clone() };
                run_cmd(&c, &lit_args(&c), runner, o)?;
            }
            run_cmd(configure, &lit_args(configure), runner, o)?;
            run_cmd(fix, &lit_args(fix), runner, o)
        }
        Action::EnrollMok { key } => enroll_mok(key, runner, o),
        Action::EnableCrb => enable_crb(runner, o),
        Action::Reboot | Action::Verify => Ok(()),
        Action::InstallForCuda { .. } => {
            Err(ActionError::new("a package for a CUDA release is installed by run_action"))
        }
    }
}

/// The trust gate (`Action::InstallKey`): the key file, or the keyring inside the .deb, must be
/// the pinned key and nothing else; then what was checked is written, not the file.
fn install_key(
    file: &str,
    deb_member: Option<&str>,
    fingerprint: &str,
    to: &str,
    armored: bool,
    runner: &mut dyn Runner,
    o: &mut Options,
) -> Result<(), ActionError> {
    let path = Sysroot::new(&o.root).host_path(file);
    if let Some(dir) = path.parent() {
        own_dir(dir, Kind::Private)?; // still root's alone
    }
    let bytes = match deb_member {
        Some(member) => deb_member_bytes(&path, member, runner)?,
        // Root's own download, read without following a link (a `Sysroot` would follow
        // one inside the root).
        None => crate::sysroot::read_regular(&path, true, 1 << 20)
            .map_err(|e| ActionError::new(format!("{}: {e}", path.display())))?,
    };
    let key = super::pgp::verified(&bytes, fingerprint)
        .map_err(|e| ActionError::new(format!("{file} is not the pinned key: {e}; nothing from it was trusted")))?;
    // What was checked is what is written: the packets read above, by us, not the file.
    let target = Sysroot::new(&o.root).host_path(to);
    let out = if armored { key.armored().into_bytes() } else { key.binary().to_vec() };
    crate::durable::write(&target, &out, 0o644).map_err(|e| ActionError::new(format!("{}: {e}", target.display())))?;
    for sub in &key.unbound_subkeys {
        (o.progress)(&format!("      left out subkey {}: the pinned key does not bind it", super::pgp::spaced(sub)));
    }
    (o.progress)(&format!("      key {} verified and written to {to}", super::pgp::spaced(fingerprint)));
    Ok(())
}

/// Packages dpkg marks reinst-required (the third letter of `db:Status-Abbrev` is `R`): their
/// unpacking was interrupted, and dpkg will do nothing more with them until they are installed
/// again or removed with --force-remove-reinstreq (dpkg(1), dpkg-query(1)).
fn reinst_required(runner: &mut dyn Runner) -> Result<Vec<String>, ActionError> {
    let args = vec!["-W".to_string(), "-f=${db:Status-Abbrev}${Package}\n".to_string()];
    let out = runner.run("dpkg-query", &args, &[]).map_err(|e| ActionError::new(format!("dpkg-query: {e}")))?;
    Ok(out
        .stdout_text()
        .lines()
        .filter(|l| l.as_bytes().get(2) == Some(&b'R'))
        .filter_map(|l| l.get(3..).map(|n| n.trim().to_string()))
        .filter(|n| !n.is_empty())
        .collect())
}

/// The pre-flight: asks the package manager to resolve every package without installing any,
/// and turns a refusal into the names it could not find. apt-get -s exits non-zero when a
/// package cannot be resolved ("Unable to locate package", "has no installation candidate",
/// unmet dependencies); dnf with --assumeno always exits 1 ("Operation aborted") and says
/// "No match for argument" or "Problem" when it cannot.
fn resolve(pkgs: &[String], plan: &Plan, runner: &mut dyn Runner, o: &mut Options) -> Result<(), ActionError> {
    let deb = plan.distro.is_deb();
    let (program, mut args): (&str, Vec<String>) = if deb {
        ("apt-get", vec!["-s".into(), "-q".into(), "install".into()])
    } else {
        ("dnf", vec!["-q".into(), "install".into(), "--assumeno".into()])
    };
    args.extend(pkgs.iter().cloned());
    (o.progress)(&format!("      $ {program} {}", args.join(" ")));
    let env: Vec<(String, String)> =
        if deb { DEB_ENV.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect() } else { Vec::new() };
    let out = runner.run(program, &args, &env).map_err(|e| ActionError::new(format!("{program}: {e}")))?;
    let text = format!("{}\n{}", out.stdout_text(), out.stderr);
    let missing = unresolvable(&text);
    let refused = if deb { !out.ok() } else { dnf_refused(&text, &missing) };
    if !refused {
        (o.progress)(&format!("      all {} packages resolve", pkgs.len()));
        return Ok(());
    }
    let names = if missing.is_empty() {
        "the whole set (in the package manager's words:)".to_string()
    } else {
        missing.join(", ")
    };
    // The running kernel's own headers gone from the mirror is the usual case on a guest that
    // has not been upgraded for a while: DKMS cannot build for this kernel any more.
    let headers = [format!("linux-headers-{}", plan.kernel), format!("kernel-devel-{}", plan.kernel)];
    let kernel_gone = if missing.iter().any(|m| headers.contains(m)) {
        let upgrade = if deb {
            "apt-get install linux-image-<flavour> linux-headers-<flavour>"
        } else {
            "dnf upgrade kernel kernel-devel"
        };
        format!(
            " The headers of the running kernel {} have left the repositories (they carry a newer kernel now): upgrade the kernel (`{upgrade}`), reboot into it, and run phq-agent install again.",
            plan.kernel
        )
    } else {
        String::new()
    };
    Err(ActionError::new(format!(
        "pre-flight: the repositories cannot install {names}; nothing was installed.{kernel_gone} {}",
        tail_lines(&text, 6)
    )))
}

/// Whether dnf's answer to `install --assumeno` is a refusal. It always exits 1 and ends with
/// "Error: Operation aborted." when it resolved everything and was told not to go on (dnf's CLI
/// raises that as an error); a real refusal says "No match for argument", "Problem" or another
/// error.
fn dnf_refused(text: &str, missing: &[String]) -> bool {
    !missing.is_empty()
        || text.contains("Problem")
        || text.lines().any(|l| l.trim_start().starts_with("Error:") && !l.contains("Operation aborted"))
}

/// Package names a resolver's output says it cannot install: asked for and unknown (apt's
/// "Unable to locate package", dnf's "No match for argument"), or a dependency no repository
/// has (apt's "X : Depends: Y but it is not installable", dnf's "nothing provides Y needed by X").
fn unresolvable(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        let l = line.trim();
        // dnf -q keeps only its closing error, which names every argument it found nothing for
        // on one line ("Error: Unable to find a match: a b"; dnf's MarkingErrors): the real-dnf
        // test (tests/install_el9.rs) saw no "No match for argument" line under -q.
        if let Some(names) = l.strip_prefix("Error: Unable to find a match: ") {
            for n in names.split_whitespace() {
                if !out.iter().any(|o| o == n) {
                    out.push(n.to_string());
                }
            }
            continue;
        }
        let name = l
            .strip_prefix("E: Unable to locate package ")
            .or_else(|| l.strip_prefix("No match for argument: "))
            .map(|n| n.trim().to_string())
            .or_else(|| {
                let rest = l.strip_prefix("E: Package '")?;
                rest.split_once('\'').map(|(n, _)| n.to_string())
            })
            .or_else(|| {
                let dep = l.strip_suffix(" but it is not installable")?.rsplit_once("Depends: ")?.1;
                dep.split_whitespace().next().map(str::to_string)
            })
            .or_else(|| {
                let rest = l.split_once("nothing provides ")?.1;
                rest.split_whitespace().next().map(str::to_string)
            });
        if let Some(n) = name.filter(|n| !n.is_empty() && !out.contains(n)) {
            out.push(n);
        }
    }
    out
}

/// `Arg::AtDriverVersion` becomes `pkg=<the repository's version of pkg whose upstream part is
/// the installed driver's>` (apt) or `pkg-<driver version>` (dnf).
fn resolve_args(c: &Cmd, plan: &Plan, runner: &mut dyn Runner) -> Result<Vec<String>, ActionError> {
    let mut driver_version: Option<String> = None;
    let mut out = Vec::new();
    for a in &c.args {
        match a {
            Arg::Lit(s) => out.push(s.clone()),
            Arg::AtDriverVersion(pkg) => {
                if driver_version.is_none() {
                    driver_version = Some(query_driver_version(plan, runner)?);
                }
                let dv = driver_version.as_deref().unwrap_or_default();
                if plan.distro.is_deb() {
                    out.push(format!("{pkg}={}", candidate_at(pkg, dv, runner)?));
                } else {
                    out.push(format!("{pkg}-{dv}"));
                }
            }
        }
    }
    Ok(out)
}

/// The repository version of `pkg` whose upstream part equals `upstream` (`apt-cache madison`).
fn candidate_at(pkg: &str, upstream: &str, runner: &mut dyn Runner) -> Result<String, ActionError> {
    let out = runner
        .run("apt-cache", &["madison".into(), pkg.into()], &[])
        .map_err(|e| ActionError::new(format!("apt-cache: {e}")))?;
    let versions = parse_madison(&out.stdout_text());
    versions.iter().find(|v| crate::collect::packages::upstream_version(v) == upstream).cloned().ok_or_else(|| {
        ActionError::new(format!(
            "the repository has no {pkg} at the driver's version {upstream} (it has: {}); fabric manager must equal the driver exactly",
            if versions.is_empty() { "none".to_string() } else { versions.join(", ") }
        ))
    })
}

/// ` nvidia-fabricmanager-550 | 550.90.07-1 | http://… Packages` → versions.
pub fn parse_madison(text: &str) -> Vec<String> {
    text.lines().filter_map(|l| l.split('|').nth(1)).map(|v| v.trim().to_string()).filter(|v| !v.is_empty()).collect()
}

/// `Action::InstallForCuda`: the repository's versions of `package` from `query`, the newest
/// built for `cuda` installed with `install`; none, a warning and nothing installed.
fn install_for_cuda(
    package: &str,
    cuda: &str,
    query: &Cmd,
    install: &Cmd,
    plan: &Plan,
    runner: &mut dyn Runner,
    o: &mut Options,
) -> Result<Option<Finding>, ActionError> {
    let out = run_cmd_output(query, &lit_args(query), runner, o)?;
    let text = out.stdout_text();
    // apt-cache madison: ` libnccl2 | 2.27.3-1+cuda12.9 | <uri> Packages`, and nothing (exit 0)
    // for a name no source has. dnf repoquery --qf: one `version-release` a line.
    let versions: Vec<String> = if plan.distro.is_deb() {
        parse_madison(&text)
    } else {
        text.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_string).collect()
    };
    let Some(version) = newest_for_cuda(&versions, cuda) else {
        let mut cudas: Vec<&str> = versions.iter().filter_map(|v| built_for_cuda(v)).collect();
        cudas.sort_by(|a, b| crate::facts::version_cmp(a, b));
        cudas.dedup();
        let has = if versions.is_empty() {
            format!("no {package} at all")
        } else {
            format!("{package} built for CUDA {} only", cudas.join(", "))
        };
        // Only what install.cuda takes (a CUDA 12 toolkit it knows) is offered as a choice.
        let choices: Vec<&str> = cudas
            .iter()
            .copied()
            .filter(|c| c.starts_with("12.") && crate::facts::cuda_min_driver(c).is_some())
            .collect();
        let remedy = if choices.is_empty() {
            format!("Use a mirror that carries NVIDIA's NCCL packages (install.repo_url), or install NCCL built for CUDA {cuda} yourself; then rerun phq-agent install")
        } else {
            format!("Choose an install.cuda the repository has NCCL for ({}), or install NCCL built for CUDA {cuda} yourself; then rerun phq-agent install", choices.join(", "))
        };
        return Ok(Some(
            Finding::warn("install.nccl", format!("NCCL is not installed: the repository has no {package} built for CUDA {cuda}"))
                .detail(format!("It has {has}. A build for another CUDA is not installed in its place: NCCL must be built for the toolkit's CUDA ({cuda}). Without NCCL the all-reduce probe (probe.allreduce) cannot run; everything else is installed."))
                .remedy(remedy)
                .evidence("package", package)
                .evidence("cuda", cuda)
                .evidence("versions", &versions),
        ));
    };
    let pinned = if plan.distro.is_deb() { format!("{package}={version}") } else { format!("{package}-{version}") };
    let mut args = lit_args(install);
    args.push(pinned);
    run_cmd(install, &args, runner, o).map(|()| None)
}

#[cfg(test)]
mod tests;
