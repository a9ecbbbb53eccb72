//! A lane's frames as data, in the shape of quinn-proto: everything about a ring pass or a
//! chain that is not moving bytes. [`RingFrames`] lists, in order, every frame this node sends
//! (its range, its exact header, and how many received frames it must wait for) and every frame
//! it expects (its range, its exact header, and whether it is added or copied in). The lane
//! executors in `transport::quic::lane` only move these frames: wait for the dependency, encode,
//! write; read a header, check it against the expectation, read the payload into the range.
//!
//! The tests run the frames of every node of a ring against each other, without sockets: each
//! expected frame is exactly the frame the previous node sends, a send waits for the frames
//! that carry its data, and the pass completes on any ring, length, frame size and dtype.

use super::ring::{RecvMode, RingStep};
use crate::codec::{self, Apply};
use crate::error::WireError;
use crate::wire::{FrameHeader, WireDtype};
use std::ops::Range;

/// Who a lane's frames belong to: the call (kind code, group code, sequence number) and
/// the element type they carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameCall {
    /// The collective's kind code ([`crate::op::OpKind::code`]).
    pub op: u8,
    /// The group's code ([`crate::op::Group::code`]).
    pub group: u8,
    /// The call's sequence number in its group.
    pub seq: u64,
    /// The element type the frames carry.
    pub dtype: WireDtype,
}

impl FrameCall {
    fn header(&self, step: u32, chunk: usize, elems: usize) -> FrameHeader {
        FrameHeader {
            op: self.op,
            group: self.group,
            dtype: self.dtype,
            seq: self.seq,
            step,
            chunk: chunk as u32,
            len: codec::encoded_len(self.dtype, elems) as u32,
        }
    }
}

/// A frame to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendFrame {
    /// The elements of the buffer the frame carries.
    pub range: Range<usize>,
    /// The exact header it is sent with.
    pub header: FrameHeader,
    /// Received frames (counted from the start of the pass) that must have landed first.
    pub after: usize,
    /// Whether the sender also replaces its own copy by the decoded frame (a node's own
    /// finished piece at the start of an all-gather, so all nodes end bit-identical).
    pub round: bool,
}

/// A frame to receive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvFrame {
    /// The elements of the buffer the frame lands in.
    pub range: Range<usize>,
    /// The exact header expected.
    pub header: FrameHeader,
    /// Whether the decoded payload is added to the range (a reduction) or overwrites it.
    pub apply: Apply,
}

impl RecvFrame {
    /// Checks a received header against this frame: anything else is a protocol error.
    pub fn check(&self, got: &FrameHeader) -> Result<(), WireError> {
        got.expect(&self.header)
    }
}

/// The frames of one ring pass on one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingFrames {
    /// Every frame this node sends, in sending order.
    pub sends: Vec<SendFrame>,
    /// Every frame this node receives, in the order it expects them.
    pub recvs: Vec<RecvFrame>,
}

/// Splits `r` into frames of at most `per` elements (one empty frame for an empty range, so
/// every step carries at least one frame).
pub fn frames(r: Range<usize>, per: usize) -> impl Iterator<Item = Range<usize>> {
    let n = r.len().div_ceil(per).max(1);
    (0..n).map(move |i| {
        let s = r.start + i * per;
        s..(s + per).min(r.end).max(s)
    })
}

/// Channel `c` of `k`'s slice of every piece: the c-th of `k` near-equal contiguous parts (the
/// slices of one piece tile it in channel order; a part may be empty).
pub fn channel_pieces(pieces: &[Range<usize>], c: usize, k: usize) -> Vec<Range<usize>> {
    let k = k.max(1);
    pieces
        .iter()
        .map(|p| {
            let n = p.len();
            p.start + n * c / k..p.start + n * (c + 1) / k
        })
        .collect()
}

fn frame_count(r: &Range<usize>, per: usize) -> usize {
    r.len().div_ceil(per).max(1)
}

