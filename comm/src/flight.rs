//! The flight recorder: each rank keeps its last collectives (op, sequence number, bytes,
//! when each was submitted, started and finished, and how it ended) in a small ring buffer, and
//! writes it to a JSON file the first time a collective fails — like PyTorch's NCCL Flight
//! Recorder, so after a hang or a crash every rank shows what it was doing and which call
//! never completed.
//!
//! The file is `wiretrain-flight-<pid>-rank<rank>.json` in `$WIRETRAIN_FLIGHT_DIR`, or else in
//! a private directory (mode 0700, an unpredictable name) the process makes once under the
//! system temporary directory. The file is always created new: a name that already exists (a
//! planted symlink, say) is never followed or overwritten.

use crate::op::OpId;
use serde::Serialize;
use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

/// Collectives each rank remembers.
pub const CAPACITY: usize = 64;

/// One collective as the recorder saw it (times in ms since the group started).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Entry {
    /// The call's sequence number in its group.
    pub seq: u64,
    /// The collective's name ("all_reduce", "broadcast", ...).
    pub op: &'static str,
    /// The group the call spans and numbers in ("world", "node" or "replica").
    pub group: &'static str,
    /// The group's size.
    pub ranks: usize,
    /// The size of the call's buffer, in bytes.
    pub bytes: usize,
    /// Element type between nodes ("f32", "bf16", ...).
    pub wire: &'static str,
    /// The caller's label for the call ([`crate::group::CallOpts::tag`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<&'static str>,
    /// When the call was submitted.
    pub submitted_ms: f64,
    /// When the communication thread started it (`None` while pending).
    pub started_ms: Option<f64>,
    /// When it ended, successfully or not (`None` while pending or running).
    pub finished_ms: Option<f64>,
    /// "pending", "running", "ok" or the error.
    pub state: String,
    /// Milliseconds this rank spent on its inter-node lane (none when the collective stayed
    /// inside the node or this rank carries no lane).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inter_ms: Option<f64>,
    /// Bytes this rank sent on its inter-node lane (none when [`Self::inter_ms`] is none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inter_bytes: Option<u64>,
}

/// The ring buffer of one rank.
#[derive(Debug)]
pub struct FlightRecorder {
    rank: usize,
    t0: Instant,
    entries: VecDeque<Entry>,
    dumped: Option<PathBuf>,
    /// When tracing: every finished collective, until taken (bounded).
    history: Option<Vec<Entry>>,
    /// Calls started and not yet finished, since when one has been (ms), and the total time
    /// during which one was: what the communication thread carried.
    running: usize,
    busy_since_ms: f64,
    busy_ms: f64,
}

/// Finished collectives kept for a trace between two `take_history` calls at most.
pub const HISTORY_CAP: usize = 100_000;

impl FlightRecorder {
    /// An empty recorder for rank `rank`; its times count from now.
    pub fn new(rank: usize) -> Self {
        Self {
            rank,
            t0: Instant::now(),
            entries: VecDeque::with_capacity(CAPACITY),
            dumped: None,
            history: None,
            running: 0,
            busy_since_ms: 0.0,
            busy_ms: 0.0,
        }
    }

    /// Milliseconds so far during which at least one call of this rank was running (between
    /// its start and its end on the communication thread), the running one included.
    pub fn busy_ms(&self) -> f64 {
        let open = if self.running > 0 {
            self.now() - self.busy_since_ms
        } else {
            0.0
        };
        self.busy_ms + open
    }

    /// The instant the recorder's millisecond times count from.
    pub fn epoch(&self) -> Instant {
        self.t0
    }

    /// Starts (or stops) keeping every finished collective for [`Self::take_history`].
    pub fn keep_history(&mut self, on: bool) {
        self.history = on.then(Vec::new);
    }

    /// The collectives finished since the last call (empty unless history is kept).
    pub fn take_history(&mut self) -> Vec<Entry> {
        self.history
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64() * 1e3
    }

    fn entry(&mut self, id: OpId) -> Option<&mut Entry> {
        let group = id.group.name();
        self.entries
            .iter_mut()
            .rev()
            .find(|e| e.seq == id.seq && e.group == group)
    }

    /// Records a new call as pending (dropping the oldest entry when the ring holds
    /// [`CAPACITY`]); `bytes` is its buffer size, `wire` its wire dtype's name.
    pub fn submitted(
        &mut self,
        id: OpId,
        ranks: usize,
        bytes: usize,
        wire: &'static str,
        tag: Option<&'static str>,
    ) {
        if self.entries.len() == CAPACITY {
            self.entries.pop_front();
        }
        let submitted_ms = self.now();
        self.entries.push_back(Entry {
            seq: id.seq,
            op: id.kind.name(),
            group: id.group.name(),
            ranks,
            bytes,
            wire,
            tag,
            submitted_ms,
            started_ms: None,
            finished_ms: None,
            state: "pending".into(),
            inter_ms: None,
            inter_bytes: None,
        });
    }

