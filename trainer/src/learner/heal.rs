//! A Learner step cut off by a lost node, healed from live replicas ([`crate::heal`]), as
//! `wiretrain::fit` heals its own: the rank joins the next job epoch through its node's
//! [`Healer`], the trainer takes the new process group and the ranks agree on one state
//! (sent, checksummed, where replicas differ). The rest of the Learner epoch runs on the
//! survivors' own shares of the data (the lost ranks' remaining items are skipped in this
//! epoch, as a torchft replica's are); the next epoch is shared over the new world. The ranks
//! also agree where they were cut off ([`Spot`]): in a step, each goes on after the furthest
//! batch any of them took; at the epoch's end, each does again what failed. Ranks cut off at
//! different points (one in the epoch's last step, another in its checkpoint), and a lost rank
//! 0 (validation, Burn's checkpointer and metric logs run there), fail the heal: the launch
//! restarts from the checkpoint.

use crate::engine::{RecoverError, Recovery, TrainError, Trainer};
use crate::heal::Healer;
use burn::module::Module;
use std::time::Instant;

/// Whether `e` (a step's failure) may heal: a communication failure under a strategy whose
/// state lives on more than one node.
pub(super) fn healable<M: Module>(trainer: &Trainer<M>, e: &TrainError) -> bool {
    trainer.may_heal_after(matches!(e, TrainError::Comm(_)))
}

/// What a rank was doing when a lost node cut it off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Step,
    /// Reading the whole model back at the epoch's end.
    Model,
    Checkpoint,
    /// Following rank 0's decision to stop early.
    Follow,
}

/// Where a rank was cut off: the epoch, the phase, and the batches of the epoch it had taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Spot {
    pub epoch: usize,
    pub phase: Phase,
    pub taken: usize,
}

impl Spot {
    /// At the end of `epoch`, in `phase`.
    pub(super) fn at(epoch: usize, phase: Phase) -> Self {
        Self {
            epoch,
            phase,
            taken: 0,
        }
    }
}

/// Heals after a collective failed with `reason` at `spot`, the trainer's state holding
/// `done` steps where it would have held `attempted` (one more when a step's update was cut
/// off); returns the steps of the agreed state and the batches of the epoch every rank goes
/// on after (the furthest any had taken).
pub(super) fn heal<M: Module>(
    trainer: &mut Trainer<M>,
    h: &Healer,
    reason: &str,
    (done, attempted): (usize, usize),
    spot: Spot,
) -> Result<(usize, usize), String> {
    let t0 = Instant::now();
    let fail = |why: RecoverError| format!("healing after a collective failed ({reason}): {why}");
    if trainer.process_group().rank() == 0 {
        eprintln!("wiretrain: a Learner collective failed: {reason}; healing from live replicas");
    }
    let recovery = Recovery {
        healer: h,
        reason,
        done,
        refuse_joiners: Some(
            "a node joined in place; the Learner strategy takes new nodes at a restart from \
             the checkpoint",
        ),
    };
    let rc = trainer
        .recover(recovery, |trainer, was_leader| {
            // Every rank learns whether rank 0 of the new epoch was rank 0 before (a
            // collective, so all fail alike).
            let lead = trainer
                .process_group()
                .broadcast(vec![f32::from(u8::from(was_leader))], 0)
                .wait()
                .map_err(TrainError::from)?;
            if lead[0] == 0.0 {
                return Err(RecoverError::Refused(
                    "the node of rank 0 was lost, and with it the Learner's validation, Burn's \
                     checkpointer and metric logs (they run on rank 0): the launch restarts \
                     from the checkpoint"
                        .into(),
                ));
            }
            // Where each was cut off first: ranks that cannot go on together send no state.
            agree_spot(trainer, spot).map_err(RecoverError::Refused)
        })
        .map_err(fail)?;
    let (agreed, taken) = (rc.agreed, rc.between);
    let pg = trainer.process_group();
    if pg.rank() == 0 {
        eprintln!(
            "wiretrain: healed from live replicas: epoch {} on {} node(s) ({} ranks), going \
             on from step {} with no checkpoint read ({} step(s) lost, state {}), {} ms after \
             the failure; the rest of this Learner epoch runs on the survivors' shares",
            rc.elastic.epoch,
            pg.table().num_nodes(),
            pg.world(),
            agreed.steps,
            attempted.saturating_sub(agreed.steps),
            if agreed.transferred {
                "sent from a replica"
            } else {
                "identical on every replica"
            },
            t0.elapsed().as_millis()
        );
    }
    Ok((agreed.steps, taken))
}

/// Every rank's [`Spot`] gathered: the furthest batch taken when all were cut off at the same
/// epoch and phase; an error naming two that were not.
fn agree_spot<M: Module>(trainer: &mut Trainer<M>, spot: Spot) -> Result<usize, String> {
    let mine: Vec<u8> = [spot.epoch, spot.phase as usize, spot.taken]
        .iter()
        .flat_map(|v| (*v as u64).to_le_bytes())
        .collect();
    let all = trainer
        .process_group()
        .all_gather_bytes(&mine)
        .map_err(|e| e.to_string())?;
    let mut taken = 0;
    for (r, b) in all.iter().enumerate() {
        if b.len() != 24 {
            return Err(format!("rank {r} sent a malformed position"));
        }
        let v = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8"));
        if b[..16] != all[0][..16] {
            return Err(format!(
                "the survivors were cut off at different points of the run (rank 0 {}, rank \
                 {r} {}): they cannot go on together",
                describe(&all[0]),
                describe(b)
            ));
        }
        taken = taken.max(v(2) as usize);
    }
    Ok(taken)
}

/// A gathered [`Spot`] in words.
fn describe(b: &[u8]) -> String {
    let v = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8"));
    let phase = match v(1) {
        0 => "a step",
        1 => "reading the model back",
        2 => "its checkpoint",
        _ => "the early-stop decision",
    };
    format!("in epoch {}'s {phase}", v(0))
}

/// Runs `op` on the trainer (the trainer's state holding `steps` steps) at `spot`; when a
/// lost node cuts it off and this node heals, runs it again in the healed world, once.
pub(super) fn healed<M: Module, T>(
    trainer: &mut Trainer<M>,
    (healer, spot): (Option<&Healer>, Spot),
    steps: &mut usize,
    mut op: impl FnMut(&mut Trainer<M>) -> Result<T, TrainError>,
) -> Result<T, String> {
    match op(trainer) {
        Ok(v) => Ok(v),
        Err(e) => match healer {
            Some(h) if healable(trainer, &e) => {
                *steps = heal(trainer, h, &e.to_string(), (*steps, *steps), spot)?.0;
                op(trainer).map_err(|e| e.to_string())
            }
            _ => Err(e.to_string()),
        },
    }
}
