//! A step cut off by a lost node, healed from live replicas ([`crate::heal`]): the rank joins
//! the next epoch through its node's [`Healer`], the trainer takes the new process group and
//! the ranks agree on one state (transferring it, checksummed, where replicas differ); the
//! sampler and the pace follow the new world, the record and the trace mark the heal, and the
//! loop goes on from the agreed step (redoing the step cut off unless it was applied).

use super::pace::Pace;
use super::record::{Record, unix_ms};
use super::{FitError, FitOptions};
use crate::data::DistributedSampler;
use crate::engine::{Agreed, RecoverError, Recovered, Recovery, TrainError, Trainer};
use crate::heal::Healer;
use burn::module::Module;
use std::sync::Arc;

/// The step a failure cut off (or after which the node regroups), whether its update was
/// applied, and why.
pub(super) struct Cut {
    pub step: usize,
    pub applied: bool,
    pub reason: String,
    /// Not a failure: the launcher moves this node into a bigger epoch in place.
    pub regroup: bool,
}

impl Cut {
    /// Step `step` failed for `reason`; `applied`: its update had been applied.
    pub(super) fn failed(step: usize, applied: bool, reason: String) -> Self {
        Self {
            step,
            applied,
            reason,
            regroup: false,
        }
    }

    /// Agents joined: after step `step` the world grows in place.
    pub(super) fn regroup(step: usize) -> Self {
        Self {
            step,
            applied: true,
            reason: "agents joined: the world grows in place".into(),
            regroup: true,
        }
    }
}

/// Before the loop, in a run that heals: says whether this node can go on in place (so the
/// launcher may grow the world in place) and arms the regroup flag; a node that joins in
/// place (`WIRETRAIN_HEAL_JOIN`) receives the state from the nodes already there. Returns the
/// step to start from when it joined so.
pub(super) fn setup<M: Module>(
    trainer: &mut Trainer<M>,
    run: &FitOptions,
    run_meta: &serde_json::Value,
) -> Result<Option<usize>, FitError> {
    let Some(h) = &run.heal else {
        return Ok(None);
    };
    let live = trainer.heal_unsupported().is_none();
    h.capable(live);
    if live {
        trainer.set_regroup_flag(h.regroup_flag());
    }
    let joining = std::env::var(crate::job::env::HEAL_JOIN).is_ok_and(|v| v == "1");
    if !joining {
        return Ok(None);
    }
    let agreed = trainer.join_state()?;
    // The collectives the nodes already there make after agreeing (see `heal`).
    catch_up_checkpoint(trainer, run, run_meta, agreed.steps)?;
    if trainer.process_group().rank() == 0 {
        eprintln!("wiretrain: joined in place at step {}", agreed.steps);
    }
    tracing::info!(
        step = agreed.steps,
        "joined a running job: the state came from a live replica"
    );
    Ok(Some(agreed.steps))
}

/// The healer to go on with after `e`: a communication failure, in a run that heals, under a
/// strategy whose state lives on more than one node. `None`: the run fails with `e`.
pub(super) fn healable<M: Module>(
    run: &FitOptions,
    trainer: &Trainer<M>,
    e: &FitError,
) -> Option<Arc<Healer>> {
    let h = run.heal.clone()?;
    let comm = matches!(e, FitError::Comm(_) | FitError::Train(TrainError::Comm(_)));
    trainer.may_heal_after(comm).then_some(h)
}

/// Heals after `e` cut off `cut`; returns the step to go on from.
#[allow(clippy::too_many_arguments)]
pub(super) fn heal<M: Module>(
    trainer: &mut Trainer<M>,
    sampler: &mut DistributedSampler,
    pace: &mut Pace,
    rec: &mut Record,
    run: &FitOptions,
    h: &Healer,
    cut: Cut,
    run_meta: &serde_json::Value,
) -> Result<usize, FitError> {
    let detected = unix_ms();
    let reason = cut.reason.clone();
    let failure = if cut.regroup {
        format!("after step {}: {reason}", cut.step)
    } else {
        format!("step {} failed: {reason}", cut.step)
    };
    let fail = |why: RecoverError| FitError::Heal {
        failure: failure.clone(),
        source: Box::new(why),
    };
    let done = cut.step + usize::from(cut.applied);
    if trainer.process_group().rank() == 0 {
        let what = if cut.regroup {
            "regrouping in place"
        } else {
            "healing from live replicas"
        };
        rec.bar
            .suspend(|| eprintln!("wiretrain: {failure}; {what}"));
    }
    let recovery = Recovery {
        healer: h,
        reason: &reason,
        done,
        refuse_joiners: None,
    };
    let rc = trainer.recover(recovery, |_, _| Ok(())).map_err(fail)?;
    let (agreed, rj_joined) = (rc.agreed, rc.joined);
    let pg = trainer.process_group();
    let (rank, node, world, nodes) = (pg.rank(), pg.node(), pg.world(), pg.table().num_nodes());
    let refused = |why: String| fail(RecoverError::Refused(why));
    sampler.rebind(rank, world).map_err(refused)?;
    check_world(run, world).map_err(refused)?;
    *pace = Pace::new(trainer, run);
    let lost = (cut.step + 1).saturating_sub(agreed.steps);
    let healed = unix_ms();
    let times = (detected, healed);
    let event = heal_event(trainer, &rc, &cut, &reason, times);
    crate::trace::heal_marker(
        rank,
        node,
        rc.elastic.epoch,
        serde_json::json!({ "epoch": rc.elastic.epoch, "restarts": rc.elastic.restarts }),
    );
    let epoch = rc.elastic.epoch;
    rec.healed(event, rc.elastic, rank == 0, run)?;
    catch_up_checkpoint(trainer, run, run_meta, agreed.steps)?;
    if rj_joined && run.trace.is_some() {
        // The newcomers' traces take their clock offset to rank 0 (a collective).
        crate::trace::estimate_offset(trainer.process_group())?;
    }
    if rank == 0 {
        let ms = healed.saturating_sub(detected);
        rec.bar
            .suspend(|| say_healed(epoch, nodes, world, &agreed, lost, ms));
    }
    Ok(agreed.steps)
}

