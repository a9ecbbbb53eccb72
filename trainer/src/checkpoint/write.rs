//! Writing a checkpoint's files: atomic writes (temporary sibling, fsync, rename, fsync of the
//! directory), shard encoding (safetensors, one 1-D tensor per state) and the manifest.

use super::{CheckpointError, FileEntry, MANIFEST, Manifest, io, shard_file_name};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

pub(super) fn hex(bytes: &[u8]) -> String {
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
    /// Flat-vector element ranges, in the order the data below is laid out.
    pub ranges: Vec<Range<usize>>,
    /// The parameters over `ranges`, concatenated.
    pub params: Vec<f32>,
    /// Each optimizer state tensor by name (without the `state.` prefix), over `ranges`.
    pub state: Vec<(String, Vec<f32>)>,
}

impl ShardData {
    /// Elements covered by `ranges` together.
    pub fn len(&self) -> usize {
        self.ranges.iter().map(|r| r.len()).sum()
    }

    /// Whether `ranges` cover no element.
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
