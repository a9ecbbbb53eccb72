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
//! strategy can resume node 0's model; rank 0 adds the outer state (the round's anchor and
//! the outer momentum). A DiLoCo run resumes each node's own inner state (on fewer nodes,
//! those past the last are dropped; on more, the new ones copy node 0's); from a checkpoint
//! without DiLoCo state it starts a new round at the loaded parameters.

use super::{OtherRank, TrainError, Trainer};
use crate::checkpoint::Checkpoint;
use crate::checkpoint::{
    BuffersManifest, CheckpointError, DilocoManifest, DirLock, FORMAT, FileEntry, LayoutEntry,
    Manifest, OUTER_FILE, OUTER_MOMENTUM, ShardData, ensure_unused, move_aside, prune_stalling,
    step_dir_name, write_manifest, write_named, write_shard,
};
use crate::clock::StepClock;
use crate::optim::ExportedState;
use crate::strategy::flat_ranges;
use burn::module::Module;
use std::path::{Path, PathBuf};
use wiretrain_comm::ReduceOp;

/// Checkpoints `resume_latest` tries, newest first, before it gives up.
const MAX_FALLBACK: usize = 8;

/// What a rank wrote of a checkpoint, before the reports are gathered.
struct Own {
    /// Its shard's outcome, when it writes one.
    shard: Option<Result<FileEntry, CheckpointError>>,
    /// The optimizer state's names and scalars.
    state: ExportedState,
    /// Rank 0 under DiLoCo: the outer state's file.
    outer: Option<FileEntry>,
    /// Rank 0: the module state that is not trained, when the model has any.
    buffers: Option<BuffersManifest>,
}

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
    /// The flat layout as the manifest records it.
    pub fn layout_entries(&self) -> Vec<LayoutEntry> {
        super::buffers::manifest_entries(&self.layout)
    }

    /// The piece `piece` (positions in the concatenation of the owned ranges, what the sync
    /// says this rank writes) of its owned elements: their flat ranges, the parameters over
    /// them and its optimizer state for them; and the optimizer's whole exported state.
    fn shard_data(
        &self,
        piece: std::ops::Range<usize>,
    ) -> Result<(ShardData, ExportedState), TrainError> {
        let params = match self.opt.device_master()? {
            // The fused optimizer holds the f32 master on the device.
            Some(m) => m,
            None => self.sync.owned_values(&self.held),
        };
        let state = self.opt.export_state()?;
        let shard = ShardData {
            ranges: flat_ranges(&self.held.owned, piece.clone()),
            params: params[piece.clone()].to_vec(),
            state: state
                .tensors
                .iter()
                .map(|(k, v)| (k.clone(), v[piece.clone()].to_vec()))
                .collect(),
        };
        Ok((shard, state))
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
        self.sync_host()?;
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
        let rank = self.pg.rank();
        let own = self.write_own(&dir)?;
        // An injected stall between the shards and the manifest (the window in which a crash
        // must not harm older checkpoints).
        if let Some(stall) = self.cfg.faults.checkpoint_stall(step, rank) {
            std::thread::sleep(stall);
        }
        let reports = self.gather_reports(own.shard, step)?;
        let mut status = 0.0f32;
        if rank == 0 {
            let mut manifest = self.manifest(step, run, reports, own.state, own.outer);
            manifest.buffers = own.buffers;
            let res = self.commit(&dir, root, &manifest, keep);
            status = f32::from(u8::from(res.is_err()));
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

    /// Writes this rank's shard (when it writes one) and, on rank 0, the outer state under
    /// DiLoCo and the module state that is not trained.
    fn write_own(&mut self, dir: &Path) -> Result<Own, TrainError> {
        let rank = self.pg.rank();
        let mut own = Own {
            shard: None,
            state: ExportedState::default(),
            outer: None,
            buffers: None,
        };
        if let Some(piece) = self.sync.checkpoint_piece(&self.pg, &self.held) {
            let (shard, st) = self.shard_data(piece)?;
            own.state = st;
            own.shard = Some(write_shard(dir, rank, &shard));
        }
        if rank != 0 || matches!(own.shard, Some(Err(_))) {
            return Ok(own);
        }
        if let Some(o) = self.sync.outer() {
            let outer = ShardData {
                ranges: std::iter::once(0..o.anchor.len()).collect(),
                params: o.anchor.clone(),
                state: vec![(OUTER_MOMENTUM.into(), o.momentum.clone())],
            };
            match write_named(dir, OUTER_FILE, rank, &outer) {
                Ok(f) => own.outer = Some(f),
                Err(e) => own.shard = Some(Err(e)),
            }
        }
        match self.write_buffers(dir) {
            Ok(b) => own.buffers = b,
            Err(TrainError::Checkpoint(e)) => own.shard = Some(Err(e)),
            Err(e) => return Err(e),
        }
        Ok(own)
    }

    /// Every rank's outcome, as a record, to every rank; an error when any rank's write
    /// failed (this rank's own error when it is one of them).
    fn gather_reports(
        &mut self,
        mine: Option<Result<FileEntry, CheckpointError>>,
        step: usize,
    ) -> Result<Vec<Wrote>, TrainError> {
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
        let failed: Vec<usize> = (0..reports.len())
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
        Ok(reports)
    }

    /// Rank 0: the manifest of step `step` from every rank's file (under DiLoCo, nodes past
    /// the first list their inner state apart).
    fn manifest(
        &self,
        step: usize,
        run: serde_json::Value,
        reports: Vec<Wrote>,
        state: ExportedState,
        outer_file: Option<FileEntry>,
    ) -> Manifest {
        let table = self.pg.table();
        let mut files = Vec::new();
        let mut node_files = Vec::new();
        for (r, w) in reports.into_iter().enumerate() {
            let Wrote::File(f) = w else { continue };
            let node = table.locate(r).0;
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
        Manifest {
            format: FORMAT.into(),
            step,
            strategy: self.cfg.strategy.to_string(),
            world: table.world(),
            ranks_per_node: (0..table.num_nodes()).map(|n| table.ranks_on(n)).collect(),
            total: self.layout.total(),
            layout: self.layout_entries(),
            optim_kind: self.opt.kind().into(),
            state_tensors: state.tensors.iter().map(|(n, _)| n.clone()).collect(),
            optim_scalars: state.scalars,
            run,
            files,
            run_id: self.run_id.clone(),
            buffers: None,
            diloco: self.sync.outer().map(|o| DilocoManifest {
                inner_done: o.inner_done,
                outer: outer_file.expect("rank 0 wrote the outer state"),
                nodes: {
                    node_files.resize_with(table.num_nodes() - 1, Vec::new);
                    node_files
                },
            }),
        }
    }

    /// Rank 0: writes the manifest last, checks the new checkpoint reads back, then prunes
    /// older ones (a failed prune costs disk space, not data: the run goes on).
    fn commit(
        &self,
        dir: &Path,
        root: &Path,
        manifest: &Manifest,
        keep: usize,
    ) -> Result<(), TrainError> {
        let step = manifest.step;
        // The new checkpoint must read back before any older one goes. The step directory's
        // own entry in the root is made durable too.
        let res = write_manifest(dir, manifest)
            .and_then(|()| crate::checkpoint::sync_dir(root))
            .and_then(|()| Checkpoint::open(dir));
        if let Err(e) = &res {
            tracing::error!("checkpoint of step {step}: {e}");
        } else if let Err(e) = prune_stalling(root, keep, &self.run_id, self.cfg.faults.stall_prune)
        {
            tracing::warn!("checkpoint of step {step} written; pruning older ones: {e}");
            eprintln!(
                "wiretrain: warning: checkpoint of step {step} written, but older checkpoints \
                 could not be removed: {e}"
            );
        }
        res.map(|_| ()).map_err(Into::into)
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

    /// Locks `root` for this run (a collective; rank 0's process takes the lock, see
    /// [`DirLock`]) and holds it while the returned value lives: `None` on the other ranks.
    /// A directory another run holds is refused on every rank, naming the holder on rank 0
    /// ([`CheckpointError::Locked`]).
    pub fn lock_checkpoint_dir(&mut self, root: &Path) -> Result<Option<DirLock>, TrainError> {
        let mut mine = Ok(None);
        if self.pg.rank() == 0 {
            mine = DirLock::acquire(root).map(Some);
        }
        // 0: locked; 1: held by another run; 2: another error.
        let code = match &mine {
            Ok(_) => 0.0,
            Err(CheckpointError::Locked { .. }) => 1.0,
            Err(_) => 2.0,
        };
        let code = self.pg.broadcast(vec![code], 0).wait()?[0];
        let lock = mine?;
        let root = root.to_path_buf();
        match code {
            0.0 => Ok(lock),
            1.0 => Err(OtherRank::DirLocked { root }.into()),
            _ => Err(OtherRank::DirRefused { root }.into()),
        }
    }
}

mod load;
