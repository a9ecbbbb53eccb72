//! Sharded checkpoints that reshard: the on-disk format, atomic writes, validation and reads.
//!
//! A checkpoint of step `s` is the directory `D/step-{s:08}/` holding
//! - one `shard-{rank:05}.safetensors` per writing rank: 1-D f32 tensors `params` and
//!   `state.<name>` (the optimizer state, e.g. `state.momentum.moment_1`) over the concatenation
//!   of the flat-vector element ranges the rank owns; every element is written exactly once;
//! - `manifest.json` (written last, by rank 0): step, world layout, flat layout, optimizer
//!   kind and scalars (step counts), run settings (sampler seed and global batch), and every
//!   file with its ranges, size and SHA-256.
//!
//! Every file is written to a temporary name, fsynced and renamed; the manifest is renamed
//! into place only after every shard is on disk, so a checkpoint is valid exactly when its
//! manifest exists. Reading checks the manifest (bounded size, known format, plain file
//! names, ranges inside the model and covering it exactly once) and each file's size and
//! checksum before parsing it, so garbage is never loaded and a bad file is named.
//! Resharding is a range intersection: a rank of any world size or strategy asks for the
//! element ranges it owns now and gets them from whichever files hold them.

// Lists of element ranges with a single range in them are meant: the whole vector, one piece.
#![allow(clippy::single_range_in_vec_init)]

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

mod dir;
pub use dir::{ensure_unused, list_valid, move_aside, prune};

/// The format tag of the manifest.
pub const FORMAT: &str = "wiretrain-checkpoint/1";
/// The file whose presence makes a checkpoint valid.
pub const MANIFEST: &str = "manifest.json";
/// Manifests larger than this are refused unread.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// What can go wrong with a checkpoint; every variant names the file involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "checkpoint file {path}: checksum mismatch (manifest says sha256 {expected}, file has {found}); the file is corrupted, refusing to load it"
    )]
    Checksum {
        path: PathBuf,
        expected: String,
        found: String,
    },
    #[error("checkpoint file {path}: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("no valid checkpoint (a step-* directory with a {MANIFEST}) in {0}")]
    NotFound(PathBuf),
    #[error("checkpoint {path} does not fit this run: {reason}")]
    Mismatch { path: PathBuf, reason: String },
    #[error(
        "{} already holds checkpoints of an earlier run (steps {steps:?}); a fresh run there \
         would mix with them. Continue that run (--resume), move them aside and start afresh \
         (--overwrite-checkpoints: they go to {}/previous-<time>/), or pick another directory",
        .dir.display(), .dir.display()
    )]
    InUse { dir: PathBuf, steps: Vec<usize> },
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// An optimizer scalar (a step count, say), as Burn's state records hold them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScalarValue {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
}

/// One parameter of the flat layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutEntry {
    pub path: String,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub len: usize,
}

/// One shard file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub rank: usize,
    /// Flat-vector element ranges `[start, end)` in the order their data is stored.
    pub ranges: Vec<[usize; 2]>,
    pub bytes: u64,
    pub sha256: String,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    /// Optimizer steps completed; training resumes at this step index.
    pub step: usize,
    pub strategy: String,
    pub world: usize,
    /// Ranks of each node, node-major.
    pub ranks_per_node: Vec<usize>,
    pub total: usize,
    pub layout: Vec<LayoutEntry>,
    /// "adamw" or "sgd".
    pub optim_kind: String,
    /// Names of the per-element optimizer state tensors (stored as `state.<name>`).
    pub state_tensors: Vec<String>,
    /// Optimizer scalars (e.g. `momentum.time`, AdamW's step count), equal on every rank.
    pub optim_scalars: BTreeMap<String, ScalarValue>,
    /// Run settings the writer chose to record (example, seed, global batch, lr, ...). The
    /// data order is a pure function of (seed, global batch, step), so this is the sampler
    /// and RNG state.
    pub run: serde_json::Value,
    pub files: Vec<FileEntry>,
    /// The run that wrote it (random, fixed for a run and kept across `--resume`): pruning
    /// removes only checkpoints of its own run. Empty in checkpoints of older releases.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run_id: String,
    /// DiLoCo runs only: the outer state and the inner state of nodes 1.. (node 0's inner
    /// state is `files`, so any run can resume the model node 0 had).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diloco: Option<DilocoManifest>,
}