/// The heal's record in the run's metrics: the new epoch and world, the step cut off and the
/// one gone on from, and (`times`) when the failure was seen and when the heal was done.
fn heal_event<M: Module>(
    trainer: &mut Trainer<M>,
    rc: &Recovered<()>,
    cut: &Cut,
    reason: &str,
    (detected, healed): (u64, u64),
) -> serde_json::Value {
    let pg = trainer.process_group();
    let agreed = &rc.agreed;
    let mut event = serde_json::json!({
        "epoch": rc.elastic.epoch,
        "world": pg.world(),
        "nodes": pg.table().num_nodes(),
        "failed_step": cut.step,
        "went_on_from": agreed.steps,
        "steps_lost": (cut.step + 1).saturating_sub(agreed.steps),
        "state_transferred": agreed.transferred,
        "detected_unix_ms": detected,
        "healed_unix_ms": healed,
        "reason": reason,
    });
    if trainer.config().diloco().is_some() {
        event["outer_step_ran"] = agreed.outer_step_ran.into();
    }
    event
}

/// The leader's line after a heal (`ms`: from the failure to now).
fn say_healed(epoch: u64, nodes: usize, world: usize, agreed: &Agreed, lost: usize, ms: u64) {
    eprintln!(
        "wiretrain: healed from live replicas: epoch {epoch} on {nodes} node(s) ({world} \
         ranks), going on from step {} with no checkpoint read ({lost} step(s) lost, state \
         {}), {ms} ms after the failure",
        agreed.steps,
        if agreed.transferred {
            "sent from a replica"
        } else {
            "identical on every replica"
        },
    )
}

/// What a run of `world` ranks must satisfy as a new run would (train refuses these at
/// start): fixed shares, one per rank, and micro-batches that divide each rank's batch.
fn check_world(run: &FitOptions, world: usize) -> Result<(), String> {
    if let crate::balance::Balance::Fixed(v) = &run.balance
        && v.len() != world
    {
        return Err(format!(
            "the fixed shares name {} ranks and the healed world has {world}",
            v.len()
        ));
    }
    if run.accumulate > 1 && !(run.global_batch / world).is_multiple_of(run.accumulate) {
        return Err(format!(
            "{} micro-batches do not divide the {} samples a rank of {world} trains on",
            run.accumulate,
            run.global_batch / world
        ));
    }
    Ok(())
}

/// The checkpoint of `steps` when it was due and the failure cut it off (the step's update
/// was applied, its checkpoint not written): written now, in the new epoch, so the cadence
/// the run asked for holds. Rank 0 looks; every rank follows its answer.
fn catch_up_checkpoint<M: Module>(
    trainer: &mut Trainer<M>,
    run: &FitOptions,
    run_meta: &serde_json::Value,
    steps: usize,
) -> Result<(), FitError> {
    let Some(c) = &run.checkpoint else {
        return Ok(());
    };
    let due = c.every.is_some_and(|k| steps.is_multiple_of(k)) || steps == run.steps;
    if steps == 0 || !due {
        return Ok(());
    }
    let pg = trainer.process_group();
    let dir = c.dir.join(crate::checkpoint::step_dir_name(steps));
    let missing = pg.rank() == 0 && crate::checkpoint::Checkpoint::open(&dir).is_err();
    let missing = pg.broadcast(vec![f32::from(u8::from(missing))], 0).wait()?[0] > 0.0;
    if missing {
        let d = trainer.save_checkpoint(&c.dir, steps, run_meta.clone(), c.keep)?;
        if trainer.process_group().rank() == 0 {
            eprintln!(
                "wiretrain: checkpoint of step {steps} written to {} (the failure had cut it off)",
                d.display()
            );
        }
    }
    Ok(())
}
