//! The agent's side of the rendezvous: it joins, then takes the host's messages (start an
//! epoch's node, stop it, regroup, the job's end) and reports what its node does, until the
//! job ends.

use super::AgentOptions;
use super::node::{Node, end_node, heal_in_place, start_node, watch};
use crate::elastic::launcher::{LaunchError, temp_dir};
use crate::elastic::protocol::{self, NodeEnd, Start, ToAgent, ToHost};
use crate::heal::{Answer, answer_file, regroup_file, write_json};
use quinn::SendStream;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use wiretrain_comm::tls::JobIdentity;

/// How long an agent stopped by a signal, its node ended, waits for the host's last word.
const LEAVE_WITHIN: Duration = Duration::from_secs(10);

/// One agent's life in the job: its link to the host and its node.
struct Session<'a> {
    o: &'a AgentOptions,
    master: SocketAddr,
    ip: IpAddr,
    stop: &'a AtomicBool,
    send: SendStream,
    /// Where this agent's nodes ask for their place in the next epoch after losing a peer.
    heal_dir: PathBuf,
    node: Option<Node>,
    /// Since when this agent, stopped by a signal with its node ended, waits for the host's
    /// word (its last report must reach the host before the link closes).
    leaving: Option<Instant>,
}

/// Joins the rendezvous at `master` and serves the job until it ends.
pub(super) async fn agent(
    o: &AgentOptions,
    id: &JobIdentity,
    master: SocketAddr,
    ip: IpAddr,
    stop: &AtomicBool,
) -> Result<(), LaunchError> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let protocol::Link { conn, send, recv } = protocol::dial(id, master, deadline)
        .await
        .map_err(LaunchError::Rendezvous)?;
    let mut a = Session {
        o,
        master,
        ip,
        stop,
        send,
        heal_dir: temp_dir()?,
        node: None,
        leaving: None,
    };
    let join = ToHost::Join {
        version: protocol::VERSION,
        name: format!("{ip}/pid {}", std::process::id()),
        host: ip.to_string(),
        settings: o.settings(),
    };
    a.report(&join).await?;
    let (reader, mut rx) = read_all(recv);
    let res = loop {
        let tick = tokio::time::sleep(Duration::from_millis(20));
        let msg = tokio::select! {
            m = rx.recv() => Some(m.unwrap_or_else(|| Err("the link closed".into()))),
            () = tick => None,
        };
        let step = match msg {
            Some(Ok(ToAgent::Start(s))) => a.on_start(s).await,
            Some(Ok(ToAgent::Stop { epoch, reason })) => {
                a.on_stop(epoch, &reason);
                Ok(())
            }
            Some(Ok(ToAgent::Regroup { epoch })) => {
                a.on_regroup(epoch);
                Ok(())
            }
            Some(Ok(ToAgent::Done { code: 0, .. })) => break Ok(()),
            Some(Ok(ToAgent::Done { code, message })) => {
                break Err(LaunchError::Failed {
                    failures: vec![message],
                    code,
                });
            }
            Some(Ok(ToAgent::Refused { reason })) => {
                break Err(LaunchError::Rendezvous(format!("refused: {reason}")));
            }
            Some(Err(why)) => {
                let why = conn.close_reason().map_or(why, |e| {
                    wiretrain_comm::transport::quic::describe_conn_error(&e)
                });
                break Err(a.lost(why));
            }
            None => a.on_tick().await,
        };
        if let Err(e) = step {
            break Err(e);
        }
    };
    reader.abort();
    a.close().await;
    conn.close(0u32.into(), b"agent done");
    res
}

/// The host's messages as they arrive; the stream's end or error is the last one.
fn read_all(
    mut recv: quinn::RecvStream,
) -> (
    tokio::task::JoinHandle<()>,
    mpsc::UnboundedReceiver<Result<ToAgent, String>>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        loop {
            let m = protocol::recv::<ToAgent>(&mut recv).await;
            let end = m.is_err();
            if tx.send(m).is_err() || end {
                return;
            }
        }
    });
    (reader, rx)
}

