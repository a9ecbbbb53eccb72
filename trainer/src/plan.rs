//! `wiretrain plan`: what fits and how fast it goes, per strategy, before renting a cluster.
//!
//! Pure arithmetic, every assumption written down (also in docs/WIRING.md):
//! - **Memory** (the ZeRO paper's model-state accounting, GB = 1e9 bytes): mixed precision holds
//!   2 bytes of parameters, 2 of gradients and K = 12 of optimizer state (f32 master, m, v) per
//!   parameter; f32 holds 4 + 4 + 8. DDP keeps all of it on every device; ZeRO-1 shards the
//!   optimizer state over the N devices, ZeRO-2 also the gradients, ZeRO-3 also the parameters;
//!   hybrid is ZeRO-2 inside a node (shards over the g devices of a node), replicated across
//!   nodes. Activations (when a transformer shape is given) follow Korthikanti et al.:
//!   `s·b·h·(34 + 5·a·s/h)` bytes per layer at 16 bits, or `2·s·b·h` per layer with full
//!   recomputation; scaled by 2 for f32. Temporary buffers and fragmentation are not counted.
//! - **Communication** follows wiretrain's hierarchical collectives: a reduce-scatter or
//!   all-gather of Ψ elements over N = n·g devices moves Ψ(g−1)/g per device over the intra-node
//!   link and Ψ(n−1)/(n·g) per device across nodes (one ring per local rank, the g lanes of a
//!   node sharing its network link). DDP, ZeRO-1 and ZeRO-2 run one reduce-scatter and one
//!   all-gather (an all-reduce) per step — volume 2Ψ; ZeRO-3 gathers the parameters twice
//!   (forward, backward) and reduce-scatters the gradients — 3Ψ; hybrid does its two inside the
//!   node and all-reduces each device's Ψ/g piece across nodes; HSDP is ZeRO-3 inside the
//!   node (3Ψ there) with hybrid's traffic across nodes. Time per link level is α–β:
//!   `steps·α + bytes/β`.
//! - **DiLoCo** (rows added with an inner-step count H): inner steps all-reduce (ddp) or
//!   reduce-scatter and gather (hybrid) inside the node only; every H steps the parameter
//!   deltas are all-reduced over every device, as DDP's gradients are: per step, the inner
//!   strategy's node traffic plus 1/H of DDP's. Memory: the inner strategy's, plus the f32
//!   anchor and outer momentum (8 bytes per parameter). Its effect on the loss is not
//!   predicted (it changes the optimization): such rows are recommended only when allowed.
//! - **Compute**: 6·Ψ FLOPs per token (8·Ψ with recomputation) at the device's achieved TFLOP/s.
//!   ZeRO-3 and HSDP always recompute: wiretrain runs them unit by unit, recomputing each
//!   unit's forward in the backward pass (their activations are counted recomputed too).
//! - **Overlap**, as wiretrain runs it: `step = compute + max(exposed, comm − compute)`. A
//!   strategy that runs unit by unit issues each unit's gradient reduction as soon as the
//!   unit's backward is done, hiding the reductions behind the backward pass (2/3 of compute,
//!   3/4 with recomputation): ZeRO-3 and HSDP always, DDP, ZeRO-1/2 and hybrid with
//!   `--overlap` (on by default across nodes). The reduction is all of DDP's communication,
//!   half of ZeRO-1/2's (the gather after the update waits), hybrid's and HSDP's across nodes
//!   plus their share inside the node. ZeRO-3 with prefetch (wiretrain's default `--prefetch 1`)
//!   also hides its two parameter all-gathers (2/3 of its communication, of its intra-node
//!   time for HSDP) behind compute. With n (effective) units, a unit's reduction starts when
//!   its backward ends, so the last one always waits and, when the reductions outlast the
//!   backward, they run back to back from the end of the first unit's backward:
//!   `exposed = max(0, gathers − compute) + max(R/n, R − backward·(n−1)/n) + the rest`, R the
//!   reductions. DiLoCo's rows overlap nothing.
//! - **Wire dtype**: `wire` between nodes for every row, or a row's own (`wire_rows`: DiLoCo's
//!   deltas as int8, say); inside the node elements move as the model holds them.
//! - **Rank order**: the above is wiretrain's node-major order (ring neighbours inside the
//!   node). `--rank-order scrambled` models a flat ring over all N devices in which every
//!   neighbour sits on another node (what a careless host list gives): each collective moves
//!   Ψ(N−1)/N per device, all of it across nodes, the g devices of a node sharing its link,
//!   in N−1 steps.
//!   The optimizer step and data loading are not counted.

