//! phq-agent: one binary inside a KubeVirt VM with NVIDIA Hopper GPUs passed through.
//!
//! collect (I/O) → `Snapshot` → check (pure) → `Finding`s → report (table, JSON, bundle).
//! docs/architecture.md is the map: the pipeline, the service's tasks, the test seams.

pub mod checks;
pub mod cli;
pub mod collect;
pub mod config;
pub mod cuda;
pub mod durable;
pub mod facts;
pub mod history;
pub mod install;
pub mod probe;
pub mod report;
pub mod serve;
pub mod snapshot;
pub mod sysroot;
pub mod text;
