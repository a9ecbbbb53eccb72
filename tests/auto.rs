//! `train --strategy auto` through the binary: on one node it plans, says that no strategy
//! uses the network and trains with its pick; across two local nodes it measures the link
//! too; bad combinations are refused with one line. The shaped-link checks (the pick against
//! measured runs of every strategy) are in tests/lab.rs.

mod common;

use std::time::Duration;

/// The auto run's metrics: (summary, rank 0's stderr).
fn auto_run(name: &str, args: &[&str]) -> (serde_json::Value, String) {
    let d = common::fresh_dir("auto", name);
    let m = d.join("m.jsonl");
    let mut all = args.to_vec();
    all.extend(["--metrics", m.to_str().unwrap()]);
    let out = common::run(&all, &[], Duration::from_secs(240));
    let text = common::text(&out);
    assert!(out.status.success(), "{text}");
    let rows = common::jsonl(&m);
    let _ = std::fs::remove_dir_all(&d);
    (rows.last().unwrap().clone(), text)
}

/// Checks the summary's `auto` record: every row planned, the pick is the recommended row and
/// the strategy trained, and the measurement took at most 10 s.
fn check_pick(s: &serde_json::Value, text: &str, rows: usize) -> String {
    let a = &s["auto"];
    let plans = a["plans"].as_array().unwrap();
    assert_eq!(plans.len(), rows, "{a}");
    let picked: Vec<_> = plans.iter().filter(|p| p["recommended"] == true).collect();
    assert_eq!(picked.len(), 1, "{a}");
    assert_eq!(picked[0]["name"], a["name"], "{a}");
    let name = a["name"].as_str().unwrap().to_string();
    assert_eq!(s["strategy"], name, "the run trains with the pick");
    let m = &a["measured"];
    assert!(
        m["step_s"].as_f64().unwrap() > 0.0 && m["tflops"].as_f64().unwrap() > 0.0,
        "{m}"
    );
    assert!(m["seconds"].as_f64().unwrap() <= 10.0, "measuring took {m}");
    assert!(
        text.contains(&format!("--strategy auto picked {name}")),
        "{text}"
    );
    assert!(text.contains("<- picked"), "{text}");
    name
}

#[test]
fn auto_on_one_node_picks_without_the_network_and_says_so() {
    let (s, text) = auto_run(
        "one-node",
        &[
            "train",
            "--example",
            "char-lm",
            "--strategy",
            "auto",
            "--ranks-per-node",
            "2",
            "--steps",
            "3",
            "--device",
            "cpu",
            "--no-progress",
        ],
    );
    let name = check_pick(&s, &text, 6);
    assert!(
        text.contains("one node: no strategy uses the network"),
        "{text}"
    );
    let m = &s["auto"]["measured"];
    assert!(m["inter_gbps"].is_null(), "one node has no link: {m}");
    for p in s["auto"]["plans"].as_array().unwrap() {
        assert_eq!(p["comm_bytes_inter"], 0.0, "{p}");
    }
    // Host memory is known for the CPU backend.
    assert!(m["device_mem"].as_f64().unwrap() > 1e6, "{m}");
    assert_ne!(
        name, "zero3",
        "zero3 recomputes: never the fastest on one node"
    );
}

#[test]
fn auto_across_two_nodes_measures_the_link_and_trains_with_its_pick() {
    let (s, text) = auto_run(
        "two-nodes",
        &common::local_train(
            "2",
            "2",
            &[
                "--example",
                "char-lm",
                "--strategy",
                "auto",
                "--allow",
                "diloco",
                "--inner-steps",
                "3",
                "--steps",
                "4",
                "--device",
                "cpu",
                "--no-progress",
            ],
        ),
    );
    // Six strategies and DiLoCo's two rows (allowed).
    check_pick(&s, &text, 8);
    let m = &s["auto"]["measured"];
    assert!(m["inter_gbps"].as_f64().unwrap() > 0.01, "{m}");
    assert!(m["inter_latency_us"].as_f64().unwrap() > 0.0, "{m}");
    assert_eq!(s["steps_done"], 4);
}

