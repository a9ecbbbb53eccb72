//! One entry point that runs every decoder of bytes that arrive from the network — data frame
//! headers, stream headers, length-prefixed control (rendezvous) messages — on arbitrary input.
//! The `cargo fuzz` target (`comm/fuzz/`) and the property tests (`comm/tests/untrusted.rs`)
//! both call it, so CI replays the fuzz corpus through exactly the code the fuzzer explores.
//! A decoded control message also goes through rendezvous' own checks of a `Hello` and a
//! `Welcome` ([`crate::rendezvous::validate`]), and what they accept must hold their promises.

use crate::rendezvous::Control;
use crate::rendezvous::validate::{Expect, MAX_RANKS_PER_NODE, check_hello, check_welcome};
use crate::wire::{
    FRAME_HEADER_LEN, FrameHeader, MAX_FRAME_PAYLOAD, STREAM_HEADER_LEN, StreamHeader, control_len,
    decode_control,
};

/// What the decoders made of some bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    /// The first [`FRAME_HEADER_LEN`] bytes decoded as a valid data frame header.
    pub frame: bool,
    /// The first [`STREAM_HEADER_LEN`] bytes decoded as a valid stream header.
    pub stream: bool,
    /// The bytes decoded as a length-prefixed control message within the length limit.
    pub control: bool,
    /// The control message passed the coordinator's hello check or a joiner's welcome check.
    pub accepted: bool,
}

/// Decodes `data` as a frame header, as a stream header and as a control message (u32 length,
/// JSON body). Never panics; allocates at most what the bounded length prefix allows.
pub fn decode_untrusted(data: &[u8]) -> Decoded {
    let mut out = Decoded::default();
    if let Some(b) = data.first_chunk::<FRAME_HEADER_LEN>()
        && let Ok(h) = FrameHeader::decode(b, u8::MAX)
    {
        assert!(
            h.len as usize <= MAX_FRAME_PAYLOAD,
            "decoded length above the bound"
        );
        assert_eq!(FrameHeader::decode(&h.encode(), u8::MAX).ok(), Some(h));
        out.frame = true;
    }
    if let Some(b) = data.first_chunk::<STREAM_HEADER_LEN>() {
        out.stream = StreamHeader::decode(b).is_ok();
    }
    if let Some((prefix, rest)) = data.split_first_chunk::<4>()
        && let Ok(len) = control_len(*prefix)
        && let Ok(c) = decode_control::<Control>(&rest[..len.min(rest.len())])
    {
        out.control = true;
        out.accepted = rendezvous_checks(&c);
    }
    out
}

/// Runs both rendezvous checks on `c` (a coordinator of a 3-node job where node 2 has
/// joined; a joiner that asked for as many ranks as its row holds, so a welcome can pass) and
/// asserts what acceptance promises. Whether either accepted.
fn rendezvous_checks(c: &Control) -> bool {
    let mut accepted = false;
    if let Ok(h) = check_hello(c, 1, 3, |r| r == 2) {
        assert!(!h.devices.is_empty() && h.devices.len() <= MAX_RANKS_PER_NODE);
        assert!(matches!(h.node_rank, None | Some(1)), "{:?}", h.node_rank);
        accepted = true;
    }
    if let Control::Welcome { node, table } = c {
        let row = table.nodes().get(*node);
        let want = Expect {
            nnodes: 3,
            ranks: row.map_or(1, |n| n.devices.len()),
            coordinator_sha256: "aa",
            own_sha256: row.map_or("", |n| n.cert_sha256.as_str()),
        };
        if check_welcome(*node, table, &want).is_ok() {
            assert_eq!(table.num_nodes(), 3);
            assert!((1..3).contains(node));
            assert_eq!(table.nodes()[0].cert_sha256, "aa");
            accepted = true;
        }
    }
    accepted
}
