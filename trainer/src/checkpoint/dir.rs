//! The checkpoint directory as a whole: which steps are valid, whether a fresh run may use
//! it, moving an earlier run aside, and pruning a run's older checkpoints.

use super::{Checkpoint, CheckpointError, MANIFEST, io, sync_dir};
use std::path::{Path, PathBuf};

/// Step directories under `root` that hold a manifest, oldest first.
pub fn list_valid(root: &Path) -> Result<Vec<(usize, PathBuf)>, CheckpointError> {
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io(root)(e)),
    };
    for ent in rd {
        let ent = ent.map_err(io(root))?;
        let name = ent.file_name();
        let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|s| s.parse::<usize>().ok())
        else {
            continue;
        };
        if ent.path().join(MANIFEST).is_file() {
            out.push((step, ent.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// A fresh run may write into `root` only when it holds no valid checkpoint: a later
/// `--resume` would otherwise pick whichever run's checkpoint is newest.
pub fn ensure_unused(root: &Path) -> Result<(), CheckpointError> {
    let valid = list_valid(root)?;
    if valid.is_empty() {
        return Ok(());
    }
    Err(CheckpointError::InUse {
        dir: root.to_path_buf(),
        steps: valid.iter().map(|(s, _)| *s).collect(),
    })
}

/// Moves every `step-*` directory of `root` (valid or not) into `root/previous-<unix time>/`
/// and returns that directory (`None` when there was nothing to move).
pub fn move_aside(root: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    let steps = step_dirs(root)?;
    if steps.is_empty() {
        return Ok(None);
    }
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut aside = root.join(format!("previous-{secs}"));
    for n in 1.. {
        if !aside.exists() {
            break;
        }
        aside = root.join(format!("previous-{secs}-{n}"));
    }
    std::fs::create_dir(&aside).map_err(io(&aside))?;
    for (_, p) in steps {
        let to = aside.join(p.file_name().expect("a step directory has a name"));
        std::fs::rename(&p, &to).map_err(io(&p))?;
    }
    sync_dir(root)?;
    Ok(Some(aside))
}

/// Every `step-*` directory under `root` with its step, valid or not.
fn step_dirs(root: &Path) -> Result<Vec<(usize, PathBuf)>, CheckpointError> {
    let rd = match std::fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(root)(e)),
    };
    let mut out = Vec::new();
    for ent in rd {
        let ent = ent.map_err(io(root))?;
        let step = ent
            .file_name()
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|s| s.parse::<usize>().ok());
        if let Some(step) = step {
            out.push((step, ent.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Keeps the newest `keep` valid checkpoints of run `run_id` under `root` and removes its
/// older ones, together with incomplete step directories older than its newest (debris of
/// crashes). Checkpoints of other runs are never touched. A directory is renamed to a
/// `.removing-*` name before it is deleted, and the root is fsynced, so a crash mid-prune
/// leaves either the whole checkpoint or a name no reader takes for one.
pub fn prune(root: &Path, keep: usize, run_id: &str) -> Result<Vec<PathBuf>, CheckpointError> {
    prune_stalling(root, keep, run_id, None)
}

/// [`prune`], stalling for `stall` (an injected fault, see [`crate::faults`]) between renaming
/// a checkpoint aside and deleting it.
pub(crate) fn prune_stalling(
    root: &Path,
    keep: usize,
    run_id: &str,
    stall: Option<std::time::Duration>,
) -> Result<Vec<PathBuf>, CheckpointError> {
    // Finish what a crash interrupted: directories already renamed for removal.
    for ent in std::fs::read_dir(root).map_err(io(root))? {
        let p = ent.map_err(io(root))?.path();
        if p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(".removing-step-"))
        {
            std::fs::remove_dir_all(&p).map_err(io(&p))?;
        }
    }
    let mine: Vec<(usize, PathBuf)> = list_valid(root)?
        .into_iter()
        .filter(|(_, p)| Checkpoint::open_step(p).is_ok_and(|c| c.manifest.run_id == run_id))
        .collect();
    let Some(&(newest, _)) = mine.last() else {
        return Ok(Vec::new());
    };
    let keep_from = mine.len().saturating_sub(keep.max(1));
    let kept: Vec<&PathBuf> = mine[keep_from..].iter().map(|(_, p)| p).collect();
    let mut removed = Vec::new();
    for (step, p) in step_dirs(root)? {
        let ours = mine.iter().any(|(_, q)| *q == p);
        let debris = !p.join(MANIFEST).is_file();
        if step < newest && !kept.contains(&&p) && (ours || debris) {
            let name = p.file_name().expect("a step directory has a name");
            let doomed = root.join(format!(".removing-{}", name.to_string_lossy()));
            std::fs::rename(&p, &doomed).map_err(io(&p))?;
            sync_dir(root)?;
            if let Some(stall) = stall {
                std::thread::sleep(stall);
            }
            std::fs::remove_dir_all(&doomed).map_err(io(&doomed))?;
            removed.push(p);
        }
    }
    Ok(removed)
}
