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
    // Uniforms are read before the lane-dependent bounds check, as Burn's generated kernels
    // do: on llvmpipe (lavapipe) loads inside divergent control flow are much dearer (reading
    // them after the bounds check made this kernel 1.3x slower there).
    let beta1 = vec4<f32>(p.beta1);
    let beta2 = vec4<f32>(p.beta2);
    let omb1 = vec4<f32>(p.one_minus_beta1);
    let omb2 = vec4<f32>(p.one_minus_beta2);
    let bias1 = vec4<f32>(p.bias1);
    let bias2 = vec4<f32>(p.bias2);
    let eps = vec4<f32>(p.eps);
    let lr = vec4<f32>(p.lr);
    let decay = vec4<f32>(p.decay);
    let n = p.n;
    let i = (wg.y * nwg.x + wg.x) * 256u + li;
    if (4u * i < n) {
        let g = grad[i];
        let m_old = m1[i];
        let v_old = m2[i];
        let p_old = param[i];
        let m = fma(m_old, beta1, g * omb1);
        let v = fma(v_old, beta2, (g * g) * omb2);
        let update = (m / bias1) / (sqrt(v / bias2) + eps);
        let q = fma(p_old, decay, -(update * lr));
        // Lanes past n in the last vec4 only touch the shard's padding (its buffers are
        // allocated in whole vec4s and hold exactly n elements).
        m1[i] = m;
        m2[i] = v;
        param[i] = q;
    }
}
