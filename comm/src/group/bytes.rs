//! Bytes between ranks: the small integers, hashes, ids and records that ranks must agree on
//! (a checkpoint's file list, memory figures, an NCCL id) travel through these two collectives
//! instead of ad-hoc encodings. Each pair of bytes rides as one f32 holding 0..=65535 (exact),
//! on the f32 wire whatever the group's wire dtype.
//!
//! Lengths come from peers, so they are bounded before anything is allocated: each call has a
//! maximum per rank ([`MAX_BYTES`], or the caller's with the `_within` forms), and a length
//! past it is a [`CollectiveError::Protocol`] naming the rank that sent it, on every rank.

use super::{CallOpts, ProcessGroup};
use crate::error::{CollectiveError, Error, WireError};
use crate::wire::WireDtype;

/// The most bytes one rank may send through [`ProcessGroup::all_gather_bytes`] or
/// [`ProcessGroup::broadcast_bytes`] (the `_within` forms take their own limit).
pub const MAX_BYTES: usize = 16 << 20;

fn encode(b: &[u8]) -> Vec<f32> {
    b.chunks(2)
        .map(|c| f32::from(u16::from_le_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .collect()
}

fn decode(f: &[f32], len: usize) -> Vec<u8> {
    let mut out: Vec<u8> = f.iter().flat_map(|&x| (x as u16).to_le_bytes()).collect();
    out.truncate(len);
    out
}

/// The length rank `rank` announced in `f` (4 carriers of a u64), if within `max`.
fn length(op: &'static str, f: &[f32], rank: usize, max: usize) -> Result<usize, Error> {
    let b = decode(f, 8);
    let len = b.try_into().map_or(u64::MAX, u64::from_le_bytes);
    match usize::try_from(len) {
        Ok(n) if n <= max => Ok(n),
        _ => Err(CollectiveError::Protocol {
            op,
            rank,
            source: WireError::TooLong {
                len,
                max: max as u64,
            },
        }
        .into()),
    }
}

impl ProcessGroup {
    /// Every rank's bytes, in rank order (a collective; the lengths may differ, each at most
    /// [`MAX_BYTES`]). Exact.
    pub fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        self.all_gather_bytes_within(mine, MAX_BYTES)
    }

    /// [`ProcessGroup::all_gather_bytes`] with at most `max` bytes from each rank: a rank
    /// that announces more fails the call on every rank, naming it, before any allocation.
    pub fn all_gather_bytes_within(
        &mut self,
        mine: &[u8],
        max: usize,
    ) -> Result<Vec<Vec<u8>>, Error> {
        const OP: &str = "all_gather_bytes";
        let world = self.world();
        let exact = CallOpts::wire(WireDtype::F32).tag("bytes");
        // Sent even when too long, so that every rank fails this call together.
        let lens = self
            .call(exact)
            .all_gather(encode(&(mine.len() as u64).to_le_bytes()), 4 * world)
            .wait()?;
        let lens: Vec<usize> = lens
            .chunks(4)
            .enumerate()
            .map(|(r, c)| length(OP, c, r, max))
            .collect::<Result<_, _>>()?;
        let width = lens.iter().copied().max().unwrap_or(0).div_ceil(2);
        if width == 0 {
            return Ok(vec![Vec::new(); world]);
        }
        if width
            .checked_mul(world)
            .is_none_or(|n| n > isize::MAX as usize / 4)
        {
            return Err(CollectiveError::InvalidCall(format!(
                "{OP}: {world} payloads of up to {max} bytes do not fit in memory"
            ))
            .into());
        }
        let mut padded = encode(mine);
        padded.resize(width, 0.0);
        let all = self.call(exact).all_gather(padded, width * world).wait()?;
        Ok(all
            .chunks(width)
            .zip(lens)
            .map(|(c, len)| decode(c, len))
            .collect())
    }

    /// `root`'s bytes on every rank (a collective; only the root's `bytes` are read, at most
    /// [`MAX_BYTES`]). Exact.
    pub fn broadcast_bytes(&mut self, bytes: &[u8], root: usize) -> Result<Vec<u8>, Error> {
        self.broadcast_bytes_within(bytes, root, MAX_BYTES)
    }

    /// [`ProcessGroup::broadcast_bytes`] of at most `max` bytes: a root that announces more
    /// fails the call on every rank, naming it, before any allocation.
    pub fn broadcast_bytes_within(
        &mut self,
        bytes: &[u8],
        root: usize,
        max: usize,
    ) -> Result<Vec<u8>, Error> {
        const OP: &str = "broadcast_bytes";
        let len = self
            .broadcast(encode(&(bytes.len() as u64).to_le_bytes()), root)
            .wait()?;
        let len = length(OP, &len, root, max)?;
        let mut payload = encode(bytes);
        payload.resize(len.div_ceil(2), 0.0);
        let got = self.broadcast(payload, root).wait()?;
        Ok(decode(&got, len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_through_f32_exactly() {
        for b in [
            vec![],
            vec![7],
            vec![0, 255, 1, 254, 128],
            (0..=255).collect::<Vec<u8>>(),
        ] {
            assert_eq!(decode(&encode(&b), b.len()), b);
        }
    }
}
