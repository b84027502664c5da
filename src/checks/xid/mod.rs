//! gpu.xid: the Xids in the kernel log and NVML's event set, merged per GPU; and NVIDIA's catalog
//! of Xids and SXids, as data (`catalog.rs`, generated from data/ by scripts/gen-xid-catalog),
//! with the types that data is made of.

pub mod catalog;

use super::Finding;
use crate::facts::{self, XidClass};
use crate::snapshot::{Fact, Snapshot, XidEvent};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// gpu.xid for every GPU, and for addresses with Xids but no GPU on the bus now.
pub fn run(s: &Snapshot, out: &mut Vec<Finding>) {
    gpu_xid(s, out);
}

/// One Xid code on one GPU, summed over both sources: what `gpu.xid` shows and the report carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct XidSummary {
    pub code: String,
    /// Reports of this code. The kernel log holds every report since boot and NVML's event set
    /// only those while the agent listened, so the same Xid is usually in both: the count is
    /// the larger of the two, never their sum.
    pub count: usize,
    pub meaning: String,
    /// Seconds since boot of the first and last report, when the log carries timestamps.
    pub first_seen_s: Option<f64>,
    pub last_seen_s: Option<f64>,
    pub last_message: String,
    /// `kmsg`, `nvml`, or both.
    pub sources: Vec<String>,
}

/// Groups Xid reports per code from the kernel log and NVML's event set, worst first.
pub fn summarize(kmsg: &[&XidEvent], nvml: &[u64]) -> Vec<XidSummary> {
    let meaning = |code: Option<u32>| {
        code.and_then(facts::xid)
            .map(|x| x.meaning.to_string())
            .unwrap_or_else(|| "not in the agent's Xid table".into())
    };
    let mut by_code: BTreeMap<String, XidSummary> = BTreeMap::new();
    let blank = |code: &str, m: String| XidSummary {
        code: code.to_string(),
        count: 0,
        meaning: m,
        first_seen_s: None,
        last_seen_s: None,
        last_message: String::new(),
        sources: Vec::new(),
    };
    for e in kmsg {
        let entry = by_code.entry(e.raw_code.clone()).or_insert_with(|| blank(&e.raw_code, meaning(e.xid)));
        entry.count += 1;
        let t = e.usec.map(|u| u as f64 / 1e6);
        entry.first_seen_s = entry.first_seen_s.or(t);
        entry.last_seen_s = t.or(entry.last_seen_s);
        entry.last_message = e.message.clone();
        if entry.sources.is_empty() {
            entry.sources.push("kmsg".into());
        }
    }
    let mut nvml_counts: BTreeMap<u64, usize> = BTreeMap::new();
    for code in nvml {
        *nvml_counts.entry(*code).or_default() += 1;
    }
    for (code, n) in nvml_counts {
        let key = code.to_string();
        let entry = by_code.entry(key.clone()).or_insert_with(|| blank(&key, meaning(u32::try_from(code).ok())));
        entry.count = entry.count.max(n);
        entry.sources.push("nvml".into());
    }
    let mut v: Vec<XidSummary> = by_code.into_values().collect();
    v.sort_by_key(|x| (std::cmp::Reverse(class_rank(&x.code)), x.code.parse::<u64>().unwrap_or(u64::MAX)));
    v
}

/// Reset 3, unknown code 2, watch 1, application 0.
fn class_rank(code: &str) -> u8 {
    match code.parse::<u32>().ok().and_then(facts::xid).map(|x| x.class) {
        Some(XidClass::Reset) => 3,
        None => 2,
        Some(XidClass::Watch) => 1,
        Some(XidClass::Application) => 0,
    }
}

/// Xid reports for one GPU address from both sources.
pub fn events_for<'a>(s: &'a Snapshot, address: &str) -> (Vec<&'a XidEvent>, Vec<u64>) {
    let prefix = address.rsplit_once('.').map(|(a, _)| a).unwrap_or(address);
    let kmsg = s
        .kernel_log
        .value()
        .map(|l| l.xids.iter().filter(|e| e.pci == prefix || e.pci == address).collect())
        .unwrap_or_default();
    let nvml =
        s.nvml().map(|n| n.xid_events.iter().filter(|e| e.gpu == address).map(|e| e.xid).collect()).unwrap_or_default();
    (kmsg, nvml)
}

