//! Shared host buffers between the rank threads of one node.
//!
//! Ranks of a node are threads of one process, so "shared buffers" are the ranks' own buffers:
//! at the start of a collective each rank publishes a pointer to its buffer in its slot, and
//! the ranks read and write each other's buffers directly between barriers, with no socket,
//! copy into a channel, or serialization. Soundness rests on two rules the collectives follow:
//!
//! 1. Between two barriers, every element of every buffer is written by at most one rank, and
//!    an element that is written is read by no other rank.
//! 2. A buffer is published only between the first and last barrier of a collective, and its
//!    owner does not touch it outside the ranges the plan gives it until the last barrier.
//!
//! The barrier can be aborted: a rank that fails poisons it with its error, so the other ranks
//! return that error instead of waiting forever.

use std::ops::Range;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// What each rank publishes at the start of a collective; all ranks must agree on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Call {
    pub seq: u64,
    pub op: u8,
    /// The group the call spans (`op::Group::code`): its sequence numbers are its own.
    pub group: u8,
    /// Elements in the (full) buffer.
    pub len: usize,
    /// Op-specific argument (the root of a broadcast).
    pub arg: usize,
}

#[derive(Clone, Copy)]
struct Slot {
    ptr: *mut f32,
    len: usize,
    call: Call,
}

// SAFETY: the pointer is only dereferenced under the rules in the module docs.
unsafe impl Send for Slot {}

/// How long a barrier waits, after a rank it needs left, for that rank's node failure (and its
/// reason) before it fails with "left the job".
const LEAVE_GRACE: Duration = Duration::from_millis(500);

/// Why a barrier wait failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BarrierError {
    /// Local rank `rank` aborted the node with `reason`.
    Aborted { rank: usize, reason: String },
    /// The wait exceeded its timeout; `missing` are the local ranks that had not arrived.
    Timeout { missing: Vec<usize> },
    /// Local rank `rank`, which this wait needs, left the job (its process group was dropped).
    Departed { rank: usize, reason: String },
}

struct BarrierState {
    arrived: Vec<bool>,
    count: usize,
    generation: u64,
    aborted: Option<(usize, String)>,
    /// Ranks that left the job, with why.
    left: Vec<Option<String>>,
}

/// The shared state of the ranks of one node.
pub(crate) struct NodeShared {
    ranks: usize,
    slots: Mutex<Vec<Option<Slot>>>,
    state: Mutex<BarrierState>,
    cv: Condvar,
    /// Buffers of failed collectives: other ranks of the node may still read or write them
    /// (they learn of the failure at their next barrier), so they are kept here, not freed,
    /// and freed with this state, when the last rank of the node has let go of it.
    parked: Mutex<Vec<Vec<f32>>>,
}

impl NodeShared {
    pub(crate) fn new(ranks: usize) -> Self {
        Self {
            ranks,
            slots: Mutex::new(vec![None; ranks]),
            state: Mutex::new(BarrierState {
                arrived: vec![false; ranks],
                count: 0,
                generation: 0,
                aborted: None,
                left: vec![None; ranks],
            }),
            cv: Condvar::new(),
            parked: Mutex::new(Vec::new()),
        }
    }

    /// Keeps the buffer of a failed collective until the node's shared state is dropped: every
    /// rank that could still reach it through a slot holds this state, so it is freed only
    /// when none of them can (a heal's teardown of the node's groups frees the failed step's
    /// buffers; before, each heal leaked them for good).
    pub(crate) fn park(&self, buf: Vec<f32>) {
        self.parked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(buf);
    }

