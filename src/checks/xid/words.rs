//! What each of the catalog's resolutions asks of a tenant inside a passthrough VM, in our words.
//! NVIDIA's catalog names a bucket per code ("Resolution Bucket", with the steps on its "Guidance
//! Class" sheet, docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html); the steps are
//! written for a data-center operator, so here they are said for someone who owns the VM and
//! not the host.

use super::catalog::XID_READ;

/// A GPU reset as a tenant can do it. `nvidia-smi -r` resets one GPU that no process holds (the
/// nvidia-smi manual page, quoted in the Fabric Manager User Guide, "GPU VM System Reset
/// Capabilities and Limitations"; `--query-compute-apps` lists the processes, same manual);
/// in a passthrough VM whether that works depends on the hypervisor, and a VM restart always
/// resets its GPUs (same guide, "Hopper and NVSwitch").
pub fn reset(gpu: &str) -> String {
    format!(
        "Stop the processes on the GPU (`nvidia-smi --query-compute-apps=pid,process_name --format=csv -i {gpu}` lists them) and reset it with `nvidia-smi -r -i {gpu}`; if the reset is refused in this VM or the GPU stays unusable, restart the VM, which resets every GPU passed through to it. If the Xid comes back after the reset, report the GPU to the platform with `phq-agent doctor --bundle`."
    )
}

/// The catalog's RESTART_APP: the application is done for, the GPU is not.
pub fn restart_app(who: &str) -> String {
    format!("Restart {who}. The GPU itself is fine unless this Xid repeats; if it does, on this GPU with other programs too, report the GPU to the platform.")
}

pub const RESTART_VM: &str = "Restart the VM that owns the GPU; NVIDIA says neither a GPU reset nor a restart of the host is needed for this one.";

pub const RESTART_BM: &str = "Restart the VM. NVIDIA's action is a restart of the machine itself: if the GPU is still missing or lost after the VM restart, the host must be restarted, which only the platform can do — report it with `phq-agent doctor --bundle`.";

pub const CHECK_MECHANICALS: &str = "The board's seating or its power connections must be checked on the host: nothing inside the VM fixes this. Report the GPU to the platform so the host is drained and the board checked.";

pub const UPDATE_SWFW: &str = "Update the driver in the VM to a current release of its branch (`phq-agent install`), and ask the platform to bring the GPU's firmware and the host's software up to date.";

pub const CONTACT_SUPPORT: &str =
    "Report it to the platform with `phq-agent doctor --bundle`: NVIDIA's catalog sends this code to support.";

pub const FABRIC_MANAGER_RESTART: &str = "Restart the fabric manager: `sudo systemctl restart nvidia-fabricmanager` (NVIDIA's step for an Xid 45 that comes alone). If CUDA then fails with error 802, see fabric.manager-running.";

/// A code the catalog gives no action for yet (162–172 when it was read).
pub fn no_action_yet(code: &str) -> String {
    format!("NVIDIA's catalog (read {XID_READ}) gives no action for Xid {code} yet: report it to the platform with `phq-agent doctor --bundle`.")
}

/// A code that is not in the catalog at all.
pub fn not_in_catalog(code: &str) -> String {
    format!("Xid {code} is not in NVIDIA's Xid catalog as read on {XID_READ} (docs.nvidia.com/deploy/xid-errors); a newer edition may list it. Report it to the platform with `phq-agent doctor --bundle`.")
}

/// The catalog's "Resolution Bucket (Investigatory Action)": what to look into when the Xid
/// comes back after the immediate action.
pub fn investigatory(bucket: &str) -> String {
    match bucket {
        "" => "NVIDIA's catalog names no investigation for it.".into(),
        "CONTACT_SUPPORT" => "NVIDIA wants its support to see it: report it to the platform with a bundle.".into(),
        "CHECK_APP/CUDA" => "Usually the application passed bad data or used the API wrongly; the Xid line's pid points at it. If the application is known good, it is a driver bug to report.".into(),
        "WORKFLOW_XID_13" => "Repeats on this GPU across different SMs point at the hardware (run DCGM's diagnostics); a lone one, or one that follows the program across GPUs, is the program's (run it under compute-sanitizer).".into(),
        "WORKFLOW_XID_31" => "MMU faults that repeat on this GPU across runs point at the hardware (DCGM diagnostics); faults that follow the program across GPUs are its own bug (compute-sanitizer).".into(),
        "WORKFLOW_XID_48" => "Alone, NVIDIA asks for its field diagnostics; with Xid 63 or 64, follow the row-remapping result (gpu.row-remap). For an SRAM error, the SRAM error threshold decides whether the GPU is replaced.".into(),
        "INVESTIGATE_SW" => "A software problem, the application's or NVIDIA's: the Xid line's pid points at where it came from; if it is not the application, report a driver bug.".into(),
        "IGNORE" => "Nothing to investigate.".into(),
        "IGNORE (sympathetic)" => "Usually a side effect of another error: resolve that one first, and report it if it comes alone.".into(),
        "XID_137_FLOW" => "An illegal NVLink peer-to-peer access, usually the application's bug: run it under compute-sanitizer or cuda-gdb.".into(),
        "Solo: RESTART_FM Not Solo: IGNORE (follow other Xid)" => "Alone, the fabric manager is restarted; with other Xids, they decide.".into(),
        "UPDATE_SWFW" => "Bring the driver and firmware up to date.".into(),
        "INVESTIGATE_LINK_SI" => "The link's signal integrity: the platform must check the board's NVLink connections.".into(),
        "INVESTIGATE_SW_USER" => "Software or a person took the link down on purpose; find out who if nobody meant to.".into(),
        "SYMPATHETIC_REPORT_SOLO" => "Expected beside other errors; report it if it comes alone.".into(),
        "N/A Informational only regarding another Xid" => "It only summarises the recovery that another Xid needs: look at that one.".into(),
        "WORKFLOW_NVLINK5_ERR" => "The exact action comes from decoding the Xid's IntrInfo and error status against NVIDIA's NVLink5 decode table (its \"XID 144-150 Decode\" sheet).".into(),
        other => format!("NVIDIA's catalog names the investigation `{other}`."),
    }
}
