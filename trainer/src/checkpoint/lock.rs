//! One run per checkpoint directory: an advisory lock (`flock`) on `D/wiretrain.lock`, held
//! for the life of the run, and a lease in that file naming the holder (host, pid, job id,
//! start time). A second run on the directory is refused naming the holder
//! ([`CheckpointError::Locked`]). A lease left by a run that died (the lock free) is reported
//! and taken over; a lease whose pid is dead while the lock is still held is reported and
//! never broken. Within one process the lock is shared: the node and its trainer take it
//! once. The lock is advisory and per machine unless the file system shares `flock` locks
//! (local disks, NFSv4, most Lustre mounts with `flock`).

use super::{CheckpointError, io};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

/// The lock file inside a checkpoint directory.
pub const LOCK_FILE: &str = "wiretrain.lock";

/// Who holds a checkpoint directory, as its lock file says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The holder's host name.
    pub host: String,
    /// The holder's process id on that host.
    pub pid: u32,
    /// The batch system's job id (Slurm, PBS, LSF, SGE, Flux) or the launch's, if any.
    pub job: Option<String>,
    /// When the holder took the lease, in seconds since the Unix epoch.
    pub started_unix: u64,
}

impl Lease {
    /// This process's lease, now.
    pub fn mine() -> Self {
        let job = [
            "SLURM_JOB_ID",
            "PBS_JOBID",
            "LSB_JOBID",
            "FLUX_JOB_ID",
            "JOB_ID",
            crate::job::env::JOB_ID,
        ]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()));
        Self {
            host: hostname(),
            pid: std::process::id(),
            job,
            started_unix: unix_now(),
        }
    }

    /// Whether the holder is known to be gone: its pid is not running on this host.
    pub fn holder_dead(&self) -> bool {
        self.host == hostname() && !pid_alive(self.pid)
    }
}

impl std::fmt::Display for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "host {}, pid {}", self.host, self.pid)?;
        if let Some(j) = &self.job {
            write!(f, ", job {j}")?;
        }
        let ago = unix_now().saturating_sub(self.started_unix);
        write!(f, ", started {ago} s ago")
    }
}

/// The lock on a checkpoint directory; released (and its lease cleared) when the last clone
/// in this process drops.
#[derive(Clone)]
pub struct DirLock(Arc<Held>);

impl std::fmt::Debug for DirLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DirLock").field(&self.0.lock_file).finish()
    }
}

struct Held {
    file: File,
    lock_file: PathBuf,
}

impl Drop for Held {
    fn drop(&mut self) {
        // The lease goes with the lock (a dead holder leaves it behind: that is how a stale
        // one is told). The file stays: removing it would race with a run opening it.
        if let Err(e) = self.file.set_len(0) {
            tracing::warn!("{}: clearing the lease: {e}", self.lock_file.display());
        }
    }
}

/// The locks this process holds, by lock file (`flock` locks are per open file: a second
/// open of the same file in this process would refuse itself).
static HELD: Mutex<Vec<(PathBuf, Weak<Held>)>> = Mutex::new(Vec::new());

impl DirLock {
    /// Locks `root` (created if missing) for this process's run and writes its lease, or
    /// refuses naming the holder. A stale lease of a run that died is reported and replaced.
    pub fn acquire(root: &Path) -> Result<Self, CheckpointError> {
        std::fs::create_dir_all(root).map_err(io(root))?;
        let lock_file = root.canonicalize().map_err(io(root))?.join(LOCK_FILE);
        let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
        held.retain(|(_, w)| w.strong_count() > 0);
        if let Some(h) = held
            .iter()
            .find(|(p, _)| *p == lock_file)
            .and_then(|(_, w)| w.upgrade())
        {
            return Ok(Self(h));
        }
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_file)
            .map_err(io(&lock_file))?;
        let old = read_lease(&mut file);
        if !try_lock(&file, &lock_file)? {
            return Err(refusal(root, old));
        }
        if let Some(old) = old {
            let why = match old.holder_dead() {
                true => "its process is gone",
                false => "its lock was free: that run ended without releasing it",
            };
            tracing::warn!(
                "checkpoint directory {}: taking over the stale lease of {old} ({why})",
                root.display()
            );
        }
        let lease = Lease::mine();
        let text = serde_json::to_string(&lease).expect("a lease serializes");
        file.set_len(0).map_err(io(&lock_file))?;
        file.rewind().map_err(io(&lock_file))?;
        file.write_all(format!("{text}\n").as_bytes())
            .and_then(|()| file.sync_data())
            .map_err(io(&lock_file))?;
        let h = Arc::new(Held {
            file,
            lock_file: lock_file.clone(),
        });
        held.push((lock_file, Arc::downgrade(&h)));
        Ok(Self(h))
    }
}

