//! ZeRO-3 (FSDP): parameters, gradients and optimizer state sharded; a unit's full parameters
//! exist only while it runs.
//!
//! Forward: all-gather unit u (up to `prefetch` units ahead are in flight), write it into the
//! module, run it graph-free on the saved boundary activation, free it. The last unit stays
//! gathered and runs with autodiff together with the loss. Backward, last unit first:
//! re-gather (prefetched), recompute the unit from its saved input, backpropagate the
//! surrogate `sum(y * g)` (see [`crate::units`]), reduce-scatter the unit's gradient into this
//! rank's shard, free the unit. Then each rank steps its shard; nothing is gathered after the
//! update (the next forward gathers).
//!
//! HSDP is the same step with the scope of the two collectives narrowed ([`Reach`]): units are
//! gathered inside the node only and gradients reduced with the hybrid reduction, so a rank
//! owns its node shard of each unit and only the gradient reduction crosses nodes.

use super::{TrainError, Trainer, TrainerConfig};
use crate::clock::{Phase, StepClock};
use crate::error::ConfigError;
use crate::flat::{FlatEntry, FlatLayout};
use crate::strategy::Reach;
use crate::units::{Act, Units};
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Gradients, Tensor, TensorData};
use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;
use wiretrain_comm::{ProcessGroup, Work};

/// Unit ranges of the flat layout: unit `u` owns a contiguous run of entries, units in order.
pub(super) fn unit_ranges<M: Units>(
    model: &M,
    layout: &FlatLayout,
) -> Result<Vec<Range<usize>>, TrainError> {
    let n = model.num_units();
    if n == 0 {
        return Err(ConfigError::NoUnits.into());
    }
    let mut ranges: Vec<Option<Range<usize>>> = vec![None; n];
    let mut last = 0;
    for e in layout.entries() {
        let u = model.unit_of(&e.path);
        if u >= n {
            return Err(ConfigError::UnitOutOfRange {
                path: e.path.clone(),
                unit: u,
                units: n,
            }
            .into());
        }
        if u < last {
            return Err(ConfigError::UnitOrder {
                path: e.path.clone(),
                unit: u,
                previous: last,
            }
            .into());
        }
        last = u;
        let r = ranges[u].get_or_insert(e.offset..e.offset);
        r.end = e.offset + e.len;
    }
    // A unit without parameters (e.g. an activation) gets an empty range at its place.
    let mut at = 0;
    Ok(ranges
        .into_iter()
        .map(|r| {
            let r = r.unwrap_or(at..at);
            at = r.end;
            r
        })
        .collect())
}

/// Writes `values` (the unit's full flat parameters) into the module, or, with `None`, frees
/// the unit: each parameter becomes a one-element placeholder (same id, same rank).
fn set_unit<M: Module>(
    model: M,
    layout: &FlatLayout,
    unit: &Range<usize>,
    values: Option<&[f32]>,
) -> M {
    struct Set<'a> {
        entries: &'a [FlatEntry],
        index: usize,
        unit: &'a Range<usize>,
        values: Option<&'a [f32]>,
    }
    impl ModuleMapper for Set<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let e = &self.entries[self.index];
            self.index += 1;
            if !(e.offset >= self.unit.start && e.offset + e.len <= self.unit.end) || e.len == 0 {
                return param;
            }
            let (vals, shape) = match self.values {
                Some(v) => (
                    v[e.offset - self.unit.start..e.offset - self.unit.start + e.len].to_vec(),
                    e.shape.clone(),
                ),
                None => (vec![0.0], vec![1; D]),
            };
            param.map(|t| {
                let fresh = Tensor::<D>::from_data(TensorData::new(vals, shape), &t.device());
                if t.is_require_grad() {
                    fresh.require_grad()
                } else {
                    fresh
                }
            })
        }
    }
    model.map(&mut Set {
        entries: layout.entries(),
        index: 0,
        unit,
        values,
    })
}

