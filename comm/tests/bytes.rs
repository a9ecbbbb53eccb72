//! Per-call options and the bytes collectives over real QUIC between nodes and shared buffers
//! inside them (2 nodes x 2 ranks): a call's wire dtype applies to that call only and is
//! recorded with its tag; bytes payloads of different lengths (empty too) arrive exactly, in
//! rank order, even on a group whose wire dtype is bf16 or int8, which would round f32 carriers.

mod common;

use wiretrain_comm::{CallOpts, ReduceOp, WireDtype};

/// A value bf16 cannot hold (8 mantissa bits): 1 + 2^-12.
const FINE: f32 = 1.0 + 1.0 / 4096.0;

#[test]
fn a_calls_wire_dtype_applies_to_that_call_only() {
    let res = common::cluster(&[2, 2], "opts-token", |mut pg| {
        pg.keep_history(true);
        let narrow = pg
            .call(CallOpts::wire(WireDtype::Bf16).tag("narrow"))
            .all_reduce(vec![FINE; 64], ReduceOp::Mean)
            .wait()
            .map_err(|e| e.to_string())?;
        let exact = pg
            .all_reduce(vec![FINE; 64], ReduceOp::Mean)
            .wait()
            .map_err(|e| e.to_string())?;
        let hist: Vec<_> = pg
            .take_history()
            .into_iter()
            .map(|e| (e.wire, e.tag))
            .collect();
        Ok::<_, String>((narrow, exact, pg.wire_dtype(), hist))
    });
    for node in res {
        for r in node.expect("node") {
            let (narrow, exact, wire, hist) = r.expect("rank");
            // Rounded between the nodes in bf16 (1 + 2^-12 is not a bf16), then exact again.
            assert!(
                narrow.iter().all(|&x| x != FINE && (x - FINE).abs() < 1e-2),
                "{:?}",
                &narrow[..4]
            );
            assert!(exact.iter().all(|&x| x == FINE), "{:?}", &exact[..4]);
            assert_eq!(wire, WireDtype::F32, "the group's default is untouched");
            assert_eq!(hist, [("bf16", Some("narrow")), ("f32", None)]);
        }
    }
}

fn payload(rank: usize) -> Vec<u8> {
    (0..rank * 37).map(|i| (i * 31 + rank * 7) as u8).collect()
}

#[test]
fn bytes_arrive_exactly_in_rank_order_whatever_the_wire_dtype() {
    let res = common::cluster(&[2, 2], "bytes-token", |mut pg| {
        pg.set_wire_dtype(WireDtype::Bf16);
        let all = pg
            .all_gather_bytes(&payload(pg.rank()))
            .map_err(|e| e.to_string())?;
        pg.set_wire_dtype(WireDtype::Int8);
        let root = pg
            .broadcast_bytes(&payload(pg.rank()), 3)
            .map_err(|e| e.to_string())?;
        // The group's own dtype is left as it was.
        Ok::<_, String>((all, root, pg.wire_dtype()))
    });
    for node in res {
        for r in node.expect("node") {
            let (all, root, wire) = r.expect("rank");
            assert_eq!(all, (0..4).map(payload).collect::<Vec<_>>());
            assert_eq!(root, payload(3));
            assert_eq!(wire, WireDtype::Int8);
        }
    }
}

/// A length as the bytes collectives announce it: a u64 in four f32 carriers of 16 bits.
fn announce(len: u64) -> Vec<f32> {
    len.to_le_bytes()
        .chunks(2)
        .map(|c| f32::from(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

/// What each rank saw of one bytes collective: `None` on the rank that lied.
type Seen = Option<Result<(), String>>;

#[test]
fn a_peer_announcing_2_pow_64_minus_1_bytes_fails_the_call_naming_it() {
    let res = common::cluster(&[2, 2], "huge-token", |mut pg| {
        let exact = CallOpts::wire(WireDtype::F32).tag("bytes");
        let world = pg.world();
        // Rank 1 announces 2^64 - 1 bytes to an all-gather, rank 2 to a broadcast it roots.
        let gathered: Seen = if pg.rank() == 1 {
            let lie = announce(u64::MAX);
            let _ = pg.call(exact).all_gather(lie, 4 * world).wait();
            None
        } else {
            Some(
                pg.all_gather_bytes(b"fine")
                    .map(drop)
                    .map_err(|e| e.to_string()),
            )
        };
        let broadcast: Seen = if pg.rank() == 2 {
            let _ = pg.broadcast(announce(u64::MAX), 2).wait();
            None
        } else {
            Some(
                pg.broadcast_bytes(b"", 2)
                    .map(drop)
                    .map_err(|e| e.to_string()),
            )
        };
        // Within a caller's limit: a rank sending more fails the call on every rank.
        let limited = pg.all_gather_bytes_within(&payload(pg.rank()), 100);
        // The group still works after each refusal.
        let after = pg.all_gather_bytes(&[pg.rank() as u8]);
        (
            gathered,
            broadcast,
            limited.map_err(|e| e.to_string()),
            after.ok(),
        )
    });
    for node in res {
        for (gathered, broadcast, limited, after) in node.expect("node") {
            for (seen, liar) in [(gathered, 1), (broadcast, 2)] {
                if let Some(r) = seen {
                    let e = r.expect_err("a length of 2^64 - 1 is refused");
                    assert!(
                        e.contains(&format!("rank {liar} broke the protocol"))
                            && e.contains("18446744073709551615"),
                        "{e}"
                    );
                }
            }
            // payload(3) is 111 bytes, above the limit of 100.
            let e = limited.expect_err("over the caller's limit");
            assert!(e.contains("rank 3 broke the protocol"), "{e}");
            assert_eq!(after, Some(vec![vec![0], vec![1], vec![2], vec![3]]));
        }
    }
}
