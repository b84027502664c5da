//! The fault history (issue 39): which fault each physical GPU has shown in which boots, kept
//! across reboots under the service's state directory, so that a VM restart does not hide a
//! fault until the next tenant meets it.
//!
//! Rules:
//! 1. A fault is a GPU's board serial (NVML's `nvmlDeviceGetSerial`; `pci:<address>` when NVML
//!    cannot read it, which the report says) and what it showed: a check id, and for `gpu.xid`
//!    the governing Xid code. Only warn and fail findings about one GPU are faults.
//! 2. Each boot (`/proc/sys/kernel/random/boot_id`, read through the sysroot like every file)
//!    that saw the fault is kept with its first and last time; an occurrence is new when the
//!    fault was absent or cleared, or an Xid's count in the kernel log grew.
//! 3. The same fault on the same serial in two or more boots escalates only when it is already
//!    the platform's and hardware-class (`route::hardware_class`: the platform's reset, restart,
//!    host reboot or inspection): the finding's action becomes `inspect_hardware`, its evidence
//!    says `decided_by: history` with the boots, and the verdict's basis says `history` (gpud
//!    escalates an Xid seen again after reboots to hardware inspection the same way: its
//!    `api/v1` repair actions). A fault that is the tenant's (an Xid 13 or 31 from a program
//!    that faults, a power cap, ECC switched off, a BAR the VM spec cannot place) stays the
//!    tenant's, with its own action, and says that it recurs: a claim from the guest never grows
//!    into a hardware verdict by repeating itself (issue 51).
//! 4. A fault is cleared only by a probe run that passes every probe of that GPU after the
//!    fault's last occurrence, and the history records which run; never by a reboot alone.
//! 5. Bounded: at most `MAX_FAULTS` faults and `MAX_BOOTS` boots each (the oldest cleared go
//!    first); written whole with `durable::write`, as the spool is.

use crate::checks::route::{Action, Owner};
use crate::checks::{Finding, Severity};
use crate::snapshot::{Snapshot, Timestamp};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const SCHEMA: &str = "phq.history/v1";
pub const FILE: &str = "history.json";
pub const MAX_FAULTS: usize = 1024;
pub const MAX_BOOTS: usize = 16;
/// The evidence key an escalated finding carries, with the value `history` (rule 3).
pub use crate::checks::route::DECIDED_BY;
/// Bytes read of a history file: a full one is well under 1 MiB.
const MAX_FILE_BYTES: u64 = 8 << 20;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct History {
    pub schema: String,
    pub faults: Vec<Fault>,
    /// Probe runs already applied (`rule 4`), newest last, bounded.
    #[serde(default)]
    pub probe_runs: Vec<String>,
}

