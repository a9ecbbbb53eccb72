//! The fused AdamW path of [`super::ShardOptimizer`]: one WGSL dispatch per step on the
//! rank's wgpu device (master, m and v there), and its state in Burn's AdamW form for
//! checkpoints.

use super::*;
use burn::optim::AdaptiveMomentumState;
use wiretrain_shaders::Half;

impl Fused {
    pub(super) fn step(
        &mut self,
        lr: f64,
        params: &mut [f32],
        grads: &[f32],
        opts: StepOpts,
    ) -> Result<(), wiretrain_shaders::ShaderError> {
        let k = &self.kernels;
        let n = params.len();
        if self.shard.is_none() {
            let mut shard = k.adamw_shard(params)?;
            transfer::note_write(4 * n);
            if let Some((m, v, t)) = self.pending.take() {
                k.write(shard.m(), &m)?;
                k.write(shard.v(), &v)?;
                transfer::note_write(8 * n);
                shard.t = t;
            }
            self.shard = Some(shard);
        }
        let raw = match self.grad_raw.take() {
            Some(b) if b.words() == n => b,
            _ => k.zeros(n)?,
        };
        let grad = match self.grad.take() {
            Some(b) if b.words() == n => b,
            _ => k.zeros(n)?,
        };
        k.write(&raw, grads)?;
        transfer::note_write(4 * n);
        // The gradient as the step reads it: scaled on the device (reduce of one buffer).
        k.reduce(&[&raw], &grad, n, opts.grad_scale)?;
        let shard = self.shard.as_mut().expect("created above");
        self.hyper.lr = lr;
        k.adamw_step(shard, &grad, &self.hyper)?;
        let half = match opts.readback {
            WireDtype::F16 => Some(Half::F16),
            WireDtype::Bf16 => Some(Half::Bf16),
            WireDtype::F32 | WireDtype::Int8 => None,
        };
        match half {
            Some(h) => {
                let packed = k.cast_to_half(h, shard.param(), n)?;
                let words: Vec<u32> = k.read(&packed, n.div_ceil(2))?;
                transfer::note_read(4 * n.div_ceil(2));
                // The same decode the wire uses (two little-endian halves per word).
                let bytes: &[u8] = bytemuck::cast_slice(&words);
                let wire = match h {
                    Half::F16 => WireDtype::F16,
                    Half::Bf16 => WireDtype::Bf16,
                };
                wiretrain_comm::codec::decode(
                    wire,
                    &bytes[..2 * n],
                    params,
                    wiretrain_comm::codec::Apply::Set,
                );
            }
            None => {
                // Straight into the caller's buffer (the all-gather's), no Vec in between.
                k.read_into(shard.param(), &mut params[..n])?;
                transfer::note_read(4 * n);
            }
        }
        self.grad_raw = Some(raw);
        self.grad = Some(grad);
        Ok(())
    }

    /// The state in Burn's AdamW form (for checkpoints), `None` before the first step.
    pub(super) fn burn_state(&self, device: &Device) -> Result<Option<AdamWState<1>>, OptimError> {
        let (m, v, t) = match (&self.shard, &self.pending) {
            (Some(s), _) => {
                let k = &self.kernels;
                let m: Vec<f32> = k.read(s.m(), s.len())?;
                let v: Vec<f32> = k.read(s.v(), s.len())?;
                (m, v, s.t)
            }
            (None, Some((m, v, t))) => (m.clone(), v.clone(), *t),
            (None, None) => return Ok(None),
        };
        if t == 0 {
            return Ok(None);
        }
        let n = m.len();
        let tensor = |x: Vec<f32>| Tensor::<1>::from_data(TensorData::new(x, [n]), device);
        Ok(Some(AdamWState {
            momentum: AdaptiveMomentumState::new(t as usize, tensor(m), tensor(v)),
        }))
    }
}
