//! Every byte wiretrain moves between a rank's device and the host goes through here: reads
//! are batched (one blocking device wait per call, however many tensors it reads), uploads
//! are one write per call, and both are counted on the calling thread (a rank steps on one
//! thread), so a step can report exactly what crossed PCIe ([`TransferCounts`]).
//!
//! Counted: what the trainer reads and writes (gradient buckets, parameters, the loss scalar,
//! the optimizer's host path, wiretrain's kernels' reads and writes). Not counted: what the
//! user's own code moves (its batches) and Burn's internal traffic.

use burn::tensor::{Device, Tensor, TensorData, TensorReadError, Transaction};

mod raw;
use serde::Serialize;
use std::cell::Cell;

/// Bytes moved between this thread's device and the host, and the blocking device waits
/// (a read that blocks until the device has computed and copied its result).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TransferCounts {
    /// Device to host.
    pub d2h_bytes: u64,
    /// Host to device.
    pub h2d_bytes: u64,
    /// Blocking reads (one per call, however many tensors it reads).
    pub device_waits: u64,
}

impl std::ops::Sub for TransferCounts {
    type Output = Self;
    fn sub(self, o: Self) -> Self {
        Self {
            d2h_bytes: self.d2h_bytes.saturating_sub(o.d2h_bytes),
            h2d_bytes: self.h2d_bytes.saturating_sub(o.h2d_bytes),
            device_waits: self.device_waits.saturating_sub(o.device_waits),
        }
    }
}

thread_local! {
    static COUNTS: Cell<TransferCounts> = const { Cell::new(TransferCounts {
        d2h_bytes: 0,
        h2d_bytes: 0,
        device_waits: 0,
    }) };
}

/// What this thread has moved so far (subtract two readings for a span).
pub fn counts() -> TransferCounts {
    COUNTS.with(Cell::get)
}

fn add(f: impl FnOnce(&mut TransferCounts)) {
    COUNTS.with(|c| {
        let mut v = c.get();
        f(&mut v);
        c.set(v);
    });
}

/// Records a blocking read of `bytes` made outside this module (wiretrain's kernels).
pub(crate) fn note_read(bytes: usize) {
    add(|c| {
        c.d2h_bytes += bytes as u64;
        c.device_waits += 1;
    });
}

/// Records a write of `bytes` made outside this module (wiretrain's kernels).
pub(crate) fn note_write(bytes: usize) {
    add(|c| c.h2d_bytes += bytes as u64);
}

/// Reads `t` as f32 with one blocking wait (an f16 tensor moves 2 bytes an element and is
/// widened on the host).
pub fn read_f32<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>, TensorReadError> {
    if let Some(v) = read_staged(&t) {
        note_read(4 * v.len());
        return Ok(v);
    }
    let data = t.try_into_data()?;
    note_read(data.as_bytes().len());
    Ok(data.try_into_vec_as::<f32>()?)
}

/// Reads every tensor of `ts` in one submit and one blocking wait, as f32, in order.
pub fn read_many(ts: Vec<Tensor<1>>) -> Result<Vec<Vec<f32>>, TensorReadError> {
    match ts.len() {
        0 => return Ok(Vec::new()),
        1 => return Ok(vec![read_f32(ts.into_iter().next().expect("one"))?]),
        _ => {}
    }
    let tx = ts
        .into_iter()
        .fold(Transaction::default(), |tx, t| tx.register(t));
    let datas = tx.try_execute()?;
    note_read(datas.iter().map(|d| d.as_bytes().len()).sum());
    datas
        .into_iter()
        .map(|d| Ok(d.try_into_vec_as::<f32>()?))
        .collect()
}

/// Reads one scalar (a loss) with one blocking wait.
pub fn read_scalar(t: Tensor<1>) -> Result<f32, TensorReadError> {
    Ok(read_f32(t)?.first().copied().unwrap_or(f32::NAN))
}

