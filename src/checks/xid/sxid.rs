//! fabric.sxid: the SXids the NVSwitch driver wrote to the kernel log, per NVSwitch, and for the
//! GPUs behind an NVSwitch whose SXid was fatal.
//!
//! Rules:
//! 1. The driver's own word decides: a `Fatal` SXid fails its NVSwitch and the NVLink fabric of
//!    every GPU behind it; a `Non-fatal` one warns. The Fabric Manager User Guide's tables name
//!    the code and say what recovers it. — `judge_switch`
//! 2. The GPUs behind an NVSwitch are those whose NVLinks NVML says end at it; without NVML's
//!    word, every GPU of the VM (on HGX H100 each GPU has NVLinks to all four NVSwitches, Fabric
//!    Manager User Guide, "NVSwitch-Based Systems"). — `gpus_behind`
//! 3. In a passthrough VM the recovery is a restart of the VM (it resets the NVSwitches and GPUs
//!    with it, and the fabric manager trains the fabric again when it starts); an SXid the guide
//!    calls fatal to the whole fabric may need the host. — `fatal_remedy`

use super::catalog::{SXID_GUIDE, SXID_READ};
use super::{sxid, SxidRecovery, SxidTable};
use crate::checks::{Finding, Severity};
use crate::snapshot::{Fact, Snapshot, SxidEvent};
use serde::Serialize;
use std::collections::BTreeMap;

const ID: &str = "fabric.sxid";

/// One SXid code on one NVSwitch.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SxidSummary {
    pub code: String,
    /// The guide's name for it, or why there is none.
    pub name: String,
    /// Which of the guide's tables lists it: `non-fatal`, `fatal`, `always-fatal`, `other`;
    /// `unlisted` when none does.
    pub table: &'static str,
    pub fatal: usize,
    pub non_fatal: usize,
    /// The NVLink ports the reports name.
    pub links: Vec<u32>,
    pub last_message: String,
}

/// SXid reports per code, fatal ones first.
pub fn summarize(events: &[&SxidEvent]) -> Vec<SxidSummary> {
    let mut by_code: BTreeMap<String, SxidSummary> = BTreeMap::new();
    for e in events {
        let entry = by_code.entry(e.raw_code.clone()).or_insert_with(|| {
            let row = e.sxid.and_then(sxid);
            SxidSummary {
                code: e.raw_code.clone(),
                name: match row {
                    Some(r) if !r.name.is_empty() => r.name.to_string(),
                    Some(_) => "named by no error string in the guide".into(),
                    None => format!("not in the {SXID_GUIDE} tables"),
                },
                table: match row.map(|r| r.table) {
                    Some(SxidTable::NonFatal) => "non-fatal",
                    Some(SxidTable::Fatal) => "fatal",
                    Some(SxidTable::AlwaysFatal) => "always-fatal",
                    Some(SxidTable::Other) => "other",
                    None => "unlisted",
                },
                fatal: 0,
                non_fatal: 0,
                links: Vec::new(),
                last_message: String::new(),
            }
        });
        if e.fatal {
            entry.fatal += 1;
        } else {
            entry.non_fatal += 1;
        }
        if let Some(l) = e.link {
            if !entry.links.contains(&l) {
                entry.links.push(l);
            }
        }
        entry.last_message = e.message.clone();
    }
    let mut v: Vec<SxidSummary> = by_code.into_values().collect();
    v.sort_by_key(|x| (x.fatal == 0, x.code.parse::<u64>().unwrap_or(u64::MAX)));
    v
}

/// The SXid reports of one NVSwitch address.
pub fn events_for<'a>(s: &'a Snapshot, address: &str) -> Vec<&'a SxidEvent> {
    s.kernel_log.value().map(|l| l.sxids.iter().filter(|e| e.pci == address).collect()).unwrap_or_default()
}

