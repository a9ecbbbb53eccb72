//! Saving and loading sharded checkpoints from a running [`Trainer`] (the format is in
//! [`crate::checkpoint`]).
//!
//! Saving is a collective: each writing rank stores the elements it owns (every element is
//! written once: all ranks under ZeRO-1/2/3, rank 0 under DDP, the ranks of node 0 under
//! hybrid and HSDP), then one all-gather brings every file's size, checksum and ranges to rank
//! 0, which writes the manifest last. Loading reads, on each rank, the element ranges this
//! rank owns under the *current* world and strategy, so a checkpoint resumes on any world
//! size or strategy; ranks then agree on success so none is left waiting for another.
//!
//! DiLoCo: every node writes its node's inner state (its first rank under DDP inside the
//! node, its owning ranks when sharded inside it); node 0's is the ordinary file set, so any
//! strategy can resume node 0's model; rank 0 adds the outer state (the round's anchor and the outer momentum). A DiLoCo run resumes each node's own
//! inner state and so needs the same number of nodes; from a checkpoint without DiLoCo state
//! it starts a new round at the loaded parameters.

use super::{TrainError, Trainer};
use crate::checkpoint::Checkpoint;
use crate::checkpoint::{
    CheckpointError, DilocoManifest, FORMAT, FileEntry, LayoutEntry, Manifest, OUTER_FILE,
    OUTER_MOMENTUM, ShardData, f32s_to_u64, prune, step_dir_name, u64_to_f32s, write_manifest,
    write_named, write_shard,
};
use crate::optim::ExportedState;
use crate::strategy::Strategy;
use burn::module::Module;
use std::path::{Path, PathBuf};
use wiretrain_comm::ReduceOp;

/// Values per rank in the first all-gather: status, bytes (4), sha256 (16), range count (4).
const HEAD: usize = 25;

