//! gpu.* checks that need no NVML: Xid reports from the kernel log, and the SKU from the PCI id.

use super::{gpu_model, Finding};
use crate::facts::{self, XidClass};
use crate::snapshot::{Fact, Snapshot, XidEvent};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub fn run(s: &Snapshot, out: &mut Vec<Finding>) {
    xid(s, out);
    sku_known(s, out);
}

/// One Xid code on one GPU, summed over the log: what `gpu.xid` shows and the report carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct XidSummary {
    pub code: String,
    pub count: usize,
    pub meaning: String,
    /// Seconds since boot of the first and last report, when the log carries timestamps.
    pub first_seen_s: Option<f64>,
    pub last_seen_s: Option<f64>,
    pub last_message: String,
}

/// Groups Xid events per code, worst first (then by code).
pub fn summarize(events: &[&XidEvent]) -> Vec<XidSummary> {
    let mut by_code: BTreeMap<String, XidSummary> = BTreeMap::new();
    for e in events {
        let meaning = e
            .xid
            .and_then(facts::xid)
            .map(|x| x.meaning.to_string())
            .unwrap_or_else(|| "not in the agent's Xid table".into());
        let entry = by_code.entry(e.raw_code.clone()).or_insert_with(|| XidSummary {
            code: e.raw_code.clone(),
            count: 0,
            meaning,
            first_seen_s: None,
            last_seen_s: None,
            last_message: String::new(),
        });
        entry.count += 1;
        let t = e.usec.map(|u| u as f64 / 1e6);
        entry.first_seen_s = entry.first_seen_s.or(t);
        entry.last_seen_s = t.or(entry.last_seen_s);
        entry.last_message = e.message.clone();
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

fn xid(s: &Snapshot, out: &mut Vec<Finding>) {
    const ID: &str = "gpu.xid";
    let log = match &s.kernel_log {
        Fact::Value(l) => l,
        Fact::Error(e) => {
            out.push(
                Finding::unknown(ID, format!("cannot read the kernel log: {e}"))
                    .remedy("Run doctor as root (or with CAP_SYSLOG) so it can read /dev/kmsg."),
            );
            return;
        }
    };
    let gpus = s.gpus();
    let mut claimed = vec![false; log.xids.len()];
    for g in &gpus {
        let prefix = g.address_without_function();
        let events: Vec<&XidEvent> = log
            .xids
            .iter()
            .enumerate()
            .filter(|(i, e)| {
                let hit = e.pci == prefix || e.pci == g.address;
                if hit {
                    claimed[*i] = true;
                }
                hit
            })
            .map(|(_, e)| e)
            .collect();
        out.push(judge(&events, &log.source).gpu(&g.address));
    }
    // Xids for an address with no GPU on the bus now (a GPU that fell off the bus): still reported.
    let mut orphans: BTreeMap<&str, Vec<&XidEvent>> = BTreeMap::new();
    for (e, _) in log.xids.iter().zip(&claimed).filter(|(_, c)| !**c) {
        orphans.entry(e.pci.as_str()).or_default().push(e);
    }
    for (pci, events) in orphans {
        let f = judge(&events, &log.source).gpu(pci);
        out.push(Finding { detail: format!("No GPU is at this address on the PCI bus now. {}", f.detail), ..f });
    }
    if gpus.is_empty() && log.xids.is_empty() {
        out.push(Finding::pass(ID, "no NVIDIA GPU and no Xid in the kernel log"));
    }
}

fn judge(events: &[&XidEvent], source: &str) -> Finding {
    const ID: &str = "gpu.xid";
    if events.is_empty() {
        return Finding::pass(ID, format!("no Xid in the kernel log since boot ({source})"));
    }
    let summary = summarize(events);
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
    let f = match info {
        Some(i) if i.class != XidClass::Application => {
            f.remedy(i.action).detail(format!("Last report: {}", worst.last_message))
        }
        None => f.remedy("Look the code up in NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors) and report it to the platform with `phq-agent doctor --bundle`."),
        _ => f,
    };
    f.evidence("xids", summary)
}

fn sku_known(s: &Snapshot, out: &mut Vec<Finding>) {
    const ID: &str = "gpu.sku-known";
    let gpus = s.gpus();
    if gpus.is_empty() {
        out.push(Finding::pass(ID, "no NVIDIA GPU: nothing to check"));
    }
    for g in gpus {
        let id = format!("10de:{:04x}", g.device.unwrap_or(0));
        let f = match g.device.and_then(facts::sku) {
            Some(sku) => Finding::pass(ID, format!("{} ({id})", sku.name)),
            None => Finding::warn(ID, format!("{} ({id}) is not a GPU this agent has floors for", gpu_model(g)))
                .detail("The checks still run, but thresholds and probe floors are made for Hopper (H100, H200) and may not fit.")
                .remedy("Nothing to fix on the GPU; report the device id so it can be added to the SKU table."),
        };
        out.push(f.gpu(&g.address).evidence("pci_id", id).evidence(
            "subsystem",
            g.subsystem_device.map(|d| format!("{:04x}:{d:04x}", g.subsystem_vendor.unwrap_or(0))),
        ));
    }
}

#[cfg(test)]
mod tests {
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