    /// Marks call `id` as running on the communication thread.
    pub fn started(&mut self, id: OpId) {
        let t = self.now();
        self.running += 1;
        if self.running == 1 {
            self.busy_since_ms = t;
        }
        if let Some(e) = self.entry(id) {
            e.started_ms = Some(t);
            e.state = "running".into();
        }
    }

    /// Records the inter-node part of a collective (before [`Self::finished`]).
    pub fn inter_link(&mut self, id: OpId, inter: Option<(f64, u64)>) {
        if let (Some((ms, bytes)), Some(e)) = (inter, self.entry(id)) {
            e.inter_ms = Some(ms);
            e.inter_bytes = Some(bytes);
        }
    }

    /// Ends a call that has not ended yet (one a failure cut short or kept from starting)
    /// with `why`.
    pub fn finish_open(&mut self, id: OpId, why: &str) {
        if self
            .entry(id)
            .is_some_and(|e| e.state == "pending" || e.state == "running")
        {
            self.finished(id, Some(why.to_string()));
        }
    }

    /// Marks call `id` as ended: "ok" when `error` is `None`, else the error (and keeps a copy
    /// when history is kept).
    pub fn finished(&mut self, id: OpId, error: Option<String>) {
        let t = self.now();
        let keep = self.history.as_ref().is_some_and(|h| h.len() < HISTORY_CAP);
        // A call ended before it started (kept from starting) was never running; one the
        // ring has dropped already is taken to have been.
        let (was_running, copy) = match self.entry(id) {
            Some(e) => {
                let running = e.started_ms.is_some() && e.finished_ms.is_none();
                e.finished_ms = Some(t);
                e.state = error.unwrap_or_else(|| "ok".into());
                // Copied only while a trace keeps history: the common path allocates nothing.
                (running, keep.then(|| e.clone()))
            }
            None => (true, None),
        };
        if let (Some(c), Some(h)) = (copy, self.history.as_mut()) {
            h.push(c);
        }
        if was_running && self.running > 0 {
            self.running -= 1;
            if self.running == 0 {
                self.busy_ms += t - self.busy_since_ms;
            }
        }
    }

    /// The calls in the ring, oldest first (at most [`CAPACITY`]).
    pub fn entries(&self) -> Vec<Entry> {
        self.entries.iter().cloned().collect()
    }

    /// Writes the ring to its file the first time it is called; later calls return the same
    /// path without writing (the first failure is the one worth keeping).
    pub fn dump_once(&mut self) -> Option<PathBuf> {
        if let Some(p) = &self.dumped {
            return Some(p.clone());
        }
        let dir = match std::env::var_os("WIRETRAIN_FLIGHT_DIR") {
            Some(d) => Ok(PathBuf::from(d)),
            None => private_dir(),
        };
        let body = serde_json::json!({
            "rank": self.rank,
            "pid": std::process::id(),
            "dumped_at_ms": self.now(),
            "collectives": self.entries(),
        });
        let bytes = serde_json::to_vec_pretty(&body).unwrap_or_default();
        // A process that healed into a later job epoch dumps its new group's ring beside the
        // earlier one: the first free of `-rankR.json`, `-rankR-2.json`, ...
        let (pid, rank) = (std::process::id(), self.rank);
        let write = |d: PathBuf| {
            let mut n = 1;
            loop {
                let tail = if n == 1 {
                    String::new()
                } else {
                    format!("-{n}")
                };
                let p = d.join(format!("wiretrain-flight-{pid}-rank{rank}{tail}.json"));
                match write_new(&p, &bytes) {
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 64 => n += 1,
                    r => return r.map(|()| p),
                }
            }
        };
        match dir.and_then(write) {
            Ok(path) => {
                self.dumped = Some(path.clone());
                Some(path)
            }
            Err(e) => {
                tracing::warn!(
                    "flight recorder of rank {}: cannot write its file: {e}",
                    self.rank
                );
                None
            }
        }
    }
}

/// Creates `path` (never an existing name: no symlink is followed) and writes `bytes`.
fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    let mut f = o
        .open(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    f.write_all(bytes)
}

