//! The host's messages to agents: one at a time or all at once.

use super::Host;
use crate::elastic::protocol::{self, ToAgent};

impl Host {
    /// Sends `m` to agent `id`; an agent that cannot be told counts as gone.
    pub(super) async fn tell(&mut self, id: u64, m: &ToAgent) {
        self.tell_all(&[(id, m.clone())]).await;
    }

    /// Sends each agent its message, all at once: a stalled agent costs its send's timeout
    /// once, not once per agent after it. An agent whose send fails counts as gone.
    pub(super) async fn tell_all(&mut self, msgs: &[(u64, ToAgent)]) {
        type Sending<'a> =
            std::pin::Pin<Box<dyn Future<Output = (u64, Result<(), String>)> + Send + 'a>>;
        let mut sends: Vec<Option<Sending<'_>>> = Vec::new();
        for (&id, a) in self.agents.iter_mut() {
            if a.gone.is_some() {
                continue;
            }
            if let Some((_, m)) = msgs.iter().find(|(to, _)| *to == id) {
                sends.push(Some(Box::pin(async move {
                    (id, protocol::send(&mut a.send, m).await)
                })));
            }
        }
        let mut failed = Vec::new();
        std::future::poll_fn(|cx| {
            let mut pending = false;
            for slot in sends.iter_mut() {
                let Some(f) = slot else { continue };
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready((id, r)) => {
                        if let Err(e) = r {
                            failed.push((id, e));
                        }
                        *slot = None;
                    }
                    std::task::Poll::Pending => pending = true,
                }
            }
            if pending {
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(())
            }
        })
        .await;
        drop(sends);
        for (id, e) in failed {
            if let Some(a) = self.agents.get_mut(&id) {
                a.gone = Some(e);
            }
        }
    }
}
