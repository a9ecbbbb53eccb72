//! The `wiretrain` command line: subcommands and the flags they share.

pub mod bench;
pub mod bench_compute;
pub mod devices;
pub mod export;
pub mod launch;
pub mod node;
pub mod plan;
pub mod report;
pub mod traces;
pub mod train;

/// A bad flag, configuration or combination of them: the command line is wrong, not the
/// run (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

/// A [`Usage`] error with this message.
pub fn usage_error(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Usage(msg.into()))
}

/// Returns early with a [`Usage`] error (as `anyhow::bail!` does with a plain one).
macro_rules! usage {
    ($($t:tt)*) => {
        return Err($crate::cli::usage_error(format!($($t)*)))
    };
}
pub(crate) use usage;

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