fn gpu_xid(s: &Snapshot, out: &mut Vec<Finding>) {
    const ID: &str = "gpu.xid";
    let nvml_listening = s.nvml().is_some_and(|n| n.events_error.is_none());
    let sources = match (&s.kernel_log, nvml_listening) {
        (Fact::Value(l), true) => format!("{} and NVML events", l.source),
        (Fact::Value(l), false) => l.source.clone(),
        (Fact::Error(_), _) => "NVML events".into(),
    };
    let gpus = s.gpus();
    let mut addresses: Vec<String> = gpus.iter().map(|g| g.address.clone()).collect();
    // Xids for an address with no GPU on the bus now (a GPU that fell off the bus): still reported.
    let known = |a: &str| gpus.iter().any(|g| g.address == a || g.address_without_function() == a);
    let mut orphans: Vec<String> = Vec::new();
    for e in s.kernel_log.value().map(|l| l.xids.as_slice()).unwrap_or_default() {
        if !known(&e.pci) && !orphans.contains(&e.pci) {
            orphans.push(e.pci.clone());
        }
    }
    for e in s.nvml().map(|n| n.xid_events.as_slice()).unwrap_or_default() {
        if !known(&e.gpu) && !orphans.contains(&e.gpu) {
            orphans.push(e.gpu.clone());
        }
    }
    addresses.extend(orphans.iter().cloned());
    for address in &addresses {
        let (kmsg, nvml) = events_for(s, address);
        let f = match (&s.kernel_log, kmsg.is_empty() && nvml.is_empty()) {
            (Fact::Error(e), true) => Finding::unknown(ID, format!("cannot read the kernel log: {e}"))
                .remedy("Run doctor as root (or with CAP_SYSLOG) so it can read /dev/kmsg."),
            _ => judge(&kmsg, &nvml, &sources),
        };
        let f = f.gpu(address);
        out.push(if orphans.contains(address) {
            Finding { detail: format!("No GPU is at this address on the PCI bus now. {}", f.detail), ..f }
        } else {
            f
        });
    }
    if addresses.is_empty() {
        out.push(match &s.kernel_log {
            Fact::Value(_) => Finding::pass(ID, "no NVIDIA GPU and no Xid in the kernel log"),
            Fact::Error(_) => Finding::pass(ID, "no NVIDIA GPU: nothing to check"),
        });
    }
}

fn judge(kmsg: &[&XidEvent], nvml: &[u64], sources: &str) -> Finding {
    const ID: &str = "gpu.xid";
    if kmsg.is_empty() && nvml.is_empty() {
        return Finding::pass(ID, format!("no Xid since boot ({sources})"));
    }
    let summary = summarize(kmsg, nvml);
    let line =
        summary.iter().map(|x| format!("Xid {} ({}) ×{}", x.code, x.meaning, x.count)).collect::<Vec<_>>().join(", ");
    let worst = &summary[0];
    let info = worst.code.parse::<u32>().ok().and_then(facts::xid);
    let f = match info.map(|i| i.class) {
        Some(XidClass::Reset) => Finding::fail(ID, line),
        Some(XidClass::Watch) => Finding::warn(ID, line),
        Some(XidClass::Application) => {
            Finding::pass(ID, line).detail("Application-level errors: the application faulted, the GPU did not.")
        }
        None => Finding::warn(ID, line)
            .detail(format!("Xid {} is not in the agent's table; look it up in NVIDIA's Xid catalog.", worst.code)),
    };
    let last = if worst.last_message.is_empty() {
        "Reported through NVML's event set.".to_string()
    } else {
        format!("Last report: {}", worst.last_message)
    };
    let f = match info {
        Some(i) if i.class != XidClass::Application => f.remedy(i.action).detail(last),
        None => f.remedy("Look the code up in NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors) and report it to the platform with `phq-agent doctor --bundle`."),
        _ => f,
    };
    f.evidence("xids", summary)
}

/// Which GPUs NVIDIA's catalog says a code applies to (its "Applies to" columns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applies {
    pub a100: bool,
    pub h100: bool,
    pub b100: bool,
    pub gb200: bool,
}

