//! Unit-by-unit steps of a model cut into [`Units`]: ZeRO-3 and HSDP, whose units exist in
//! full only while they run, and DDP, ZeRO-1/2 and hybrid with overlap ([`Overlap`]), whose
//! units are all there but whose gradient reductions start unit by unit during backward.
//!
//! Forward: each unit runs on the previous unit's output, cut from its graph, so every unit
//! has a graph of its own. Under stage 3, unit u is first all-gathered (up to `prefetch` units
//! ahead are in flight) and written into the module, runs graph-free, and is freed; under
//! stages 0-2 its graph is kept, from a leaf at its input. The last unit runs with autodiff
//! together with the loss. Backward, last unit first: stage 3 re-gathers the unit
//! (prefetched) and recomputes it from its saved input; then the surrogate `sum(y * g)` (see
//! [`crate::units`]) is backpropagated through the unit's graph, and the reduction of its
//! gradient issued at once (a mean all-reduce for DDP, a reduce-scatter into this rank's
//! shard otherwise), so it travels while the next unit's backward runs. One unit's
//! reduction is in flight at a time, bounding the gradients held to two units. Then each rank
//! steps what it owns; under stages 0-2 it gathers as after a whole-model step. Only stage 3
//! recomputes: stages 0-2 keep the activations a whole-model step keeps.
//!
//! HSDP is the same step with the scope of the two collectives narrowed ([`Reach`]): units are
//! gathered inside the node only and gradients reduced with the hybrid reduction, so a rank
//! owns its node shard of each unit and only the gradient reduction crosses nodes.

use super::{Overlap, TrainError, Trainer, TrainerConfig};
use crate::clock::{Phase, StepClock};
use crate::error::ConfigError;
use crate::flat::{FlatEntry, FlatLayout, buffers};
use crate::strategy::{Grad, Reach};
use crate::units::{Act, Units};
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Gradients, Tensor};
use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;
use wiretrain_comm::{ProcessGroup, Work};

/// Unit ranges of the flat layout: unit `u` owns a contiguous run of entries, units in order.
pub(crate) fn unit_ranges<M: Units>(
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

/// The effective number of units for the planner: `(Σ size)² / Σ size²` over the units'
/// parameter counts, as many equal units as overlap the way these do (2.1 for two big blocks
/// and two small ends; 1 for one unit holding everything).
pub fn effective_units(ranges: &[Range<usize>]) -> f64 {
    let (sum, sq) = ranges.iter().fold((0.0f64, 0.0f64), |(s, q), r| {
        let n = r.len() as f64;
        (s + n, q + n * n)
    });
    if sq > 0.0 { sum * sum / sq } else { 1.0 }
}

/// Writes `values` (the unit's full flat parameters) into the module, or, with `None`, frees
/// the unit: each parameter becomes a one-element placeholder (same id, same rank). The
/// values go up once (one upload for the unit); each parameter is a slice of it on the device.
fn set_unit<M: Module>(
    model: M,
    layout: &FlatLayout,
    unit: &Range<usize>,
    values: Option<(&[f32], &Device)>,
) -> M {
    struct Set<'a> {
        entries: &'a [FlatEntry],
        index: usize,
        unit: &'a Range<usize>,
        values: Option<Tensor<1>>,
    }
    impl ModuleMapper for Set<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            // Non-trained state is not in the layout (flat::buffers).
            if crate::flat::buffers::is_buffer(&param) {
                return param;
            }
            let e = &self.entries[self.index];
            self.index += 1;
            if !(e.offset >= self.unit.start && e.offset + e.len <= self.unit.end) || e.len == 0 {
                return param;
            }
            let at = e.offset - self.unit.start;
            let values = self.values.clone();
            param.map(|t| {
                let fresh: Tensor<D> = match values {
                    Some(v) => v.slice(at..at + e.len).reshape(dims::<D>(&e.shape)),
                    None => Tensor::zeros([1; D], &t.device().inner()),
                };
                let fresh = if t.is_autodiff() {
                    fresh.autodiff()
                } else {
                    fresh
                };
                if t.is_require_grad() {
                    fresh.require_grad()
                } else {
                    fresh
                }
            })
        }
    }
    let values = values.map(|(v, device)| crate::transfer::upload(v.to_vec(), device));
    model.map(&mut Set {
        entries: layout.entries(),
        index: 0,
        unit,
        values,
    })
}

