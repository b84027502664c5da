//! The test machine: a small working stand-in for the guest the installer changes (commands
//! that succeed unless told to fail, queries that answer as dpkg-query, apt-cache, modinfo,
//! mokutil and dnf do, fetches that write a file or fail like a dead network), and the guests
//! and runs the installer's tests share. Tests only.

use super::apply::apply;
use super::journal::State;
use super::plan::{self, Facts, Plan, Settings};
use super::runner::{Output, Runner};
use super::{Options, RebootPolicy};
use crate::checks::Finding;
use crate::snapshot::{OsRelease, SecureBoot};
use std::io::Read;
use std::path::Path;
use std::time::Duration;

/// A small working stand-in for the machine: commands succeed unless told to fail, queries
/// answer like dpkg-query and apt-cache do, fetches write a file or fail like a dead network.
#[derive(Default)]
pub(crate) struct FakeMachine {
    pub(crate) ran: Vec<String>,
    pub(crate) fail_when: Option<String>,
    pub(crate) offline: bool,
    pub(crate) fetched: u32,
    pub(crate) slept: Duration,
    pub(crate) key: Vec<u8>,
    /// `dpkg` answers "lock held" this many more times.
    pub(crate) lock_busy: u32,
    /// A package the repositories do not have: apt-get names it, as apt does
    /// ("E: Unable to locate package NAME", exit 100), for a simulation and an install alike.
    pub(crate) missing: Option<String>,
    /// A package whose unpacking was killed: dpkg refuses to configure while it is there,
    /// dpkg-query shows it with the reinst-required flag, and removing it clears it.
    pub(crate) reinstreq: Option<String>,
    /// The nvidia module's version for every kernel, as `modinfo -k K -F version nvidia`
    /// reads it (default: the installed driver's, 550.90.07); empty: no module, which
    /// modinfo answers with "Module nvidia not found" and exit 1 (kmod's modinfo).
    pub(crate) module: Option<String>,
    /// `modinfo -F signer`: empty for an unsigned module.
    pub(crate) signer: String,
    /// Where DKMS's certificate stands with the firmware, as `mokutil --test-key` answers
    /// (mokutil's `test_key`: "is not enrolled" exit 0, the others exit 1); `--import` of a
    /// certificate that is not enrolled queues it.
    pub(crate) mok: FakeMok,
    /// What was written to a program's stdin.
    pub(crate) stdin: Vec<String>,
    /// What `dnf repolist --all` prints.
    pub(crate) repolist: String,
    /// Other members of the keyring package besides its key (a maintainer script, a source).
    pub(crate) deb_extra: Vec<(String, Vec<u8>)>,
    /// What a fetch serves (default: a stand-in package, "deb").
    pub(crate) served: Option<Vec<u8>>,
    /// The NCCL builds the repository has, as `apt-cache madison libnccl2` and `dnf
    /// repoquery … libnccl` list them (default: `NCCL_BUILDS`).
    pub(crate) nccl: Option<Vec<&'static str>>,
    /// The keyring package unpacks without end (a compression bomb from a mirror).
    pub(crate) deb_bomb: Option<DebBomb>,
    /// How many bytes of dpkg-deb's stream the installer read.
    pub(crate) deb_read: u64,
}

#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) enum DebBomb {
    /// The key file itself claims 8 GiB, and its data never ends.
    HugeMember,
    /// Another member before the key claims 8 GiB, and its data never ends.
    EndlessBefore,
}

/// A tar member's header for `path` claiming 8 GiB, followed by zeros without end.
pub(crate) fn endless_tar(path: &str) -> impl Read {
    let mut h = tar::Header::new_gnu();
    h.set_path(path).unwrap();
    h.set_size(8 << 30);
    h.set_mode(0o644);
    h.set_cksum();
    std::io::Cursor::new(h.as_bytes().to_vec()).chain(std::io::repeat(0))
}

/// Counts what passes through it.
pub(crate) struct Counting<'a, R> {
    pub(crate) inner: R,
    pub(crate) read: &'a mut u64,
}

impl<R: Read> Read for Counting<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        *self.read += n as u64;
        Ok(n)
    }
}

/// Builds for several CUDA releases, as NVIDIA's repositories carry them (not in order: the
/// choice compares versions itself).
pub(crate) const NCCL_BUILDS: &[&str] =
    &["2.28.3-1+cuda13.0", "2.27.3-1+cuda12.9", "2.21.5-1+cuda12.4", "2.20.5-1+cuda12.4", "2.26.5-1+cuda12.8"];

#[derive(Default, Clone, Copy, PartialEq, Debug)]
pub(crate) enum FakeMok {
    #[default]
    Absent,
    Queued,
    Enrolled,
    NoKey,
}

