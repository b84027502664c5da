//! The installer run in a chroot as root runs it, and killed inside a step: what the Debian
//! (`install_chroot.rs`) and the EL9 (`install_el9.rs`) real-package-manager tests share.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub struct Outcome {
    pub code: Option<i32>,
    pub stderr: String,
}

pub fn install_command(root: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new("chroot");
    c.arg(root).arg("/usr/bin/phq-agent").arg("install");
    if !extra.contains(&"--reboot") {
        c.args(["--reboot", "never"]);
    }
    c.args(extra);
    c.env_clear().env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin").env("LANG", "C.UTF-8");
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // Its own process group: a kill reaches the package manager too (apt and dpkg, dnf and
    // rpm), as when systemd stops a unit or the VM loses power.
    c.process_group(0);
    c
}

pub fn install(root: &Path, extra: &[&str]) -> Outcome {
    let out = install_command(root, extra).output().unwrap();
    Outcome { code: out.status.code(), stderr: String::from_utf8_lossy(&out.stderr).into_owned() }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kill {
    /// Killed while a command of the step ran.
    Running,
    /// The step had nothing to do any more; killed as it said so.
    AlreadyDone,
    NotReached,
}

/// Starts an install and SIGKILLs its whole process group inside `step`: once the step's first
/// command is running (50 ms after its line; for the driver step, once the stand-in DKMS
/// postinst has made `marker`, after `during` ran), or at once when the step says it is
/// already done. Decided by what the installer prints, not by a clock, so a slow or a fast
/// machine kills in the same place. Returns what it printed and where it killed.
pub fn install_killed_in(root: &Path, step: &str, marker: Option<&Path>, during: impl FnOnce()) -> (String, Kill) {
    let mut child = install_command(root, &[]).spawn().unwrap();
    let pgid = child.id() as i32;
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let kill = |child: &mut std::process::Child| {
        // SAFETY: kill(2) on a process group we created; no memory is touched.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = child.wait();
    };
    let mut seen = String::new();
    let mut during = Some(during);
    let mut in_step = false;
    let needle = format!("] {step}: ");
    let deadline = Instant::now() + Duration::from_secs(300);
    while Instant::now() < deadline {
        let line = match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(l) => l,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        seen.push_str(&line);
        seen.push('\n');
        if !in_step {
            if line.contains(&needle) {
                in_step = true;
                if ["already done", "done in an earlier run", "not needed"].iter().any(|d| line.contains(d)) {
                    kill(&mut child);
                    return (seen, Kill::AlreadyDone);
                }
            }
            continue;
        }
        let action = line.trim_start();
        if action.starts_with("$ ")
            || action.starts_with("fetch ")
            || action.starts_with("write ")
            || action.starts_with('[')
        {
            match marker {
                Some(m) => {
                    let until = Instant::now() + Duration::from_secs(120);
                    while !m.exists() && Instant::now() < until {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    assert!(m.exists(), "the driver package's install script never ran:\n{seen}");
                    if let Some(f) = during.take() {
                        f();
                    }
                }
                None => std::thread::sleep(Duration::from_millis(50)),
            }
            kill(&mut child);
            return (seen, Kill::Running);
        }
    }
    kill(&mut child);
    (seen, Kill::NotReached)
}
