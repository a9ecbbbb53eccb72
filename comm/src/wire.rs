//! The wire format between nodes.
//!
//! * A lane stream (one QUIC unidirectional stream per node pair, direction and lane) opens
//!   with a [`StreamHeader`], then carries data frames.
//! * A data frame is a fixed 32-byte [`FrameHeader`] followed by `len` payload bytes. The
//!   receiver knows exactly which frame comes next (op kind, sequence number, step, chunk,
//!   length) and rejects anything else, so collectives can never mix.
//! * Control messages (rendezvous, goodbye) are a u32 length and a JSON body.
//!
//! Every decode is bounded: lengths are checked against fixed limits before any allocation.

use crate::error::WireError;
use serde::{Serialize, de::DeserializeOwned};

/// "WTRN" on the wire.
pub const MAGIC: u32 = 0x5754_524e;
/// Bumped on any incompatible change; checked at rendezvous.
pub const PROTOCOL_VERSION: u32 = 3;
/// Bytes of an encoded [`FrameHeader`].
pub const FRAME_HEADER_LEN: usize = 32;
/// Bytes of an encoded [`StreamHeader`].
pub const STREAM_HEADER_LEN: usize = 16;
/// The largest payload one frame may carry.
pub const MAX_FRAME_PAYLOAD: usize = 8 << 20;
/// The largest control message.
pub const MAX_CONTROL_LEN: usize = 1 << 20;

/// Element type on the wire (see [`crate::codec`] for the encodings). Reductions accumulate
/// in f32 whatever travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum WireDtype {
    /// 32-bit IEEE floats, sent as they are (4 bytes per element).
    F32 = 0,
    /// IEEE half precision (2 bytes per element).
    F16 = 1,
    /// bfloat16, the upper half of an f32 (2 bytes per element).
    Bf16 = 2,
    /// int8 codes with one f32 scale per block of [`crate::codec::INT8_BLOCK`] elements.
    Int8 = 3,
}

impl WireDtype {
    /// Every wire dtype, in code order.
    pub const ALL: [WireDtype; 4] = [Self::F32, Self::F16, Self::Bf16, Self::Int8];

    /// Bytes one element takes on the wire, int8's f32 scale per block included (what the
    /// planner counts; [`crate::codec::encoded_len`] gives a payload's exact size).
    pub fn bytes_per_element(self) -> f64 {
        match self {
            Self::F32 => 4.0,
            Self::F16 | Self::Bf16 => 2.0,
            Self::Int8 => 1.0 + 4.0 / crate::codec::INT8_BLOCK as f64,
        }
    }

    /// The lower-case name used in flags, configs, traces and tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
        }
    }

    fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Bf16,
            3 => Self::Int8,
            _ => {
                return Err(WireError::UnknownValue {
                    field: "dtype",
                    value: v.into(),
                });
            }
        })
    }
}

impl std::fmt::Display for WireDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WireDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("{s:?} is not a wire dtype (f32, f16, bf16, int8)"))
    }
}

/// The header of one data frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Collective kind code (see `op::OpKind`).
    pub op: u8,
    /// The group the call spans (see `op::Group`): its sequence numbers are its own.
    pub group: u8,
    /// The element type of the payload.
    pub dtype: WireDtype,
    /// The collective's sequence number in its process group.
    pub seq: u64,
    /// The algorithm step within the collective.
    pub step: u32,
    /// The frame index within the step.
    pub chunk: u32,
    /// Payload bytes that follow.
    pub len: u32,
}

impl FrameHeader {
    /// The header's [`FRAME_HEADER_LEN`] bytes on the wire (little-endian, after [`MAGIC`]).
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = 1; // frame kind: data
        b[5] = self.op;
        b[6] = self.dtype as u8;
        b[7] = self.group;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..20].copy_from_slice(&self.step.to_le_bytes());
        b[20..24].copy_from_slice(&self.chunk.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and validates a header; `max_op` is the largest known op code.
    pub fn decode(b: &[u8; FRAME_HEADER_LEN], max_op: u8) -> Result<Self, WireError> {
        let magic = u32::from_le_bytes(b[0..4].try_into().unwrap());
        if magic != MAGIC {
            return Err(WireError::BadMagic { found: magic });
        }
        if b[4] != 1 {
            return Err(WireError::UnknownValue {
                field: "frame kind",
                value: b[4].into(),
            });
        }
        if b[5] == 0 || b[5] > max_op {
            return Err(WireError::UnknownValue {
                field: "op",
                value: b[5].into(),
            });
        }
        let dtype = WireDtype::from_u8(b[6])?;
        if b[7] > crate::op::Group::MAX_CODE {
            return Err(WireError::UnknownValue {
                field: "group",
                value: b[7].into(),
            });
        }
        let len = u32::from_le_bytes(b[24..28].try_into().unwrap());
        if len as usize > MAX_FRAME_PAYLOAD {
            return Err(WireError::Oversized {
                len: len.into(),
                max: MAX_FRAME_PAYLOAD as u64,
            });
        }
        Ok(Self {
            op: b[5],
            group: b[7],
            dtype,
            seq: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            step: u32::from_le_bytes(b[16..20].try_into().unwrap()),
            chunk: u32::from_le_bytes(b[20..24].try_into().unwrap()),
            len,
        })
    }

    /// Checks that `self` (received) is exactly the frame the schedule expects.
    pub fn expect(&self, want: &FrameHeader) -> Result<(), WireError> {
        if self != want {
            return Err(WireError::Unexpected {
                expected: want.describe(),
                got: self.describe(),
            });
        }
        Ok(())
    }

    /// A one-line description of every field, for error messages.
    pub fn describe(&self) -> String {
        format!(
            "op {} group {} seq {} step {} chunk {} ({} bytes {:?})",
            self.op, self.group, self.seq, self.step, self.chunk, self.len, self.dtype
        )
    }
}

