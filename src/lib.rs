//! phq-agent: one binary inside a KubeVirt VM with NVIDIA Hopper GPUs passed through.
//!
//! collect (I/O) → `Snapshot` → check (pure) → `Finding`s → report (table, JSON, bundle).
//! See DESIGN.md in the shared folder for the architecture and the contracts.

pub mod checks;
pub mod cli;
pub mod collect;
pub mod config;
pub mod durable;
pub mod facts;
pub mod install;
pub mod probe;
pub mod report;
pub mod serve;
pub mod snapshot;
pub mod sysroot;
