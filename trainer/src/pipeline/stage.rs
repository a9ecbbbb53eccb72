//! One stage of a pipeline ([`PipelineTrainer`]): its units, its parameters' flat range and
//! optimizer, and the step that runs its schedule (see the parent module).

use super::schedule::{self, Op};
use super::{PipelineConfig, PipelineError, Placement, wire};
use crate::engine::{TrainError, check_agreement, unit_ranges};
use crate::flat::FlatLayout;
use crate::optim::{ShardOptimizer, StepOpts};
use crate::transfer;
use crate::units::{Act, Units};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;
use wiretrain_comm::{CallOpts, ProcessGroup, ReduceOp, Work};

/// What one pipeline step did on this stage (the loss is the same on every stage).
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineReport {
    /// The mean loss over the step's micro-batches (computed on the last stage).
    pub loss: f32,
    /// This stage's wall time for the step, in milliseconds.
    pub step_ms: f64,
    /// Of it, the time this stage computed (forwards, backwards, its optimizer step).
    pub busy_ms: f64,
    /// The most micro-batches whose activations this stage held at once.
    pub peak_in_flight: usize,
}

/// The output a forward pass keeps for its backward.
enum Kept {
    /// A stage before the last: its output, whose gradient comes back.
    Out(Act),
    /// The last stage: the micro-batch's mean loss.
    Loss(Tensor<1>),
}

/// What one step carries between its forwards and backwards.
#[derive(Default)]
struct StepState {
    /// Per micro-batch in flight: its input (a leaf past the first stage) and what its
    /// backward starts from.
    kept: HashMap<usize, (Act, Kept)>,
    /// The step's sends, waited for at its end.
    sends: Vec<Work<()>>,
    /// The sum of the micro-batches' gradients of this stage's parameters, on the device.
    acc: Option<Tensor<1>>,
    /// Seconds spent computing.
    busy: f64,
    /// The last stage: the sum of the micro-batches' mean losses.
    loss_sum: f32,
    /// The most micro-batches in flight.
    peak: usize,
}

/// One rank's stage of a pipeline over a [`Units`] model.
pub struct PipelineTrainer<M: Units> {
    model: Option<M>,
    layout: FlatLayout,
    pg: ProcessGroup,
    cfg: PipelineConfig,
    placement: Placement,
    stage: usize,
    replica: usize,
    /// The ranks of the previous and next stage in this replica.
    prev: Option<usize>,
    next: Option<usize>,
    units: Range<usize>,
    /// The flat range of this stage's parameters.
    range: Range<usize>,
    /// The whole flat vector as this stage knows it (its own range current).
    params: Vec<f32>,
    opt: ShardOptimizer,
    device: Device,
}

impl<M: Units> PipelineTrainer<M> {
    /// Joins the pipeline as the stage and replica its [`Placement`] gives `pg.rank()`: checks
    /// the configuration against the model and the world, agrees with every rank on the
    /// model, and takes rank 0's parameters (a collective).
    pub fn new(
        model: M,
        device: &Device,
        cfg: PipelineConfig,
        mut pg: ProcessGroup,
    ) -> Result<Self, TrainError> {
        let layout = FlatLayout::of(&model);
        let unit_flat = unit_ranges(&model, &layout)?;
        let cut = cfg.cut(unit_flat.len(), pg.world()).map_err(config)?;
        check_agreement(&mut pg, &layout)?;
        let params = pg.broadcast(layout.flatten_params(&model), 0).wait()?;
        let model = layout.unflatten(model, &params);
        let placement = Placement::choose(cfg.stages, pg.table()).map_err(config)?;
        let (stage, replica) = placement.locate(pg.table(), pg.rank());
        let at = |s: usize| placement.rank_of(pg.table(), s, replica);
        let prev = stage.checked_sub(1).map(at);
        let next = (stage + 1 < cfg.stages).then(|| at(stage + 1));
        if pg.rank() == 0 {
            tracing::info!("pipeline placement: {}", placement.describe());
        }
        let units = cut[stage].clone();
        let range = unit_flat[units.start].start..unit_flat[units.end - 1].end;
        let opt = ShardOptimizer::new(&cfg.optim, device.clone(), range.len(), None);
        Ok(Self {
            model: Some(model),
            layout,
            pg,
            cfg,
            placement,
            stage,
            replica,
            prev,
            next,
            units,
            range,
            params,
            opt,
            device: device.clone(),
        })
    }

