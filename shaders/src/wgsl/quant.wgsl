// Symmetric int8 block quantization (ZeRO++ qgZ style) and its inverse; the same rules as
// wiretrain-comm's codec: one f32 scale per block of 128 values, scale = amax / 127 rounded
// up to 17 significant bits (so re-quantizing a dequantized block is exact), codes
// round(x / scale) with ties away from zero, clamped to [-127, 127]; a block with a
// non-finite value gets a NaN scale; an all-zero block a zero scale.
// Codes are packed four per u32, element 4k + j in byte j.

struct Params {
    n: u32,
}

@group(0) @binding(0) var<storage, read> src: array<u32>;   // quantize: f32 bits
@group(0) @binding(1) var<storage, read_write> codes: array<u32>;
@group(0) @binding(2) var<storage, read_write> scales: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

var<workgroup> red: array<f32, 128>;
var<workgroup> q: array<u32, 128>;

fn scale_of(amax: f32) -> f32 {
    let b = bitcast<u32>(amax);
    if ((b & 0x7f800000u) == 0x7f800000u) {
        return bitcast<f32>(0x7fc00000u);
    }
    if (amax == 0.0) {
        return 0.0;
    }
    let s = bitcast<u32>(amax / 127.0);
    var up = s & 0xffffff80u;
    if ((s & 0x7fu) != 0u) {
        up = up + 0x80u;
    }
    return bitcast<f32>(up);
}

fn round_away(v: f32) -> f32 {
    let t = trunc(v);
    if (abs(v - t) == 0.5) {
        return t + sign(v);
    }
    return round(v);
}

@compute @workgroup_size(128)
fn quantize(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) li: u32) {
    let block = wg.y * nwg.x + wg.x;
    let i = block * 128u + li;
    var x = 0.0;
    var mag = 0.0;
    if (i < p.n) {
        let b = src[i];
        if ((b & 0x7f800000u) == 0x7f800000u) {
            mag = bitcast<f32>(0x7f800000u); // +Inf marks a non-finite block
        } else {
            x = bitcast<f32>(b);
            mag = abs(x);
        }
    }
    red[li] = mag;
    workgroupBarrier();
    for (var s = 64u; s > 0u; s = s >> 1u) {
        if (li < s) {
            red[li] = max(red[li], red[li + s]);
        }
        workgroupBarrier();
    }
    let amax = red[0];
    let scale = scale_of(amax);
    var code = 0u;
    if (i < p.n && (bitcast<u32>(scale) & 0x7f800000u) != 0x7f800000u && scale > 0.0) {
        let c = clamp(round_away(x / scale), -127.0, 127.0);
        code = u32(i32(c)) & 0xffu;
    }
    q[li] = code;
    if (li == 0u && block * 128u < p.n) {
        scales[block] = scale;
    }
    workgroupBarrier();
    if (li < 32u && block * 128u + 4u * li < p.n) {
        let k = 4u * li;
        codes[block * 32u + li] = q[k] | (q[k + 1u] << 8u) | (q[k + 2u] << 16u) | (q[k + 3u] << 24u);
    }
}