impl<M: Module> Trainer<M> {
    /// The model with every parameter in full, on every rank: what to evaluate, export or
    /// hand to Burn after training. Under ZeRO-3 and HSDP the model held at rest has
    /// one-element placeholders (what [`Trainer::into_model`] returns there); this gathers the
    /// f32 masters (a collective: every rank calls it) and writes them in. Otherwise the same
    /// as `into_model`.
    pub fn into_full_model(mut self) -> Result<M, TrainError> {
        if !self.cfg.strategy.shards_params() {
            return Ok(self.into_model());
        }
        let params = self.gather_params()?;
        let model = self.model.take().expect("model present between steps");
        let all = 0..self.layout.total();
        let model = set_unit(model, &self.layout, &all, Some((&params, &self.device)));
        // Folds a RunningState's pending update into its value, as `into_model` does.
        drop(model.valid());
        Ok(model)
    }
}

/// `shape` as the dimensions of a rank-`D` tensor (the layout recorded it from one).
fn dims<const D: usize>(shape: &[usize]) -> [usize; D] {
    let mut d = [1; D];
    d.copy_from_slice(shape);
    d
}

/// Frees every unit (the module at rest under ZeRO-3).
/// `model` with unit `unit`'s parameters replaced by placeholders (its memory freed).
pub(super) fn free_unit<M: Module>(model: M, layout: &FlatLayout, unit: &Range<usize>) -> M {
    set_unit(model, layout, unit, None)
}

/// Waits for `w` as `phase` (a unit gather or a gradient reduction).
fn timed<T>(clock: &StepClock, phase: Phase, w: Work<T>) -> Result<T, TrainError> {
    let _wait = clock.enter(phase, format!("wait {}", w.id()));
    Ok(w.wait()?)
}

impl<M: Units> Trainer<M> {
    /// Like [`Trainer::new`], for a model cut into [`Units`]; the only way to build a
    /// ZeRO-3 or HSDP trainer, and the way to overlap gradient reductions with backward
    /// under the other strategies ([`Overlap`]: `auto` overlaps when the reduction crosses
    /// nodes; then the units are the buckets). Fails when the unit split does not follow
    /// module order.
    pub fn with_units(
        model: M,
        device: &Device,
        cfg: TrainerConfig,
        pg: ProcessGroup,
    ) -> Result<Self, TrainError> {
        let layout = FlatLayout::of(&model);
        let units = unit_ranges(&model, &layout)?;
        let effective = effective_units(&units);
        let overlap = match cfg.overlap {
            // DiLoCo's inner reductions stay in the node: nothing to hide (as planned).
            Overlap::On => cfg.diloco.is_none(),
            Overlap::Off => false,
            Overlap::Auto => pg.table().nodes().len() > 1 && cfg.diloco.is_none(),
        };
        let mut t = if !cfg.strategy.shards_params() && !overlap {
            Self::build(model, device, cfg, pg, None)?
        } else {
            Self::build(model, device, cfg, pg, Some((units, layout)))?
        };
        t.units_effective = Some(effective);
        Ok(t)
    }

    /// [`effective_units`] of a unit model (before building a trainer, e.g. to plan).
    pub fn effective_units_of(model: &M) -> Result<f64, TrainError> {
        let layout = FlatLayout::of(model);
        Ok(effective_units(&unit_ranges(model, &layout)?))
    }

    /// One step of a unit model: `input` goes to unit 0, `loss_fn` turns the last unit's
    /// output into this rank's mean loss. Under ZeRO-3 the step runs unit by unit (module
    /// doc); under the other strategies it is [`Trainer::step`] on the units run in order.
    pub fn step_units(
        &mut self,
        input: Act,
        loss_fn: impl FnOnce(Act) -> Tensor<1>,
    ) -> Result<super::StepReport, TrainError> {
        let sharded = self.cfg.strategy.shards_params();
        if !sharded && !self.unit_overlap {
            return self.step(move |m| {
                let x = (0..m.num_units()).fold(input, |x, u| m.forward_unit(u, x));
                loss_fn(x)
            });
        }
        let clock = StepClock::since(Instant::now());
        self.begin_counters();
        let pass = Pass {
            units: self.held.buckets.clone(),
            sharded,
            reach: Reach::of(self.cfg.strategy.scope()),
            ahead: self.cfg.prefetch,
            clock: &clock,
        };
        let model = self.model.take().expect("model present between steps");
        // The module of the last step is kept (handles, not copies of the tensors; at rest
        // under stage 3, placeholders): a step cut off by a lost node leaves the trainer
        // whole, and a heal goes on.
        let kept = model.clone();
        let (model, loss) = match self.unit_pass(model, input, loss_fn, &pass) {
            Ok(v) => v,
            Err(e) => {
                self.held.dev = None;
                self.model = Some(kept);
                return Err(e);
            }
        };
        let model = if sharded {
            model
        } else {
            let _u = clock.enter(Phase::Compute, "unflatten");
            self.model_after_update(model)
        };
        self.finish_step(model, loss, &clock)
    }

