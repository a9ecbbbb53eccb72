//! Sharded checkpoints that reshard: the on-disk format, atomic writes, validation and reads.
//!
//! A checkpoint of step `s` is the directory `D/step-{s:08}/` holding
//! - one `shard-{rank:05}.safetensors` per writing rank: 1-D f32 tensors `params` and
//!   `state.<name>` (the optimizer state, e.g. `state.momentum.moment_1`) over the concatenation
//!   of the flat-vector element ranges the rank owns; every element is written exactly once;
//! - with a model that has state that is not trained (BatchNorm's running statistics),
//!   `buffers.safetensors` (rank 0's, 1-D f32 `params`, laid out by the manifest's `buffers`);
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
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod dir;
mod export;
mod lock;
mod read;
mod validate;
mod write;
pub(crate) use dir::prune_stalling;
pub use dir::{ensure_unused, list_valid, move_aside, prune};
pub use export::{Exported, export};
pub use lock::{DirLock, LOCK_FILE, Lease};
pub use read::Checkpoint;
use validate::validate;
use write::hex;
pub(crate) use write::sync_dir;
pub use write::{ShardData, encode_shard, write_atomic, write_manifest, write_named, write_shard};

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
    /// Reading, writing, renaming, listing or locking a file or directory failed.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file or directory the operation was on.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A file's SHA-256 differs from the one its manifest records.
    #[error(
        "checkpoint file {path}: checksum mismatch (manifest says sha256 {expected}, file has \
         {found}); the file is corrupted, refusing to load it"
    )]
    Checksum {
        /// The file.
        path: PathBuf,
        /// The lowercase hex SHA-256 the manifest records.
        expected: String,
        /// The lowercase hex SHA-256 of the bytes on disk.
        found: String,
    },
    /// A manifest or shard fails its checks (size, format, ranges, tensors), a shard being
    /// written does not match its ranges, or an export cannot be serialized.
    #[error("checkpoint file {path}: {reason}")]
    Corrupt {
        /// The file (the step directory for an export, `<shard being written>` when encoding).
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The directory holds no step directory with a manifest.
    #[error("no valid checkpoint (a step-* directory with a {MANIFEST}) in {0}")]
    NotFound(PathBuf),
    /// The checkpoint is valid but does not fit the run loading it (model size, layout,
    /// optimizer, requested ranges).
    #[error("checkpoint {path} does not fit this run: {reason}")]
    Mismatch {
        /// The step directory.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// A fresh run was pointed at a directory that already holds valid checkpoints.
    #[error(
        "{} already holds checkpoints of an earlier run (steps {steps:?}); a fresh run there \
         would mix with them. Continue that run (--resume), move them aside and start afresh \
         (--overwrite-checkpoints: they go to {}/previous-<time>/), or pick another directory",
        .dir.display(), .dir.display()
    )]
    InUse {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The steps of its valid checkpoints, oldest first.
        steps: Vec<usize>,
    },
    /// Another process holds the directory's lock file.
    #[error(
        "checkpoint directory {} is in use by another run ({holder}); give this run its own \
         directory, or wait for that one to end and pass --resume to continue it",
        .dir.display()
    )]
    Locked {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The holder as its lease describes it (host, pid, job), or why it is unknown.
        holder: String,
    },
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
    /// A signed integer.
    Int(i64),
    /// An unsigned integer.
    UInt(u64),
    /// A floating-point number.
    Float(f64),
    /// A boolean.
    Bool(bool),
}

/// One parameter of the flat layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutEntry {
    /// The parameter's module path (Burn's store naming).
    pub path: String,
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// Where it starts in the flat vector, in elements.
    pub offset: usize,
    /// Its size in elements (the product of `shape`).
    pub len: usize,
}