impl RingFrames {
    /// The frames of `steps` over `pieces`, `per` elements a frame, steps numbered from
    /// `step_base`; `round_step`: the step whose sent piece is also rounded locally.
    pub fn new(
        call: FrameCall,
        steps: &[RingStep],
        pieces: &[Range<usize>],
        per: usize,
        step_base: u32,
        round_step: Option<usize>,
    ) -> Self {
        let per = per.max(1);
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        // Frames received once step s - 2 has completed.
        let mut before_prev = 0;
        for (s, st) in steps.iter().enumerate() {
            let step = step_base + s as u32;
            // Frame f of step s forwards what frame f of step s - 1 brought in (all of it, if
            // the previous step had fewer frames).
            let prev_frames = s
                .checked_sub(1)
                .map(|p| frame_count(&pieces[steps[p].recv], per));
            for (f, fr) in frames(pieces[st.send].clone(), per).enumerate() {
                let after = prev_frames.map_or(0, |pf| before_prev + (f + 1).min(pf));
                sends.push(SendFrame {
                    header: call.header(step, f, fr.len()),
                    range: fr,
                    after,
                    round: round_step == Some(s),
                });
            }
            if s >= 1 {
                before_prev += prev_frames.unwrap_or(0);
            }
            let apply = match st.mode {
                RecvMode::Copy => Apply::Set,
                RecvMode::Reduce => Apply::Add,
            };
            for (f, fr) in frames(pieces[st.recv].clone(), per).enumerate() {
                recvs.push(RecvFrame {
                    header: call.header(step, f, fr.len()),
                    range: fr,
                    apply,
                });
            }
        }
        Self { sends, recvs }
    }
}

