//! Persistent staging between the host and a device's buffers: a ring of `MAP_READ` buffers
//! for reads and a ring of `MAP_WRITE` buffers for writes, `slots` chunks of `chunk` bytes
//! each, created once and reused by every call (wgpu's `queue.write_buffer` allocates fresh
//! staging memory per call, and a read that makes its own `MAP_READ` buffer does too).
//!
//! A read copies chunk after chunk into the ring with up to `slots` copies and maps in flight:
//! while the host copies chunk i out of its mapped slot into the caller's slice (the buffer
//! the collective uses: no host copy in between), the device is copying chunks i+1 onwards.
//! A write fills a mapped slot on the host, unmaps it, submits its copy into the destination
//! and maps it again; it waits only when it comes round to a slot whose map is still pending,
//! so up to `slots` chunks are on their way at once, and work submitted later on the same
//! queue sees the data. A call that fails drops the ring (buffers in an unknown map state are
//! never reused); the next call makes a new one.

use crate::ShaderError;
use std::collections::VecDeque;
use std::sync::mpsc;

/// Bytes per staging chunk by default.
pub(crate) const DEFAULT_CHUNK_BYTES: u64 = 8 << 20;
/// Chunks in flight per direction by default.
pub(crate) const DEFAULT_SLOTS: usize = 3;

type Mapped = mpsc::Receiver<Result<(), wgpu::BufferAsyncError>>;

/// A write slot and, when its map is pending, the submission that must finish first.
struct WriteSlot {
    buf: wgpu::Buffer,
    pending: Option<(wgpu::SubmissionIndex, Mapped)>,
}

/// A chunk of a read in flight.
struct Flight {
    slot: usize,
    at: usize,
    len: usize,
    index: wgpu::SubmissionIndex,
    mapped: Mapped,
}

/// The two rings of one device.
pub(crate) struct Staging {
    chunk: u64,
    slots: usize,
    read: Vec<wgpu::Buffer>,
    write: Vec<WriteSlot>,
    /// Staging buffers created so far (both rings, across failures).
    pub(crate) created: u64,
    /// Reads and writes that went through the rings.
    pub(crate) reads: u64,
    pub(crate) writes: u64,
}

/// Starts a map of `slice` whose outcome arrives on the returned channel.
fn map(slice: wgpu::BufferSlice<'_>, mode: wgpu::MapMode) -> Mapped {
    let (tx, rx) = mpsc::channel();
    slice.map_async(mode, move |r| {
        let _ = tx.send(r);
    });
    rx
}

/// Waits for submission `index` (its map callbacks run), then for the map's outcome.
fn wait(
    device: &wgpu::Device,
    index: wgpu::SubmissionIndex,
    m: &Mapped,
) -> Result<(), ShaderError> {
    device.poll(wgpu::PollType::Wait {
        submission_index: Some(index),
        timeout: None,
    })?;
    m.recv().unwrap_or(Err(wgpu::BufferAsyncError))?;
    Ok(())
}

impl Staging {
    /// Rings of `slots` chunks of `chunk_bytes` (rounded up to a multiple of 256; at least
    /// one slot). Nothing is allocated until a call needs it.
    pub(crate) fn new(chunk_bytes: u64, slots: usize) -> Self {
        Self {
            chunk: chunk_bytes.max(1).next_multiple_of(256),
            slots: slots.max(1),
            read: Vec::new(),
            write: Vec::new(),
            created: 0,
            reads: 0,
            writes: 0,
        }
    }

