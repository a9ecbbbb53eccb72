//! The flat view of a model's float parameters that every strategy works on.
//!
//! Parameters are visited in module order and named by their field path ("l1.weight"); every
//! rank builds the same [`FlatLayout`] and the trainer checks at start-up that all ranks agree
//! (a mismatch names the first differing parameter). Buckets cut the flat vector into
//! contiguous ranges (25 MiB by default); shards cut each bucket at element offsets, so shards
//! are equal within one element per bucket.

use crate::transfer;
pub use buffers::BufferSync;
use buffers::is_buffer;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor, TensorData};
use std::ops::Range;
use wiretrain_comm::WireDtype;

/// The device dtype a gradient bucket is narrowed to before it is read for a reduction on
/// `wire`: f16 or bf16 where `device` computes in it; `None` for f32 and int8 wires.
pub fn narrow_dtype(wire: WireDtype, device: &Device) -> Option<DType> {
    let d = match wire {
        WireDtype::F16 => DType::F16,
        WireDtype::Bf16 => DType::BF16,
        WireDtype::F32 | WireDtype::Int8 => return None,
    };
    device.supports_dtype(d).then_some(d)
}

pub(crate) mod buffers;

/// One parameter's place in the flat vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatEntry {
    /// The module path of the parameter, its field names joined with dots.
    pub path: String,
    /// Burn's id of the parameter.
    pub id: ParamId,
    /// Its tensor shape.
    pub shape: Vec<usize>,
    /// Where it starts in the flat vector, in elements.
    pub offset: usize,
    /// Its number of elements.
    pub len: usize,
}

/// All float parameters of a module, in a deterministic order.
#[derive(Debug, Clone)]
pub struct FlatLayout {
    entries: Vec<FlatEntry>,
    total: usize,
}

struct Collect {
    path: Vec<String>,
    entries: Vec<FlatEntry>,
    total: usize,
    /// Collect the non-trained state ([`buffers`]) instead of the parameters.
    buffers: bool,
}

impl ModuleVisitor for Collect {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if is_buffer(param) != self.buffers {
            return;
        }
        let shape: Vec<usize> = param.lazy_shape().to_vec();
        let len = shape.iter().product();
        self.entries.push(FlatEntry {
            path: self.path.join("."),
            id: param.id,
            shape,
            offset: self.total,
            len,
        });
        self.total += len;
    }
}

impl FlatLayout {
    /// The layout of `module`'s trained float parameters, in module visiting order.
    pub fn of<M: Module>(module: &M) -> Self {
        Self::collect(module, false)
    }

    /// The layout of `module`'s non-trained state (BatchNorm's running statistics, frozen
    /// parameters: [`buffers`]), in the order the trainer gathers it.
    pub fn buffers_of<M: Module>(module: &M) -> Self {
        Self::collect(module, true)
    }

    fn collect<M: Module>(module: &M, buffers: bool) -> Self {
        let mut c = Collect {
            path: Vec::new(),
            entries: Vec::new(),
            total: 0,
            buffers,
        };
        module.visit(&mut c);
        Self {
            entries: c.entries,
            total: c.total,
        }
    }

    /// Every parameter's entry, in flat-vector order.
    pub fn entries(&self) -> &[FlatEntry] {
        &self.entries
    }

    /// Number of float elements.
    pub fn total(&self) -> usize {
        self.total
    }

    /// A fingerprint per parameter (path and shape), for the start-up agreement check.
    pub fn signature(&self) -> Vec<u32> {
        self.entries
            .iter()
            .map(|e| {
                let mut h: u32 = 0x811c_9dc5;
                for b in e
                    .path
                    .bytes()
                    .chain(e.shape.iter().flat_map(|d| (*d as u64).to_le_bytes()))
                {
                    h ^= u32::from(b);
                    h = h.wrapping_mul(0x0100_0193);
                }
                h
            })
            .collect()
    }

    /// Contiguous bucket ranges of at most `bucket_elems` elements (at least one element each;
    /// the empty layout has no buckets).
    pub fn buckets(&self, bucket_elems: usize) -> Vec<Range<usize>> {
        let b = bucket_elems.max(1);
        (0..self.total.div_ceil(b))
            .map(|i| i * b..((i + 1) * b).min(self.total))
            .collect()
    }

    /// The flat copy of the module's current parameter values: one device read.
    pub fn flatten_params<M: Module>(&self, module: &M) -> Vec<f32> {
        let Some(flat) = self.params_device(module) else {
            return Vec::new();
        };
        let out = transfer::read_f32(flat).expect("float parameters read back as f32");
        assert_eq!(out.len(), self.total, "module changed shape after layout");
        out
    }