/// Frees every unit (the module at rest under ZeRO-3).
pub(super) fn free_all<M: Module>(mut model: M, layout: &FlatLayout, units: &[Range<usize>]) -> M {
    for u in units {
        model = set_unit(model, layout, u, None);
    }
    model
}

/// Waits for `w` as `phase` (a unit gather or a gradient reduction).
fn timed<T>(clock: &StepClock, phase: Phase, w: Work<T>) -> Result<T, TrainError> {
    let _wait = clock.enter(phase, format!("wait {}", w.id()));
    Ok(w.wait()?)
}

impl<M: Units> Trainer<M> {
    /// Like [`Trainer::new`], for a model cut into [`Units`]; the only way to build a
    /// [`crate::strategy::Strategy::Zero3`] trainer. Fails when the unit split does not follow module order.
    pub fn with_units(
        model: M,
        device: &Device,
        cfg: TrainerConfig,
        pg: ProcessGroup,
    ) -> Result<Self, TrainError> {
        let layout = FlatLayout::of(&model);
        let units = unit_ranges(&model, &layout)?;
        if !cfg.strategy.shards_params() {
            return Self::build(model, device, cfg, pg, None);
        }
        Self::build(model, device, cfg, pg, Some((units, layout)))
    }

    /// One step of a unit model: `input` goes to unit 0, `loss_fn` turns the last unit's
    /// output into this rank's mean loss. Under ZeRO-3 the step runs unit by unit (module
    /// doc); under the other strategies it is [`Trainer::step`] on the units run in order.
    pub fn step_units(
        &mut self,
        input: Act,
        loss_fn: impl FnOnce(Act) -> Tensor<1>,
    ) -> Result<super::StepReport, TrainError> {
        if !self.cfg.strategy.shards_params() {
            return self.step(move |m| {
                let x = (0..m.num_units()).fold(input, |x, u| m.forward_unit(u, x));
                loss_fn(x)
            });
        }
        let clock = StepClock::since(Instant::now());
        self.sent_at_start = self.pg.bytes_sent();
        self.busy_at_start = self.pg.comm_busy();
        let units = self.held.buckets.clone();
        let reach = Reach::of(self.cfg.strategy.scope());
        // Offsets of each unit's share inside this rank's concatenated share vector.
        let mut at = 0;
        let shard_of: Vec<Range<usize>> = units
            .iter()
            .map(|u| {
                let s = at..at + reach.share(&self.pg, u.len());
                at = s.end;
                s
            })
            .collect();
        let pass = Pass {
            units,
            shard_of,
            reach,
            ahead: self.cfg.prefetch,
            clock: &clock,
        };
        let model = self.model.take().expect("model present between steps");
        let (model, fw) = self.forward_units(model, input, loss_fn, &pass)?;
        let loss = fw.loss;
        let (model, gshard) = self.backward_units(model, fw, &pass)?;
        // Compute is what the step did besides waiting for its collectives.
        let waited = clock.total(Phase::Comm) + clock.total(Phase::Gather);
        clock.add(Phase::Compute, clock.elapsed().saturating_sub(waited));
        let (mut cx, sync) = self.sync_cx(&clock);
        sync.update(&mut cx, &gshard, 1.0)?;
        self.finish_step(model, loss, &clock)
    }

    /// Starts gathering unit `u`'s full parameters from every rank's share.
    fn gather_unit(&mut self, p: &Pass<'_>, u: usize) -> Work<Vec<f32>> {
        let share = &self.held.params[p.shard_of[u].clone()];
        p.reach
            .gather(&mut self.pg, self.cfg.wire, share, p.units[u].len())
    }

