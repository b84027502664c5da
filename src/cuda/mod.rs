//! cuda: the CUDA libraries the agent loads at run time with `dlopen` and never links — the
//! driver API and cuBLAS (`driver.rs`), NCCL (`nccl.rs`) — bound call by call as safe values
//! (contexts, streams, events, buffers) that keep the driver's rules.
//!
//! The rules of this room:
//! 1. Bindings only: what to measure and what a figure means are `probe`'s, what a failure at
//!    start-up means is `collect::cuda`'s; nothing here imports another room of the crate.
//! 2. A missing library or symbol is an error naming the file and the symbol; nothing panics.
//! 3. Every `unsafe` call states on the line above what makes it sound.

#[macro_use]
pub mod driver;
pub mod nccl;

pub use driver::{
    attr, blas, code, driver, is_sticky, named_library, use_library, Api, Arg, Blas, BlasHandle, CUdevice, CUdeviceptr,
    CUresult, Ctx, CudaError, Device, DeviceBuffer, Driver, Event, Function, LoadError, Loaded, Module, PinnedBuffer,
    Result, Stream,
};
