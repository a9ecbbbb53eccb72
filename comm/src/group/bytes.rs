//! Bytes between ranks: the small integers, hashes, ids and records that ranks must agree on
//! (a checkpoint's file list, memory figures, an NCCL id) travel through these two collectives
//! instead of ad-hoc encodings. Each pair of bytes rides as one f32 holding 0..=65535 (exact),
//! on the f32 wire whatever the group's wire dtype.

use super::{CallOpts, ProcessGroup};
use crate::error::Error;
use crate::wire::WireDtype;

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

impl ProcessGroup {
    /// Every rank's bytes, in rank order (a collective; the lengths may differ). Exact.
    pub fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        let world = self.world();
        let exact = CallOpts::wire(WireDtype::F32).tag("bytes");
        let lens = self
            .call(exact)
            .all_gather(encode(&(mine.len() as u64).to_le_bytes()), 4 * world)
            .wait()?;
        let lens: Vec<usize> = lens
            .chunks(4)
            .map(|c| {
                let b = decode(c, 8);
                u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize
            })
            .collect();
        let width = lens.iter().copied().max().unwrap_or(0).div_ceil(2);
        if width == 0 {
            return Ok(vec![Vec::new(); world]);
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

    /// `root`'s bytes on every rank (a collective; only the root's `bytes` are read). Exact.
    pub fn broadcast_bytes(&mut self, bytes: &[u8], root: usize) -> Result<Vec<u8>, Error> {
        let len = self
            .broadcast(encode(&(bytes.len() as u64).to_le_bytes()), root)
            .wait()?;
        let len = u64::from_le_bytes(decode(&len, 8).try_into().expect("8 bytes")) as usize;
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