    pub(crate) fn chunk_bytes(&self) -> u64 {
        self.chunk
    }

    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    fn read_slot(&mut self, device: &wgpu::Device, i: usize) -> &wgpu::Buffer {
        while self.read.len() <= i {
            self.created += 1;
            self.read
                .push(device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("wiretrain read staging"),
                    size: self.chunk,
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                }));
        }
        &self.read[i]
    }

    fn write_slot(&mut self, device: &wgpu::Device, i: usize) -> &mut WriteSlot {
        while self.write.len() <= i {
            self.created += 1;
            let buf = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("wiretrain write staging"),
                size: self.chunk,
                usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: true,
            });
            self.write.push(WriteSlot { buf, pending: None });
        }
        &mut self.write[i]
    }

    /// Copies `out.len()` bytes of `src` from byte `offset` into `out` (lengths and offset
    /// multiples of 4), waiting for all work submitted before.
    pub(crate) fn read_into(
        &mut self,
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        src: &wgpu::Buffer,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), ShaderError> {
        self.reads += 1;
        let res = self.read_chunks(device, queue, src, offset, out);
        if res.is_err() {
            self.read.clear();
        }
        res
    }

    fn read_chunks(
        &mut self,
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        src: &wgpu::Buffer,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), ShaderError> {
        let (chunk, slots) = (self.chunk as usize, self.slots);
        let chunks = out.len().div_ceil(chunk);
        let mut flight: VecDeque<Flight> = VecDeque::with_capacity(slots);
        let mut next = 0;
        while next < chunks || !flight.is_empty() {
            while next < chunks && flight.len() < slots {
                let (slot, at) = (next % slots, next * chunk);
                let len = chunk.min(out.len() - at);
                let buf = self.read_slot(device, slot);
                let mut enc = device.create_command_encoder(&Default::default());
                enc.copy_buffer_to_buffer(src, offset + at as u64, buf, 0, len as u64);
                let index = queue.submit([enc.finish()]);
                let mapped = map(buf.slice(..len as u64), wgpu::MapMode::Read);
                flight.push_back(Flight {
                    slot,
                    at,
                    len,
                    index,
                    mapped,
                });
                next += 1;
            }
            let f = flight.pop_front().expect("a chunk in flight");
            wait(device, f.index, &f.mapped)?;
            let buf = &self.read[f.slot];
            {
                let view = buf
                    .slice(..f.len as u64)
                    .get_mapped_range()
                    .map_err(|e| ShaderError::MapRange(e.to_string()))?;
                out[f.at..f.at + f.len].copy_from_slice(&view);
            }
            buf.unmap();
        }
        Ok(())
    }

    /// Copies `data` into `dst` from byte `offset` (lengths and offset multiples of 4). Work
    /// submitted to `queue` afterwards sees it; the call waits only for a slot to come free.
    pub(crate) fn write_from(
        &mut self,
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        dst: &wgpu::Buffer,
        offset: u64,
        data: &[u8],
    ) -> Result<(), ShaderError> {
        self.writes += 1;
        let res = self.write_chunks(device, queue, dst, offset, data);
        if res.is_err() {
            self.write.clear();
        }
        res
    }

    fn write_chunks(
        &mut self,
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        dst: &wgpu::Buffer,
        offset: u64,
        data: &[u8],
    ) -> Result<(), ShaderError> {
        let (chunk, slots) = (self.chunk as usize, self.slots);
        for (i, part) in data.chunks(chunk).enumerate() {
            let at = (i * chunk) as u64;
            // A slot whose map is still pending (from this call or an earlier one) is
            // waited for.
            let slot = self.write_slot(device, i % slots);
            if let Some((index, mapped)) = slot.pending.take() {
                wait(device, index, &mapped)?;
            }
            {
                let mut view = slot
                    .buf
                    .slice(..part.len() as u64)
                    .get_mapped_range_mut()
                    .map_err(|e| ShaderError::MapRange(e.to_string()))?;
                view.copy_from_slice(part);
            }
            slot.buf.unmap();
            let mut enc = device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&slot.buf, 0, dst, offset + at, part.len() as u64);
            let index = queue.submit([enc.finish()]);
            let mapped = map(slot.buf.slice(..), wgpu::MapMode::Write);
            slot.pending = Some((index, mapped));
        }
        Ok(())
    }
}
