//! Pipelines, buffers and chunked dispatch of the WGSL kernels.

use crate::ShaderError;
use crate::staging::{DEFAULT_CHUNK_BYTES, DEFAULT_SLOTS, Staging};
use std::num::NonZeroU64;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use wgpu::util::DeviceExt;

/// Elements per chunk are a multiple of this, so every sub-range offset (f32, packed 16-bit,
/// int8 codes, one scale per 128) stays aligned to the 256-byte storage offset alignment.
const CHUNK_QUANTUM: usize = 1 << 16;
/// The most workgroups in one dispatch dimension (WebGPU's guaranteed limit).
const MAX_GROUPS: u32 = 65_535;

/// A 16-bit float format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    /// IEEE half precision.
    F16,
    /// bfloat16 (the upper 16 bits of an f32).
    Bf16,
}

/// Hyper-parameters of one AdamW step (Burn's AdamW semantics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    /// Learning rate.
    pub lr: f64,
    /// Decay rate of the first moment estimate.
    pub beta1: f32,
    /// Decay rate of the second moment estimate.
    pub beta2: f32,
    /// Added to the denominator for numerical stability.
    pub eps: f32,
    /// Decoupled weight decay: each step scales the parameters by `1 - lr * weight_decay`.
    pub weight_decay: f32,
}

impl Default for AdamWHyper {
    /// PyTorch's `AdamW` defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// How many times each kernel ran (calls, not chunks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    /// Staging buffers created for reads and writes (a fixed ring, reused by every call).
    pub staging_buffers: u64,
    /// Reads through the staging rings (of any buffer, Burn's tensors' too).
    pub staging_reads: u64,
    /// Writes through the staging rings (of any buffer, Burn's tensors' too).
    pub staging_writes: u64,
    /// Calls of [`Kernels::cast_to_half`] and [`Kernels::cast_from_half`].
    pub cast: u64,
    /// Calls of [`Kernels::reduce`].
    pub reduce: u64,
    /// Calls of [`Kernels::adamw_step`].
    pub adamw: u64,
    /// Calls of [`Kernels::quantize_int8`].
    pub quantize: u64,
    /// Calls of [`Kernels::dequantize_int8`].
    pub dequantize: u64,
}

#[derive(Default)]
struct AtomicCounters {
    cast: AtomicU64,
    reduce: AtomicU64,
    adamw: AtomicU64,
    quantize: AtomicU64,
    dequantize: AtomicU64,
}

/// The device state of AdamW on one flat shard.
#[derive(Debug)]
pub struct AdamWShard {
    // Exactly `n` words each (the kernel writes whole vec4s: past `n` lies only padding).
    param: GpuBuf,
    m: GpuBuf,
    v: GpuBuf,
    n: usize,
    /// Steps taken.
    pub t: u32,
}

impl AdamWShard {
    /// The f32 master parameters.
    pub fn param(&self) -> &GpuBuf {
        &self.param
    }
    /// First moments.
    pub fn m(&self) -> &GpuBuf {
        &self.m
    }
    /// Second moments.
    pub fn v(&self) -> &GpuBuf {
        &self.v
    }
    /// Elements in the shard.
    pub fn len(&self) -> usize {
        self.n
    }
    /// Whether the shard has no element.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
}

/// A storage buffer of `words` 4-byte words (f32 values, or packed 16-bit / int8 codes).
#[derive(Debug)]
pub struct GpuBuf {
    buffer: wgpu::Buffer,
    words: usize,
}

impl GpuBuf {
    /// The buffer's size in 4-byte words, as requested (the allocation is rounded up to
    /// whole vec4s).
    pub fn words(&self) -> usize {
        self.words
    }
    /// The underlying wgpu buffer.
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }
}

