//! Saving and loading sharded checkpoints from a running [`Trainer`] (the format is in
//! [`crate::checkpoint`]).
//!
//! Saving is a collective: each writing rank stores the elements it owns (every element is
//! written once: all ranks under ZeRO-1/2/3, each rank its share under DDP, and under hybrid
//! and HSDP each node's ranks 1/nodes of their shard, the replicas splitting what they all
//! hold), then one all-gather brings every file's size, checksum and ranges to rank
//! 0, which writes the manifest last. Loading reads, on each rank, the element ranges this
//! rank owns under the *current* world and strategy, so a checkpoint resumes on any world
//! size or strategy; ranks then agree on success so none is left waiting for another.
//!
//! DiLoCo: every node writes its node's inner state (its first rank under DDP inside the
//! node, its owning ranks when sharded inside it); node 0's is the ordinary file set, so any
//! strategy can resume node 0's model; rank 0 adds the outer state (the round's anchor and the outer momentum). A DiLoCo run resumes each node's own
//! inner state and so needs the same number of nodes; from a checkpoint without DiLoCo state
//! it starts a new round at the loaded parameters.

use super::{OtherRank, TrainError, Trainer};
use crate::checkpoint::Checkpoint;
use crate::checkpoint::{
    CheckpointError, DilocoManifest, FORMAT, FileEntry, LayoutEntry, Manifest, OUTER_FILE,
    OUTER_MOMENTUM, ShardData, ensure_unused, move_aside, prune_stalling, step_dir_name,
    write_manifest, write_named, write_shard,
};
use crate::clock::StepClock;
use crate::optim::ExportedState;
use crate::strategy::{Scope, Stage};
use burn::module::Module;
use std::path::{Path, PathBuf};
use wiretrain_comm::ReduceOp;

/// Checkpoints `resume_latest` tries, newest first, before it gives up.
const MAX_FALLBACK: usize = 8;

/// What a rank reports after its part of a checkpoint save.
#[derive(serde::Serialize, serde::Deserialize)]
enum Wrote {
    /// It writes nothing in this strategy.
    Nothing,
    /// Its write failed (it reports the error itself).
    Failed,
    File(FileEntry),
}

impl<M: Module> Trainer<M> {
    /// Whether this rank writes its owned elements (so that each element is written once).
    fn writes_checkpoint(&self) -> bool {
        let replicated = self.cfg.strategy.stage() == Stage::Replicated;
        if self.sync.outer().is_some() {
            // DiLoCo: every node's inner state, by its first rank (DDP inside the node) or by
            // the ranks that own a part of it (sharded inside the node).
            return match replicated {
                true => self.pg.local_rank() == 0,
                false => self.held.owned.iter().any(|r| !r.is_empty()),
            };
        }
        match (replicated, self.cfg.strategy.scope()) {
            // Every rank holds everything: each writes its share, so no rank writes it all.
            (true, _) => !self.ddp_write_range().is_empty(),
            (false, Scope::World) => true,
            (false, Scope::Node) => !self.replica_write_piece().is_empty(),
        }
    }

    /// Under hybrid and HSDP (without DiLoCo), every node holds the same shards, so node k
    /// writes the k-th of `nodes` equal pieces of this rank's shard: a range of positions in
    /// the shard (the concatenation of `owned`), so each element is written once and no node
    /// writes it all.
    fn replica_write_piece(&self) -> std::ops::Range<usize> {
        let held = self.held.owned_len();
        let nodes = self.pg.table().num_nodes();
        let k = self.pg.node();
        held * k / nodes..held * (k + 1) / nodes
    }

    /// The flat layout as the manifest records it.
    pub fn layout_entries(&self) -> Vec<LayoutEntry> {
        self.layout
            .entries()
            .iter()
            .map(|e| LayoutEntry {
                path: e.path.clone(),
                shape: e.shape.clone(),
                offset: e.offset,
                len: e.len,
            })
            .collect()
    }

