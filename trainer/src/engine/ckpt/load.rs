//! Loading a checkpoint into a running [`Trainer`]: the elements this rank owns under the
//! current world and strategy, the newest readable checkpoint of a directory (falling back to
//! older ones), DiLoCo's node and outer state, and the agreement that every rank loaded.

use super::*;

impl<M: Module> Trainer<M> {
    /// Loads `ck` into this trainer, whatever world size and strategy wrote it: parameters
    /// and optimizer state of the elements this rank owns now. A collective: every rank
    /// learns whether all ranks loaded, so a failure on one rank stops all of them (each
    /// rank reads without communicating, and only after all agree do they gather).
    pub fn load_checkpoint(&mut self, ck: &Checkpoint) -> Result<(), TrainError> {
        let res = self.load_local(ck);
        self.agree(res, &ck.dir)?;
        self.finish_load()
    }

    /// Loads the newest checkpoint under `root` that every rank can read and verify (the
    /// steps as rank 0 lists them, newest first): a corrupt or unreadable newest checkpoint
    /// falls back to the older one kept beside it, with a warning naming the file. A
    /// checkpoint that does not fit this run (another model, optimizer) is an error, never
    /// skipped. `None` when there is no checkpoint. A collective.
    pub fn resume_latest(&mut self, root: &Path) -> Result<Option<Manifest>, TrainError> {
        let steps = self.agreed_steps(root)?;
        let mut first_err = None;
        let none_listed = steps.is_empty();
        for step in steps {
            let dir = root.join(step_dir_name(step));
            let res = Checkpoint::open(&dir)
                .map_err(TrainError::from)
                .and_then(|ck| self.load_local(&ck).map(|()| ck));
            let (unreadable, unfit) = match &res {
                Ok(_) => (0.0, 0.0),
                Err(TrainError::Checkpoint(
                    CheckpointError::Io { .. }
                    | CheckpointError::Checksum { .. }
                    | CheckpointError::Corrupt { .. }
                    | CheckpointError::NotFound(_),
                )) => (1.0, 0.0),
                Err(_) => (0.0, 1.0),
            };
            if let Err(e) = &res {
                tracing::error!("rank {}: {e}", self.pg.rank());
            }
            let all = self
                .pg
                .all_reduce(vec![unreadable, unfit], ReduceOp::Sum)
                .wait()?;
            match res {
                Ok(ck) if all[0] == 0.0 && all[1] == 0.0 => {
                    self.finish_load()?;
                    // Resuming continues that run: its checkpoints are ours to prune.
                    self.run_id = ck.manifest.run_id.clone();
                    return Ok(Some(ck.manifest));
                }
                Err(e) if all[1] > 0.0 => return Err(e),
                _ if all[1] > 0.0 => {
                    return Err(OtherRank::CheckpointUnfit {
                        ranks: all[1] as usize,
                        dir: dir.to_path_buf(),
                    }
                    .into());
                }
                res => {
                    if self.pg.rank() == 0 {
                        eprintln!(
                            "wiretrain: warning: checkpoint {} cannot be used ({} rank(s) could \
                             not read or verify it; errors above); trying the one before it",
                            dir.display(),
                            all[0]
                        );
                    }
                    if let Err(e) = res {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None if none_listed => Ok(None),
            None => Err(OtherRank::NoneLoadable {
                root: root.to_path_buf(),
            }
            .into()),
        }
    }

    /// The newest valid steps under `root` (at most [`MAX_FALLBACK`], newest first), agreed by
    /// every rank: each lists its own directory (machine-local disks differ), and when a
    /// rank's list differs from rank 0's the resume fails naming both, unless the
    /// configuration trusts rank 0's list ([`TrainerConfigBuilder::trust_rank0_checkpoints`]).
    ///
    /// [`TrainerConfigBuilder::trust_rank0_checkpoints`]: crate::engine::TrainerConfigBuilder::trust_rank0_checkpoints
    fn agreed_steps(&mut self, root: &Path) -> Result<Vec<usize>, TrainError> {
        let (listed, mine) = match crate::checkpoint::list_valid(root) {
            Ok(valid) => {
                let steps = valid.iter().rev().take(MAX_FALLBACK);
                (
                    Ok(steps.map(|(s, _)| *s as u64).collect::<Vec<u64>>()),
                    None,
                )
            }
            Err(e) => (Err(()), Some(e)),
        };
        let bytes = serde_json::to_vec(&listed).expect("a list serializes");
        // At most MAX_FALLBACK steps in JSON: a longer list is refused before it is read.
        let all = self
            .pg
            .all_gather_bytes_within(&bytes, 64 + 24 * MAX_FALLBACK)?;
        if let Some(e) = mine {
            return Err(e.into());
        }
        let parse = |b: &[u8]| serde_json::from_slice::<Result<Vec<u64>, ()>>(b).ok();
        let lists: Vec<Option<Result<Vec<u64>, ()>>> = all.iter().map(|b| parse(b)).collect();
        let Some(Ok(steps)) = lists[0].clone() else {
            return Err(OtherRank::ListUnreadable {
                root: root.to_path_buf(),
            }
            .into());
        };
        if !self.cfg.trust_rank0_checkpoints
            && let Some((rank, theirs)) = lists
                .iter()
                .enumerate()
                .find(|(_, l)| l.as_ref() != Some(&Ok(steps.clone())))
        {
            return Err(OtherRank::ListingsDiffer {
                root: root.to_path_buf(),
                rank,
                theirs: match theirs {
                    Some(Ok(s)) => format!("{s:?}"),
                    _ => "an unreadable directory".into(),
                },
                rank0: format!("{steps:?}"),
            }
            .into());
        }
        Ok(steps.into_iter().map(|s| s as usize).collect())
    }

    /// Every rank learns whether all of them succeeded; a failing rank logs its own error
    /// (so the file at fault is named whichever rank hit it) and returns it.
    fn agree(&mut self, res: Result<(), TrainError>, dir: &Path) -> Result<(), TrainError> {
        if let Err(e) = &res {
            tracing::error!("rank {}: {e}", self.pg.rank());
        }
        let failed = self
            .pg
            .all_reduce(vec![f32::from(u8::from(res.is_err()))], ReduceOp::Sum)
            .wait()?[0];
        res?;
        if failed > 0.0 {
            return Err(OtherRank::LoadFailed {
                ranks: failed as usize,
                dir: dir.to_path_buf(),
            }
            .into());
        }
        Ok(())
    }

    fn load_local(&mut self, ck: &Checkpoint) -> Result<(), TrainError> {
        ck.check_layout(&self.layout_entries())?;
        let m = &ck.manifest;
        if m.optim_kind != self.opt.kind() {
            return Err(CheckpointError::Mismatch {
                path: ck.dir.clone(),
                reason: format!(
                    "it holds {} optimizer state, this run uses {}",
                    m.optim_kind,
                    self.opt.kind()
                ),
            }
            .into());
        }
        let data = ck.read_ranges(&self.held.owned)?;
        self.opt
            .import_state(ExportedState {
                tensors: data.state,
                scalars: m.optim_scalars.clone(),
            })
            .map_err(|reason| CheckpointError::Mismatch {
                path: ck.dir.clone(),
                reason: reason.to_string(),
            })?;
        if self.cfg.strategy.shards_params() {
            self.held.params = data.params;
        } else {
            self.held.params = ck.read_params()?;
            self.reset_master();
        }
        self.load_buffers(ck)?;
        if self.sync.outer().is_some() {
            // DiLoCo: this node's inner state and the outer state, or a new round at the
            // loaded parameters when the checkpoint has no DiLoCo state.
            self.load_diloco_state(ck)?;
        }
        Ok(())
    }

    /// After every rank loaded its part: what the model computes with is what a step's
    /// gather gives (the masters through the wire dtype; the node's gather under hybrid), so
    /// a resumed run continues bit for bit. A collective for the sharded strategies.
    pub(in crate::engine) fn finish_load(&mut self) -> Result<(), TrainError> {
        if self.cfg.strategy.shards_params() {
            return Ok(());
        }
        let clock = StepClock::since(std::time::Instant::now());
        let (mut cx, sync) = self.sync_cx(&clock);
        sync.refresh(&mut cx)?;
        let model = self.model.take().expect("model present between steps");
        self.model = Some(self.layout.unflatten(model, &self.held.params));
        Ok(())
    }

    fn load_diloco_state(&mut self, ck: &Checkpoint) -> Result<(), TrainError> {
        let m = &ck.manifest;
        let nodes = self.pg.table().num_nodes();
        let Some(outer) = ck.read_outer()? else {
            tracing::info!(
                "{}: no DiLoCo state in the checkpoint; a new outer round starts at its parameters",
                ck.dir.display()
            );
            let params = self.held.params.clone();
            let o = self.sync.outer_mut().expect("diloco state");
            o.momentum = vec![0.0; params.len()];
            o.anchor = params;
            o.inner_done = 0;
            o.rounds = 0;
            return Ok(());
        };
        // Each node resumes its own inner state. On fewer nodes, the inner progress of the
        // nodes past the last since the round's anchor is dropped (as when they are lost);
        // on more, the new nodes start the round at the anchor with node 0's inner optimizer
        // state (as a node joining in place does).
        let saved = m.ranks_per_node.len();
        if saved != nodes && self.pg.rank() == 0 {
            let what = if saved > nodes {
                format!(
                    "the inner steps of node(s) {nodes}..{saved} since the round's anchor are \
                     dropped"
                )
            } else {
                format!(
                    "node(s) {saved}..{nodes} start the round at its anchor, with node 0's \
                     inner optimizer state"
                )
            };
            tracing::warn!(
                "{}: DiLoCo state of {saved} node(s) resumed on {nodes}: {what}",
                ck.dir.display()
            );
        }
        if outer.anchor.len() != self.held.params.len() {
            return Err(CheckpointError::Mismatch {
                path: ck.dir.clone(),
                reason: "the outer state does not match the model".into(),
            }
            .into());
        }
        let node = self.pg.node();
        if node > 0 && node < saved {
            // This node's whole inner state; this rank keeps the state of what it owns.
            let all: Vec<_> = std::iter::once(0..self.layout.total()).collect();
            let whole = ck.read_node(node, &all)?;
            let tensors = whole
                .state
                .iter()
                .map(|(name, v)| (name.clone(), self.held.owned_of(v)))
                .collect();
            self.opt
                .import_state(ExportedState {
                    tensors,
                    scalars: m.optim_scalars.clone(),
                })
                .map_err(|reason| CheckpointError::Mismatch {
                    path: ck.dir.clone(),
                    reason: reason.to_string(),
                })?;
            self.held.params = whole.params;
            self.reset_master();
        } else if node >= saved {
            self.held.params.clone_from(&outer.anchor);
            self.reset_master();
        }
        let rounds = outer.inner_done / self.cfg.diloco().map_or(1, |d| d.inner_steps);
        let o = self.sync.outer_mut().expect("diloco state");
        o.anchor = outer.anchor;
        o.momentum = outer.momentum;
        o.inner_done = outer.inner_done;
        // A checkpoint is written after a whole step: its round's outer step ran.
        o.rounds = rounds;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
