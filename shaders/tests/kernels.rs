//! Every kernel against a CPU reference on a real wgpu device (lavapipe on CPU-only
//! machines): casts bit-exact with the `half` crate (NaN, Inf, subnormals, ties included),
//! AdamW within 1e-6 relative of Burn's formula in f32, int8 within half a quantization step
//! per element, reduce against a serial f32 sum; multi-chunk dispatches (chunks forced small,
//! and one real buffer larger than lavapipe's 128 MiB binding limit).
//!
//! Skipped with a printed reason when the machine has no Vulkan/Metal/DX12 adapter at all;
//! under `CI=true` that fails instead.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use wiretrain_shaders::{AdamWHyper, Half, Kernels};

#[path = "../../tests/common/skip.rs"]
mod skip;

fn kernels() -> Option<Kernels> {
    match Kernels::standalone() {
        Ok(k) => {
            eprintln!("kernels on {}", k.description());
            Some(k)
        }
        Err(e) => {
            skip::skip_unless_ci(&format!(
                "no wgpu adapter: {e} (install mesa-vulkan-drivers for lavapipe)"
            ));
            None
        }
    }
}

/// A seeded generator, so every run checks the same inputs.
fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// A uniform value in [-1, 1].
fn unit(r: &mut StdRng) -> f32 {
    r.random_range(-1.0f32..=1.0)
}

/// Special values and random bit patterns (every class of float: NaNs with payloads,
/// infinities, subnormals of both formats, values at rounding ties, overflow for f16).
fn cast_inputs(n: usize) -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN, low payload
        f32::from_bits(0xffc1_2345),
        f32::MIN_POSITIVE,
        f32::from_bits(1), // smallest f32 subnormal
        65504.0,
        65520.0, // rounds to f16 Inf
        1e6,
        5.960_464_5e-8, // smallest f16 subnormal
        2.980_232_2e-8, // half of it: tie to even (0)
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        6.1e-5,
        -3.0e-6,
    ];
    let mut r = rng(0x9e37_79b9_7f4a_7c15);
    while v.len() < n {
        v.push(f32::from_bits(r.random::<u32>()));
    }
    v.truncate(n);
    v
}

fn ref_half(h: Half, x: f32) -> u16 {
    match h {
        Half::F16 => half::f16::from_f32(x).to_bits(),
        Half::Bf16 => half::bf16::from_f32(x).to_bits(),
    }
}

fn ref_back(h: Half, b: u16) -> f32 {
    match h {
        Half::F16 => half::f16::from_bits(b).to_f32(),
        Half::Bf16 => half::bf16::from_bits(b).to_f32(),
    }
}

fn check_casts(k: &Kernels, n: usize) {
    let x = cast_inputs(n);
    let src = k.upload(&x).unwrap();
    for h in [Half::F16, Half::Bf16] {
        let packed = k.cast_to_half(h, &src, n).unwrap();
        let words: Vec<u32> = k.read(&packed, n.div_ceil(2)).unwrap();
        let mut bad = 0;
        for (i, v) in x.iter().enumerate() {
            let got = (words[i / 2] >> (16 * (i % 2))) as u16;
            let want = ref_half(h, *v);
            if got != want {
                bad += 1;
                if bad < 5 {
                    eprintln!(
                        "{h:?} {i}: {:#010x} -> {got:#06x}, want {want:#06x}",
                        v.to_bits()
                    );
                }
            }
        }
        assert_eq!(bad, 0, "{h:?} to-half mismatches out of {n}");
        if n % 2 == 1 {
            assert_eq!(words[n / 2] >> 16, 0, "padding half is zero");
        }
        let back = k.cast_from_half(h, &packed, n).unwrap();
        let got: Vec<u32> = k.read(&back, n).unwrap();
        for (i, g) in got.iter().enumerate() {
            let b = (words[i / 2] >> (16 * (i % 2))) as u16;
            assert_eq!(
                *g,
                ref_back(h, b).to_bits(),
                "{h:?} from-half {i} ({b:#06x})"
            );
        }
        // Every 16-bit pattern expands exactly.
        if n == 100_003 {
            let all: Vec<u32> = (0..=u16::MAX as u32)
                .step_by(2)
                .map(|a| a | ((a + 1) << 16))
                .collect();
            let b = k.upload(&all).unwrap();
            let out: Vec<u32> = k
                .read(&k.cast_from_half(h, &b, 65536).unwrap(), 65536)
                .unwrap();
            for (p, g) in out.iter().enumerate() {
                assert_eq!(
                    *g,
                    ref_back(h, p as u16).to_bits(),
                    "{h:?} pattern {p:#06x}"
                );
            }
        }
    }
}

