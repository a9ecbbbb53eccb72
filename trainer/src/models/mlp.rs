//! `mlp`: synthetic classification. Inputs are seeded Gaussian-ish vectors; labels come from a
//! fixed random teacher (argmax of a linear map), so the task is learnable and deterministic.

use crate::units::{Act, UnitMap, Units};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};

/// Three linear layers with ReLU between them: [`INPUT`] features to [`HIDDEN`], [`HIDDEN`],
/// then [`CLASSES`] logits.
#[derive(Module, Debug)]
pub struct Mlp {
    l1: Linear,
    l2: Linear,
    l3: Linear,
}

/// Features per sample (the input width).
pub const INPUT: usize = 32;
/// Width of the two hidden layers.
pub const HIDDEN: usize = 64;
/// Classes (the output width).
pub const CLASSES: usize = 10;

impl Mlp {
    /// A model with deterministic parameters (the same on every device kind for a seed).
    pub fn new(device: &Device, seed: u64) -> Self {
        let m = Self {
            l1: LinearConfig::new(INPUT, HIDDEN).init(device),
            l2: LinearConfig::new(HIDDEN, HIDDEN).init(device),
            l3: LinearConfig::new(HIDDEN, CLASSES).init(device),
        };
        crate::flat::init_deterministic(m, seed)
    }

    /// Logits `[batch, CLASSES]` for inputs `[batch, INPUT]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        use burn::tensor::activation::relu;
        self.l3
            .forward(relu(self.l2.forward(relu(self.l1.forward(x)))))
    }

    /// The unit-model form of [`Mlp::loss`]: unit 0's input and the loss of the last unit's
    /// output.
    pub fn unit_io(
        data: &Dataset,
        idx: &[usize],
        device: &Device,
    ) -> (Act, impl FnOnce(Act) -> Tensor<1> + use<>) {
        let (x, y) = data.batch(idx, device);
        let device = device.clone();
        (Act::F2(x), move |out: Act| {
            let Act::F2(logits) = out else {
                unreachable!("the mlp's last unit returns logits [batch, classes]")
            };
            CrossEntropyLossConfig::new()
                .init(&device)
                .forward(logits, y)
        })
    }

    /// Mean cross-entropy over the samples `idx` of `data`.
    pub fn loss(&self, data: &Dataset, idx: &[usize], device: &Device) -> Tensor<1> {
        let (x, y) = data.batch(idx, device);
        CrossEntropyLossConfig::new()
            .init(device)
            .forward(self.forward(x), y)
    }
}

/// Three units, one per layer (ZeRO-3 gathers one layer at a time).
impl Units for Mlp {
    fn unit_map(&self) -> UnitMap {
        UnitMap::new().unit(&["l1"]).unit(&["l2"]).unit(&["l3"])
    }
    fn forward_unit(&self, unit: usize, x: Act) -> Act {
        use burn::tensor::activation::relu;
        let Act::F2(x) = x else {
            unreachable!("mlp units take [batch, features] floats")
        };
        Act::F2(match unit {
            0 => relu(self.l1.forward(x)),
            1 => relu(self.l2.forward(x)),
            _ => self.l3.forward(x),
        })
    }
}

/// The synthetic dataset.
pub struct Dataset {
    x: Vec<f32>,
    y: Vec<i64>,
}

impl Dataset {
    /// `n` samples drawn from `seed`, labelled by a teacher drawn from the same seed.
    pub fn synthetic(n: usize, seed: u64) -> Self {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xda7a);
        let teacher: Vec<f32> = (0..INPUT * CLASSES)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let mut x = Vec::with_capacity(n * INPUT);
        let mut y = Vec::with_capacity(n);
        for _ in 0..n {
            let v: Vec<f32> = (0..INPUT)
                .map(|_| (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum::<f32>() / 2.0)
                .collect();
            let label = (0..CLASSES)
                .map(|c| {
                    (0..INPUT)
                        .map(|i| v[i] * teacher[i * CLASSES + c])
                        .sum::<f32>()
                })
                .enumerate()
                .fold(
                    (0, f32::MIN),
                    |best, (c, s)| if s > best.1 { (c, s) } else { best },
                )
                .0;
            x.extend_from_slice(&v);
            y.push(label as i64);
        }
        Self { x, y }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// Whether there is no sample.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// Inputs `[idx.len(), INPUT]` and labels `[idx.len()]` of the samples `idx`, on `device`.
    pub fn batch(&self, idx: &[usize], device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        let mut xs = Vec::with_capacity(idx.len() * INPUT);
        let mut ys = Vec::with_capacity(idx.len());
        for &i in idx {
            xs.extend_from_slice(&self.x[i * INPUT..(i + 1) * INPUT]);
            ys.push(self.y[i]);
        }
        (
            Tensor::<2>::from_data(TensorData::new(xs, [idx.len(), INPUT]), device),
            Tensor::<1, Int>::from_data(TensorData::new(ys, [idx.len()]), device),
        )
    }
}