impl Default for History {
    fn default() -> Self {
        History { schema: SCHEMA.into(), faults: Vec::new(), probe_runs: Vec::new() }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fault {
    /// The GPU's board serial, or `pci:<address>` when NVML could not read it.
    pub serial: String,
    /// Where the GPU was last seen in this VM.
    pub gpu: String,
    pub check: String,
    /// The Xid code, for `gpu.xid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    pub boots: Vec<BootSeen>,
    pub first_seen: Timestamp,
    pub last_seen: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cleared: Option<Cleared>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BootSeen {
    pub boot_id: String,
    pub first: Timestamp,
    pub last: Timestamp,
    /// For an Xid: the count the kernel log held at `last` (a larger one is a new occurrence).
    #[serde(default)]
    pub count: u64,
}

/// Who asked for a run, as the agent could tell (issue 50): what proved it, not what it said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(tag = "who", rename_all = "snake_case")]
pub enum AskedBy {
    /// The service itself: at boot, or when every GPU was idle.
    #[default]
    Service,
    /// A client certificate from the platform's CA with one of the configured names: over
    /// vsock, KubeVirt's (virt-handler's vsock client, `vsock.client_names`); over TCP, the
    /// platform's own (`http.client_ca`, `http.client_names`).
    Platform { over: Channel, name: String },
    /// The control token (`http.control_token_file`): whoever holds it in the guest.
    Tenant,
    /// Root on the guest, over D-Bus (the bus policy lets only root call `RunProbes`).
    LocalRoot,
}

/// The channel a certificate was presented on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Channel {
    Vsock,
    Tcp,
}

impl std::fmt::Display for AskedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AskedBy::Service => write!(f, "the service"),
            AskedBy::Platform { over: Channel::Vsock, name } => write!(f, "the platform over vsock ({name})"),
            AskedBy::Platform { over: Channel::Tcp, name } => write!(f, "the platform over TCP ({name})"),
            AskedBy::Tenant => write!(f, "the tenant (the control token)"),
            AskedBy::LocalRoot => write!(f, "root on the guest (D-Bus)"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cleared {
    pub by_probe_run: String,
    pub at: Timestamp,
    /// Who asked for the run that cleared it (issue 50); absent in older histories.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asked_by: Option<AskedBy>,
}

impl Fault {
    pub fn boot_count(&self) -> usize {
        self.boots.len()
    }
    fn matches(&self, serial: &str, check: &str, code: Option<&str>) -> bool {
        self.serial == serial && self.check == check && self.code.as_deref() == code
    }
}

/// The physical identity of the GPU at `address`: its board serial, else `pci:<address>`.
pub fn serial_of(s: &Snapshot, address: &str) -> String {
    s.nvml_gpu(address)
        .and_then(|g| g.serial.value().cloned())
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| format!("pci:{address}"))
}

/// What fault a finding is, if it is one: (check, Xid code, the Xid's count).
fn fault_key(f: &Finding) -> Option<(String, Option<String>, u64)> {
    if !matches!(f.severity, Severity::Warn | Severity::Fail) || f.gpu.is_none() {
        return None;
    }
    if f.id == "gpu.xid" {
        let code = f.evidence.get("governs")?.as_str()?.strip_prefix("Xid ")?.to_string();
        let count = f
            .evidence
            .get("xids")
            .and_then(|x| x.as_array())
            .and_then(|xs| xs.iter().find(|x| x["code"] == code.as_str()))
            .and_then(|x| x["count"].as_u64())
            .unwrap_or(1);
        return Some((f.id.clone(), Some(code), count));
    }
    Some((f.id.clone(), None, 0))
}

impl History {
    pub fn path(state_dir: &Path) -> PathBuf {
        state_dir.join(FILE)
    }

    /// The history in `state_dir`; empty when there is none. A file that is there but cannot be
    /// read as one is an error that names it (never silently an empty history: that would
    /// forget faults). Never through a symbolic link: the service's user writes the directory,
    /// and root reads it (`phq-agent history`), so a link there would have root read, and print
    /// a part of, any file it names (issue 51).
    pub fn load(state_dir: &Path) -> anyhow::Result<History> {
        use std::io::Read;
        let path = Self::path(state_dir);
        let file = match crate::sysroot::open_regular(&path, true) {
            Ok((f, _)) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(History::default()),
            Err(e) => anyhow::bail!("{}: cannot open the fault history: {e}", path.display()),
        };
        let mut buf = Vec::new();
        file.take(MAX_FILE_BYTES + 1).read_to_end(&mut buf).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        if buf.len() as u64 > MAX_FILE_BYTES {
            anyhow::bail!("{}: more than {MAX_FILE_BYTES} bytes; not a fault history", path.display());
        }
        let what = format!("{}: the fault history", path.display());
        let h: History = serde_json::from_slice(&buf).map_err(|e| anyhow::anyhow!("{what} cannot be read: {e}"))?;
        if h.schema != SCHEMA {
            anyhow::bail!("{what} is {:?}, not {SCHEMA}", h.schema);
        }
        Ok(h)
    }

    pub fn save(&self, state_dir: &Path) -> anyhow::Result<()> {
        let path = Self::path(state_dir);
        let bytes = serde_json::to_vec_pretty(self)?;
        crate::durable::write(&path, &bytes, 0o600)
            .map_err(|e| anyhow::anyhow!("{}: cannot write the fault history: {e}", path.display()))
    }

    /// Records the faults among `findings` (rules 1 and 2); true when anything changed.
    pub fn record(&mut self, s: &Snapshot, findings: &[Finding], boot_id: &str, at: Timestamp) -> bool {
        let mut changed = false;
        for f in findings {
            let Some((check, code, count)) = fault_key(f) else { continue };
            let gpu = f.gpu.clone().unwrap_or_default();
            let serial = serial_of(s, &gpu);
            match self.faults.iter_mut().find(|x| x.matches(&serial, &check, code.as_deref())) {
                Some(fault) => {
                    let reopened = fault.cleared.is_some();
                    let here = fault.boots.iter().position(|b| b.boot_id == boot_id);
                    let new_occurrence = match here {
                        None => true,
                        // An Xid stays in the kernel log for the whole boot: only a larger count
                        // is another one. A state (a failed remap) seen again after a clear is.
                        Some(i) if code.is_some() => count > fault.boots[i].count,
                        Some(_) => reopened,
                    };
                    let boot = here.map(|i| &mut fault.boots[i]);
                    if !new_occurrence {
                        continue;
                    }
                    match boot {
                        Some(b) => {
                            b.last = at;
                            b.count = count;
                        }
                        None => fault.boots.push(BootSeen { boot_id: boot_id.into(), first: at, last: at, count }),
                    }
                    if fault.boots.len() > MAX_BOOTS {
                        fault.boots.remove(0);
                    }
                    fault.last_seen = at;
                    fault.gpu = gpu;
                    fault.cleared = None;
                    changed = true;
                }
                None => {
                    self.faults.push(Fault {
                        serial,
                        gpu,
                        check,
                        code,
                        boots: vec![BootSeen { boot_id: boot_id.into(), first: at, last: at, count }],
                        first_seen: at,
                        last_seen: at,
                        cleared: None,
                    });
                    changed = true;
                }
            }
        }
        if self.faults.len() > MAX_FAULTS {
            // The oldest cleared first, then the oldest.
            self.faults.sort_by_key(|f| (f.cleared.is_none(), f.last_seen.0));
            let excess = self.faults.len() - MAX_FAULTS;
            self.faults.drain(..excess);
        }
        changed
    }

    /// Rule 4: a probe run (`run_id`, finished by `at`) whose findings pass every probe of a
    /// GPU clears that GPU's open faults last seen before `at`. True when anything changed.
    pub fn clear_by_probes(
        &mut self,
        s: &Snapshot,
        run_id: &str,
        asked_by: &AskedBy,
        at: Timestamp,
        probe_findings: &[Finding],
    ) -> bool {
        if self.probe_runs.iter().any(|r| r == run_id) {
            return false;
        }
        self.probe_runs.push(run_id.to_string());
        if self.probe_runs.len() > 64 {
            self.probe_runs.remove(0);
        }
        let mut passed: Vec<String> = Vec::new();
        let mut failed: Vec<String> = Vec::new();
        for f in probe_findings.iter().filter(|f| f.id.starts_with("probe.")) {
            let Some(gpu) = &f.gpu else { continue };
            if matches!(f.severity, Severity::Pass) {
                passed.push(gpu.clone());
            } else {
                failed.push(gpu.clone());
            }
        }
        let clean: Vec<String> = passed.into_iter().filter(|g| !failed.contains(g)).map(|g| serial_of(s, &g)).collect();
        for fault in self.faults.iter_mut().filter(|f| f.cleared.is_none() && f.last_seen.0 <= at.0) {
            if clean.contains(&fault.serial) {
                fault.cleared = Some(Cleared { by_probe_run: run_id.into(), at, asked_by: Some(asked_by.clone()) });
            }
        }
        true
    }

    /// Rule 3: a finding whose fault is open and was seen in two boots or more. When its route
    /// is already the platform's hardware (`route::hardware_class`) it becomes
    /// `inspect_hardware`, says the history decided it (`DECIDED_BY`) and names the boots; any
    /// other (a tenant's program that faults, a power cap the tenant set) keeps its action and
    /// owner and says that it recurs.
    pub fn escalate(&self, s: &Snapshot, findings: &mut [Finding]) {
        for f in findings.iter_mut() {
            let Some((check, code, _)) = fault_key(f) else { continue };
            let serial = serial_of(s, f.gpu.as_deref().unwrap_or(""));
            let Some(fault) =
                self.faults.iter().find(|x| x.cleared.is_none() && x.matches(&serial, &check, code.as_deref()))
            else {
                continue;
            };
            let boots = fault.boot_count();
            f.evidence.insert("boots".into(), boots.into());
            f.evidence.insert("serial".into(), fault.serial.clone().into());
            if boots < 2 {
                continue;
            }
            let ids: Vec<&str> = fault.boots.iter().map(|b| b.boot_id.as_str()).collect();
            f.evidence.insert("boot_ids".into(), serde_json::json!(ids));
            if !crate::checks::route::hardware_class(f.action, f.owner) {
                f.evidence.insert("recurs".into(), true.into());
                f.summary =
                    format!("{} — recurs: seen on this GPU (serial {}) in {boots} boots", f.summary, fault.serial);
                f.detail = format!(
                    "{}\nThe same finding came back after a reboot on the same physical GPU (serial {}): seen in {boots} boots ({}), first at {}. It stays {}'s to act on ({}): what it shows is not the hardware's, however often it recurs.",
                    f.detail,
                    fault.serial,
                    ids.join(", "),
                    fault.first_seen,
                    f.owner.word(),
                    f.action.word()
                )
                .trim_start()
                .to_string();
                continue;
            }
            f.evidence.insert(DECIDED_BY.into(), "history".into());
            f.summary = format!("{} — seen on this GPU (serial {}) in {boots} boots", f.summary, fault.serial);
            f.detail = format!(
                "{}\nThe same fault on the same physical GPU (serial {}) came back after a reboot: seen in {boots} boots ({}), first at {}. A restart does not fix it: the GPU needs a person.",
                f.detail,
                fault.serial,
                ids.join(", "),
                fault.first_seen
            )
            .trim_start()
            .to_string();
            f.action = Action::InspectHardware;
            f.owner = Owner::Platform;
        }
    }

    /// When the verdict's faults were first seen, if the history holds them.
    pub fn since(&self, s: &Snapshot, findings: &[Finding], action: Action) -> Option<Timestamp> {
        findings
            .iter()
            .filter(|f| f.action == action)
            .filter_map(|f| {
                let (check, code, _) = fault_key(f)?;
                let serial = serial_of(s, f.gpu.as_deref()?);
                self.faults.iter().find(|x| x.cleared.is_none() && x.matches(&serial, &check, code.as_deref()))
            })
            .map(|x| x.first_seen)
            .min_by_key(|t| t.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::testutil::healthy;
    use std::time::{Duration, UNIX_EPOCH};

    fn at(s: u64) -> Timestamp {
        Timestamp(UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s))
    }

    fn xid79(count: u64) -> Finding {
        Finding::fail("gpu.xid", "Xid 79")
            .gpu("0000:0c:00.0")
            .evidence("governs", "Xid 79")
            .evidence("xids", serde_json::json!([{"code": "79", "count": count, "resolution": "RESTART_BM"}]))
    }

    /// Who asked for the test's runs: the platform over vsock.
    fn platform() -> AskedBy {
        AskedBy::Platform { over: Channel::Vsock, name: "kubevirt.io:system:client:vsock".into() }
    }

    fn probes(sev: Severity) -> Vec<Finding> {
        let f = Finding::pass("probe.memory-integrity", "ok").gpu("0000:0c:00.0");
        vec![Finding { severity: sev, ..f }]
    }

    /// The walk: an Xid 79 in one boot, again in the next, escalated; a reboot alone
    /// does not clear it, a passing probe does, and it comes back as new only when it recurs.
    #[test]
    fn a_fault_in_two_boots_escalates_until_a_probe_passes() {
        let s = healthy();
        let mut h = History::default();
        let mut f = vec![xid79(1)];
        assert!(h.record(&s, &f, "boot-a", at(0)));
        crate::checks::route::apply(&mut f);
        h.escalate(&s, &mut f);
        assert_eq!((f[0].action, f[0].evidence["boots"].as_u64()), (Action::RebootHost, Some(1)));
        assert!(!h.record(&s, &f, "boot-a", at(30)), "the same line in the same boot is no new occurrence");

        let mut f = vec![xid79(1)];
        assert!(h.record(&s, &f, "boot-b", at(600)));
        crate::checks::route::apply(&mut f);
        h.escalate(&s, &mut f);
        assert_eq!((f[0].action, f[0].owner), (Action::InspectHardware, Owner::Platform));
        assert_eq!(f[0].evidence["boot_ids"], serde_json::json!(["boot-a", "boot-b"]));
        let serial = f[0].evidence["serial"].as_str().unwrap().to_string();
        assert!(
            f[0].summary.contains(&format!("serial {serial}")) && f[0].summary.contains("2 boots"),
            "{}",
            f[0].summary
        );

        // A reboot alone: a third boot without the Xid changes nothing.
        assert!(!h.record(&s, &[], "boot-c", at(1200)));
        assert!(h.faults[0].cleared.is_none());
        // A failing probe does not clear it; a passing one after the last occurrence does.
        h.clear_by_probes(&s, "run-1", &platform(), at(1300), &probes(Severity::Fail));
        assert!(h.faults[0].cleared.is_none());
        h.clear_by_probes(&s, "run-2", &platform(), at(1400), &probes(Severity::Pass));
        assert_eq!(h.faults[0].cleared.as_ref().map(|c| c.by_probe_run.as_str()), Some("run-2"));
        assert_eq!(
            h.faults[0].cleared.as_ref().and_then(|c| c.asked_by.clone()),
            Some(platform()),
            "who asked is kept"
        );
        let mut f = vec![xid79(1)];
        crate::checks::route::apply(&mut f);
        h.escalate(&s, &mut f);
        assert_eq!(f[0].action, Action::RebootHost, "cleared: no longer escalated");
        // The same kernel-log line later in boot-b is not a new occurrence; a second Xid is.
        assert!(!h.record(&s, &[xid79(1)], "boot-b", at(1500)));
        assert!(h.record(&s, &[xid79(2)], "boot-b", at(1600)));
        assert!(h.faults[0].cleared.is_none());
    }

    /// Issue 51 hole 2: a tenant's own faults, seen in two boots, stay the tenant's and say they
    /// recur; the platform's hardware fault escalates and says the history decided it.
    #[test]
    fn only_the_platforms_hardware_faults_escalate() {
        let s = healthy();
        let mut h = History::default();
        let xid = |code: &str, resolution: &str| {
            Finding::fail("gpu.xid", format!("Xid {code}"))
                .gpu("0000:0c:00.0")
                .evidence("governs", format!("Xid {code}"))
                .evidence("xids", serde_json::json!([{"code": code, "count": 1, "resolution": resolution}]))
        };
        let power = || Finding::warn("gpu.power-limit", "capped at 500 W").gpu("0000:0c:00.0");
        let ecc_off = || Finding::warn("gpu.ecc-mode", "ECC off").gpu("0000:0c:00.0");
        let bar1 = || Finding::fail("pci.bar1-assigned", "no BAR1").gpu("0000:0c:00.0");
        let all = || vec![xid("31", "RESTART_APP"), xid("13", "RESTART_APP"), power(), ecc_off(), bar1(), xid79(1)];
        for (boot, t) in [("boot-a", 0), ("boot-b", 600)] {
            let f = all();
            h.record(&s, &f, boot, at(t));
        }
        let mut f = all();
        crate::checks::route::apply(&mut f);
        let before: Vec<(Action, Owner)> = f.iter().map(|x| (x.action, x.owner)).collect();
        h.escalate(&s, &mut f);
        for (x, was) in f.iter().zip(&before).take(5) {
            assert_eq!((x.action, x.owner), *was, "{} escalated: {x:#?}", x.id);
            assert_eq!(x.evidence["recurs"], true, "{}", x.id);
            assert!(x.summary.contains("recurs") && x.summary.contains("2 boots"), "{}", x.summary);
            assert!(!x.evidence.contains_key(DECIDED_BY), "{}", x.id);
        }
        assert_eq!(before[0], (Action::RestartApp, Owner::Tenant));
        let x79 = &f[5];
        assert_eq!((x79.action, x79.owner), (Action::InspectHardware, Owner::Platform));
        assert_eq!(x79.evidence[DECIDED_BY], "history");
        assert_eq!(x79.evidence["boot_ids"], serde_json::json!(["boot-a", "boot-b"]));
    }

    #[test]
    fn bounded_and_round_trips() {
        let s = healthy();
        let mut h = History::default();
        for i in 0..(MAX_FAULTS + 10) {
            let f = Finding::warn("gpu.temperature", "hot").gpu(format!("0000:{:02x}:00.0", i % 256));
            let f = Finding { id: format!("gpu.t{i}"), ..f };
            h.record(&s, &[f], "b", at(i as u64));
        }
        assert_eq!(h.faults.len(), MAX_FAULTS);
        let dir = tempfile::tempdir().unwrap();
        h.save(dir.path()).unwrap();
        assert_eq!(History::load(dir.path()).unwrap(), h);
        std::fs::write(History::path(dir.path()), b"{not json").unwrap();
        let e = History::load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("history.json"), "{e}");
        // A link in its place is refused, not followed (issue 51).
        std::fs::remove_file(History::path(dir.path())).unwrap();
        let elsewhere = dir.path().join("elsewhere.json");
        h.save(dir.path()).unwrap();
        std::fs::rename(History::path(dir.path()), &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, History::path(dir.path())).unwrap();
        let e = History::load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("history.json") && e.contains("symbolic link"), "{e}");
    }
}