    /// This rank's stage (0 runs the first units).
    pub fn stage(&self) -> usize {
        self.stage
    }

    /// This rank's replica of the pipeline (0 to [`Self::replicas`] - 1): which share of the
    /// global batch it trains on.
    pub fn replica(&self) -> usize {
        self.replica
    }

    /// Replicas of the pipeline (the world over the stages).
    pub fn replicas(&self) -> usize {
        self.pg.world() / self.cfg.stages
    }

    /// Which ranks form which stage, and why.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The units this stage runs.
    pub fn units(&self) -> Range<usize> {
        self.units.clone()
    }

    /// The model as this stage holds it: its own units current, the others' as they were at
    /// the start.
    pub fn model(&self) -> &M {
        self.model.as_ref().expect("model present between steps")
    }

    /// Every stage's parameters, the full flat vector, on every rank (a collective).
    pub fn gather_params(&mut self) -> Result<Vec<f32>, TrainError> {
        let mut mine = vec![0.0; self.params.len()];
        if self.replica == 0 {
            mine[self.range.clone()].copy_from_slice(&self.params[self.range.clone()]);
        }
        Ok(self.pg.all_reduce(mine, ReduceOp::Sum).wait()?)
    }

    /// One step over the configured micro-batches: `input(i)` is micro-batch `i`'s input to
    /// the first unit (called on the first stage only); `loss(i, out)` turns the last unit's
    /// output for micro-batch `i` into its mean loss (on the last stage only). Every stage
    /// calls it once per step.
    ///
    /// A stage that fails fails the job at once (its neighbours' waiting receives end with
    /// its reason), as a failed collective does.
    pub fn step(
        &mut self,
        input: impl FnMut(usize) -> Act,
        loss: impl FnMut(usize, Act) -> Tensor<1>,
    ) -> Result<PipelineReport, TrainError> {
        let r = self.run_step(input, loss);
        if let Err(e) = &r
            && !matches!(e, TrainError::Comm(_))
        {
            // A communication error failed the node already; anything else does now.
            let why = format!("pipeline stage {}: {e}", self.stage);
            self.pg.aborter().abort(&why);
        }
        r
    }

    fn run_step(
        &mut self,
        mut input: impl FnMut(usize) -> Act,
        mut loss: impl FnMut(usize, Act) -> Tensor<1>,
    ) -> Result<PipelineReport, TrainError> {
        let t0 = Instant::now();
        let (s, stages, m) = (self.stage, self.cfg.stages, self.cfg.micro_batches);
        let mut st = StepState::default();
        for op in schedule::ops(self.cfg.schedule, s, stages, m) {
            match op {
                Op::Forward(i) => self.forward(i, &mut st, &mut input, &mut loss)?,
                Op::Backward(i) => self.backward(i, &mut st)?,
            }
        }
        let t = Instant::now();
        self.update(st.acc.take())?;
        st.busy += t.elapsed().as_secs_f64();
        for w in st.sends {
            w.wait()?;
        }
        // Each last-stage replica's mean over its share; the mean of the replicas' means.
        let r = self.replicas() as f32;
        let mine = if s + 1 == stages {
            st.loss_sum / m as f32 / r
        } else {
            0.0
        };
        let loss = self.pg.all_reduce(vec![mine], ReduceOp::Sum).wait()?[0];
        Ok(PipelineReport {
            loss,
            step_ms: t0.elapsed().as_secs_f64() * 1e3,
            busy_ms: st.busy * 1e3,
            peak_in_flight: st.peak,
        })
    }

    /// Micro-batch `i`'s forward: its input (the batch's, or the previous stage's output),
    /// this stage's units, then the loss (last stage) or a send to the next stage.
    fn forward(
        &mut self,
        i: usize,
        st: &mut StepState,
        input: &mut impl FnMut(usize) -> Act,
        loss: &mut impl FnMut(usize, Act) -> Tensor<1>,
    ) -> Result<(), TrainError> {
        let (s, last) = (self.stage, self.stage + 1 == self.cfg.stages);
        let x = match s {
            0 => input(i),
            _ => self.recv_act(self.prev, 4 * i as u64)?.fresh_leaf(),
        };
        let t = Instant::now();
        let model = self.model();
        let y = self
            .units
            .clone()
            .fold(x.clone(), |a, u| model.forward_unit(u, a));
        let out = if last {
            let l = loss(i, y);
            st.loss_sum += transfer::read_scalar(l.clone().detach()).map_err(read)?;
            st.busy += t.elapsed().as_secs_f64();
            Kept::Loss(l)
        } else {
            st.busy += t.elapsed().as_secs_f64();
            st.sends
                .extend(self.send_act(&y.clone().detached(), self.next, 4 * i as u64)?);
            Kept::Out(y)
        };
        st.kept.insert(i, (x, out));
        st.peak = st.peak.max(st.kept.len());
        Ok(())
    }