impl Runner for FakeMachine {
    fn run(&mut self, program: &str, args: &[String], _env: &[(String, String)]) -> std::io::Result<Output> {
        let line = format!("{program} {}", args.join(" "));
        self.ran.push(line.clone());
        let ok = |stdout: &[u8]| Output { code: Some(0), stdout: stdout.to_vec(), stderr: String::new() };
        if program == "dpkg" && self.lock_busy > 0 {
            self.lock_busy -= 1;
            let stderr = "dpkg: error: dpkg frontend lock was locked by another process with pid 4242".into();
            return Ok(Output { code: Some(2), stdout: vec![], stderr });
        }
        if let Some(name) = self.reinstreq.clone() {
            if program == "dpkg" && args.first().map(String::as_str) == Some("--configure") {
                let stderr = format!("dpkg: error processing package {name} (--configure):\n package is in a very bad inconsistent state; you should\n reinstall it before attempting configuration");
                return Ok(Output { code: Some(1), stdout: vec![], stderr });
            }
            if program == "dpkg-query" && args.iter().any(|a| a.contains("db:Status-Abbrev")) {
                return Ok(ok(format!("ii bash\niHR{name}\n").as_bytes()));
            }
            if program == "dpkg" && args.iter().any(|a| a == "--force-remove-reinstreq") && args.contains(&name) {
                self.reinstreq = None;
                return Ok(ok(b""));
            }
        }
        if let Some(name) = self.missing.as_ref().filter(|n| program == "apt-get" && args.contains(n)) {
            let stderr = format!("Reading package lists...\nE: Unable to locate package {name}");
            return Ok(Output { code: Some(100), stdout: vec![], stderr });
        }
        if self.fail_when.as_deref().is_some_and(|f| line.contains(f)) {
            return Ok(Output { code: Some(100), stdout: vec![], stderr: "E: Unable to locate package".into() });
        }
        if program == "mokutil" && args.first().map(String::as_str) == Some("--test-key") {
            let key = &args[1];
            let (code, stdout, stderr) = match self.mok {
                FakeMok::Absent => (0, format!("{key} is not enrolled\n"), String::new()),
                FakeMok::Queued => (1, format!("{key} is already in the enrollment request\n"), String::new()),
                FakeMok::Enrolled => (1, format!("{key} is already enrolled\n"), String::new()),
                FakeMok::NoKey => (255, String::new(), format!("Failed to open {key}\n")),
            };
            return Ok(Output { code: Some(code), stdout: stdout.into_bytes(), stderr });
        }
        Ok(match program {
            "dnf" if args.iter().any(|a| a == "repolist") => ok(self.repolist.as_bytes()),
            "modinfo" if args.iter().any(|a| a == "version") => match self.module.as_deref().unwrap_or("550.90.07") {
                "" => Output {
                    code: Some(1),
                    stdout: vec![],
                    stderr: "modinfo: ERROR: Module nvidia not found.".into(),
                },
                v => ok(format!("{v}\n").as_bytes()),
            },
            "modinfo" => ok(format!("{}\n", self.signer).as_bytes()),
            "dpkg-query" => ok(b"550.90.07-0ubuntu1"),
            "apt-cache" if args.iter().any(|a| a == "libnccl2") => {
                let builds = self.nccl.as_deref().unwrap_or(NCCL_BUILDS);
                let lines: String =
                    builds.iter().map(|v| format!("  libnccl2 | {v} | http://r/ Packages\n")).collect();
                ok(lines.as_bytes())
            }
            "dnf" if args.iter().any(|a| a == "repoquery") => {
                let builds = self.nccl.as_deref().unwrap_or(NCCL_BUILDS);
                ok(builds.iter().map(|v| format!("{v}\n")).collect::<String>().as_bytes())
            }
            "apt-cache" => ok(b" nvidia-fabricmanager-550 | 550.127.05-1 | http://r/ Packages\n nvidia-fabricmanager-550 | 550.90.07-1 | http://r/ Packages\n"),
            "dpkg-deb" => {
                let mut b = tar::Builder::new(Vec::new());
                let mut h = tar::Header::new_gnu();
                h.set_size(self.key.len() as u64);
                h.set_mode(0o644);
                h.set_cksum();
                b.append_data(&mut h, "./usr/share/keyrings/cuda-archive-keyring.gpg", self.key.as_slice()).unwrap();
                for (name, data) in &self.deb_extra {
                    let mut h = tar::Header::new_gnu();
                    h.set_size(data.len() as u64);
                    h.set_mode(0o755);
                    h.set_cksum();
                    b.append_data(&mut h, name, data.as_slice()).unwrap();
                }
                ok(&b.into_inner().unwrap())
            }
            _ => ok(b""),
        })
    }
    fn run_input(&mut self, program: &str, args: &[String], input: &[u8]) -> std::io::Result<Output> {
        self.stdin.push(String::from_utf8_lossy(input).into_owned());
        let out = self.run(program, args, &[])?;
        if program == "mokutil" && args.first().map(String::as_str) == Some("--import") {
            // Two identical lines, as mokutil's get_password asks; else its "Abort".
            let lines: Vec<&str> = std::str::from_utf8(input).unwrap_or("").lines().collect();
            if lines.len() < 2 || lines[0] != lines[1] || lines[0].is_empty() {
                return Ok(Output { code: Some(255), stdout: vec![], stderr: "Abort\n".into() });
            }
            if self.mok == FakeMok::Absent {
                self.mok = FakeMok::Queued;
            }
        }
        Ok(out)
    }
    fn run_reading(
        &mut self,
        program: &str,
        args: &[String],
        read: &mut dyn FnMut(&mut dyn Read),
    ) -> std::io::Result<Output> {
        let out = self.run(program, args, &[])?;
        let mut counted = 0;
        match self.deb_bomb {
            None => read(&mut Counting { inner: out.stdout.as_slice(), read: &mut counted }),
            Some(DebBomb::HugeMember) => read(&mut Counting {
                inner: endless_tar("./usr/share/keyrings/cuda-archive-keyring.gpg"),
                read: &mut counted,
            }),
            Some(DebBomb::EndlessBefore) => {
                read(&mut Counting { inner: endless_tar("./usr/share/doc/bomb"), read: &mut counted })
            }
        }
        self.deb_read += counted;
        // A writer whose reader stopped early dies of SIGPIPE.
        let code = if self.deb_bomb.is_some() { None } else { out.code };
        Ok(Output { code, stdout: Vec::new(), ..out })
    }
    fn fetch(&mut self, url: &str, to: &Path) -> anyhow::Result<()> {
        self.fetched += 1;
        if self.offline {
            anyhow::bail!("error sending request for url ({url}): connection refused");
        }
        Ok(std::fs::write(to, self.served.as_deref().unwrap_or(b"deb"))?)
    }
    fn sleep(&mut self, d: Duration) {
        self.slept += d;
    }
}

