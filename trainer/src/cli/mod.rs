//! The `wiretrain` command line: subcommands and the flags they share.

pub mod bench;
pub mod bench_compute;
pub mod devices;
pub mod export;
pub mod launch;
pub mod node;
pub mod plan;
pub mod report;
pub mod train;

/// A run stopped cleanly by a signal (exit code 130).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Interrupted(pub String);

/// Joins every rank thread; returns their results in rank order, or the first error (a
/// panicked rank counts as an error).
pub fn join_ranks<T>(
    handles: Vec<std::thread::JoinHandle<anyhow::Result<T>>>,
) -> anyhow::Result<Vec<T>> {
    let mut out = Vec::with_capacity(handles.len());
    let mut first_err = None;
    for h in handles {
        match h.join() {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert(anyhow::anyhow!("a rank thread panicked"));
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}
