//! Units whose boundaries carry what `burn::nn` models pass between their layers: a
//! convolution's rank-4 activations (`Act::F4`), and a tuple of a hidden state and an integer
//! mask (`Act::Tuple`). On 2 ranks of one node (real threads and shared buffers), under ZeRO-3
//! (every unit gathered, the backward through the surrogate loss) and under ZeRO-2 with overlap
//! (the same unit-by-unit backward): the per-step global losses and the final parameters
//! equal a plain Burn loop on the global batch with the same SGD, within 1e-5 (the parameters
//! from `Trainer::into_full_model`, whose ZeRO-3 model is gathered whole). Before, `Act` had
//! no rank-4 or tuple form: neither model could be cut into units.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use wiretrain::device::DeviceSpec;
use wiretrain::engine::Overlap;
use wiretrain::units::{Act, UnitMap, Units};
use wiretrain::{JobOptions, Strategy, Trainer, TrainerConfig};

const STEPS: usize = 4;
const LR: f64 = 0.05;
/// Rows per rank; the global batch is both ranks' rows.
const ROWS: usize = 4;

/// Deterministic values in [-1, 1] for step `step`, row `row`.
fn vals(n: usize, step: usize, row: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 13 + step * 7 + row * 29 + salt) % 17) as f32 / 8.0 - 1.0)
        .collect()
}

fn mse(y: Tensor<2>, target: Tensor<2>) -> Tensor<1> {
    (y - target).powf_scalar(2.0).mean()
}

#[derive(Module, Debug)]
struct Cnn {
    c1: Conv2d,
    c2: Conv2d,
    head: Linear,
}

impl Cnn {
    fn new(device: &Device) -> Self {
        let conv = |i, o| {
            Conv2dConfig::new([i, o], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device)
        };
        let m = Self {
            c1: conv(1, 3),
            c2: conv(3, 2),
            head: LinearConfig::new(2 * 6 * 6, 3).init(device),
        };
        wiretrain::flat::init_deterministic(m, 11)
    }
}

impl Units for Cnn {
    fn num_units(&self) -> usize {
        3
    }
    fn unit_of(&self, path: &str) -> usize {
        let map = UnitMap::new().unit(&["c1"]).unit(&["c2"]).unit(&["head"]);
        map.unit_of(path)
            .expect("every parameter is in a declared field")
    }
    fn forward_unit(&self, unit: usize, x: Act) -> Act {
        let Act::F4(x) = x else {
            unreachable!("every unit of Cnn takes [batch, channels, height, width]")
        };
        match unit {
            0 => Act::F4(relu(self.c1.forward(x))),
            1 => Act::F4(relu(self.c2.forward(x))),
            _ => Act::F2(self.head.forward(x.flatten(1, 3))),
        }
    }
}

#[derive(Module, Debug)]
struct Gated {
    l1: Linear,
    l2: Linear,
    head: Linear,
}

impl Gated {
    fn new(device: &Device) -> Self {
        let m = Self {
            l1: LinearConfig::new(4, 8).init(device),
            l2: LinearConfig::new(8, 8).init(device),
            head: LinearConfig::new(8, 3).init(device),
        };
        wiretrain::flat::init_deterministic(m, 12)
    }
}

impl Units for Gated {
    fn num_units(&self) -> usize {
        3
    }
    fn unit_of(&self, path: &str) -> usize {
        let map = UnitMap::new().unit(&["l1"]).unit(&["l2"]).unit(&["head"]);
        map.unit_of(path)
            .expect("every parameter is in a declared field")
    }
    /// Every boundary carries the hidden state and an integer keep-mask that unit 1 applies.
    fn forward_unit(&self, unit: usize, x: Act) -> Act {
        let Act::Tuple(mut parts) = x else {
            unreachable!("Gated's boundaries carry (hidden, mask)")
        };
        let (Some(Act::I2(keep)), Some(Act::F2(h))) = (parts.pop(), parts.pop()) else {
            unreachable!("(F2 hidden, I2 mask)")
        };
        match unit {
            0 => Act::Tuple(vec![Act::F2(relu(self.l1.forward(h))), Act::I2(keep)]),
            1 => {
                let kept = self.l2.forward(h) * keep.clone().float();
                Act::Tuple(vec![Act::F2(kept), Act::I2(keep)])
            }
            _ => Act::F2(self.head.forward(h)),
        }
    }
}

/// One rank's (or, with `rows` of both, the global) batch of a model: its unit input and
/// its regression target.
type Batch = fn(&[usize], usize, &Device) -> (Act, Tensor<2>);

