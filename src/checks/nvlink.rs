//! NVLink per GPU, from NVML: nvlink.links-active and nvlink.errors. Whether the fabric that
//! trains the links runs is `fabric`'s.

use super::{has_nvswitches, missing, Finding};
use crate::snapshot::{Nv, NvmlGpu, Snapshot};

pub(super) fn links_active(s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "nvlink.links-active";
    let links = match &g.nvlinks {
        Nv::Value(l) => l,
        Nv::NotSupported => return Finding::pass(ID, "no NVLink on this GPU (NVML reports none)"),
        other => return missing(ID, "NVLink state", other),
    };
    let active: Vec<u32> = links.iter().filter(|l| l.active == Nv::Value(true)).map(|l| l.link).collect();
    let inactive: Vec<u32> = links.iter().filter(|l| l.active == Nv::Value(false)).map(|l| l.link).collect();
    let f = if links.is_empty() {
        Finding::pass(ID, "no NVLink on this GPU")
    } else if inactive.is_empty() {
        Finding::pass(ID, format!("{}/{} NVLinks active", active.len(), links.len()))
    } else if active.is_empty() && !has_nvswitches(s) {
        Finding::pass(ID, "NVLink not in use in this VM (no NVSwitch passed through, none trained by the host)")
    } else {
        let list = inactive.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(", ");
        let summary = if active.is_empty() {
            format!("all {} NVLinks inactive", links.len())
        } else {
            format!("{} of {} NVLinks inactive (links {list})", inactive.len(), links.len())
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
