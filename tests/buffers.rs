//! Module state that is not trained (Burn's `RunningState`: BatchNorm's running mean and
//! variance) through the real trainer: at world 1 it advances exactly as in a plain Burn
//! training loop with the same optimizer; across 2 ranks (one node, real threads and shared
//! buffers) every rank ends with rank 0's statistics by default, the mean with
//! `BufferSync::Mean`, and its own with `BufferSync::Local`. Before, the trainer treated the
//! statistics as parameters and wrote its stale copy back after every step: they came out of
//! `into_model()` at their initial values.

mod common;

use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use wiretrain::device::DeviceSpec;
use wiretrain::flat::BufferSync;
use wiretrain::{JobOptions, Strategy, Trainer, TrainerConfig};

#[derive(Module, Debug)]
struct Net {
    lin: Linear,
    bn: BatchNorm,
}

impl Net {
    /// The same starting point in every run (seeded values for the linear layer; BatchNorm's
    /// constants as Burn makes them).
    fn new(device: &Device) -> Self {
        let net = Self {
            lin: LinearConfig::new(4, 3).init(device),
            bn: BatchNormConfig::new(3).init(device),
        };
        wiretrain::flat::init_deterministic(net, 5)
    }

    /// A batch of 8 rows that depends on the rank and step, so ranks see different data.
    fn loss(&self, rank: usize, step: usize, device: &Device) -> Tensor<1> {
        let vals: Vec<f32> = (0..32)
            .map(|i| ((i * 7 + step * 3 + rank * 11) % 13) as f32 / 4.0 - 1.0 + rank as f32)
            .collect();
        let x = Tensor::<2>::from_data(TensorData::new(vals, [8, 4]), device);
        let y = self.bn.forward(self.lin.forward(x));
        (y - 0.5).powf_scalar(2.0).mean()
    }

    fn stats(&self) -> Vec<f32> {
        let mut v = self
            .bn
            .running_mean
            .value()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        v.extend(
            self.bn
                .running_var
                .value()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap(),
        );
        v
    }
}

const STEPS: usize = 5;
const LR: f64 = 1e-2;
/// AdamW's decoupled weight decay: large enough that decaying the statistics as parameters
/// (what the trainer did) shows.
const DECAY: f32 = 0.1;

/// Each rank's running statistics after `STEPS` steps under `strategy` and `policy`.
fn trained(ranks: usize, strategy: Strategy, policy: BufferSync) -> Vec<Vec<f32>> {
    run_steps(ranks, strategy, policy, 0..STEPS, None)
}

/// Each rank's running statistics after the steps `steps` under `strategy` and `policy`; with
/// `ck`, the run first resumes from the newest checkpoint there (when `steps` does not start
/// at 0) and, when it ran steps, ends by saving one.
fn run_steps(
    ranks: usize,
    strategy: Strategy,
    policy: BufferSync,
    steps: std::ops::Range<usize>,
    ck: Option<std::path::PathBuf>,
) -> Vec<Vec<f32>> {
    let job = JobOptions {
        ranks_per_node: Some(ranks),
        devices: vec![DeviceSpec::Cpu],
        nnodes: Some(1),
        ..JobOptions::default()
    };
    wiretrain::run(job, move |ctx| {
        let device = ctx.device().autodiff();
        let rank = ctx.rank();
        let cfg = TrainerConfig::builder(strategy)
            .lr(LR)
            .optim(wiretrain::optim::OptimConfig::AdamW {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: DECAY,
            })
            .buffer_sync(policy)
            .build()
            .map_err(|e| e.to_string())?;
        let mut t =
            Trainer::new(Net::new(&device), &device, cfg, ctx.pg).map_err(|e| e.to_string())?;
        if let Some(ck) = ck.as_ref().filter(|_| steps.start > 0) {
            let m = t.resume_latest(ck).map_err(|e| e.to_string())?;
            assert_eq!(
                m.map(|m| m.step),
                Some(steps.start),
                "resumed where it stopped"
            );
        }
        for step in steps.clone() {
            t.step(|m| m.loss(rank, step, &device))
                .map_err(|e| e.to_string())?;
        }
        if let Some(ck) = ck.as_ref().filter(|_| !steps.is_empty()) {
            let run = serde_json::json!({});
            t.save_checkpoint(ck, steps.end, run, 2)
                .map_err(|e| e.to_string())?;
        }
        Ok::<_, String>(t.into_model().stats())
    })
    .expect("trains")
}

