//! Narrow element encodings for the wire: f16, bf16 (IEEE round-to-nearest-even, NaN and Inf
//! kept) and int8 block quantization (symmetric, one f32 scale per block of [`INT8_BLOCK`]
//! elements, as ZeRO++'s qgZ). Reductions always accumulate in f32: a receiver decodes a frame
//! and adds it to its own f32 values.
//!
//! Every encoding is *idempotent* on its own output: encoding values that came out of a decode
//! gives back exactly the same bytes. The ring relies on that so every rank ends a collective
//! with bit-identical values (see docs/STRATEGIES.md, "error model"). For int8 that needs one
//! detail: the scale `amax / 127` is rounded *up* to 17 significant bits, so `127 * scale` is
//! exact in f32 and re-quantizing a dequantized block finds the same scale and the same codes.
//!
//! Layout of an int8 frame of `n` elements: `ceil(n / 128)` little-endian f32 scales, then `n`
//! signed bytes. A block whose values are not all finite gets a NaN scale, so non-finite
//! gradients stay visible after the collective.

use crate::wire::WireDtype;

/// Elements per int8 quantization block (one f32 scale each).
pub const INT8_BLOCK: usize = 128;

/// Bytes that `n` elements take on the wire in `dtype`.
pub fn encoded_len(dtype: WireDtype, n: usize) -> usize {
    match dtype {
        WireDtype::F32 => 4 * n,
        WireDtype::F16 | WireDtype::Bf16 => 2 * n,
        WireDtype::Int8 => n + 4 * n.div_ceil(INT8_BLOCK),
    }
}

/// The int8 scale of a block with largest magnitude `amax` (see the module docs).
pub fn int8_scale(amax: f32) -> f32 {
    if !amax.is_finite() {
        return f32::NAN;
    }
    if amax == 0.0 {
        return 0.0;
    }
    let s = amax / 127.0;
    // Round up to 17 significant bits: clear the low 7 mantissa bits, add one step if any
    // were set. Positive finite floats order like their bit patterns, so this is a ceiling.
    let b = s.to_bits();
    let low = b & 0x7f;
    let up = (b & !0x7f) + if low != 0 { 0x80 } else { 0 };
    f32::from_bits(up)
}

/// The int8 code of `v = x / scale`: rounded half away from zero (by adding ±0.5 and
/// truncating, which vectorizes; `f32::round` is a libm call on baseline x86-64), clamped.
/// Decoded values (integers) come back exactly, which keeps the encoding idempotent.
fn quantize(v: f32) -> i8 {
    (v + 0.5f32.copysign(v)).clamp(-127.0, 127.0) as i8
}

/// Encodes `src` into `dst` (resized to [`encoded_len`]).
pub fn encode(dtype: WireDtype, src: &[f32], dst: &mut Vec<u8>) {
    dst.clear();
    dst.resize(encoded_len(dtype, src.len()), 0);
    match dtype {
        WireDtype::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
        WireDtype::F16 => {
            for (d, x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&half::f16::from_f32(*x).to_bits().to_le_bytes());
            }
        }
        WireDtype::Bf16 => {
            for (d, x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&half::bf16::from_f32(*x).to_bits().to_le_bytes());
            }
        }
        WireDtype::Int8 => {
            let nb = src.len().div_ceil(INT8_BLOCK);
            let (scales, codes) = dst.split_at_mut(4 * nb);
            for ((blk, sc), out) in src
                .chunks(INT8_BLOCK)
                .zip(scales.chunks_exact_mut(4))
                .zip(codes.chunks_mut(INT8_BLOCK))
            {
                let amax = blk.iter().fold(0.0f32, |m, x| {
                    if x.is_finite() {
                        m.max(x.abs())
                    } else {
                        f32::INFINITY
                    }
                });
                let s = int8_scale(amax);
                sc.copy_from_slice(&s.to_le_bytes());
                // Exact division when s is finite and non-zero: codes are round(x / s).
                if s.is_finite() && s > 0.0 {
                    // A multiply instead of a divide: the code can differ from round(x / s)
                    // only within an ulp of a .5 tie, still within half a step (+ulps).
                    let inv = 1.0 / s;
                    for (o, x) in out.iter_mut().zip(blk) {
                        *o = quantize(*x * inv) as u8;
                    }
                }
            }
        }
    }
}

/// What a decoded frame does to the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Apply {
    /// Overwrite.
    Set,
    /// Add (accumulate in f32).
    Add,
}

#[inline]
fn put(d: &mut f32, v: f32, how: Apply) {
    match how {
        Apply::Set => *d = v,
        Apply::Add => *d += v,
    }
}

