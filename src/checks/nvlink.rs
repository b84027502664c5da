//! NVLink per GPU, from NVML: nvlink.links-active and nvlink.errors. Whether the fabric that
//! trains the links runs is `fabric`'s. How many links a GPU should have up comes from its SKU
//! (`facts::nvlink_use`): all of them on SXM, the bridge's share on a bridged PCIe pair.

use super::{has_nvswitches, missing, Finding};
use crate::facts::{self, NvlinkUse};
use crate::snapshot::{Nv, NvLinkInfo, NvmlGpu, Snapshot};

pub(super) fn links_active(s: &Snapshot, g: &NvmlGpu) -> Finding {
    let bridged = device_id(s, g).and_then(facts::nvlink_use);
    match bridged {
        Some(NvlinkUse::Bridged { links, bridge_required }) => bridged_links(s, g, links, bridge_required),
        _ => switched_links(s, g),
    }
}

const LINKS_ACTIVE: &str = "nvlink.links-active";

/// The GPU's PCI device id: NVML's (`pciDeviceId` holds the device id in its upper 16 bits and
/// the vendor's in the lower, NVML API reference `nvmlPciInfo_t`), else the PCI tree's.
fn device_id(s: &Snapshot, g: &NvmlGpu) -> Option<u16> {
    let from_nvml = g.pci_device_id.value().map(|v| (v >> 16) as u16);
    from_nvml.or_else(|| {
        let address = g.pci_address.value()?;
        s.gpus().into_iter().find(|d| &d.address == address)?.device
    })
}

/// Link numbers for a finding: `4, 11`.
fn list(links: &[u32]) -> String {
    links.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(", ")
}

/// SXM on an HGX board (and any SKU without a sourced link count): every link NVML lists is
/// expected up, unless none is and the VM has no NVSwitch (NVLink not in use).
fn switched_links(s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = LINKS_ACTIVE;
    let links = match &g.nvlinks {
        Nv::Value(l) => l,
        Nv::NotSupported => return Finding::pass(ID, "no NVLink on this GPU (NVML reports none)"),
        other => return missing(ID, "NVLink state", other),
    };
    let (active, inactive) = split(links);
    let f = if links.is_empty() {
        Finding::pass(ID, "no NVLink on this GPU")
    } else if inactive.is_empty() {
        Finding::pass(ID, format!("{}/{} NVLinks active", active.len(), links.len()))
    } else if active.is_empty() && !has_nvswitches(s) {
        Finding::pass(ID, "NVLink not in use in this VM (no NVSwitch passed through, none trained by the host)")
    } else {
        let summary = if active.is_empty() {
            format!("all {} NVLinks inactive", links.len())
        } else {
            format!("{} of {} NVLinks inactive (links {})", inactive.len(), links.len(), list(&inactive))
        };
        Finding::fail(ID, summary)
            .detail(if active.is_empty() && has_nvswitches(s) {
                "No link trained: when the fabric is not started (see fabric.state), this is why; otherwise the GPU's NVLink is down."
            } else {
                "GPU↔GPU bandwidth drops with every link down, and NCCL collectives slow to the weakest GPU."
            })
            .remedy("Start the fabric manager if fabric.state says not_started; else restart the VM to retrain the links, and if they stay down report the GPU and links to the platform (`nvidia-smi nvlink -s` shows the same).")
    };
    f.evidence("active", active).evidence("inactive", inactive)
}

fn split(links: &[NvLinkInfo]) -> (Vec<u32>, Vec<u32>) {
    let active = links.iter().filter(|l| l.active == Nv::Value(true)).map(|l| l.link).collect();
    let inactive = links.iter().filter(|l| l.active == Nv::Value(false)).map(|l| l.link).collect();
    (active, inactive)
}

