//! The executor over a transport of the tests' own: two nodes of one rank each in one
//! process, their lanes joined by in-memory channels ([`MemLane`], f32 only). Through the
//! [`Lane`] trait alone, the executor's real collectives (phases, node barrier, lane phase)
//! reduce, gather and broadcast across the nodes; a lane that times out, or whose task dies,
//! fails the collective naming where it waited, and every later call fails at once.

use super::{Executor, OpId, ReduceOp};
use crate::error::TransportError;
use crate::op::{Group, OpKind};
use crate::topology::table_of;
use crate::transport::lane::{Lane, LaneError, LaneRun, OwnedLaneTask, RawBuf};
use crate::transport::local::NodeShared;
use crate::wire::WireDtype;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

/// What a [`MemLane`] does with a task.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Moves the pieces to and from the other nodes.
    Work,
    /// Waits on a frame that never comes, until the deadline.
    Hang,
    /// Its task panics.
    Panic,
}

/// A lane whose peers are channels in this process; pieces travel as f32 vectors.
struct MemLane {
    to: HashMap<usize, UnboundedSender<Vec<f32>>>,
    from: HashMap<usize, UnboundedReceiver<Vec<f32>>>,
    sent: u64,
    waiting: (u64, u64, usize),
    mode: Mode,
}

/// The lanes of `nodes` nodes, each joined to every other.
fn mem_lanes(nodes: usize, mode: Mode) -> Vec<MemLane> {
    let mut lanes: Vec<MemLane> = (0..nodes)
        .map(|_| MemLane {
            to: HashMap::new(),
            from: HashMap::new(),
            sent: 0,
            waiting: (0, 0, 0),
            mode,
        })
        .collect();
    for a in 0..nodes {
        for b in (0..nodes).filter(|&b| b != a) {
            let (tx, rx) = unbounded_channel();
            lanes[a].to.insert(b, tx);
            lanes[b].from.insert(a, rx);
        }
    }
    lanes
}

fn lost(node: usize) -> LaneError {
    LaneError::Failed(TransportError::Lost {
        peer: format!("node {node}"),
        reason: "its channel closed".into(),
    })
}

impl MemLane {
    fn send(
        &mut self,
        node: usize,
        buf: RawBuf,
        r: std::ops::Range<usize>,
    ) -> Result<(), LaneError> {
        // SAFETY: the executor keeps the buffer alive and unshared for the task's length.
        let piece = unsafe { buf.read(r) }.to_vec();
        self.sent += 4 * piece.len() as u64;
        self.to[&node].send(piece).map_err(|_| lost(node))
    }

    async fn recv(&mut self, node: usize, at: (u64, u64)) -> Result<Vec<f32>, LaneError> {
        self.waiting = (at.0, at.1, node);
        let rx = self.from.get_mut(&node).ok_or_else(|| lost(node))?;
        rx.recv().await.ok_or_else(|| lost(node))
    }

    async fn exec(&mut self, task: OwnedLaneTask) -> Result<(), LaneError> {
        match task {
            OwnedLaneTask::Ring { job, pieces, steps } => {
                if job.call.dtype != WireDtype::F32 {
                    return Err(LaneError::Failed(TransportError::Lost {
                        peer: "every other node".into(),
                        reason: "the in-memory lane carries f32 only".into(),
                    }));
                }
                for (s, st) in steps.iter().enumerate() {
                    self.send(job.next, job.buf, pieces[st.send].clone())?;
                    let got = self.recv(job.prev, (s as u64, 0)).await?;
                    // SAFETY: a step never receives into the piece it sends.
                    let dst = unsafe { job.buf.write(pieces[st.recv].clone()) };
                    match st.mode {
                        crate::algo::ring::RecvMode::Reduce => {
                            dst.iter_mut().zip(&got).for_each(|(d, g)| *d += g)
                        }
                        crate::algo::ring::RecvMode::Copy => dst.copy_from_slice(&got),
                    }
                }
                Ok(())
            }
            OwnedLaneTask::Chain {
                buf,
                pieces,
                from,
                to,
            } => {
                for (i, p) in pieces.iter().enumerate() {
                    if let Some(f) = from {
                        let got = self.recv(f, (0, i as u64)).await?;
                        // SAFETY: as above.
                        unsafe { buf.write(p.clone()) }.copy_from_slice(&got);
                    }
                    if let Some(t) = to {
                        self.send(t, buf, p.clone())?;
                    }
                }
                Ok(())
            }
        }
    }
}

impl Lane for MemLane {
    fn run(
        mut self: Box<Self>,
        task: OwnedLaneTask,
        _call: (u8, u64),
        deadline: tokio::time::Instant,
    ) -> LaneRun {
        Box::pin(async move {
            let res = match self.mode {
                Mode::Work => tokio::time::timeout_at(deadline, self.exec(task)).await,
                Mode::Hang => {
                    self.waiting = (3, 7, 1);
                    let never = std::future::pending::<Result<(), LaneError>>();
                    tokio::time::timeout_at(deadline, never).await
                }
                Mode::Panic => panic!("injected panic in a lane task"),
            };
            (
                self as Box<dyn Lane>,
                res.unwrap_or(Err(LaneError::TimedOut)),
            )
        })
    }