    /// The forward pass, graph-free except the last unit: each unit gathered (up to
    /// `ahead` units in advance), run, and freed.
    fn forward_units(
        &mut self,
        mut model: M,
        input: Act,
        loss_fn: impl FnOnce(Act) -> Tensor<1>,
        p: &Pass<'_>,
    ) -> Result<(M, Forwarded), TrainError> {
        let n = p.units.len();
        let mut gathers: VecDeque<(usize, Work<Vec<f32>>)> = VecDeque::new();
        let mut next = 0usize;
        let mut loss_fn = Some(loss_fn);
        let mut saved: Vec<Act> = Vec::with_capacity(n);
        let mut x = Some(input);
        let mut last = None;
        for u in 0..n {
            let sp = crate::trace::span("issue gathers", "comm");
            while next < n && next <= u + p.ahead {
                let w = self.gather_unit(p, next);
                gathers.push_back((next, w));
                next += 1;
            }
            drop(sp);
            let (gu, w) = gathers.pop_front().expect("unit gather issued");
            debug_assert_eq!(gu, u);
            let full = timed(p.clock, Phase::Gather, w)?;
            let fwd = crate::trace::span(format!("forward unit {u}"), "compute");
            model = set_unit(model, &self.layout, &p.units[u], Some(&full));
            drop(full);
            let xin = x.take().expect("an input for every unit");
            if u + 1 < n {
                saved.push(xin.clone().detached());
                x = Some(model.forward_unit(u, xin).detached());
                drop(fwd);
                let _f = crate::trace::span(format!("free unit {u}"), "compute");
                model = set_unit(model, &self.layout, &p.units[u], None);
            } else {
                let leaf = xin.fresh_leaf();
                saved.push(xin);
                let loss_fn = loss_fn.take().expect("one loss");
                let loss = loss_fn(model.forward_unit(u, leaf.clone()));
                let value = loss.clone().into_scalar::<f32>();
                last = Some((leaf, value, loss.backward()));
            }
        }
        let (last_leaf, loss, grads) = last.expect("a model has at least one unit");
        Ok((
            model,
            Forwarded {
                saved,
                last_leaf,
                loss,
                grads,
            },
        ))
    }

    /// The backward pass, last unit first: each unit gathered again (up to `ahead` in
    /// advance, in reverse order), its forward recomputed on the saved input and backed
    /// through, its gradient flattened and reduce-scattered (one unit's reduction in flight
    /// while the next computes). Returns this rank's share of the gradient.
    fn backward_units(
        &mut self,
        mut model: M,
        fw: Forwarded,
        p: &Pass<'_>,
    ) -> Result<(M, Vec<f32>), TrainError> {
        let n = p.units.len();
        let Forwarded {
            mut saved,
            last_leaf,
            grads,
            ..
        } = fw;
        let mut grads_last = Some(grads);
        let owned_len: usize = self.held.owned.iter().map(|r| r.len()).sum();
        let mut gshard = vec![0.0f32; owned_len];
        let mut pending: Option<(usize, Work<Vec<f32>>)> = None;
        let mut back: VecDeque<(usize, Work<Vec<f32>>)> = VecDeque::new();
        let mut next_back = n.saturating_sub(1); // units below this still need a gather
        let mut g: Option<Act> = None;
        for u in (0..n).rev() {
            // Gathers for units u-1 .. u-ahead are in flight while unit u computes.
            let sp = crate::trace::span("issue gathers", "comm");
            while next_back > 0 && next_back + p.ahead > u {
                next_back -= 1;
                let w = self.gather_unit(p, next_back);
                back.push_back((next_back, w));
            }
            drop(sp);
            let sp =
                (u + 1 == n).then(|| crate::trace::span(format!("backward unit {u}"), "compute"));
            let grads = if u + 1 == n {
                let grads = grads_last.take().expect("the loss ran");
                g = last_leaf.grad(&grads);
                grads
            } else {
                let (gu, w) = back.pop_front().expect("unit gather issued");
                debug_assert_eq!(gu, u);
                let full = timed(p.clock, Phase::Gather, w)?;
                let _s = crate::trace::span(format!("backward unit {u}"), "compute");
                model = set_unit(model, &self.layout, &p.units[u], Some(&full));
                drop(full);
                let leaf = saved[u].fresh_leaf();
                let y = model.forward_unit(u, leaf.clone());
                let gin = g.take().ok_or(ConfigError::NoInputGradient(u + 1))?;
                let s = y.surrogate(&gin).ok_or(ConfigError::UnitOutput(u))?;
                let grads = s.backward();
                g = if u > 0 { leaf.grad(&grads) } else { None };
                grads
            };
            drop(sp);
            saved.truncate(u);
            let sf = crate::trace::span(format!("flatten unit {u}"), "compute");
            let mut gp = GradientsParams::from_grads(grads, &model);
            let mut flat = Vec::new();
            self.layout
                .flatten_grads(&mut gp, p.units[u].clone(), &mut flat);
            crate::strategy::weigh(&mut flat, self.sample_weight);
            drop(gp);
            drop(sf);
            let fr = crate::trace::span(format!("free unit {u}"), "compute");
            model = set_unit(model, &self.layout, &p.units[u], None);
            drop(fr);
            // One unit's reduce-scatter in flight while the next unit computes.
            if let Some((pu, w)) = pending.take() {
                let buf = timed(p.clock, Phase::Comm, w)?;
                p.reach
                    .take_share(&self.pg, &buf, &mut gshard[p.shard_of[pu].clone()]);
            }
            let _s = crate::trace::span("issue reduce", "comm");
            pending = Some((u, p.reach.reduce(&mut self.pg, self.cfg.wire, flat)));
        }
        if let Some((pu, w)) = pending.take() {
            let buf = timed(p.clock, Phase::Comm, w)?;
            p.reach
                .take_share(&self.pg, &buf, &mut gshard[p.shard_of[pu].clone()]);
        }
        Ok((model, gshard))
    }
}

