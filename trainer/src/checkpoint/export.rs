//! One consolidated safetensors file from a sharded checkpoint: a tensor per parameter and per
//! tensor of non-trained module state (BatchNorm's running statistics), named by its module
//! path, which Burn's `SafetensorsStore` loads into the same module.

use super::{Checkpoint, CheckpointError, LayoutEntry, write_atomic};
use std::collections::HashMap;
use std::path::Path;

/// What [`export`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exported {
    /// The checkpoint's step.
    pub step: usize,
    /// Parameter elements written.
    pub params: usize,
    /// Parameter tensors written.
    pub tensors: usize,
    /// Tensors of non-trained module state (0 for a checkpoint of an older release, which
    /// holds none).
    pub state_tensors: usize,
}

/// Writes `ck` as one safetensors file at `out` (replaced atomically).
pub fn export(ck: &Checkpoint, out: &Path) -> Result<Exported, CheckpointError> {
    let m = &ck.manifest;
    let flat = ck.read_params()?;
    let buffers = ck.read_buffers()?.unwrap_or_default();
    let state_layout: &[LayoutEntry] = m.buffers.as_ref().map_or(&[], |b| &b.layout);
    let tensors: Vec<(&LayoutEntry, Vec<u8>)> = m
        .layout
        .iter()
        .map(|e| (e, le_bytes(&flat[e.offset..e.offset + e.len])))
        .chain(
            state_layout
                .iter()
                .map(|e| (e, le_bytes(&buffers[e.offset..e.offset + e.len]))),
        )
        .collect();
    let corrupt = |reason: String| CheckpointError::Corrupt {
        path: ck.dir.clone(),
        reason,
    };
    let views = tensors
        .iter()
        .map(|(e, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, e.shape.clone(), b)
                .map(|v| (e.path.clone(), v))
                .map_err(|err| corrupt(format!("tensor {}: {err}", e.path)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = HashMap::from([
        ("format".to_string(), "safetensors".to_string()),
        ("producer".to_string(), "wiretrain".to_string()),
        ("step".to_string(), m.step.to_string()),
    ]);
    let bytes = safetensors::serialize(views, Some(meta))
        .map_err(|err| corrupt(format!("serializing: {err}")))?;
    write_atomic(out, &bytes)?;
    Ok(Exported {
        step: m.step,
        params: m.total,
        tensors: m.layout.len(),
        state_tensors: state_layout.len(),
    })
}

fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
