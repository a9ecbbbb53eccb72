//! Reading a checkpoint: open a step directory (bounded, validated manifest), verify each
//! file's size and checksum before parsing it, and read the element ranges a rank owns now,
//! from whichever files hold them (resharding is a range intersection).

use super::{
    CheckpointError, FileEntry, LayoutEntry, MANIFEST, MAX_MANIFEST_BYTES, Manifest,
    OUTER_MOMENTUM, OuterData, ShardData, hex, io, list_valid, validate,
};
use sha2::{Digest, Sha256};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// A checkpoint opened for reading: its manifest, checked.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The step directory it was read from.
    pub dir: PathBuf,
    /// Its manifest, validated.
    pub manifest: Manifest,
}

impl Checkpoint {
    /// Opens `path`: a step directory (holding a manifest) or a checkpoint root, in which case
    /// the newest valid step is taken.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        if path.join(MANIFEST).is_file() {
            return Self::open_step(path);
        }
        let valid = list_valid(path)?;
        let (_, dir) = valid
            .last()
            .ok_or_else(|| CheckpointError::NotFound(path.to_path_buf()))?;
        Self::open_step(dir)
    }

    /// The newest valid checkpoint under `root`, or `None` when there is none.
    pub fn latest(root: &Path) -> Result<Option<Self>, CheckpointError> {
        match Self::open(root) {
            Ok(c) => Ok(Some(c)),
            Err(CheckpointError::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub(super) fn open_step(dir: &Path) -> Result<Self, CheckpointError> {
        let mpath = dir.join(MANIFEST);
        let len = std::fs::metadata(&mpath).map_err(io(&mpath))?.len();
        let corrupt = |reason: String| CheckpointError::Corrupt {
            path: mpath.clone(),
            reason,
        };
        if len > MAX_MANIFEST_BYTES {
            return Err(corrupt(format!(
                "{len} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have"
            )));
        }
        let text = std::fs::read(&mpath).map_err(io(&mpath))?;
        let manifest: Manifest =
            serde_json::from_slice(&text).map_err(|e| corrupt(format!("not a manifest: {e}")))?;
        validate(&manifest).map_err(corrupt)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
        })
    }

    /// Reads the parameters and optimizer state over `want` (flat element ranges, in order),
    /// from whichever files hold them. Each file needed is size- and checksum-checked first.
    pub fn read_ranges(&self, want: &[Range<usize>]) -> Result<ShardData, CheckpointError> {
        self.read_from(&self.manifest.files, want)
    }

    /// [`Checkpoint::read_ranges`] from the file set `files` (one that covers the vector).
    fn read_from(
        &self,
        files: &[FileEntry],
        want: &[Range<usize>],
    ) -> Result<ShardData, CheckpointError> {
        let m = &self.manifest;
        let n: usize = want.iter().map(|r| r.len()).sum();
        if let Some(r) = want.iter().find(|r| r.end > m.total || r.start > r.end) {
            return Err(CheckpointError::Mismatch {
                path: self.dir.clone(),
                reason: format!("range {r:?} is outside the {} parameters", m.total),
            });
        }
        let mut out = ShardData {
            ranges: want.to_vec(),
            params: vec![0.0; n],
            state: m
                .state_tensors
                .iter()
                .map(|s| (s.clone(), vec![0.0; n]))
                .collect(),
        };
        for f in files {
            // (offset in the file's data, offset in `out`, len) of every overlap.
            let mut copies = Vec::new();
            let mut file_at = 0;
            for fr in &f.ranges {
                let mut out_at = 0;
                for w in want {
                    let (s, e) = (fr[0].max(w.start), fr[1].min(w.end));
                    if s < e {
                        copies.push((file_at + s - fr[0], out_at + s - w.start, e - s));
                    }
                    out_at += w.len();
                }
                file_at += fr[1] - fr[0];
            }
            if copies.is_empty() {
                continue;
            }
            let data = self.load_file(f, &m.state_tensors)?;
            for (from, to, len) in copies {
                out.params[to..to + len].copy_from_slice(&data.params[from..from + len]);
                for ((_, dst), (_, src)) in out.state.iter_mut().zip(&data.state) {
                    dst[to..to + len].copy_from_slice(&src[from..from + len]);
                }
            }
        }
        Ok(out)
    }

    /// The whole flat parameter vector.
    pub fn read_params(&self) -> Result<Vec<f32>, CheckpointError> {
        Ok(self.read_ranges(&[0..self.manifest.total])?.params)
    }

    /// DiLoCo checkpoints: the inner state of `node` (parameters and inner optimizer state)
    /// over `want`; node 0's is the ordinary file set.
    pub fn read_node(
        &self,
        node: usize,
        want: &[Range<usize>],
    ) -> Result<ShardData, CheckpointError> {
        match (&self.manifest.diloco, node) {
            (None, _) | (_, 0) => self.read_ranges(want),
            (Some(d), n) => {
                let files = d
                    .nodes
                    .get(n - 1)
                    .ok_or_else(|| CheckpointError::Mismatch {
                        path: self.dir.clone(),
                        reason: format!("it holds the inner state of {} nodes", d.nodes.len() + 1),
                    })?;
                self.read_from(files, want)
            }
        }
    }

    /// DiLoCo checkpoints: the outer state.
    pub fn read_outer(&self) -> Result<Option<OuterData>, CheckpointError> {
        let Some(d) = &self.manifest.diloco else {
            return Ok(None);
        };
        let mut data = self.load_file(&d.outer, &[OUTER_MOMENTUM.to_string()])?;
        let (_, momentum) = data.state.pop().expect("one state tensor was read");
        Ok(Some(OuterData {
            anchor: data.params,
            momentum,
            inner_done: d.inner_done,
        }))
    }

    /// The module state that is not trained (see [`super::BuffersManifest`]), when the
    /// checkpoint holds it.
    pub fn read_buffers(&self) -> Result<Option<Vec<f32>>, CheckpointError> {
        let Some(b) = &self.manifest.buffers else {
            return Ok(None);
        };
        Ok(Some(self.load_file(&b.file, &[])?.params))
    }

    /// Reads one shard file after checking its size and checksum against the manifest; it
    /// holds `params` and the state tensors `state_names`.
    fn load_file(
        &self,
        f: &FileEntry,
        state_names: &[String],
    ) -> Result<ShardData, CheckpointError> {
        let path = self.dir.join(&f.name);
        let corrupt = |reason: String| CheckpointError::Corrupt {
            path: path.clone(),
            reason,
        };
        let len = std::fs::metadata(&path).map_err(io(&path))?.len();
        if len != f.bytes {
            return Err(corrupt(format!(
                "{len} bytes on disk, the manifest says {}; the file is truncated or replaced",
                f.bytes
            )));
        }
        let bytes = std::fs::read(&path).map_err(io(&path))?;
        let found = hex(&Sha256::digest(&bytes));
        if found != f.sha256 {
            return Err(CheckpointError::Checksum {
                path,
                expected: f.sha256.clone(),
                found,
            });
        }
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| corrupt(format!("not a safetensors file: {e}")))?;
        let n: usize = f.ranges.iter().map(|r| r[1] - r[0]).sum();
        let read = |name: &str| -> Result<Vec<f32>, CheckpointError> {
            let t = st
                .tensor(name)
                .map_err(|e| corrupt(format!("tensor {name}: {e}")))?;
            if t.dtype() != safetensors::Dtype::F32 || t.shape() != [n] {
                return Err(corrupt(format!(
                    "tensor {name} is {:?} {:?}, expected F32 [{n}]",
                    t.dtype(),
                    t.shape()
                )));
            }
            Ok(t.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        let params = read("params")?;
        let state = state_names
            .iter()
            .map(|s| Ok((s.clone(), read(&format!("state.{s}"))?)))
            .collect::<Result<_, CheckpointError>>()?;
        Ok(ShardData {
            ranges: f.ranges.iter().map(|r| r[0]..r[1]).collect(),
            params,
            state,
        })
    }

    /// Checks that this checkpoint holds the model described by `layout` (paths and shapes in
    /// order); a difference names the first differing parameter.
    pub fn check_layout(&self, layout: &[LayoutEntry]) -> Result<(), CheckpointError> {
        self.compare("parameter", &self.manifest.layout, layout)
    }

    /// Checks that the checkpoint's non-trained module state fits `layout` (this model's, see
    /// [`crate::flat::FlatLayout::buffers_of`]); a checkpoint without it fits any model.
    pub fn check_buffer_layout(&self, layout: &[LayoutEntry]) -> Result<(), CheckpointError> {
        match &self.manifest.buffers {
            Some(b) => self.compare("module state tensor", &b.layout, layout),
            None => Ok(()),
        }
    }

    fn compare(
        &self,
        what: &str,
        saved: &[LayoutEntry],
        layout: &[LayoutEntry],
    ) -> Result<(), CheckpointError> {
        let mismatch = |reason: String| CheckpointError::Mismatch {
            path: self.dir.clone(),
            reason,
        };
        for (i, (a, b)) in saved.iter().zip(layout).enumerate() {
            if a.path != b.path || a.shape != b.shape {
                return Err(mismatch(format!(
                    "{what} #{i} is {:?} {:?} in the checkpoint but {:?} {:?} in this model",
                    a.path, a.shape, b.path, b.shape
                )));
            }
        }
        if saved.len() != layout.len() {
            return Err(mismatch(format!(
                "the checkpoint has {} {what}s, this model {}",
                saved.len(),
                layout.len()
            )));
        }
        Ok(())
    }
}
