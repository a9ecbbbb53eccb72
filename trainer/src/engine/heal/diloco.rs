//! Healing DiLoCo from live nodes. Within a round each node trains apart, so its inner state
//! (parameters and inner optimizer) is its own and stays where it is: the lost node's inner
//! steps since the anchor are gone, as in DiLoCo's own model of a dropped worker. What must
//! agree is the outer state (anchor, momentum and counters): the rank that got furthest (the
//! most outer steps, then the most inner steps) sends it where it differs, checked by its
//! SHA-256 digest. A rank whose outer step the failure cut off while another's completed
//! restarts the round at the anchor, as the step would have left it; when no rank completed
//! it, the healed world runs it. A node's own ranks must hold one state. A node that joins
//! holds no inner state: it takes the first live node's inner optimizer state (each local
//! rank its counterpart's) and starts the round at the anchor, as a checkpoint resumed on
//! more nodes does.

use super::{Agreed, Entry};
use crate::clock::StepClock;
use crate::engine::{TrainError, Trainer};
use crate::optim::ExportedState;
use crate::strategy::diloco::OuterState;
use burn::module::Module;

impl<M: Module> Trainer<M> {
    /// [`Trainer::agree_state`] under DiLoCo, from every rank's `entries`; `exported` is this
    /// rank's inner optimizer state.
    pub(super) fn agree_diloco(
        &mut self,
        entries: &[Entry],
        exported: &ExportedState,
    ) -> Result<Agreed, TrainError> {
        let heal_err = |m: String| TrainError::Heal(m);
        let n = entries.len();
        let table = self.pg.table().clone();
        let (node, local): (Vec<usize>, Vec<usize>) = (0..n).map(|r| table.locate(r)).unzip();
        let joined = |r: usize| entries[r].joined;
        let live: Vec<usize> = (0..n).filter(|&r| !joined(r)).collect();
        let agreed = live.iter().map(|&r| entries[r].steps).max().unwrap_or(0);
        let replicas = self.cfg.strategy.stage() == crate::strategy::Stage::Replicated;
        check_live(entries, &live, &node, replicas, agreed)?;
        let src = live
            .iter()
            .copied()
            .max_by_key(|&r| (entries[r].rounds, entries[r].inner_done, usize::MAX - r))
            .ok_or_else(|| heal_err("no rank of the job holds a state".into()))?;
        let want = &entries[src];
        let me = self.pg.rank();
        let behind = !joined(me) && entries[me].rounds < want.rounds;
        let mut transferred = false;
        if entries.iter().any(|e| e.outer != want.outer) {
            transferred = true;
            self.receive_outer(src, want)?;
        }
        // Joining ranks take the inner optimizer state of the first live node's rank with
        // their local rank, and start the round at the anchor (below): what they add to the
        // round's delta is their own steps.
        for g in 0..local.iter().max().map_or(0, |m| m + 1) {
            if !(0..n).any(|r| local[r] == g && joined(r)) {
                continue;
            }
            let from = live
                .iter()
                .copied()
                .find(|&r| local[r] == g)
                .ok_or_else(|| {
                    heal_err(format!(
                        "local rank {g} joined and no live node has that rank"
                    ))
                })?;
            transferred = true;
            self.receive_state(from, local[me] == g && joined(me), exported, &entries[from])?;
        }
        // A round's outer step cut off on every rank runs now; the joiners (at the anchor)
        // hold no delta, so the others' weigh world / live for the mean to be theirs.
        let weight = n as f32 / live.len() as f32;
        let clock = StepClock::since(std::time::Instant::now());
        let (mut cx, sync) = self.sync_cx(&clock);
        let outer_step_ran = sync.heal_round(&mut cx, behind || joined(me), weight)?;
        if outer_step_ran {
            tracing::info!(
                step = agreed,
                "the outer step the failure cut off ran on the healed world"
            );
        }
        self.finish_load()?;
        Ok(Agreed {
            steps: agreed,
            transferred,
            outer_step_ran,
        })
    }

    /// The transfer of rank `src`'s outer state (a collective of the whole world); ranks
    /// whose own differs keep it, checked against `want`'s digest.
    fn receive_outer(&mut self, src: usize, want: &Entry) -> Result<(), TrainError> {
        let heal_err = |m: String| TrainError::Heal(m);
        let total = self.layout.total();
        let own = self.sync.outer().cloned().unwrap_or_default();
        let header = serde_json::to_vec(&(
            own.inner_done,
            own.rounds,
            own.anchor.len(),
            own.momentum.len(),
        ))
        .map_err(|e| heal_err(e.to_string()))?;
        // Four integers in JSON: a longer header is refused before it is read.
        let header = self.pg.broadcast_bytes_within(&header, src, 256)?;
        let (inner_done, rounds, n_anchor, n_momentum): (usize, usize, usize, usize) =
            serde_json::from_slice(&header)
                .map_err(|e| heal_err(format!("rank {src}'s outer state header: {e}")))?;
        if n_anchor != total || n_momentum != total {
            return Err(heal_err(format!(
                "rank {src}'s outer state holds {n_anchor} and {n_momentum} elements; the model \
                 has {total}"
            )));
        }
        let buf = |v: &[f32]| {
            if v.len() == total {
                v.to_vec()
            } else {
                vec![0.0; total]
            }
        };
        let anchor = self.pg.broadcast(buf(&own.anchor), src).wait()?;
        let momentum = self.pg.broadcast(buf(&own.momentum), src).wait()?;
        if self.pg.rank() == src || own.digest() == want.outer {
            return Ok(());
        }
        let got = OuterState {
            anchor,
            momentum,
            inner_done,
            rounds,
        };
        if got.digest() != want.outer {
            return Err(heal_err(format!(
                "the outer state received from rank {src} does not match its SHA-256 digest: \
                 the transfer was corrupted"
            )));
        }
        if let Some(o) = self.sync.outer_mut() {
            *o = got;
        }
        Ok(())
    }
}

/// The live ranks' (`live`) states must be one DiLoCo state: every node within one inner step
/// of `agreed` (the most steps), and each node's ranks (`node[r]`: rank r's node) at the same
/// step, with the same digest where they hold replicas.
fn check_live(
    entries: &[Entry],
    live: &[usize],
    node: &[usize],
    replicas: bool,
    agreed: usize,
) -> Result<(), TrainError> {
    // Inner steps cross no node, so live nodes stop at most one step apart (one may have
    // seen the loss all-reduce of a step complete that another saw fail).
    if let Some(&r) = live.iter().find(|&&r| entries[r].steps + 1 < agreed) {
        return Err(TrainError::Heal(format!(
            "rank {r} stopped at step {} and another at {agreed}: DiLoCo's nodes must be \
             within one inner step of each other",
            entries[r].steps
        )));
    }
    // A node's ranks hold one inner state (replicas under DDP, shards of it sharded):
    // they must have stepped alike, or it is not one state.
    for &r in live {
        let first = live.iter().copied().find(|&q| node[q] == node[r]);
        if let Some(q) = first.filter(|&q| {
            entries[q].steps != entries[r].steps
                || (replicas && entries[q].digest != entries[r].digest)
        }) {
            return Err(TrainError::Heal(format!(
                "ranks {q} and {r} of node {} hold different inner states (steps {} and \
                 {}): the node has no one state to go on with",
                node[r], entries[q].steps, entries[r].steps
            )));
        }
    }
    Ok(())
}