/// Rule 2: the GPUs whose NVLinks end at `switch`, and whether NVML said so.
fn gpus_behind(s: &Snapshot, switch: &str) -> (Vec<String>, bool) {
    let Some(n) = s.nvml() else { return (s.gpus().iter().map(|g| g.address.clone()).collect(), false) };
    let mut said = false;
    let mut behind = Vec::new();
    for g in &n.devices {
        let Some(links) = g.nvlinks.value() else { continue };
        let ends: Vec<&str> = links.iter().filter_map(|l| l.remote_pci.value().map(String::as_str)).collect();
        said |= !ends.is_empty();
        if ends.iter().any(|e| e.eq_ignore_ascii_case(switch)) {
            behind.push(super::super::gpu_label(g));
        }
    }
    if said {
        (behind, true)
    } else {
        (s.gpus().iter().map(|g| g.address.clone()).collect(), false)
    }
}

pub fn run(s: &Snapshot, out: &mut Vec<Finding>) {
    let switches: Vec<String> = s.nvswitches().iter().map(|d| d.address.clone()).collect();
    let all: &[SxidEvent] = s.kernel_log.value().map(|l| l.sxids.as_slice()).unwrap_or_default();
    let mut addresses = switches.clone();
    // SXids of an NVSwitch that is not on the bus now: still reported.
    for e in all {
        if !addresses.contains(&e.pci) {
            addresses.push(e.pci.clone());
        }
    }
    if addresses.is_empty() {
        out.push(Finding::pass(ID, "no NVSwitch in this VM: no SXid to read"));
        return;
    }
    let mut fatal_gpus: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    for address in &addresses {
        let events = events_for(s, address);
        if let (Fact::Error(e), true) = (&s.kernel_log, events.is_empty()) {
            out.push(
                Finding::unknown(ID, format!("cannot read the kernel log: {e}"))
                    .remedy("Run doctor as root (or with CAP_SYSLOG) so it can read /dev/kmsg.")
                    .gpu(address),
            );
            continue;
        }
        let f = judge_switch(s, address, &events);
        if f.severity == Severity::Fail {
            let (gpus, _) = gpus_behind(s, address);
            for g in gpus {
                fatal_gpus.entry(g).or_default().push((address.clone(), f.summary.clone()));
            }
        }
        out.push(if switches.contains(address) {
            f
        } else {
            Finding { detail: format!("No NVSwitch is at this address on the PCI bus now. {}", f.detail), ..f }
        });
    }
    // Rule 1: a fatal SXid is a failure of the fabric for every GPU behind the NVSwitch.
    for (gpu, from) in fatal_gpus {
        let list = from.iter().map(|(sw, what)| format!("NVSwitch {sw}: {what}")).collect::<Vec<_>>().join("; ");
        out.push(
            Finding::fail(ID, format!("the NVLink fabric of this GPU is down: a fatal SXid on {}", from.iter().map(|(sw, _)| sw.as_str()).collect::<Vec<_>>().join(", ")))
                .detail(format!("{list}. Peer-to-peer traffic over NVLink through that NVSwitch stops; a fatal SXid on a GPU's port reaches the GPU as Xid 74 (Fabric Manager User Guide, \"Fatal NVSwitch SXid Errors\")."))
                .remedy(fatal_remedy(&[]))
                .evidence("nvswitches", from.iter().map(|(sw, _)| sw).collect::<Vec<_>>())
                .gpu(gpu),
        );
    }
}

/// Rule 3 for a fatal SXid; `codes` are the SXids on the NVSwitch, for the ones fatal to the
/// whole fabric.
fn fatal_remedy(codes: &[&SxidSummary]) -> String {
    let mut r = "Restart the VM: that resets the NVSwitches and GPUs passed through to it, and the fabric manager trains the NVLink fabric again when it starts (check fabric.manager-running and fabric.state afterwards); the Fabric Manager User Guide's recovery for a fatal SXid is to restart the guest VM whose GPUs use the port. If the same SXid comes back, report the NVSwitch and its link to the platform with `phq-agent doctor --bundle`.".to_string();
    let whole: Vec<&str> = codes
        .iter()
        .filter(|x| {
            x.code
                .parse()
                .ok()
                .and_then(sxid)
                .is_some_and(|r| r.table == SxidTable::AlwaysFatal || r.recovery == SxidRecovery::ResetAll)
        })
        .map(|x| x.code.as_str())
        .collect();
    if !whole.is_empty() {
        r.push_str(&format!(" SXid {} is fatal to the whole fabric: if the fabric does not come back after the VM restart, every NVSwitch and GPU of the host must be reset or the host restarted, which only the platform can do.", whole.join(", ")));
    }
    r
}