/// The error for a directory whose lock another process holds: its lease names the holder.
fn refusal(root: &Path, lease: Option<Lease>) -> CheckpointError {
    let holder = match lease {
        Some(l) if l.holder_dead() => {
            let h = format!(
                "{l}; its pid is not running, so a process it started holds the lock (the lease \
                 is stale, and is not broken while the lock is held)"
            );
            tracing::warn!("checkpoint directory {}: {h}", root.display());
            h
        }
        Some(l) => l.to_string(),
        None => "a holder whose lease is not written yet or unreadable".into(),
    };
    CheckpointError::Locked {
        dir: root.to_path_buf(),
        holder,
    }
}

/// The lease in the lock file, if one parses.
fn read_lease(file: &mut File) -> Option<Lease> {
    let mut text = String::new();
    file.rewind().ok()?;
    // A lease is one short line; a larger file is not one.
    file.take(4096).read_to_string(&mut text).ok()?;
    serde_json::from_str(text.trim()).ok()
}

/// Takes the lock without waiting: `false` when another open file holds it. A file system
/// without `flock` gets a warning and no lock (the lease is still written).
#[cfg(unix)]
fn try_lock(file: &File, path: &Path) -> Result<bool, CheckpointError> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor this `File` owns; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(false),
        Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL) => {
            tracing::warn!(
                "{}: this file system does not lock files ({e}); runs sharing the directory \
                 are not detected",
                path.display()
            );
            Ok(true)
        }
        _ => Err(io(path)(e)),
    }
}

#[cfg(not(unix))]
fn try_lock(_file: &File, path: &Path) -> Result<bool, CheckpointError> {
    tracing::warn!(
        "{}: checkpoint directories are locked on Unix only; runs sharing it are not detected",
        path.display()
    );
    Ok(true)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(unix)]
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match rc {
        0 => String::from_utf8_lossy(&buf[..end]).into_owned(),
        _ => "unknown-host".into(),
    }
}

#[cfg(not(unix))]
fn hostname() -> String {
    std::env::var("COMPUTERNAME").unwrap_or_else(|_| "unknown-host".into())
}

/// Whether `pid` runs on this host (a process we may not signal still runs).
#[cfg(unix)]
fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(not(unix))]
fn pid_alive(_pid: u32) -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("wiretrain-lock-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn one_process_shares_its_lock_and_clears_the_lease_on_release() {
        let d = dir("share");
        let a = DirLock::acquire(&d).unwrap();
        let b = DirLock::acquire(&d).unwrap();
        let text = std::fs::read_to_string(d.join(LOCK_FILE)).unwrap();
        let lease: Lease = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(lease.pid, std::process::id());
        drop((a, b));
        assert_eq!(std::fs::read(d.join(LOCK_FILE)).unwrap(), b"");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_stale_lease_with_a_free_lock_is_taken_over() {
        let d = dir("stale");
        std::fs::create_dir_all(&d).unwrap();
        let old = Lease {
            host: hostname(),
            pid: u32::MAX - 1,
            job: Some("1234".into()),
            started_unix: 1,
        };
        assert!(old.holder_dead());
        std::fs::write(d.join(LOCK_FILE), serde_json::to_string(&old).unwrap()).unwrap();
        let l = DirLock::acquire(&d).unwrap();
        let text = std::fs::read_to_string(d.join(LOCK_FILE)).unwrap();
        assert!(
            text.contains(&format!("\"pid\":{}", std::process::id())),
            "{text}"
        );
        drop(l);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[cfg(unix)]
    #[test]
    fn a_held_lock_is_refused_naming_the_holder() {
        use std::os::fd::AsRawFd;
        let d = dir("held");
        std::fs::create_dir_all(&d).unwrap();
        let lease = Lease {
            job: Some("777".into()),
            ..Lease::mine()
        };
        std::fs::write(d.join(LOCK_FILE), serde_json::to_string(&lease).unwrap()).unwrap();
        // Another open file description holds it, as another process would.
        let other = File::open(d.join(LOCK_FILE)).unwrap();
        // SAFETY: flock on a descriptor `other` owns.
        assert_eq!(unsafe { libc::flock(other.as_raw_fd(), libc::LOCK_EX) }, 0);
        let e = DirLock::acquire(&d).expect_err("refused").to_string();
        assert!(e.contains("job 777") && e.contains(&lease.host), "{e}");
        drop(other);
        let _ = std::fs::remove_dir_all(&d);
    }
}
