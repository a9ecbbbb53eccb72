//! Node processes die with the process that started them (a launcher or an agent): on Linux
//! they get a parent-death signal, so a `kill -9` of their launcher leaves no node training
//! on, beside a relaunch, with nobody to stop it.

use std::process::Command;

/// Arms `c`'s process to be killed (SIGKILL) when this process's spawning thread dies, and
/// re-checks its parent after arming: a parent that died first leaves the exec refused
/// (ESRCH) rather than a node running without it. Linux only; elsewhere nothing changes.
pub(super) fn die_with_parent(c: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid are async-signal-safe and touch no
        // memory of the parent; they run in the child between fork and exec.
        unsafe {
            c.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                // The parent died before the signal was armed: do not run without it.
                if libc::getppid() != parent {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = c;
}
