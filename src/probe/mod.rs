//! probe: what a tenant will get from each GPU, measured through CUDA, judged against per-SKU
//! floors (`facts::probe_floors`).
//!
//! The rules of this room:
//! 1. `Backend` (`backend.rs`) does the measuring: `cuda_backend/` through the driver (its
//!    measurements in `copies.rs`, `memtest.rs`, `gemm.rs`, its kernels in `kernels.rs`), the
//!    simulated GPUs of `fake.rs` in the unit tests. Everything else here is pure.
//! 2. `run` (`run.rs`) decides what to measure, on which GPUs (`targets.rs`) and pairs, at what
//!    size (`levels.rs`); it never touches a GPU with compute processes unless forced, and lets
//!    go of a GPU a sticky error poisoned in one place (`Runner::retire`).
//! 3. Only `collect` touches NVML: the readings beside each measurement come through the
//!    caller's `collect::nvml::Session` (`observed.rs`, handed it by `here.rs`), never a session
//!    of the probe's own.
//! 4. The service never runs CUDA itself: its probes run in a child process under a deadline
//!    (`child.rs`), as does each NCCL all-reduce (`allreduce.rs`), both supervised alike
//!    (`supervise.rs`), one run at a time (`lock.rs`).
//! 5. `judge` turns a report (`results.rs`) into `probe.*` findings, against the SKU's floors and
//!    the GPU's own first passing run (`baseline.rs`). `report` renders the results, so this room
//!    imports `checks`, `collect`, `config`, `cuda` and below, never `report`, `serve` or `cli`.
//!
//! Method (nvbandwidth's): large buffers, many copies queued per sample and timed with CUDA
//! events, several samples, the median reported.

pub mod affinity;
pub mod allreduce;
pub mod backend;
pub mod baseline;
pub mod budget;
pub mod child;
pub mod cuda_backend;
#[cfg(test)]
mod fake;
pub mod here;
pub mod judge;
pub mod kernels;
pub mod levels;
pub mod lock;
mod observed;
pub mod results;
pub mod run;
mod scope;
mod supervise;
pub mod targets;
#[cfg(test)]
mod tests;

pub use backend::{Backend, Half};
pub use here::{plan_here, run_here, NotRun};
pub use judge::{judge, judge_here, unavailable, GEMM_TOLERANCE};
pub use levels::{params, LevelParams, Options};
pub use results::{
    GemmResult, GpuProbes, MemtestPass, MemtestResult, Mismatch, NvlinkScope, Outcome, PairFigures, PeerLink,
    ProbeError, ProbeReport, Skipped, Stat,
};
pub use run::run;
pub use targets::{choose, targets_of, Target};
