//! report: the `phq.status/v1` Report (schema in `schema/phq.status.v1.json`) built from a
//! snapshot and its findings, and its renderings for people (table) and machines (JSON).
//!
//! The rules of this room: it renders what it is given (snapshot, findings, probe results) and
//! touches no file but the bundles it writes and reads (`bundle.rs`); it judges nothing (`checks`
//! and `probe::judge` do); it imports `checks`, `probe`'s result types and below, never `serve`
//! or `cli`.

pub mod bundle;
pub mod html;
pub mod matrix;
pub mod probe_run;
pub mod table;
pub mod untrusted;

use crate::checks::xid::{summarize, XidSummary};
use crate::checks::{gpu_model, Finding, Severity};
use crate::snapshot::{PciLink, SecureBoot, Snapshot, Timestamp};
use serde::{Deserialize, Serialize};

pub const SCHEMA: &str = "phq.status/v1";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    Healthy,
    Degraded,
    Unhealthy,
    Unknown,
}

impl Health {
    /// fail → unhealthy, else warn → degraded, else unknown → unknown, else healthy.
    pub fn of(findings: &[Finding]) -> Health {
        match findings.iter().map(|f| f.severity).max() {
            Some(Severity::Fail) => Health::Unhealthy,
            Some(Severity::Warn) => Health::Degraded,
            Some(Severity::Unknown) => Health::Unknown,
            _ => Health::Healthy,
        }
    }
}

/// The monitoring-plugin exit code (Nagios plugin guidelines, as monitoring-plugins.org keeps them): 2 fail, 1 warn, 3 unknown, 0 all passed.
pub fn exit_code(findings: &[Finding]) -> i32 {
    match Health::of(findings) {
        Health::Unhealthy => 2,
        Health::Degraded => 1,
        Health::Unknown => 3,
        Health::Healthy => 0,
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentInfo {
    pub version: String,
    pub agent_id: String,
    pub boot_id: Option<String>,
    pub started_at: Timestamp,
    /// The service's event accounting since it started; absent outside `serve`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<EventCounts>,
    /// KubeVirt's CA bundle behind the vsock listener (`serve::client_ca`); absent outside
    /// `serve`, and where the listener is off or plain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_ca: Option<VsockCa>,
}

/// Where the vsock listener's CA bundle came from, how old it is, and the last call to
/// virt-handler's CA server (issue 50).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VsockCa {
    /// `None`: no bundle yet, every vsock client refused.
    pub source: Option<CaSource>,
    /// When the bundle in force was written (the file) or fetched.
    pub since: Option<Timestamp>,
    /// Seconds since then, when the report was made.
    pub age_s: Option<u64>,
    pub certificates: usize,
    /// The latest `notAfter` among its certificates: past it nothing chains to the bundle.
    pub expires: Option<Timestamp>,
    /// The last call to virt-handler's CA server.
    pub last_fetch: Option<CaFetch>,
}

/// Where a CA bundle came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CaSource {
    /// The file (`vsock.client_ca`), as cloud-init wrote it.
    CloudInit,
    /// virt-handler's CA server, over vsock from the host.
    VirtHandler,
}

/// One call to virt-handler's CA server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaFetch {
    pub at: Timestamp,
    pub server: String,
    /// `None`: a usable bundle came (in force from then on).
    pub error: Option<String>,
}

