//! The kernels themselves, as methods of [`Kernels`]: f32 <-> f16/bf16 casts, the fused
//! reduction of several buffers, AdamW on a shard kept on the device, and int8 block
//! quantization. Each checks its buffers' sizes, then dispatches in chunks.

use super::*;

impl Kernels {
    /// Casts `n` f32 values to `half`, packed two per u32 (`ceil(n / 2)` words).
    pub fn cast_to_half(&self, half: Half, src: &GpuBuf, n: usize) -> Result<GpuBuf, ShaderError> {
        need("cast source", src, n)?;
        let dst = self.zeros(n.div_ceil(2))?;
        let pipe = match half {
            Half::F16 => &self.to_f16,
            Half::Bf16 => &self.to_bf16,
        };
        self.dispatch(
            pipe,
            n,
            |a, b| {
                let m = (b - a) as u64;
                (
                    vec![
                        (0, &src.buffer, 4 * a as u64, 4 * m),
                        (1, &dst.buffer, 2 * a as u64, 4 * m.div_ceil(2)),
                    ],
                    vec![m as u32],
                )
            },
            |m| m.div_ceil(2).div_ceil(256),
        );
        self.counters.cast.fetch_add(1, Ordering::Relaxed);
        Ok(dst)
    }

    /// Expands `n` packed 16-bit values back to f32 (`n` words).
    pub fn cast_from_half(
        &self,
        half: Half,
        src: &GpuBuf,
        n: usize,
    ) -> Result<GpuBuf, ShaderError> {
        need("cast source", src, n.div_ceil(2))?;
        let dst = self.zeros(n)?;
        let pipe = match half {
            Half::F16 => &self.from_f16,
            Half::Bf16 => &self.from_bf16,
        };
        self.dispatch(
            pipe,
            n,
            |a, b| {
                let m = (b - a) as u64;
                (
                    vec![
                        (0, &src.buffer, 2 * a as u64, 4 * m.div_ceil(2)),
                        (1, &dst.buffer, 4 * a as u64, 4 * m),
                    ],
                    vec![m as u32],
                )
            },
            |m| m.div_ceil(256),
        );
        self.counters.cast.fetch_add(1, Ordering::Relaxed);
        Ok(dst)
    }