/// What a non-fatal SXid of the guide's tables asks for, and how it ranks among several.
fn non_fatal_remedy(code: &str) -> (u8, String) {
    let Some(row) = code.parse().ok().and_then(sxid) else {
        return (1, format!("SXid {code} is not in the {SXID_GUIDE} tables (read {SXID_READ}): report it to the platform with `phq-agent doctor --bundle` if it repeats."));
    };
    match row.recovery {
        SxidRecovery::ResetAll => (6, "The guide resets all GPUs and NVSwitches for it, and it usually comes with a fatal SXid: restart the VM, and report it to the platform.".into()),
        SxidRecovery::RestartVm => (5, "Restart the VM: NVLink traffic through this port is stalled, and the driver aborts CUDA jobs on the GPUs behind it (Xid 45) until then.".into()),
        SxidRecovery::ResetGpu => (4, "Reset the GPU on that link (restart the VM).".into()),
        SxidRecovery::CheckLinks => (3, "Unless the VM was shut down without the fabric manager stopping first, the link's connections must be checked on the host: report it to the platform.".into()),
        SxidRecovery::Cooling => (2, "The NVSwitch's cooling may not keep up (its links can drop to a single lane): report it to the platform.".into()),
        SxidRecovery::Watch => (2, "Not fatal by itself, but fatal SXids may follow it: report it to the platform if it repeats.".into()),
        SxidRecovery::None => (0, "No action: the NVSwitch corrected it, with no effect on the VM. Report it if it keeps coming.".into()),
    }
}