/// The frames of a chain broadcast of `pieces` (in order, as one stream): each is received
/// from the previous node (unless this node is the root) and forwarded (unless last), always
/// in f32.
pub fn chain_frames(
    op: u8,
    group: u8,
    seq: u64,
    pieces: &[Range<usize>],
    per: usize,
) -> Vec<(Range<usize>, FrameHeader)> {
    let call = FrameCall {
        op,
        group,
        seq,
        dtype: WireDtype::F32,
    };
    pieces
        .iter()
        .flat_map(|p| frames(p.clone(), per.max(1)))
        .enumerate()
        .map(|(chunk, fr)| (fr.clone(), call.header(0, chunk, fr.len())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::ring;
    use crate::topology::split;

    #[test]
    fn channel_slices_tile_every_piece() {
        let pieces = [0..0, 0..1, 1..8, 8..1000, 1000..1003];
        for k in 1..=5 {
            let parts: Vec<_> = (0..k).map(|c| channel_pieces(&pieces, c, k)).collect();
            for (i, p) in pieces.iter().enumerate() {
                let mut at = p.start;
                for part in &parts {
                    assert_eq!(part[i].start, at, "k={k} piece {i}");
                    at = part[i].end;
                    assert!(part[i].len() <= p.len().div_ceil(k));
                }
                assert_eq!(at, p.end, "k={k} piece {i}");
            }
        }
    }

    type Schedule = fn(usize, usize) -> Vec<RingStep>;
    const SCHEDULES: [(Schedule, Option<usize>); 3] = [
        (ring::reduce_scatter, None),
        (ring::all_gather, Some(0)),
        (ring::all_reduce, None),
    ];

    fn cases() -> impl Iterator<Item = (usize, usize, usize, WireDtype)> {
        let mut v = vec![];
        for nn in 2..=5 {
            for len in [0, 1, 7, 100, 1003] {
                for per in [1, 3, 64, 1 << 18] {
                    for dtype in [WireDtype::F32, WireDtype::Bf16, WireDtype::Int8] {
                        v.push((nn, len, per, dtype));
                    }
                }
            }
        }
        v.into_iter()
    }

    fn node_frames(
        sched: Schedule,
        round: Option<usize>,
        nn: usize,
        len: usize,
        per: usize,
        dtype: WireDtype,
    ) -> Vec<RingFrames> {
        let pieces = split(0..len, nn);
        let call = FrameCall {
            op: 1,
            group: 0,
            seq: 9,
            dtype,
        };
        (0..nn)
            .map(|n| RingFrames::new(call, &sched(n, nn), &pieces, per, 0, round))
            .collect()
    }

    #[test]
    fn every_expected_frame_is_the_one_the_previous_node_sends() {
        for (nn, len, per, dtype) in cases() {
            for (sched, round) in SCHEDULES {
                let nodes = node_frames(sched, round, nn, len, per, dtype);
                for n in 0..nn {
                    let from = &nodes[(n + nn - 1) % nn].sends;
                    let want = &nodes[n].recvs;
                    assert_eq!(from.len(), want.len(), "{nn} {len} {per}");
                    for (s, r) in from.iter().zip(want) {
                        assert_eq!(s.range, r.range);
                        assert!(r.check(&s.header).is_ok(), "{nn} {len} {per} {dtype}");
                    }
                }
            }
        }
    }

    /// A send at step s > 0 forwards what step s - 1 received: every element it reads must be
    /// in a frame of that step among the first `after` received.
    #[test]
    fn a_send_waits_for_the_frames_that_carry_its_data() {
        for (nn, len, per, dtype) in cases() {
            for (sched, round) in SCHEDULES {
                let nodes = node_frames(sched, round, nn, len, per, dtype);
                for (n, fr) in nodes.iter().enumerate() {
                    for s in &fr.sends {
                        let step = s.header.step;
                        if step == 0 {
                            assert_eq!(s.after, 0);
                            continue;
                        }
                        let landed: Vec<&RecvFrame> = fr.recvs[..s.after]
                            .iter()
                            .filter(|r| r.header.step == step - 1)
                            .collect();
                        for i in s.range.clone() {
                            assert!(
                                landed.iter().any(|r| r.range.contains(&i)),
                                "node {n} of {nn}, len {len}, per {per}: step {step} sends {i} \
                                 before it lands"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every node sends as soon as its dependency has landed and receives whatever has
    /// arrived: the pass completes, with nothing left in flight.
    #[test]
    fn a_ring_pass_completes_on_any_ring() {
        for (nn, len, per, dtype) in cases() {
            for (sched, round) in SCHEDULES {
                let nodes = node_frames(sched, round, nn, len, per, dtype);
                let mut sent = vec![0; nn];
                let mut got = vec![0; nn];
                let mut wire: Vec<std::collections::VecDeque<FrameHeader>> =
                    vec![Default::default(); nn];
                loop {
                    let mut moved = false;
                    for n in 0..nn {
                        let f = &nodes[n];
                        while sent[n] < f.sends.len() && got[n] >= f.sends[sent[n]].after {
                            wire[(n + 1) % nn].push_back(f.sends[sent[n]].header);
                            sent[n] += 1;
                            moved = true;
                        }
                        while let Some(h) = wire[n].pop_front() {
                            assert!(f.recvs[got[n]].check(&h).is_ok());
                            got[n] += 1;
                            moved = true;
                        }
                    }
                    if !moved {
                        break;
                    }
                }
                for n in 0..nn {
                    assert_eq!(sent[n], nodes[n].sends.len(), "{nn} {len} {per}: stuck");
                    assert_eq!(got[n], nodes[n].recvs.len(), "{nn} {len} {per}: stuck");
                }
            }
        }
    }

    #[test]
    fn frames_carry_the_encoded_length_and_round_only_their_step() {
        let call = FrameCall {
            op: 3,
            group: 2,
            seq: 4,
            dtype: WireDtype::Int8,
        };
        let f = RingFrames::new(
            call,
            &ring::all_gather(0, 3),
            &split(0..600, 3),
            128,
            10,
            Some(0),
        );
        // 200 elements a piece in frames of 128 and 72; int8: n bytes + a 4-byte scale per 128.
        let lens: Vec<u32> = f.sends.iter().map(|s| s.header.len).collect();
        assert_eq!(lens, [132, 76, 132, 76]);
        assert_eq!(f.sends[0].header.step, 10);
        let rounded: Vec<bool> = f.sends.iter().map(|s| s.round).collect();
        assert_eq!(rounded, [true, true, false, false]);
        assert!(f.recvs.iter().all(|r| r.apply == Apply::Set));
        let c = chain_frames(4, 0, 7, &[0..5, 5..9], 4);
        let chunks: Vec<(Range<usize>, u32, u32)> =
            c.iter().map(|(r, h)| (r.clone(), h.chunk, h.len)).collect();
        assert_eq!(chunks, [(0..4, 0, 16), (4..5, 1, 4), (5..9, 2, 16)]);
    }
}
