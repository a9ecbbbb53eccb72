//! Collectives across nodes joined in one test process (real QUIC sockets on loopback, real
//! shared buffers): fast coverage of every op and shape. The multi-process tests in the
//! top-level tests/ run the same checks between real processes.

mod common;

use common::{cluster, cluster_tuned};
use wiretrain_comm::bench::{BenchOp, BenchSpec, run_rank};
use wiretrain_comm::{CallOpts, Group, ReduceOp, WireDtype};

fn check_shape(shape: &[usize], sizes: &[usize], iters: usize) {
    check_shape_wire(shape, sizes, iters, WireDtype::F32);
}

fn check_shape_wire(shape: &[usize], sizes: &[usize], iters: usize, wire: WireDtype) {
    check_shape_channels(shape, sizes, iters, wire, 1);
}

fn check_shape_channels(
    shape: &[usize],
    sizes: &[usize],
    iters: usize,
    wire: WireDtype,
    channels: usize,
) {
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
        let tune = move |c: &mut wiretrain_comm::NodeConfig| {
            c.quic().channels(channels).unwrap();
        };
        let res = cluster_tuned(shape, "test-token", tune, move |mut pg| {
            run_rank(&mut pg, &spec, |_| {}).map_err(|e| e.to_string())
        });
        for node in res {
            for rank in node.expect("node failed").0 {
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

/// A lane split over several QUIC connections (channels): every collective exact (f32) or
/// within its bound (int8) and bit-identical on every rank, for lengths that leave some
/// channels an empty slice (4 elements over 3 channels), frames of several chunks, and more
/// channels than nodes.
#[test]
fn channels_split_every_collective() {
    check_shape_channels(&[2, 2], &[0, 4, 28, 4_000_012], 2, WireDtype::F32, 3);
    check_shape_channels(&[2, 1, 2], &[4, 4_000_012], 2, WireDtype::Int8, 2);
    check_shape_channels(&[3, 1], &[28, 4_000_012], 2, WireDtype::Bf16, 4);
}

/// With 3 channels, each of a pair's lane connections carries a third of an all-reduce's
/// datagrams, and the control connection next to none.
#[test]
fn channels_each_carry_their_share() {
    let spec = BenchSpec {
        ops: vec![BenchOp::AllReduce],
        sizes: vec![24 << 20],
        iters: 2,
        warmup: 0,
        check: true,
        reduce: ReduceOp::Sum,
        wire: WireDtype::F32,
    };
    let res = common::cluster_each(
        &[2, 1],
        "test-token",
        |c| {
            c.quic().channels(3).unwrap();
        },
        move |mut pg| run_rank(&mut pg, &spec, |_| {}).map_err(|e| e.to_string()),
    );
    for node in res {
        let (out, conns) = node.expect("node failed");
        assert_eq!(out[0].as_ref().expect("rank")[0].wrong, 0);
        assert_eq!(conns.len(), 4, "control + 3 lane connections: {conns:?}");
        let total: u64 = conns.iter().map(|c| c.udp_tx_datagrams).sum();
        for c in &conns[1..] {
            let share = c.udp_tx_datagrams as f64 / total as f64;
            assert!((0.25..0.42).contains(&share), "{share} of {conns:?}");
        }
        assert!(conns[0].udp_tx_datagrams * 50 < total, "{conns:?}");
    }
}

/// Nodes that disagree on the channel count are refused at rendezvous, with what to change.
#[test]
fn channel_mismatch_is_refused() {
    let res = cluster_tuned(
        &[1, 1],
        "test-token",
        |c| {
            let k = if c.node_rank() == Some(0) { 2 } else { 1 };
            c.quic().channels(k).unwrap();
            c.rendezvous_timeout(std::time::Duration::from_secs(3));
        },
        |_| (),
    );
    let err = res[1].as_ref().expect_err("node 1 is refused").to_string();
    assert!(
        err.contains("channel count mismatch") && err.contains("--channels"),
        "{err}"
    );
}

/// A node of an earlier job epoch (a stale process after an elastic restart) is refused at
/// rendezvous with a message that says so.
#[test]
fn stale_epoch_is_refused() {
    let res = cluster_tuned(
        &[1, 1],
        "test-token",
        |c| {
            let e = if c.node_rank() == Some(0) { 2 } else { 1 };
            c.epoch(e)
                .rendezvous_timeout(std::time::Duration::from_secs(3));
        },
        |_| (),
    );
    let err = res[1].as_ref().expect_err("node 1 is refused").to_string();
    assert!(
        err.contains("epoch mismatch") && err.contains("epoch 1") && err.contains("stale"),
        "{err}"
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

/// Hybrid sharding on the node × lane mesh: after `hybrid_reduce_in_place` (a node-group
/// reduce-scatter, then a replica-group all-reduce of the shard) every rank holds the sum over
/// all ranks on its node shard; the node shards of one node's ranks partition the buffer and
/// are the same positions on every node; a node-group all-gather completes the buffer from
/// the node's own ranks.
#[test]
fn hybrid_reduce_and_node_gather() {
    for shape in [vec![2usize, 2], vec![3], vec![1, 1], vec![2, 3]] {
        let res = cluster(
            &shape,
            "tok",
            |mut pg| -> Result<std::ops::Range<usize>, String> {
                let len = 1003;
                let world = pg.world();
                let input: Vec<f32> = (0..len).map(|i| (pg.rank() * 7 + i % 13) as f32).collect();
                let want: Vec<f32> = (0..len)
                    .map(|i| (0..world).map(|r| (r * 7 + i % 13) as f32).sum())
                    .collect();
                let shard = pg.group_shard(Group::Node, len);
                let out = pg
                    .call(CallOpts::default())
                    .hybrid_reduce_in_place(input, ReduceOp::Sum)
                    .wait()
                    .map_err(|e| e.to_string())?;
                if out[shard.clone()] != want[shard.clone()] {
                    return Err(format!("rank {} shard {shard:?} not reduced", pg.rank()));
                }
                // Each rank writes its values on its shard; the node gather fills the rest.
                let mut buf = vec![f32::NAN; len];
                for i in shard.clone() {
                    buf[i] = want[i] + 0.5;
                }
                let before = pg.bytes_sent();
                let full = pg
                    .call(CallOpts::default().on(Group::Node))
                    .all_gather_in_place(buf)
                    .wait()
                    .map_err(|e| e.to_string())?;
                // A rank beyond the smallest node's count owns nothing but still gets everything.
                if full.iter().zip(&want).any(|(a, b)| *a != b + 0.5) {
                    return Err(format!("rank {} gathered a wrong buffer", pg.rank()));
                }
                if pg.bytes_sent() != before {
                    return Err("the node gather sent bytes to other nodes".into());
                }
                Ok(shard)
            },
        );
        let nodes: Vec<Vec<std::ops::Range<usize>>> = res
            .into_iter()
            .map(|n| n.unwrap().into_iter().map(|r| r.unwrap()).collect())
            .collect();
        // Same positions on every node; a node's shards cover the buffer exactly once.
        let lanes = *shape.iter().min().unwrap();
        for node in &nodes {
            let mut cover = vec![0u32; 1003];
            for (l, p) in node.iter().enumerate() {
                if l < lanes {
                    assert_eq!(p, &nodes[0][l], "{shape:?}: lane {l} differs between nodes");
                }
                p.clone().for_each(|i| cover[i] += 1);
                assert_eq!(p.is_empty(), l >= lanes, "{shape:?}: lane {l}");
            }
            assert!(
                cover.iter().all(|&c| c == 1),
                "{shape:?}: shards partition the buffer"
            );
        }
    }
}

/// The node group: each node's ranks reduce among themselves over shared memory, uneven node
/// sizes included, and not one byte crosses nodes.
#[test]
fn node_all_reduce_stays_inside_the_node() {
    for shape in [vec![2, 2], vec![3, 1], vec![1, 3]] {
        let res = cluster(&shape, "test-token", move |mut pg| {
            let before = pg.bytes_sent();
            let r = pg.rank() as f32;
            let len = 1001;
            let node = CallOpts::default().on(Group::Node);
            let sum = pg
                .call(node)
                .all_reduce(vec![r; len], ReduceOp::Sum)
                .wait()
                .map_err(|e| e.to_string())?;
            let mean = pg
                .call(node)
                .all_reduce(vec![r; len], ReduceOp::Mean)
                .wait()
                .map_err(|e| e.to_string())?;
            // Element i of rank r is r + i % 7: the node mean on this rank's shard.
            let vals: Vec<f32> = (0..len).map(|i| r + (i % 7) as f32).collect();
            let rs = pg
                .call(node)
                .reduce_scatter_in_place(vals, ReduceOp::Mean)
                .wait()
                .map_err(|e| e.to_string())?;
            let shard: Vec<(usize, f32)> = pg
                .group_shard(Group::Node, len)
                .map(|i| (i, rs[i]))
                .collect();
            Ok::<_, String>((pg.node(), sum, mean, shard, pg.bytes_sent() - before))
        });
        for (n, node) in res.into_iter().enumerate() {
            let ranks = node.expect("node");
            let first: usize = shape[..n].iter().sum();
            let want: f32 = (first..first + shape[n]).map(|r| r as f32).sum();
            let mut covered = 0;
            for r in ranks {
                let (node, sum, mean, shard, sent) = r.expect("rank");
                assert_eq!(node, n);
                assert!(sum.iter().all(|&x| x == want), "{shape:?} node {n}");
                let m = want / shape[n] as f32;
                assert!(mean.iter().all(|&x| x == m), "{shape:?} node {n} mean");
                for (i, x) in &shard {
                    let w = (want + (shape[n] * (i % 7)) as f32) / shape[n] as f32;
                    assert_eq!(*x, w, "{shape:?} node {n} reduce-scatter element {i}");
                }
                covered += shard.len();
                assert_eq!(sent, 0, "{shape:?}: bytes crossed nodes");
            }
            assert_eq!(covered, 1001, "{shape:?} node {n}: shards cover the buffer");
        }
    }
}

/// Sub-groups number their own calls: node 0's ranks make node-group calls that node 1's
/// ranks never make, and the world and replica calls after them still meet. A replica-group
/// all-reduce sums local rank l over the nodes (over QUIC, in a narrow wire dtype here), and
/// a rank with no replica on some node is refused with a clear error unless its buffer is
/// empty.
#[test]
fn sub_groups_number_their_own_calls() {
    for shape in [vec![2, 2], vec![2, 3]] {
        let res = cluster(&shape, "test-token", move |mut pg| {
            let err = |e: wiretrain_comm::Error| e.to_string();
            let (r, len) = (pg.rank() as f32, 5003);
            if pg.node() == 0 {
                for _ in 0..3 {
                    pg.call(CallOpts::default().on(Group::Node))
                        .all_reduce(vec![r; 8], ReduceOp::Sum)
                        .wait()
                        .map_err(err)?;
                }
            }
            let world = pg
                .all_reduce(vec![r; len], ReduceOp::Sum)
                .wait()
                .map_err(err)?;
            let replica = CallOpts::wire(WireDtype::Bf16).on(Group::Replica);
            let rep = pg
                .call(replica)
                .all_reduce(vec![r; len], ReduceOp::Sum)
                .wait();
            let empty = pg
                .call(replica)
                .all_reduce(Vec::new(), ReduceOp::Sum)
                .wait();
            let ids = pg
                .flight_recorder()
                .iter()
                .map(|e| format!("{}.{}#{}", e.group, e.op, e.seq))
                .collect::<Vec<_>>();
            Ok::<_, String>((
                pg.local_rank(),
                world[0],
                rep.map(|v| v[0]).map_err(err),
                empty.is_ok(),
                ids,
            ))
        });
        let world: f32 = (0..shape.iter().sum::<usize>()).map(|r| r as f32).sum();
        let lanes = *shape.iter().min().unwrap();
        for (n, node) in res.into_iter().enumerate() {
            for r in node.expect("node") {
                let (l, w, rep, empty, ids) = r.expect("rank");
                assert_eq!(w, world, "{shape:?}");
                assert!(empty, "{shape:?}: an empty replica call is nothing to do");
                if l < lanes {
                    // Local rank l of node m is global rank first(m) + l.
                    let want: f32 = (0..shape.len())
                        .map(|m| (shape[..m].iter().sum::<usize>() + l) as f32)
                        .sum();
                    assert_eq!(rep, Ok(want), "{shape:?} node {n} local {l}");
                    assert!(ids.contains(&"replica.all_reduce#1".to_string()), "{ids:?}");
                } else {
                    let e = rep.expect_err("no replica group");
                    assert!(e.contains("has no replica group"), "{e}");
                }
                assert!(ids.contains(&"world.all_reduce#1".to_string()), "{ids:?}");
                assert_eq!(
                    ids.contains(&"node.all_reduce#3".to_string()),
                    n == 0,
                    "{ids:?}"
                );
            }
        }
    }
}
