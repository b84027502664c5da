//! Processes blocked in the NVIDIA driver: in uninterruptible sleep (state `D` in
//! `/proc/<pid>/stat`) while holding a `/dev/nvidia*` node open. A GPU that stops answering shows
//! this way before any Xid: the process that asked is stuck inside the driver and cannot even be
//! killed (issue 42 names gpud's os component as watching the same; the kernel's hung-task detector reports such a
//! task only after `hung_task_timeout_secs`, 120 s by default).
//!
//! A moment in state D is normal (an ioctl that waits for the GPU), so on a live machine a
//! candidate counts only if it is still in D a second later without having been scheduled in
//! between (its voluntary and involuntary context switches in `/proc/<pid>/status` unchanged —
//! the test the hung-task detector itself makes, `check_hung_task`'s switch count). A fixture
//! or bundle is read once. Only the processes in state D are recorded into a support bundle.

use crate::snapshot::{BlockedProcess, Fact};
use crate::sysroot::Sysroot;
use std::time::Duration;

/// How long a candidate must stay blocked, unscheduled, on a live machine.
const SECOND_LOOK: Duration = Duration::from_secs(1);
/// At most this many processes are looked at: /proc on a guest holds hundreds, not more.
const MAX_PIDS: usize = 65_536;

pub fn blocked_in_driver(root: &Sysroot) -> Fact<Vec<BlockedProcess>> {
    let pids = match root.list_dir("proc") {
        Ok(names) => names.into_iter().filter_map(|n| n.parse::<u32>().ok()).take(MAX_PIDS).collect::<Vec<_>>(),
        Err(e) => return Fact::Error(e.to_string()),
    };
    let mut found: Vec<(BlockedProcess, Option<u64>)> = vec![];
    for pid in pids {
        // Every process is looked at, but only one in state D is read again, recorded: a support
        // bundle carries the blocked processes, not the names of all the tenant's programs.
        let unrecorded = root.read_bytes_unrecorded(&format!("proc/{pid}/stat")).ok();
        if unrecorded.and_then(|b| parse_stat(&String::from_utf8_lossy(&b))).is_none_or(|(_, s)| s != 'D') {
            continue;
        }
        let Some((comm, 'D')) = state(root, pid) else { continue };
        let devices = nvidia_fds(root, pid);
        if !devices.is_empty() {
            found.push((BlockedProcess { pid, comm, devices }, switches(root, pid)));
        }
    }
    if root.is_live() && !found.is_empty() {
        std::thread::sleep(SECOND_LOOK);
        found.retain(|(p, before)| {
            matches!(state(root, p.pid), Some((_, 'D'))) && before.is_some() && switches(root, p.pid) == *before
        });
    }
    Fact::Value(found.into_iter().map(|(p, _)| p).collect())
}

/// `(comm, state)` from `/proc/<pid>/stat`: `pid (comm) S …`, where `comm` may hold spaces and
/// parentheses, so the state is the first field after the *last* `)` (proc(5)).
fn state(root: &Sysroot, pid: u32) -> Option<(String, char)> {
    parse_stat(&root.read_string(&format!("proc/{pid}/stat")).ok()?)
}

pub fn parse_stat(stat: &str) -> Option<(String, char)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    // The name is the process's own choice (prctl PR_SET_NAME), escape sequences included.
    let comm = crate::text::printable(stat.get(open + 1..close)?).into_owned();
    let state = stat.get(close + 1..)?.trim_start().chars().next()?;
    Some((comm, state))
}

/// A process's name (printable) and its parent's pid, from `/proc/<pid>/stat` under `root`;
/// `None` where the process is gone or hidden (the service's `ProtectProc=invisible` hides
/// other users' processes).
pub fn name_and_parent(root: &Sysroot, pid: u32) -> Option<(String, u32)> {
    let stat = String::from_utf8_lossy(&root.read_bytes_unrecorded(&format!("proc/{pid}/stat")).ok()?).into_owned();
    let (comm, _) = parse_stat(&stat)?;
    // After the name: state, then the parent's pid (proc(5), /proc/pid/stat fields 3 and 4).
    let ppid = stat.get(stat.rfind(')')? + 1..)?.split_whitespace().nth(1)?.parse().ok()?;
    Some((comm, ppid))
}

/// `voluntary_ctxt_switches` + `nonvoluntary_ctxt_switches` of `/proc/<pid>/status`.
fn switches(root: &Sysroot, pid: u32) -> Option<u64> {
    let status = root.read_string(&format!("proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> { status.lines().find_map(|l| l.strip_prefix(name)?.trim().parse().ok()) };
    Some(field("voluntary_ctxt_switches:")? + field("nonvoluntary_ctxt_switches:")?)
}

/// The `/dev/nvidia*` nodes among the process's open files (`/proc/<pid>/fd/*` links).
fn nvidia_fds(root: &Sysroot, pid: u32) -> Vec<String> {
    let dir = format!("proc/{pid}/fd");
    let mut devices: Vec<String> = root
        .list_dir(&dir)
        .unwrap_or_default()
        .iter()
        .filter_map(|fd| root.link_target(&format!("{dir}/{fd}")).ok().flatten())
        .filter(|t| {
            t.strip_prefix("/dev/nvidia")
                .is_some_and(|rest| rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
        })
        .collect();
    devices.sort();
    devices.dedup();
    devices
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_records_the_blocked_processes_only() {
        let dir = tempfile::tempdir().unwrap();
        let proc = dir.path().join("proc");
        for (pid, stat) in [("1", "1 (systemd) S 0"), ("4242", "4242 (trainer) D 1"), ("77", "77 (secret-job) R 1")] {
            std::fs::create_dir_all(proc.join(pid).join("fd")).unwrap();
            std::fs::write(proc.join(pid).join("stat"), stat).unwrap();
        }
        std::os::unix::fs::symlink("/dev/nvidia0", proc.join("4242/fd/3")).unwrap();
        let root = Sysroot::recording(dir.path());
        let found = blocked_in_driver(&root);
        assert_eq!(found.value().map(Vec::len), Some(1));
        let files: Vec<String> = root
            .recorded()
            .into_iter()
            .filter_map(|r| match r {
                crate::sysroot::Recorded::File { path, .. } => Some(path),
                _ => None,
            })
            .collect();
        assert_eq!(files, vec!["proc/4242/stat".to_string()], "no other process's name in the bundle");
    }

    #[test]
    fn the_state_is_read_after_the_last_parenthesis() {
        assert_eq!(parse_stat("42 (python3) D 1 42 42 0"), Some(("python3".into(), 'D')));
        assert_eq!(parse_stat("43 (a) R (b)) S 1"), Some(("a) R (b)".into(), 'S')), "a name that fakes a state");
        assert_eq!(parse_stat("44 python3 D"), None);
        // A name that would move a terminal's cursor reaches no terminal as such.
        assert_eq!(parse_stat("45 (\u{1b}[2Jx) D 1"), Some(("\u{fffd}[2Jx".into(), 'D')));
    }
}
