//! Property tests of every decoder of network bytes (`untrusted::decode_untrusted`, also the
//! `cargo fuzz` target in comm/fuzz/): arbitrary and mutated-valid input never panics, and no
//! single allocation while decoding exceeds the configured maximum (`MAX_CONTROL_LEN`); valid
//! messages still decode. The fuzz regression corpus (comm/fuzz/corpus/untrusted/) is replayed.
//! Rendezvous' checks of a joiner's `Hello` and the coordinator's `Welcome` run on every decoded
//! control message, and on arbitrary structured ones below: each refusal is named, and what
//! passes keeps the promises the rest of rendezvous relies on.

use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use wiretrain_comm::rendezvous::Control;
use wiretrain_comm::rendezvous::validate::{BadWelcome, Expect, check_hello, check_welcome};
use wiretrain_comm::topology::{NodeInfo, RankTable};
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
            group: 0,
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
            nnodes: 3,
            listen_ip: None,
            listen_port: 4000,
            devices: vec!["cpu".into()],
            channels: 1,
            epoch: 0,
        },
        Control::Refused { reason: "x".into() },
        Control::PeerHello {
            version: 1,
            node: 1,
        },
        Control::Goodbye,
        Control::Welcome {
            node: 1,
            table: table(&[("aa", 2), ("bb", 1), ("cc", 1)]),
        },
    ] {
        v.push(encode_control(&c));
    }
    v
}

/// A rank table of nodes (fingerprint, ranks).
fn table(rows: &[(&str, usize)]) -> RankTable {
    RankTable::new(
        rows.iter()
            .enumerate()
            .map(|(node, (fp, ranks))| NodeInfo {
                node,
                addr: format!("127.0.0.{}:4000", node + 1).parse().unwrap(),
                devices: vec!["cpu".into(); *ranks],
                cert_sha256: fp.to_string(),
            })
            .collect(),
    )
    .unwrap()
}

fn hello(version: u32, node_rank: Option<usize>, nnodes: usize, ranks: usize) -> Control {
    Control::Hello {
        version,
        node_rank,
        nnodes,
        listen_ip: None,
        listen_port: 4000,
        devices: vec!["cpu".into(); ranks],
        channels: 1,
        epoch: 0,
    }
}

#[test]
fn every_hello_refusal_is_named() {
    let taken = |r: usize| r == 2;
    for (h, needle) in [
        (hello(2, Some(1), 3, 1), "protocol version mismatch"),
        (hello(1, Some(1), 4, 1), "node count mismatch"),
        (hello(1, Some(3), 3, 1), "not below the node count"),
        (hello(1, Some(0), 3, 1), "the coordinator itself"),
        (hello(1, Some(2), 3, 1), "already joined"),
        (hello(1, None, 3, 0), "1..=1024 ranks, not 0"),
        (hello(1, None, 3, 1025), "not 1025"),
        (Control::Goodbye, "expected a Hello"),
    ] {
        let e = check_hello(&h, 1, 3, taken).unwrap_err();
        assert!(e.contains(needle), "{h:?}: {e}");
    }
    assert!(check_hello(&hello(1, Some(1), 3, 4), 1, 3, taken).is_ok());
    assert!(check_hello(&hello(1, None, 3, 1024), 1, 3, taken).is_ok());
}

