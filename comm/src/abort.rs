//! Failing a node at once: a rank that errors or panics poisons its node's shared buffers (its
//! local peers' collectives end with its reason instead of waiting out the collective timeout)
//! and closes the node's connections with the reason (every other node's collectives end too).
//!
//! A panicking rank thread does this itself: [`crate::ProcessGroup`]'s `Drop` aborts while the
//! thread unwinds, with the panic message that [`note_panics`] recorded for that thread.

use crate::transport::local::NodeShared;
use std::cell::RefCell;
use std::sync::{Arc, Once};

/// Closes the node's endpoint with a reason, so every peer node learns at once.
pub(crate) type FailHook = Arc<dyn Fn(String) + Send + Sync>;

/// Fails one rank's node (cheap to clone, usable from any thread).
#[derive(Clone)]
pub struct Aborter {
    pub(crate) shared: Arc<NodeShared>,
    pub(crate) on_fail: FailHook,
    pub(crate) local: usize,
    pub(crate) rank: usize,
}

impl std::fmt::Debug for Aborter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Aborter").field("rank", &self.rank).finish()
    }
}

impl Aborter {
    /// Fails every rank of the job with `reason` (the first reason given wins on this node).
    pub fn abort(&self, reason: &str) {
        tracing::error!(rank = self.rank, "{reason}");
        self.shared
            .abort(self.local, format!("rank {}: {reason}", self.rank));
        (self.on_fail)(format!("rank {} failed: {reason}", self.rank));
    }

    /// This rank left the job without failing (its process group was dropped): local peers
    /// that still wait for it fail at once instead of waiting out the collective timeout.
    pub fn leave(&self, reason: &str) {
        self.shared
            .leave(self.local, format!("rank {}: {reason}", self.rank));
    }

    /// The global rank this handle fails in the name of.
    pub fn rank(&self) -> usize {
        self.rank
    }
}

/// What a rank thread does first when it panics (see [`on_panic`]).
type PanicAction = Box<dyn FnOnce(&str)>;

thread_local! {
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
    static ON_PANIC: RefCell<Option<PanicAction>> = const { RefCell::new(None) };
}

/// Sets what this thread does first if it panics, called by the panic hook with the message
/// before the previous hook prints the panic (with `RUST_BACKTRACE` set, symbolizing a
/// backtrace of a large binary takes seconds, during which peers would wait): a rank fails
/// its node with it at once. `None` clears it. Needs [`note_panics`].
pub fn on_panic(action: Option<PanicAction>) {
    ON_PANIC.with(|a| *a.borrow_mut() = action);
}

/// Installs (once per process) a panic hook that records each thread's panic message before
/// the previous hook runs (which still prints it), so a dropping process group can name it.
pub fn note_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let msg = panic_message(info.payload());
            let at = info
                .location()
                .map(|l| format!(" at {}:{}", l.file(), l.line()))
                .unwrap_or_default();
            let msg = format!("{msg}{at}");
            LAST_PANIC.with(|p| *p.borrow_mut() = Some(msg.clone()));
            if let Some(act) = ON_PANIC.with(|a| a.borrow_mut().take()) {
                act(&msg);
            }
            prev(info);
        }));
    });
}

/// The message of the panic this thread is unwinding from, when [`note_panics`] saw it.
pub fn current_panic() -> Option<String> {
    LAST_PANIC.with(|p| p.borrow().clone())
}

/// The text of a panic payload (`&str` or `String`; anything else is named as such).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-text payload".into()
    }
}
