//! One entry point that runs every decoder of bytes that arrive from the network — data frame
//! headers, stream headers, length-prefixed control (rendezvous) messages — on arbitrary input.
//! The `cargo fuzz` target (`comm/fuzz/`) and the property tests (`comm/tests/untrusted.rs`)
//! both call it, so CI replays the fuzz corpus through exactly the code the fuzzer explores.

use crate::rendezvous::Control;
use crate::wire::{
    FRAME_HEADER_LEN, FrameHeader, MAX_FRAME_PAYLOAD, STREAM_HEADER_LEN, StreamHeader, control_len,
    decode_control,
};

/// What the decoders made of some bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    pub frame: bool,
    pub stream: bool,
    pub control: bool,
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
    {
        out.control = decode_control::<Control>(&rest[..len.min(rest.len())]).is_ok();
    }
    out
}
