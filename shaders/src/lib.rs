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

#![warn(missing_docs, unreachable_pub)]

mod kernels;
mod staging;

pub use kernels::{AdamWHyper, AdamWShard, Counters, GpuBuf, Half, Kernels};

/// What can go wrong running a kernel.
#[derive(Debug, thiserror::Error)]
pub enum ShaderError {
    /// [`Kernels::standalone`] found no Vulkan, Metal or DX12 adapter.
    #[error("no wgpu adapter: {0}")]
    NoAdapter(String),
    /// [`Kernels::standalone`]'s adapter refused to create a device.
    #[error("requesting a wgpu device: {0}")]
    Device(#[from] wgpu::RequestDeviceError),
    /// Waiting for submitted work on the device failed.
    #[error("waiting for the device: {0}")]
    Poll(#[from] wgpu::PollError),
    /// A staging or read-back buffer could not be mapped.
    #[error("reading a buffer back: {0}")]
    Map(#[from] wgpu::BufferAsyncError),
    /// The mapped range of a staging or read-back buffer could not be accessed; holds wgpu's
    /// error.
    #[error("mapping a read-back buffer: {0}")]
    MapRange(String),
    /// A buffer holds fewer words than the call reads or writes.
    #[error("{what}: buffer holds {have} words, {need} needed")]
    TooSmall {
        /// Which buffer of the call (e.g. "cast source", "write").
        what: &'static str,
        /// Words the buffer holds.
        have: usize,
        /// Words the call needs.
        need: usize,
    },
    /// Host data's length (or a raw copy's byte offset) is not a multiple of 4 bytes; holds
    /// the data's length in bytes.
    #[error("{0} bytes is not a whole number of 4-byte words")]
    Unaligned(usize),
    /// [`Kernels::reduce`] was given its output buffer among its inputs.
    #[error("the reduce output is also one of its inputs")]
    Aliased,
    /// A buffer to create is larger than the device allows.
    #[error("{bytes} bytes exceed the device's largest buffer ({max} bytes)")]
    TooLarge {
        /// The buffer's size, in bytes.
        bytes: u64,
        /// The device's `max_buffer_size`, in bytes.
        max: u64,
    },
}