    /// The unit-by-unit passes and the update of [`Trainer::step_units`]: the module back and
    /// this rank's loss.
    fn unit_pass(
        &mut self,
        model: M,
        input: Act,
        loss_fn: impl FnOnce(Act) -> Tensor<1>,
        pass: &Pass<'_>,
    ) -> Result<(M, f32), TrainError> {
        let (model, fw) = self.forward_units(model, input, loss_fn, pass)?;
        let loss = fw.loss;
        let (model, grad) = self.backward_units(model, fw, pass)?;
        // Compute is what the step did besides waiting for its collectives.
        let clock = pass.clock;
        let waited = clock.total(Phase::Comm) + clock.total(Phase::Gather);
        clock.add(Phase::Compute, clock.elapsed().saturating_sub(waited));
        if !pass.sharded {
            self.params_to_update(&model);
        }
        self.step_mem.sample(&self.device);
        let (mut cx, sync) = self.sync_cx(clock);
        sync.update(&mut cx, Grad::Host(grad), 1.0)?;
        Ok((model, loss))
    }

    /// Stage 3: makes unit `u` (the next of `g`'s order) whole in the module, issuing the
    /// gathers up to `count` units of the order first. A no-op under stages 0-2.
    fn load_unit(
        &mut self,
        model: M,
        p: &Pass<'_>,
        g: &mut Gathers,
        u: usize,
        count: usize,
    ) -> Result<M, TrainError> {
        if !p.sharded {
            return Ok(model);
        }
        self.issue_gathers(p, g, count);
        let (gu, w) = g.queue.pop_front().expect("unit gather issued");
        debug_assert_eq!(gu, u);
        let full = timed(p.clock, Phase::Gather, w)?;
        let _s = crate::trace::span(format!("load unit {u}"), "compute");
        Ok(set_unit(
            model,
            &self.layout,
            &p.units[u],
            Some((&full, &self.device)),
        ))
    }

    /// Stage 3: issues the gathers of `g`'s order up to its first `count` units.
    fn issue_gathers(&mut self, p: &Pass<'_>, g: &mut Gathers, count: usize) {
        if !p.sharded {
            return;
        }
        let _sp = crate::trace::span("issue gathers", "comm");
        while g.next < g.order.len().min(count) {
            let v = g.order[g.next];
            let share = &self.held.params[self.held.owned_at(v)];
            let w = p
                .reach
                .gather(&mut self.pg, self.cfg.wire, share, p.units[v].len());
            g.queue.push_back((v, w));
            g.next += 1;
        }
    }

    /// Stage 3: frees unit `u` in the module. A no-op under stages 0-2.
    fn unload_unit(&self, model: M, p: &Pass<'_>, u: usize) -> M {
        if !p.sharded {
            return model;
        }
        let _f = crate::trace::span(format!("free unit {u}"), "compute");
        set_unit(model, &self.layout, &p.units[u], None)
    }

    /// The forward pass, graph-free except the last unit: each unit loaded (stage 3: up to
    /// `ahead` units gathered in advance), run, and freed.
    fn forward_units(
        &mut self,
        mut model: M,
        input: Act,
        loss_fn: impl FnOnce(Act) -> Tensor<1>,
        p: &Pass<'_>,
    ) -> Result<(M, Forwarded), TrainError> {
        let n = p.units.len();
        let mut gathers = Gathers::new((0..n).collect());
        let mut saved: Vec<Saved> = Vec::with_capacity(n);
        let mut x = input;
        for u in 0..n - 1 {
            model = self.load_unit(model, p, &mut gathers, u, u + p.ahead + 1)?;
            let fwd = crate::trace::span(format!("forward unit {u}"), "compute");
            if p.sharded {
                saved.push(Saved {
                    input: x.clone().detached(),
                    out: None,
                });
                x = model.forward_unit(u, x).detached();
            } else {
                // The unit's own graph, from a leaf at its input: its backward runs alone.
                let leaf = x.fresh_leaf();
                let out = model.forward_unit(u, leaf.clone());
                x = out.clone().detached();
                saved.push(Saved {
                    input: leaf,
                    out: Some(out),
                });
            }
            drop(fwd);
            model = self.unload_unit(model, p, u);
        }
        model = self.load_unit(model, p, &mut gathers, n - 1, n)?;
        let _fwd = crate::trace::span(format!("forward unit {}", n - 1), "compute");
        let last_leaf = x.fresh_leaf();
        let loss = loss_fn(model.forward_unit(n - 1, last_leaf.clone()));
        let value = super::read_loss(loss.clone())?;
        let fw = Forwarded {
            saved,
            last_leaf,
            loss: value,
            grads: loss.backward(),
        };
        Ok((model, fw))
    }

