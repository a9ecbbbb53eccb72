// The inverse of quant.wgsl: value = code * scale of its block (128 values per scale).

struct Params {
    n: u32,
}

@group(0) @binding(0) var<storage, read> dcodes: array<u32>;
@group(0) @binding(1) var<storage, read> dscales: array<f32>;
@group(0) @binding(2) var<storage, read_write> dout: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(256)
fn dequantize(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) li: u32) {
    let i = (wg.y * nwg.x + wg.x) * 256u + li;
    if (i >= p.n) {
        return;
    }
    let byte = (dcodes[i / 4u] >> (8u * (i % 4u))) & 0xffu;
    let c = i32(byte << 24u) >> 24u;
    dout[i] = f32(c) * dscales[i / 128u];
}
