//! Where messages wait for their receive: one mailbox per node, keyed by (source rank,
//! destination rank, tag). A message meets the oldest receive posted for its key, or waits in
//! order for the next; a failed mailbox answers every waiting and later receive with the
//! failure. What waits unreceived between two ranks is bounded ([`MAX_HELD_BYTES`]); a key's
//! slot goes once it holds neither a message nor a receive.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use tokio::sync::oneshot;

/// The most bytes of messages from one rank to another that no receive has taken yet. Sends
/// are eager, so messages wait at the receiver until it posts its receives (a GPipe stage may
/// hold all of a step's activations); past this, the job fails naming the pair.
pub(crate) const MAX_HELD_BYTES: usize = 4 << 30;

/// (source rank, destination rank, tag).
pub(crate) type Key = (usize, usize, u64);

/// What a receive gets: the message, or why none will come.
pub(crate) type Delivery = Result<Vec<f32>, String>;

#[derive(Default)]
struct Slot {
    msgs: VecDeque<Vec<f32>>,
    waiters: VecDeque<oneshot::Sender<Delivery>>,
}

#[derive(Default)]
struct State {
    slots: HashMap<Key, Slot>,
    failed: Option<String>,
    /// Bytes waiting unreceived, per (source, destination).
    held: HashMap<(usize, usize), usize>,
}

/// The node's mailbox (see the module doc).
#[derive(Default)]
pub(crate) struct Mailbox {
    state: Mutex<State>,
}

impl Mailbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands `msg` to the oldest receive waiting on `key`, or keeps it for the next. Fails
    /// (and leaves the mailbox as it was) past [`MAX_HELD_BYTES`] between the two ranks; a
    /// failed mailbox drops it (its receives have failed already).
    pub(crate) fn deliver(&self, key: Key, mut msg: Vec<f32>) -> Result<(), String> {
        let mut st = self.lock();
        if st.failed.is_some() {
            return Ok(());
        }
        let slot = st.slots.entry(key).or_default();
        while let Some(w) = slot.waiters.pop_front() {
            match w.send(Ok(msg)) {
                Ok(()) => {
                    st.prune(key);
                    return Ok(());
                }
                // That receive was given up (its handle dropped): the next one gets it.
                Err(back) => msg = back.expect("sent Ok"),
            }
        }
        let bytes = 4 * msg.len();
        let held = st.held.entry((key.0, key.1)).or_default();
        if *held + bytes > MAX_HELD_BYTES {
            let why = format!(
                "rank {} has sent rank {} more than {} GiB that no receive has taken yet \
                 (messages wait at the receiver until it posts its receives: post them \
                 earlier, or send less at once, e.g. 1F1B rather than GPipe)",
                key.0,
                key.1,
                MAX_HELD_BYTES >> 30
            );
            st.prune(key);
            return Err(why);
        }
        *held += bytes;
        st.slots.entry(key).or_default().msgs.push_back(msg);
        Ok(())
    }

    /// The next message on `key`: at once when one waits, else when it comes (or the
    /// mailbox fails).
    pub(crate) fn take(&self, key: Key) -> oneshot::Receiver<Delivery> {
        let (tx, rx) = oneshot::channel();
        let mut st = self.lock();
        if let Some(why) = &st.failed {
            let _ = tx.send(Err(why.clone()));
            return rx;
        }
        let slot = st.slots.entry(key).or_default();
        match slot.msgs.pop_front() {
            Some(m) => {
                let bytes = 4 * m.len();
                let _ = tx.send(Ok(m));
                if let Some(h) = st.held.get_mut(&(key.0, key.1)) {
                    *h -= bytes;
                }
                st.prune(key);
            }
            None => {
                // Receives given up (their handles dropped) wait no more.
                slot.waiters.retain(|w| !w.is_closed());
                slot.waiters.push_back(tx);
            }
        }
        rx
    }

    /// Fails every waiting and later receive with `why` (the first reason stays).
    pub(crate) fn fail(&self, why: &str) {
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some(why.to_string());
        }
        let why = st.failed.clone().expect("set above");
        for (_, slot) in st.slots.drain() {
            for w in slot.waiters {
                let _ = w.send(Err(why.clone()));
            }
        }
        st.held.clear();
    }
}

impl State {
    /// Drops `key`'s slot once it holds neither a message nor a receive.
    fn prune(&mut self, key: Key) {
        if self
            .slots
            .get(&key)
            .is_some_and(|s| s.msgs.is_empty() && s.waiters.is_empty())
        {
            self.slots.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now(rx: oneshot::Receiver<Delivery>) -> Option<Delivery> {
        let mut rx = rx;
        rx.try_recv().ok()
    }

    #[test]
    fn messages_meet_receives_in_order_whichever_comes_first() {
        let m = Mailbox::default();
        m.deliver((0, 1, 5), vec![1.0]).unwrap();
        m.deliver((0, 1, 5), vec![2.0]).unwrap();
        let early = m.take((0, 1, 9));
        assert_eq!(now(m.take((0, 1, 5))), Some(Ok(vec![1.0])));
        assert_eq!(now(m.take((0, 1, 5))), Some(Ok(vec![2.0])));
        let waiting = m.take((0, 1, 5));
        m.deliver((0, 1, 9), vec![9.0]).unwrap();
        m.deliver((0, 1, 5), vec![3.0]).unwrap();
        assert_eq!(now(early), Some(Ok(vec![9.0])));
        assert_eq!(now(waiting), Some(Ok(vec![3.0])));
        assert_eq!(m.lock().held[&(0, 1)], 0);
        // Every slot emptied went: unique tags do not grow the mailbox.
        assert!(m.lock().slots.is_empty());
    }

    #[test]
    fn a_given_up_receive_passes_its_message_on_and_a_failure_reaches_every_waiter() {
        let m = Mailbox::default();
        drop(m.take((2, 0, 1)));
        let next = m.take((2, 0, 1));
        m.deliver((2, 0, 1), vec![4.0]).unwrap();
        assert_eq!(now(next), Some(Ok(vec![4.0])));
        let a = m.take((3, 0, 1));
        m.fail("node 1 failed");
        m.fail("a later reason");
        assert_eq!(now(a), Some(Err("node 1 failed".into())));
        assert_eq!(now(m.take((3, 0, 2))), Some(Err("node 1 failed".into())));
    }

    #[test]
    fn what_waits_unreceived_is_bounded() {
        let m = Mailbox::default();
        m.lock().held.insert((0, 1), MAX_HELD_BYTES - 4);
        m.deliver((0, 1, 0), vec![1.0]).unwrap();
        let e = m.deliver((0, 1, 0), vec![1.0]).unwrap_err();
        assert!(e.contains("rank 0 has sent rank 1 more than 4 GiB"), "{e}");
        // Another pair has its own budget.
        m.deliver((2, 1, 0), vec![1.0]).unwrap();
    }
}