/// What a ZeRO-3 step's two passes share: the units, where each unit's share sits in this
/// rank's share vector, where shards live, how far gathers run ahead, and the step's clock.
struct Pass<'a> {
    units: Vec<Range<usize>>,
    shard_of: Vec<Range<usize>>,
    reach: Reach,
    ahead: usize,
    clock: &'a StepClock,
}

/// The forward pass's result: every unit's input (detached), the last unit's input leaf, the
/// loss, and the last unit's gradients.
struct Forwarded {
    saved: Vec<Act>,
    last_leaf: Act,
    loss: f32,
    grads: Gradients,
}

#[cfg(test)]
mod tests {
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
                        DistributedSampler::new(corpus.len(), 12, pg.world(), pg.rank(), 5)
                            .unwrap();
                    let model = CharLmConfig::new(corpus.vocab_size())
                        .with_seq(16)
                        .with_d_model(16)
                        .with_d_ff(32)
                        .init(&device, 4);
                    let mut cfg = TrainerConfig::new(strategy);
                    cfg.prefetch = prefetch;
                    // SGD: the attention's key bias has a gradient that is zero in exact
                    // arithmetic; AdamW would turn its rounding noise (which depends on the
                    // summation order, hence on the world size) into full-size updates.
                    cfg.optim = crate::optim::OptimConfig::Sgd {
                        momentum: 0.9,
                        weight_decay: 0.0,
                    };
                    cfg.lr = 0.5;
                    let mut t = Trainer::with_units(model, &device, cfg, pg).unwrap();
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

    #[test]
    fn zero3_matches_single_rank_training_with_and_without_prefetch() {
        let (p1, l1) = run(Strategy::Ddp, 1, 1, 6);
        for (strategy, world, prefetch) in [
            (Strategy::Zero3, 1, 1),
            (Strategy::Zero3, 2, 1),
            (Strategy::Zero3, 3, 0),
            (Strategy::Zero3, 2, 2),
            (Strategy::Hsdp, 3, 1),
        ] {
            let (p, l) = run(strategy, world, prefetch, 6);
            let worst = p1
                .iter()
                .zip(&p)
                .map(|(a, b)| (a - b).abs() / a.abs().max(1.0))
                .fold(0.0, f32::max);
            assert!(
                worst < 1e-5,
                "{strategy} world {world} prefetch {prefetch}: {worst}"
            );
            for (a, b) in l1.iter().zip(&l) {
                assert!(((a - b) / a).abs() < 1e-5, "loss {a} vs {b}");
            }
        }
        assert!(l1[5] < l1[0], "it learns: {l1:?}");
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
}
