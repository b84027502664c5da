//! Which probed pairs are NVLink pairs, and the VM's NVLink scope: what NVML says links the
//! probed GPUs, and what the peer copies found.

use super::results::{NvlinkScope, Outcome, PairFigures, PeerLink, ProbeReport};
use super::targets::Target;

/// Peer copies faster than this cannot have gone over PCIe Gen5 x16 (≈ 64 GB/s raw).
const NVLINK_SCOPE_GBPS: f64 = 100.0;

/// Whether NVML reported link states for any target (else scope falls back to throughput).
fn nvml_knows_links(targets: &[Target]) -> bool {
    targets.iter().any(|t| t.nvlinks_known)
}

/// The VM's NVLink scope over the GPUs `report` probed: their links, what the links lead to,
/// their fabric, and every measured pair's rate each way.
pub(super) fn nvlink_scope(report: &ProbeReport, targets: &[Target]) -> NvlinkScope {
    let probed: Vec<&Target> = report.gpus.iter().filter_map(|g| targets.iter().find(|t| t.pci == g.pci)).collect();
    let gpu_pcis: Vec<&str> = probed.iter().map(|t| t.pci.as_str()).collect();
    let remotes: Vec<&String> = probed.iter().flat_map(|t| &t.nvlink_remotes).collect();
    let to_gpu = remotes.iter().filter(|r| gpu_pcis.contains(&r.as_str())).count();
    let through = match (remotes.len(), to_gpu) {
        (0, _) => "unknown",
        (_, 0) => "NVSwitch",
        (n, k) if n == k => "direct",
        _ => "mixed",
    };
    NvlinkScope {
        gpus: probed.len(),
        pairs: report.peers.len(),
        nvlink_pairs: report.peers.iter().filter(|l| l.scope == "nvlink").count(),
        links: probed.iter().map(|t| (t.pci.clone(), t.nvlinks_active)).collect(),
        through: through.into(),
        fabric: probed.iter().filter_map(|t| Some((t.pci.clone(), t.fabric.clone()?))).collect(),
        pairs_gbps: {
            let rate = |src: usize, dst: usize| {
                report.peers.iter().find(|l| l.src == src && l.dst == dst).and_then(|l| match &l.gbps {
                    Some(Outcome::Ok(s)) => Some(s.median),
                    _ => None,
                })
            };
            report
                .peers
                .iter()
                .filter(|l| l.src < l.dst)
                .map(|l| PairFigures {
                    a: l.src,
                    b: l.dst,
                    scope: l.scope.clone(),
                    a_to_b: rate(l.src, l.dst),
                    b_to_a: rate(l.dst, l.src),
                })
                .collect()
        },
    }
}

/// Each measured pair's scope: NVML's own answer for the pair first; without it, active NVLinks
/// on both GPUs; without NVML link states at all, the copy rate. A degraded NVLink stays an
/// `nvlink` pair (judged against the NVLink floor), never mistaken for a PCIe pair.
pub(super) fn mark(peers: &mut [PeerLink], targets: &[Target]) {
    for l in peers.iter_mut().filter(|l| l.peer_access) {
        let target = |o: usize| targets.iter().find(|t| t.ordinal == o);
        // NVML's own answer for the pair first; without it, active NVLinks on both GPUs.
        let nvml_says = target(l.src)
            .and_then(|a| Some((a.nvlink_peers.as_ref()?, target(l.dst)?)))
            .map(|(peers, b)| peers.contains(&b.pci));
        let links_on = |o: usize| target(o).is_some_and(|t| t.nvlinks_active > 0);
        let nvlink = nvml_says.unwrap_or_else(|| links_on(l.src) && links_on(l.dst));
        l.scope = match (&l.gbps, nvlink) {
            (_, true) => "nvlink",
            // No NVML link state (an old driver, a fixture): judge by throughput.
            (Some(Outcome::Ok(s)), false) if s.median >= NVLINK_SCOPE_GBPS && !nvml_knows_links(targets) => "nvlink",
            _ => "pcie",
        }
        .into();
    }
}