/// `--allow` of an unknown strategy, `--allow` without auto, and auto with `--shares`: one
/// line naming what is wrong, exit 2.
#[test]
fn bad_auto_settings_are_refused() {
    common::refused_each(&[
        (
            &["train", "--strategy", "auto", "--allow", "zero9"],
            "--allow: unknown strategy \"zero9\"",
        ),
        (
            &["train", "--strategy", "ddp", "--allow", "diloco"],
            "--allow belongs to --strategy auto",
        ),
        (
            &["train", "--strategy", "auto", "--shares", "32,32"],
            "cannot go with --shares",
        ),
        (
            &["train", "--strategy", "auto", "--inner-steps", "5"],
            "--inner-steps goes with --allow diloco",
        ),
    ]);
}

/// A named strategy wins; `--show-plan` still measures and prints the table, marking the
/// strategy given and what auto would pick.
#[test]
fn a_given_strategy_wins_and_show_plan_prints_its_predicted_cost() {
    let (s, text) = auto_run(
        "given",
        &[
            "train",
            "--example",
            "mlp",
            "--strategy",
            "zero3",
            "--show-plan",
            "--ranks-per-node",
            "2",
            "--steps",
            "2",
            "--device",
            "cpu",
            "--no-progress",
        ],
    );
    assert_eq!(s["strategy"], "zero3", "{text}");
    assert!(
        text.contains("training with the strategy given, zero3"),
        "{text}"
    );
    assert!(text.contains("<- given"), "{text}");
    let plans = s["auto"]["plans"].as_array().unwrap();
    assert!(
        plans
            .iter()
            .any(|p| p["name"] == "zero3" && p["step_s"].as_f64().unwrap() > 0.0)
    );
}

/// When the steps stay more than 30 % off the prediction for 20 steps (here one rank made
/// slow after the measurement: `WIRETRAIN_TEST_SLOW_RANK`), rank 0 logs what they measure and
/// what the planner would now pick, and the run keeps its strategy.
#[test]
fn drift_from_the_prediction_is_logged_with_a_new_plan_and_no_switch() {
    let d = common::fresh_dir("auto", "drift");
    let m = d.join("m.jsonl");
    let out = common::run(
        &[
            "train",
            "--example",
            "mlp",
            "--strategy",
            "auto",
            "--ranks-per-node",
            "2",
            "--steps",
            "24",
            "--device",
            "cpu",
            "--no-progress",
            "--metrics",
            m.to_str().unwrap(),
        ],
        &[("WIRETRAIN_TEST_SLOW_RANK", "1:150")],
        Duration::from_secs(240),
    );
    let text = common::text(&out);
    assert!(out.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("re-planned")).collect();
    // Steps 2..=21 drift (the first is a warm-up): one report, after step 21.
    assert_eq!(lines.len(), 1, "{text}");
    assert!(lines[0].contains("after step 21"), "{text}");
    assert!(lines[0].contains("the planner would now pick"), "{text}");
    assert!(lines[0].contains("the run keeps its strategy"), "{text}");
    let s = common::jsonl(&m).pop().unwrap();
    assert_eq!(s["strategy"], s["auto"]["name"], "no switch: {s}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `--show-plan` with a DiLoCo run plans DiLoCo's rows (with its inner steps) so that the
/// strategy given is in the table.
#[test]
fn show_plan_with_diloco_plans_its_rows() {
    let (s, text) = auto_run(
        "given-diloco",
        &common::local_train(
            "2",
            "1",
            &[
                "--example",
                "mlp",
                "--strategy",
                "diloco",
                "--inner-steps",
                "2",
                "--show-plan",
                "--steps",
                "2",
                "--device",
                "cpu",
                "--no-progress",
            ],
        ),
    );
    assert_eq!(s["strategy"], "diloco", "{text}");
    assert!(
        text.contains("training with the strategy given, diloco"),
        "{text}"
    );
    let plans = s["auto"]["plans"].as_array().unwrap();
    let given: Vec<_> = plans.iter().filter(|p| p["name"] == "diloco").collect();
    assert_eq!(given.len(), 1, "{text}");
    assert_eq!(given[0]["diloco_inner_steps"], 2);
}
