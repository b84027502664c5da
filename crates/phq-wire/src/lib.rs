//! The words the agent and the platform share (issue 49): a verdict's `action`, `owner` and
//! `basis` — the closed vocabulary docs/checks.md defines — and `view`, the part of a
//! `phq.status/v1` report the platform's poller reads.
//!
//! One crate for both sides so that the poller validates a guest's claim against the very
//! enums the agent writes: a word that is not in them is not a label value on the platform.
//! Nothing here does I/O; serde is the only dependency.

use serde::{Deserialize, Serialize};

pub mod view;

/// The report's schema, as `schema` carries it (schema/phq.status.v1.json).
pub const SCHEMA: &str = "phq.status/v1";

/// Every value a verdict's `basis` can hold: where its evidence came from (docs/checks.md).
pub const BASES: [&str; 5] = ["guest", "history", "kernel_log", "nvml", "probe"];

/// What to do, most urgent last (the order `Ord` gives, and the verdict picks the greatest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Nothing to do now.
    #[default]
    None,
    /// Talk to the platform's support (a state the agent cannot name an action for).
    ContactSupport,
    /// Restart the application that hit the error; the GPU is fine.
    RestartApp,
    /// Fix the guest's software: driver, CUDA, fabric manager, the agent's configuration.
    FixGuestSoftware,
    /// Change the VM's spec (its MMIO window, the devices it asks for).
    FixVmSpec,
    /// Reboot the VM from inside the guest.
    RebootVm,
    /// Reset the GPU (`nvidia-smi -r`, with no process on it).
    ResetGpu,
    /// Stop and start the VM from the platform: a new QEMU process, its devices reset, possibly
    /// on another node.
    RestartVm,
    /// Reboot the host the VM runs on.
    RebootHost,
    /// The GPU or its baseboard needs a person: drain, diagnose, RMA by serial.
    InspectHardware,
}

impl Action {
    pub fn word(self) -> &'static str {
        match self {
            Action::None => "none",
            Action::ContactSupport => "contact_support",
            Action::RestartApp => "restart_app",
            Action::FixGuestSoftware => "fix_guest_software",
            Action::FixVmSpec => "fix_vm_spec",
            Action::RebootVm => "reboot_vm",
            Action::ResetGpu => "reset_gpu",
            Action::RestartVm => "restart_vm",
            Action::RebootHost => "reboot_host",
            Action::InspectHardware => "inspect_hardware",
        }
    }

    pub const ALL: [Action; 10] = [
        Action::None,
        Action::ContactSupport,
        Action::RestartApp,
        Action::FixGuestSoftware,
        Action::FixVmSpec,
        Action::RebootVm,
        Action::ResetGpu,
        Action::RestartVm,
        Action::RebootHost,
        Action::InspectHardware,
    ];

    pub fn from_word(w: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.word() == w)
    }
}

/// Whose move it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Owner {
    #[default]
    None,
    Tenant,
    Platform,
}

impl Owner {
    pub fn word(self) -> &'static str {
        match self {
            Owner::None => "none",
            Owner::Tenant => "tenant",
            Owner::Platform => "platform",
        }
    }

    pub fn from_word(w: &str) -> Option<Owner> {
        [Owner::None, Owner::Tenant, Owner::Platform].into_iter().find(|o| o.word() == w)
    }
}
