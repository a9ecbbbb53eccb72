//! The flat view of a model's float parameters that every strategy works on.
//!
//! Parameters are visited in module order and named by their field path ("l1.weight"); every
//! rank builds the same [`FlatLayout`] and the trainer checks at start-up that all ranks agree
//! (a mismatch names the first differing parameter). Buckets cut the flat vector into
//! contiguous ranges (25 MiB by default); shards cut each bucket at element offsets, so shards
//! are equal within one element per bucket.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use std::ops::Range;

/// One parameter's place in the flat vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatEntry {
    pub path: String,
    pub id: ParamId,
    pub shape: Vec<usize>,
    pub offset: usize,
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
}

impl ModuleVisitor for Collect {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
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
    pub fn of<M: Module>(module: &M) -> Self {
        let mut c = Collect {
            path: Vec::new(),
            entries: Vec::new(),
            total: 0,
        };
        module.visit(&mut c);
        Self {
            entries: c.entries,
            total: c.total,
        }
    }

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

    /// The flat copy of the module's current parameter values.
    pub fn flatten_params<M: Module>(&self, module: &M) -> Vec<f32> {
        struct Read<'a> {
            out: &'a mut Vec<f32>,
        }
        impl ModuleVisitor for Read<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let v = param
                    .val()
                    .inner()
                    .try_into_vec_as::<f32>()
                    .expect("float parameter reads back as f32");
                self.out.extend_from_slice(&v);
            }
        }
        let mut out = Vec::with_capacity(self.total);
        module.visit(&mut Read { out: &mut out });
        assert_eq!(out.len(), self.total, "module changed shape after layout");
        out
    }

    /// Writes gradient elements `range` of the flat vector into `out` (zeros where a parameter
    /// has no gradient), taking each touched gradient out of `grads`.
    pub fn flatten_grads(
        &self,
        grads: &mut GradientsParams,
        range: Range<usize>,
        out: &mut Vec<f32>,
    ) {
        out.clear();
        out.resize(range.len(), 0.0);
        for e in &self.entries {
            let r = e.offset.max(range.start)..(e.offset + e.len).min(range.end);
            if r.is_empty() {
                continue;
            }
            // A parameter split across buckets is read once, on its first bucket, and kept
            // whole until its last bucket is done.
            let Some(v) = grad_vec(grads, e, e.offset + e.len <= range.end) else {
                continue;
            };
            out[r.start - range.start..r.end - range.start]
                .copy_from_slice(&v[r.start - e.offset..r.end - e.offset]);
        }
    }

    /// Returns `module` with every float parameter replaced by its slice of `flat`.
    pub fn unflatten<M: Module>(&self, module: M, flat: &[f32]) -> M {
        assert_eq!(flat.len(), self.total);
        struct Write<'a> {
            flat: &'a [f32],
            at: usize,
        }
        impl ModuleMapper for Write<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let n: usize = param.lazy_shape().iter().product();
                let vals = self.flat[self.at..self.at + n].to_vec();
                self.at += n;
                param.map(|t| {
                    let shape = t.shape();
                    replace_values(t, vals, shape)
                })
            }
        }
        module.map(&mut Write { flat, at: 0 })
    }
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

/// Reads one parameter's gradient as f32 (D up to 6); `take` removes it from `grads`.
fn grad_vec(grads: &mut GradientsParams, e: &FlatEntry, take: bool) -> Option<Vec<f32>> {
    macro_rules! rank {
        ($d:literal) => {{
            let t: Option<Tensor<$d>> = if take {
                grads.remove::<$d>(e.id)
            } else {
                grads.get::<$d>(e.id)
            };
            t.map(|t| {
                t.try_into_vec_as::<f32>()
                    .expect("gradient reads back as f32")
            })
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
