//! `wiretrain plan` through the binary: the JSON contract other tools depend on, the ZeRO
//! paper's Figure 1 figures, the interconnects table, and bad input.

mod common;

use std::time::Duration;

fn plan(args: &[&str]) -> std::process::Output {
    let mut a = vec!["plan"];
    a.extend_from_slice(args);
    common::run(&a, &[], Duration::from_secs(30))
}

#[test]
fn json_contract_and_zero_figure_1() {
    let out = plan(&[
        "--params",
        "7.5e9",
        "--nodes",
        "8",
        "--gpus-per-node",
        "8",
        "--precision",
        "mixed",
        "--device-mem",
        "32",
        "--json",
    ]);
    assert!(out.status.success(), "{}", common::text(&out));
    let rows = common::rows(&out);
    let names: Vec<&str> = rows
        .iter()
        .map(|r| r["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["ddp", "zero1", "zero2", "zero3", "hybrid", "hsdp"]);
    for r in &rows {
        for f in ["bytes_per_device", "fits", "step_s", "tokens_per_s"] {
            assert!(r.get(f).is_some(), "{r} lacks {f}");
        }
    }
    // No activations without a shape, so bytes per device are the model states of Figure 1.
    let gb: Vec<f64> = rows
        .iter()
        .map(|r| r["bytes_per_device"].as_f64().unwrap() / 1e9)
        .collect();
    assert_eq!(&gb[..4], &[120.0, 31.40625, 16.640625, 1.875]);
    assert_eq!(rows[0]["fits"], false);
    assert_eq!(rows.iter().filter(|r| r["recommended"] == true).count(), 1);
    let vol: Vec<f64> = rows
        .iter()
        .map(|r| r["volume_elems"].as_f64().unwrap() / 7.5e9)
        .collect();
    assert_eq!(vol, [2.0, 2.0, 2.0, 3.0, 2.0, 3.0]);
    // DiLoCo's rows come with --diloco H, recommended only with --allow diloco: on a
    // 20 Mbit/s link it is then the pick.
    let slow = [
        "--params",
        "1e9",
        "--nodes",
        "4",
        "--gpus-per-node",
        "4",
        "--inter-gbps",
        "0.02",
        "--device-mem",
        "1000",
        "--diloco",
        "50",
        "--json",
    ];
    let rows = common::rows(&plan(&slow));
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(&names[6..], ["diloco", "diloco-hybrid"]);
    let pick = |rows: &[serde_json::Value]| {
        let r = rows.iter().find(|r| r["recommended"] == true).unwrap();
        r["name"].as_str().unwrap().to_string()
    };
    assert!(!pick(&rows).starts_with("diloco"), "{}", pick(&rows));
    assert_eq!(rows[6]["exact"], false);
    assert_eq!(rows[6]["diloco_inner_steps"], 50);
    let allowed = common::rows(&plan(&[&slow[..], &["--allow", "diloco"]].concat()));
    assert!(pick(&allowed).starts_with("diloco"), "{}", pick(&allowed));
}

#[test]
fn human_table_and_interconnects_table() {
    let out = plan(&[
        "--layers", "24", "--hidden", "2048", "--heads", "16", "--nodes", "2",
    ]);
    let text = common::text(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("<- recommended") && text.contains("recommendation:"),
        "{text}"
    );
    let out = plan(&["--table", "interconnects"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    for w in ["IB NDR", "RoCE 100G", "100 GbE", "10 GbE", "PCIe Gen4"] {
        assert!(text.contains(w), "{w} row missing:\n{text}");
    }
    // 70B in mixed precision on 16 devices of 80 GB: only ZeRO-3 fits (DDP needs 16 x 70 GB
    // of model states plus 2.7 GB of recomputation checkpoints).
    assert!(text.contains("no fit (1123)"), "{text}");
    assert_eq!(text.matches("| zero3    |").count(), 5, "{text}");
    let out = plan(&["--table", "interconnects", "--json"]);
    assert_eq!(common::rows(&out).len(), 30);
}

#[test]
fn bad_input_exits_2_with_the_flag_named() {
    for (args, want) in [
        (vec!["--params=-3"], "--params"),
        (vec![], "--params N or a transformer shape"),
        (vec!["--params", "1e9", "--intra", "warp"], "--intra"),
        (
            vec!["--params", "1e9", "--global-batch", "7"],
            "--global-batch",
        ),
        (vec!["--params", "1e9", "--table", "x"], "--table"),
        (
            vec!["--params", "1e9", "--diloco", "5", "--allow", "zero9"],
            "--allow",
        ),
        (
            vec!["--params", "1e9", "--allow", "diloco"],
            "--allow diloco needs --diloco",
        ),
        (vec!["--params", "1e9", "--diloco", "0"], "--diloco"),
        // A row of its own wire dtype must be a row the table has (zero3, not its alias).
        (
            vec!["--params", "1e9", "--wire", "f32,fsdp=int8"],
            "--wire: \"fsdp\" is not a row",
        ),
        (
            vec!["--params", "1e9", "--wire", "f32,ddp=f12"],
            "--wire \"f12\"",
        ),
        (vec!["--params", "1e9", "--units", "0.5"], "--units"),
    ] {
        let out = plan(&args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            common::text(&out)
        );
        assert!(
            common::text(&out).contains(want),
            "{args:?}: {}",
            common::text(&out)
        );
    }
}

#[test]
fn a_bad_lab_csv_is_a_clear_error() {
    let p = std::env::temp_dir().join(format!("wiretrain-badlab-{}.csv", std::process::id()));
    std::fs::write(&p, "rate_mbit,strategy\n50,ddp\n").unwrap();
    let out = plan(&["--lab-csv", p.to_str().unwrap()]);
    let text = common::text(&out);
    assert!(
        !out.status.success() && text.contains("no column step_ms"),
        "{text}"
    );
    let _ = std::fs::remove_file(&p);
}

/// The planner's compute calibration: `wiretrain bench --op compute` runs the trainer's step
/// of a built-in example in every process of a `--local` job at once and reports the rate by
/// the planner's 6·Ψ·tokens model, for the model `train` trains.
#[test]
fn bench_measures_the_compute_rate_the_planner_takes() {
    let mut args = vec![
        "bench",
        "--op",
        "compute",
        "--example",
        "mlp",
        "--batch",
        "32",
    ];
    args.extend(["--iters", "5", "--local", "2", "--json"]);
    let rows = common::json_rows(&args, Duration::from_secs(120), 1);
    let r = &rows[0];
    assert_eq!(r["op"], "compute");
    assert_eq!(
        (r["nodes"].as_u64(), r["ranks"].as_u64()),
        (Some(2), Some(2))
    );
    let m = common::train_metrics(
        "compute-params",
        &[
            "train",
            "--example",
            "mlp",
            "--steps",
            "1",
            "--global-batch",
            "32",
        ],
        &[],
        Duration::from_secs(60),
    );
    let params = m.last().unwrap()["params_total"].as_f64().unwrap();
    assert_eq!(r["params"].as_f64(), Some(params), "{r}");
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k}: {r}"));
    assert!(
        f("compute_ms") > 0.0 && f("time_us") >= f("compute_ms") * 1e3,
        "{r}"
    );
    // The rate is the planner's model applied to the measured time, nothing else.
    let flops = 6.0 * params * 32.0 * f("seq");
    assert!((f("tflops") / (flops / (f("compute_ms") * 1e-3) / 1e12) - 1.0).abs() < 1e-6);
    assert!(f("step_tflops") <= f("tflops"), "{r}");
    // The figure feeds the planner as is.
    let out = plan(&[
        "--params",
        &params.to_string(),
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--seq",
        "1",
        "--micro-batch",
        "32",
        "--global-batch",
        "64",
        "--tflops",
        &f("step_tflops").to_string(),
        "--json",
    ]);
    assert!(out.status.success(), "{}", common::text(&out));
    let ddp = common::rows(&out)
        .into_iter()
        .find(|p| p["strategy"] == "ddp")
        .unwrap();
    let compute_s = ddp["compute_s"].as_f64().unwrap();
    assert!(
        (compute_s / (f("time_us") * 1e-6) - 1.0).abs() < 1e-3,
        "{ddp} vs {r}"
    );
}

#[test]
fn bench_compute_refuses_bad_input() {
    let e = common::refused(&["bench", "--op", "compute,all-reduce"]);
    assert!(e.contains("--op compute runs alone"), "{e}");
    let e = common::refused(&["bench", "--op", "compute", "--example", "resnet"]);
    assert!(e.contains("--example") && e.contains("resnet"), "{e}");
    let e = common::refused(&["bench", "--op", "compute", "--batch", "0"]);
    assert!(e.contains("--batch"), "{e}");
    let e = common::refused(&["bench", "--op", "compute", "--d-model", "6"]);
    assert!(e.contains("--d-model"), "{e}");
}

/// `wiretrain plan ... | head`: a reader that goes away ends the command quietly (SIGPIPE's
/// default action, as Unix tools), not with a panic on the failed print.
#[cfg(unix)]
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = std::process::Command::new(common::bin())
        .args(["plan", "--params", "1e9"])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {err}",
        out.status
    );
}
