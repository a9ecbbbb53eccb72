// Casts between f32 and the 16-bit wire types, bit-exact with the `half` crate (IEEE
// round-to-nearest-even; NaN stays NaN with its sign and top payload bits, +-Inf stays Inf,
// f16 overflow gives Inf, subnormals are kept). Everything works on the bit patterns (u32),
// so no float unit can flush subnormals or canonicalize NaNs.
//
// to_f16 / to_bf16: thread i packs elements 2i (low half) and 2i+1 (high half) into one u32.
// from_f16 / from_bf16: thread i unpacks element i.

struct Params {
    n: u32, // elements in this chunk
}

@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;

// Where a thread is: workgroups run over a 2-D grid when one dimension is not enough.
struct Thread {
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
}

fn index(t: Thread) -> u32 {
    return (t.wg.y * t.nwg.x + t.wg.x) * 256u + t.li;
}

fn bf16_of(x: u32) -> u32 {
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return ((x >> 16u) | 0x40u) & 0xffffu;
    }
    let r = 0x8000u;
    var h = x >> 16u;
    if ((x & r) != 0u && (x & (3u * r - 1u)) != 0u) {
        h = h + 1u;
    }
    return h & 0xffffu;
}

fn f16_of(x: u32) -> u32 {
    let sign = x & 0x80000000u;
    let ex = x & 0x7f800000u;
    let man = x & 0x007fffffu;
    if (ex == 0x7f800000u) {
        var nan_bit = 0u;
        if (man != 0u) {
            nan_bit = 0x200u;
        }
        return (sign >> 16u) | 0x7c00u | nan_bit | (man >> 13u);
    }
    let half_sign = sign >> 16u;
    let half_exp = i32(ex >> 23u) - 127 + 15;
    if (half_exp >= 0x1f) {
        return half_sign | 0x7c00u;
    }
    if (half_exp <= 0) {
        if (14 - half_exp > 24) {
            return half_sign;
        }
        let m = man | 0x00800000u;
        let sh = u32(14 - half_exp);
        var half_man = m >> sh;
        let round_bit = 1u << (sh - 1u);
        if ((m & round_bit) != 0u && (m & (3u * round_bit - 1u)) != 0u) {
            half_man = half_man + 1u;
        }
        return half_sign | half_man;
    }
    let he = u32(half_exp) << 10u;
    let hm = man >> 13u;
    let round_bit = 0x1000u;
    if ((man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u) {
        return (half_sign | he | hm) + 1u;
    }
    return half_sign | he | hm;
}

fn f32_of_bf16(h: u32) -> u32 {
    if ((h & 0x7fffu) > 0x7f80u) {
        return (h | 0x40u) << 16u;
    }
    return h << 16u;
}

fn f32_of_f16(i: u32) -> u32 {
    if ((i & 0x7fffu) == 0u) {
        return i << 16u;
    }
    let half_sign = i & 0x8000u;
    let half_exp = i & 0x7c00u;
    let half_man = i & 0x03ffu;
    if (half_exp == 0x7c00u) {
        if (half_man == 0u) {
            return (half_sign << 16u) | 0x7f800000u;
        }
        return (half_sign << 16u) | 0x7fc00000u | (half_man << 13u);
    }
    let sign = half_sign << 16u;
    if (half_exp == 0u) {
        // Subnormal: normalize (leading zeros of the 16-bit value, minus 6).
        let e = countLeadingZeros(half_man) - 22u;
        let ex = (127u - 15u - e) << 23u;
        let m = (half_man << (14u + e)) & 0x7fffffu;
        return sign | ex | m;
    }
    let ex = u32(i32(half_exp >> 10u) - 15 + 127) << 23u;
    return sign | ex | (half_man << 13u);
}

// The f32 bits `x` as bf16 (`bf`) or f16 bits.
fn narrow(x: u32, bf: bool) -> u32 {
    if (bf) {
        return bf16_of(x);
    }
    return f16_of(x);
}

// Packs elements 2i and 2i+1 (0 past the end) into dst[i], low half first.
fn pack_pair(i: u32, bf: bool) {
    let a = 2u * i;
    if (a >= p.n) {
        return;
    }
    var hi = 0u;
    if (a + 1u < p.n) {
        hi = narrow(src[a + 1u], bf);
    }
    dst[i] = narrow(src[a], bf) | (hi << 16u);
}

// Element i, the low (even i) or high half of src[i / 2], widened to f32 bits.
fn unpack(i: u32, bf: bool) {
    if (i >= p.n) {
        return;
    }
    let h = (src[i / 2u] >> (16u * (i % 2u))) & 0xffffu;
    if (bf) {
        dst[i] = f32_of_bf16(h);
    } else {
        dst[i] = f32_of_f16(h);
    }
}

@compute @workgroup_size(256)
fn to_bf16(t: Thread) {
    pack_pair(index(t), true);
}

@compute @workgroup_size(256)
fn to_f16(t: Thread) {
    pack_pair(index(t), false);
}

@compute @workgroup_size(256)
fn from_bf16(t: Thread) {
    unpack(index(t), true);
}

@compute @workgroup_size(256)
fn from_f16(t: Thread) {
    unpack(index(t), false);
}