/// The extra state of a DiLoCo checkpoint. Inner states differ between nodes (each node
/// steps its own replica for H steps), so each node's is kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DilocoManifest {
    /// Inner steps done when the checkpoint was written (the round position is this modulo
    /// the inner steps per outer step).
    pub inner_done: usize,
    /// The outer state over the whole flat vector: `params` holds the round's starting
    /// parameters (the anchor), `state.outer_momentum` the outer Nesterov momentum.
    pub outer: FileEntry,
    /// Inner state (parameters and inner optimizer state) of node `i + 1`: its files cover
    /// the flat vector exactly once (one file under DDP inside the node, one per rank when
    /// sharded inside the node).
    pub nodes: Vec<Vec<FileEntry>>,
}

/// A DiLoCo checkpoint's outer state as read back.
#[derive(Debug, Clone, PartialEq)]
pub struct OuterData {
    /// The parameters at the start of the round.
    pub anchor: Vec<f32>,
    pub momentum: Vec<f32>,
    pub inner_done: usize,
}

/// The optimizer state tensor name of the outer momentum in a DiLoCo outer file.
pub const OUTER_MOMENTUM: &str = "outer_momentum";
/// The file name of a DiLoCo checkpoint's outer state.
pub const OUTER_FILE: &str = "diloco-outer.safetensors";

/// The name of the directory of step `step`.
pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

/// The name of rank `rank`'s shard file.
pub fn shard_file_name(rank: usize) -> String {
    format!("shard-{rank:05}.safetensors")
}

/// Lowercase hex of a digest.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `bytes` to `path` atomically: a temporary sibling, fsync, rename, fsync of the
/// directory. A crash leaves either the old file (or none) or the complete new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    // "model.safetensors" has the parent "": that is the current directory.
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        // A full disk (ENOSPC) must not keep the partial file's space.
        let _ = std::fs::remove_file(&tmp);
        return Err(io(path)(e));
    }
    sync_dir(dir)
}

pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    // Directories can be opened and fsynced on Unix; elsewhere the rename is what we have.
    #[cfg(unix)]
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// What one rank writes: its element ranges, the parameters over them and the optimizer
/// state tensors over them (each as long as the ranges together).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShardData {
    pub ranges: Vec<Range<usize>>,
    pub params: Vec<f32>,
    pub state: Vec<(String, Vec<f32>)>,
}