#[test]
fn casts_are_bit_exact() {
    let Some(k) = kernels() else { return };
    check_casts(&k, 100_003);
    check_casts(&k, 1);
}

#[test]
fn casts_are_bit_exact_across_chunks() {
    let Some(k) = kernels() else { return };
    let k = k.with_chunk_elems(65536);
    check_casts(&k, 3 * 65536 + 12_345);
}

/// Burn's AdamW (burn-optim 0.22) in f32, element by element.
fn adamw_ref(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamWHyper, t: i32) {
    let (b1, b2) = (h.beta1, h.beta2);
    let bias1 = 1.0f32 - b1.powi(t);
    let bias2 = 1.0f32 - b2.powi(t);
    let decay = (1.0 - h.lr * f64::from(h.weight_decay)) as f32;
    let lr = h.lr as f32;
    for i in 0..p.len() {
        m[i] = m[i] * b1 + g[i] * (1.0 - b1);
        v[i] = v[i] * b2 + (g[i] * g[i]) * (1.0 - b2);
        let u = (m[i] / bias1) / ((v[i] / bias2).sqrt() + h.eps);
        p[i] = p[i] * decay - u * lr;
    }
}

fn rel(a: f32, b: f32) -> f32 {
    (a - b).abs() / b.abs().max(1e-30)
}

fn check_adamw(k: &Kernels, n: usize) {
    let h = AdamWHyper::default();
    let mut r = rng(42);
    let mut p: Vec<f32> = (0..n).map(|_| unit(&mut r)).collect();
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mut shard = k.adamw_shard(&p).unwrap();
    let gg = k.zeros(n).unwrap();
    for t in 1..=5 {
        let g: Vec<f32> = (0..n).map(|_| unit(&mut r) * 0.1).collect();
        k.write(&gg, &g).unwrap();
        k.adamw_step(&mut shard, &gg, &h).unwrap();
        assert_eq!(shard.t, t);
        adamw_ref(&mut p, &g, &mut m, &mut v, &h, t as i32);
    }
    let (dp, dm, dv): (Vec<f32>, Vec<f32>, Vec<f32>) = (
        k.read(shard.param(), n).unwrap(),
        k.read(shard.m(), n).unwrap(),
        k.read(shard.v(), n).unwrap(),
    );
    let mut worst = 0.0f32;
    for i in 0..n {
        worst = worst
            .max(rel(dp[i], p[i]))
            .max(rel(dm[i], m[i]))
            .max(rel(dv[i], v[i]));
    }
    eprintln!("adamw n={n}: worst relative difference {worst:e} after 5 steps");
    assert!(worst <= 1e-6, "adamw worst relative difference {worst:e}");
}

#[test]
fn fused_adamw_matches_burns_formula() {
    let Some(k) = kernels() else { return };
    check_adamw(&k, 100_001);
    check_adamw(&k.with_chunk_elems(65536), 2 * 65536 + 77);
}