    /// The flat copy of elements `range` of the module's parameters (whole parameters: a
    /// unit), with one device read.
    pub fn flatten_range<M: Module>(&self, module: &M, range: Range<usize>) -> Vec<f32> {
        struct Pick<'a> {
            entries: &'a [FlatEntry],
            index: usize,
            range: Range<usize>,
            parts: Vec<Tensor<1>>,
        }
        impl ModuleVisitor for Pick<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if is_buffer(param) {
                    return;
                }
                let e = &self.entries[self.index];
                self.index += 1;
                if e.len > 0 && e.offset >= self.range.start && e.offset + e.len <= self.range.end {
                    self.parts.push(param.val().inner().reshape([e.len]));
                }
            }
        }
        let mut pick = Pick {
            entries: &self.entries,
            index: 0,
            range: range.clone(),
            parts: Vec::new(),
        };
        module.visit(&mut pick);
        if pick.parts.is_empty() {
            return Vec::new();
        }
        let out = transfer::read_f32(Tensor::cat(pick.parts, 0))
            .expect("float parameters read back as f32");
        assert_eq!(out.len(), range.len(), "a unit's range cuts a parameter");
        out
    }

    /// The module's parameter values as one flat tensor on their device, without autodiff (a
    /// device copy; nothing crosses to the host). `None` when the module has no element.
    pub fn params_device<M: Module>(&self, module: &M) -> Option<Tensor<1>> {
        gather_flat(module, false)
    }

    /// Writes gradient elements `range` of the flat vector into `out` (zeros where a parameter
    /// has no gradient), taking each touched gradient out of `grads`: the bucket is put
    /// together on the device ([`Self::grads_device`]) and read with one blocking wait.
    pub fn flatten_grads(
        &self,
        grads: &mut GradientsParams,
        range: Range<usize>,
        device: &Device,
        out: &mut Vec<f32>,
    ) {
        *out = self.read_grads(grads, range, device, 1.0, None);
    }

    /// Gradient elements `range` on the host with one blocking read, weighed by `weight` on
    /// the device. `narrow`: a 16-bit wire dtype the reduction carries the bucket in; when
    /// the device computes in it, the bucket is narrowed there before the read, so half the
    /// bytes cross (what the wire's encoding would round it to: that encoding keeps the
    /// narrowed values exactly, as DDP's bf16 compression hook casts each rank's gradient).
    pub fn read_grads(
        &self,
        grads: &mut GradientsParams,
        range: Range<usize>,
        device: &Device,
        weight: f32,
        narrow: Option<WireDtype>,
    ) -> Vec<f32> {
        if range.is_empty() {
            return Vec::new();
        }
        let mut t = self.grads_device(grads, range, device);
        if weight != 1.0 {
            t = t * weight;
        }
        if let Some(d) = narrow.and_then(|w| narrow_dtype(w, device)) {
            t = t.cast(d);
        }
        transfer::read_f32(t).expect("gradients read back as f32")
    }

    /// Gradient elements `range` of the flat vector as one tensor on `device` (zeros where a
    /// parameter has no gradient), taking each touched gradient out of `grads`; slices and
    /// one concatenation on the device, nothing crosses to the host. `range` is not empty.
    pub fn grads_device(
        &self,
        grads: &mut GradientsParams,
        range: Range<usize>,
        device: &Device,
    ) -> Tensor<1> {
        let mut parts = Vec::new();
        for e in &self.entries {
            let r = e.offset.max(range.start)..(e.offset + e.len).min(range.end);
            if r.is_empty() {
                continue;
            }
            // A parameter split across buckets stays in `grads` until its last bucket.
            let part = match grad_tensor(grads, e, e.offset + e.len <= range.end) {
                Some(g) if r.len() == e.len => g,
                Some(g) => g.slice(r.start - e.offset..r.end - e.offset),
                None => Tensor::zeros([r.len()], device),
            };
            parts.push(part);
        }
        cat(parts).expect("a bucket holds at least one element")
    }

    /// Returns `module` with every float parameter replaced by its slice of `flat`: one
    /// upload, then slices of it on the device ([`Self::unflatten_device`]).
    pub fn unflatten<M: Module>(&self, module: M, flat: &[f32]) -> M {
        assert_eq!(flat.len(), self.total);
        let Some(device) = first_device(&module) else {
            return module;
        };
        let t = transfer::upload(flat.to_vec(), &device.inner());
        self.unflatten_device(module, t)
    }

    /// Returns `module` with every float parameter replaced by its slice of `flat`, a flat
    /// tensor on the module's device: each parameter becomes a view of it (a device copy
    /// where the slice is not aligned for a view). Nothing crosses to the host.
    pub fn unflatten_device<M: Module>(&self, module: M, flat: Tensor<1>) -> M {
        assert_eq!(flat.dims()[0], self.total);
        write_flat(module, flat.inner(), false)
    }
}

