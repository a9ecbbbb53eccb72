//! Resuming lists the checkpoint directory on every rank: machine-local directories that hold
//! different checkpoints fail the resume naming the difference (issue 42, item 2), where rank
//! 0's list alone used to decide (a new rank 0 with an empty disk restarted at step 0).

use crate::engine::{Trainer, TrainerConfig};
use crate::models::mlp::{Dataset, Mlp};
use crate::strategy::Strategy;
use burn::tensor::Device;
use std::path::{Path, PathBuf};
use wiretrain_comm::{Node, NodeConfig, tls::Token};

/// Two rank threads: each trains 2 DDP steps of the mlp, saves them into `save` (one
/// checkpoint), then resumes from its own root (`roots[rank]`); each rank's outcome, as text.
fn save_then_resume(save: &Path, roots: [PathBuf; 2], trust_rank0: bool) -> Vec<String> {
    let mut node = Node::join(NodeConfig::single_node(2, Token::generate())).unwrap();
    let handles: Vec<_> = node
        .take_groups()
        .into_iter()
        .map(|pg| {
            let (save, root) = (save.to_path_buf(), roots[pg.rank()].clone());
            std::thread::spawn(move || {
                let device = Device::flex().autodiff();
                let data = Dataset::synthetic(64, 1);
                let cfg = TrainerConfig::builder(Strategy::Ddp)
                    .trust_rank0_checkpoints(trust_rank0)
                    .build()
                    .unwrap();
                let mut t = Trainer::new(Mlp::new(&device, 1), &device, cfg, pg).unwrap();
                for _ in 0..2 {
                    t.step(|m| m.loss(&data, &[0, 1, 2, 3], &device)).unwrap();
                }
                t.save_checkpoint(&save, 2, serde_json::json!({}), 2)
                    .unwrap();
                match t.resume_latest(&root) {
                    Ok(m) => format!("resumed at {:?}", m.map(|m| m.step)),
                    Err(e) => e.to_string(),
                }
            })
        })
        .collect();
    let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
    node.shutdown().unwrap();
    out
}

fn dirs(name: &str) -> (PathBuf, PathBuf) {
    let d = std::env::temp_dir().join(format!("wiretrain-listings-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("empty")).unwrap();
    (d.join("ckpt"), d.join("empty"))
}

#[test]
fn ranks_whose_directories_hold_other_checkpoints_refuse_to_resume() {
    let (shared, empty) = dirs("differ");
    // Rank 1's machine lost its disk: its directory is empty.
    let got = save_then_resume(&shared, [shared.clone(), empty.clone()], false);
    for g in &got {
        assert!(
            g.contains("rank 1 lists steps []") && g.contains("rank 0 lists [2]"),
            "every rank fails naming the difference: {g}"
        );
        assert!(g.contains("--trust-rank0-checkpoints"), "{g}");
    }
    // The same directory on every rank resumes.
    let got = save_then_resume(&shared, [shared.clone(), shared.clone()], false);
    assert_eq!(got, ["resumed at Some(2)", "resumed at Some(2)"]);
    let _ = std::fs::remove_dir_all(shared.parent().unwrap());
}

#[test]
fn an_empty_rank_0_directory_does_not_restart_the_run_at_step_0() {
    let (shared, empty) = dirs("rank0");
    let got = save_then_resume(&shared, [empty.clone(), shared.clone()], false);
    for g in &got {
        assert!(g.contains("rank 1 lists steps [2], rank 0 lists []"), "{g}");
    }
    // Trusting rank 0 is the old behaviour: a fresh start, said plainly by the caller.
    let got = save_then_resume(&shared, [empty.clone(), shared.clone()], true);
    assert_eq!(got, ["resumed at None", "resumed at None"]);
    let _ = std::fs::remove_dir_all(shared.parent().unwrap());
}