/// A PCIe card of a bridged pair: its bridges wire `expected` of the links NVML lists, the rest
/// are inactive by design (facts::NVLINKS_PER_BRIDGED_H100).
fn bridged_links(s: &Snapshot, g: &NvmlGpu, expected: usize, bridge_required: bool) -> Finding {
    const ID: &str = LINKS_ACTIVE;
    let model = device_id(s, g).and_then(facts::sku).map_or("GPU", |k| k.name);
    // Another GPU of the same SKU in this VM: the bridge's other end, when the pair is here.
    let peers: Vec<String> = s
        .nvml()
        .map(|n| {
            n.devices
                .iter()
                .filter(|o| o.index != g.index && device_id(s, o) == device_id(s, g))
                .map(super::gpu_label)
                .collect()
        })
        .unwrap_or_default();
    let links: &[NvLinkInfo] = match &g.nvlinks {
        Nv::Value(l) => l,
        Nv::NotSupported => &[],
        other => return missing(ID, "NVLink state", other),
    };
    let (active, inactive) = split(links);
    let f = if active.is_empty() {
        if bridge_required && !peers.is_empty() {
            Finding::fail(ID, format!("no NVLink active to its bridged peer {} ({expected} expected)", peers.join(", ")))
                .detail(format!(
                    "An {model} pair is joined by NVLink bridges that wire {expected} links on each card; none came up, so the pair talks over PCIe (`nvidia-smi topo -m` shows SYS or PHB where NV{expected} belongs). Seen on whole VM starts, where a restart on the host brought the links back."
                ))
                .remedy("The platform's move: stop and start the VM so the host resets the GPUs and retrains the bridge; if the links stay absent, the host or the bridge is at fault: report the pair to the platform.")
        } else if bridge_required {
            Finding::pass(ID, "no NVLink active: its bridged peer is not in this VM")
        } else {
            Finding::pass(ID, format!("no NVLink bridge in use (an {model} runs without one)"))
        }
    } else if active.len() < expected {
        let down = expected - active.len();
        Finding::fail(ID, format!("{down} of the {expected} bridged NVLinks down ({}/{} active)", active.len(), links.len()))
            .detail(format!(
                "An {model} bridge wires {expected} of the {} links NVML lists; {} are inactive by design. Inactive now: links {}. GPU↔GPU bandwidth drops with every link down.",
                links.len(),
                links.len().saturating_sub(expected),
                list(&inactive)
            ))
            .remedy("Restart the VM to retrain the links; if they stay down, report the GPU and links to the platform: a bridge or card to inspect (`nvidia-smi nvlink -s` shows the same).")
    } else {
        Finding::pass(
            ID,
            format!("{}/{} NVLinks active, the {expected} an {model} bridge wires", active.len(), links.len()),
        )
    };
    f.evidence("active", active)
        .evidence("inactive", inactive)
        .evidence("expected_active", expected)
        .evidence("bridge_peers", peers)
}

pub(super) fn nvlink_errors(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "nvlink.errors";
    let links = match &g.nvlinks {
        Nv::Value(l) => l,
        Nv::NotSupported => return Finding::pass(ID, "no NVLink on this GPU"),
        other => return missing(ID, "NVLink error counters", other),
    };
    // DCGM's NVLink health watch treats any CRC, replay or recovery error as a warning.
    let mut bad = Vec::new();
    for l in links {
        let counters = [
            ("replay", &l.replay_errors),
            ("recovery", &l.recovery_errors),
            ("crc_flit", &l.crc_flit_errors),
            ("crc_data", &l.crc_data_errors),
        ];
        let nonzero: Vec<String> =
            counters.iter().filter_map(|(n, v)| v.value().filter(|c| **c > 0).map(|c| format!("{n} {c}"))).collect();
        if !nonzero.is_empty() {
            bad.push(format!("link {}: {}", l.link, nonzero.join(", ")));
        }
    }
    if bad.is_empty() {
        Finding::pass(ID, "no NVLink errors")
    } else {
        Finding::warn(ID, format!("NVLink errors on {} link(s)", bad.len()))
            .detail(bad.join("; "))
            .remedy("Watch whether the counters grow (`nvidia-smi nvlink -e`); growing recovery or replay errors mean a marginal link: report the GPU and link to the platform.")
            .evidence("links", bad)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::checks::Severity;
    use crate::snapshot::*;

    #[test]
    fn inactive_links_are_listed() {
        let mut s = healthy();
        if let Nv::Value(l) = &mut gpu_mut(&mut s, 1).nvlinks {
            l[4].active = Nv::Value(false);
            l[11].active = Nv::Value(false);
        }
        let f = findings(&s);
        let x = find(&f, "nvlink.links-active").into_iter().find(|f| f.severity == Severity::Fail).unwrap();
        assert_eq!(x.summary, "2 of 18 NVLinks inactive (links 4, 11)");
        assert_eq!(x.gpu.as_deref(), Some("0000:0a:00.0"));
    }

    /// An H100 PCIe without a bridge fitted lists its links all inactive: no alarm, since the
    /// bridge is an option on that card (facts::nvlink_use).
    #[test]
    fn an_h100_pcie_without_a_bridge_is_no_alarm() {
        let mut s = healthy();
        let g = gpu_mut(&mut s, 0);
        g.pci_device_id = Nv::Value(0x233110de);
        if let Nv::Value(l) = &mut g.nvlinks {
            l.iter_mut().for_each(|l| l.active = Nv::Value(false));
        }
        let all = findings(&s);
        let f =
            find(&all, "nvlink.links-active").into_iter().find(|f| f.gpu.as_deref() == Some("0000:09:00.0")).unwrap();
        assert_eq!(f.severity, Severity::Pass, "{f:?}");
        assert_eq!(f.summary, "no NVLink bridge in use (an H100 PCIe runs without one)");
    }

    #[test]
    fn nvlink_error_counters_warn_per_link() {
        let mut s = healthy();
        if let Nv::Value(l) = &mut gpu_mut(&mut s, 0).nvlinks {
            l[3].crc_flit_errors = Nv::Value(12);
        }
        let f = one(&s, "nvlink.errors");
        assert_eq!(f.severity, Severity::Warn);
        assert_eq!(f.detail, "link 3: crc_flit 12");
    }
}
