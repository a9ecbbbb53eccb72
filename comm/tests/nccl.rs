//! The NCCL path (`--features nccl`): the communicator is built through wiretrain's own
//! rendezvous (the unique id broadcast over the process group) and every collective matches
//! the serial reference. Needs a CUDA driver, libnccl and GPUs: skipped with a printed reason
//! otherwise (as on CI, which still compiles and runs this file).
#![cfg(feature = "nccl")]

mod common;

use wiretrain_comm::ReduceOp;
use wiretrain_comm::nccl::{NcclGroup, probe};

#[test]
fn nccl_collectives_match_the_reference() {
    let devices = match probe() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            return;
        }
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