impl Session<'_> {
    /// Ends the node, removes the heal directory, and lets what was sent reach the host
    /// before the link closes.
    async fn close(&mut self) {
        if let Some(mut n) = self.node.take() {
            end_node(&mut n);
        }
        let _ = std::fs::remove_dir_all(&self.heal_dir);
        let _ = self.send.finish();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.send.stopped()).await;
    }

    fn lost(&self, why: String) -> LaunchError {
        let master = self.master;
        LaunchError::Rendezvous(format!("lost the elastic rendezvous at {master}: {why}"))
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Sends `m` to the host.
    async fn report(&mut self, m: &ToHost) -> Result<(), LaunchError> {
        match protocol::send(&mut self.send, m).await {
            Ok(()) => Ok(()),
            Err(e) => Err(self.lost(e)),
        }
    }

    /// Epoch `s` starts: this agent's node goes on in place, or a new node starts.
    async fn on_start(&mut self, s: Start) -> Result<(), LaunchError> {
        // A node waiting to heal goes on in place when the epoch does: it is told its place
        // in it. In an epoch that starts afresh it is stopped first.
        let in_place = s.in_place && !s.joined.contains(&s.node);
        let stopped = self.stopped();
        if let Some(n) = self.node.as_mut().filter(|n| n.healing) {
            if in_place && !stopped {
                match heal_in_place(n, &s, self.ip, &self.heal_dir) {
                    Ok(()) => return Ok(()),
                    Err(e) => tracing::warn!("healing in place failed ({e})"),
                }
            } else {
                let f = answer_file(&self.heal_dir, n.child.id());
                let _ = write_json(&f, &Answer::Stop("the job restarts afresh".into()));
            }
        }
        if let Some(mut n) = self.node.take() {
            end_node(&mut n);
        }
        let started = if in_place {
            // The node this epoch goes on with is gone: the host restarts the job.
            Err(end_with("no node to go on in place".into(), 1))
        } else if stopped {
            // Stopped between epochs: this node ends before it starts.
            Err(end_with(
                "stopped by a signal before it started".into(),
                crate::signal::INTERRUPTED_EXIT,
            ))
        } else {
            start_node(self.o, &s, self.ip, &self.heal_dir)
                .map_err(|e| end_with(format!("cannot start: {e}"), 1))
        };
        match started {
            Ok(n) => {
                if self.stopped() {
                    // The signal came while it started: pass it on.
                    crate::signal::terminate(n.child.id());
                }
                self.node = Some(n);
                Ok(())
            }
            Err(end) => {
                let epoch = s.epoch;
                self.report(&ToHost::Exited { epoch, end }).await
            }
        }
    }

    /// The host stops epoch `epoch`'s node (once).
    fn on_stop(&mut self, epoch: usize, reason: &str) {
        let Some(n) = self
            .node
            .as_mut()
            .filter(|n| n.epoch == epoch && n.stop_at.is_none())
        else {
            return;
        };
        if n.healing {
            let f = answer_file(&self.heal_dir, n.child.id());
            let _ = write_json(&f, &Answer::Stop(reason.to_string()));
        }
        eprintln!("wiretrain launch: stopping node of epoch {epoch}: {reason}");
        crate::signal::terminate(n.child.id());
        n.stop_at = Some(Instant::now());
    }

    /// The host asks epoch `epoch`'s node to regroup after its step (a growth in place).
    fn on_regroup(&mut self, epoch: usize) {
        if let Some(n) = self
            .node
            .as_ref()
            .filter(|n| n.epoch == epoch && !n.healing)
        {
            let _ = std::fs::write(regroup_file(&self.heal_dir, n.child.id()), b"");
        }
    }

    /// Between messages: reports what the node did; an agent stopped by a signal with no
    /// node left gives up on the host's word after [`LEAVE_WITHIN`].
    async fn on_tick(&mut self) -> Result<(), LaunchError> {
        if let Some(n) = self.node.as_mut()
            && let Some(m) = watch(n, self.o.grace, &self.heal_dir)?
        {
            let ended = matches!(m, ToHost::Exited { .. });
            self.report(&m).await?;
            if ended {
                self.node = None;
            }
        }
        if self.node.is_none() && self.stopped() {
            let since = *self.leaving.get_or_insert_with(Instant::now);
            if since.elapsed() > LEAVE_WITHIN {
                return Err(LaunchError::Interrupted);
            }
        }
        Ok(())
    }
}

/// A node's end that no process reported (it did not start, or could not go on).
fn end_with(status: String, code: i32) -> NodeEnd {
    NodeEnd {
        status,
        code,
        success: false,
    }
}
