//! The unit-by-unit step against whole-model training: ZeRO-3, HSDP and overlapped reductions.

use super::*;
use crate::data::DistributedSampler;
use crate::models::char_lm::{CharLm, CharLmConfig, Corpus};
use crate::strategy::Strategy;
use wiretrain_comm::{Node, NodeConfig, tls::Token};

/// Final flat parameters and per-step losses of `steps` steps of a tiny char-lm, with
/// `world` rank threads in one node.
fn run(
    strategy: Strategy,
    world: usize,
    prefetch: usize,
    overlap: Overlap,
    steps: usize,
) -> (Vec<f32>, Vec<f32>) {
    let corpus = std::sync::Arc::new(Corpus::shipped(16));
    let mut node = Node::join(NodeConfig::single_node(world, Token::generate())).unwrap();
    let handles: Vec<_> = node
        .take_groups()
        .into_iter()
        .map(|pg| {
            let corpus = corpus.clone();
            std::thread::spawn(move || {
                let device = Device::flex().autodiff();
                let mut sampler =
                    DistributedSampler::new(corpus.len(), 12, pg.world(), pg.rank(), 5).unwrap();
                let model = CharLmConfig::new(corpus.vocab_size())
                    .with_seq(16)
                    .with_d_model(16)
                    .with_d_ff(32)
                    .init(&device, 4);
                let mut cfg = TrainerConfig::new(strategy);
                cfg.prefetch = prefetch;
                cfg.overlap = overlap;
                // SGD: the attention's key bias has a gradient that is zero in exact
                // arithmetic; AdamW would turn its rounding noise (which depends on the
                // summation order, hence on the world size) into full-size updates.
                cfg.optim = crate::optim::OptimConfig::Sgd {
                    momentum: 0.9,
                    weight_decay: 0.0,
                };
                cfg.lr = 0.5;
                let mut t = Trainer::with_units(model, &device, cfg, pg).unwrap();
                // One node: `auto` does not overlap (no reduction crosses nodes).
                let overlaps = overlap == Overlap::On && !strategy.shards_params();
                assert_eq!(t.overlaps_units(), overlaps, "{strategy} {overlap}");
                let mut losses = vec![];
                for s in 0..steps {
                    let idx = sampler.indices(s);
                    let (x, loss) = CharLm::unit_io(&corpus, &idx, &device);
                    losses.push(t.step_units(x, loss).unwrap().loss);
                }
                (t.gather_params().unwrap(), losses)
            })
        })
        .collect();
    let mut out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    node.shutdown().unwrap();
    for o in &out[1..] {
        assert_eq!(o.0, out[0].0, "every rank gathers the same parameters");
    }
    out.swap_remove(0)
}

/// Checks `run(..)`'s parameters and per-step losses against the reference's within 1e-5.
fn assert_matches(reference: &(Vec<f32>, Vec<f32>), got: &(Vec<f32>, Vec<f32>), what: &str) {
    let worst = reference
        .0
        .iter()
        .zip(&got.0)
        .map(|(a, b)| (a - b).abs() / a.abs().max(1.0))
        .fold(0.0, f32::max);
    assert!(worst < 1e-5, "{what}: parameters differ by {worst}");
    for (a, b) in reference.1.iter().zip(&got.1) {
        assert!(((a - b) / a).abs() < 1e-5, "{what}: loss {a} vs {b}");
    }
}

#[test]
fn zero3_matches_single_rank_training_with_and_without_prefetch() {
    let one = run(Strategy::Ddp, 1, 1, Overlap::Off, 6);
    for (strategy, world, prefetch) in [
        (Strategy::Zero3, 1, 1),
        (Strategy::Zero3, 2, 1),
        (Strategy::Zero3, 3, 0),
        (Strategy::Zero3, 2, 2),
        (Strategy::Hsdp, 3, 1),
    ] {
        let got = run(strategy, world, prefetch, Overlap::Auto, 6);
        assert_matches(
            &one,
            &got,
            &format!("{strategy} world {world} prefetch {prefetch}"),
        );
    }
    assert!(one.1[5] < one.1[0], "it learns: {:?}", one.1);
}

/// Every strategy that otherwise steps the whole model gives the same parameters and losses
/// with its reductions overlapped unit by unit as without (the units become the buckets; each
/// unit keeps a graph of its own).
#[test]
fn overlapped_reductions_match_whole_model_steps_for_every_strategy() {
    let one = run(Strategy::Ddp, 1, 1, Overlap::Off, 6);
    for (strategy, world) in [
        (Strategy::Ddp, 1),
        (Strategy::Ddp, 2),
        (Strategy::Zero1, 3),
        (Strategy::Zero2, 2),
        (Strategy::Hybrid, 3),
    ] {
        let on = run(strategy, world, 1, Overlap::On, 6);
        assert_matches(&one, &on, &format!("{strategy} world {world} overlapped"));
        let off = run(strategy, world, 1, Overlap::Auto, 6);
        assert_matches(&one, &off, &format!("{strategy} world {world} whole"));
    }
}

#[derive(Module, Debug)]
struct Reversed {
    inner: crate::models::mlp::Mlp,
}

impl Units for Reversed {
    fn num_units(&self) -> usize {
        3
    }
    fn unit_of(&self, path: &str) -> usize {
        2 - self.inner.unit_of(path.trim_start_matches("inner."))
    }
    fn forward_unit(&self, unit: usize, x: Act) -> Act {
        self.inner.forward_unit(2 - unit, x)
    }
}

#[test]
fn a_unit_split_against_module_order_is_refused() {
    let device = Device::flex();
    let m = crate::models::mlp::Mlp::new(&device, 1);
    let layout = FlatLayout::of(&m);
    let r = unit_ranges(&m, &layout).unwrap();
    assert_eq!(r.len(), 3);
    assert_eq!(r[2].end, layout.total());
    let bad = Reversed { inner: m };
    let layout = FlatLayout::of(&bad);
    let err = unit_ranges(&bad, &layout).unwrap_err().to_string();
    assert!(
        err.contains("module order") && err.contains("inner.l2"),
        "{err}"
    );
}
