//! What to do about a finding and whose move it is (issue 39): the fields a platform routes on.
//!
//! Rules of this room:
//! 1. Every warn and fail finding gets an `action` from a closed vocabulary and an `owner`:
//!    `tenant` (the guest's software — driver, CUDA, fabric manager, configuration — and the VM
//!    spec) or `platform` (the node, the GPU hardware, the host's IOMMU/ACS and PCI set-up, the
//!    NVLink fabric, the device allocation). A pass or an unknown gets `none`/`none`.
//! 2. The rule for each check id is data (`RULES`), and docs/checks.md's table says the same;
//!    a test holds the two equal and every finding of every example guest to them.
//! 3. `gpu.xid` follows NVIDIA's Xid catalog: the governing code's immediate resolution
//!    ("Resolution Bucket") maps to an action in `for_resolution`, written down beside the
//!    catalog's names; NVML's recovery action, when it governs, in `for_recovery_action`.
//! 5. One cause, one owner: a finding whose evidence names its cause (`caused_by`, another
//!    check id — the fabric manager that is not running, for the fabric's state and the
//!    NVLinks it has not trained: `fabric::one_cause`) routes as that check does, so the
//!    verdict does not page one owner for what the other must fix first.
//! 6. Pure: no I/O. What came back across reboots (the fault history) escalates an action in the
//!    service, not here.

use super::{Finding, Severity};

// The closed vocabulary is shared with the platform's poller, which validates a guest's claim
// against it (crates/phq-wire).
pub use phq_wire::{Action, Owner};

/// One check id's rule: the action on a warning, on a failure, and whose move it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub id: &'static str,
    pub warn: Action,
    pub fail: Action,
    pub owner: Owner,
}

const fn rule(id: &'static str, warn: Action, fail: Action, owner: Owner) -> Rule {
    Rule { id, warn, fail, owner }
}

use Action::{
    ContactSupport, FixGuestSoftware, FixVmSpec, InspectHardware, RebootHost, RebootVm, ResetGpu, RestartApp, RestartVm,
};
use Owner::{Platform, Tenant};

