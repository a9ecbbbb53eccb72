//! Collectives across nodes joined in one test process (real QUIC sockets on loopback, real
//! shared buffers): fast coverage of every op and shape. The multi-process tests in the
//! top-level tests/ run the same checks between real processes.

mod common;

use common::cluster;
use wiretrain_comm::bench::{BenchOp, BenchSpec, run_rank};
use wiretrain_comm::{ReduceOp, WireDtype};

fn check_shape(shape: &[usize], sizes: &[usize], iters: usize) {
    check_shape_wire(shape, sizes, iters, WireDtype::F32);
}

fn check_shape_wire(shape: &[usize], sizes: &[usize], iters: usize, wire: WireDtype) {
    let spec = BenchSpec {
        ops: vec![
            BenchOp::AllReduce,
            BenchOp::ReduceScatter,
            BenchOp::AllGather,
            BenchOp::Broadcast,
        ],
        sizes: sizes.to_vec(),
        iters,
        warmup: 0,
        check: true,
        reduce: ReduceOp::Sum,
        wire,
    };
    for reduce in [ReduceOp::Sum, ReduceOp::Mean] {
        let mut spec = spec.clone();
        spec.reduce = reduce;
        let res = cluster(shape, "test-token", move |mut pg| {
            run_rank(&mut pg, &spec, |_| {}).map_err(|e| e.to_string())
        });
        for node in res {
            for rank in node.expect("node failed") {
                let rows = rank.expect("rank failed");
                assert_eq!(rows.len(), 4 * sizes.len());
                for r in rows {
                    assert_eq!(
                        r.wrong, 0,
                        "{shape:?} {reduce:?} {wire} {} {} bytes",
                        r.op, r.bytes
                    );
                }
            }
        }
    }
}

/// Narrow wire dtypes over real QUIC: f16/bf16 exact on these integer inputs, int8 within its
/// error bound, and every rank bit-identical (the bench's check counts both); frames of
/// several chunks (1M+3 elements) and odd lengths.
#[test]
fn narrow_wire_dtypes() {
    for wire in [WireDtype::F16, WireDtype::Bf16, WireDtype::Int8] {
        check_shape_wire(&[2, 2], &[0, 4, 28, 4_000_012], 3, wire);
        check_shape_wire(&[3, 1], &[28, 4_000_012], 2, wire);
    }
}

/// Bytes on the wire per all-reduce call: bf16 half of f32, int8 about a quarter (scales
/// included), measured on the QUIC lane counters.
#[test]
fn narrow_wire_bytes() {
    let bytes = 16 << 20;
    let mut sent = Vec::new();
    for wire in [WireDtype::F32, WireDtype::Bf16, WireDtype::Int8] {
        let spec = BenchSpec {
            ops: vec![BenchOp::AllReduce],
            sizes: vec![bytes],
            iters: 2,
            warmup: 0,
            check: true,
            reduce: ReduceOp::Sum,
            wire,
        };
        let res = cluster(&[2, 1], "test-token", move |mut pg| {
            run_rank(&mut pg, &spec, |_| {}).map_err(|e| e.to_string())
        });
        let row = res[0].as_ref().expect("node")[0].as_ref().expect("rank")[0].clone();
        assert_eq!(row.wrong, 0, "{wire}");
        sent.push(row.wire_bytes as f64);
    }
    let (f32b, bf16, int8) = (sent[0], sent[1], sent[2]);
    // 2 nodes: each sends 2 * (1/2) of the buffer.
    assert!((f32b / bytes as f64 - 1.0).abs() < 0.01, "{sent:?}");
    assert!((bf16 / f32b - 0.5).abs() < 0.01, "{sent:?}");
    assert!(
        (int8 / f32b - (0.25 + 1.0 / 128.0)).abs() < 0.01,
        "{sent:?}"
    );
}

#[test]
fn single_node_four_ranks() {
    check_shape(&[4], &[0, 4, 28, 4 * 1_000_003], 3);
}

#[test]
fn two_nodes_two_ranks() {
    check_shape(&[2, 2], &[0, 4, 28, 4 * 100_003], 3);
}