/// The compiled kernels of one device.
pub struct Kernels {
    device: wgpu::Device,
    queue: wgpu::Queue,
    to_f16: wgpu::ComputePipeline,
    to_bf16: wgpu::ComputePipeline,
    from_f16: wgpu::ComputePipeline,
    from_bf16: wgpu::ComputePipeline,
    reduce: wgpu::ComputePipeline,
    adamw: wgpu::ComputePipeline,
    quantize: wgpu::ComputePipeline,
    dequantize: wgpu::ComputePipeline,
    chunk: usize,
    counters: AtomicCounters,
    staging: Mutex<Staging>,
    description: String,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels")
            .field("device", &self.description)
            .field("chunk_elems", &self.chunk)
            .finish_non_exhaustive()
    }
}

fn pipeline(
    device: &wgpu::Device,
    module: &wgpu::ShaderModule,
    entry: &str,
) -> wgpu::ComputePipeline {
    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(entry),
        layout: None,
        module,
        entry_point: Some(entry),
        compilation_options: Default::default(),
        cache: None,
    })
}

/// Compiles one of our WGSL files without the runtime bounds checks wgpu would add to every
/// storage access (as cubecl does for Burn's kernels: on software adapters those checks cost
/// about as much as the arithmetic).
fn module(device: &wgpu::Device, name: &str, src: &str) -> wgpu::ShaderModule {
    let desc = wgpu::ShaderModuleDescriptor {
        label: Some(name),
        source: wgpu::ShaderSource::Wgsl(src.into()),
    };
    // SAFETY: every access in our kernels is in bounds by construction: each index is
    // guarded by the element count `n` of its dispatch, every binding covers exactly the
    // words those indices reach (vec4 kernels: whole vec4s, which `zeros` allocates), `n` is
    // checked against the buffers' sizes before any dispatch (`need`), and the only loop
    // (quant.wgsl's tree reduction) has a constant trip count.
    unsafe { device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) }
}

/// Packs uniform fields (4-byte words) padded to 16 bytes.
fn uniform(words: &[u32]) -> Vec<u8> {
    let mut v: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    v.resize(v.len().div_ceil(16) * 16, 0);
    v
}

/// A (x, y) workgroup grid covering `groups` groups.
fn grid(groups: usize) -> (u32, u32) {
    let g = groups.max(1) as u64;
    let x = g.min(MAX_GROUPS as u64);
    (x as u32, g.div_ceil(x) as u32)
}

impl Kernels {
    /// Builds every pipeline on `device` (the one Burn uses, or any other).
    pub fn new(device: wgpu::Device, queue: wgpu::Queue, description: String) -> Self {
        let cast = module(&device, "cast", include_str!("wgsl/cast.wgsl"));
        let reduce = module(&device, "reduce", include_str!("wgsl/reduce.wgsl"));
        let adamw = module(&device, "adamw", include_str!("wgsl/adamw.wgsl"));
        let quant = module(&device, "quant", include_str!("wgsl/quant.wgsl"));
        let dequant = module(&device, "dequant", include_str!("wgsl/dequant.wgsl"));
        let limit = device.limits().max_storage_buffer_binding_size as usize;
        let chunk = ((limit / 4) / CHUNK_QUANTUM).max(1) * CHUNK_QUANTUM;
        Self {
            to_f16: pipeline(&device, &cast, "to_f16"),
            to_bf16: pipeline(&device, &cast, "to_bf16"),
            from_f16: pipeline(&device, &cast, "from_f16"),
            from_bf16: pipeline(&device, &cast, "from_bf16"),
            reduce: pipeline(&device, &reduce, "main"),
            adamw: pipeline(&device, &adamw, "main"),
            quantize: pipeline(&device, &quant, "quantize"),
            dequantize: pipeline(&device, &dequant, "dequantize"),
            device,
            queue,
            chunk,
            counters: AtomicCounters::default(),
            staging: Mutex::new(Staging::new(DEFAULT_CHUNK_BYTES, DEFAULT_SLOTS)),
            description,
        }
    }

