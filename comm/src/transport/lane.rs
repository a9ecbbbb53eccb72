//! What the executor asks of the link between nodes: a [`Lane`] runs a collective's
//! cross-node part (a ring pass, or a chain broadcast) on one local rank's share of the
//! buffer, by a deadline, as a task of its own on the node's network runtime. The executor
//! knows only this trait; QUIC (`quic/lane.rs`) is its implementation between processes, and
//! the executor's tests drive it with lanes of their own.

use crate::algo::RingStep;
use crate::algo::frames::FrameCall;
use crate::error::TransportError;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;

/// A raw view of a rank's buffer shared by a lane's sender and receiver.
#[derive(Clone, Copy)]
pub(crate) struct RawBuf {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the sender reads only ranges the receiver has finished writing (progress counter),
// and the receiver writes ranges the sender does not read in the same step.
unsafe impl Send for RawBuf {}
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// # Safety
    /// `ptr..ptr+len` must stay valid for as long as the `RawBuf` is used.
    pub(crate) unsafe fn from_raw(ptr: *mut f32, len: usize) -> Self {
        Self { ptr, len }
    }

    pub(crate) fn new(buf: &mut [f32]) -> Self {
        Self {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    /// # Safety
    /// Nobody writes `r` while the slice lives.
    pub(crate) unsafe fn read(&self, r: Range<usize>) -> &[f32] {
        assert!(r.end <= self.len);
        unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.len()) }
    }

    /// # Safety
    /// Nobody else reads or writes `r` while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn write(&self, r: Range<usize>) -> &mut [f32] {
        assert!(r.end <= self.len);
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }
}

/// A lane failure: what went wrong (the error names the node), or the deadline passed.
#[derive(Debug)]
pub(crate) enum LaneError {
    /// The transport failed; the error names the node.
    Failed(TransportError),
    /// The deadline passed first.
    TimedOut,
}

/// One ring pass to execute on a lane.
pub(crate) struct RingJob<'a> {
    pub buf: RawBuf,
    pub pieces: &'a [Range<usize>],
    pub steps: &'a [RingStep],
    pub next: usize,
    pub prev: usize,
    /// The call the frames belong to and what they carry; reductions accumulate in f32
    /// whatever travels.
    pub call: FrameCall,
    pub step_base: u32,
    /// The step whose sent piece this node also replaces by its decoded form (its own
    /// finished piece at the start of an all-gather), so all nodes end bit-identical.
    pub round_step: Option<usize>,
}

/// What a lane owner runs across nodes.
pub(crate) enum LaneTask<'a> {
    Ring(RingJob<'a>),
    Chain {
        buf: RawBuf,
        pieces: &'a [std::ops::Range<usize>],
        from: Option<usize>,
        to: Option<usize>,
    },
}

/// A `LaneTask` that owns its piece and step lists, so it can run as a task on the runtime.
pub(crate) enum OwnedLaneTask {
    /// `job`'s own `pieces` and `steps` are empty; the task points them at these.
    Ring {
        job: RingJob<'static>,
        pieces: Vec<std::ops::Range<usize>>,
        steps: Vec<RingStep>,
    },
    Chain {
        buf: RawBuf,
        pieces: Vec<std::ops::Range<usize>>,
        from: Option<usize>,
        to: Option<usize>,
    },
}

impl From<LaneTask<'_>> for OwnedLaneTask {
    fn from(t: LaneTask<'_>) -> Self {
        match t {
            LaneTask::Ring(j) => OwnedLaneTask::Ring {
                pieces: j.pieces.to_vec(),
                steps: j.steps.to_vec(),
                job: RingJob {
                    pieces: &[],
                    steps: &[],
                    ..j
                },
            },
            LaneTask::Chain {
                buf,
                pieces,
                from,
                to,
            } => OwnedLaneTask::Chain {
                buf,
                pieces: pieces.to_vec(),
                from,
                to,
            },
        }
    }
}

/// A lane's run: the lane handed back, with how the task went.
pub(crate) type LaneRun =
    Pin<Box<dyn Future<Output = (Box<dyn Lane>, Result<(), LaneError>)> + Send>>;

/// The cross-node link of one local rank (one lane of the node × lane mesh): the executor
/// moves it into a task on the network runtime for each collective's cross-node part and
/// takes it back when the task ends.
pub(crate) trait Lane: Send {
    /// Runs `task` by `deadline`; `call` is (op code, sequence number) of the collective,
    /// which a chain's frames carry. The lane comes back with the result, unless the task
    /// itself died.
    fn run(
        self: Box<Self>,
        task: OwnedLaneTask,
        call: (u8, u64),
        deadline: tokio::time::Instant,
    ) -> LaneRun;

    /// (step, frame, node) of the frame the lane waits for, or waited for last.
    fn waiting(&self) -> (u64, u64, usize);

    /// Bytes the lane has sent to other nodes so far (frame headers included).
    fn sent(&self) -> u64;

    /// A peer node, in words, for error messages.
    fn describe(&self, node: usize) -> String;
}
