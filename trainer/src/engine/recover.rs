//! One recovery after a lost node, for `wiretrain::fit`'s loop and the Learner's alike: the
//! rank joins the next job epoch through its node's [`Healer`], the trainer takes the new
//! process group ([`Trainer::rebind`]), welcomes the nodes that join in place, runs the
//! loop's own step (the Learner agrees where each rank was cut off), and the ranks agree on
//! one state ([`Trainer::agree_state`]). Each loop keeps only its bookkeeping around it
//! (sampler, pace, records, messages).

use super::heal::Agreed;
use super::{TrainError, Trainer};
use crate::heal::{HealError, Healer};
use crate::job::Elastic;
use burn::module::Module;

/// Why a trainer could not recover from live replicas: the run then fails with it, and an
/// elastic launch restarts from the checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecoverError {
    /// The node could not join the next epoch.
    #[error(transparent)]
    Rejoin(#[from] HealError),
    /// This rank's state does not fit the new world.
    #[error("{0}")]
    Rebind(String),
    /// The loop cannot go on in the new world; the message says why.
    #[error("{0}")]
    Refused(String),
    /// A collective of the recovery failed.
    #[error(transparent)]
    Train(#[from] TrainError),
}

/// How a loop takes part in a recovery.
pub(crate) struct Recovery<'a> {
    pub healer: &'a Healer,
    /// The failure, in words.
    pub reason: &'a str,
    /// Steps the trainer's state holds.
    pub done: usize,
    /// Why this loop cannot take nodes that join in place (`None`: it can).
    pub refuse_joiners: Option<&'a str>,
}

/// A recovered trainer's place in the new epoch.
pub(crate) struct Recovered<T> {
    pub agreed: Agreed,
    pub elastic: Elastic,
    /// Nodes joined in place in this epoch.
    pub joined: bool,
    /// What the loop's own step (between the rebind and the agreement) returned.
    pub between: T,
}

impl<M: Module> Trainer<M> {
    /// Recovers after a lost node (see the module doc); `between` runs after the rebind and
    /// before the agreement, with whether this rank was rank 0 before the failure.
    pub(crate) fn recover<T>(
        &mut self,
        r: Recovery<'_>,
        between: impl FnOnce(&mut Self, bool) -> Result<T, RecoverError>,
    ) -> Result<Recovered<T>, RecoverError> {
        let pg = self.process_group();
        let (local, was_leader, old_node) = (pg.local_rank(), pg.rank() == 0, pg.node());
        let rj = r.healer.rejoin(local, r.done, r.reason)?;
        if let (true, Some(why)) = (rj.joined, r.refuse_joiners) {
            return Err(RecoverError::Refused(why.to_string()));
        }
        self.rebind(rj.pg).map_err(RecoverError::Rebind)?;
        let done = self.heal_test_fault(old_node, r.done);
        if rj.joined {
            // Newcomers build their trainers (collectives this rank meets) before they agree.
            self.welcome_joiners()?;
        }
        let between = between(self, was_leader)?;
        let agreed = self.agree_state(done)?;
        Ok(Recovered {
            agreed,
            elastic: rj.elastic,
            joined: rj.joined,
            between,
        })
    }
}