    /// Kernels on a device of their own: the first hardware adapter, else a software one
    /// (lavapipe), Vulkan/Metal/DX12 only (never GL). For tests and benchmarks.
    pub fn standalone() -> Result<Self, ShaderError> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let mut adapters = futures_lite::future::block_on(instance.enumerate_adapters(
            wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12,
        ));
        // Hardware first.
        adapters.sort_by_key(|a| a.get_info().device_type == wgpu::DeviceType::Cpu);
        let adapter = adapters
            .into_iter()
            .next()
            .ok_or_else(|| ShaderError::NoAdapter("no Vulkan, Metal or DX12 adapter".into()))?;
        let info = adapter.get_info();
        let (device, queue) =
            futures_lite::future::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
                label: Some("wiretrain-shaders"),
                required_limits: adapter.limits(),
                ..Default::default()
            }))?;
        let desc = format!("{:?} {} ({:?})", info.backend, info.name, info.device_type);
        Ok(Self::new(device, queue, desc))
    }

    /// Processes buffers in chunks of at most `elems` elements (rounded up to a multiple of
    /// 65536): tests use it to exercise the multi-chunk path on small buffers.
    pub fn with_chunk_elems(mut self, elems: usize) -> Self {
        self.chunk = elems.div_ceil(CHUNK_QUANTUM).max(1) * CHUNK_QUANTUM;
        self
    }

    /// Reads and writes through rings of `slots` staging chunks of `chunk_bytes` (rounded up
    /// to a multiple of 256) instead of the default 3 x 8 MiB: tests use small ones to
    /// exercise buffers larger than the ring.
    pub fn with_staging(self, chunk_bytes: u64, slots: usize) -> Self {
        *self.staging.lock().unwrap_or_else(|p| p.into_inner()) = Staging::new(chunk_bytes, slots);
        self
    }

    /// The staging ring's chunk size in bytes and its slots per direction.
    pub fn staging_shape(&self) -> (u64, usize) {
        let s = self.staging();
        (s.chunk_bytes(), s.slots())
    }

    fn staging(&self) -> std::sync::MutexGuard<'_, Staging> {
        // A panic while a ring was held leaves nothing half-done that matters: a failed call
        // drops its ring before returning.
        self.staging.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Elements per dispatch chunk: buffers larger than this are processed in chunks, each
    /// bound as a sub-range.
    pub fn chunk_elems(&self) -> usize {
        self.chunk
    }

    /// The description of the device given to [`Self::new`] (backend, adapter name and type
    /// for [`Self::standalone`]).
    pub fn description(&self) -> &str {
        &self.description
    }

    /// The wgpu device the kernels run on.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// How many times each kernel has run so far, and the staging rings' counts.
    pub fn counters(&self) -> Counters {
        let c = &self.counters;
        let (staging_buffers, staging_reads, staging_writes) = {
            let s = self.staging();
            (s.created, s.reads, s.writes)
        };
        Counters {
            staging_buffers,
            staging_reads,
            staging_writes,
            cast: c.cast.load(Ordering::Relaxed),
            reduce: c.reduce.load(Ordering::Relaxed),
            adamw: c.adamw.load(Ordering::Relaxed),
            quantize: c.quantize.load(Ordering::Relaxed),
            dequantize: c.dequantize.load(Ordering::Relaxed),
        }
    }

    fn check_size(&self, bytes: u64) -> Result<(), ShaderError> {
        let max = self.device.limits().max_buffer_size;
        if bytes > max {
            return Err(ShaderError::TooLarge { bytes, max });
        }
        Ok(())
    }

    /// A zeroed buffer of `words` words.
    pub fn zeros(&self, words: usize) -> Result<GpuBuf, ShaderError> {
        // Whole vec4s, so vectorized kernels may bind the last partial vec4.
        let bytes = (4 * words.max(1)).next_multiple_of(16) as u64;
        self.check_size(bytes)?;
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("wiretrain"),
            size: bytes,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Ok(GpuBuf { buffer, words })
    }

    /// A buffer holding `data` (f32 values or u32 words).
    pub fn upload<T: bytemuck::Pod>(&self, data: &[T]) -> Result<GpuBuf, ShaderError> {
        let words = std::mem::size_of_val(data) / 4;
        let buf = self.zeros(words)?;
        self.write(&buf, data)?;
        Ok(buf)
    }

    /// Overwrites the start of `buf` with `data`, through the staging ring: work submitted
    /// afterwards sees it.
    pub fn write<T: bytemuck::Pod>(&self, buf: &GpuBuf, data: &[T]) -> Result<(), ShaderError> {
        let bytes = fits("write", buf, data)?;
        if !bytes.is_empty() {
            self.staging()
                .write_from(&self.device, &self.queue, &buf.buffer, 0, bytes)?;
        }
        Ok(())
    }

    /// Reads the first `words` words of `buf` back (waits for all submitted work), through
    /// the staging ring.
    pub fn read<T: bytemuck::Pod>(
        &self,
        buf: &GpuBuf,
        words: usize,
    ) -> Result<Vec<T>, ShaderError> {
        need("read", buf, words)?;
        let mut out = vec![T::zeroed(); 4 * words / std::mem::size_of::<T>()];
        self.read_into(buf, &mut out)?;
        Ok(out)
    }

    /// Reads the start of `buf` into `out` (waits for all submitted work), through the
    /// staging ring: straight into the caller's buffer, with no copy in between.
    pub fn read_into<T: bytemuck::Pod>(
        &self,
        buf: &GpuBuf,
        out: &mut [T],
    ) -> Result<(), ShaderError> {
        let bytes = std::mem::size_of_val(out);
        if !bytes.is_multiple_of(4) {
            return Err(ShaderError::Unaligned(bytes));
        }
        need("read", buf, bytes / 4)?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        if !bytes.is_empty() {
            self.staging()
                .read_into(&self.device, &self.queue, &buf.buffer, 0, bytes)?;
        }
        Ok(())
    }

    /// Copies `out.len()` bytes (a multiple of 4) of any buffer of this device, from byte
    /// `offset` (a multiple of 4), into `out` through the staging ring: a Burn tensor's
    /// storage, say. The caller keeps the range alive and flushed.
    pub fn read_raw_into(
        &self,
        src: &wgpu::Buffer,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), ShaderError> {
        if !out.len().is_multiple_of(4) || !offset.is_multiple_of(4) {
            return Err(ShaderError::Unaligned(out.len()));
        }
        if !out.is_empty() {
            self.staging()
                .read_into(&self.device, &self.queue, src, offset, out)?;
        }
        Ok(())
    }

    /// Copies `data` (a multiple of 4 bytes) into any buffer of this device from byte
    /// `offset` (a multiple of 4) through the staging ring; work submitted afterwards sees it.
    pub fn write_raw(
        &self,
        dst: &wgpu::Buffer,
        offset: u64,
        data: &[u8],
    ) -> Result<(), ShaderError> {
        if !data.len().is_multiple_of(4) || !offset.is_multiple_of(4) {
            return Err(ShaderError::Unaligned(data.len()));
        }
        if !data.is_empty() {
            self.staging()
                .write_from(&self.device, &self.queue, dst, offset, data)?;
        }
        Ok(())
    }

    /// [`Kernels::write`] through `queue.write_buffer`, which makes fresh staging memory on
    /// every call: the baseline the transfer benchmark compares the ring with.
    pub fn write_unstaged<T: bytemuck::Pod>(
        &self,
        buf: &GpuBuf,
        data: &[T],
    ) -> Result<(), ShaderError> {
        let bytes = fits("write", buf, data)?;
        if !bytes.is_empty() {
            self.queue.write_buffer(&buf.buffer, 0, bytes);
        }
        Ok(())
    }

    /// [`Kernels::read`] through a `MAP_READ` buffer made for the call: the baseline the
    /// transfer benchmark compares the ring with.
    pub fn read_unstaged<T: bytemuck::Pod>(
        &self,
        buf: &GpuBuf,
        words: usize,
    ) -> Result<Vec<T>, ShaderError> {
        need("read", buf, words)?;
        let bytes = (4 * words) as u64;
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("wiretrain readback"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&buf.buffer, 0, &staging, 0, bytes);
        self.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device.poll(wgpu::PollType::wait_indefinitely())?;
        rx.recv().unwrap_or(Err(wgpu::BufferAsyncError))?;
        let out = {
            let view = staging
                .slice(..)
                .get_mapped_range()
                .map_err(|e| ShaderError::MapRange(e.to_string()))?;
            bytemuck::pod_collect_to_vec::<u8, T>(&view[..])
        };
        staging.unmap();
        Ok(out)
    }

    /// Waits until every submitted kernel has finished.
    pub fn sync(&self) -> Result<(), ShaderError> {
        self.device.poll(wgpu::PollType::wait_indefinitely())?;
        Ok(())
    }

    /// Encodes one dispatch per chunk of `n` elements and submits them together. `bind`
    /// gives a chunk's bindings as (binding, buffer, byte offset, byte size) and its uniform
    /// words; `groups` gives its workgroup count.
    fn dispatch<'b>(
        &self,
        pipe: &wgpu::ComputePipeline,
        n: usize,
        bind: impl Fn(usize, usize) -> (Vec<(u32, &'b wgpu::Buffer, u64, u64)>, Vec<u32>),
        groups: impl Fn(usize) -> usize,
    ) {
        if n == 0 {
            return;
        }
        let layout = pipe.get_bind_group_layout(0);
        let mut enc = self.device.create_command_encoder(&Default::default());
        let mut start = 0;
        while start < n {
            let end = (start + self.chunk).min(n);
            let (bufs, words) = bind(start, end);
            let uni = self
                .device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("wiretrain params"),
                    contents: &uniform(&words),
                    usage: wgpu::BufferUsages::UNIFORM,
                });
            let mut entries: Vec<wgpu::BindGroupEntry> = bufs
                .iter()
                .map(|&(binding, buffer, offset, size)| wgpu::BindGroupEntry {
                    binding,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer,
                        offset,
                        size: NonZeroU64::new(size.max(4)),
                    }),
                })
                .collect();
            entries.push(wgpu::BindGroupEntry {
                binding: bufs.len() as u32,
                resource: uni.as_entire_binding(),
            });
            let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &layout,
                entries: &entries,
            });
            let (x, y) = grid(groups(end - start));
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                pass.set_pipeline(pipe);
                pass.set_bind_group(0, &bg, &[]);
                pass.dispatch_workgroups(x, y, 1);
            }
            start = end;
        }
        self.queue.submit([enc.finish()]);
    }
}

/// Bytes of `elems` f32 values rounded up to whole vec4s (buffers are allocated that way).
fn vec4_bytes(elems: usize) -> u64 {
    (4 * elems).next_multiple_of(16) as u64
}

/// `data` as bytes, when it fits in `buf`.
fn fits<'a, T: bytemuck::Pod>(
    what: &'static str,
    buf: &GpuBuf,
    data: &'a [T],
) -> Result<&'a [u8], ShaderError> {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    if !bytes.len().is_multiple_of(4) {
        return Err(ShaderError::Unaligned(bytes.len()));
    }
    if bytes.len() > 4 * buf.words {
        return Err(ShaderError::TooSmall {
            what,
            have: buf.words,
            need: bytes.len().div_ceil(4),
        });
    }
    Ok(bytes)
}

fn need(what: &'static str, b: &GpuBuf, words: usize) -> Result<(), ShaderError> {
    if b.words < words {
        return Err(ShaderError::TooSmall {
            what,
            have: b.words,
            need: words,
        });
    }
    Ok(())
}

mod ops;