    /// Micro-batch `i`'s backward: from its loss (last stage, scaled by 1 / M) or from the
    /// gradient the next stage sends back; the input's gradient goes to the previous stage,
    /// the parameters' joins the step's sum.
    fn backward(&mut self, i: usize, st: &mut StepState) -> Result<(), TrainError> {
        let (s, m) = (self.stage, self.cfg.micro_batches);
        let (x, out) = st.kept.remove(&i).expect("the schedule ran its forward");
        let surrogate = match out {
            Kept::Loss(l) => l * (1.0 / m as f32),
            Kept::Out(y) => {
                let g = self.recv_act(self.next, 4 * i as u64 + 2)?;
                y.surrogate(&g).ok_or_else(|| {
                    config(PipelineError::Activation(
                        "the gradient does not match the stage's output".into(),
                    ))
                })?
            }
        };
        let t = Instant::now();
        let grads = surrogate.backward();
        if s > 0 {
            let gx = x.grad(&grads).unwrap_or_else(|| x.zeros_like());
            st.busy += t.elapsed().as_secs_f64();
            st.sends
                .extend(self.send_act(&gx, self.prev, 4 * i as u64 + 2)?);
        }
        let t = Instant::now();
        let mut gp = GradientsParams::from_grads(grads, self.model());
        if !self.range.is_empty() {
            let g = self
                .layout
                .grads_device(&mut gp, self.range.clone(), &self.device);
            st.acc = Some(match st.acc.take() {
                Some(a) => a + g,
                None => g,
            });
        }
        st.busy += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Steps this stage's parameters with the summed gradient `acc` (the micro-batches' mean,
    /// each loss having been scaled by 1 / M) and puts them back into the model.
    fn update(&mut self, acc: Option<Tensor<1>>) -> Result<(), TrainError> {
        let Some(acc) = acc else {
            return Ok(());
        };
        let mut grad = transfer::read_f32(acc).map_err(read)?;
        if let Some(g) = self.placement.replica_group() {
            // The stage's replicas trained on their own shares: their mean is the stage's.
            let opts = CallOpts::default().on(g).tag("pipeline grads");
            grad = self.pg.call(opts).all_reduce(grad, ReduceOp::Mean).wait()?;
        }
        let lr = self.cfg.lr;
        self.opt.step_with(
            lr,
            &mut self.params[self.range.clone()],
            &grad,
            StepOpts::default(),
        )?;
        let model = self.model.take().expect("model present between steps");
        self.model = Some(self.layout.unflatten(model, &self.params));
        Ok(())
    }

    /// Sends `act` to rank `to` (a neighbour stage's): its header (tag `tag`) and its
    /// elements (tag `tag + 1`).
    fn send_act(
        &mut self,
        act: &Act,
        to: Option<usize>,
        tag: u64,
    ) -> Result<[Work<()>; 2], TrainError> {
        let to = to.expect("the schedule sends only to a neighbour stage");
        let (header, data) = wire::encode(act).map_err(config)?;
        Ok([
            self.pg.send(header, to, tag),
            self.pg.send(data, to, tag + 1),
        ])
    }

    /// Receives the activation rank `from` sent with [`Self::send_act`] at `tag`.
    fn recv_act(&mut self, from: Option<usize>, tag: u64) -> Result<Act, TrainError> {
        let from = from.expect("the schedule receives only from a neighbour stage");
        let header = self.pg.recv(wire::HEADER_LEN, from, tag).wait()?;
        let n = wire::data_len(&header).map_err(config)?;
        let data = self.pg.recv(n, from, tag + 1).wait()?;
        wire::decode(&header, data, &self.device).map_err(config)
    }
}

fn config(e: PipelineError) -> TrainError {
    TrainError::Pipeline(e)
}

fn read(e: burn::tensor::TensorReadError) -> TrainError {
    TrainError::Pipeline(PipelineError::Activation(e.to_string()))
}
