//! The pre-flight: every package the remaining steps install, resolved at once right after the
//! repository, so a name the repositories do not have stops the install before the first
//! package changes.

use super::{Action, Arg, Cmd, Step, StepId, DEBIAN_PIN_PATH};

/// Inserts the pre-flight after the repository (and the pin), when anything is left to install.
pub(super) fn insert(steps: &mut Vec<Step>) {
    // Pre-flight, right after the repository (nothing can be resolved before it): every package
    // the remaining steps install, resolved at once, so a name the repositories do not have
    // stops the install before the first package changes, not half-way through it.
    let at = steps.iter().rposition(|st| matches!(st.id, StepId::Pin | StepId::Repo)).map_or(0, |i| i + 1);
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
                id: StepId::Preflight,
                title: format!("resolve all {} packages before installing any", wanted.len()),
                actions,
                done: None,
                needs_reboot: false,
            },
        );
    }
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