impl<M: Module> Trainer<M> {
    /// Whether this rank writes its owned elements (so that each element is written once).
    fn writes_checkpoint(&self) -> bool {
        if self.outer.is_some() {
            // DiLoCo: every node's inner state, by its first rank (DDP inside the node) or by
            // the ranks that own a part of it (sharded inside the node).
            return match self.cfg.strategy {
                Strategy::Ddp => self.pg.local_rank() == 0,
                _ => self.owned.iter().any(|r| !r.is_empty()),
            };
        }
        match self.cfg.strategy {
            Strategy::Ddp => self.pg.rank() == 0,
            Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3 => true,
            Strategy::Hybrid | Strategy::Hsdp => {
                self.pg.node() == 0 && self.owned.iter().any(|r| !r.is_empty())
            }
        }
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
        let device = self.opt.device_master().map_err(TrainError::Optimizer)?;
        let params: Vec<f32> = match (device, self.cfg.strategy) {
            // The fused optimizer holds the f32 master on the device.
            (Some(m), _) => m,
            (None, strategy) => match strategy {
                Strategy::Zero3 | Strategy::Hsdp => self.params.clone(),
                // The f32 master, not the compute copy a narrow wire dtype rounds.
                Strategy::Zero1 | Strategy::Zero2 | Strategy::Hybrid => self.master.clone(),
                Strategy::Ddp => self
                    .owned
                    .iter()
                    .flat_map(|r| self.params[r.clone()].iter().copied())
                    .collect(),
            },
        };
        let state = self.opt.export_state().map_err(TrainError::Config)?;
        Ok((
            ShardData {
                ranges: self.owned.clone(),
                params,
                state: state.tensors.clone(),
            },
            state,
        ))
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
            && let Some(o) = &self.outer
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
        // Test hook for the crash-during-checkpoint fault test: stall between the shards and
        // the manifest (the window in which a crash must not harm older checkpoints).
        if let Some(ms) = stall_ms(step) {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        let mut head = vec![0.0f32; HEAD];
        match &mine {
            None => {}
            Some(Err(_)) => head[0] = 2.0,
            Some(Ok(f)) => {
                head[0] = 1.0;
                head[1..5].copy_from_slice(&u64_to_f32s(f.bytes));
                for (i, pair) in f.sha256.as_bytes().chunks(4).enumerate() {
                    let v = u16::from_str_radix(std::str::from_utf8(pair).unwrap_or("0"), 16)
                        .unwrap_or(0);
                    head[5 + i] = f32::from(v);
                }
                head[21..25].copy_from_slice(&u64_to_f32s(f.ranges.len() as u64));
            }
        }
        let heads = self.pg.all_gather(head, HEAD * world).wait()?;
        let failed: Vec<usize> = (0..world).filter(|r| heads[r * HEAD] == 2.0).collect();
        if let Some(Err(e)) = mine {
            return Err(e.into());
        }
        if !failed.is_empty() {
            return Err(TrainError::OtherRank(format!(
                "checkpoint of step {step} not written: rank(s) {failed:?} could not write their \
                 shard (older checkpoints are untouched)"
            )));
        }
        // Every file's ranges, padded to the longest list.
        let max_ranges = (0..world)
            .map(|r| f32s_to_u64(&heads[r * HEAD + 21..r * HEAD + 25]) as usize)
            .max()
            .unwrap_or(0);
        let mut rbuf = vec![0.0f32; 8 * max_ranges];
        if let Some(Ok(f)) = &mine {
            for (i, r) in f.ranges.iter().enumerate() {
                rbuf[8 * i..8 * i + 4].copy_from_slice(&u64_to_f32s(r[0] as u64));
                rbuf[8 * i + 4..8 * i + 8].copy_from_slice(&u64_to_f32s(r[1] as u64));
            }
        }
        let all_ranges = if max_ranges > 0 {
            self.pg.all_gather(rbuf, 8 * max_ranges * world).wait()?
        } else {
            Vec::new()
        };
        let mut status = 0.0f32;
        if rank == 0 {
            let mut files = Vec::new();
            let mut node_files = Vec::new();
            for r in 0..world {
                let h = &heads[r * HEAD..(r + 1) * HEAD];
                if h[0] != 1.0 {
                    continue;
                }
                let n = f32s_to_u64(&h[21..25]) as usize;
                let base = r * 8 * max_ranges;
                let ranges = (0..n)
                    .map(|i| {
                        let at = base + 8 * i;
                        [
                            f32s_to_u64(&all_ranges[at..at + 4]) as usize,
                            f32s_to_u64(&all_ranges[at + 4..at + 8]) as usize,
                        ]
                    })
                    .collect();
                let node = self.pg.table().locate(r).0;
                let to = if self.outer.is_some() && node > 0 {
                    if node_files.len() < node {
                        node_files.resize_with(node, Vec::new);
                    }
                    &mut node_files[node - 1]
                } else {
                    &mut files
                };
                to.push(FileEntry {
                    name: crate::checkpoint::shard_file_name(r),
                    rank: r,
                    ranges,
                    bytes: f32s_to_u64(&h[1..5]),
                    sha256: h[5..21]
                        .iter()
                        .map(|v| format!("{:04x}", *v as u16))
                        .collect(),
                });
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
                diloco: self.outer.as_ref().map(|o| DilocoManifest {
                    inner_done: o.inner_done,
                    outer: outer_file.clone().expect("rank 0 wrote the outer state"),
                    nodes: {
                        node_files.resize_with(table.num_nodes() - 1, Vec::new);
                        node_files
                    },
                }),
            };
            let res = write_manifest(&dir, &manifest).and_then(|()| prune(root, keep));
            if let Err(e) = &res {
                tracing::error!("checkpoint of step {step}: {e}");
                status = 1.0;
            }
            let agreed = self.pg.broadcast(vec![status], 0).wait()?;
            res?;
            debug_assert_eq!(agreed[0], 0.0);
        } else {
            status = self.pg.broadcast(vec![status], 0).wait()?[0];
        }
        if status != 0.0 {
            return Err(TrainError::OtherRank(format!(
                "checkpoint of step {step}: rank 0 could not write the manifest"
            )));
        }
        Ok(dir)
    }

    /// Loads `ck` into this trainer, whatever world size and strategy wrote it: parameters
    /// and optimizer state of the elements this rank owns now. A collective: every rank
    /// learns whether all ranks loaded, so a failure on one rank stops all of them.
    pub fn load_checkpoint(&mut self, ck: &Checkpoint) -> Result<(), TrainError> {
        let res = self.load_local(ck);
        self.agree(res, &ck.dir)
    }

    /// Loads the newest valid checkpoint under `root` as rank 0 sees it (every rank then opens
    /// that step); `None` when there is none. A collective.
    pub fn resume_latest(&mut self, root: &Path) -> Result<Option<Manifest>, TrainError> {
        let mut head = vec![0.0f32; 5];
        let mut mine = None;
        if self.pg.rank() == 0 {
            match Checkpoint::latest(root) {
                Ok(Some(ck)) => {
                    head[0] = 1.0;
                    head[1..5].copy_from_slice(&u64_to_f32s(ck.manifest.step as u64));
                }
                Ok(None) => {}
                Err(e) => {
                    head[0] = 2.0;
                    mine = Some(e);
                }
            }
        }
        let head = self.pg.broadcast(head, 0).wait()?;
        if let Some(e) = mine {
            return Err(e.into());
        }
        match head[0] {
            0.0 => return Ok(None),
            1.0 => {}
            _ => {
                return Err(TrainError::OtherRank(format!(
                    "rank 0 could not read the checkpoints in {}",
                    root.display()
                )));
            }
        }
        let dir = root.join(step_dir_name(f32s_to_u64(&head[1..5]) as usize));
        let ck = match Checkpoint::open(&dir) {
            Ok(ck) => ck,
            // `agree` returns this rank's error after the others learned of it.
            Err(e) => return self.agree(Err(e.into()), &dir).map(|()| None),
        };
        self.load_checkpoint(&ck)?;
        Ok(Some(ck.manifest))
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
            return Err(TrainError::OtherRank(format!(
                "{failed} rank(s) could not load checkpoint {} (their errors are above)",
                dir.display()
            )));
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
        let data = ck.read_ranges(&self.owned)?;
        self.opt
            .import_state(ExportedState {
                tensors: data.state,
                scalars: m.optim_scalars.clone(),
            })
            .map_err(|reason| CheckpointError::Mismatch {
                path: ck.dir.clone(),
                reason,
            })?;
        if self.cfg.strategy.shards_params() {
            self.params = data.params;
        } else {
            self.params = ck.read_params()?;
            self.master = super::owned_master(self.cfg.strategy, &self.owned, &self.params);
            if self.cfg.strategy != Strategy::Ddp {
                // What the model computes with is what a step's gather gives (the masters
                // through the wire dtype), so a resumed run continues bit for bit.
                self.gather_shards()?;
            }
            let model = self.model.take().expect("model present between steps");
            self.model = Some(self.layout.unflatten(model, &self.params));
        }
        if self.outer.is_some() {
            self.load_diloco(ck)?;
        }
        Ok(())
    }

    /// DiLoCo: this node's inner state and the outer state, or a new round at the loaded
    /// parameters when the checkpoint has no DiLoCo state.
    fn load_diloco(&mut self, ck: &Checkpoint) -> Result<(), TrainError> {
        let res = self.load_diloco_state(ck);
        if self.cfg.strategy == Strategy::Hybrid {
            // Sharded inside the node: the parameters computed with are the node's gather of
            // its masters. Every rank gathers, whatever happened above, so none waits.
            self.gather_shards()?;
        }
        let model = self.model.take().expect("model present between steps");
        self.model = Some(self.layout.unflatten(model, &self.params));
        res
    }

    fn load_diloco_state(&mut self, ck: &Checkpoint) -> Result<(), TrainError> {
        let m = &ck.manifest;
        let nodes = self.pg.table().num_nodes();
        let Some(outer) = ck.read_outer()? else {
            tracing::info!(
                "{}: no DiLoCo state in the checkpoint; a new outer round starts at its parameters",
                ck.dir.display()
            );
            let o = self.outer.as_mut().expect("diloco state");
            o.anchor = self.params.clone();
            o.momentum = vec![0.0; self.params.len()];
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
        if outer.anchor.len() != self.params.len() {
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
            let owned = |v: &[f32]| -> Vec<f32> {
                self.owned
                    .iter()
                    .flat_map(|r| v[r.clone()].iter().copied())
                    .collect()
            };
            let tensors = whole
                .state
                .iter()
                .map(|(name, v)| (name.clone(), owned(v)))
                .collect();
            self.opt
                .import_state(ExportedState {
                    tensors,
                    scalars: m.optim_scalars.clone(),
                })
                .map_err(|reason| CheckpointError::Mismatch {
                    path: ck.dir.clone(),
                    reason,
                })?;
            self.params = whole.params;
            self.master = super::owned_master(self.cfg.strategy, &self.owned, &self.params);
        }
        let o = self.outer.as_mut().expect("diloco state");
        o.anchor = outer.anchor;
        o.momentum = outer.momentum;
        o.inner_done = outer.inner_done;
        Ok(())
    }
}

/// `WIRETRAIN_TEST_STALL_CHECKPOINT=step:ms` stalls the checkpoint of `step` (and later ones)
/// between the shard files and the manifest, for the fault tests. Unset in normal runs.
fn stall_ms(step: usize) -> Option<u64> {
    let v = std::env::var("WIRETRAIN_TEST_STALL_CHECKPOINT").ok()?;
    let (s, ms) = v.split_once(':')?;
    (step >= s.parse::<usize>().ok()?).then(|| ms.parse().ok())?
}