/// The first bytes of every lane stream: who opened it and for which lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamHeader {
    /// The link the stream belongs to: lane × channels per lane + channel.
    pub lane: u32,
    /// The node rank of the node that opened the stream.
    pub from_node: u32,
}

impl StreamHeader {
    /// The header's [`STREAM_HEADER_LEN`] bytes on the wire: [`MAGIC`],
    /// [`PROTOCOL_VERSION`], lane and node, each a little-endian u32.
    pub fn encode(&self) -> [u8; STREAM_HEADER_LEN] {
        let mut b = [0u8; STREAM_HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[8..12].copy_from_slice(&self.lane.to_le_bytes());
        b[12..16].copy_from_slice(&self.from_node.to_le_bytes());
        b
    }

    /// Decodes a header; fails on a wrong magic or another protocol version.
    pub fn decode(b: &[u8; STREAM_HEADER_LEN]) -> Result<Self, WireError> {
        let magic = u32::from_le_bytes(b[0..4].try_into().unwrap());
        if magic != MAGIC {
            return Err(WireError::BadMagic { found: magic });
        }
        let version = u32::from_le_bytes(b[4..8].try_into().unwrap());
        if version != PROTOCOL_VERSION {
            return Err(WireError::UnknownValue {
                field: "stream protocol version",
                value: version,
            });
        }
        Ok(Self {
            lane: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            from_node: u32::from_le_bytes(b[12..16].try_into().unwrap()),
        })
    }
}

/// Encodes a control message: u32 little-endian length, then JSON.
pub fn encode_control<T: Serialize>(msg: &T) -> Vec<u8> {
    let body = serde_json::to_vec(msg).expect("control messages serialize");
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Validates a control message length prefix before anything is allocated.
pub fn control_len(prefix: [u8; 4]) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_CONTROL_LEN {
        return Err(WireError::Oversized {
            len: len as u64,
            max: MAX_CONTROL_LEN as u64,
        });
    }
    Ok(len)
}

/// Decodes a control message body.
pub fn decode_control<T: DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    serde_json::from_slice(body).map_err(|e| WireError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr() -> FrameHeader {
        FrameHeader {
            op: 2,
            group: 2,
            dtype: WireDtype::F32,
            seq: 77,
            step: 3,
            chunk: 9,
            len: 4096,
        }
    }

    #[test]
    fn frame_roundtrip() {
        let h = hdr();
        assert_eq!(FrameHeader::decode(&h.encode(), 6).unwrap(), h);
        assert!(h.expect(&h).is_ok());
        let mut other = h;
        other.seq = 78;
        assert!(matches!(
            other.expect(&h),
            Err(WireError::Unexpected { .. })
        ));
        // The same number in another group is another call.
        let mut other = h;
        other.group = 0;
        assert!(matches!(
            other.expect(&h),
            Err(WireError::Unexpected { .. })
        ));
    }

    #[test]
    fn rejects_garbage_and_oversize() {
        let mut b = hdr().encode();
        b[0] ^= 0xff;
        assert!(matches!(
            FrameHeader::decode(&b, 6),
            Err(WireError::BadMagic { .. })
        ));
        let mut b = hdr().encode();
        b[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&b, 6),
            Err(WireError::Oversized { .. })
        ));
        let mut b = hdr().encode();
        b[5] = 200;
        assert!(matches!(
            FrameHeader::decode(&b, 6),
            Err(WireError::UnknownValue { .. })
        ));
        let mut b = hdr().encode();
        b[6] = 9;
        assert!(FrameHeader::decode(&b, 6).is_err());
        let mut b = hdr().encode();
        b[7] = 3;
        assert!(matches!(
            FrameHeader::decode(&b, 6),
            Err(WireError::UnknownValue { field: "group", .. })
        ));
        assert!(control_len((u32::MAX).to_le_bytes()).is_err());
        assert!(decode_control::<Vec<u32>>(b"{not json").is_err());
    }

    #[test]
    fn every_byte_string_decodes_or_errors() {
        // A cheap fuzz: random headers never panic.
        let mut x = 0x1234_5678_9abc_def0u64;
        for _ in 0..100_000 {
            let mut b = [0u8; FRAME_HEADER_LEN];
            for c in b.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
            }
            if x.is_multiple_of(2) {
                b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
            }
            let _ = FrameHeader::decode(&b, 6);
            let mut s = [0u8; STREAM_HEADER_LEN];
            s.copy_from_slice(&b[..STREAM_HEADER_LEN]);
            let _ = StreamHeader::decode(&s);
        }
    }

    #[test]
    fn stream_header_roundtrip_and_version() {
        let s = StreamHeader {
            lane: 3,
            from_node: 2,
        };
        assert_eq!(StreamHeader::decode(&s.encode()).unwrap(), s);
        let mut b = s.encode();
        b[4] = 99;
        assert!(StreamHeader::decode(&b).is_err());
    }
}
