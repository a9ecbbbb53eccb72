//! The staging rings of `Kernels::read` / `write` on a real wgpu device (lavapipe on CPU-only
//! machines), with a ring of 2 chunks of 1 KiB so that most sizes span it several times:
//! sizes that do not divide the chunk, 1 word and zero words, and buffers much larger than
//! the ring read back exactly what was written (checked against the host data and against a
//! read through a staging buffer made for the call); writes are seen by kernels submitted
//! after them; and the rings are allocated once: no staging buffer is created after the
//! first calls, however many more there are.
//!
//! Skipped with a printed reason when the machine has no Vulkan/Metal/DX12 adapter at all;
//! under `CI=true` that fails instead.

use wiretrain_shaders::Kernels;

#[path = "../../tests/common/skip.rs"]
mod skip;

const CHUNK: u64 = 1024;
const SLOTS: usize = 2;

fn kernels() -> Option<Kernels> {
    match Kernels::standalone() {
        Ok(k) => Some(k.with_staging(CHUNK, SLOTS)),
        Err(e) => {
            skip::skip_unless_ci(&format!(
                "no wgpu adapter: {e} (install mesa-vulkan-drivers for lavapipe)"
            ));
            None
        }
    }
}

/// Distinct values per size and round, so a stale chunk from an earlier call shows.
fn data(words: usize, round: usize) -> Vec<f32> {
    (0..words)
        .map(|i| (i * 31 + round * 7919) as f32 * 0.5 - 1e4)
        .collect()
}

#[test]
fn the_rings_move_any_size_exactly_and_are_allocated_once() {
    let Some(k) = kernels() else { return };
    assert_eq!(k.staging_shape(), (CHUNK, SLOTS));
    let words_per_chunk = CHUNK as usize / 4;
    let sizes = [
        0,
        1,
        3,
        words_per_chunk - 1,
        words_per_chunk,
        words_per_chunk + 1,
        2 * words_per_chunk + 5,
        // Many times the whole ring (2 KiB): 40 KiB, 10.5 chunks.
        10 * words_per_chunk + words_per_chunk / 2,
    ];
    let mut after_first = None;
    for round in 0..6 {
        for &n in &sizes {
            let want = data(n, round);
            let buf = k.zeros(n).unwrap();
            k.write(&buf, &want).unwrap();
            let got: Vec<f32> = k.read(&buf, n).unwrap();
            assert_eq!(got, want, "{n} words, round {round}: read through the ring");
            let fresh: Vec<f32> = k.read_unstaged(&buf, n).unwrap();
            assert_eq!(
                fresh, want,
                "{n} words, round {round}: read through fresh staging"
            );
            // Into a slice the caller owns, shorter than the buffer.
            let mut part = vec![0.0f32; n / 2];
            k.read_into(&buf, &mut part).unwrap();
            assert_eq!(part, want[..n / 2], "{n} words, round {round}: read_into");
        }
        let created = k.counters().staging_buffers;
        assert!(
            created <= 2 * SLOTS as u64,
            "at most the two rings: {created} staging buffers"
        );
        if round == 0 {
            after_first = Some(created);
        }
    }
    assert_eq!(
        Some(k.counters().staging_buffers),
        after_first,
        "no staging buffer is created after the first round"
    );
}

#[test]
fn writes_through_the_ring_are_seen_by_later_kernels() {
    let Some(k) = kernels() else { return };
    // Larger than the ring: the first chunks' slots are reused before the kernel runs.
    let n = 5 * CHUNK as usize / 4 + 3;
    let (a, b) = (data(n, 1), data(n, 2));
    let (ga, gb, out) = (
        k.zeros(n).unwrap(),
        k.zeros(n).unwrap(),
        k.zeros(n).unwrap(),
    );
    k.write(&ga, &a).unwrap();
    k.write(&gb, &b).unwrap();
    k.reduce(&[&ga, &gb], &out, n, 0.5).unwrap();
    let got: Vec<f32> = k.read(&out, n).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| (x + y) * 0.5).collect();
    assert_eq!(got, want);
}

#[test]
fn misaligned_or_oversized_transfers_are_errors() {
    let Some(k) = kernels() else { return };
    let buf = k.zeros(4).unwrap();
    let e = k.write(&buf, &[1u16, 2, 3]).unwrap_err().to_string();
    assert!(e.contains("4-byte words"), "{e}");
    let e = k.write(&buf, &[0.0f32; 9]).unwrap_err().to_string();
    assert!(e.contains("9 needed"), "{e}");
    let mut odd = [0u16; 3];
    let e = k.read_into(&buf, &mut odd).unwrap_err().to_string();
    assert!(e.contains("4-byte words"), "{e}");
    let mut big = [0.0f32; 9];
    assert!(k.read_into(&buf, &mut big).is_err());
    // The rings still work after refused calls.
    k.write(&buf, &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    assert_eq!(k.read::<f32>(&buf, 4).unwrap(), [1.0, 2.0, 3.0, 4.0]);
}