#[test]
fn every_welcome_refusal_is_named() {
    let t = table(&[("aa", 1), ("bb", 2), ("cc", 1)]);
    let want = |nnodes, ranks, coord, own| Expect {
        nnodes,
        ranks,
        coordinator_sha256: coord,
        own_sha256: own,
    };
    let inconsistent = |e: BadWelcome| matches!(e, BadWelcome::Inconsistent(_));
    assert!(check_welcome(1, &t, &want(3, 2, "aa", "bb")).is_ok());
    // Told another node count, node 0 (the coordinator's own index), an index past the
    // table, another rank count than asked for.
    assert!(inconsistent(
        check_welcome(1, &t, &want(4, 2, "aa", "bb")).unwrap_err()
    ));
    assert!(inconsistent(
        check_welcome(0, &t, &want(3, 1, "aa", "aa")).unwrap_err()
    ));
    assert!(inconsistent(
        check_welcome(3, &t, &want(3, 1, "aa", "")).unwrap_err()
    ));
    assert!(inconsistent(
        check_welcome(1, &t, &want(3, 1, "aa", "bb")).unwrap_err()
    ));
    // The coordinator presented another certificate than node 0's row.
    assert_eq!(
        check_welcome(1, &t, &want(3, 2, "zz", "bb")).unwrap_err(),
        BadWelcome::CoordinatorCert {
            expected: "aa".into()
        }
    );
    // The table names another certificate for this node.
    assert_eq!(
        check_welcome(1, &t, &want(3, 2, "aa", "cc")).unwrap_err(),
        BadWelcome::OwnCert
    );
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
    // The hello and the welcome pass rendezvous' checks (a coordinator of 3 nodes, "aa").
    assert!(decode_untrusted(&v[2]).accepted);
    assert!(decode_untrusted(v.last().unwrap()).accepted);
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
    fn mutated_valid_messages_never_panic(which in 0usize..7, flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8), cut in any::<usize>()) {
        let mut m = valid_messages()[which].clone();
        for (at, x) in flips {
            let i = at % m.len();
            m[i] ^= x;
        }
        let keep = cut % (m.len() + 1);
        m.truncate(keep);
        prop_assert!(largest_alloc(&m) <= MAX_CONTROL_LEN);
    }

    /// Any decoded table (validated on decoding) and any claims: the welcome check never
    /// panics, and what it accepts fits the joiner: its node count, an index in 1..n hosting
    /// the ranks it asked for, node 0 the coordinator it met, its own certificate in its row.
    #[test]
    fn welcome_checks_hold_on_arbitrary_tables(
        rows in proptest::collection::vec((0usize..3, 1usize..4), 1..6),
        node in 0usize..8,
        nnodes in 1usize..7,
        ranks in 0usize..5,
        coord in 0usize..3,
        own in 0usize..3,
    ) {
        let fps = ["aa", "bb", ""];
        let t = table(&rows.iter().map(|&(f, r)| (fps[f], r)).collect::<Vec<_>>());
        let want = Expect { nnodes, ranks, coordinator_sha256: fps[coord], own_sha256: fps[own] };
        if check_welcome(node, &t, &want).is_ok() {
            prop_assert_eq!(t.num_nodes(), nnodes);
            prop_assert!(node >= 1 && node < nnodes);
            prop_assert_eq!(t.ranks_on(node), ranks);
            prop_assert_eq!(&t.nodes()[0].cert_sha256, fps[coord]);
            prop_assert_eq!(&t.nodes()[node].cert_sha256, fps[own]);
        }
    }

    /// Any hello: accepted only with the coordinator's version and node count, a free node
    /// rank in 1..n (or none) and 1..=1024 ranks.
    #[test]
    fn hello_checks_hold_on_arbitrary_hellos(
        version in 0u32..3,
        node_rank in proptest::option::of(0usize..6),
        nnodes in 1usize..6,
        ranks in 0usize..1100,
    ) {
        let h = hello(version, node_rank, nnodes, ranks);
        if let Ok(a) = check_hello(&h, 1, 4, |r| r == 2) {
            prop_assert_eq!(version, 1);
            prop_assert_eq!(nnodes, 4);
            prop_assert!(matches!(a.node_rank, None | Some(1) | Some(3)));
            prop_assert!((1..=1024).contains(&a.devices.len()));
        }
    }

    #[test]
    fn frame_headers_round_trip(op in 1u8..=6, group in 0u8..=2, seq: u64, step: u32, chunk: u32, len in 0u32..=(8 << 20)) {
        let h = FrameHeader { op, group, dtype: WireDtype::F32, seq, step, chunk, len };
        prop_assert_eq!(FrameHeader::decode(&h.encode(), 6).unwrap(), h);
    }
}
