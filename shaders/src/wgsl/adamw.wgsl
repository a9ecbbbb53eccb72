// Fused AdamW on a flat shard, in place, one dispatch: the same element-wise math as Burn's
// AdamW (burn-optim 0.22), so a run can switch between them:
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   update = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
//   param = param (1 - lr wd) - lr update          (decoupled weight decay)
// The host computes the step-dependent scalars (bias corrections) once per step.

struct Params {
    n: u32,
    beta1: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    bias1: f32, // 1 - beta1^t
    bias2: f32, // 1 - beta2^t
    eps: f32,
    lr: f32,
    decay: f32, // 1 - lr * weight_decay
}

@group(0) @binding(0) var<storage, read_write> param: array<f32>;
@group(0) @binding(1) var<storage, read> grad: array<f32>;
@group(0) @binding(2) var<storage, read_write> m1: array<f32>;
@group(0) @binding(3) var<storage, read_write> m2: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let i = (wg.y * nwg.x + wg.x) * 256u + li;
    if (i >= p.n) {
        return;
    }
    let g = grad[i];
    let m = m1[i] * p.beta1 + g * p.one_minus_beta1;
    let v = m2[i] * p.beta2 + (g * g) * p.one_minus_beta2;
    m1[i] = m;
    m2[i] = v;
    let update = (m / p.bias1) / (sqrt(v / p.bias2) + p.eps);
    param[i] = param[i] * p.decay - update * p.lr;
}