/// The rule of every check id (docs/checks.md, "What to do and whose move it is", says why for
/// each). `gpu.xid` and `fabric.sxid` are decided by what the finding carries (see `route`);
/// their rows here are what applies when it carries nothing more specific.
pub const RULES: &[Rule] = &[
    rule("host.os-supported", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("host.virtualization", FixVmSpec, FixVmSpec, Tenant),
    rule("host.kernel-headers", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("host.secure-boot", FixGuestSoftware, FixGuestSoftware, Tenant),
    // A task stuck in the driver: our choice is that the guest reboots itself first (a stuck
    // task cannot be killed and blocks a GPU reset); the remedy names the platform's restart
    // when that reboot hangs.
    rule("host.hung-tasks", RebootVm, RebootVm, Tenant),
    rule("pci.gpu-present", RestartVm, RestartVm, Platform),
    rule("pci.gpu-count", RestartVm, RestartVm, Platform),
    rule("pci.gpu-driver-bound", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("pci.bar1-assigned", FixVmSpec, FixVmSpec, Tenant),
    rule("pci.nvswitch-present", FixVmSpec, FixVmSpec, Tenant),
    rule("pci.link", InspectHardware, InspectHardware, Platform),
    rule("driver.nouveau-disabled", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("driver.module-loaded", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("driver.open-kernel-module", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("driver.version-consistent", RebootVm, RebootVm, Tenant),
    rule("driver.branch-supported", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("driver.kernel-taint", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("driver.next-kernel", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("driver.device-nodes", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("driver.persistence", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("nvml.init", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("nvml.responsive", RestartVm, RestartVm, Platform),
    rule("cuda.driver-api", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("cuda.init", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("cuda.toolkit", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("cuda.toolkit-driver-compatible", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("fabric.manager-running", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("fabric.manager-version", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("fabric.state", RestartVm, RestartVm, Platform),
    rule("fabric.sxid", Action::None, RestartVm, Platform),
    rule("nvlink.links-active", InspectHardware, InspectHardware, Platform),
    rule("nvlink.errors", InspectHardware, InspectHardware, Platform),
    rule("gpu.xid", ContactSupport, ContactSupport, Platform),
    rule("gpu.ecc-mode", ResetGpu, ResetGpu, Tenant),
    rule("gpu.ecc-uncorrectable", ResetGpu, ResetGpu, Platform),
    rule("gpu.sram-ecc", InspectHardware, InspectHardware, Platform),
    rule("gpu.row-remap", ResetGpu, InspectHardware, Platform),
    rule("gpu.throttle", Action::None, InspectHardware, Platform),
    rule("gpu.throttle-time", InspectHardware, InspectHardware, Platform),
    rule("gpu.temperature", InspectHardware, InspectHardware, Platform),
    rule("gpu.power-limit", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("gpu.pcie-link", InspectHardware, InspectHardware, Platform),
    rule("gpu.pcie-replay", InspectHardware, InspectHardware, Platform),
    rule("gpu.mig-pending", ResetGpu, ResetGpu, Tenant),
    rule("gpu.inforom", InspectHardware, InspectHardware, Platform),
    rule("gpu.sku-known", ContactSupport, ContactSupport, Platform),
    rule("gpu.firmware-consistent", InspectHardware, InspectHardware, Platform),
    rule("probe.h2d-bandwidth", InspectHardware, InspectHardware, Platform),
    rule("probe.d2h-bandwidth", InspectHardware, InspectHardware, Platform),
    rule("probe.bidir-bandwidth", InspectHardware, InspectHardware, Platform),
    rule("probe.d2d-bandwidth", InspectHardware, InspectHardware, Platform),
    rule("probe.sm-copy-bandwidth", InspectHardware, InspectHardware, Platform),
    rule("probe.p2p-bandwidth", InspectHardware, InspectHardware, Platform),
    rule("probe.nvlink-scope", InspectHardware, InspectHardware, Platform),
    rule("probe.allreduce", InspectHardware, InspectHardware, Platform),
    rule("probe.nccl-start", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("probe.memory-integrity", InspectHardware, InspectHardware, Platform),
    rule("probe.gemm", InspectHardware, InspectHardware, Platform),
    rule("probe.gemm-tensor", InspectHardware, InspectHardware, Platform),
    rule("probe.gemm-tensor-fp16", InspectHardware, InspectHardware, Platform),
    rule("probe.gemm-sustained", InspectHardware, InspectHardware, Platform),
    rule("probe.gemm-fp64", InspectHardware, InspectHardware, Platform),
    rule("probe.power", InspectHardware, InspectHardware, Platform),
    rule("probe.power-limit", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("probe.cublas", FixGuestSoftware, FixGuestSoftware, Tenant),
    rule("probe.latency", InspectHardware, InspectHardware, Platform),
    rule("probe.baseline", InspectHardware, InspectHardware, Platform),
    rule("probe.responsive", RestartVm, RestartVm, Platform),
    rule("agent.platform-reachable", ContactSupport, ContactSupport, Platform),
    rule("agent.endpoint-auth", FixGuestSoftware, FixGuestSoftware, Tenant),
];

/// The evidence key a finding carries, with the value `history`, when the fault history (not a
/// reading) decided its action (`history` rule 3); the verdict's basis then says `history`.
pub const DECIDED_BY: &str = "decided_by";

/// Whether a routed finding is already the platform's hardware: the platform's move, and an
/// action on the device or the node (a reset, a restart from the platform, a host reboot, an
/// inspection). Only such a finding may be escalated to `inspect_hardware` by recurring
/// (`history` rule 3); a tenant's finding, or the platform's call to support, never is.
pub fn hardware_class(action: Action, owner: Owner) -> bool {
    owner == Owner::Platform && matches!(action, ResetGpu | RestartVm | RebootHost | InspectHardware)
}

/// The rule for `id`; an id no rule names (a new check before its row) goes to support.
pub fn rule_for(id: &str) -> Rule {
    RULES.iter().copied().find(|r| r.id == id).unwrap_or(Rule {
        id: "",
        warn: ContactSupport,
        fail: ContactSupport,
        owner: Platform,
    })
}

/// NVIDIA's Xid catalog's immediate resolutions ("Resolution Bucket (Immediate Action)",
/// docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html) in a passthrough VM, where a
/// guest reboot keeps the same QEMU process and the host is the platform's:
///
/// | bucket | action | owner | why |
/// |---|---|---|---|
/// | `RESTART_APP` | restart_app | tenant | the catalog's own action; the application is the tenant's |
/// | `RESET_GPU` | reset_gpu | tenant | the catalog's own action; the guest can reset a GPU it holds |
/// | `RESTART_VM` | restart_vm | platform | a restart from the platform resets the passed-through devices in a new QEMU process; a guest reboot may not |
/// | `RESTART_BM` | reboot_host | platform | "bare metal" is the host here |
/// | `CHECK_MECHANICALS` | inspect_hardware | platform | seating, cooling and power are the node's |
/// | `UPDATE_SWFW` | fix_guest_software | tenant | the driver is the guest's (firmware updates the platform schedules) |
/// | `CHECK_UVM` | fix_guest_software | tenant | nvidia_uvm is the guest's module |
/// | `WORKFLOW_XID_45` | restart_app | tenant | a preempted or killed channel: the application's |
/// | `WORKFLOW_XID_48` | reset_gpu | platform | a double-bit error: reset to remap, and the hardware's to watch |
/// | `WORKFLOW_NVLINK_ERR`, `WORKFLOW_NVLINK5_ERR` | restart_vm | platform | the NVLink fabric is the platform's; a restart resets GPUs and switches together |
/// | `XID_154` | reset_gpu | tenant | follows NVML's recovery action when it governs (`for_recovery_action`) |
/// | `CONTACT_SUPPORT`, none, not in the catalog | contact_support | platform | the catalog names no action a tenant can take |
/// | `IGNORE` | none | none | the catalog says to ignore it |
pub fn for_resolution(bucket: &str) -> (Action, Owner) {
    match bucket {
        "RESTART_APP" | "WORKFLOW_XID_45" => (RestartApp, Tenant),
        "RESET_GPU" | "XID_154" => (ResetGpu, Tenant),
        "WORKFLOW_XID_48" => (ResetGpu, Platform),
        "RESTART_VM" | "WORKFLOW_NVLINK_ERR" | "WORKFLOW_NVLINK5_ERR" => (RestartVm, Platform),
        "RESTART_BM" => (RebootHost, Platform),
        "CHECK_MECHANICALS" => (InspectHardware, Platform),
        "UPDATE_SWFW" | "CHECK_UVM" => (FixGuestSoftware, Tenant),
        "IGNORE" => (Action::None, Owner::None),
        _ => (ContactSupport, Platform),
    }
}

/// NVML's `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION` values (nvml.h: `NVML_GPU_RECOVERY_ACTION_NONE`
/// 0, `_GPU_RESET` 1, `_NODE_REBOOT` 2, `_DRAIN_P2P` 3, `_DRAIN_AND_RESET` 4): a node reboot
/// is, for a passthrough GPU, a restart of its VM from the platform.
pub fn for_recovery_action(value: u64) -> (Action, Owner) {
    match value {
        0 => (Action::None, Owner::None),
        1 | 4 => (ResetGpu, Tenant),
        2 => (RestartVm, Platform),
        3 => (RestartApp, Tenant),
        _ => (ContactSupport, Platform),
    }
}

/// The action and owner of one finding.
pub fn route(f: &Finding) -> (Action, Owner) {
    let r = rule_for(&f.id);
    let by_severity = |sev| match sev {
        Severity::Warn => (r.warn, r.owner),
        Severity::Fail => (r.fail, r.owner),
        Severity::Pass | Severity::Unknown => (Action::None, Owner::None),
    };
    if !matches!(f.severity, Severity::Warn | Severity::Fail) {
        return (Action::None, Owner::None);
    }
    if f.id == "gpu.xid" {
        if let Some(routed) = xid_route(f) {
            return routed;
        }
    }
    // No GPU and no expected count: the guest cannot tell the tenant's spec from the platform's
    // allocation (`pci::gpu_present`), so the platform's support looks.
    if f.id == "pci.gpu-present" && f.evidence.get("expected_gpus").is_some_and(serde_json::Value::is_null) {
        return (ContactSupport, Platform);
    }
    if let Some(cause) = f.evidence.get(super::fabric::CAUSED_BY).and_then(serde_json::Value::as_str) {
        // Rule 5; a cause that is no check id routes as an unknown id does, to support.
        let c = rule_for(cause);
        return (if f.severity == Severity::Warn { c.warn } else { c.fail }, c.owner);
    }
    by_severity(f.severity)
}

/// gpu.xid by what governs it: an Xid code (its catalog resolution in the evidence) or NVML's
/// recovery action.
fn xid_route(f: &Finding) -> Option<(Action, Owner)> {
    let governs = f.evidence.get("governs")?.as_str()?;
    if let Some(code) = governs.strip_prefix("Xid ") {
        let xids = f.evidence.get("xids")?.as_array()?;
        let entry = xids.iter().find(|x| x["code"] == code)?;
        return Some(for_resolution(entry["resolution"].as_str().unwrap_or("")));
    }
    let value = f.evidence.get("recovery_action")?;
    // `Nv<u32>` serialises as {"value": n} when NVML read it.
    let n = value.get("value").and_then(serde_json::Value::as_u64).or_else(|| value.as_u64())?;
    Some(for_recovery_action(n))
}

/// Sets `action` and `owner` on every finding.
pub fn apply(findings: &mut [Finding]) {
    for f in findings {
        let (a, o) = route(f);
        f.action = a;
        f.owner = o;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_catalog_id_has_one_rule_and_words_round_trip() {
        for id in super::super::CATALOG {
            assert_eq!(RULES.iter().filter(|r| r.id == *id).count(), 1, "{id}");
        }
        assert_eq!(RULES.len(), super::super::CATALOG.len());
        for a in Action::ALL {
            assert_eq!(Action::from_word(a.word()), Some(a));
        }
        assert!(Action::InspectHardware > Action::RestartVm && Action::RestartVm > Action::ResetGpu);
    }

    /// docs/checks.md says what RULES says, row for row.
    #[test]
    fn the_documented_table_is_the_rules() {
        let doc = include_str!("../../docs/checks.md");
        let rows = documented_rules(doc);
        assert_eq!(rows.len(), RULES.len(), "{rows:?}");
        for r in RULES {
            let d = rows
                .iter()
                .find(|d| d.0 == r.id)
                .unwrap_or_else(|| panic!("{} is not in docs/checks.md's table", r.id));
            assert_eq!(
                (d.1.as_str(), d.2.as_str(), d.3.as_str()),
                (r.warn.word(), r.fail.word(), r.owner.word()),
                "{}",
                r.id
            );
        }
    }

    /// The rows of docs/checks.md's routing table: (id, on warn, on fail, owner).
    pub fn documented_rules(doc: &str) -> Vec<(String, String, String, String)> {
        let section = doc.split("## What to do and whose move it is").nth(1).unwrap_or("");
        section
            .lines()
            .take_while(|l| !l.starts_with("## "))
            .filter_map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                let id = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
                let word = |i: usize| cells.get(i).map(|c| c.trim_matches('`').to_string());
                Some((id.to_string(), word(2)?, word(3)?, word(4)?))
            })
            .collect()
    }

    #[test]
    fn xid_follows_the_catalog_and_recovery_action() {
        let f = Finding::fail("gpu.xid", "x")
            .evidence("governs", "Xid 79")
            .evidence("xids", serde_json::json!([{"code": "79", "resolution": "RESTART_VM"}]));
        assert_eq!(route(&f), (RestartVm, Platform));
        let f = Finding::warn("gpu.xid", "x")
            .evidence("governs", "Xid 13")
            .evidence("xids", serde_json::json!([{"code": "13", "resolution": "RESTART_APP"}]));
        assert_eq!(route(&f), (RestartApp, Tenant));
        let f = Finding::fail("gpu.xid", "x")
            .evidence("governs", "NVML's recovery action")
            .evidence("recovery_action", serde_json::json!({"value": 2}));
        assert_eq!(route(&f), (RestartVm, Platform));
        assert_eq!(route(&Finding::pass("gpu.xid", "x")), (Action::None, Owner::None));
        assert_eq!(route(&Finding::fail("pci.bar1-assigned", "x")), (FixVmSpec, Tenant));
        assert_eq!(route(&Finding::warn("gpu.row-remap", "x")), (ResetGpu, Platform));
        assert_eq!(route(&Finding::fail("gpu.row-remap", "x")), (InspectHardware, Platform));
    }
}
