//! Property tests of every decoder of network bytes (`untrusted::decode_untrusted`, also the
//! `cargo fuzz` target in comm/fuzz/): arbitrary and mutated-valid input never panics, and no
//! single allocation while decoding exceeds the configured maximum (`MAX_CONTROL_LEN`); valid
//! messages still decode. The fuzz regression corpus (comm/fuzz/corpus/untrusted/) is replayed.

use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use wiretrain_comm::rendezvous::Control;
use wiretrain_comm::untrusted::decode_untrusted;
use wiretrain_comm::wire::{FrameHeader, MAX_CONTROL_LEN, StreamHeader, WireDtype, encode_control};

/// Records the largest allocation made on this thread while `TRACK` is on.
struct Tracking;

thread_local! {
    static TRACK: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = TRACK.try_with(|t| {
            if t.get() {
                let _ = LARGEST.try_with(|m| m.set(m.get().max(l.size())));
            }
        });
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let _ = TRACK.try_with(|t| {
            if t.get() {
                let _ = LARGEST.try_with(|m| m.set(m.get().max(new)));
            }
        });
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Tracking = Tracking;

/// Decodes `data` and returns the largest single allocation made meanwhile.
fn largest_alloc(data: &[u8]) -> usize {
    LARGEST.with(|m| m.set(0));
    TRACK.with(|t| t.set(true));
    let _ = decode_untrusted(data);
    TRACK.with(|t| t.set(false));
    LARGEST.with(|m| m.get())
}

fn valid_messages() -> Vec<Vec<u8>> {
    let mut v = vec![
        FrameHeader {
            op: 1,
            dtype: WireDtype::F32,
            seq: 7,
            step: 2,
            chunk: 0,
            len: 4096,
        }
        .encode()
        .to_vec(),
        StreamHeader {
            lane: 1,
            from_node: 3,
        }
        .encode()
        .to_vec(),
    ];
    for c in [
        Control::Hello {
            version: 1,
            node_rank: Some(1),
            nnodes: 2,
            listen_ip: None,
            listen_port: 4000,
            devices: vec!["cpu".into()],
        },
        Control::Refused { reason: "x".into() },
        Control::PeerHello {
            version: 1,
            node: 1,
        },
        Control::Goodbye,
    ] {
        v.push(encode_control(&c));
    }
    v
}

#[test]
fn valid_messages_decode() {
    let v = valid_messages();
    assert!(decode_untrusted(&v[0]).frame);
    assert!(decode_untrusted(&v[1]).stream);
    for m in &v[2..] {
        assert!(
            decode_untrusted(m).control,
            "{}",
            String::from_utf8_lossy(m)
        );
    }
}

#[test]
fn the_fuzz_corpus_replays_without_panic_or_large_allocation() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/untrusted");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).expect("the corpus directory") {
        let data = std::fs::read(e.unwrap().path()).unwrap();
        assert!(largest_alloc(&data) <= MAX_CONTROL_LEN);
        n += 1;
    }
    assert!(n >= 8, "corpus has {n} entries");
}

#[test]
fn a_huge_length_prefix_allocates_nothing_big() {
    let mut m = u32::MAX.to_le_bytes().to_vec();
    m.extend_from_slice(b"{\"Goodbye\":null}");
    assert!(!decode_untrusted(&m).control);
    assert!(largest_alloc(&m) < 1024);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic_or_overallocate(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        prop_assert!(largest_alloc(&data) <= MAX_CONTROL_LEN);
    }

    #[test]
    fn mutated_valid_messages_never_panic(which in 0usize..6, flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8), cut in any::<usize>()) {
        let mut m = valid_messages()[which].clone();
        for (at, x) in flips {
            let i = at % m.len();
            m[i] ^= x;
        }
        let keep = cut % (m.len() + 1);
        m.truncate(keep);
        prop_assert!(largest_alloc(&m) <= MAX_CONTROL_LEN);
    }

    #[test]
    fn frame_headers_round_trip(op in 1u8..=8, seq: u64, step: u32, chunk: u32, len in 0u32..=(8 << 20)) {
        let h = FrameHeader { op, dtype: WireDtype::F32, seq, step, chunk, len };
        prop_assert_eq!(FrameHeader::decode(&h.encode(), 8).unwrap(), h);
    }
}