/// What became of the service's events since it started, so that a storm the agent merged or a
/// full spool is said in every report rather than lost silently.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventCounts {
    /// Xids folded into a later event's `count` (repeats of one code on one GPU in a window).
    pub merged: u64,
    /// Events not spooled because the spool was at its byte bound (or the disk refused them).
    pub dropped: u64,
    /// Events in the spool now, waiting for the platform.
    pub spooled: u64,
    /// Bytes the spool holds now.
    pub spool_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostSummary {
    pub hostname: Option<String>,
    pub os: Option<String>,
    pub os_id: Option<String>,
    pub os_version: Option<String>,
    pub kernel: Option<String>,
    /// `kubevirt`, `vm`, `bare-metal`, or `unknown`.
    pub virtualization: String,
    pub secure_boot: Option<SecureBoot>,
    pub nvswitches: usize,
    /// The vsock device's local CID, the platform's channel through KubeVirt; `None`: none.
    #[serde(default)]
    pub vsock_cid: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DriverSummary {
    pub loaded: bool,
    pub version: Option<String>,
    pub open_kernel_module: Option<bool>,
    pub cuda_toolkits: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuSummary {
    pub pci_address: String,
    /// From NVML once it is read; until then `null`.
    pub uuid: Option<String>,
    pub model: String,
    /// `10de:2330`
    pub pci_id: String,
    pub driver: Option<String>,
    pub bar1_bytes: Option<u64>,
    pub link: PciLink,
    /// The worst severity among the findings about this GPU.
    pub status: Severity,
    pub xids: Vec<XidSummary>,
    /// What identifies the physical part, not the VM's view of it (issue 39): NVML's board
    /// serial, board part number, VBIOS and InfoROM image versions. `null` where NVML did not
    /// read them; `identity_note` then says why.
    #[serde(default)]
    pub serial: Option<String>,
    #[serde(default)]
    pub board_part_number: Option<String>,
    #[serde(default)]
    pub vbios_version: Option<String>,
    #[serde(default)]
    pub inforom_image_version: Option<String>,
    /// The baseboard module (`nvmlDeviceGetModuleId`; 0: not on a baseboard); `null` where NVML
    /// does not give it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module_id: Option<u32>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub identity_note: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub schema: String,
    pub agent: AgentInfo,
    pub observed_at: Timestamp,
    /// Monotonic per agent across restarts for reports `serve` pushes; 0 for `doctor`.
    pub seq: u64,
    pub health: Health,
    pub host: HostSummary,
    pub driver: DriverSummary,
    pub gpus: Vec<GpuSummary>,
    pub findings: Vec<Finding>,
    /// Probe results; `null` when no probe ran.
    pub probes: Option<serde_json::Value>,
    /// The installer's state; `null` when no install has run.
    pub install: Option<serde_json::Value>,
    /// Set on a pushed event report: what happened. Absent on periodic status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<Event>,
    /// The one field a platform routes on: the most urgent action over all findings.
    #[serde(default)]
    pub verdict: Verdict,
    /// The probe run whose results `probes` holds (the service's reports; absent elsewhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_run: Option<probe_run::ProbeRun>,
}

/// The most urgent action over a report's findings (`route::Action`'s order), whose move it is,
/// the findings and GPUs it comes from and what backs it. The guest's root is the tenant's, so
/// a verdict is a claim: `basis` names its evidence for the platform to weigh.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Verdict {
    pub action: crate::checks::route::Action,
    pub owner: crate::checks::route::Owner,
    /// The ids of the findings that call for this action.
    pub findings: Vec<String>,
    /// The GPUs (PCI addresses) those findings are about.
    pub gpus: Vec<String>,
    /// What backs it: `nvml` (the driver through NVML), `kernel_log` (the kernel log alone),
    /// `probe` (a measurement through CUDA), `guest` (the guest's own files and services),
    /// `history` (the fault history escalated it: the same fault in several boots; `boots`).
    pub basis: Vec<String>,
    /// The boots the fault history saw the escalated fault in, when `basis` has `history`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub boots: Vec<String>,
    /// Since when this verdict has stood: the report's time unless the service's fault history
    /// knows an earlier one.
    pub since: Option<Timestamp>,
    /// A word for whoever acts on it, e.g. that a hardware verdict rests on the kernel log alone.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
}

/// What backs one finding (see `Verdict::basis`): where its reading came from, and `history`
/// beside it when the fault history decided its action.
fn basis_of(f: &Finding) -> impl Iterator<Item = &'static str> {
    let area = f.id.split('.').next().unwrap_or("");
    let reading = match area {
        "probe" => "probe",
        "gpu" if f.id == "gpu.xid" => {
            if f.evidence.get("authority").and_then(serde_json::Value::as_str) == Some("kernel_log") {
                "kernel_log"
            } else {
                "nvml"
            }
        }
        "fabric" if f.id == "fabric.sxid" => "kernel_log",
        "gpu" | "nvml" | "nvlink" | "fabric" => "nvml",
        _ => "guest",
    };
    let history =
        f.evidence.get(crate::checks::route::DECIDED_BY).and_then(serde_json::Value::as_str) == Some("history");
    std::iter::once(reading).chain(history.then_some("history"))
}

/// Every value `Verdict::basis` can hold, for the metrics' label and the schema (shared with the
/// platform's poller).
pub use phq_wire::BASES;