/// A v4 key packet and its fingerprint.
pub(crate) fn test_key() -> (Vec<u8>, String) {
    test_key_seeded(42)
}

pub(crate) fn test_key_seeded(seed: u8) -> (Vec<u8>, String) {
    let mut body =
        vec![4, 0x5f, 0, 0, 0, 22, 9, 0x2b, 0x06, 0x01, 0x04, 0x01, 0xda, 0x47, 0x0f, 0x01, 0x01, 0x07, 0x40];
    body.extend([seed; 32]);
    let mut p = vec![0xc6, body.len() as u8];
    p.extend(&body);
    let fpr = crate::install::pgp::keys(&p).unwrap()[0].fingerprint.clone();
    (p, fpr)
}

pub(crate) fn fresh_ubuntu_hgx(_dir: &str, fpr: &str) -> (Facts, Settings) {
    let f = Facts {
        os: Ok(OsRelease {
            id: "ubuntu".into(),
            id_like: vec![],
            version_id: "22.04".into(),
            pretty_name: String::new(),
        }),
        kernel: Some("5.15.0-113-generic".into()),
        headers_present: true,
        secure_boot: Some(SecureBoot::Disabled),
        gpus: 8,
        nvswitches: 4,
        packages: Ok(vec![]),
        nouveau_off: false,
        nouveau_loaded: true,
        nvidia_loaded: None,
        nvidia_module_built: false,
        dpkg_interrupted: false,
        apt_lists: vec![],
        apt_sources: vec![],
        enabled_units: vec![],
        files: Default::default(),
        keys: Default::default(),
    };
    let s = Settings {
        cuda: "12.4".into(),
        driver_branch: 550,
        repo_url: String::new(),
        key_fingerprint: fpr.into(),
        epel_url: String::new(),
        epel_key_fingerprint: String::new(),
        replace_driver: false,
        allow_plain_http: false,
    };
    (f, s)
}

/// A fresh 8-GPU Ubuntu guest's plan, its state directory, and a machine whose keyring
/// carries the test key; `pin` replaces the pinned fingerprint (default: the test key's).
pub(crate) fn fresh_install(pin: Option<&str>) -> (tempfile::TempDir, Plan, FakeMachine) {
    let dir = tempfile::tempdir().unwrap();
    let (key, fpr) = test_key();
    let (f, s) = fresh_ubuntu_hgx(dir.path().to_str().unwrap(), pin.unwrap_or(&fpr));
    let p = plan::plan(&f, &s).unwrap();
    (dir, p, FakeMachine { key, ..Default::default() })
}

