//! The bytes collectives over real QUIC between nodes and shared buffers inside them (2 nodes
//! x 2 ranks): payloads of different lengths (empty too) arrive exactly, in rank order, even
//! on a group whose wire dtype is bf16 or int8, which would round f32 carriers.

mod common;

use wiretrain_comm::WireDtype;

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
