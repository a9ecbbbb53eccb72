//! Ctrl-C (and SIGTERM/SIGHUP): the first signal asks for a clean stop, a signal more than
//! two seconds later forces the process out at once (exit code 130), like torchrun.
//!
//! The two-second window makes a signal that arrives twice for one keypress (from the terminal
//! to the whole process group, and forwarded by `wiretrain launch`) count once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Exit status of a run stopped by a signal (128 + SIGINT).
pub const INTERRUPTED_EXIT: i32 = 130;

const REPEAT_WINDOW: Duration = Duration::from_secs(2);

type Callback = Box<dyn Fn() + Send + Sync>;

/// Installs the process's handler (once; later calls return the same flag and ignore their
/// callback). `on_stop` runs on the first signal, after the flag is raised; a repeated signal
/// runs it again, then exits with [`INTERRUPTED_EXIT`].
pub fn install(on_stop: Option<Callback>) -> Result<Arc<AtomicBool>, String> {
    static FLAG: OnceLock<Result<Arc<AtomicBool>, String>> = OnceLock::new();
    FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicBool::new(false));
        let first: Mutex<Option<Instant>> = Mutex::new(None);
        let f = flag.clone();
        ctrlc::set_handler(move || {
            let mut first = first.lock().unwrap_or_else(|p| p.into_inner());
            match *first {
                None => {
                    *first = Some(Instant::now());
                    f.store(true, Ordering::SeqCst);
                    eprintln!(
                        "wiretrain: stopping after this step on every rank (signal again to abort)"
                    );
                    if let Some(cb) = &on_stop {
                        cb();
                    }
                }
                Some(t) if t.elapsed() > REPEAT_WINDOW => {
                    eprintln!("wiretrain: aborting");
                    if let Some(cb) = &on_stop {
                        cb();
                    }
                    std::process::exit(INTERRUPTED_EXIT);
                }
                Some(_) => {}
            }
        })
        .map(|()| flag)
        .map_err(|e| format!("cannot install the Ctrl-C handler: {e}"))
    })
    .clone()
}

/// Sends SIGTERM to a child process. A no-op on Windows, which has no signals: there Ctrl-C
/// and console close reach every process attached to the console, the launcher's children
/// included, so each node sees it itself (and the launcher kills a child that outlives its
/// grace period).
pub fn terminate(pid: u32) {
    #[cfg(unix)]
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: kill(2) has no memory effects; a stale pid at worst gets an ESRCH error.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
    #[cfg(not(unix))]
    let _ = pid;
}