    fn waiting(&self) -> (u64, u64, usize) {
        self.waiting
    }

    fn sent(&self) -> u64 {
        self.sent
    }

    fn describe(&self, node: usize) -> String {
        format!("node {node} (in memory)")
    }
}

/// The executor of the one rank of `node` in a job of `nodes` one-rank nodes.
fn executor(nodes: usize, node: usize, lane: MemLane, rt: &tokio::runtime::Runtime) -> Executor {
    let table = Arc::new(table_of(&vec![1; nodes]));
    Executor {
        rank: node,
        local: 0,
        node,
        scopes: Arc::new(crate::algo::Scopes::of(&table, node, 0)),
        table,
        shared: Arc::new(NodeShared::new(1)),
        lane: Some(Box::new(lane)),
        rt: rt.handle().clone(),
        timeout: Duration::from_millis(500),
        failed: None,
        on_fail: Arc::new(|_| {}),
        inter: None,
        wire: WireDtype::F32,
        panic_at: None,
    }
}

fn id(kind: OpKind, seq: u64) -> OpId {
    OpId {
        kind,
        group: Group::World,
        seq,
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn collectives_cross_nodes_through_a_lane_of_the_tests_own() {
    let rt = runtime();
    let nodes = 3;
    let n = 1000;
    let input = |node: usize| -> Vec<f32> { (0..n).map(|i| (node * n + i) as f32).collect() };
    let outs: Vec<(Vec<f32>, Vec<f32>, u64)> = std::thread::scope(|s| {
        let hs: Vec<_> = mem_lanes(nodes, Mode::Work)
            .into_iter()
            .enumerate()
            .map(|(node, lane)| {
                let mut ex = executor(nodes, node, lane, &rt);
                s.spawn(move || {
                    let mut sum = input(node);
                    ex.collective(id(OpKind::AllReduce, 1), &mut sum, 0, ReduceOp::Sum)
                        .unwrap();
                    let mut bcast = if node == 2 { input(2) } else { vec![0.0; n] };
                    ex.collective(id(OpKind::Broadcast, 2), &mut bcast, 2, ReduceOp::Sum)
                        .unwrap();
                    let (_, bytes) = ex.inter.expect("the lane counted its time and bytes");
                    (sum, bcast, bytes)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want: Vec<f32> = (0..n)
        .map(|i| (0..nodes).map(|k| input(k)[i]).sum())
        .collect();
    for (node, (sum, bcast, bytes)) in outs.into_iter().enumerate() {
        assert_eq!(sum, want, "node {node}'s all-reduce");
        assert_eq!(bcast, input(2), "node {node}'s broadcast");
        assert!(bytes > 0, "node {node} sent {bytes} bytes across");
    }
}

#[test]
fn a_lane_that_times_out_fails_the_call_naming_where_it_waited_and_every_later_call() {
    let rt = runtime();
    let lane = mem_lanes(2, Mode::Hang).remove(0);
    let mut ex = executor(2, 0, lane, &rt);
    let mut buf = vec![1.0; 64];
    let e = ex
        .collective(id(OpKind::AllReduce, 1), &mut buf, 0, ReduceOp::Sum)
        .map_err(|e| crate::error::report(&e))
        .unwrap_err();
    assert!(
        e.contains(
            "all_reduce seq 1 (256 bytes) on rank 0 timed out after 500ms while waiting \
             for step 3 frame 7 from node 1 (in memory)"
        ),
        "{e}"
    );
    let later = ex
        .collective(id(OpKind::AllReduce, 2), &mut buf, 0, ReduceOp::Sum)
        .map_err(|e| crate::error::report(&e))
        .unwrap_err();
    assert!(later.contains("an earlier collective failed"), "{later}");
}

#[test]
fn a_lane_task_that_dies_fails_the_rank_and_the_lane_is_not_used_again() {
    let rt = runtime();
    let lane = mem_lanes(2, Mode::Panic).remove(0);
    let mut ex = executor(2, 0, lane, &rt);
    let mut buf = vec![1.0; 64];
    let e = ex
        .collective(id(OpKind::AllReduce, 1), &mut buf, 0, ReduceOp::Sum)
        .map_err(|e| crate::error::report(&e))
        .unwrap_err();
    assert!(e.contains("the lane task ended abnormally"), "{e}");
    assert!(ex.lane.is_none(), "the lane went down with its task");
    let later = ex
        .collective(id(OpKind::AllReduce, 2), &mut buf, 0, ReduceOp::Sum)
        .map_err(|e| crate::error::report(&e))
        .unwrap_err();
    assert!(later.contains("an earlier collective failed"), "{later}");
}