/// One shard file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// The file name inside the step directory (a plain name, no path).
    pub name: String,
    /// The rank that wrote it.
    pub rank: usize,
    /// Flat-vector element ranges `[start, end)` in the order their data is stored.
    pub ranges: Vec<[usize; 2]>,
    /// The file's size in bytes.
    pub bytes: u64,
    /// The lowercase hex SHA-256 of the file's bytes.
    pub sha256: String,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The format tag, [`FORMAT`].
    pub format: String,
    /// Optimizer steps completed; training resumes at this step index.
    pub step: usize,
    /// The writing run's strategy by name (`ddp`, `zero2`, ...).
    pub strategy: String,
    /// The writing run's number of ranks.
    pub world: usize,
    /// Ranks of each node, node-major.
    pub ranks_per_node: Vec<usize>,
    /// Elements in the flat parameter vector.
    pub total: usize,
    /// The parameters' places in the flat vector, in order, covering `0..total`.
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
    /// The shard files, whose ranges cover the flat vector exactly once.
    pub files: Vec<FileEntry>,
    /// The run that wrote it (random, fixed for a run and kept across `--resume`): pruning
    /// removes only checkpoints of its own run. Empty in checkpoints of older releases.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run_id: String,
    /// DiLoCo runs only: the outer state and the inner state of nodes 1.. (node 0's inner
    /// state is `files`, so any run can resume the model node 0 had).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diloco: Option<DilocoManifest>,
    /// The module state that is not trained (BatchNorm's running statistics, frozen
    /// parameters), when the model has any; absent in checkpoints of older releases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffers: Option<BuffersManifest>,
}

/// The module state that is not trained, as rank 0 held it after the step's buffer sync
/// (with `BufferSync::Local` the other ranks' own values are not kept): one file with the
/// whole state as `params`, laid out by `layout` (the module paths Burn's stores use).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuffersManifest {
    /// The state tensors' places in the file's `params`, covering `0..total`.
    pub layout: Vec<LayoutEntry>,
    /// Elements of non-trained state in all.
    pub total: usize,
    /// The file holding it (written as [`BUFFERS_FILE`]), with the one range `[0, total]`.
    pub file: FileEntry,
}

/// The file name of a checkpoint's non-trained module state.
pub const BUFFERS_FILE: &str = "buffers.safetensors";

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
    /// The outer Nesterov momentum over the whole flat vector.
    pub momentum: Vec<f32>,
    /// Inner steps done when the checkpoint was written ([`DilocoManifest::inner_done`]).
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::ops::Range;

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
            buffers: None,
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

    /// A file entry of rank 0 holding `ranges`.
    fn entry(name: &str, ranges: Vec<[usize; 2]>) -> FileEntry {
        FileEntry {
            name: name.into(),
            rank: 0,
            ranges,
            bytes: 10,
            sha256: "0".repeat(64),
        }
    }

    /// A valid manifest of 10 elements in two files.
    fn ok_manifest() -> Manifest {
        let ok = manifest_for(
            10,
            vec![entry("a", vec![[0, 5]]), entry("b", vec![[5, 10]])],
        );
        assert!(validate(&ok).is_ok());
        ok
    }

    #[test]
    fn bad_manifests_are_refused() {
        let ok = ok_manifest();
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
        // Crafted sums that overflow are refused, not a panic (issue 42, item 7).
        let mut ranks = ok.clone();
        ranks.ranks_per_node = vec![usize::MAX, 2];
        assert!(validate(&ranks).unwrap_err().contains("ranks per node"));
        let mut ranges = ok.clone();
        ranges.files[0].ranges = vec![[0, usize::MAX], [0, usize::MAX]];
        assert!(validate(&ranges).is_err());
    }

    #[test]
    fn bad_module_state_manifests_are_refused() {
        // Non-trained module state: one whole file, a layout that adds up.
        let mut bufs = ok_manifest();
        let layout = vec![LayoutEntry {
            path: "bn.running_mean".into(),
            shape: vec![3],
            offset: 0,
            len: 3,
        }];
        let file = entry(BUFFERS_FILE, vec![[0, 3]]);
        bufs.buffers = Some(BuffersManifest {
            layout,
            total: 3,
            file,
        });
        assert!(validate(&bufs).is_ok());
        let mut short = bufs.clone();
        short.buffers.as_mut().unwrap().total = 4;
        assert!(validate(&short).unwrap_err().contains("module state"));
        let mut shape = bufs.clone();
        shape.buffers.as_mut().unwrap().layout[0].shape = vec![usize::MAX, 2];
        assert!(validate(&shape).unwrap_err().contains("shape overflows"));
        let mut name = bufs;
        name.buffers.as_mut().unwrap().file.name = "../b".into();
        assert!(validate(&name).unwrap_err().contains("plain file name"));
    }

    #[test]
    fn bad_diloco_manifests_are_refused() {
        // DiLoCo: whole-vector files, one per node after the first.
        let mut dl = ok_manifest();
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