    /// Waits until all local ranks arrive, the barrier is aborted, or `timeout` passes.
    pub(crate) fn barrier(&self, rank: usize, timeout: Duration) -> Result<(), BarrierError> {
        if self.ranks == 1 {
            return self.check_aborted();
        }
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((r, why)) = &st.aborted {
            return Err(BarrierError::Aborted {
                rank: *r,
                reason: why.clone(),
            });
        }
        let gen_at_entry = st.generation;
        let mut departed_seen: Option<Instant> = None;
        st.arrived[rank] = true;
        st.count += 1;
        if st.count == self.ranks {
            st.count = 0;
            st.arrived.iter_mut().for_each(|a| *a = false);
            st.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        loop {
            // A completed barrier wins over a later abort: the others have moved on.
            if st.generation != gen_at_entry {
                return Ok(());
            }
            if let Some((r, why)) = &st.aborted {
                return Err(BarrierError::Aborted {
                    rank: *r,
                    reason: why.clone(),
                });
            }
            // A rank this barrier still waits for will never come. It may be about to fail
            // the node with its reason (`wiretrain::run` does so right after a rank's closure
            // returned an error, which dropped its group): give that reason a moment to win.
            let now = Instant::now();
            if let Some(r) = (0..self.ranks).find(|&i| !st.arrived[i] && st.left[i].is_some()) {
                let since = *departed_seen.get_or_insert(now);
                if now >= since + LEAVE_GRACE || now >= deadline {
                    st.arrived[rank] = false;
                    st.count -= 1;
                    return Err(BarrierError::Departed {
                        rank: r,
                        reason: st.left[r].clone().unwrap_or_default(),
                    });
                }
                let wake = (since + LEAVE_GRACE).min(deadline);
                st = self
                    .cv
                    .wait_timeout(st, wake.saturating_duration_since(now))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                continue;
            }
            if now >= deadline {
                let missing: Vec<usize> = (0..self.ranks).filter(|&i| !st.arrived[i]).collect();
                // Leave the barrier and poison it under the same lock, so no late arrival
                // can complete it with this rank gone.
                st.arrived[rank] = false;
                st.count -= 1;
                st.aborted = Some((
                    rank,
                    format!("timed out waiting for local ranks {missing:?} at a barrier"),
                ));
                self.cv.notify_all();
                return Err(BarrierError::Timeout { missing });
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn check_aborted(&self) -> Result<(), BarrierError> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match &st.aborted {
            Some((r, why)) => Err(BarrierError::Aborted {
                rank: *r,
                reason: why.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Which local rank poisoned the node, and why (`None` while it is healthy).
    pub(crate) fn aborted(&self) -> Option<(usize, String)> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.aborted.clone()
    }

    /// Local rank `rank` left the job: a barrier that waits for it fails at once (barriers it
    /// already passed, and ranks that finish cleanly, are unaffected).
    pub(crate) fn leave(&self, rank: usize, reason: String) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.left[rank] = Some(reason);
        self.cv.notify_all();
    }

    /// Poisons the node: every current and future barrier wait fails with this reason.
    pub(crate) fn abort(&self, rank: usize, reason: String) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.aborted.is_none() {
            st.aborted = Some((rank, reason));
        }
        self.cv.notify_all();
    }

    /// Publishes `rank`'s buffer for the current collective.
    #[cfg(test)]
    pub(crate) fn publish(&self, rank: usize, buf: &mut [f32], call: Call) {
        self.publish_raw(rank, buf.as_mut_ptr(), buf.len(), call);
    }

    /// Publishes a raw buffer; the caller keeps it alive and accesses it only through the
    /// same pointer until the collective's last barrier (or, on failure, parks it: [`park`](Self::park)).
    pub(crate) fn publish_raw(&self, rank: usize, ptr: *mut f32, len: usize, call: Call) {
        let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        s[rank] = Some(Slot { ptr, len, call });
    }

    /// After the first barrier: the published buffers, checked to belong to the same call.
    pub(crate) fn peers(&self, me: usize) -> Result<Peers, String> {
        let s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let mine = s[me].expect("own slot published before peers()");
        let mut out = Vec::with_capacity(self.ranks);
        for (i, slot) in s.iter().enumerate() {
            let slot = slot.ok_or_else(|| format!("local rank {i} published no buffer"))?;
            if slot.call != mine.call {
                return Err(format!(
                    "local rank {me} called {:?} but local rank {i} called {:?}",
                    mine.call, slot.call
                ));
            }
            out.push((slot.ptr, slot.len));
        }
        Ok(Peers { bufs: out })
    }
}

/// The buffers of all local ranks during one collective.
pub(crate) struct Peers {
    bufs: Vec<(*mut f32, usize)>,
}

impl Peers {
    /// The calling rank's own buffer alone (a call of a group with one rank on this node).
    pub(crate) fn solo(ptr: *mut f32, len: usize) -> Self {
        Self {
            bufs: vec![(ptr, len)],
        }
    }

    /// Rank `rank`'s elements `r`, for reading.
    ///
    /// # Safety
    /// No other rank may write these elements until the next barrier (module rule 1).
    pub(crate) unsafe fn read(&self, rank: usize, r: Range<usize>) -> &[f32] {
        let (p, len) = self.bufs[rank];
        assert!(r.end <= len, "range {r:?} outside buffer of {len}");
        // SAFETY: in bounds (checked); aliasing guaranteed by the caller.
        unsafe { std::slice::from_raw_parts(p.add(r.start), r.len()) }
    }

    /// Rank `rank`'s elements `r`, for writing.
    ///
    /// # Safety
    /// Only the calling rank writes these elements and no other rank reads them until the
    /// next barrier (module rule 1).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn write(&self, rank: usize, r: Range<usize>) -> &mut [f32] {
        let (p, len) = self.bufs[rank];
        assert!(r.end <= len, "range {r:?} outside buffer of {len}");
        // SAFETY: in bounds (checked); exclusivity guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(p.add(r.start), r.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn barrier_releases_and_reuses() {
        let s = Arc::new(NodeShared::new(3));
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        s.barrier(r, Duration::from_secs(10)).unwrap();
                    }
                })
            })
            .collect();
        hs.into_iter().for_each(|h| h.join().unwrap());
    }

    #[test]
    fn barrier_times_out_naming_missing_rank() {
        let s = NodeShared::new(2);
        let e = s.barrier(0, Duration::from_millis(50)).unwrap_err();
        assert_eq!(e, BarrierError::Timeout { missing: vec![1] });
    }

    #[test]
    fn abort_wakes_waiters() {
        let s = Arc::new(NodeShared::new(2));
        let s2 = s.clone();
        let h = std::thread::spawn(move || s2.barrier(0, Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(50));
        s.abort(1, "boom".into());
        assert_eq!(
            h.join().unwrap().unwrap_err(),
            BarrierError::Aborted {
                rank: 1,
                reason: "boom".into()
            }
        );
        assert!(s.barrier(1, Duration::from_secs(1)).is_err());
    }

    #[test]
    fn mismatched_calls_are_reported() {
        let s = NodeShared::new(2);
        let mut a = vec![0.0f32; 4];
        let mut b = vec![0.0f32; 5];
        s.publish(
            0,
            &mut a,
            Call {
                seq: 1,
                op: 1,
                group: 0,
                len: 4,
                arg: 0,
            },
        );
        s.publish(
            1,
            &mut b,
            Call {
                seq: 1,
                op: 1,
                group: 0,
                len: 5,
                arg: 0,
            },
        );
        let e = s.peers(0).err().unwrap();
        assert!(e.contains("local rank 1"), "{e}");
    }
}
