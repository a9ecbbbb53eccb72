//! Pipeline parallelism: a model cut into [`Units`] runs as `S` stages, one per rank, each
//! owning a contiguous range of units. A step splits the global batch into `M` micro-batches;
//! each stage runs its units' forward on them, sends the activations on (point-to-point
//! messages, `comm`'s `send`/`recv`), receives their gradients back and runs its backward from
//! them, in the order of its [`Schedule`] (GPipe or 1F1B, [`schedule`]); the loss is computed
//! on the last stage. After the last micro-batch each stage steps its own units' parameters
//! with the mean gradient over the micro-batches. Only activations and their gradients cross
//! between stages, which is why a pipeline communicates least over slow wiring.
//!
//! Pipeline × data parallel: a world of `S × R` ranks runs `R` replicas of the pipeline, each
//! stage's replicas averaging its gradients before its optimizer step (DDP within the stage;
//! [`Placement`] says which ranks form a stage). A replica trains on its own share of the
//! global batch.

mod placement;
pub mod schedule;
mod stage;
pub mod wire;

pub use placement::Placement;
pub use schedule::{Op, Schedule};
pub use stage::{PipelineReport, PipelineTrainer};

use crate::optim::OptimConfig;
use std::ops::Range;

/// What a pipeline runs: its stages, micro-batches, schedule, cut and optimizer.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    /// Stages (`S`): one per rank.
    pub stages: usize,
    /// Micro-batches per step (`M`); 1F1B is refused with fewer than `S`, where it would run
    /// as GPipe does (all forwards first) under another name.
    pub micro_batches: usize,
    /// The order of each stage's forward and backward passes.
    pub schedule: Schedule,
    /// The units of each stage, in order (`None`: as even a cut by unit count as there is).
    pub split: Option<Vec<Range<usize>>>,
    /// The optimizer each stage steps its parameters with.
    pub optim: OptimConfig,
    /// The learning rate.
    pub lr: f64,
}

/// Why a pipeline cannot run, or a step failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// The configuration cannot run on this model and world; holds what to change.
    #[error("pipeline: {0}")]
    Config(String),
    /// An activation or gradient cannot cross a stage boundary, or arrived malformed.
    #[error("pipeline activation: {0}")]
    Activation(String),
}

impl PipelineConfig {
    /// The units of each of the `stages` stages of a model of `units` units, checked: the
    /// configured split, or an even one.
    pub fn cut(&self, units: usize, world: usize) -> Result<Vec<Range<usize>>, PipelineError> {
        let (s, m) = (self.stages, self.micro_batches);
        let bad = |why: String| Err(PipelineError::Config(why));
        if s == 0 || s > units {
            return bad(format!(
                "{s} stages for a model of {units} units: each stage needs at least one unit"
            ));
        }
        if world == 0 || !world.is_multiple_of(s) {
            return bad(format!(
                "{s} stages on a world of {world} ranks: the world must be the stages times \
                 the replicas of each stage; launch a multiple of {s} ranks"
            ));
        }
        if m == 0 || (self.schedule == Schedule::OneFOneB && m < s) {
            return bad(format!(
                "{m} micro-batches for {s} stages: 1F1B needs at least one per stage (use \
                 --microbatches {s} or more, or --schedule gpipe)"
            ));
        }
        let Some(split) = &self.split else {
            return Ok((0..s).map(|k| k * units / s..(k + 1) * units / s).collect());
        };
        let covers = split.len() == s
            && split.first().is_some_and(|r| r.start == 0)
            && split.last().is_some_and(|r| r.end == units)
            && split.windows(2).all(|w| w[0].end == w[1].start);
        if !covers || split.iter().any(|r| r.is_empty()) {
            return bad(format!(
                "the split {split:?} is not {s} non-empty, contiguous unit ranges covering \
                 0..{units}"
            ));
        }
        Ok(split.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(
        stages: usize,
        m: usize,
        schedule: Schedule,
        split: Option<Vec<Range<usize>>>,
    ) -> PipelineConfig {
        PipelineConfig {
            stages,
            micro_batches: m,
            schedule,
            split,
            optim: OptimConfig::default(),
            lr: 1e-3,
        }
    }

    #[test]
    fn cuts_are_even_or_as_given_and_bad_ones_say_what_to_change() {
        let one = Schedule::OneFOneB;
        assert_eq!(cfg(2, 4, one, None).cut(3, 2).unwrap(), vec![0..1, 1..3]);
        assert_eq!(
            cfg(4, 4, one, None).cut(8, 4).unwrap(),
            vec![0..2, 2..4, 4..6, 6..8]
        );
        let given = Some(vec![0..3, 3..8]);
        assert_eq!(cfg(2, 2, one, given).cut(8, 2).unwrap(), vec![0..3, 3..8]);
        let err = |c: PipelineConfig, u, w| c.cut(u, w).unwrap_err().to_string();
        assert!(err(cfg(4, 4, one, None), 3, 4).contains("each stage needs at least one unit"));
        assert!(err(cfg(2, 2, one, None), 3, 3).contains("a multiple of 2 ranks"));
        assert!(cfg(2, 2, one, None).cut(3, 4).is_ok());
        assert!(err(cfg(4, 2, one, None), 8, 4).contains("--schedule gpipe"));
        assert!(cfg(4, 2, Schedule::Gpipe, None).cut(8, 4).is_ok());
        let gap = Some(vec![0..3, 4..8]);
        assert!(err(cfg(2, 2, one, gap), 8, 2).contains("contiguous"));
        let empty = Some(vec![0..0, 0..8]);
        assert!(err(cfg(2, 2, one, empty), 8, 2).contains("non-empty"));
    }
}
