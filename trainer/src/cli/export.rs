//! `wiretrain export`: flags and printing around [`wiretrain::checkpoint::export`] (one
//! safetensors file that Burn's `SafetensorsStore` loads into the same module).

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use wiretrain::checkpoint::{Checkpoint, export};

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
    let e = export(&ck, &args.out)
        .with_context(|| format!("exporting {}", args.checkpoint.display()))?;
    let state = match e.state_tensors {
        0 => String::new(),
        n => format!(", {n} tensors of running state"),
    };
    eprintln!(
        "wiretrain: step {} of {} ({} parameters, {} tensors{state}) written to {}",
        e.step,
        ck.dir.display(),
        e.params,
        e.tensors,
        args.out.display()
    );
    Ok(())
}
