//! The flight recorder: each rank keeps its last collectives (op, sequence number, bytes,
//! when each was submitted, started and finished, and how it ended) in a small ring buffer, and
//! writes it to a JSON file the first time a collective fails — like PyTorch's NCCL Flight
//! Recorder, so after a hang or a crash every rank shows what it was doing and which call
//! never completed.
//!
//! The file is `wiretrain-flight-<pid>-rank<rank>.json` in `$WIRETRAIN_FLIGHT_DIR` (or the
//! system temporary directory).

use serde::Serialize;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Instant;

/// Collectives each rank remembers.
pub const CAPACITY: usize = 64;

/// One collective as the recorder saw it (times in ms since the group started).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Entry {
    pub seq: u64,
    pub op: &'static str,
    pub bytes: usize,
    /// Element type between nodes ("f32", "bf16", ...).
    pub wire: &'static str,
    pub submitted_ms: f64,
    pub started_ms: Option<f64>,
    pub finished_ms: Option<f64>,
    /// "pending", "running", "ok" or the error.
    pub state: String,
    /// Milliseconds and bytes this rank spent sending on its inter-node lane (none when the
    /// collective stayed inside the node or this rank carries no lane).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inter_ms: Option<f64>,
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
}

/// Finished collectives kept for a trace between two `take_history` calls at most.
pub const HISTORY_CAP: usize = 100_000;

impl FlightRecorder {
    pub fn new(rank: usize) -> Self {
        Self {
            rank,
            t0: Instant::now(),
            entries: VecDeque::with_capacity(CAPACITY),
            dumped: None,
            history: None,
        }
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

    fn entry(&mut self, seq: u64) -> Option<&mut Entry> {
        self.entries.iter_mut().rev().find(|e| e.seq == seq)
    }

    pub fn submitted(&mut self, seq: u64, op: &'static str, bytes: usize, wire: &'static str) {
        if self.entries.len() == CAPACITY {
            self.entries.pop_front();
        }
        let submitted_ms = self.now();
        self.entries.push_back(Entry {
            seq,
            op,
            bytes,
            wire,
            submitted_ms,
            started_ms: None,
            finished_ms: None,
            state: "pending".into(),
            inter_ms: None,
            inter_bytes: None,
        });
    }

    pub fn started(&mut self, seq: u64) {
        let t = self.now();
        if let Some(e) = self.entry(seq) {
            e.started_ms = Some(t);
            e.state = "running".into();
        }
    }

    /// Records the inter-node part of a collective (before [`Self::finished`]).
    pub fn inter_link(&mut self, seq: u64, inter: Option<(f64, u64)>) {
        if let (Some((ms, bytes)), Some(e)) = (inter, self.entry(seq)) {
            e.inter_ms = Some(ms);
            e.inter_bytes = Some(bytes);
        }
    }

    pub fn finished(&mut self, seq: u64, error: Option<String>) {
        let t = self.now();
        let keep = self.history.as_ref().is_some_and(|h| h.len() < HISTORY_CAP);
        if let Some(e) = self.entry(seq) {
            e.finished_ms = Some(t);
            e.state = error.unwrap_or_else(|| "ok".into());
            // Copied only while a trace keeps history: the common path allocates nothing.
            let copy = keep.then(|| e.clone());
            if let (Some(c), Some(h)) = (copy, self.history.as_mut()) {
                h.push(c);
            }
        }
    }

    pub fn entries(&self) -> Vec<Entry> {
        self.entries.iter().cloned().collect()
    }

    /// Writes the ring to its file the first time it is called; later calls return the same
    /// path without writing (the first failure is the one worth keeping).
    pub fn dump_once(&mut self) -> Option<PathBuf> {
        if let Some(p) = &self.dumped {
            return Some(p.clone());
        }
        let dir = std::env::var_os("WIRETRAIN_FLIGHT_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let path = dir.join(format!(
            "wiretrain-flight-{}-rank{}.json",
            std::process::id(),
            self.rank
        ));
        let body = serde_json::json!({
            "rank": self.rank,
            "pid": std::process::id(),
            "dumped_at_ms": self.now(),
            "collectives": self.entries(),
        });
        match std::fs::write(&path, serde_json::to_vec_pretty(&body).unwrap_or_default()) {
            Ok(()) => {
                self.dumped = Some(path.clone());
                Some(path)
            }
            Err(e) => {
                tracing::warn!(
                    "flight recorder of rank {}: cannot write {}: {e}",
                    self.rank,
                    path.display()
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_collectives_and_their_outcome() {
        let mut f = FlightRecorder::new(3);
        for seq in 1..=(CAPACITY as u64 + 10) {
            f.submitted(seq, "all_reduce", 4 * seq as usize, "f32");
            f.started(seq);
            f.finished(seq, None);
        }
        f.submitted(1000, "all_gather", 64, "f32");
        f.started(1000);
        f.finished(1000, Some("connection to node 1 lost".into()));
        let e = f.entries();
        assert_eq!(e.len(), CAPACITY);
        assert_eq!(e[0].seq, 12);
        assert_eq!(e.last().unwrap().state, "connection to node 1 lost");
        let dir = std::env::temp_dir().join(format!("wt-flight-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // SAFETY: this unit test is the only one in the crate that reads this variable.
        unsafe { std::env::set_var("WIRETRAIN_FLIGHT_DIR", &dir) };
        let p = f.dump_once().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(v["collectives"].as_array().unwrap().len(), CAPACITY);
        assert_eq!(v["collectives"][CAPACITY - 1]["op"], "all_gather");
        assert_eq!(f.dump_once().unwrap(), p);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