/// The catalog's "Resolution Bucket (Immediate Action)": what NVIDIA says to do at once to get
/// the GPU back into service. One variant per bucket the catalog uses; `bucket()` is its
/// spelling there (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, "Guidance
/// Class" sheet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Immediate {
    RestartApp,
    ResetGpu,
    RestartVm,
    RestartBm,
    Ignore,
    CheckMechanicals,
    UpdateSwfw,
    CheckUvm,
    WorkflowXid45,
    WorkflowXid48,
    WorkflowNvlinkErr,
    WorkflowNvlink5Err,
    Xid154,
    ContactSupport,
    /// The catalog gives no resolution yet (codes 162–172 when it was read).
    None,
}

impl Immediate {
    /// The bucket as NVIDIA's catalog names it; `""` for none.
    pub fn bucket(self) -> &'static str {
        match self {
            Immediate::RestartApp => "RESTART_APP",
            Immediate::ResetGpu => "RESET_GPU",
            Immediate::RestartVm => "RESTART_VM",
            Immediate::RestartBm => "RESTART_BM",
            Immediate::Ignore => "IGNORE",
            Immediate::CheckMechanicals => "CHECK_MECHANICALS",
            Immediate::UpdateSwfw => "UPDATE_SWFW",
            Immediate::CheckUvm => "CHECK_UVM",
            Immediate::WorkflowXid45 => "WORKFLOW_XID_45",
            Immediate::WorkflowXid48 => "WORKFLOW_XID_48",
            Immediate::WorkflowNvlinkErr => "WORKFLOW_NVLINK_ERR",
            Immediate::WorkflowNvlink5Err => "WORKFLOW_NVLINK5_ERR",
            Immediate::Xid154 => "XID_154",
            Immediate::ContactSupport => "CONTACT_SUPPORT",
            Immediate::None => "",
        }
    }
}

/// One row of NVIDIA's Xid catalog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidEntry {
    pub code: u32,
    pub mnemonic: &'static str,
    pub description: &'static str,
    pub applies: Applies,
    pub immediate: Immediate,
    /// The catalog's "Resolution Bucket (Investigatory Action)", as it spells it; empty when
    /// it gives none.
    pub investigatory: &'static str,
}

impl XidEntry {
    /// The catalog describes codes it no longer uses as "Unused" (deprecated, or seen only on
    /// V100 and older GPUs, in the catalog's own column notes).
    pub fn unused(&self) -> bool {
        self.description == "Unused"
    }
}

/// The catalog's row for `code`.
pub fn xid(code: u32) -> Option<&'static XidEntry> {
    catalog::XIDS.binary_search_by_key(&code, |x| x.code).ok().map(|i| &catalog::XIDS[i])
}

/// Which of the Fabric Manager User Guide's SXid tables lists a code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SxidTable {
    NonFatal,
    Fatal,
    /// Fatal to the whole fabric: the host, or all GPUs and NVSwitches, must be reset.
    AlwaysFatal,
    /// "Other notable" SXids that may affect the fabric.
    Other,
}

/// The guide's recovery for an SXid, classified (data/sxid-catalog.tsv says how).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SxidRecovery {
    None,
    RestartVm,
    ResetGpu,
    ResetAll,
    CheckLinks,
    Watch,
    Cooling,
}

/// One SXid of the Fabric Manager User Guide's tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SxidEntry {
    pub code: u32,
    pub table: SxidTable,
    /// The guide's error string (empty where it gives none).
    pub name: &'static str,
    pub recovery: SxidRecovery,
}