    /// `out[..n] = scale * sum(inputs[k][..n])`, accumulated in f32, in passes of four inputs.
    pub fn reduce(
        &self,
        inputs: &[&GpuBuf],
        out: &GpuBuf,
        n: usize,
        scale: f32,
    ) -> Result<(), ShaderError> {
        need("reduce output", out, n)?;
        for b in inputs {
            need("reduce input", b, n)?;
        }
        if inputs.iter().any(|b| std::ptr::eq(*b, out)) {
            return Err(ShaderError::Aliased);
        }
        if inputs.is_empty() {
            return Err(ShaderError::TooSmall {
                what: "reduce inputs",
                have: 0,
                need: 1,
            });
        }
        let passes: Vec<&[&GpuBuf]> = inputs.chunks(4).collect();
        for (k, pass) in passes.iter().enumerate() {
            let last = k + 1 == passes.len();
            let s = if last { scale } else { 1.0 };
            self.dispatch(
                &self.reduce,
                n,
                |a, b| {
                    let (o, sz) = (4 * a as u64, vec4_bytes(b - a));
                    let mut v = vec![(0, &out.buffer, o, sz)];
                    for slot in 0..4 {
                        // Unused slots repeat the first input; `count` masks them.
                        let src = pass.get(slot).unwrap_or(&pass[0]);
                        v.push((slot as u32 + 1, &src.buffer, o, sz));
                    }
                    (
                        v,
                        vec![
                            (b - a) as u32,
                            pass.len() as u32,
                            u32::from(k > 0),
                            s.to_bits(),
                        ],
                    )
                },
                |m| m.div_ceil(4).div_ceil(256),
            );
        }
        self.counters.reduce.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// A shard's AdamW buffers on this device: `params` uploaded, m and v zero, no step yet.
    pub fn adamw_shard(&self, params: &[f32]) -> Result<AdamWShard, ShaderError> {
        let n = params.len();
        Ok(AdamWShard {
            param: self.upload(params)?,
            m: self.zeros(n)?,
            v: self.zeros(n)?,
            n,
            t: 0,
        })
    }

    /// One fused AdamW step of `shard` with gradient `grad`: one dispatch (per chunk), in
    /// place on the shard's param, m and v.
    pub fn adamw_step(
        &self,
        shard: &mut AdamWShard,
        grad: &GpuBuf,
        h: &AdamWHyper,
    ) -> Result<(), ShaderError> {
        let AdamWShard { param, m, v, n, t } = shard;
        let (param, m, v, n) = (&*param, &*m, &*v, *n);
        for (what, b) in [("param", param), ("grad", grad), ("m", m), ("v", v)] {
            need(what, b, n)?;
        }
        *t += 1;
        let t = (*t).min(i32::MAX as u32) as i32;
        // The scalars exactly as Burn computes them (f32 powi; lr and decay from f64).
        let bias1 = 1.0f32 - h.beta1.powi(t);
        let bias2 = 1.0f32 - h.beta2.powi(t);
        let decay = (1.0 - h.lr * f64::from(h.weight_decay)) as f32;
        let lr = h.lr as f32;
        self.dispatch(
            &self.adamw,
            n,
            |a, b| {
                let (o, sz) = (4 * a as u64, vec4_bytes(b - a));
                (
                    vec![
                        (0, &param.buffer, o, sz),
                        (1, &grad.buffer, o, sz),
                        (2, &m.buffer, o, sz),
                        (3, &v.buffer, o, sz),
                    ],
                    vec![
                        (b - a) as u32,
                        h.beta1.to_bits(),
                        h.beta2.to_bits(),
                        (1.0 - h.beta1).to_bits(),
                        (1.0 - h.beta2).to_bits(),
                        bias1.to_bits(),
                        bias2.to_bits(),
                        h.eps.to_bits(),
                        lr.to_bits(),
                        decay.to_bits(),
                    ],
                )
            },
            |m| m.div_ceil(4).div_ceil(256),
        );
        self.counters.adamw.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Quantizes `n` f32 values: (codes, four per word: `ceil(n / 4)` words; scales, one per
    /// 128 values).
    pub fn quantize_int8(&self, src: &GpuBuf, n: usize) -> Result<(GpuBuf, GpuBuf), ShaderError> {
        need("quantize source", src, n)?;
        let codes = self.zeros(n.div_ceil(4))?;
        let scales = self.zeros(n.div_ceil(128))?;
        self.dispatch(
            &self.quantize,
            n,
            |a, b| {
                let m = (b - a) as u64;
                (
                    vec![
                        (0, &src.buffer, 4 * a as u64, 4 * m),
                        (1, &codes.buffer, a as u64, 4 * m.div_ceil(4)),
                        (2, &scales.buffer, 4 * (a / 128) as u64, 4 * m.div_ceil(128)),
                    ],
                    vec![m as u32],
                )
            },
            |m| m.div_ceil(128),
        );
        self.counters.quantize.fetch_add(1, Ordering::Relaxed);
        Ok((codes, scales))
    }

    /// The inverse of [`Self::quantize_int8`]: `n` f32 values.
    pub fn dequantize_int8(
        &self,
        codes: &GpuBuf,
        scales: &GpuBuf,
        n: usize,
    ) -> Result<GpuBuf, ShaderError> {
        need("codes", codes, n.div_ceil(4))?;
        need("scales", scales, n.div_ceil(128))?;
        let out = self.zeros(n)?;
        self.dispatch(
            &self.dequantize,
            n,
            |a, b| {
                let m = (b - a) as u64;
                (
                    vec![
                        (0, &codes.buffer, a as u64, 4 * m.div_ceil(4)),
                        (1, &scales.buffer, 4 * (a / 128) as u64, 4 * m.div_ceil(128)),
                        (2, &out.buffer, 4 * a as u64, 4 * m),
                    ],
                    vec![m as u32],
                )
            },
            |m| m.div_ceil(256),
        );
        self.counters.dequantize.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }
}