#[test]
fn uneven_nodes() {
    check_shape(&[1, 3, 2], &[0, 4, 28, 4000], 3);
}

#[test]
fn many_back_to_back_mixed_collectives() {
    let res = cluster(&[2, 1], "tok", |mut pg| -> Result<(), String> {
        let world = pg.world() as f32;
        for i in 0..1000usize {
            let len = [1usize, 7, 64, 1000, 3][i % 5];
            let w = pg.all_reduce(vec![pg.rank() as f32 + i as f32; len], ReduceOp::Sum);
            let out = w.wait().map_err(|e| e.to_string())?;
            let want = (0..pg.world()).map(|r| r as f32 + i as f32).sum::<f32>();
            if out.iter().any(|&x| x != want) {
                return Err(format!("iteration {i}: got {:?} want {want}", &out[..1]));
            }
            if i % 100 == 0 {
                let g = pg.all_gather(vec![i as f32; pg.shard_range(pg.world()).len()], pg.world());
                let g = g.wait().map_err(|e| e.to_string())?;
                assert_eq!(g.len(), world as usize);
            }
        }
        Ok(())
    });
    for n in res {
        for r in n.unwrap() {
            r.unwrap();
        }
    }
}

#[test]
fn overlapping_submissions_complete_in_order() {
    let res = cluster(&[2, 2], "tok", |mut pg| -> Result<(), String> {
        let works: Vec<_> = (0..20)
            .map(|i| pg.all_reduce(vec![i as f32; 5000], ReduceOp::Mean))
            .collect();
        for (i, w) in works.into_iter().enumerate() {
            let v = w.wait().map_err(|e| e.to_string())?;
            if v.iter().any(|&x| x != i as f32) {
                return Err(format!("op {i} mixed"));
            }
        }
        Ok(())
    });
    for n in res {
        for r in n.unwrap() {
            r.unwrap();
        }
    }
}

#[test]
fn invalid_calls_are_errors_not_panics() {
    let res = cluster(&[2], "tok", |mut pg| {
        let e1 = pg.broadcast(vec![1.0], 5).wait().unwrap_err().to_string();
        let e2 = pg
            .all_gather(vec![1.0, 2.0], 1)
            .wait()
            .unwrap_err()
            .to_string();
        // Rejected calls take no sequence number: the group keeps working.
        let ok = pg.all_reduce(vec![1.0; 3], ReduceOp::Sum).wait().unwrap();
        assert_eq!(ok, vec![2.0; 3]);
        (e1, e2)
    });
    let (e1, e2) = &res.into_iter().next().unwrap().unwrap()[0];
    assert!(e1.contains("root 5"), "{e1}");
    assert!(e2.contains("shard has 2 elements"), "{e2}");
}