/// The verdict of routed findings (`route::apply` has run), at `at`.
pub fn verdict_of(findings: &[Finding], at: Timestamp) -> Verdict {
    use crate::checks::route::{Action, Owner};
    let worst = findings.iter().map(|f| f.action).max().unwrap_or(Action::None);
    if worst == Action::None {
        return Verdict { since: Some(at), ..Verdict::default() };
    }
    let from: Vec<&Finding> = findings.iter().filter(|f| f.action == worst).collect();
    // The platform's move over the tenant's when both are asked the same action.
    let owner = from.iter().map(|f| f.owner).max().unwrap_or(Owner::None);
    let mut ids: Vec<String> = from.iter().map(|f| f.id.clone()).collect();
    ids.dedup();
    let mut gpus: Vec<String> = from.iter().filter_map(|f| f.gpu.clone()).collect();
    gpus.sort();
    gpus.dedup();
    let mut basis: Vec<String> = from.iter().flat_map(|f| basis_of(f)).map(str::to_string).collect();
    basis.sort();
    basis.dedup();
    let mut boots: Vec<String> = from
        .iter()
        .filter(|f| f.evidence.contains_key(crate::checks::route::DECIDED_BY))
        .filter_map(|f| f.evidence.get("boot_ids")?.as_array().cloned())
        .flatten()
        .filter_map(|b| b.as_str().map(str::to_string))
        .collect();
    boots.sort();
    boots.dedup();
    let mut notes = Vec::new();
    if !boots.is_empty() {
        notes.push(format!(
            "Escalated by the fault history: the same fault on the same physical GPU in boots {}; no single reading decided it.",
            boots.join(", ")
        ));
    }
    if owner == Owner::Platform
        && basis.iter().all(|b| b == "kernel_log" || b == "history")
        && basis.iter().any(|b| b == "kernel_log")
    {
        notes.push(
            "Backed by the guest's kernel log alone: NVML did not report it and no probe measured it. The guest's root is \
             the tenant's; weigh it before draining hardware."
                .to_string(),
        );
    }
    Verdict { action: worst, owner, findings: ids, gpus, basis, boots, since: Some(at), note: notes.join(" ") }
}

/// The verdict of routed findings on snapshot `s` (`verdict_of`), saying when what it rests on
/// was read through a library other than the driver's own: `--nvml-lib` / `PHQ_NVML_LIB` for
/// `nvml`, `--cuda-lib` / `PHQ_CUDA_LIB` for `probe` (issue 51). Such a library answers whatever
/// it was written to answer, so the platform must know before it weighs the verdict.
pub fn verdict_for(s: &Snapshot, findings: &[Finding], at: Timestamp) -> Verdict {
    let mut v = verdict_of(findings, at);
    let mut said = Vec::new();
    let rests_on = |b: &str| v.basis.iter().any(|x| x == b);
    if let Some(lib) = s.nvml().map(|n| n.library.as_str()).filter(|l| *l != crate::collect::nvml::DEFAULT_LIBRARY) {
        if rests_on("nvml") {
            said.push(format!(
                "NVML was read from {lib} (--nvml-lib or PHQ_NVML_LIB), not the driver's {}",
                crate::collect::nvml::DEFAULT_LIBRARY
            ));
        }
    }
    if let Some(lib) = crate::cuda::driver::named_library() {
        if rests_on("probe") {
            said.push(format!(
                "the probes ran through {} (--cuda-lib or PHQ_CUDA_LIB), not the driver's libcuda.so.1",
                lib.display()
            ));
        }
    }
    if !said.is_empty() {
        let text = format!(
            "{}: what this verdict rests on came from a library named by whoever started the agent.",
            said.join("; ")
        );
        v.note = if v.note.is_empty() { text } else { format!("{} {text}", v.note) };
    }
    v
}

/// Something that happened, pushed through the spool so that it is never lost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Event {
    Xid {
        gpu: String,
        xid: u64,
        source: String,
        /// How many times this code was seen on this GPU in the window this event stands for
        /// (1 for the first, which is sent at once; the repeats come in one event at the window's
        /// end).
        #[serde(default = "one")]
        count: u64,
    },
    /// An NVSwitch SXid, from the kernel log (rule 9 of serve).
    Sxid {
        /// The NVSwitch's PCI address.
        nvswitch: String,
        sxid: u64,
        /// The driver's word: `Fatal` or `Non-fatal`.
        fatal: bool,
        source: String,
        /// As for Xids: 1 for the first, the repeats in one event at the window's end.
        #[serde(default = "one")]
        count: u64,
    },
    SeverityChange {
        check: String,
        gpu: Option<String>,
        from: Severity,
        to: Severity,
        summary: String,
    },
    /// The installer finished, failed, or stopped for a reboot (`install.status` of the report).
    Install {
        status: String,
        error: Option<String>,
    },
}

