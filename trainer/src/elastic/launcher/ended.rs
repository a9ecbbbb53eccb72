//! How a launch's node processes ended: waiting for all of them (killing the rest a grace
//! period after the first failure) and what their exit statuses mean for the launch.

use super::{LaunchError, exit_code};
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// How an epoch of a local launch ended: every node's exit status (`None`: it had to be
/// killed after the grace period, or could not be waited for) and when the first failure was
/// seen.
pub(crate) struct Ended {
    pub status: Vec<Option<ExitStatus>>,
    pub detected: Option<Instant>,
}

pub(crate) fn wait_all(mut children: Vec<Child>, grace: Duration) -> Result<Ended, LaunchError> {
    let mut status: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let mut first_failure: Option<Instant> = None;
    loop {
        for (i, c) in children.iter_mut().enumerate() {
            if status[i].is_none()
                && let Some(st) = c.try_wait()?
            {
                status[i] = Some(st);
                if !st.success() && first_failure.is_none() {
                    first_failure = Some(Instant::now());
                }
            }
        }
        if status.iter().all(Option::is_some) {
            break;
        }
        if let Some(t) = first_failure
            && t.elapsed() > grace
        {
            for (i, c) in children.iter_mut().enumerate() {
                if status[i].is_none() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Ended {
        status,
        detected: first_failure,
    })
}

/// What the nodes' exit statuses mean for the launch: success, a signal passed on, or the
/// failures (the exit code that of the first failed node).
pub(crate) fn verdict(status: &[Option<ExitStatus>]) -> Result<(), LaunchError> {
    let failures: Vec<String> = status
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match s {
            Some(s) if s.success() => None,
            Some(s) => Some(format!("node {i} exited with {s}")),
            None => Some(format!(
                "node {i} did not exit within the grace period (killed)"
            )),
        })
        .collect();
    let code = status
        .iter()
        .flatten()
        .find(|s| !s.success())
        .map_or(1, |s| exit_code(*s));
    let all_interrupted = status.iter().all(|s| {
        s.is_some_and(|s| s.success() || s.code() == Some(crate::signal::INTERRUPTED_EXIT))
    });
    if failures.is_empty() {
        Ok(())
    } else if all_interrupted {
        // A node was stopped by a signal (e.g. Ctrl-C on one machine) and took the job along.
        Err(LaunchError::Interrupted)
    } else {
        Err(LaunchError::Failed { failures, code })
    }
}