    /// The backward pass, last unit first: each unit loaded again (stage 3: up to `ahead` in
    /// advance, in reverse order) and recomputed on its saved input, then backed
    /// through, its gradient flattened and its reduction issued (one unit's reduction in
    /// flight while the next computes). Returns this rank's owned gradient.
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
        let mut grad = vec![0.0f32; self.held.owned_len()];
        let mut pending: Option<(usize, Work<Vec<f32>>)> = None;
        // The last unit stays loaded from the forward pass.
        let mut gathers = Gathers::new((0..n - 1).rev().collect());
        let mut g = last_leaf.grad(&grads);
        let mut grads = Some(grads);
        for u in (0..n).rev() {
            if u + 1 < n {
                let (leaf, y) = match saved.pop().expect("a saved entry per unit") {
                    Saved {
                        input,
                        out: Some(out),
                    } => (input, out),
                    Saved { input, out: None } => {
                        let ahead = n - 1 - u + p.ahead;
                        model = self.load_unit(model, p, &mut gathers, u, ahead)?;
                        let _r = crate::trace::span(format!("recompute unit {u}"), "compute");
                        let leaf = input.fresh_leaf();
                        // The recompute must not advance module state (BatchNorm's running
                        // statistics) a second time: it is put back as the forward left it.
                        let state = self.has_buffers.then(|| buffers::read(&model)).flatten();
                        let y = model.forward_unit(u, leaf.clone());
                        if let Some(state) = state {
                            drop(model.valid());
                            model = buffers::write(model, state);
                        }
                        (leaf, y)
                    }
                };
                let _s = crate::trace::span(format!("backward unit {u}"), "compute");
                let gin = g.take().ok_or(ConfigError::NoInputGradient(u + 1))?;
                let s = y.surrogate(&gin).ok_or(ConfigError::UnitOutput(u))?;
                let unit_grads = s.backward();
                g = if u > 0 { leaf.grad(&unit_grads) } else { None };
                grads = Some(unit_grads);
            } else {
                // Gathers for the units below are in flight while the last unit's
                // gradient is flattened.
                self.issue_gathers(p, &mut gathers, p.ahead);
            }
            let sf = crate::trace::span(format!("flatten unit {u}"), "compute");
            let mut gp = GradientsParams::from_grads(grads.take().expect("a backward ran"), &model);
            let crosses = self.sync.reach().crosses_nodes(&self.pg);
            let narrow = (self.cfg.device_resident && crosses).then_some(self.cfg.wire);
            let flat = self.layout.read_grads(
                &mut gp,
                p.units[u].clone(),
                &self.device,
                self.sample_weight,
                narrow,
            );
            drop(gp);
            drop(sf);
            model = self.unload_unit(model, p, u);
            // One unit's reduction in flight while the next unit computes.
            self.settle(p.clock, &mut pending, &mut grad)?;
            if !flat.is_empty() {
                let _s = crate::trace::span("issue reduce", "comm");
                let (mut cx, sync) = self.sync_cx(p.clock);
                pending = Some((u, sync.issue(&mut cx, flat)));
            }
        }
        self.settle(p.clock, &mut pending, &mut grad)?;
        Ok((model, grad))
    }

    /// Waits for the reduction in flight, if any, and keeps this rank's part of it in `grad`.
    fn settle(
        &mut self,
        clock: &StepClock,
        pending: &mut Option<(usize, Work<Vec<f32>>)>,
        grad: &mut [f32],
    ) -> Result<(), TrainError> {
        if let Some((b, w)) = pending.take() {
            let buf = timed(clock, Phase::Comm, w)?;
            let (cx, sync) = self.sync_cx(clock);
            sync.place(&cx, b, &buf, grad);
        }
        Ok(())
    }
}

/// Stage 3's unit gathers: the units in the order a pass loads them, how many of them are
/// issued, and those in flight.
struct Gathers {
    order: Vec<usize>,
    next: usize,
    queue: VecDeque<(usize, Work<Vec<f32>>)>,
}

impl Gathers {
    fn new(order: Vec<usize>) -> Self {
        Self {
            order,
            next: 0,
            queue: VecDeque::new(),
        }
    }
}

/// What a unit-by-unit step's two passes share: the units, whether they are sharded (stage
/// 3: gathered to run, freed after), where shards live, how far gathers run ahead, and the
/// step's clock.
struct Pass<'a> {
    units: Vec<Range<usize>>,
    sharded: bool,
    reach: Reach,
    ahead: usize,
    clock: &'a StepClock,
}

/// What the backward pass needs of a unit (but the last) from the forward pass: under stage 3
/// its input, detached (the backward recomputes the unit from it; `out` is `None`); under
/// stages 0-2 its graph, from the leaf at its input to its output.
struct Saved {
    input: Act,
    out: Option<Act>,
}

/// The forward pass's result: what the backward needs of each unit but the last, the last
/// unit's input leaf, the loss, and the last unit's gradients.
struct Forwarded {
    saved: Vec<Saved>,
    last_leaf: Act,
    loss: f32,
    grads: Gradients,
}

#[cfg(test)]
mod tests;
