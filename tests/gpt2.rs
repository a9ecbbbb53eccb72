//! The GPT-2-style example (`examples/gpt2.rs`, a decoder written from `burn::nn` as a user
//! writes one) through `wiretrain launch` at 2 nodes x 2 ranks, against the same model
//! trained by plain Burn in one process (the example's `--reference`: Burn's AdamW on the
//! whole global batch, no wiretrain in the loop).

mod common;

use std::path::Path;
use std::time::Duration;

const STEPS: usize = 12;

fn dir(name: &str) -> std::path::PathBuf {
    common::fresh_dir("wiretrain-gpt2", name)
}

fn gpt2(args: &[&str]) -> std::process::Output {
    let ex = common::example("gpt2");
    let mut all = vec![ex.to_str().unwrap()];
    all.extend(args);
    let out = std::process::Command::new(all[0])
        .args(&all[1..])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::text(&out));
    out
}

fn launch_2x2(strategy: &str, m: &Path) -> Vec<f64> {
    let ex = common::example("gpt2");
    let steps = STEPS.to_string();
    let args = common::local(
        "2",
        "2",
        &[
            ex.to_str().unwrap(),
            "--device",
            "cpu",
            "--steps",
            &steps,
            "--strategy",
            strategy,
            "--inner-steps",
            "4",
            "--metrics",
            m.to_str().unwrap(),
        ],
    );
    let out = common::run(&args, &[], Duration::from_secs(300));
    assert!(out.status.success(), "{strategy}: {}", common::text(&out));
    let summary = common::jsonl(m).pop().unwrap();
    assert_eq!(summary["world"], 4, "{summary}");
    assert_eq!(summary["example"], "gpt2", "{summary}");
    common::step_losses(m)
}

#[test]
fn the_gpt2_style_decoder_trains_at_2x2_as_plain_burn_does_under_every_exact_strategy() {
    let d = dir("equal");
    let reference = d.join("reference.jsonl");
    let steps = STEPS.to_string();
    gpt2(&[
        "--reference",
        "--steps",
        &steps,
        "--metrics",
        reference.to_str().unwrap(),
    ]);
    let want = common::step_losses(&reference);
    assert_eq!(want.len(), STEPS);
    assert!(
        want[STEPS - 1] < 0.8 * want[0],
        "plain Burn learns: {want:?}"
    );
    for strategy in ["ddp", "zero1", "zero2", "zero3", "hybrid", "hsdp"] {
        let got = launch_2x2(strategy, &d.join(format!("{strategy}.jsonl")));
        assert_eq!(got.len(), STEPS, "{strategy}: {got:?}");
        let worst = common::worst_rel(&got, &want, 1e-3);
        eprintln!("{strategy}: 2x2 against plain Burn, worst relative loss difference {worst:e}");
        assert!(worst <= 1e-5, "{strategy}: {got:?} vs plain Burn {want:?}");
    }
    // DiLoCo is not exact by design (each node steps alone between outer steps): it trains.
    let got = launch_2x2("diloco", &d.join("diloco.jsonl"));
    assert_eq!(got.len(), STEPS);
    assert!(got[STEPS - 1] < 0.8 * got[0], "diloco learns: {got:?}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_small_preset_has_gpt2_small_s_shapes() {
    // GPT-2 small's published count is 124,439,808 with the head tied to the token
    // embedding; this model's own head adds 768 x 50,257.
    let out = gpt2(&["--preset", "small", "--params"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.trim(),
        format!("{} parameters", 124_439_808 + 768 * 50_257)
    );
}

#[test]
fn bad_shapes_are_one_line_and_exit_2() {
    let ex = common::example("gpt2");
    for (args, says) in [
        (&["--preset", "huge"][..], "--preset huge: not a preset"),
        (
            &["--d-model", "30", "--heads", "4"][..],
            "not a multiple of --heads",
        ),
        (&["--vocab", "100"][..], "at least 256"),
        (&["--steps", "x"][..], "--steps x: not a number"),
    ] {
        let out = std::process::Command::new(&ex).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