    /// This rank's owned element ranges, the parameters over them and its optimizer state.
    fn shard_data(&self) -> Result<(ShardData, ExportedState), TrainError> {
        let device = self.opt.device_master()?;
        let stage = self.cfg.strategy.stage();
        let params: Vec<f32> = match (device, stage) {
            // The fused optimizer holds the f32 master on the device.
            (Some(m), _) => m,
            (None, Stage::Parameters) => self.held.params.clone(),
            // The f32 master, not the compute copy a narrow wire dtype rounds.
            (None, Stage::OptimizerState | Stage::Gradients) => self.held.master.clone(),
            (None, Stage::Replicated) => self.held.owned_of(&self.held.params),
        };
        let mut state = self.opt.export_state()?;
        let diloco = self.sync.outer().is_some();
        if !diloco && stage == Stage::Replicated {
            // DDP owns the whole vector; this rank writes its share of it.
            let r = self.ddp_write_range();
            for (_, v) in &mut state.tensors {
                *v = v[r.clone()].to_vec();
            }
            let shard = ShardData {
                ranges: vec![r.clone()],
                params: params[r].to_vec(),
                state: state.tensors.clone(),
            };
            return Ok((shard, state));
        }
        if !diloco && self.cfg.strategy.scope() == Scope::Node {
            // The replicas split the shard: this node's piece of it, mapped to flat ranges.
            let piece = self.replica_write_piece();
            let mut ranges = Vec::new();
            let mut at = 0;
            for r in &self.held.owned {
                let (lo, hi) = (piece.start.max(at), piece.end.min(at + r.len()));
                if lo < hi {
                    ranges.push(r.start + (lo - at)..r.start + (hi - at));
                }
                at += r.len();
            }
            let shard = ShardData {
                ranges,
                params: params[piece.clone()].to_vec(),
                state: state
                    .tensors
                    .iter()
                    .map(|(k, v)| (k.clone(), v[piece.clone()].to_vec()))
                    .collect(),
            };
            return Ok((shard, state));
        }
        Ok((
            ShardData {
                ranges: self.held.owned.clone(),
                params,
                state: state.tensors.clone(),
            },
            state,
        ))
    }

    /// Under DDP (without DiLoCo), the part of the flat vector this rank writes.
    fn ddp_write_range(&self) -> std::ops::Range<usize> {
        self.pg.shard_range(self.layout.total())
    }

    /// Writes a checkpoint of the state after `step` optimizer steps into
    /// `root/step-{step}/`; a collective (every rank calls it after the same step). `run`
    /// is recorded in the manifest (the CLI stores seed, global batch and the like); `keep`
    /// valid checkpoints are kept, older ones removed. Returns the step directory.
    pub fn save_checkpoint(
        &mut self,
        root: &Path,
        step: usize,
        run: serde_json::Value,
        keep: usize,
    ) -> Result<PathBuf, TrainError> {
        // Writers take as long as the disk does: the collectives that wait for them get the
        // checkpoint timeout, not the step's.
        let t = self.cfg.checkpoint_timeout.max(self.pg.timeout());
        let before = self.pg.set_timeout(t);
        let res = self.save_checkpoint_within(root, step, run, keep);
        self.pg.set_timeout(before);
        res
    }

