// out = (out_or_zero + in0 + in1 + in2 + in3 [first `count` inputs]) * scale, in f32,
// four elements per thread (vec4; buffers are allocated in whole vec4s; lanes past `n` in
// the last vec4 keep their old values).
// N buffers are reduced in passes of up to 4: the first pass starts from zero
// (accumulate = 0), later ones add to `out`; only the last pass applies the scale.

struct Params {
    n: u32, // elements in this chunk
    count: u32,
    accumulate: u32,
    scale: f32,
}

@group(0) @binding(0) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> in0: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> in1: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> in2: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> in3: array<vec4<f32>>;
@group(0) @binding(5) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    // Uniforms are read before the lane-dependent bounds check, as Burn's generated kernels
    // do: on llvmpipe (lavapipe) loads inside divergent control flow are much dearer.
    let n = p.n;
    let count = p.count;
    let accumulate = p.accumulate != 0u;
    let scale = p.scale;
    let i = (wg.y * nwg.x + wg.x) * 256u + li;
    if (4u * i < n) {
        var acc = vec4<f32>(0.0);
        if (accumulate) {
            acc = out[i];
        }
        acc = acc + in0[i];
        if (count > 1u) {
            acc = acc + in1[i];
        }
        if (count > 2u) {
            acc = acc + in2[i];
        }
        if (count > 3u) {
            acc = acc + in3[i];
        }
        if (4u * i + 3u < n) {
            out[i] = acc * scale;
        } else {
            // The chunk's last, partial vec4: lanes past n keep their values.
            let keep = vec4<u32>(4u * i) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(n);
            out[i] = select(out[i], acc * scale, keep);
        }
    }
}