use crate::strategy::{Scope, Stage, Strategy};
use serde::Serialize;

mod inputs;
pub use inputs::{Link, PRESETS, Precision, RankOrder, Shape, WireDtype};

/// The strategies the planner compares (DiLoCo's rows come on top, see [`DilocoPlan`]).
pub const PLANNED: [Strategy; 6] = [
    Strategy::Ddp,
    Strategy::Zero1,
    Strategy::Zero2,
    Strategy::Zero3,
    Strategy::Hybrid,
    Strategy::Hsdp,
];

/// DiLoCo in the plan: one row per inner strategy (ddp, hybrid) with `inner_steps` (H)
/// between outer steps. `allowed`: it may be recommended (it changes the optimization, so a
/// faster step is not the whole story: its cost in loss is the user's call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DilocoPlan {
    /// H, the inner steps between outer steps.
    pub inner_steps: u64,
    /// Whether a DiLoCo row may be recommended.
    pub allowed: bool,
}

/// DiLoCo's inner strategies, as the trainer accepts them.
pub const DILOCO_INNER: [Strategy; 2] = [Strategy::Ddp, Strategy::Hybrid];

/// Everything the plan depends on.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanInput {
    /// Ψ, the parameter count.
    pub params: f64,
    /// When known: the shape (activation memory is counted only then).
    pub shape: Option<Shape>,
    /// Sequence length in tokens.
    pub seq: u64,
    /// Sequences per device per micro-step.
    pub micro_batch: u64,
    /// Sequences per optimizer step over all devices.
    pub global_batch: u64,
    /// Nodes (n).
    pub nodes: u64,
    /// Devices per node (g).
    pub gpus_per_node: u64,
    /// Device memory in bytes.
    pub device_mem: f64,
    /// The training precision, which sets the bytes of model state per parameter.
    pub precision: Precision,
    /// The dtype elements travel in between nodes.
    pub wire: WireDtype,
    /// Rows that put another dtype on the wire than `wire`, by row name (`ddp`, `diloco`,
    /// `diloco-hybrid`, ...): what each would run with `--wire-dtype`.
    pub wire_rows: Vec<(String, WireDtype)>,
    /// Achieved (not peak) TFLOP/s per device.
    pub tflops: f64,
    /// The link between the devices of a node.
    pub intra: Link,
    /// The link between nodes (each node's, shared by its devices).
    pub inter: Link,
    /// Activations are recomputed in the backward pass (stage 3 always recomputes).
    pub recompute: bool,
    /// DDP, ZeRO-1/2 and hybrid reduce each unit's gradient during backward (wiretrain's
    /// `--overlap`; ZeRO-3 and HSDP always do).
    pub overlap: bool,
    /// ZeRO-3 prefetches the next unit's parameters while a unit computes, hiding its
    /// all-gathers behind compute.
    pub prefetch: bool,
    /// How ranks are ordered over the nodes.
    pub rank_order: RankOrder,
    /// The model is cut into units (`wiretrain::units::Units`), this many effective ones
    /// (`(Σ size)² / Σ size²`, as many equal units as overlap the same way: see
    /// `wiretrain::engine::effective_units`); `None`: not cut, so ZeRO-3 and HSDP cannot run it
    /// and are never recommended, and nothing overlaps unit by unit.
    pub units: Option<f64>,
    /// DiLoCo rows to add, when given.
    pub diloco: Option<DilocoPlan>,
}

/// Communication per device per step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Comm {
    /// Elements in the large-N limit (2Ψ, 3Ψ).
    pub volume: f64,
    /// Bytes over the intra-node link.
    pub intra_bytes: f64,
    /// Bytes over the inter-node link.
    pub inter_bytes: f64,
    /// Seconds on the intra-node link.
    pub intra_s: f64,
    /// Seconds on the inter-node link.
    pub inter_s: f64,
}

