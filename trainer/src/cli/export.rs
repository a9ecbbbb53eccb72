//! `wiretrain export`: one consolidated safetensors file from a sharded checkpoint, with one
//! tensor per parameter named by its module path, which Burn's `SafetensorsStore` loads into
//! the same module.

use anyhow::{Context, Result};
use clap::Args;
use std::collections::HashMap;
use std::path::PathBuf;
use wiretrain::checkpoint::{Checkpoint, write_atomic};

#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    /// A checkpoint directory (its newest valid step is used) or one `step-*` directory.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The safetensors file to write (replaced atomically).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: &ExportArgs) -> Result<()> {
    let ck = Checkpoint::open(&args.checkpoint)?;
    let flat = ck.read_params()?;
    let m = &ck.manifest;
    let bytes: Vec<Vec<u8>> = m
        .layout
        .iter()
        .map(|e| {
            flat[e.offset..e.offset + e.len]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect()
        })
        .collect();
    let views = m
        .layout
        .iter()
        .zip(&bytes)
        .map(|(e, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, e.shape.clone(), b)
                .map(|v| (e.path.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .context("building the tensors")?;
    let meta = HashMap::from([
        ("format".to_string(), "safetensors".to_string()),
        ("producer".to_string(), "wiretrain".to_string()),
        ("step".to_string(), m.step.to_string()),
    ]);
    let out = safetensors::serialize(views, Some(meta)).context("serializing")?;
    write_atomic(&args.out, &out)?;
    eprintln!(
        "wiretrain: step {} of {} ({} parameters, {} tensors) written to {}",
        m.step,
        ck.dir.display(),
        m.total,
        m.layout.len(),
        args.out.display()
    );
    Ok(())
}