/// Hybrid sharding's two collectives: after `hybrid_reduce_in_place` every rank holds the sum
/// over all ranks on its node pieces; the node pieces of one node's ranks partition the buffer
/// and are the same positions on every node; `node_gather_in_place` completes the buffer from
/// the node's own ranks.
#[test]
fn hybrid_reduce_and_node_gather() {
    for shape in [vec![2usize, 2], vec![3], vec![1, 1], vec![2, 3]] {
        let res = cluster(
            &shape,
            "tok",
            |mut pg| -> Result<Vec<std::ops::Range<usize>>, String> {
                let len = 1003;
                let world = pg.world();
                let input: Vec<f32> = (0..len).map(|i| (pg.rank() * 7 + i % 13) as f32).collect();
                let want: Vec<f32> = (0..len)
                    .map(|i| (0..world).map(|r| (r * 7 + i % 13) as f32).sum())
                    .collect();
                let pieces = pg.node_pieces(len);
                let out = pg
                    .hybrid_reduce_in_place(input, ReduceOp::Sum)
                    .wait()
                    .map_err(|e| e.to_string())?;
                for r in &pieces {
                    if out[r.clone()] != want[r.clone()] {
                        return Err(format!("rank {} piece {r:?} not reduced", pg.rank()));
                    }
                }
                // Each rank writes rank-tagged values on its pieces; the node gather fills the rest.
                let mut buf = vec![f32::NAN; len];
                for r in &pieces {
                    for i in r.clone() {
                        buf[i] = want[i] + 0.5;
                    }
                }
                let full = pg
                    .node_gather_in_place(buf)
                    .wait()
                    .map_err(|e| e.to_string())?;
                // A rank beyond the smallest node's count owns nothing but still gets everything.
                if full.iter().zip(&want).any(|(a, b)| *a != b + 0.5) {
                    return Err(format!("rank {} gathered a wrong buffer", pg.rank()));
                }
                Ok(pieces)
            },
        );
        let nodes: Vec<Vec<Vec<std::ops::Range<usize>>>> = res
            .into_iter()
            .map(|n| n.unwrap().into_iter().map(|r| r.unwrap()).collect())
            .collect();
        // Same positions on every node; a node's pieces cover the buffer exactly once.
        let lanes = *shape.iter().min().unwrap();
        for node in &nodes {
            let mut cover = vec![0u32; 1003];
            for (l, p) in node.iter().enumerate() {
                if l < lanes {
                    assert_eq!(p, &nodes[0][l], "{shape:?}: lane {l} differs between nodes");
                }
                for r in p {
                    r.clone().for_each(|i| cover[i] += 1);
                }
                assert_eq!(p.is_empty(), l >= lanes, "{shape:?}: lane {l}");
            }
            assert!(
                cover.iter().all(|&c| c == 1),
                "{shape:?}: pieces partition the buffer"
            );
        }
    }
}

/// `node_all_reduce` and `node_reduce_scatter_in_place`: each node's ranks reduce among
/// themselves over shared memory, uneven node sizes included, and not one byte crosses nodes.
#[test]
fn node_all_reduce_stays_inside_the_node() {
    for shape in [vec![2, 2], vec![3, 1], vec![1, 3]] {
        let res = cluster(&shape, "test-token", move |mut pg| {
            let before = pg.bytes_sent();
            let r = pg.rank() as f32;
            let len = 1001;
            let sum = pg
                .node_all_reduce(vec![r; len], ReduceOp::Sum)
                .wait()
                .map_err(|e| e.to_string())?;
            let mean = pg
                .node_all_reduce(vec![r; len], ReduceOp::Mean)
                .wait()
                .map_err(|e| e.to_string())?;
            // Element i of rank r is r + i % 7: the node mean on this rank's pieces.
            let vals: Vec<f32> = (0..len).map(|i| r + (i % 7) as f32).collect();
            let rs = pg
                .node_reduce_scatter_in_place(vals, ReduceOp::Mean)
                .wait()
                .map_err(|e| e.to_string())?;
            let pieces: Vec<(usize, f32)> = pg
                .node_pieces(len)
                .into_iter()
                .flatten()
                .map(|i| (i, rs[i]))
                .collect();
            Ok::<_, String>((pg.node(), sum, mean, pieces, pg.bytes_sent() - before))
        });
        for (n, node) in res.into_iter().enumerate() {
            let ranks = node.expect("node");
            let first: usize = shape[..n].iter().sum();
            let want: f32 = (first..first + shape[n]).map(|r| r as f32).sum();
            let mut covered = 0;
            for r in ranks {
                let (node, sum, mean, pieces, sent) = r.expect("rank");
                assert_eq!(node, n);
                assert!(sum.iter().all(|&x| x == want), "{shape:?} node {n}");
                let m = want / shape[n] as f32;
                assert!(mean.iter().all(|&x| x == m), "{shape:?} node {n} mean");
                for (i, x) in &pieces {
                    let w = (want + (shape[n] * (i % 7)) as f32) / shape[n] as f32;
                    assert_eq!(*x, w, "{shape:?} node {n} reduce-scatter element {i}");
                }
                covered += pieces.len();
                assert_eq!(sent, 0, "{shape:?}: bytes crossed nodes");
            }
            assert_eq!(covered, 1001, "{shape:?} node {n}: pieces cover the buffer");
        }
    }
}