impl ShardData {
    pub fn len(&self) -> usize {
        self.ranges.iter().map(|r| r.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Encodes a shard as safetensors bytes.
pub fn encode_shard(shard: &ShardData) -> Result<Vec<u8>, CheckpointError> {
    use safetensors::tensor::{Dtype, TensorView};
    let n = shard.len();
    let bad = |reason: String| CheckpointError::Corrupt {
        path: PathBuf::from("<shard being written>"),
        reason,
    };
    if shard.params.len() != n || shard.state.iter().any(|(_, v)| v.len() != n) {
        return Err(bad(format!(
            "tensors do not match the {n} elements of the ranges"
        )));
    }
    // Little-endian bytes, as safetensors specifies, whatever the host.
    let le = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let mut named: Vec<(String, Vec<u8>)> = vec![("params".into(), le(&shard.params))];
    for (name, v) in &shard.state {
        named.push((format!("state.{name}"), le(v)));
    }
    let views: Vec<(String, TensorView<'_>)> = named
        .iter()
        .map(|(name, v)| {
            TensorView::new(Dtype::F32, vec![n], v)
                .map(|t| (name.clone(), t))
                .map_err(|e| bad(e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    let ranges: Vec<[usize; 2]> = shard.ranges.iter().map(|r| [r.start, r.end]).collect();
    let meta = std::collections::HashMap::from([(
        "ranges".to_string(),
        serde_json::to_string(&ranges).expect("ranges serialize"),
    )]);
    safetensors::tensor::serialize(views, Some(meta)).map_err(|e| bad(e.to_string()))
}

/// Writes this rank's shard into `step_dir` atomically; returns its manifest entry.
pub fn write_shard(
    step_dir: &Path,
    rank: usize,
    shard: &ShardData,
) -> Result<FileEntry, CheckpointError> {
    write_named(step_dir, &shard_file_name(rank), rank, shard)
}

/// Writes `shard` as the file `name` in `step_dir` atomically; returns its manifest entry.
pub fn write_named(
    step_dir: &Path,
    name: &str,
    rank: usize,
    shard: &ShardData,
) -> Result<FileEntry, CheckpointError> {
    std::fs::create_dir_all(step_dir).map_err(io(step_dir))?;
    let bytes = encode_shard(shard)?;
    let name = name.to_string();
    write_atomic(&step_dir.join(&name), &bytes)?;
    Ok(FileEntry {
        name,
        rank,
        ranges: shard.ranges.iter().map(|r| [r.start, r.end]).collect(),
        bytes: bytes.len() as u64,
        sha256: hex(&Sha256::digest(&bytes)),
    })
}

/// Writes the manifest last, making the checkpoint valid.
pub fn write_manifest(step_dir: &Path, m: &Manifest) -> Result<(), CheckpointError> {
    let text = serde_json::to_vec_pretty(m).expect("manifest serializes");
    write_atomic(&step_dir.join(MANIFEST), &text)
}

/// A checkpoint opened for reading: its manifest, checked.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub dir: PathBuf,
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

    fn open_step(dir: &Path) -> Result<Self, CheckpointError> {
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
        let m = &self.manifest;
        let mismatch = |reason: String| CheckpointError::Mismatch {
            path: self.dir.clone(),
            reason,
        };
        for (i, (a, b)) in m.layout.iter().zip(layout).enumerate() {
            if a.path != b.path || a.shape != b.shape {
                return Err(mismatch(format!(
                    "parameter #{i} is {:?} {:?} in the checkpoint but {:?} {:?} in this model",
                    a.path, a.shape, b.path, b.shape
                )));
            }
        }
        if m.layout.len() != layout.len() {
            return Err(mismatch(format!(
                "the checkpoint has {} parameters, this model {}",
                m.layout.len(),
                layout.len()
            )));
        }
        Ok(())
    }
}

/// Checks a manifest read from disk: known format, sane names, layout and file ranges that
/// cover the flat vector exactly once.
fn validate(m: &Manifest) -> Result<(), String> {
    if m.format != FORMAT {
        return Err(format!("format {:?}, expected {FORMAT:?}", m.format));
    }
    if m.world == 0 || m.ranks_per_node.iter().sum::<usize>() != m.world {
        return Err(format!(
            "world {} does not match ranks per node {:?}",
            m.world, m.ranks_per_node
        ));
    }
    let mut at = 0usize;
    for e in &m.layout {
        let prod = e
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("parameter {:?}: shape overflows", e.path))?;
        if e.offset != at || e.len != prod {
            return Err(format!(
                "parameter {:?}: offset {} / len {} do not follow the layout",
                e.path, e.offset, e.len
            ));
        }
        at = at
            .checked_add(e.len)
            .ok_or_else(|| "layout size overflows".to_string())?;
    }
    if at != m.total {
        return Err(format!(
            "layout holds {at} elements, total says {}",
            m.total
        ));
    }
    check_cover("", &m.files, m.total, m.state_tensors.len())?;
    if let Some(d) = &m.diloco {
        check_file(&d.outer, 1)?;
        if d.outer.ranges != [[0, m.total]] {
            return Err(format!(
                "diloco outer file {}: ranges {:?}, expected the whole vector [[0, {}]]",
                d.outer.name, d.outer.ranges, m.total
            ));
        }
        if d.nodes.len() + 1 != m.ranks_per_node.len() {
            return Err(format!(
                "diloco: inner state of {} nodes for {} nodes",
                d.nodes.len() + 1,
                m.ranks_per_node.len()
            ));
        }
        for (i, files) in d.nodes.iter().enumerate() {
            let what = format!("diloco node {}: ", i + 1);
            check_cover(&what, files, m.total, m.state_tensors.len())?;
        }
    }
    if m.state_tensors
        .iter()
        .any(|s| s.is_empty() || s.len() > 200)
    {
        return Err("bad optimizer state tensor name".into());
    }
    Ok(())
}

/// Checks every file of a set and that their ranges cover `0..total` exactly once.
fn check_cover(
    what: &str,
    files: &[FileEntry],
    total: usize,
    state_tensors: usize,
) -> Result<(), String> {
    let mut all: Vec<[usize; 2]> = Vec::new();
    for f in files {
        check_file(f, state_tensors)?;
        all.extend(f.ranges.iter().copied());
    }
    all.sort();
    let mut at = 0;
    for r in &all {
        if r[0] > r[1] || r[1] > total {
            return Err(format!("{what}range {r:?} is outside 0..{total}"));
        }
        if r[0] != at {
            return Err(if r[0] < at {
                format!("{what}element {} is stored twice", r[0])
            } else {
                format!("{what}elements {at}..{} are in no file", r[0])
            });
        }
        at = r[1];
    }
    if at != total {
        return Err(format!("{what}elements {at}..{total} are in no file"));
    }
    Ok(())
}

/// A file entry's name, checksum and size claims, before anything is read.
fn check_file(f: &FileEntry, state_tensors: usize) -> Result<(), String> {
    let plain = !f.name.is_empty()
        && f.name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !f.name.starts_with('.')
        && f.name != MANIFEST;
    if !plain {
        return Err(format!("file name {:?} is not a plain file name", f.name));
    }
    if f.sha256.len() != 64 || !f.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!("file {}: bad sha256 {:?}", f.name, f.sha256));
    }
    let n: usize = f.ranges.iter().map(|r| r[1].saturating_sub(r[0])).sum();
    // Data plus a small header; a file claiming more bytes than that is refused unread.
    let limit = (n as u64)
        .saturating_mul(4 * (1 + state_tensors as u64))
        .saturating_add(1 << 20);
    if f.bytes > limit {
        return Err(format!(
            "file {}: {} bytes is more than its {n} elements need",
            f.name, f.bytes
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest_for(total: usize, files: Vec<FileEntry>) -> Manifest {
        Manifest {
            format: FORMAT.into(),
            step: 3,
            strategy: "zero2".into(),
            world: 2,
            ranks_per_node: vec![1, 1],
            total,
            layout: vec![LayoutEntry {
                path: "w".into(),
                shape: vec![total],
                offset: 0,
                len: total,
            }],
            optim_kind: "adamw".into(),
            state_tensors: vec!["m".into()],
            optim_scalars: BTreeMap::from([("time".into(), ScalarValue::UInt(3))]),
            run: serde_json::json!({}),
            files,
            run_id: "run-a".into(),
            diloco: None,
        }
    }

    /// Writes `total` elements cut as `cuts` (one file per cut list) with values = index.
    fn write_cut(dir: &Path, total: usize, cuts: &[Vec<Range<usize>>]) -> Checkpoint {
        let step = dir.join(step_dir_name(3));
        let files = cuts
            .iter()
            .enumerate()
            .map(|(rank, ranges)| {
                let params: Vec<f32> = ranges
                    .iter()
                    .flat_map(|r| r.clone())
                    .map(|i| i as f32)
                    .collect();
                let m = params.iter().map(|x| -x).collect();
                write_shard(
                    &step,
                    rank,
                    &ShardData {
                        ranges: ranges.clone(),
                        params,
                        state: vec![("m".into(), m)],
                    },
                )
                .unwrap()
            })
            .collect();
        write_manifest(&step, &manifest_for(total, files)).unwrap();
        Checkpoint::open(dir).unwrap()
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("wt-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn reads_any_resharding_of_what_was_written() {
        let d = tmp("reshard");
        // Written by 3 ranks with interleaved pieces, read back as 2 and as 5 other cuts.
        let ck = write_cut(
            &d,
            100,
            &[vec![0..10, 50..70], vec![10..30, 70..100], vec![30..50]],
        );
        for want in [
            vec![0..100],
            vec![0..50],
            vec![50..100],
            vec![3..4, 20..60, 99..100],
        ] {
            let got = ck.read_ranges(&want).unwrap();
            let exp: Vec<f32> = want
                .iter()
                .flat_map(|r| r.clone())
                .map(|i| i as f32)
                .collect();
            assert_eq!(got.params, exp);
            assert_eq!(got.state[0].1, exp.iter().map(|x| -x).collect::<Vec<_>>());
        }
        assert!(ck.read_ranges(&[90..101]).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn corruption_is_named_and_never_loaded() {
        let d = tmp("corrupt");
        let ck = write_cut(&d, 40, &[vec![0..20], vec![20..40]]);
        let f = ck.dir.join(shard_file_name(1));
        let mut bytes = std::fs::read(&f).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&f, &bytes).unwrap();
        // Reading only rank 0's elements still works; touching rank 1's file fails naming it.
        assert!(ck.read_ranges(&[0..20]).is_ok());
        let e = ck.read_ranges(&[0..40]).unwrap_err().to_string();
        assert!(
            e.contains("shard-00001.safetensors") && e.contains("checksum"),
            "{e}"
        );
        bytes.truncate(10);
        std::fs::write(&f, &bytes).unwrap();
        let e = ck.read_params().unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn bad_manifests_are_refused() {
        let entry = |name: &str, ranges: Vec<[usize; 2]>| FileEntry {
            name: name.into(),
            rank: 0,
            ranges,
            bytes: 10,
            sha256: "0".repeat(64),
        };
        let ok = manifest_for(
            10,
            vec![entry("a", vec![[0, 5]]), entry("b", vec![[5, 10]])],
        );
        assert!(validate(&ok).is_ok());
        let cases = [
            (
                manifest_for(
                    10,
                    vec![entry("a", vec![[0, 6]]), entry("b", vec![[5, 10]])],
                ),
                "twice",
            ),
            (
                manifest_for(10, vec![entry("a", vec![[0, 5]])]),
                "in no file",
            ),
            (
                manifest_for(10, vec![entry("../x", vec![[0, 10]])]),
                "plain file name",
            ),
            (manifest_for(10, vec![entry("a", vec![[0, 11]])]), "outside"),
        ];
        for (m, want) in cases {
            let e = validate(&m).unwrap_err();
            assert!(e.contains(want), "{e} should say {want}");
        }
        let mut big = ok.clone();
        big.files[0].bytes = u64::MAX;
        assert!(validate(&big).unwrap_err().contains("more than"));
        let mut fmt = ok.clone();
        fmt.format = "other/9".into();
        assert!(validate(&fmt).is_err());
        // DiLoCo: whole-vector files, one per node after the first.
        let mut dl = ok;
        dl.diloco = Some(DilocoManifest {
            inner_done: 4,
            outer: entry(OUTER_FILE, vec![[0, 10]]),
            nodes: vec![vec![
                entry("shard-00002.safetensors", vec![[0, 4]]),
                entry("shard-00003.safetensors", vec![[4, 10]]),
            ]],
        });
        assert!(validate(&dl).is_ok());
        let mut part = dl.clone();
        part.diloco.as_mut().unwrap().nodes[0][1].ranges = vec![[5, 10]];
        assert!(
            validate(&part)
                .unwrap_err()
                .contains("diloco node 1: elements 4..5 are in no file")
        );
        let mut outer = dl.clone();
        outer.diloco.as_mut().unwrap().outer.ranges = vec![[0, 5]];
        assert!(validate(&outer).unwrap_err().contains("whole vector"));
        let mut count = dl.clone();
        count.diloco.as_mut().unwrap().nodes.clear();
        assert!(
            validate(&count)
                .unwrap_err()
                .contains("inner state of 1 nodes")
        );
        let mut name = dl;
        name.diloco.as_mut().unwrap().outer.name = MANIFEST.into();
        assert!(validate(&name).unwrap_err().contains("plain file name"));
    }

    #[test]
    fn only_manifested_steps_count_and_prune_keeps_the_newest() {
        let d = tmp("prune");
        for s in [1, 2, 3] {
            let step = d.join(step_dir_name(s));
            std::fs::create_dir_all(&step).unwrap();
            write_manifest(&step, &manifest_for(0, vec![])).unwrap();
        }
        // An interrupted write: shards but no manifest.
        std::fs::create_dir_all(d.join(step_dir_name(4))).unwrap();
        let v: Vec<usize> = list_valid(&d).unwrap().iter().map(|x| x.0).collect();
        assert_eq!(v, [1, 2, 3]);
        assert_eq!(Checkpoint::open(&d).unwrap().dir, d.join(step_dir_name(3)));
        // Another run's checkpoint (older step) in the same directory: never pruned by run-a.
        let other = d.join(step_dir_name(0));
        std::fs::create_dir_all(&other).unwrap();
        let mut m = manifest_for(0, vec![]);
        m.run_id = "run-b".into();
        write_manifest(&other, &m).unwrap();
        // Debris of a crash in the middle of an earlier prune.
        std::fs::create_dir_all(d.join(".removing-step-00000001")).unwrap();
        prune(&d, 2, "run-a").unwrap();
        let v: Vec<usize> = list_valid(&d).unwrap().iter().map(|x| x.0).collect();
        assert_eq!(v, [0, 2, 3]);
        assert!(
            d.join(step_dir_name(4)).exists(),
            "newer debris may be a write in progress"
        );
        assert!(!d.join(".removing-step-00000001").exists());
        assert!(!d.join(".removing-step-00000002").exists());
        // A fresh run is refused here; moved aside, the directory is free and nothing is lost.
        let e = ensure_unused(&d).unwrap_err().to_string();
        assert!(
            e.contains("--resume") && e.contains("--overwrite-checkpoints"),
            "{e}"
        );
        let aside = move_aside(&d).unwrap().unwrap();
        ensure_unused(&d).unwrap();
        let moved: Vec<usize> = list_valid(&aside).unwrap().iter().map(|x| x.0).collect();
        assert_eq!(moved, [0, 2, 3]);
        assert!(aside.join(step_dir_name(4)).exists());
        assert!(Checkpoint::latest(&d.join("none")).unwrap().is_none());
        let _ = std::fs::remove_dir_all(&d);
    }
}