/// Decodes `src` (exactly [`encoded_len`]`(dtype, dst.len())` bytes; the caller checked the
/// frame length) into `dst`.
pub fn decode(dtype: WireDtype, src: &[u8], dst: &mut [f32], how: Apply) {
    debug_assert_eq!(src.len(), encoded_len(dtype, dst.len()));
    match dtype {
        WireDtype::F32 => {
            for (d, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                put(d, f32::from_le_bytes([b[0], b[1], b[2], b[3]]), how);
            }
        }
        WireDtype::F16 => {
            for (d, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                let v = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                put(d, v, how);
            }
        }
        WireDtype::Bf16 => {
            for (d, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                let v = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                put(d, v, how);
            }
        }
        WireDtype::Int8 => {
            let nb = dst.len().div_ceil(INT8_BLOCK);
            let (scales, codes) = src.split_at(4 * nb);
            for ((blk, sc), code) in dst
                .chunks_mut(INT8_BLOCK)
                .zip(scales.chunks_exact(4))
                .zip(codes.chunks(INT8_BLOCK))
            {
                let s = f32::from_le_bytes([sc[0], sc[1], sc[2], sc[3]]);
                for (d, q) in blk.iter_mut().zip(code) {
                    put(d, f32::from(*q as i8) * s, how);
                }
            }
        }
    }
}

/// Replaces `buf` by what a receiver of its encoding would decode (encode, then decode).
pub fn round_trip(dtype: WireDtype, buf: &mut [f32], scratch: &mut Vec<u8>) {
    if dtype == WireDtype::F32 {
        return;
    }
    encode(dtype, buf, scratch);
    decode(dtype, scratch, buf, Apply::Set);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt(d: WireDtype, v: &[f32]) -> Vec<f32> {
        let mut b = v.to_vec();
        round_trip(d, &mut b, &mut Vec::new());
        b
    }

    fn sample(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                let m = (s % 2001) as f32 / 1000.0 - 1.0;
                m * 10f32.powi((i % 7) as i32 - 3)
            })
            .collect()
    }

    #[test]
    fn lengths() {
        assert_eq!(encoded_len(WireDtype::F32, 10), 40);
        assert_eq!(encoded_len(WireDtype::Bf16, 10), 20);
        assert_eq!(encoded_len(WireDtype::Int8, 128), 132);
        assert_eq!(encoded_len(WireDtype::Int8, 129), 137);
        assert_eq!(encoded_len(WireDtype::Int8, 0), 0);
    }

    #[test]
    fn narrow_floats_round_to_nearest_even_and_keep_specials() {
        // 1 + 2^-8 is halfway between two bf16 values: ties to even (1.0).
        assert_eq!(rt(WireDtype::Bf16, &[1.0 + 1.0 / 256.0])[0], 1.0);
        // 1 + 3 * 2^-8 ties up to 1 + 2^-6.
        assert_eq!(
            rt(WireDtype::Bf16, &[1.0 + 3.0 / 256.0])[0],
            1.0 + 1.0 / 64.0
        );
        for d in [WireDtype::F16, WireDtype::Bf16] {
            let v = rt(d, &[f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -0.0, 0.0]);
            assert_eq!(v[0], f32::INFINITY);
            assert_eq!(v[1], f32::NEG_INFINITY);
            assert!(v[2].is_nan());
            assert!(v[3] == 0.0 && v[3].is_sign_negative());
        }
        assert_eq!(rt(WireDtype::F16, &[1e6])[0], f32::INFINITY);
    }

    #[test]
    fn every_encoding_is_idempotent() {
        for d in [WireDtype::F16, WireDtype::Bf16, WireDtype::Int8] {
            for seed in 1..50 {
                let once = rt(d, &sample(1000 + seed as usize, seed));
                let twice = rt(d, &once);
                assert_eq!(
                    bytemuck::cast_slice::<f32, u32>(&once),
                    bytemuck::cast_slice::<f32, u32>(&twice),
                    "{d:?} seed {seed}"
                );
            }
        }
        // Scales from every mantissa of one binade: 127 * scale is exact.
        for m in (0u32..(1 << 23)).step_by(97) {
            let amax = f32::from_bits((130 << 23) | m);
            let s = int8_scale(amax);
            assert_eq!(int8_scale(127.0 * s), s);
            assert!(s >= amax / 127.0);
            assert_eq!((amax / s).round(), 127.0);
        }
    }

    #[test]
    fn int8_error_is_at_most_half_a_step() {
        let v = sample(10_000, 7);
        let q = rt(WireDtype::Int8, &v);
        for (blk, qb) in v.chunks(INT8_BLOCK).zip(q.chunks(INT8_BLOCK)) {
            let amax = blk.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let s = int8_scale(amax);
            for (x, y) in blk.iter().zip(qb) {
                assert!((x - y).abs() <= 0.5 * s * (1.0 + 1e-6), "{x} {y} {s}");
            }
        }
        let nan = rt(WireDtype::Int8, &[1.0, f32::NAN, 2.0]);
        assert!(nan.iter().all(|x| x.is_nan()));
        assert_eq!(rt(WireDtype::Int8, &[0.0; 5]), vec![0.0; 5]);
    }

    #[test]
    fn decode_add_accumulates() {
        let mut enc = Vec::new();
        encode(WireDtype::Bf16, &[1.0, 2.0], &mut enc);
        let mut acc = [0.5f32, 0.25];
        decode(WireDtype::Bf16, &enc, &mut acc, Apply::Add);
        assert_eq!(acc, [1.5, 2.25]);
    }
}