impl Comm {
    /// Seconds on both link levels together (nothing overlapped).
    pub fn seconds(&self) -> f64 {
        self.intra_s + self.inter_s
    }

    fn scaled(self, k: f64) -> Self {
        Self {
            volume: self.volume * k,
            intra_bytes: self.intra_bytes * k,
            inter_bytes: self.inter_bytes * k,
            intra_s: self.intra_s * k,
            inter_s: self.inter_s * k,
        }
    }

    fn plus(self, o: Self) -> Self {
        Self {
            volume: self.volume + o.volume,
            intra_bytes: self.intra_bytes + o.intra_bytes,
            inter_bytes: self.inter_bytes + o.inter_bytes,
            intra_s: self.intra_s + o.intra_s,
            inter_s: self.inter_s + o.inter_s,
        }
    }
}

/// The plan of one strategy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StrategyPlan {
    /// The row's name: the strategy's, or `diloco` / `diloco-hybrid` (by inner strategy).
    pub name: String,
    /// The strategy, or DiLoCo's inner strategy.
    pub strategy: Strategy,
    /// DiLoCo's inner steps between outer steps, on a DiLoCo row.
    pub diloco_inner_steps: Option<u64>,
    /// The update equals single-process training's (false for DiLoCo).
    pub exact: bool,
    /// What the row puts on the wire between nodes.
    pub wire: WireDtype,
    /// Parameter bytes per device.
    pub params_bytes: f64,
    /// Gradient bytes per device.
    pub grads_bytes: f64,
    /// Optimizer state bytes per device (with DiLoCo's anchor and outer momentum).
    pub optim_bytes: f64,
    /// Activation bytes per device (0 without a shape).
    pub activation_bytes: f64,
    /// The four above together: bytes per device.
    pub bytes_per_device: f64,
    /// `bytes_per_device` is at most the device memory.
    pub fits: bool,
    /// Elements communicated per device per step in the large-N limit (2Ψ or 3Ψ).
    pub volume_elems: f64,
    /// Bytes per device per step over the intra-node link.
    pub comm_bytes_intra: f64,
    /// Bytes per device per step over the inter-node link.
    pub comm_bytes_inter: f64,
    /// Seconds of compute per step.
    pub compute_s: f64,
    /// Seconds of communication per step, overlapped or not.
    pub comm_s: f64,
    /// Predicted seconds per step: compute plus the communication it waits for.
    pub step_s: f64,
    /// Tokens per second over all devices.
    pub tokens_per_s: f64,
    /// The row [`PlanInput::plan`] recommends (at most one).
    pub recommended: bool,
}