    fn save_checkpoint_within(
        &mut self,
        root: &Path,
        step: usize,
        run: serde_json::Value,
        keep: usize,
    ) -> Result<PathBuf, TrainError> {
        let dir = root.join(step_dir_name(step));
        let (rank, world) = (self.pg.rank(), self.pg.world());
        let mut mine: Option<Result<FileEntry, CheckpointError>> = None;
        let mut state = ExportedState::default();
        let mut outer_file = None;
        if self.writes_checkpoint() {
            let (shard, st) = self.shard_data()?;
            state = st;
            mine = Some(write_shard(&dir, rank, &shard));
        }
        if rank == 0
            && let Some(o) = self.sync.outer()
            && let Some(Ok(_)) = &mine
        {
            let outer = ShardData {
                ranges: std::iter::once(0..o.anchor.len()).collect(),
                params: o.anchor.clone(),
                state: vec![(OUTER_MOMENTUM.into(), o.momentum.clone())],
            };
            match write_named(&dir, OUTER_FILE, rank, &outer) {
                Ok(f) => outer_file = Some(f),
                Err(e) => mine = Some(Err(e)),
            }
        }
        // An injected stall between the shards and the manifest (the window in which a crash
        // must not harm older checkpoints).
        if let Some(stall) = self.cfg.faults.checkpoint_stall(step, rank) {
            std::thread::sleep(stall);
        }
        // Every rank's outcome, as a record, to every rank (rank 0 writes the manifest).
        let report = match &mine {
            None => Wrote::Nothing,
            Some(Err(_)) => Wrote::Failed,
            Some(Ok(f)) => Wrote::File(f.clone()),
        };
        let report = serde_json::to_vec(&report).expect("a report serializes");
        let reports = self
            .pg
            .all_gather_bytes(&report)?
            .iter()
            .map(|b| serde_json::from_slice::<Wrote>(b))
            .collect::<Result<Vec<_>, _>>()
            .map_err(OtherRank::UnreadableReport)?;
        let failed: Vec<usize> = (0..world)
            .filter(|&r| matches!(reports[r], Wrote::Failed))
            .collect();
        if let Some(Err(e)) = mine {
            return Err(e.into());
        }
        if !failed.is_empty() {
            return Err(OtherRank::ShardsNotWritten {
                step,
                ranks: failed,
            }
            .into());
        }
        let mut status = 0.0f32;
        if rank == 0 {
            let mut files = Vec::new();
            let mut node_files = Vec::new();
            for (r, w) in reports.into_iter().enumerate() {
                let Wrote::File(f) = w else { continue };
                let node = self.pg.table().locate(r).0;
                let to = if self.sync.outer().is_some() && node > 0 {
                    if node_files.len() < node {
                        node_files.resize_with(node, Vec::new);
                    }
                    &mut node_files[node - 1]
                } else {
                    &mut files
                };
                to.push(FileEntry { rank: r, ..f });
            }
            let table = self.pg.table();
            let manifest = Manifest {
                format: FORMAT.into(),
                step,
                strategy: self.cfg.strategy.to_string(),
                world,
                ranks_per_node: (0..table.num_nodes()).map(|n| table.ranks_on(n)).collect(),
                total: self.layout.total(),
                layout: self.layout_entries(),
                optim_kind: self.opt.kind().into(),
                state_tensors: state.tensors.iter().map(|(n, _)| n.clone()).collect(),
                optim_scalars: state.scalars,
                run,
                files,
                run_id: self.run_id.clone(),
                diloco: self.sync.outer().map(|o| DilocoManifest {
                    inner_done: o.inner_done,
                    outer: outer_file.clone().expect("rank 0 wrote the outer state"),
                    nodes: {
                        node_files.resize_with(table.num_nodes() - 1, Vec::new);
                        node_files
                    },
                }),
            };
            // The new checkpoint must read back before any older one goes.
            // The step directory's own entry in the root is made durable too.
            let res = write_manifest(&dir, &manifest)
                .and_then(|()| crate::checkpoint::sync_dir(root))
                .and_then(|()| Checkpoint::open(&dir));
            match &res {
                Err(e) => {
                    tracing::error!("checkpoint of step {step}: {e}");
                    status = 1.0;
                }
                // A failed prune costs disk space, not data: the run goes on.
                Ok(_) => {
                    let stall = self.cfg.faults.stall_prune;
                    if let Err(e) = prune_stalling(root, keep, &self.run_id, stall) {
                        tracing::warn!(
                            "checkpoint of step {step} written; pruning older ones: {e}"
                        );
                        eprintln!(
                            "wiretrain: warning: checkpoint of step {step} written, but older \
                             checkpoints could not be removed: {e}"
                        );
                    }
                }
            }
            let res = res.map(|_| ());
            let agreed = self.pg.broadcast(vec![status], 0).wait()?;
            res?;
            debug_assert_eq!(agreed[0], 0.0);
        } else {
            status = self.pg.broadcast(vec![status], 0).wait()?[0];
        }
        if status != 0.0 {
            return Err(OtherRank::ManifestNotWritten { step }.into());
        }
        Ok(dir)
    }

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
        // Rank 0 lists the checkpoints; every rank gets its answer: the newest steps, or
        // that it could not read the directory.
        let mut mine = None;
        let mut listed: Result<Vec<u64>, ()> = Ok(Vec::new());
        if self.pg.rank() == 0 {
            match crate::checkpoint::list_valid(root) {
                Ok(valid) => {
                    listed = Ok(valid
                        .iter()
                        .rev()
                        .take(MAX_FALLBACK)
                        .map(|(s, _)| *s as u64)
                        .collect());
                }
                Err(e) => {
                    listed = Err(());
                    mine = Some(e);
                }
            }
        }
        let bytes = serde_json::to_vec(&listed).expect("a list serializes");
        let got = self.pg.broadcast_bytes(&bytes, 0)?;
        if let Some(e) = mine {
            return Err(e.into());
        }
        let steps: Vec<usize> = match serde_json::from_slice::<Result<Vec<u64>, ()>>(&got) {
            Ok(Ok(steps)) => steps.into_iter().map(|s| s as usize).collect(),
            _ => {
                return Err(OtherRank::ListUnreadable {
                    root: root.to_path_buf(),
                }
                .into());
            }
        };
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