/// The same model and data in a plain Burn loop (the same AdamW: betas 0.9, 0.999, eps 1e-8,
/// weight decay [`DECAY`]), rank 0's data.
fn plain_burn() -> Vec<f32> {
    let device = Device::flex().autodiff();
    let mut model = Net::new(&device);
    let mut opt = AdamWConfig::new()
        .with_epsilon(1e-8)
        .with_weight_decay(DECAY)
        .init();
    for step in 0..STEPS {
        let loss = model.loss(0, step, &device);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = opt.step(LR, model, grads);
    }
    drop(model.valid());
    model.stats()
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn running_statistics_advance_as_in_plain_burn_at_world_1() {
    let want = plain_burn();
    let initial = [vec![0.0f32; 3], vec![1.0; 3]].concat();
    assert!(
        worst(&want, &initial) > 1e-3,
        "plain Burn moves them: {want:?}"
    );
    for strategy in [Strategy::Ddp, Strategy::Zero2] {
        let got = trained(1, strategy, BufferSync::Broadcast).remove(0);
        let w = worst(&got, &want);
        eprintln!("{strategy}: running statistics {got:?}, plain Burn {want:?}");
        assert!(w <= 1e-5, "{strategy}: differ from plain Burn by {w}");
    }
}

#[test]
fn across_ranks_the_policy_decides_whose_statistics_every_rank_keeps() {
    for strategy in [Strategy::Ddp, Strategy::Zero2] {
        let b = trained(2, strategy, BufferSync::Broadcast);
        assert_eq!(
            b[0], b[1],
            "{strategy}, broadcast: every rank holds rank 0's"
        );
        let m = trained(2, strategy, BufferSync::Mean);
        assert_eq!(m[0], m[1], "{strategy}, mean: every rank holds the same");
        let l = trained(2, strategy, BufferSync::Local);
        assert!(
            worst(&l[0], &l[1]) > 1e-3,
            "{strategy}, local: ranks on different data keep their own: {l:?}"
        );
        // The mean policy lands between the ranks' own statistics.
        assert!(
            worst(&m[0], &b[0]) > 1e-4,
            "{strategy}: the mean differs from rank 0's: {m:?} {b:?}"
        );
    }
}

/// Checkpoints keep the running statistics: a run saved after 3 steps and resumed by fresh
/// trainers for the last 2 ends with the statistics of an uninterrupted run (at world 1, plain
/// Burn's; at world 2, the uninterrupted 2-rank run's), and `checkpoint::export` writes them
/// under Burn's module paths, so Burn's `SafetensorsStore` loads them into a fresh module.
/// Before, checkpoints held the parameters only: a resumed run restarted the statistics from
/// their initial values, and the exported model had none.
#[test]
fn checkpoints_and_the_export_keep_the_running_statistics() {
    let plain = plain_burn();
    for (ranks, strategy) in [
        (1, Strategy::Ddp),
        (1, Strategy::Zero2),
        (2, Strategy::Zero2),
    ] {
        let want = match ranks {
            1 => plain.clone(),
            _ => trained(ranks, strategy, BufferSync::Broadcast).remove(0),
        };
        let d = std::env::temp_dir().join(format!(
            "wt-buffers-ck-{ranks}-{strategy}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        let policy = BufferSync::Broadcast;
        run_steps(ranks, strategy, policy, 0..3, Some(d.clone()));
        let got = run_steps(ranks, strategy, policy, 3..STEPS, Some(d.clone())).remove(0);
        let w = worst(&got, &want);
        eprintln!("{ranks} x {strategy}: resumed {got:?}, uninterrupted {want:?}");
        assert!(
            w <= 1e-5,
            "{ranks} x {strategy}: resumed statistics differ by {w}"
        );

        let ck = wiretrain::checkpoint::Checkpoint::open(&d).unwrap();
        let file = d.join("model.safetensors");
        let e = wiretrain::checkpoint::export(&ck, &file).unwrap();
        assert_eq!((e.step, e.state_tensors), (STEPS, 2), "{e:?}");
        use burn::store::{ModuleSnapshot, SafetensorsStore};
        let mut fresh = Net::new(&Device::flex());
        let res = fresh
            .load_from(&mut SafetensorsStore::from_file(&file))
            .expect("Burn loads the exported file");
        assert!(res.missing.is_empty() && res.errors.is_empty(), "{res:?}");
        let w = worst(&fresh.stats(), &want);
        assert!(
            w <= 1e-5,
            "{ranks} x {strategy}: the exported statistics differ by {w}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// A checkpoint's running statistics resume on another world size: written by 2 ranks
/// (rank 0's, after the broadcast) and read by 1, and written by 1 and read by 2 (every rank
/// gets them), exactly.
#[test]
fn the_running_statistics_resume_on_another_world_size() {
    for (from, to) in [(2, 1), (1, 2)] {
        let d = std::env::temp_dir().join(format!(
            "wt-buffers-world-{from}-{to}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        let (s, p) = (Strategy::Zero2, BufferSync::Broadcast);
        let saved = run_steps(from, s, p, 0..3, Some(d.clone())).remove(0);
        let resumed = run_steps(to, s, p, 3..3, Some(d.clone()));
        assert_eq!(resumed.len(), to);
        for (rank, got) in resumed.iter().enumerate() {
            assert_eq!(got, &saved, "{from} -> {to} ranks: rank {rank}");
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}