/// This process's private directory for flight-recorder files: created once, mode 0700, with
/// a random name so no other user can plant it in advance.
fn private_dir() -> std::io::Result<PathBuf> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| {
        let tag: u64 = rand::random();
        let d = std::env::temp_dir().join(format!(
            "wiretrain-flight-{}-{tag:016x}",
            std::process::id()
        ));
        #[cfg_attr(not(unix), allow(unused_mut))]
        let mut b = std::fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        b.create(&d)
            .map(|()| d.clone())
            .map_err(|e| format!("{}: {e}", d.display()))
    })
    .clone()
    .map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Busy time is the union of the calls' running spans: overlapping calls count once,
    /// a call kept from starting not at all, and the running one up to now.
    #[test]
    fn busy_time_is_the_union_of_running_calls() {
        use crate::op::{Group, OpKind};
        let id = |seq| OpId {
            kind: OpKind::AllReduce,
            group: Group::World,
            seq,
        };
        let pause = || std::thread::sleep(std::time::Duration::from_millis(20));
        let mut f = FlightRecorder::new(0);
        for seq in 1..=3 {
            f.submitted(id(seq), 2, 64, "f32", None);
        }
        f.started(id(1));
        pause();
        f.started(id(2)); // overlaps call 1
        pause();
        f.finished(id(1), None);
        pause();
        f.finished(id(2), None);
        f.finish_open(id(3), "kept from starting");
        let busy = f.busy_ms();
        assert!(
            (60.0..200.0).contains(&busy),
            "{busy} ms for three 20 ms pauses"
        );
        pause();
        assert_eq!(f.busy_ms(), busy, "idle time is not busy");
        f.submitted(id(4), 2, 64, "f32", None);
        f.started(id(4));
        pause();
        assert!(
            f.busy_ms() >= busy + 20.0,
            "the running call counts up to now"
        );
        f.finished(id(4), None);
        assert_eq!(f.running, 0);
    }

    #[test]
    fn keeps_the_last_collectives_and_their_outcome() {
        use crate::op::{Group, OpKind};
        let id = |kind, group, seq| OpId { kind, group, seq };
        let mut f = FlightRecorder::new(3);
        for seq in 1..=(CAPACITY as u64 + 10) {
            let a = id(OpKind::AllReduce, Group::World, seq);
            f.submitted(a, 4, 4 * seq as usize, "f32", None);
            f.started(a);
            f.finished(a, None);
        }
        // The same number in two groups: two calls, each ended on its own.
        let g = id(OpKind::AllGather, Group::Node, 1000);
        let r = id(OpKind::AllReduce, Group::Replica, 1000);
        f.submitted(g, 2, 64, "f32", Some("grad bucket"));
        f.submitted(r, 2, 64, "f32", None);
        f.started(g);
        f.finished(g, Some("connection to node 1 lost".into()));
        f.finish_open(g, "not this");
        f.finish_open(r, "cut short");
        let e = f.entries();
        assert_eq!(e.len(), CAPACITY);
        assert_eq!(e[0].seq, 13);
        assert_eq!(e[CAPACITY - 2].state, "connection to node 1 lost");
        assert_eq!(e[CAPACITY - 2].group, "node");
        assert_eq!(e.last().unwrap().state, "cut short");
        assert_eq!(e.last().unwrap().started_ms, None);
        let dir = std::env::temp_dir().join(format!("wt-flight-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // SAFETY: this unit test is the only one in the crate that reads this variable.
        unsafe { std::env::set_var("WIRETRAIN_FLIGHT_DIR", &dir) };
        let p = f.dump_once().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(v["collectives"].as_array().unwrap().len(), CAPACITY);
        assert_eq!(v["collectives"][CAPACITY - 2]["op"], "all_gather");
        assert_eq!(v["collectives"][CAPACITY - 2]["tag"], "grad bucket");
        assert!(v["collectives"][0].get("tag").is_none());
        assert_eq!(f.dump_once().unwrap(), p);
        // A name planted in advance (a symlink to a file of someone else's) is not followed:
        // the ring goes to the next free name, as a healed process's later group's does.
        #[cfg(unix)]
        {
            let victim = dir.join("victim");
            std::fs::write(&victim, b"keep").unwrap();
            let mut g = FlightRecorder::new(4);
            let planted = dir.join(format!(
                "wiretrain-flight-{}-rank4.json",
                std::process::id()
            ));
            std::os::unix::fs::symlink(&victim, &planted).unwrap();
            let next = g.dump_once().unwrap();
            assert_eq!(
                next,
                dir.join(format!(
                    "wiretrain-flight-{}-rank4-2.json",
                    std::process::id()
                ))
            );
            assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[cfg(unix)]
    #[test]
    fn the_default_directory_is_private_and_unpredictable() {
        use std::os::unix::fs::PermissionsExt;
        let d = private_dir().unwrap();
        assert_eq!(private_dir().unwrap(), d, "one directory per process");
        let mode = std::fs::metadata(&d).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{mode:o}");
        let name = d.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.len() > format!("wiretrain-flight-{}-", std::process::id()).len() + 8);
        let _ = std::fs::remove_dir(&d);
    }
}