fn check_int8(k: &Kernels, n: usize) {
    let mut r = rng(7);
    let mut x: Vec<f32> = (0..n)
        .map(|i| unit(&mut r) * 10f32.powi((i / 128 % 9) as i32 - 4))
        .collect();
    // A zero block, and a block with a NaN and one with Inf.
    for v in x.iter_mut().take(256).skip(128) {
        *v = 0.0;
    }
    if n > 1000 {
        x[300] = f32::NAN;
        x[700] = f32::INFINITY;
    }
    let src = k.upload(&x).unwrap();
    let (codes, scales) = k.quantize_int8(&src, n).unwrap();
    let s: Vec<f32> = k.read(&scales, n.div_ceil(128)).unwrap();
    let out: Vec<f32> = k
        .read(&k.dequantize_int8(&codes, &scales, n).unwrap(), n)
        .unwrap();
    let mut same_scale = 0;
    for (b, blk) in x.chunks(128).enumerate() {
        let finite = blk.iter().all(|v| v.is_finite());
        let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let cpu = wiretrain_comm_scale(amax, finite);
        if !finite {
            assert!(
                s[b].is_nan(),
                "block {b}: non-finite block has scale {}",
                s[b]
            );
            assert!(out[b * 128..b * 128 + blk.len()].iter().all(|v| v.is_nan()));
            continue;
        }
        if s[b].to_bits() == cpu.to_bits() {
            same_scale += 1;
        }
        for (j, v) in blk.iter().enumerate() {
            let e = (out[b * 128 + j] - v).abs();
            assert!(
                e <= 0.5 * s[b] * (1.0 + 1e-5),
                "block {b} elem {j}: {v} -> {} (scale {})",
                out[b * 128 + j],
                s[b]
            );
        }
    }
    let blocks = n.div_ceil(128);
    eprintln!("int8 n={n}: {same_scale}/{blocks} scales bit-equal to the CPU codec's");
    assert!(
        same_scale * 100 >= blocks * 95,
        "scales mostly agree with the CPU codec"
    );
}

/// The comm codec's scale rule (amax / 127 rounded up to 17 significant bits).
fn wiretrain_comm_scale(amax: f32, finite: bool) -> f32 {
    if !finite {
        return f32::NAN;
    }
    if amax == 0.0 {
        return 0.0;
    }
    let b = (amax / 127.0).to_bits();
    f32::from_bits((b & !0x7f) + if b & 0x7f != 0 { 0x80 } else { 0 })
}

#[test]
fn int8_error_is_within_half_a_step() {
    let Some(k) = kernels() else { return };
    check_int8(&k, 100_000);
    check_int8(&k, 77);
    check_int8(&k.with_chunk_elems(65536), 3 * 65536 + 200);
}

#[test]
fn reduce_sums_n_buffers_with_a_scale() {
    let Some(k) = kernels() else { return };
    for (count, n, scale) in [
        (1usize, 1000usize, 1.0f32),
        (3, 70_001, 0.5),
        (6, 4097, 1.0 / 6.0),
    ] {
        let mut r = rng(count as u64 + 11);
        let xs: Vec<Vec<f32>> = (0..count)
            .map(|_| (0..n).map(|_| unit(&mut r)).collect())
            .collect();
        let bufs: Vec<_> = xs.iter().map(|x| k.upload(x).unwrap()).collect();
        let refs: Vec<_> = bufs.iter().collect();
        let out = k.zeros(n).unwrap();
        k.reduce(&refs, &out, n, scale).unwrap();
        let got: Vec<f32> = k.read(&out, n).unwrap();
        for i in 0..n {
            let want = xs.iter().map(|x| x[i]).sum::<f32>() * scale;
            assert!(
                (got[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
                "count {count} elem {i}: {} vs {want}",
                got[i]
            );
        }
    }
    let a = k.upload(&[1.0f32; 8]).unwrap();
    assert!(k.reduce(&[&a], &a, 8, 1.0).is_err(), "aliasing refused");
    assert!(
        k.reduce(&[&a], &k.zeros(4).unwrap(), 8, 1.0).is_err(),
        "short output refused"
    );
    let c = k.counters();
    assert_eq!(c.reduce, 3);
}

/// A real buffer above lavapipe's 128 MiB storage binding: 40M f32 (160 MiB) cast to bf16 and
/// back, in several chunks.
#[test]
fn buffers_larger_than_one_binding() {
    let Some(k) = kernels() else { return };
    let n = 40 << 20;
    let limit = k.device().limits().max_storage_buffer_binding_size as usize;
    eprintln!(
        "max binding {limit} bytes, chunk {} elements, buffer {} bytes",
        k.chunk_elems(),
        4 * n
    );
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.001 - 0.5).collect();
    let src = k.upload(&x).unwrap();
    let packed = k.cast_to_half(Half::Bf16, &src, n).unwrap();
    let back: Vec<f32> = k
        .read(&k.cast_from_half(Half::Bf16, &packed, n).unwrap(), n)
        .unwrap();
    for i in (0..n).step_by(9973).chain([n - 1]) {
        assert_eq!(back[i], half::bf16::from_f32(x[i]).to_f32(), "elem {i}");
    }
    assert_eq!(k.counters().cast, 2);
}