fn cnn_batch(rows: &[usize], step: usize, device: &Device) -> (Act, Tensor<2>) {
    let x: Vec<f32> = rows.iter().flat_map(|&r| vals(36, step, r, 1)).collect();
    let t: Vec<f32> = rows.iter().flat_map(|&r| vals(3, step, r, 2)).collect();
    let n = rows.len();
    (
        Act::F4(Tensor::from_data(TensorData::new(x, [n, 1, 6, 6]), device)),
        Tensor::from_data(TensorData::new(t, [n, 3]), device),
    )
}

fn gated_batch(rows: &[usize], step: usize, device: &Device) -> (Act, Tensor<2>) {
    let x: Vec<f32> = rows.iter().flat_map(|&r| vals(4, step, r, 3)).collect();
    let keep: Vec<i64> = rows
        .iter()
        .flat_map(|&r| (0..8).map(move |i| i64::from(!(i + r + step).is_multiple_of(3))))
        .collect();
    let t: Vec<f32> = rows.iter().flat_map(|&r| vals(3, step, r, 4)).collect();
    let n = rows.len();
    let keep = Tensor::<2, Int>::from_data(TensorData::new(keep, [n, 8]), device);
    (
        Act::Tuple(vec![
            Act::F2(Tensor::from_data(TensorData::new(x, [n, 4]), device)),
            Act::I2(keep),
        ]),
        Tensor::from_data(TensorData::new(t, [n, 3]), device),
    )
}

fn rank_rows(rank: usize) -> Vec<usize> {
    (rank * ROWS..(rank + 1) * ROWS).collect()
}

fn flat<M: Module>(m: &M) -> Vec<f32> {
    wiretrain::flat::FlatLayout::of(m).flatten_params(m)
}

/// Losses and final parameters of rank 0 on 2 ranks.
fn distributed<M: Units + 'static>(
    new: fn(&Device) -> M,
    batch: Batch,
    strategy: Strategy,
) -> (Vec<f32>, Vec<f32>) {
    let job = JobOptions {
        ranks_per_node: Some(2),
        devices: vec![DeviceSpec::Cpu],
        nnodes: Some(1),
        ..JobOptions::default()
    };
    let mut out = wiretrain::run(job, move |ctx| {
        let device = ctx.device().autodiff();
        let rank = ctx.rank();
        let cfg = TrainerConfig::builder(strategy)
            .lr(LR)
            .optim(wiretrain::optim::OptimConfig::Sgd {
                momentum: 0.0,
                weight_decay: 0.0,
            })
            .overlap(Overlap::On)
            .build()
            .map_err(|e| e.to_string())?;
        let mut t =
            Trainer::with_units(new(&device), &device, cfg, ctx.pg).map_err(|e| e.to_string())?;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (x, target) = batch(&rank_rows(rank), step, &device);
            let loss = move |y: Act| {
                let Act::F2(y) = y else {
                    unreachable!("the head gives [batch, 3]")
                };
                mse(y, target)
            };
            losses.push(t.step_units(x, loss).map_err(|e| e.to_string())?.loss);
        }
        // Under ZeRO-3 the model holds placeholders at rest: the full one, gathered.
        let model = t.into_full_model().map_err(|e| e.to_string())?;
        Ok::<_, String>((losses, flat(&model)))
    })
    .expect("trains");
    out.swap_remove(0)
}

/// The same model on the global batch in a plain Burn loop with Burn's SGD.
fn plain_burn<M: Units + 'static>(new: fn(&Device) -> M, batch: Batch) -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let mut model = new(&device);
    let mut opt = SgdConfig::new().init();
    let rows: Vec<usize> = (0..2 * ROWS).collect();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, target) = batch(&rows, step, &device);
        let y = (0..model.num_units()).fold(x, |h, u| model.forward_unit(u, h));
        let Act::F2(y) = y else { unreachable!() };
        let loss = mse(y, target);
        losses.push(loss.clone().into_data().try_to_vec::<f32>().unwrap()[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = opt.step(LR, model, grads);
    }
    (losses, flat(&model))
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
        .fold(0.0, f32::max)
}

fn check<M: Units + 'static>(name: &str, new: fn(&Device) -> M, batch: Batch) {
    let (want_loss, want_params) = plain_burn(new, batch);
    for strategy in [Strategy::Zero3, Strategy::Zero2] {
        let (loss, params) = distributed(new, batch, strategy);
        let (wl, wp) = (worst(&loss, &want_loss), worst(&params, &want_params));
        eprintln!("{name} {strategy}: losses {loss:?} vs {want_loss:?}; worst {wl:e} / {wp:e}");
        assert!(wl <= 1e-5 && wp <= 1e-5, "{name} {strategy}: {wl:e} {wp:e}");
    }
}

#[test]
fn a_cnn_cut_into_units_trains_as_plain_burn() {
    check("cnn", Cnn::new, cnn_batch);
}

#[test]
fn units_that_pass_a_hidden_state_and_a_mask_train_as_plain_burn() {
    check("gated", Gated::new, gated_batch);
}