/// The guide's row for SXid `code`.
pub fn sxid(code: u32) -> Option<&'static SxidEntry> {
    catalog::SXIDS.binary_search_by_key(&code, |x| x.code).ok().map(|i| &catalog::SXIDS[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_find_every_row_and_nothing_else() {
        for x in catalog::XIDS {
            assert_eq!(xid(x.code), Some(x));
        }
        for s in catalog::SXIDS {
            assert_eq!(sxid(s.code), Some(s));
        }
        assert_eq!(xid(0), None);
        assert_eq!(xid(173), None);
        assert_eq!(sxid(12029), None);
        assert_eq!(
            xid(79).map(|x| (x.mnemonic, x.immediate)),
            Some(("ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", Immediate::RestartBm))
        );
        assert_eq!(sxid(20034).map(|s| (s.name, s.table)), Some(("LTSSM Fault Up", SxidTable::Fatal)));
    }

    /// The counts NVIDIA's page gives: about 170 codes, 109 of them in use.
    #[test]
    fn the_catalog_is_whole() {
        assert_eq!(catalog::XIDS.len(), 172);
        assert_eq!(catalog::XIDS.iter().filter(|x| !x.unused()).count(), 109);
        assert!(catalog::XIDS.iter().enumerate().all(|(i, x)| x.code == i as u32 + 1), "codes 1..=172, no gap");
    }
}

#[cfg(test)]
mod gpu_xid_tests {
    use super::super::testutil::*;
    use super::*;
    use crate::checks::Severity;
    use crate::snapshot::*;

    fn with_xids(events: Vec<(&str, &str, u64)>) -> Snapshot {
        let mut s = healthy();
        s.kernel_log = Fact::Value(KernelLog {
            source: "/dev/kmsg".into(),
            xids: events
                .into_iter()
                .map(|(pci, code, usec)| XidEvent {
                    pci: pci.into(),
                    xid: code.parse().ok(),
                    raw_code: code.into(),
                    usec: Some(usec),
                    seq: None,
                    message: "m".into(),
                })
                .collect(),
            ..Default::default()
        });
        s
    }

    fn xids(s: &Snapshot) -> Vec<Finding> {
        let mut out = Vec::new();
        run(s, &mut out);
        out.into_iter().filter(|f| f.id == "gpu.xid").collect()
    }

    #[test]
    fn xid_79_fails_the_named_gpu_only() {
        let f = xids(&with_xids(vec![("0000:0c:00", "79", 5_000_000)]));
        let bad: Vec<_> = f.iter().filter(|f| f.severity == Severity::Fail).collect();
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].gpu.as_deref(), Some("0000:0c:00.0"));
        assert!(bad[0].summary.contains("fallen off the bus"));
        assert!(bad[0].remedy.as_ref().unwrap().contains("Restart the VM"));
        assert_eq!(f.iter().filter(|f| f.severity == Severity::Pass).count(), 7);
    }

    #[test]
    fn repeats_are_counted_and_worst_first() {
        let s = with_xids(vec![("0000:09:00", "13", 1), ("0000:09:00", "13", 2), ("0000:09:00", "119", 3)]);
        let f = &xids(&s)[0];
        assert_eq!(f.severity, Severity::Fail);
        assert!(f.summary.starts_with("Xid 119"), "{}", f.summary);
        assert!(f.summary.contains("Xid 13 (graphics engine exception) ×2"), "{}", f.summary);
    }

    #[test]
    fn application_xid_passes_unknown_and_absurd_codes_warn() {
        assert_eq!(xids(&with_xids(vec![("0000:09:00", "13", 1)]))[0].severity, Severity::Pass);
        assert_eq!(xids(&with_xids(vec![("0000:09:00", "7777", 1)]))[0].severity, Severity::Warn);
        let f = &xids(&with_xids(vec![("0000:09:00", "99999999999999999999999", 1)]))[0];
        assert_eq!(f.severity, Severity::Warn);
        assert!(f.remedy.is_some());
    }

    #[test]
    fn xid_for_a_vanished_gpu_is_still_reported() {
        let f = xids(&with_xids(vec![("0000:42:00", "79", 1)]));
        let o = f.iter().find(|f| f.gpu.as_deref() == Some("0000:42:00")).unwrap();
        assert_eq!(o.severity, Severity::Fail);
        assert!(o.detail.starts_with("No GPU is at this address"));
    }

    #[test]
    fn unreadable_log_is_unknown_with_remedy() {
        let mut s = healthy();
        s.kernel_log = Fact::Error("/dev/kmsg: Permission denied".into());
        let f = &xids(&s)[0];
        assert_eq!(f.severity, Severity::Unknown);
        assert!(f.summary.contains("Permission denied"));
    }
}