    /// Claims `root` for a fresh run's checkpoints, before step 0 (a collective; rank 0 looks).
    /// A directory that already holds valid checkpoints is refused
    /// ([`CheckpointError::InUse`]): a later resume would load whichever run's checkpoint is
    /// newest. With `overwrite` they are moved aside into `root/previous-<time>/` instead.
    pub fn claim_checkpoint_dir(&mut self, root: &Path, overwrite: bool) -> Result<(), TrainError> {
        let mut mine = Ok(());
        if self.pg.rank() == 0 {
            mine = if overwrite {
                move_aside(root).map(|moved| {
                    if let Some(d) = moved {
                        eprintln!(
                            "wiretrain: --overwrite-checkpoints: earlier checkpoints moved to {}",
                            d.display()
                        );
                    }
                })
            } else {
                ensure_unused(root)
            };
        }
        let failed = self
            .pg
            .broadcast(vec![f32::from(u8::from(mine.is_err()))], 0)
            .wait()?[0];
        mine?;
        if failed != 0.0 {
            return Err(OtherRank::DirRefused {
                root: root.to_path_buf(),
            }
            .into());
        }
        Ok(())
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
    fn finish_load(&mut self) -> Result<(), TrainError> {
        if self.cfg.strategy.shards_params() {
            return Ok(());
        }
        let clock = StepClock::since(std::time::Instant::now());
        let (mut cx, sync, held) = self.sync_cx(&clock);
        sync.refresh(&mut cx, held)?;
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
            return Ok(());
        };
        if m.ranks_per_node.len() != nodes {
            return Err(CheckpointError::Mismatch {
                path: ck.dir.clone(),
                reason: format!(
                    "it holds the DiLoCo inner state of {} nodes and this run has {nodes}; \
                     each node resumes its own inner state, so resume on {} nodes (any other \
                     strategy can resume node 0's model from it)",
                    m.ranks_per_node.len(),
                    m.ranks_per_node.len()
                ),
            }
            .into());
        }
        if outer.anchor.len() != self.held.params.len() {
            return Err(CheckpointError::Mismatch {
                path: ck.dir.clone(),
                reason: "the outer state does not match the model".into(),
            }
            .into());
        }
        let node = self.pg.node();
        if node > 0 {
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
        }
        let o = self.sync.outer_mut().expect("diloco state");
        o.anchor = outer.anchor;
        o.momentum = outer.momentum;
        o.inner_done = outer.inner_done;
        Ok(())
    }
}