fn one() -> u64 {
    1
}

/// The report an event is pushed with: the periodic report's header (agent, time, health,
/// host, driver, install) and only what the event is about — its GPU and that GPU's non-passing
/// findings, or the finding that changed — so that a storm of events is a few KB each, not a
/// whole 8-GPU report each. The periodic status still carries everything.
pub fn event_report(base: &Report, event: Event) -> Report {
    let about_gpu = |gpu: &str| {
        let g = base.gpus.iter().find(|g| g.pci_address.eq_ignore_ascii_case(gpu) || g.uuid.as_deref() == Some(gpu));
        let keys: Vec<String> = g
            .map(|g| [Some(g.pci_address.clone()), g.uuid.clone()].into_iter().flatten().collect())
            .unwrap_or_default();
        (g.cloned().into_iter().collect::<Vec<_>>(), keys)
    };
    let (gpus, findings) = match &event {
        Event::Xid { gpu, .. } => {
            let (gpus, keys) = about_gpu(gpu);
            let findings = base
                .findings
                .iter()
                .filter(|f| f.severity != Severity::Pass)
                .filter(|f| {
                    f.gpu.as_deref().is_some_and(|g| keys.iter().any(|k| k.eq_ignore_ascii_case(g)) || g == gpu)
                })
                .cloned()
                .collect();
            (gpus, findings)
        }
        // The NVSwitch's finding, and the GPUs whose fabric a fatal one took down with theirs.
        Event::Sxid { nvswitch, .. } => {
            let findings: Vec<Finding> = base
                .findings
                .iter()
                .filter(|f| f.severity != Severity::Pass && f.id == "fabric.sxid")
                .filter(|f| {
                    f.gpu.as_deref() == Some(nvswitch.as_str())
                        || f.evidence
                            .get("nvswitches")
                            .and_then(|v| v.as_array())
                            .is_some_and(|a| a.iter().any(|s| s == nvswitch.as_str()))
                })
                .cloned()
                .collect();
            let gpus = base
                .gpus
                .iter()
                .filter(|g| findings.iter().any(|f| f.gpu.as_deref() == Some(g.pci_address.as_str())))
                .cloned()
                .collect();
            (gpus, findings)
        }
        Event::SeverityChange { check, gpu, .. } => {
            let gpus = gpu.as_deref().map(|g| about_gpu(g).0).unwrap_or_default();
            let findings = base.findings.iter().filter(|f| f.id == *check && f.gpu == *gpu).cloned().collect();
            (gpus, findings)
        }
        Event::Install { .. } => (vec![], vec![]),
    };
    Report { gpus, findings, probes: None, probe_run: None, event: Some(event), ..base.clone() }
}

/// The agent id: configured, else the VM firmware UUID, else the hostname.
pub fn agent_id(configured: &str, s: &Snapshot) -> String {
    if !configured.is_empty() {
        return configured.to_string();
    }
    s.host
        .dmi
        .value()
        .and_then(|d| d.product_uuid.clone())
        .or_else(|| s.host.hostname.clone())
        .unwrap_or_else(|| "unknown".into())
}