/// Rules 1 and 3 for one NVSwitch.
fn judge_switch(s: &Snapshot, address: &str, events: &[&SxidEvent]) -> Finding {
    let device = events.first().map(|e| format!(" (nvidia-{})", e.device)).unwrap_or_default();
    if events.is_empty() {
        return Finding::pass(ID, "no SXid since boot").gpu(address);
    }
    let summary = summarize(events);
    let line = summary
        .iter()
        .map(|x| {
            let mut counts = Vec::new();
            if x.fatal > 0 {
                counts.push(format!("fatal ×{}", x.fatal));
            }
            if x.non_fatal > 0 {
                counts.push(format!("non-fatal ×{}", x.non_fatal));
            }
            format!("SXid {} ({}) {}", x.code, x.name, counts.join(", "))
        })
        .collect::<Vec<_>>()
        .join(", ");
    let links: Vec<String> = summary.iter().flat_map(|x| x.links.iter().map(|l| l.to_string())).collect();
    let fatal = summary.iter().any(|x| x.fatal > 0);
    let mut detail = Vec::new();
    for x in &summary {
        let listed = match x.table {
            "unlisted" => format!("not in the {SXID_GUIDE} tables (read {SXID_READ})"),
            t => format!("the guide lists it as {t}"),
        };
        detail.push(format!("SXid {} ({}): {listed}; last report: \"{}\".", x.code, x.name, x.last_message));
    }
    let f = if fatal {
        let (gpus, from_nvml) = gpus_behind(s, address);
        detail.push(format!(
            "The NVSwitch{device} reported a fatal error{}: the NVLink fabric through it is down for {} GPU(s) behind it ({}), {}.",
            if links.is_empty() { String::new() } else { format!(" on link(s) {}", links.join(", ")) },
            gpus.len(),
            gpus.join(", "),
            if from_nvml { "from NVML's NVLink remote ends" } else { "every GPU of the VM, since NVML does not say which links end here (on HGX H100 each GPU has NVLinks to all four NVSwitches)" }
        ));
        Finding::fail(ID, line).remedy(fatal_remedy(&summary.iter().collect::<Vec<_>>())).evidence("gpus", gpus)
    } else {
        let remedy = summary
            .iter()
            .map(|x| non_fatal_remedy(&x.code))
            .max_by_key(|(rank, _)| *rank)
            .map(|(_, r)| r)
            .unwrap_or_default();
        detail.push(format!("Non-fatal: the NVSwitch{device} reported the error and kept the fabric up."));
        Finding::warn(ID, line).remedy(remedy)
    };
    f.detail(detail.join("\n")).evidence("sxids", &summary).evidence("links", links).gpu(address)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::testutil::*;
    use crate::snapshot::*;

    /// `healthy()` (four NVSwitches at 0000:11–14:00.0, every GPU with NVLinks to each) with
    /// these kmsg records as its kernel log.
    fn with_log(kmsg: &str) -> Snapshot {
        let mut s = healthy();
        s.kernel_log = Fact::Value(crate::collect::kmsg::parse(kmsg, "/dev/kmsg"));
        s
    }

    fn sxids(s: &Snapshot) -> Vec<Finding> {
        let mut out = Vec::new();
        run(s, &mut out);
        out
    }

    /// The findings about GPUs (not NVSwitches).
    fn on_gpus(f: &[Finding]) -> Vec<&Finding> {
        let gpus: Vec<String> = healthy().gpus().iter().map(|g| g.address.clone()).collect();
        f.iter().filter(|f| f.gpu.as_ref().is_some_and(|g| gpus.contains(g))).collect()
    }

    fn of(f: &[Finding], device: &str) -> Finding {
        f.iter().find(|f| f.gpu.as_deref() == Some(device)).cloned().unwrap()
    }

    /// An example line of each kind, as leptonai/gpud quotes them in its SXid package's comments
    /// (codes from the Fabric Manager User Guide's tables), on this VM's switches.
    const FATAL: &str =
        "3,1400,9100000000,-;nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30 LTSSM Fault Up\n";
    const NON_FATAL: &str = "4,1401,9200000000,-;nvidia-nvswitch3: SXid (PCI:0000:14:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)\n";

    #[test]
    fn healthy_switches_pass_and_no_switch_passes_once() {
        let f = sxids(&healthy());
        assert_eq!(f.len(), 4);
        assert!(f.iter().all(|f| f.severity == Severity::Pass && f.summary == "no SXid since boot"));
        let mut s = healthy();
        if let Fact::Value(d) = &mut s.pci {
            d.retain(|d| !d.is_nvswitch());
        }
        let f = sxids(&s);
        assert_eq!((f.len(), f[0].severity, f[0].gpu.clone()), (1, Severity::Pass, None));
    }

    #[test]
    fn a_fatal_sxid_fails_its_switch_and_the_fabric_of_every_gpu_behind_it() {
        let f = sxids(&with_log(FATAL));
        let sw = of(&f, "0000:11:00.0");
        assert_eq!(sw.severity, Severity::Fail);
        assert_eq!(sw.summary, "SXid 20034 (LTSSM Fault Up) fatal ×1");
        assert!(sw.remedy.as_ref().unwrap().starts_with("Restart the VM"), "{:?}", sw.remedy);
        assert!(sw.detail.contains("down for 8 GPU(s) behind it"), "{}", sw.detail);
        assert!(sw.detail.contains("from NVML's NVLink remote ends"), "{}", sw.detail);
        assert_eq!(sw.evidence["links"], serde_json::json!(["30"]));
        for other in ["0000:12:00.0", "0000:13:00.0", "0000:14:00.0"] {
            assert_eq!(of(&f, other).severity, Severity::Pass, "{other}");
        }
        let gpus = on_gpus(&f);
        assert_eq!(gpus.len(), 8);
        assert!(gpus
            .iter()
            .all(|g| g.severity == Severity::Fail && g.summary.ends_with("a fatal SXid on 0000:11:00.0")));
    }

    #[test]
    fn the_gpus_behind_a_switch_are_those_nvml_links_to_it() {
        let mut s = with_log(FATAL);
        // GPU 0000:09:00.0 has no NVLink to 0000:11:00.0.
        if let Nv::Value(l) = &mut gpu_mut(&mut s, 0).nvlinks {
            for k in l.iter_mut() {
                k.remote_pci = Nv::Value("0000:12:00.0".into());
            }
        }
        let f = sxids(&s);
        assert_eq!(on_gpus(&f).len(), 7);
        assert!(!f.iter().any(|f| f.gpu.as_deref() == Some("0000:09:00.0")));
    }

    #[test]
    fn a_non_fatal_sxid_warns_its_switch_only_with_the_guides_recovery() {
        let f = sxids(&with_log(NON_FATAL));
        let sw = of(&f, "0000:14:00.0");
        assert_eq!(sw.severity, Severity::Warn);
        assert_eq!(sw.summary, "SXid 12028 (egress non-posted PRIV error) non-fatal ×1");
        assert!(sw.remedy.as_ref().unwrap().starts_with("Restart the VM: NVLink traffic through this port is stalled"));
        assert_eq!(f.iter().filter(|f| f.severity != Severity::Pass).count(), 1, "no GPU fails for a non-fatal SXid");
        // A corrected ECC error on the switch: nothing to do.
        let f = sxids(&with_log("4,1402,1,-;nvidia-nvswitch3: SXid (PCI:0000:14:00.0): 19049, Non-fatal, Link 02 NCISOC HDR ECC error (First)\n"));
        let sw = of(&f, "0000:14:00.0");
        assert_eq!(sw.summary, "SXid 19049 (Single bit ECC errors) non-fatal ×1");
        assert!(sw.remedy.unwrap().starts_with("No action"));
    }

    #[test]
    fn the_drivers_word_decides_for_codes_the_guide_does_not_list() {
        let f = sxids(&with_log(
            "3,1,1,-;nvidia-nvswitch1: SXid (PCI:0000:12:00.0): 28006, Non-fatal, Link 29 MC TS crumbstore MCTO\n",
        ));
        let sw = of(&f, "0000:12:00.0");
        assert_eq!(sw.severity, Severity::Warn);
        assert!(
            sw.summary.contains("not in the NVIDIA Fabric Manager User Guide 2.3 (2025-03-04) tables"),
            "{}",
            sw.summary
        );
    }

    #[test]
    fn an_sxid_fatal_to_the_whole_fabric_names_the_host() {
        let f = sxids(&with_log(
            "3,1,1,-;nvidia-nvswitch2: SXid (PCI:0000:13:00.0): 23001, Fatal, Link 12 ingress SRC-VC buffer overflow\n",
        ));
        let r = of(&f, "0000:13:00.0").remedy.unwrap();
        assert!(r.contains("SXid 23001 is fatal to the whole fabric"), "{r}");
    }

    #[test]
    fn sxids_of_a_switch_gone_from_the_bus_are_still_reported() {
        let f = sxids(&with_log(
            "3,1,1,-;nvidia-nvswitch7: SXid (PCI:0000:7f:00.0): 20034, Fatal, Link 3 LTSSM Fault Up\n",
        ));
        let sw = of(&f, "0000:7f:00.0");
        assert_eq!(sw.severity, Severity::Fail);
        assert!(sw.detail.starts_with("No NVSwitch is at this address"));
    }

    #[test]
    fn an_unreadable_log_is_unknown_per_switch() {
        let mut s = healthy();
        s.kernel_log = Fact::Error("/dev/kmsg: Permission denied".into());
        let f = sxids(&s);
        assert_eq!(f.len(), 4);
        assert!(f.iter().all(|f| f.severity == Severity::Unknown));
    }
}
