//! Module state that is not trained (BatchNorm's running statistics) in a model cut into
//! units, under ZeRO-3: the BatchNorm sits in the first unit, which the backward pass runs a
//! second time (it recomputes every unit but the last from its saved input). At world 1 the
//! running statistics and the losses equal a plain Burn loop's within 1e-5, so the recompute
//! does not advance the statistics a second time; on 2 ranks every rank ends with rank 0's
//! (the default `BufferSync::Broadcast`).

use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use wiretrain::device::DeviceSpec;
use wiretrain::units::{Act, UnitMap, Units};
use wiretrain::{JobOptions, Strategy, Trainer, TrainerConfig};

const STEPS: usize = 5;
const LR: f64 = 0.05;

#[derive(Module, Debug)]
struct Net {
    bn: BatchNorm,
    lin: Linear,
}

impl Net {
    fn new(device: &Device) -> Self {
        let net = Self {
            bn: BatchNormConfig::new(4).init(device),
            lin: LinearConfig::new(4, 3).init(device),
        };
        wiretrain::flat::init_deterministic(net, 3)
    }

    fn stats(&self) -> Vec<f32> {
        let read = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
        let mut v = read(self.bn.running_mean.value());
        v.extend(read(self.bn.running_var.value()));
        v
    }
}

impl Units for Net {
    fn num_units(&self) -> usize {
        2
    }
    fn unit_of(&self, path: &str) -> usize {
        let map = UnitMap::new().unit(&["bn"]).unit(&["lin"]);
        map.unit_of(path)
            .expect("every parameter is in a declared field")
    }
    fn forward_unit(&self, unit: usize, x: Act) -> Act {
        let Act::F2(x) = x else {
            unreachable!("[batch, features]")
        };
        Act::F2(match unit {
            0 => self.bn.forward(x),
            _ => self.lin.forward(x),
        })
    }
}

/// 8 rows that depend on the rank and step.
fn input(rank: usize, step: usize, device: &Device) -> Tensor<2> {
    let vals: Vec<f32> = (0..32)
        .map(|i| ((i * 5 + step * 3 + rank * 7) % 11) as f32 / 3.0 - 1.0 + rank as f32)
        .collect();
    Tensor::from_data(TensorData::new(vals, [8, 4]), device)
}

fn loss(y: Tensor<2>) -> Tensor<1> {
    (y - 0.5).powf_scalar(2.0).mean()
}

/// Each rank's (losses, running statistics) after `STEPS` ZeRO-3 steps on `ranks` ranks.
fn zero3(ranks: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
    let job = JobOptions {
        ranks_per_node: Some(ranks),
        devices: vec![DeviceSpec::Cpu],
        nnodes: Some(1),
        ..JobOptions::default()
    };
    wiretrain::run(job, move |ctx| {
        let device = ctx.device().autodiff();
        let rank = ctx.rank();
        let cfg = TrainerConfig::builder(Strategy::Zero3)
            .lr(LR)
            .optim(wiretrain::optim::OptimConfig::Sgd {
                momentum: 0.0,
                weight_decay: 0.0,
            })
            .build()
            .map_err(|e| e.to_string())?;
        let mut t = Trainer::with_units(Net::new(&device), &device, cfg, ctx.pg)
            .map_err(|e| e.to_string())?;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let x = Act::F2(input(rank, step, &device));
            let f = |y: Act| {
                let Act::F2(y) = y else { unreachable!() };
                loss(y)
            };
            losses.push(t.step_units(x, f).map_err(|e| e.to_string())?.loss);
        }
        let model = t.into_full_model().map_err(|e| e.to_string())?;
        Ok::<_, String>((losses, model.stats()))
    })
    .expect("trains")
}

/// Rank 0's data in a plain Burn loop with Burn's SGD.
fn plain_burn() -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let mut model = Net::new(&device);
    let mut opt = SgdConfig::new().init();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let y = model.lin.forward(model.bn.forward(input(0, step, &device)));
        let l = loss(y);
        losses.push(l.clone().into_data().try_to_vec::<f32>().unwrap()[0]);
        let grads = GradientsParams::from_grads(l.backward(), &model);
        model = opt.step(LR, model, grads);
    }
    drop(model.valid());
    (losses, model.stats())
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn a_batchnorm_in_a_recomputed_unit_advances_once_per_step_under_zero3() {
    let (want_loss, want_stats) = plain_burn();
    let (loss, stats) = zero3(1).remove(0);
    eprintln!("zero3 stats {stats:?}\nplain Burn {want_stats:?}");
    assert!(
        worst(&loss, &want_loss) <= 1e-5,
        "{loss:?} vs {want_loss:?}"
    );
    let w = worst(&stats, &want_stats);
    assert!(
        w <= 1e-5,
        "running statistics differ from plain Burn's by {w}"
    );
    let two = zero3(2);
    assert_eq!(two[0].1, two[1].1, "every rank holds rank 0's statistics");
}
