// Fused AdamW on a flat shard, in place, one dispatch: the same element-wise math as Burn's
// AdamW (burn-optim 0.22), so a run can switch between them:
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   update = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
//   param = param (1 - lr wd) - lr update          (decoupled weight decay)
// The host computes the step-dependent scalars (bias corrections) once per step.
// Each thread updates four consecutive elements (vec4 loads: far fewer bounds-checked
// accesses, which is what software adapters such as lavapipe pay for); buffers are allocated
// in whole vec4s.

struct Params {
    n: u32, // elements in this chunk
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

@group(0) @binding(0) var<storage, read_write> param: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> grad: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> m1: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> m2: array<vec4<f32>>;
@group(0) @binding(4) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let i = (wg.y * nwg.x + wg.x) * 256u + li;
    if (4u * i >= p.n) {
        return;
    }
    let g = grad[i];
    let m_old = m1[i];
    let v_old = m2[i];
    let p_old = param[i];
    let m = fma(m_old, vec4<f32>(p.beta1), g * p.one_minus_beta1);
    let v = fma(v_old, vec4<f32>(p.beta2), (g * g) * p.one_minus_beta2);
    let update = (m / p.bias1) / (sqrt(v / p.bias2) + vec4<f32>(p.eps));
    let q = fma(p_old, vec4<f32>(p.decay), -(update * p.lr));
    // Lanes past n in the last vec4 only touch the shard's padding (its buffers are
    // allocated in whole vec4s and hold exactly n elements).
    m1[i] = m;
    m2[i] = v;
    param[i] = q;
}
