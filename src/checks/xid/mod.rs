//! Xids and SXids, judged the way NVIDIA says to act on them: gpu.xid (`judge.rs`, each GPU's
//! Xids from the kernel log and NVML's event set, read together with what NVML says of the GPU),
//! fabric.sxid (`sxid.rs`, each NVSwitch's SXids from the kernel log), and the catalog both
//! follow, as data (`catalog.rs`, generated from data/ by scripts/gen-xid-catalog) with the
//! types that data is made of. `words.rs` says what each resolution asks of a tenant.

pub mod catalog;

mod judge;
pub mod sxid;
mod words;

pub use judge::{action_in_154, events_for, meaning, process_of, resolution, summarize, XidSummary};

use super::Finding;
use crate::snapshot::Snapshot;

/// gpu.xid for every GPU (and for addresses with Xids but no GPU on the bus now), and
/// fabric.sxid for every NVSwitch.
pub fn run(s: &Snapshot, out: &mut Vec<Finding>) {
    judge::run(s, out);
    sxid::run(s, out);
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