/// `fresh_install` on a guest whose dpkg was interrupted: the plan starts with its repair.
pub(crate) fn fresh_install_interrupted() -> (tempfile::TempDir, Plan, FakeMachine) {
    let dir = tempfile::tempdir().unwrap();
    let (key, fpr) = test_key();
    let (mut f, s) = fresh_ubuntu_hgx(dir.path().to_str().unwrap(), &fpr);
    f.dpkg_interrupted = true;
    let p = plan::plan(&f, &s).unwrap();
    assert_eq!(p.steps[0].id.as_str(), "repair");
    (dir, p, FakeMachine { key, ..Default::default() })
}

pub(crate) struct Run {
    pub(crate) state: State,
    pub(crate) progress: Vec<String>,
    pub(crate) rebooted: bool,
}

/// Runs `f` with the installer's options over `dir` (its root under `dir/root`): progress
/// lines kept, a verification that finds one warning, a reboot that is only noted. Returns
/// what `f` returned, the progress lines and whether a reboot was asked for.
pub(crate) fn with_options<R>(
    dir: &Path,
    policy: RebootPolicy,
    boot: Option<&str>,
    network_tries: u32,
    lock_wait: Duration,
    f: impl FnOnce(&mut Options) -> R,
) -> (R, Vec<String>, bool) {
    let mut lines = Vec::new();
    let mut rebooted = false;
    let mut progress = |l: &str| lines.push(l.to_string());
    let mut verify = || vec![Finding::pass("driver.loaded", "ok"), Finding::warn("gpu.ecc", "3 corrected")];
    let mut reboot_now = || {
        rebooted = true;
        Ok(())
    };
    let mut o = Options {
        journal_dir: dir.join("journal"),
        root: dir.join("root"),
        reboot: policy,
        boot_id: boot.map(str::to_string),
        network_tries,
        lock_wait,
        progress: &mut progress,
        verify: &mut verify,
        reboot_now: &mut reboot_now,
    };
    let r = f(&mut o);
    (r, lines, rebooted)
}

pub(crate) fn apply_once(p: &Plan, m: &mut FakeMachine, dir: &Path, policy: RebootPolicy, boot: &str) -> Run {
    let (state, progress, rebooted) =
        with_options(dir, policy, Some(boot), 4, Duration::from_secs(1), |o| apply(p, m, o).unwrap());
    Run { state, progress, rebooted }
}

/// A fresh Debian 12 guest (branch 550, which the fake machine's packages report) with
/// Secure Boot on.
pub(crate) fn fresh_debian_sb(dir: &Path) -> (Plan, FakeMachine) {
    let (key, fpr) = test_key();
    let (mut f, s) = fresh_ubuntu_hgx(dir.to_str().unwrap(), &fpr);
    f.os = Ok(OsRelease { id: "debian".into(), id_like: vec![], version_id: "12".into(), pretty_name: String::new() });
    f.kernel = Some("6.1.0-27-cloud-amd64".into());
    f.secure_boot = Some(SecureBoot::Enabled);
    f.apt_sources =
        vec![("/etc/apt/sources.list".into(), "deb http://debian.mirror.example/debian bookworm main\n".into())];
    let p = plan::plan(&f, &s).unwrap();
    // Debian 12's dkms signs with a key whose certificate says "DKMS module signing key".
    (p, FakeMachine { key, signer: "DKMS module signing key".into(), ..Default::default() })
}

/// `dnf repolist --all` as RHEL 9 prints it (header, id, name, status), with the repository
/// ids each way of getting RHEL's packages uses: Red Hat's CDN through subscription-manager
/// (which lists the EUS twins too), AWS's RHUI (the CRB id Percona's install docs enable with
/// `dnf config-manager`), a RHUI with `rhui-` ids (PerfKitBenchmarker enables
/// `rhui-codeready-builder-for-rhel-9-x86_64-rhui-rpms` on its RHEL 9 VMs), and an EUS
/// variant of the last made up by the same naming, for the markers.
pub(crate) fn repolist(lines: &[(&str, bool)]) -> String {
    let mut out = String::from(
        "repo id                                         repo name                                  status\n",
    );
    for (id, on) in lines {
        out.push_str(&format!(
            "{id:<47} Red Hat Enterprise Linux 9 repository      {}\n",
            if *on { "enabled" } else { "disabled" }
        ));
    }
    out
}
