//! The NCCL path (`--features nccl`): the communicator is built through wiretrain's own
//! rendezvous (the unique id broadcast over the process group) and every collective matches
//! the serial reference. Needs a CUDA driver, libnccl and GPUs: skipped with a printed reason
//! otherwise. Under CI=true a missing GPU fails the tests unless WIRETRAIN_NCCL_MAY_SKIP=1 says
//! the machine has none on purpose (as .ci/run does: CI compiles and runs this file, without a
//! GPU).
#![cfg(feature = "nccl")]

mod common;

use wiretrain_comm::ReduceOp;
use wiretrain_comm::nccl::{NcclGroup, probe};

#[path = "../../tests/common/skip.rs"]
mod skips;

/// Skips with `why` (listed), except under CI without WIRETRAIN_NCCL_MAY_SKIP=1, where a
/// missing prerequisite fails the test.
fn skip(why: &str) {
    let may = std::env::var("WIRETRAIN_NCCL_MAY_SKIP").is_ok_and(|v| v == "1");
    skips::skip_unless(
        &format!("{why} (WIRETRAIN_NCCL_MAY_SKIP=1 allows it on a machine without GPUs)"),
        may,
    );
}

#[test]
fn nccl_collectives_match_the_reference() {
    let devices = match probe() {
        Ok(n) => n,
        Err(e) => return skip(&e.to_string()),
    };
    // One rank per GPU (NCCL refuses two ranks on one device): 2 nodes on loopback when the
    // machine has 2 GPUs, else one.
    let shape = if devices >= 2 { vec![1, 1] } else { vec![1] };
    let world = shape.len();
    let res = common::cluster(&shape, "nccl-token", move |mut pg| {
        let dev = pg.rank() % devices;
        let g = NcclGroup::new(&mut pg, dev).map_err(|e| e.to_string())?;
        let n = 1 << 20;
        let mine: Vec<f32> = (0..n).map(|i| (pg.rank() * 3 + i % 7) as f32).collect();
        let mut buf = g.upload(&mine).map_err(|e| e.to_string())?;
        g.all_reduce(&mut buf, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        let sum = g.download(&buf).map_err(|e| e.to_string())?;
        let mut part = g.upload(&vec![0.0; n / world]).map_err(|e| e.to_string())?;
        let full = g.upload(&mine).map_err(|e| e.to_string())?;
        g.reduce_scatter(&full, &mut part, ReduceOp::Mean)
            .map_err(|e| e.to_string())?;
        let rs = g.download(&part).map_err(|e| e.to_string())?;
        let mut gathered = g.upload(&vec![0.0; n * world]).map_err(|e| e.to_string())?;
        g.all_gather(&full, &mut gathered)
            .map_err(|e| e.to_string())?;
        let ag = g.download(&gathered).map_err(|e| e.to_string())?;
        Ok::<_, String>((pg.rank(), sum, rs, ag))
    });
    for node in res {
        for r in node.expect("node") {
            let (rank, sum, rs, ag) = r.expect("rank");
            for i in (0..1 << 20).step_by(997) {
                let want: f32 = (0..world).map(|q| (q * 3 + i % 7) as f32).sum();
                assert_eq!(sum[i], want, "all-reduce elem {i}");
            }
            let shard = (1 << 20) / world;
            for (k, v) in rs.iter().enumerate().step_by(991) {
                let i = rank * shard + k;
                let want: f32 =
                    (0..world).map(|q| (q * 3 + i % 7) as f32).sum::<f32>() / world as f32;
                assert!((v - want).abs() < 1e-6, "reduce-scatter elem {k}");
            }
            for q in 0..world {
                assert_eq!(
                    ag[q * (1 << 20) + 5],
                    (q * 3 + 5) as f32,
                    "all-gather of rank {q}"
                );
            }
        }
    }
    eprintln!("NCCL collectives verified on {world} GPU(s)");
}

/// NCCL's init is bounded by the collective timeout: a rank that never joins (here rank 1
/// shares the id and meets the barrier, then stays out of NCCL) makes rank 0's init fail with
/// a timeout naming it, instead of blocking in NCCL's bootstrap forever. One GPU suffices.
#[test]
fn nccl_init_that_a_rank_never_joins_times_out() {
    if let Err(e) = probe() {
        return skip(&e.to_string());
    }
    let res = common::cluster(&[1, 1], "nccl-token", |mut pg| {
        if pg.rank() == 0 {
            pg.set_timeout(std::time::Duration::from_secs(3));
            let start = std::time::Instant::now();
            let got = NcclGroup::new(&mut pg, 0)
                .map(|_| ())
                .map_err(|e| e.to_string());
            let took = start.elapsed();
            pg.set_timeout(std::time::Duration::from_secs(30));
            pg.barrier().map_err(|e| e.to_string())?;
            Ok::<_, String>(Some((got, took)))
        } else {
            pg.set_timeout(std::time::Duration::from_secs(30));
            wiretrain_comm::nccl::share_id(&mut pg).map_err(|e| e.to_string())?;
            pg.barrier().map_err(|e| e.to_string())?;
            // Never calls NCCL's init; waits for rank 0 to give up.
            pg.barrier().map_err(|e| e.to_string())?;
            Ok(None)
        }
    });
    let mut seen = false;
    for node in res {
        for r in node.expect("node") {
            if let Some((got, took)) = r.expect("rank") {
                let e = got.expect_err("init without rank 1 must fail");
                assert!(
                    e.contains("NCCL init on rank 0 of 2 did not finish within 3 s"),
                    "{e}"
                );
                assert!(took.as_secs_f64() < 10.0, "gave up after {took:?}");
                seen = true;
            }
        }
    }
    assert!(seen);
    eprintln!("NCCL init deadline verified");
}

/// A collective a peer never joins is bounded too: `sync` aborts the communicator at the
/// timeout and every later call says it was aborted. Needs two GPUs (NCCL refuses two ranks
/// on one device).
#[test]
fn nccl_collective_that_a_peer_skips_times_out_and_aborts() {
    let devices = match probe() {
        Ok(n) if n >= 2 => n,
        Ok(n) => return skip(&format!("{n} GPU(s); this test needs two")),
        Err(e) => return skip(&e.to_string()),
    };
    let res = common::cluster(&[1, 1], "nccl-token", move |mut pg| {
        pg.set_timeout(std::time::Duration::from_secs(30));
        let dev = pg.rank() % devices;
        let mut g = NcclGroup::new(&mut pg, dev).map_err(|e| e.to_string())?;
        if pg.rank() == 0 {
            g.set_timeout(std::time::Duration::from_secs(2));
            let mut buf = g.upload(&[1.0; 1024]).map_err(|e| e.to_string())?;
            g.all_reduce(&mut buf, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            let first = g.sync().map(|_| ()).map_err(|e| e.to_string());
            let later = g
                .all_reduce(&mut buf, ReduceOp::Sum)
                .map_err(|e| e.to_string());
            pg.barrier().map_err(|e| e.to_string())?;
            Ok::<_, String>(Some((first, later)))
        } else {
            // Skips the all-reduce; waits for rank 0 to give up.
            pg.barrier().map_err(|e| e.to_string())?;
            Ok(None)
        }
    });
    let mut seen = false;
    for node in res {
        for r in node.expect("node") {
            if let Some((first, later)) = r.expect("rank") {
                let e = first.expect_err("a collective without rank 1 must time out");
                assert!(e.contains("did not finish within 2 s"), "{e}");
                assert!(e.contains("aborted"), "{e}");
                let e = later.expect_err("an aborted communicator refuses work");
                assert!(e.contains("aborted earlier"), "{e}");
                seen = true;
            }
        }
    }
    assert!(seen);
}