pub fn build(s: &Snapshot, findings: Vec<Finding>, agent_id: String, started_at: Timestamp, seq: u64) -> Report {
    let mut findings = findings;
    crate::checks::route::apply(&mut findings);
    let verdict = verdict_for(s, &findings, s.observed_at);
    let os = s.host.os.value();
    let gpus = s
        .gpus()
        .into_iter()
        .map(|g| {
            let prefix = g.address_without_function();
            let nv = s.nvml_gpu(&g.address);
            let (kmsg, nvml) = crate::checks::xid::events_for(s, &g.address);
            let xids = summarize(&kmsg, &nvml);
            let status = findings
                .iter()
                .filter(|f| f.gpu.as_deref() == Some(&g.address))
                .map(|f| f.severity)
                .max()
                .unwrap_or(Severity::Pass);
            GpuSummary {
                pci_address: g.address.clone(),
                uuid: s.nvml_gpu(&g.address).and_then(|n| n.uuid.value().cloned()).or_else(|| {
                    s.kernel_log
                        .value()
                        .and_then(|l| l.gpu_uuids.iter().find(|u| u.pci == prefix).map(|u| u.uuid.clone()))
                }),
                model: gpu_model(g),
                pci_id: format!("{:04x}:{:04x}", g.vendor.unwrap_or(0), g.device.unwrap_or(0)),
                driver: g.driver.clone(),
                bar1_bytes: g.bar(2).map(|b| b.size),
                link: g.link.clone(),
                status,
                xids,
                serial: nv.and_then(|n| n.serial.value().cloned()).filter(|v| !v.trim().is_empty()),
                board_part_number: nv.and_then(|n| n.board_part_number.value().cloned()),
                vbios_version: nv.and_then(|n| n.vbios_version.value().cloned()),
                inforom_image_version: nv.and_then(|n| n.inforom_image_version.value().cloned()),
                module_id: nv.and_then(|n| n.module_id.value().copied()),
                identity_note: match nv.map(|n| &n.serial) {
                    None => "NVML did not read this GPU: its board serial is unknown".into(),
                    Some(crate::snapshot::Nv::Value(v)) if !v.trim().is_empty() => String::new(),
                    Some(crate::snapshot::Nv::Value(_)) => "NVML returned an empty board serial".into(),
                    Some(crate::snapshot::Nv::NotSupported) => {
                        "NVML does not support reading the board serial here".into()
                    }
                    Some(crate::snapshot::Nv::Error(e)) => format!("NVML could not read the board serial: {e}"),
                },
            }
        })
        .collect();
    Report {
        schema: SCHEMA.into(),
        agent: AgentInfo {
            version: env!("CARGO_PKG_VERSION").into(),
            agent_id,
            boot_id: s.host.boot_id.clone(),
            started_at,
            events: None,
            vsock_ca: None,
        },
        observed_at: s.observed_at,
        seq,
        health: Health::of(&findings),
        host: HostSummary {
            hostname: s.host.hostname.clone(),
            os: os.map(|o| o.pretty_name.clone()).filter(|p| !p.is_empty()),
            os_id: os.map(|o| o.id.clone()).filter(|p| !p.is_empty()),
            os_version: os.map(|o| o.version_id.clone()).filter(|p| !p.is_empty()),
            kernel: s.host.kernel_release.value().cloned(),
            virtualization: crate::checks::host::virtualization_of(s).map(|v| v.label()).unwrap_or("unknown").into(),
            secure_boot: s.host.secure_boot.value().copied(),
            nvswitches: s.nvswitches().len(),
            vsock_cid: s.host.vsock_cid.value().copied().flatten(),
        },
        driver: DriverSummary {
            loaded: s.driver.modules.value().is_some_and(|m| m.iter().any(|n| n == "nvidia")),
            version: s.driver.nvrm.value().map(|v| v.version.clone()).or_else(|| s.driver.module_version.clone()),
            open_kernel_module: s.driver.nvrm.value().map(|v| v.open),
            cuda_toolkits: s
                .cuda_toolkits
                .value()
                .into_iter()
                .flatten()
                .filter_map(|t| t.version.value().cloned())
                .collect(),
        },
        gpus,
        findings,
        probes: None,
        install: None,
        event: None,
        verdict,
        probe_run: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::route::{Action, Owner, DECIDED_BY};

    /// Issue 51: a verdict the fault history escalated says `history` beside the reading's basis,
    /// names the boots, and keeps the kernel-log note when no other reading backs it.
    #[test]
    fn an_escalated_verdict_says_history_and_names_the_boots() {
        let at = Timestamp(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000));
        let mut f = Finding::fail("gpu.xid", "Xid 79")
            .gpu("0000:0c:00.0")
            .evidence("authority", "kernel_log")
            .evidence(DECIDED_BY, "history")
            .evidence("boot_ids", serde_json::json!(["boot-b", "boot-a"]));
        (f.action, f.owner) = (Action::InspectHardware, Owner::Platform);
        let v = verdict_of(&[f], at);
        assert_eq!(v.basis, vec!["history".to_string(), "kernel_log".to_string()]);
        assert_eq!(v.boots, vec!["boot-a".to_string(), "boot-b".to_string()]);
        assert!(v.note.contains("boots boot-a, boot-b") && v.note.contains("kernel log alone"), "{}", v.note);
    }
}