/// The float tensors of `module` that are non-trained state (`buffers`, see
/// [`buffers`]) or that are not, in visit order, as one flat tensor on their device without
/// autodiff (a device copy); `None` when there is no element.
pub(crate) fn gather_flat<M: Module>(module: &M, buffers: bool) -> Option<Tensor<1>> {
    struct Gather {
        parts: Vec<Tensor<1>>,
        buffers: bool,
    }
    impl ModuleVisitor for Gather {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let n: usize = param.lazy_shape().iter().product();
            if n > 0 && is_buffer(param) == self.buffers {
                self.parts.push(param.val().inner().reshape([n]));
            }
        }
    }
    let mut g = Gather {
        parts: Vec::new(),
        buffers,
    };
    module.visit(&mut g);
    cat(g.parts)
}

/// `module` with the float tensors [`gather_flat`] selects replaced by their slices of
/// `flat` (without autodiff), in the same order: each a view of it on the device.
pub(crate) fn write_flat<M: Module>(module: M, flat: Tensor<1>, buffers: bool) -> M {
    struct Write {
        flat: Tensor<1>,
        at: usize,
        buffers: bool,
    }
    impl ModuleMapper for Write {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let n: usize = param.lazy_shape().iter().product();
            if n == 0 || is_buffer(&param) != self.buffers {
                return param;
            }
            let part = self.flat.clone().slice(self.at..self.at + n);
            self.at += n;
            param.map(|old| like(old, part))
        }
    }
    module.map(&mut Write {
        flat,
        at: 0,
        buffers,
    })
}

/// `part` (a flat device tensor without autodiff) in `old`'s shape, with its autodiff
/// association and gradient tracking.
fn like<const D: usize>(old: Tensor<D>, part: Tensor<1>) -> Tensor<D> {
    let t: Tensor<D> = part.reshape(old.dims());
    let t = if old.is_autodiff() { t.autodiff() } else { t };
    if old.is_require_grad() {
        t.require_grad()
    } else {
        t
    }
}

/// The concatenation of `parts` (no copy for one part); `None` for none.
fn cat(mut parts: Vec<Tensor<1>>) -> Option<Tensor<1>> {
    match parts.len() {
        0 => None,
        1 => parts.pop(),
        _ => Some(Tensor::cat(parts, 0)),
    }
}

/// The device of the module's first float parameter.
fn first_device<M: Module>(module: &M) -> Option<Device> {
    struct First(Option<Device>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() {
                self.0 = Some(param.val().device());
            }
        }
    }
    let mut f = First(None);
    module.visit(&mut f);
    f.0
}

/// A tensor like `old` (device, autodiff tracking) holding `vals` in `shape`.
fn replace_values<const D: usize>(
    old: Tensor<D>,
    vals: Vec<f32>,
    shape: impl Into<burn::tensor::Shape>,
) -> Tensor<D> {
    let fresh = Tensor::<D>::from_data(TensorData::new(vals, shape), &old.device());
    if old.is_require_grad() {
        fresh.require_grad()
    } else {
        fresh
    }
}

/// One parameter's gradient as a flat tensor on its device (D up to 6); `take` removes it
/// from `grads`.
fn grad_tensor(grads: &mut GradientsParams, e: &FlatEntry, take: bool) -> Option<Tensor<1>> {
    macro_rules! rank {
        ($d:literal) => {{
            let t: Option<Tensor<$d>> = if take {
                grads.remove::<$d>(e.id)
            } else {
                grads.get::<$d>(e.id)
            };
            t.map(|t| t.reshape([e.len]))
        }};
    }
    match e.shape.len() {
        1 => rank!(1),
        2 => rank!(2),
        3 => rank!(3),
        4 => rank!(4),
        5 => rank!(5),
        6 => rank!(6),
        d => panic!("parameters of rank {d} are not supported (max 6)"),
    }
}

