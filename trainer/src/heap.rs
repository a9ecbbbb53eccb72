//! Measured host memory: a counting global allocator that tracks the live and peak heap bytes
//! of the process. The `wiretrain` binary installs it; a program of your own opts in with
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: wiretrain::heap::CountingAlloc = wiretrain::heap::CountingAlloc;
//!
//! fn main() {
//!     ALLOC.mark_installed(); // first thing: the figures are reported from here on
//!     // ...
//! }
//! ```
//!
//! and the training summary then carries each rank's `peak_heap_bytes` (its process's peak of
//! live heap bytes during the steps: the flat buffers, the optimizer state, gathered ZeRO-3
//! units, and on Burn's CPU backend the model's tensors and activations too). Without it the
//! figure is absent. Cost per allocation: one relaxed atomic add and a load (and a `fetch_max`
//! when it sets a new peak).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting live bytes and their peak.
pub struct CountingAlloc;

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    // A plain load first: the read-modify-write (a contended cache line across the rank and
    // network threads) only when this allocation sets a new peak.
    if now > PEAK.load(Ordering::Relaxed) {
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

// SAFETY: every call goes to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
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
            if new >= l.size() {
                grew(new - l.size());
            } else {
                LIVE.fetch_sub(l.size() - new, Ordering::Relaxed);
            }
        }
        q
    }
}

impl CountingAlloc {
    /// Marks the allocator as installed (the binary calls it first thing in `main`), so that
    /// [`peak_bytes`] reports figures.
    pub fn mark_installed(&self) {
        INSTALLED.store(true, Ordering::Relaxed);
    }
}

/// Whether the process counts its heap (the binary installed [`CountingAlloc`]).
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Live heap bytes now, when counted.
pub fn live_bytes() -> Option<usize> {
    installed().then(|| LIVE.load(Ordering::Relaxed))
}

/// The peak of live heap bytes since the last [`reset_peak`], when counted.
pub fn peak_bytes() -> Option<usize> {
    installed().then(|| PEAK.load(Ordering::Relaxed))
}

/// Starts a new peak from the bytes live now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}