/// Uploads `vals` to `device` as a 1-D f32 tensor: one write.
pub fn upload(vals: Vec<f32>, device: &Device) -> Tensor<1> {
    let n = vals.len();
    note_write(4 * n);
    if let Some(t) = upload_staged(&vals, device) {
        return t;
    }
    Tensor::<1>::from_data(TensorData::new(vals, [n]), device)
}

/// Whether reads and uploads on a wgpu device go through wiretrain's staging ring (the
/// default) rather than Burn's own staging: `WIRETRAIN_BURN_STAGING=1` takes Burn's, for a
/// comparison or a workaround.
fn ring_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("WIRETRAIN_BURN_STAGING").is_none_or(|v| v != "1"))
}

/// Reads an f32 tensor of a wgpu device straight from its storage through the staging ring
/// of wiretrain's kernels on that device (chunks in flight, no allocation per call); `None`
/// where that path does not apply (another backend or dtype, no kernels), and Burn's is
/// taken.
fn read_staged<const D: usize>(t: &Tensor<D>) -> Option<Vec<f32>> {
    let n = t.shape().num_elements();
    if n == 0 || !ring_enabled() {
        return None;
    }
    let kernels = crate::device::kernels_for(&t.device())?;
    let flat = raw::raw_buffer(&t.clone().reshape([n]))?;
    let mut out = vec![0.0f32; (flat.size / 4) as usize];
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
    match kernels.read_raw_into(&flat.buffer, flat.offset, bytes) {
        Ok(()) => Some(out),
        Err(e) => {
            tracing::warn!("reading through the staging ring: {e}; taking Burn's path");
            None
        }
    }
}

/// Uploads into a new tensor's storage through the staging ring (see [`read_staged`]).
fn upload_staged(vals: &[f32], device: &Device) -> Option<Tensor<1>> {
    if vals.is_empty() || !ring_enabled() {
        return None;
    }
    let kernels = crate::device::kernels_for(device)?;
    let (t, raw) = raw::empty_f32(device, vals.len())?;
    if let Err(e) = kernels.write_raw(&raw.buffer, raw.offset, bytemuck::cast_slice(vals)) {
        tracing::warn!("uploading through the staging ring: {e}; taking Burn's path");
        return None;
    }
    drop(raw);
    Some(if device.is_autodiff() {
        t.autodiff()
    } else {
        t
    })
}

/// Bytes in use on `device` by its allocator now (tensors alive, padding excluded), where
/// the backend reports it (cubecl's devices: wgpu, CUDA); `None` elsewhere (Burn's CPU
/// backend).
pub fn device_memory(device: &Device) -> Option<u64> {
    device.memory_pool_usage().map(|u| u.bytes_in_use)
}

/// Device memory of one rank over a span: the last reading and the highest one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DeviceMemory {
    /// Bytes in use at the last reading.
    pub in_use: Option<u64>,
    /// The highest reading.
    pub peak: Option<u64>,
}

impl DeviceMemory {
    /// Takes a reading of `device`.
    pub fn sample(&mut self, device: &Device) {
        if let Some(b) = device_memory(device) {
            self.in_use = Some(b);
            self.peak = Some(self.peak.map_or(b, |p| p.max(b)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_uploads_are_counted_per_call() {
        let device = Device::flex();
        let before = counts();
        let a = upload(vec![1.0, 2.0, 3.0], &device);
        let b = upload(vec![4.0], &device);
        let got = read_many(vec![a.clone(), b]).unwrap();
        assert_eq!(got, vec![vec![1.0, 2.0, 3.0], vec![4.0]]);
        assert_eq!(read_scalar(a.slice(1..2)).unwrap(), 2.0);
        let d = counts() - before;
        assert_eq!(
            d,
            TransferCounts {
                d2h_bytes: 4 * 4 + 4,
                h2d_bytes: 4 * 4,
                device_waits: 2,
            }
        );
        assert!(read_many(Vec::new()).unwrap().is_empty());
        assert_eq!(counts() - before, d, "an empty read waits for nothing");
    }
}