/// Fills every float parameter with values from a seeded generator, so a model starts
/// identically on every device kind: uniform in ±1/sqrt(fan_in) (fan_in = first dimension of
/// a matrix; 1-D parameters use their length). A parameter Burn initialised to a constant
/// (a norm's gain of ones, a bias of zeros; two elements or more) keeps that constant.
pub fn init_deterministic<M: Module>(module: M, seed: u64) -> M {
    struct Init {
        rng: rand::rngs::StdRng,
    }
    impl ModuleMapper for Init {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            use rand::Rng;
            let shape: Vec<usize> = param.lazy_shape().to_vec();
            let n: usize = shape.iter().product();
            let fan_in = shape.first().copied().unwrap_or(1).max(1) as f32;
            let bound = 1.0 / fan_in.sqrt();
            // Draw first, so the stream of values does not depend on which tensors are constant.
            let vals: Vec<f32> = (0..n)
                .map(|_| self.rng.random_range(-bound..=bound))
                .collect();
            let current = param
                .val()
                .try_into_vec_as::<f32>()
                .expect("parameter reads back as f32");
            // (One element says nothing: a 1-output layer's random bias is drawn too.)
            if n > 1 && current.windows(2).all(|w| w[0] == w[1]) {
                return param;
            }
            param.map(|t| replace_values(t, vals, shape))
        }
    }
    use rand::SeedableRng;
    module.map(&mut Init {
        rng: rand::rngs::StdRng::seed_from_u64(seed),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;

    /// Parameters of awkward sizes: one element, zero elements, and shapes that 4-element
    /// buckets cut in the middle.
    #[derive(Module, Debug)]
    struct Odd {
        one: Param<Tensor<1>>,
        empty: Param<Tensor<1>>,
        mat: Param<Tensor<2>>,
        vec: Param<Tensor<1>>,
        cube: Param<Tensor<3>>,
    }

    fn counting<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
        let n: usize = shape.iter().product();
        let vals: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
        Tensor::<D>::from_data(TensorData::new(vals, shape), device)
    }

    fn odd(device: &Device) -> Odd {
        Odd {
            one: Param::from_tensor(counting([1], device)),
            empty: Param::from_tensor(Tensor::zeros([0], device)),
            mat: Param::from_tensor(counting([3, 5], device)),
            vec: Param::from_tensor(counting([7], device)),
            cube: Param::from_tensor(counting([2, 2, 2], device)),
        }
    }

    #[test]
    fn odd_sizes_flatten_and_unflatten_through_the_device() {
        let device = Device::flex().autodiff();
        let m = odd(&device);
        let layout = FlatLayout::of(&m);
        assert_eq!(layout.total(), 1 + 15 + 7 + 8);
        let flat: Vec<f32> = (0..layout.total()).map(|i| -(i as f32)).collect();
        let before = transfer::counts();
        let m = layout.unflatten(m, &flat);
        assert_eq!(
            (transfer::counts() - before).h2d_bytes,
            4 * layout.total() as u64,
            "one upload"
        );
        assert_eq!(layout.flatten_params(&m), flat);
        assert_eq!(m.cube.val().dims(), [2, 2, 2]);
        assert_eq!(m.empty.val().dims(), [0]);
        assert!(m.mat.val().is_require_grad());
        // Device-side: the flat tensor and back, no host in between.
        let t = layout.params_device(&m).unwrap();
        let m = layout.unflatten_device(m, t * 2.0);
        let doubled: Vec<f32> = flat.iter().map(|x| 2.0 * x).collect();
        assert_eq!(layout.flatten_params(&m), doubled);
    }

    #[test]
    fn buckets_that_cut_parameters_gather_each_gradient_once_with_zeros_where_none() {
        let device = Device::flex().autodiff();
        let m = odd(&device);
        let layout = FlatLayout::of(&m);
        // d loss / d mat = 2, d loss / d cube = 3; `one` and `vec` get no gradient.
        let loss = m.mat.val().sum() * 2.0 + m.cube.val().sum() * 3.0;
        let mut grads = GradientsParams::from_grads(loss.backward(), &m);
        let mut want = vec![0.0f32; 1];
        want.extend([2.0; 15]);
        want.extend([0.0; 7]);
        want.extend([3.0; 8]);
        let inner = device.clone().inner();
        let before = transfer::counts();
        let mut got = Vec::new();
        let buckets = layout.buckets(4);
        assert_eq!(
            buckets.len(),
            8,
            "31 elements in buckets of 4: the last holds 3"
        );
        for b in &buckets {
            let mut part = Vec::new();
            layout.flatten_grads(&mut grads, b.clone(), &inner, &mut part);
            assert_eq!(part.len(), b.len());
            got.extend(part);
        }
        assert_eq!(got, want);
        let moved = transfer::counts() - before;
        assert_eq!(moved.d2h_bytes, 4 * 31);
        assert_eq!(moved.device_waits, 8, "one wait per bucket");
        assert!(
            grads.is_empty(),
            "every gradient is taken by its last bucket"
        );
    }
}