impl PlanInput {
    /// Checks the input; returns the first problem in words.
    pub fn validate(&self) -> Result<(), String> {
        let pos = |v: f64, what: &str| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("{what} must be a positive number, not {v}"))
            }
        };
        pos(self.params, "--params")?;
        pos(self.device_mem, "--device-mem")?;
        pos(self.tflops, "--tflops")?;
        pos(self.intra.bytes_per_s, "the intra-node link rate")?;
        pos(self.inter.bytes_per_s, "the inter-node link rate")?;
        if self.nodes == 0 || self.gpus_per_node == 0 || self.seq == 0 || self.micro_batch == 0 {
            return Err(
                "--nodes, --gpus-per-node, --seq and --micro-batch must be at least 1".into(),
            );
        }
        let n = self.nodes * self.gpus_per_node;
        if self.global_batch == 0 || !self.global_batch.is_multiple_of(n * self.micro_batch) {
            return Err(format!(
                "--global-batch {} must be a positive multiple of devices ({n}) x \
                 --micro-batch ({})",
                self.global_batch, self.micro_batch
            ));
        }
        if self.intra.latency_s < 0.0 || self.inter.latency_s < 0.0 {
            return Err("link latencies cannot be negative".into());
        }
        Ok(())
    }

    fn devices(&self) -> f64 {
        (self.nodes * self.gpus_per_node) as f64
    }

    /// Bytes per parameter of (parameters, gradients, optimizer state): (2, 2, K=12) mixed,
    /// (4, 4, 8) f32.
    pub fn state_bytes(&self) -> (f64, f64, f64) {
        match self.precision {
            Precision::Mixed => (2.0, 2.0, 12.0),
            Precision::F32 => (4.0, 4.0, 8.0),
        }
    }

    /// Activation bytes per device (0 without a shape).
    pub fn activation_bytes(&self) -> f64 {
        self.activations(self.recompute)
    }

    /// Whether `st`'s rows recompute activations: when asked, and always for stage 3, which
    /// wiretrain runs unit by unit, recomputing each unit's forward in the backward pass.
    pub fn recomputes(&self, st: Strategy) -> bool {
        self.recompute || st.stage() == Stage::Parameters
    }

    /// Activation bytes per device, recomputed or kept (0 without a shape).
    fn activations(&self, recompute: bool) -> f64 {
        let Some(sh) = self.shape else { return 0.0 };
        let (s, b, h, a) = (
            self.seq as f64,
            self.micro_batch as f64,
            sh.hidden as f64,
            sh.heads as f64,
        );
        let per_layer = if recompute {
            2.0 * s * b * h
        } else {
            s * b * h * (34.0 + 5.0 * a * s / h)
        };
        let width = match self.precision {
            Precision::Mixed => 1.0,
            Precision::F32 => 2.0,
        };
        per_layer * sh.layers as f64 * width
    }

    /// Model-state bytes per device: (params, grads, optimizer).
    pub fn model_states(&self, st: Strategy) -> (f64, f64, f64) {
        let (p, g, o) = self.state_bytes();
        let psi = self.params;
        // A shard spans every device, or a node's devices.
        let d = match st.scope() {
            Scope::World => self.devices(),
            Scope::Node => self.gpus_per_node as f64,
        };
        let stage = st.stage();
        let cut = |from: Stage| if stage >= from { d } else { 1.0 };
        (
            p * psi / cut(Stage::Parameters),
            g * psi / cut(Stage::Gradients),
            o * psi / cut(Stage::OptimizerState),
        )
    }

    /// Communication per device per step: (large-N volume in elements, intra bytes, inter
    /// bytes, seconds).
    pub fn communication(&self, st: Strategy) -> (f64, f64, f64, f64) {
        let c = self.comm(st);
        (c.volume, c.intra_bytes, c.inter_bytes, c.seconds())
    }

    /// Communication per device per step of `st`, by link level.
    pub fn comm(&self, st: Strategy) -> Comm {
        let psi = self.params;
        let (n, g) = (self.nodes as f64, self.gpus_per_node as f64);
        let w = self.wire.bytes_per_element();
        // Inside the node the elements move as the model holds them (shared host buffers:
        // the wire dtype applies between nodes only).
        let wi = match self.precision {
            Precision::F32 => 4.0,
            Precision::Mixed => 2.0,
        };
        // One reduce-scatter or all-gather of Ψ over all devices, hierarchically.
        let intra_rs = psi * (g - 1.0) / g * wi;
        let inter_rs = psi * (n - 1.0) / (n * g) * w;
        // Stage 3 gathers the parameters twice (forward and backward) and reduce-scatters
        // the gradients; the other stages reduce-scatter and all-gather once each. At node
        // scope (hybrid) the node does the same, and across nodes each device all-reduces its
        // Ψ/g piece, which moves the same bytes as the hierarchical pair.
        let (ops, volume) = match st.stage() {
            Stage::Parameters => (3.0, 3.0 * psi),
            _ => (2.0, 2.0 * psi),
        };
        if self.rank_order == RankOrder::Scrambled && self.nodes > 1 {
            // A flat ring of N devices, every hop across nodes; a node's g devices share its
            // link.
            let nd = n * g;
            let inter = ops * psi * (nd - 1.0) / nd * w;
            let t = ops * (nd - 1.0) * self.inter.latency_s + inter * g / self.inter.bytes_per_s;
            return Comm {
                volume,
                intra_bytes: 0.0,
                inter_bytes: inter,
                intra_s: 0.0,
                inter_s: t,
            };
        }
        // Across nodes a node-scope strategy sends only the gradient reduction.
        let inter_ops = match st.scope() {
            Scope::World => ops,
            Scope::Node => 2.0,
        };
        let (intra, inter) = (ops * intra_rs, inter_ops * inter_rs);
        // Ring steps: g−1 per collective inside the node, n−1 across nodes. The g lanes of a
        // node share its link.
        let t_intra = ops * (g - 1.0) * self.intra.latency_s + intra / self.intra.bytes_per_s;
        let t_inter = if self.nodes > 1 {
            inter_ops * (n - 1.0) * self.inter.latency_s + inter * g / self.inter.bytes_per_s
        } else {
            0.0
        };
        Comm {
            volume,
            intra_bytes: intra,
            inter_bytes: inter,
            intra_s: t_intra,
            inter_s: t_inter,
        }
    }

    /// DiLoCo over `inner` with `h` inner steps per outer step, per step: the inner
    /// strategy's reductions inside the node (an all-reduce, or a reduce-scatter and a gather:
    /// the same bytes), and 1/h of DDP's all-reduce over every device for the deltas.
    pub fn diloco_comm(&self, h: u64) -> Comm {
        let node_only = PlanInput {
            nodes: 1,
            rank_order: RankOrder::NodeMajor,
            ..self.clone()
        };
        node_only
            .comm(Strategy::Ddp)
            .plus(self.comm(Strategy::Ddp).scaled(1.0 / h.max(1) as f64))
    }

    /// The rows this input plans: every strategy of [`PLANNED`], then DiLoCo's (inner
    /// strategy, inner steps) when asked for.
    fn rows(&self) -> Vec<(Strategy, Option<u64>)> {
        let mut rows: Vec<_> = PLANNED.iter().map(|&s| (s, None)).collect();
        if let Some(d) = self.diloco {
            rows.extend(DILOCO_INNER.iter().map(|&s| (s, Some(d.inner_steps))));
        }
        rows
    }

    /// Seconds of compute per step: 6Ψ FLOPs per token, 8Ψ when `st` recomputes.
    pub fn compute_s(&self, st: Strategy) -> f64 {
        let tokens = (self.global_batch * self.seq) as f64;
        let per_token = if self.recomputes(st) { 8.0 } else { 6.0 } * self.params;
        per_token * tokens / self.devices() / (self.tflops * 1e12)
    }

    /// Seconds of `c` (`st`'s communication) the step waits for: the parameter gathers
    /// (stage 3, prefetched) hide behind compute and the gradient reductions (when `st` runs
    /// unit by unit) behind the backward pass; the rest is exposed.
    pub fn exposed(&self, st: Strategy, c: &Comm, compute_s: f64) -> f64 {
        let comm_s = c.seconds();
        // With prefetch, stage 3 gathers the next unit's parameters while a unit computes:
        // the two gathers of three collectives (over the world, or inside the node for HSDP).
        let gathers = match (self.prefetch, st.stage(), st.scope()) {
            (true, Stage::Parameters, Scope::World) => 2.0 * comm_s / 3.0,
            (true, Stage::Parameters, Scope::Node) => 2.0 * c.intra_s / 3.0,
            _ => 0.0,
        };
        let reductions = if st.shards_params() || self.overlap {
            match st {
                Strategy::Ddp => comm_s,
                Strategy::Zero1 | Strategy::Zero2 => comm_s / 2.0,
                Strategy::Hybrid => c.inter_s + c.intra_s / 2.0,
                Strategy::Zero3 => comm_s / 3.0,
                Strategy::Hsdp => c.inter_s + c.intra_s / 3.0,
            }
        } else {
            0.0
        };
        // n equal units: unit k's reduction starts when its backward ends, so the last one
        // (unit 0's) always waits after the backward pass, and when the reductions outlast
        // the backward they run back to back from the end of the first unit's backward.
        let backward = compute_s * if self.recomputes(st) { 0.75 } else { 2.0 / 3.0 };
        let n = self.units.unwrap_or(1.0).max(1.0);
        let reductions_exposed = (reductions / n).max(reductions - backward * (n - 1.0) / n);
        (gathers - compute_s).max(0.0) + reductions_exposed + (comm_s - gathers - reductions)
    }

    /// The wire dtype of the row named `row`: its own, or `wire`.
    pub fn wire_of(&self, row: &str) -> WireDtype {
        self.wire_rows
            .iter()
            .find(|(r, _)| r == row)
            .map_or(self.wire, |(_, w)| *w)
    }

    /// The plan of one row: memory, communication, and the step it predicts.
    fn plan_row(&self, st: Strategy, diloco: Option<u64>) -> StrategyPlan {
        let name = match (diloco, st) {
            (None, st) => st.to_string(),
            (Some(_), Strategy::Ddp) => "diloco".to_string(),
            (Some(_), inner) => format!("diloco-{inner}"),
        };
        let wire = self.wire_of(&name);
        if wire != self.wire {
            let row = PlanInput {
                wire,
                wire_rows: Vec::new(),
                ..self.clone()
            };
            return row.plan_row(st, diloco);
        }
        let tokens = (self.global_batch * self.seq) as f64;
        let compute_s = self.compute_s(st);
        let act = self.activations(self.recomputes(st));
        let (p, g, mut o) = self.model_states(st);
        let c = match diloco {
            Some(h) => {
                // The f32 anchor and outer momentum, whole on every device.
                o += 8.0 * self.params;
                self.diloco_comm(h)
            }
            None => self.comm(st),
        };
        let bytes = p + g + o + act;
        let comm_s = c.seconds();
        let exposed = match diloco {
            Some(_) => comm_s,
            None => self.exposed(st, &c, compute_s),
        };
        let step_s = compute_s + exposed.max(comm_s - compute_s).max(0.0);
        StrategyPlan {
            name,
            wire: self.wire,
            strategy: st,
            diloco_inner_steps: diloco,
            exact: diloco.is_none(),
            params_bytes: p,
            grads_bytes: g,
            optim_bytes: o,
            activation_bytes: act,
            bytes_per_device: bytes,
            fits: bytes <= self.device_mem,
            volume_elems: c.volume,
            comm_bytes_intra: c.intra_bytes,
            comm_bytes_inter: c.inter_bytes,
            compute_s,
            comm_s,
            step_s,
            tokens_per_s: tokens / step_s,
            recommended: false,
        }
    }

    /// The plan of every row; the fastest that fits is recommended (ties within 2 % go to the
    /// one that keeps more memory free), DiLoCo only when allowed.
    pub fn plan(&self) -> Vec<StrategyPlan> {
        let mut out: Vec<StrategyPlan> = self
            .rows()
            .into_iter()
            .map(|(st, d)| self.plan_row(st, d))
            .collect();
        let allowed = self.diloco.is_some_and(|d| d.allowed);
        let eligible = |p: &StrategyPlan| {
            p.fits && (p.exact || allowed) && (self.units.is_some() || !p.strategy.shards_params())
        };
        let best = out
            .iter()
            .filter(|p| eligible(p))
            .map(|p| p.tokens_per_s)
            .fold(0.0, f64::max);
        if let Some(i) = out
            .iter()
            .enumerate()
            .filter(|(_, p)| eligible(p) && p.tokens_per_s >= 0.98 * best)
            .min_by(|a, b| a.1.bytes_per_device.total_cmp(&b.1.bytes_per_device))
            .map(|(i, _)| i)
        {
            out[i].recommended = true;
        }
        out
    }
}

