//! RHEL's CodeReady Builder repository, which EPEL's DKMS builds against: its id differs by how
//! the machine gets its packages (Red Hat's CDN, EUS, a cloud's RHUI), so it is read from
//! `dnf repolist --all`, matched to the enabled BaseOS, and enabled through whoever owns it.

use super::plan::{cmd, Cmd, Retry};
use super::runner::{lit_args, run_cmd, CommandError, Runner};
use super::{ActionError, Options};
use crate::sysroot::Sysroot;

/// Why no CodeReady Builder repository can be chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CrbError {
    #[error("no BaseOS repository is enabled (dnf repolist --all), so there is no telling which CodeReady Builder repository goes with it")]
    NoBaseos,
    #[error(
        "no CodeReady Builder repository goes with the enabled {baseos} (dnf knows {}); register the machine (subscription-manager register) or ask the cloud's RHUI for it",
        if known.is_empty() { "none".to_string() } else { known.join(", ") }
    )]
    NoneGoesWith { baseos: String, known: Vec<String> },
    #[error("several CodeReady Builder repositories go with {baseos}: {}; enable one (dnf config-manager --set-enabled <id>) and rerun", ids.join(", "))]
    Several { baseos: String, ids: Vec<String> },
}

/// `dnf repolist --all`: each repository's id and whether it is enabled. dnf prints a header
/// ("repo id  repo name  status") and one line per repository, the id first and the status last.
pub fn parse_repolist(text: &str) -> Vec<(String, bool)> {
    text.lines()
        .filter(|l| !l.starts_with("repo id"))
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let enabled = match *words.last()? {
                "enabled" => true,
                "disabled" => false,
                _ => return None,
            };
            Some((words[0].to_string(), enabled))
        })
        .collect()
}

/// The CodeReady Builder repository for this machine: among the `codeready-builder` ids (not
/// debug or source), the one of the same kind as the enabled BaseOS — the same markers among
/// `eus`, `e4s`, `aus` and `rhui` (`rhel-9-for-x86_64-baseos-eus-rpms` goes with
/// `codeready-builder-for-rhel-9-x86_64-eus-rpms`, `rhel-9-baseos-rhui-rpms` with
/// `codeready-builder-for-rhel-9-rhui-rpms`). Its id and whether it is enabled already.
pub fn crb_repo(repos: &[(String, bool)]) -> Result<(String, bool), CrbError> {
    let markers = |id: &str| -> Vec<&'static str> {
        let words: Vec<&str> = id.split('-').collect();
        ["eus", "e4s", "aus", "rhui"].into_iter().filter(|m| words.contains(m)).collect()
    };
    let crb: Vec<&(String, bool)> = repos
        .iter()
        .filter(|(id, _)| id.contains("codeready-builder"))
        .filter(|(id, _)| !["debug", "source", "srpms"].iter().any(|x| id.contains(x)))
        .collect();
    let baseos = repos.iter().find(|(id, on)| *on && id.contains("baseos")).map(|(id, _)| id.as_str());
    let Some(baseos) = baseos else {
        return Err(CrbError::NoBaseos);
    };
    let want = markers(baseos);
    let ids = |repos: &[&(String, bool)]| repos.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>();
    let matching: Vec<&(String, bool)> = crb.iter().copied().filter(|(id, _)| markers(id) == want).collect();
    match matching.as_slice() {
        [one] => Ok((one.0.clone(), one.1)),
        [] => Err(CrbError::NoneGoesWith { baseos: baseos.into(), known: ids(&crb) }),
        many => Err(CrbError::Several { baseos: baseos.into(), ids: ids(many) }),
    }
}

/// Enable the CodeReady Builder repository `crb_repo` picks. subscription-manager owns the
/// repositories in /etc/yum.repos.d/redhat.repo and rewrites that file, so those are enabled
/// through it (`subscription-manager repos --enable`, as Red Hat documents for CRB); the others
/// (RHUI's files) through `dnf config-manager --set-enabled`.
pub fn enable_crb(runner: &mut dyn Runner, o: &mut Options) -> Result<(), ActionError> {
    let args: Vec<String> = ["-q", "repolist", "--all"].map(String::from).to_vec();
    let out = runner.run("dnf", &args, &[]).map_err(|e| ActionError::new(format!("dnf repolist: {e}")))?;
    if !out.ok() {
        return Err(CommandError::new("dnf", &args, &out).into());
    }
    let (id, enabled) = crb_repo(&parse_repolist(&out.stdout_text())).map_err(|e| ActionError::new(e.to_string()))?;
    if enabled {
        (o.progress)(&format!("      {id} is enabled already"));
        return Ok(());
    }
    let redhat_repo = Sysroot::new(&o.root).read_string("etc/yum.repos.d/redhat.repo").unwrap_or_default();
    let c = if redhat_repo.lines().any(|l| l.trim() == format!("[{id}]")) {
        Cmd { retry: Retry::Network, ..cmd("subscription-manager", &["repos", "--enable", &id]) }
    } else {
        cmd("dnf", &["config-manager", "--set-enabled", &id])
    };
    let args = lit_args(&c);
    run_cmd(&c, &args, runner, o)
}

#[cfg(test)]
mod tests;
