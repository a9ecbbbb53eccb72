//! The storage of a Burn tensor on a wgpu device as a raw `wgpu::Buffer` range, without
//! forking Burn, so that reads and uploads go through wiretrain's persistent staging ring
//! (`wiretrain_shaders`) instead of Burn's per-call staging.
//!
//! The path: strip autodiff (`inner`), take the fusion primitive of the cube backend, resolve
//! it to its `CubeTensor` (this runs the tensor's queued fused operations), and ask the
//! compute client for the resource behind its handle: a pooled `wgpu::Buffer` with the
//! tensor's byte offset. The returned guard holds that resource, which stops cubecl from
//! relocating the allocation, and a clone of the tensor, which stops Burn from overwriting
//! it in place, for as long as it lives: hold it across the submit that copies, then drop it.
//! Asking for the resource submits the work pending on the tensor's stream, and the copy is
//! submitted after it on the same queue, so it sees the tensor's values; Burn's later work
//! sees what a copy wrote. Anything else (another backend, another dtype, a strided view)
//! gives `None`, and the caller takes Burn's own path.

use burn::backend::Cube;
use burn::backend::wgpu::{AutoCompiler, CubeBackend, CubeTensor};
use burn::cubecl::wgpu::WgpuServer;
use burn::tensor::{DType, Device, Tensor};

/// A Burn tensor's storage, valid while this lives (see the module doc).
pub(crate) struct RawBuf {
    pub buffer: wgpu::Buffer,
    /// Bytes into `buffer` (a pool page shared with other tensors).
    pub offset: u64,
    /// Bytes of the tensor (elements x 4).
    pub size: u64,
    _pin: Box<dyn std::any::Any>,
    _tensor: Tensor<1>,
}

/// The storage of `t` (f32, contiguous, on a wgpu device), or `None`.
pub(crate) fn raw_buffer(t: &Tensor<1>) -> Option<RawBuf> {
    if t.dtype() != DType::F32 {
        return None;
    }
    let n = t.dims()[0] as u64;
    let held = t.clone().inner();
    let fusion = held.clone().try_into_primitive::<Cube>().ok()?;
    let client = fusion.client.clone();
    let cube: CubeTensor = client.resolve_tensor_float::<CubeBackend>(fusion);
    if cube.meta.is_tiled() || (n > 1 && cube.meta.strides()[0] != 1) {
        return None;
    }
    let res = cube
        .client
        .get_resource::<WgpuServer<AutoCompiler>>(cube.handle.clone())
        .ok()?;
    let r = res.resource();
    let size = n * 4;
    if r.size < size {
        return None;
    }
    Some(RawBuf {
        buffer: r.buffer.clone(),
        offset: r.offset,
        size,
        _pin: Box::new(res),
        _tensor: held,
    })
}

/// A new f32 tensor of `n` elements on `device` and its storage, to be filled by a copy.
pub(crate) fn empty_f32(device: &Device, n: usize) -> Option<(Tensor<1>, RawBuf)> {
    let t = Tensor::<1>::empty([n], (&device.clone().inner(), DType::F32));
    let raw = raw_buffer(&t)?;
    Some((t, raw))
}