/// Why the recommended strategy was chosen, in one sentence.
pub fn reason(plans: &[StrategyPlan], device_mem: f64) -> String {
    let Some(r) = plans.iter().find(|p| p.recommended) else {
        let least = plans
            .iter()
            .min_by(|a, b| a.bytes_per_device.total_cmp(&b.bytes_per_device))
            .expect("every strategy has a row");
        return format!(
            "nothing fits: even {} needs {:.1} GB per device of {:.1} GB; add devices, \
             recompute activations or shrink the micro-batch",
            least.name,
            least.bytes_per_device / 1e9,
            device_mem / 1e9
        );
    };
    let unfit: Vec<String> = plans
        .iter()
        .filter(|p| !p.fits)
        .map(|p| p.name.clone())
        .collect();
    let comm_share = (r.step_s - r.compute_s) / r.step_s;
    format!(
        "{}: the fastest that fits ({:.0} tokens/s, {:.1} GB per device, {:.0}% of the step \
         waiting for the network){}",
        r.name,
        r.tokens_per_s,
        r.bytes_per_device / 1e9,
        100.0 * comm_share,
        if unfit.is_empty() {
            String::new()
        } else {
            format!(
                "; {} {} not fit",
                unfit.join(", "),
                if unfit.len() == 1 { "does" } else { "do" }
            )
        }
    )
}

#[cfg(test)]
mod tests;
