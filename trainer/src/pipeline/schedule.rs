//! The order in which one stage runs its micro-batches' forward and backward passes, as pure
//! data ([`ops`]), tested without any model or transport.
//!
//! * GPipe: every forward, then every backward (in micro-batch order). A stage holds the
//!   activations of all `M` micro-batches at its peak.
//! * 1F1B (PipeDream-flush, Megatron's and torch.distributed.pipelining's `Schedule1F1B`):
//!   stage `s` of `S` runs `min(S - 1 - s, M)` warm-up forwards, then alternates one forward
//!   and one backward, then drains the remaining backwards. A stage holds at most `S - s`
//!   micro-batches' activations, however large `M` is.
//!
//! Sends are eager (they never wait for their receive), so a stage only ever waits for a
//! message its neighbour sends before waiting itself; [`ops`]'s test runs all stages'
//! lists against each other to check that no schedule can deadlock.

use serde::Serialize;

/// Which micro-batch schedule the stages run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// All forwards, then all backwards.
    Gpipe,
    /// One forward, one backward, after a warm-up (at most `S` micro-batches in flight).
    #[serde(rename = "1f1b")]
    OneFOneB,
}

impl std::str::FromStr for Schedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "gpipe" => Ok(Self::Gpipe),
            "1f1b" => Ok(Self::OneFOneB),
            o => Err(format!("{o:?} is not a pipeline schedule (1f1b, gpipe)")),
        }
    }
}

/// One step of a stage's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The forward pass of micro-batch `i`.
    Forward(usize),
    /// The backward pass of micro-batch `i`.
    Backward(usize),
}

/// The forward and backward passes of stage `stage` of `stages`, for `micro` micro-batches,
/// in the order it runs them (`stage < stages`; none for a stage past them).
pub fn ops(schedule: Schedule, stage: usize, stages: usize, micro: usize) -> Vec<Op> {
    if stage >= stages {
        return Vec::new();
    }
    let forwards = (0..micro).map(Op::Forward);
    let backwards = (0..micro).map(Op::Backward);
    match schedule {
        Schedule::Gpipe => forwards.chain(backwards).collect(),
        Schedule::OneFOneB => {
            let warmup = (stages - 1 - stage).min(micro);
            let mut out: Vec<Op> = (0..warmup).map(Op::Forward).collect();
            for i in warmup..micro {
                out.push(Op::Forward(i));
                out.push(Op::Backward(i - warmup));
            }
            out.extend((micro - warmup..micro).map(Op::Backward));
            out
        }
    }
}

/// The most micro-batches whose forward has run and whose backward has not, at any point of
/// `ops` (the activations the stage holds at its peak).
pub fn peak_in_flight(ops: &[Op]) -> usize {
    let mut live = 0usize;
    let mut peak = 0;
    for op in ops {
        match op {
            Op::Forward(_) => live += 1,
            Op::Backward(_) => live -= 1,
        }
        peak = peak.max(live);
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs every stage's list against the others with eager sends: a forward of micro-batch
    /// i on stage s > 0 waits for stage s - 1's forward of i; a backward of i on stage
    /// s < S - 1 waits for stage s + 1's backward of i. Returns whether all lists complete.
    fn completes(schedule: Schedule, stages: usize, micro: usize) -> bool {
        let lists: Vec<Vec<Op>> = (0..stages)
            .map(|s| ops(schedule, s, stages, micro))
            .collect();
        let mut at = vec![0usize; stages];
        let mut fwd_done = vec![vec![false; micro]; stages];
        let mut bwd_done = vec![vec![false; micro]; stages];
        loop {
            let mut moved = false;
            for s in 0..stages {
                let Some(&op) = lists[s].get(at[s]) else {
                    continue;
                };
                let ready = match op {
                    Op::Forward(i) => s == 0 || fwd_done[s - 1][i],
                    Op::Backward(i) => fwd_done[s][i] && (s + 1 == stages || bwd_done[s + 1][i]),
                };
                if ready {
                    match op {
                        Op::Forward(i) => fwd_done[s][i] = true,
                        Op::Backward(i) => bwd_done[s][i] = true,
                    }
                    at[s] += 1;
                    moved = true;
                }
            }
            if (0..stages).all(|s| at[s] == lists[s].len()) {
                return true;
            }
            if !moved {
                return false;
            }
        }
    }

    #[test]
    fn every_micro_batch_runs_forward_then_backward_once_and_no_schedule_deadlocks() {
        for schedule in [Schedule::Gpipe, Schedule::OneFOneB] {
            for stages in 1..=5 {
                for micro in 1..=9 {
                    for s in 0..stages {
                        let l = ops(schedule, s, stages, micro);
                        assert_eq!(l.len(), 2 * micro);
                        for i in 0..micro {
                            let f = l.iter().position(|&o| o == Op::Forward(i)).unwrap();
                            let b = l.iter().position(|&o| o == Op::Backward(i)).unwrap();
                            assert!(f < b, "{schedule:?} S={stages} M={micro} s={s} i={i}");
                        }
                    }
                    assert!(
                        completes(schedule, stages, micro),
                        "{schedule:?} {stages} {micro}"
                    );
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_holds_at_most_s_minus_stage_micro_batches_and_gpipe_all_of_them() {
        for stages in 1..=5 {
            for micro in 1..=9 {
                for s in 0..stages {
                    let one = peak_in_flight(&ops(Schedule::OneFOneB, s, stages, micro));
                    assert_eq!(one, (stages - s).min(micro), "S={stages} M={micro} s={s}");
                    let all = peak_in_flight(&ops(Schedule::Gpipe, s, stages, micro));
                    assert_eq!(all, micro);
                }
            }
        }
        // The textbook picture: stage 0 of 4 with 6 micro-batches.
        use Op::{Backward as B, Forward as F};
        assert_eq!(
            ops(Schedule::OneFOneB, 0, 4, 6),
            vec![
                F(0),
                F(1),
                F(2),
                F(3),
                B(0),
                F(4),
                B(1),
                F(5),
                B(2),
                B(3),
                B(4),
                B(5)
            ]
        );
        assert_eq!("1f1b".parse(), Ok(Schedule::OneFOneB));
        assert!(
            "zb".parse::<Schedule>()
                .unwrap_err()
                .contains("1f1b, gpipe")
        );
    }
}
