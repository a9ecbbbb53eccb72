//! wiretrain-shaders: wiretrain's own WGSL kernels, run on the same `wgpu::Device` and
//! `wgpu::Queue` as Burn (`Device::wgpu_options()...init_with_setup()` hands them out).
//!
//! * casts f32 <-> f16 / bf16, packed two per u32, bit-exact with the `half` crate
//!   (round-to-nearest-even, NaN and Inf kept) — [`Kernels::cast_to_half`],
//!   [`Kernels::cast_from_half`];
//! * the sum of N buffers with an optional scale (a mean), accumulated in f32 —
//!   [`Kernels::reduce`];
//! * fused AdamW on a flat shard (param, grad, m, v; bias correction; decoupled weight decay),
//!   one dispatch, in place — [`Kernels::adamw_step`];
//! * int8 block quantization (128 values per f32 scale, the rules of wiretrain-comm's codec)
//!   and its inverse — [`Kernels::quantize_int8`], [`Kernels::dequantize_int8`].
//!
//! Reads and writes go through persistent staging rings (`staging.rs`: a few chunks in
//! flight, no allocation per call; [`Kernels::read_into`] reads straight into the caller's
//! buffer). Pipelines are built once in [`Kernels::new`]. A buffer larger than one storage binding
//! (lavapipe: 128 MiB) is processed in chunks, each bound as a sub-range of the buffer.
//! Every kernel call counts itself ([`Kernels::counters`]) so callers can prove which path ran.
//!
//! Burn submits to the same queue, so work is ordered with Burn's: a kernel that reads a buffer
//! Burn writes needs Burn's pending work flushed first (wiretrain's trainer hands kernels host
//! data it uploaded itself, so nothing is shared).

mod kernels;
mod staging;

pub use kernels::{AdamWHyper, AdamWShard, Counters, GpuBuf, Half, Kernels};

/// What can go wrong running a kernel.
#[derive(Debug, thiserror::Error)]
pub enum ShaderError {
    #[error("no wgpu adapter: {0}")]
    NoAdapter(String),
    #[error("requesting a wgpu device: {0}")]
    Device(#[from] wgpu::RequestDeviceError),
    #[error("waiting for the device: {0}")]
    Poll(#[from] wgpu::PollError),
    #[error("reading a buffer back: {0}")]
    Map(#[from] wgpu::BufferAsyncError),
    #[error("mapping a read-back buffer: {0}")]
    MapRange(String),
    #[error("{what}: buffer holds {have} words, {need} needed")]
    TooSmall {
        what: &'static str,
        have: usize,
        need: usize,
    },
    #[error("{0} bytes is not a whole number of 4-byte words")]
    Unaligned(usize),
    #[error("the reduce output is also one of its inputs")]
    Aliased,
    #[error("{bytes} bytes exceed the device's largest buffer ({max} bytes)")]
    TooLarge { bytes: u64, max: u64 },
}
