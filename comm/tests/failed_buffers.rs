//! The buffers of failed collectives are freed with the node, not leaked (a heal tears the
//! node's groups down and joins again: before, each heal leaked the failed step's buffers, up to
//! a full gradient per local rank). 20 rounds in one process of: a 2 nodes x 2 ranks job on
//! loopback whose rank 0 leaves while the three others are in a 4 MiB all-reduce (they fail,
//! holding their buffers), then the teardown. This test binary counts the process's live heap
//! bytes (its own global allocator); growth over the rounds stays below one leaked buffer.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use wiretrain_comm::ReduceOp;

static LIVE: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting live bytes.
struct Counting;

// SAFETY: every call goes to the system allocator unchanged; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            LIVE.fetch_add(l.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            LIVE.fetch_add(l.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: forwarded as is.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            LIVE.fetch_add(new, Ordering::Relaxed);
            LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Elements of the all-reduce the failure interrupts: 4 MiB.
const BIG: usize = 1 << 20;

/// One round: rank 0 leaves after a first all-reduce; every other rank fails in the second,
/// with its 4 MiB buffer published to the node or on its lane. Returns the other ranks' errors.
fn a_failed_round(round: usize) -> Vec<String> {
    // A node whose ranks failed fails its shutdown too, which drops its ranks' results: each
    // rank reports here instead.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let report = seen.clone();
    let _ = common::cluster(&[2, 2], "failed-buffers", move |mut pg| {
        let first = pg.all_reduce(vec![1.0; 64], ReduceOp::Sum).wait();
        let outcome = match first {
            Err(e) => Err(format!("first all-reduce: {e}")),
            Ok(_) if pg.rank() == 0 => {
                drop(pg);
                return;
            }
            Ok(_) => match pg.all_reduce(vec![1.0; BIG], ReduceOp::Sum).wait() {
                Ok(_) => Err(format!("rank {} completed without rank 0", pg.rank())),
                Err(e) => Ok(e.to_string()),
            },
        };
        report.lock().unwrap().push(outcome);
    });
    let outcomes = std::mem::take(&mut *seen.lock().unwrap());
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|e| panic!("round {round}: {e}")))
        .collect()
}

#[test]
fn twenty_failed_rounds_in_one_process_free_their_buffers() {
    let mut after = Vec::new();
    for round in 0..20 {
        let errors = a_failed_round(round);
        assert_eq!(errors.len(), 3, "round {round}: the three other ranks fail");
        after.push(LIVE.load(Ordering::Relaxed));
    }
    // From the end of the second round on (the first sets up process-wide state: TLS
    // providers, thread-locals), the live heap may move by allocator noise, not by 18 rounds of
    // up to three 4 MiB buffers (216 MiB when they were leaked).
    let grew = after[19].saturating_sub(after[1]);
    eprintln!("live heap after each round (MiB): {:?}", mib(&after));
    assert!(
        grew < 4 * BIG,
        "the live heap grew by {:.1} MiB over 18 failed rounds: {:?}",
        grew as f64 / (1 << 20) as f64,
        mib(&after)
    );
}

fn mib(v: &[usize]) -> Vec<String> {
    v.iter()
        .map(|b| format!("{:.1}", *b as f64 / (1 << 20) as f64))
        .collect()
}
