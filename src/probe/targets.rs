//! Which GPUs a run probes: what the probes need to know of each GPU CUDA lists (from the
//! snapshot), and the choice a run makes among them (`--gpu`, MIG, Prohibited, busy).

use super::levels::Options;
use super::results::Skipped;

/// What CUDA says of a GPU before any context is made on it.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub pci: String,
    /// `CU_DEVICE_ATTRIBUTE_COMPUTE_MODE`: 0 default, 2 prohibited, 3 exclusive-process.
    pub compute_mode: i32,
}

/// A GPU the probes may run on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// CUDA ordinal (PCI order: the probes set `CUDA_DEVICE_ORDER=PCI_BUS_ID`).
    pub ordinal: usize,
    pub pci: String,
    pub device_id: Option<u16>,
    /// Compute processes NVML lists on it (never the agent's own).
    pub busy_pids: Vec<u32>,
    /// Why no context may be made on it at all (MIG mode, compute mode Prohibited).
    pub unusable: Option<String>,
    /// Active NVLinks NVML reports on it.
    pub nvlinks_active: usize,
    /// Whether NVML reported link states at all.
    pub nvlinks_known: bool,
    /// The GPUs (PCI addresses) NVML says this one reaches over NVLink (`nvmlDeviceGetP2PStatus`,
    /// NVLink capability), when NVML answered.
    pub nvlink_peers: Option<Vec<String>>,
    /// NVML's serial number of the board (else its UUID): the key of its baseline.
    pub serial: Option<String>,
    /// The PCI address each active NVLink leads to (an NVSwitch, or a bridged GPU).
    pub nvlink_remotes: Vec<String>,
    /// NVML's fabric state and clique, when it reports one ("completed, clique 1").
    pub fabric: Option<String>,
}

/// The targets a run probes, each with its index as nvidia-smi numbers it, and the ones it
/// leaves alone with the reason: not asked for, MIG or Prohibited, or busy without `force`.
pub fn choose<'t>(targets: &'t [Target], opts: &Options<'_>) -> (Vec<(&'t Target, usize)>, Vec<Skipped>) {
    // `--gpu N` is nvidia-smi's GPU N: the Nth in PCI bus order (CUDA programming guide,
    // CUDA_DEVICE_ORDER=PCI_BUS_ID "orders devices by PCI bus ID in ascending order"), even
    // when the user's environment asked CUDA for another order.
    let mut by_pci: Vec<&str> = targets.iter().map(|t| t.pci.as_str()).collect();
    by_pci.sort_unstable();
    let (mut chosen, mut skipped) = (Vec::new(), Vec::new());
    for t in targets {
        let index = by_pci.iter().position(|p| *p == t.pci).unwrap_or(t.ordinal);
        if !opts.only.is_empty() && !opts.only.contains(&index) {
            continue;
        }
        if let Some(why) = &t.unusable {
            skipped.push(Skipped { pci: t.pci.clone(), reason: why.clone() });
        } else if !t.busy_pids.is_empty() && !opts.force {
            let pids: Vec<String> = t.busy_pids.iter().map(|p| p.to_string()).collect();
            skipped.push(Skipped { pci: t.pci.clone(), reason: format!("{} compute process(es) run on it (pid {}); a probe never takes GPU time from a job (--force to run anyway)", pids.len(), pids.join(", ")) });
        } else {
            chosen.push((t, index));
        }
    }
    (chosen, skipped)
}

/// What the probes need to know of each GPU CUDA lists, from the snapshot. `own_pid` (the
/// agent's) never makes a GPU busy.
pub fn targets_of(snapshot: &crate::snapshot::Snapshot, devices: &[DeviceInfo], own_pid: u32) -> Vec<Target> {
    devices
        .iter()
        .enumerate()
        .map(|(ordinal, d)| {
            let nv = snapshot.nvml_gpu(&d.pci);
            let links = nv.and_then(|g| g.nvlinks.value());
            let mig = nv.and_then(|g| g.mig_mode.value()).is_some_and(|m| m.current);
            let unusable = if mig {
                Some(
                    "MIG mode is on: the probes measure whole GPUs, and CUDA sees only MIG instances of it".to_string(),
                )
            } else if d.compute_mode == 2 {
                Some(
                    "its compute mode is Prohibited: no CUDA context can be made on it (nvidia-smi -c DEFAULT)"
                        .to_string(),
                )
            } else {
                None
            };
            Target {
                ordinal,
                pci: d.pci.clone(),
                device_id: snapshot.gpus().iter().find(|g| g.address == d.pci).and_then(|g| g.device),
                busy_pids: nv
                    .and_then(|g| g.processes.value())
                    .map(|ps| ps.iter().map(|p| p.pid).filter(|p| *p != own_pid).collect())
                    .unwrap_or_default(),
                unusable,
                nvlinks_active: links
                    .map(|l| l.iter().filter(|l| l.active.value() == Some(&true)).count())
                    .unwrap_or(0),
                nvlinks_known: links.is_some(),
                nvlink_peers: nv.and_then(|g| g.nvlink_p2p.value()).cloned(),
                serial: nv.and_then(|g| g.serial.value().filter(|s| !s.trim().is_empty()).or(g.uuid.value())).cloned(),
                nvlink_remotes: links
                    .map(|l| {
                        l.iter()
                            .filter(|l| l.active.value() == Some(&true))
                            .filter_map(|l| l.remote_pci.value().cloned())
                            .collect()
                    })
                    .unwrap_or_default(),
                fabric: nv.and_then(|g| g.fabric.value()).map(|f| {
                    let state = format!("{:?}", f.state).to_lowercase();
                    format!("{state}, clique {}", f.clique_id)
                }),
            }
        })
        .collect()
}
