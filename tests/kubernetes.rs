//! The Kubernetes example (deploy/kubernetes/wiretrain.yaml): it validates against the
//! Kubernetes schemas (`kubernetes-validate --strict`, which also refuses a misspelt field),
//! and the job it describes trains: its pods' environment (NODE_RANK from the completion
//! index, NNODES, MASTER_ADDR/PORT, the token, the job id) and its container's command are
//! given to two node processes on loopback, with pod 0's DNS name standing for 127.0.0.1.
//! Under `CI=true` a missing validator fails the test; elsewhere it is skipped with the reason.

mod common;

use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn manifest() -> String {
    format!(
        "{}/deploy/kubernetes/wiretrain.yaml",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// `kubernetes-validate --strict FILE`: `None` when the validator is not installed.
fn validate(file: &str) -> Option<std::process::Output> {
    match Command::new("kubernetes-validate")
        .args(["--strict", "--quiet", file])
        .output()
    {
        Ok(o) => Some(o),
        Err(e) => {
            common::skip_unless_ci(&format!(
                "kubernetes-validate: {e} (pip install kubernetes-validate)"
            ));
            None
        }
    }
}

#[test]
fn the_manifest_validates_and_a_misspelt_field_does_not() {
    let Some(ok) = validate(&manifest()) else {
        return;
    };
    assert!(ok.status.success(), "{}", common::text(&ok));
    let bad = std::env::temp_dir().join(format!("wiretrain-k8s-{}.yaml", std::process::id()));
    let text = std::fs::read_to_string(manifest()).unwrap();
    assert!(text.contains("      protocol: UDP"));
    std::fs::write(
        &bad,
        text.replace("      protocol: UDP", "      protocl: UDP"),
    )
    .unwrap();
    let refused = validate(bad.to_str().unwrap()).unwrap();
    let _ = std::fs::remove_file(&bad);
    assert!(!refused.status.success(), "a misspelt field passed");
    assert!(common::text(&refused).contains("protocl"));
}

/// The manifest's documents as JSON (PyYAML, which kubernetes-validate brings).
fn documents() -> Option<Vec<Value>> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
            &manifest(),
        ])
        .output()
        .ok()
        .filter(|o| o.status.success());
    let Some(out) = out else {
        common::skip_unless_ci("python3 with PyYAML is missing (pip install kubernetes-validate)");
        return None;
    };
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

#[test]
fn the_manifests_job_trains_with_the_environment_it_gives_each_pod() {
    let Some(docs) = documents() else {
        return;
    };
    let kind = |k: &str| docs.iter().find(|d| d["kind"] == k).unwrap().clone();
    let (svc, job) = (kind("Service"), kind("Job"));
    let spec = &job["spec"];
    let pod = &spec["template"]["spec"];
    let c = &pod["containers"][0];
    // The wiring the comments promise: pods named <job>-<index>.<service>, one per node.
    let name = job["metadata"]["name"].as_str().unwrap();
    assert_eq!(pod["subdomain"], svc["metadata"]["name"]);
    assert_eq!(svc["spec"]["clusterIP"], "None");
    assert_eq!(spec["completionMode"], "Indexed");
    assert_eq!(spec["completions"], spec["parallelism"]);
    let env: Vec<(String, Value)> = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_string(), e.clone()))
        .collect();
    let value = |k: &str| {
        let e = &env.iter().find(|(n, _)| n == k).unwrap().1;
        e["value"].as_str().map(String::from)
    };
    let nnodes = value("NNODES").unwrap();
    assert_eq!(spec["completions"].to_string(), nnodes);
    let master = value("MASTER_ADDR").unwrap();
    assert_eq!(
        master,
        format!("{name}-0.{}", svc["metadata"]["name"].as_str().unwrap())
    );
    let port = value("MASTER_PORT").unwrap();
    assert_eq!(svc["spec"]["ports"][0]["port"].to_string(), port);
    assert_eq!(c["ports"][0]["containerPort"].to_string(), port);
    assert_eq!(c["ports"][0]["protocol"], "UDP");
    let index = &env.iter().find(|(n, _)| n == "NODE_RANK").unwrap().1;
    assert_eq!(
        index["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    );
    // The pods on loopback: each gets the manifest's command and variables, pod 0's DNS name
    // is 127.0.0.1, and the run is made short and CPU-only.
    let dir = common::fresh_dir("k8s", "pods");
    // One checkpoint directory per experiment, named by the pod's EXPERIMENT variable, which
    // Kubernetes puts into the arguments' $(EXPERIMENT).
    let experiment = value("EXPERIMENT").expect("the manifest names its experiment");
    let ck = dir.join(&experiment);
    let mut args: Vec<String> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            a.as_str()
                .unwrap()
                .replace("$(EXPERIMENT)", &experiment)
                .replace("/checkpoints", dir.to_str().unwrap())
        })
        .collect();
    assert!(
        args.iter().any(|a| *a == ck.display().to_string()) && !args.contains(&"--resume".into()),
        "a per-experiment directory, resumed only deliberately: {args:?}"
    );
    let steps = args.iter().position(|a| a == "--steps").unwrap();
    args[steps + 1] = "3".into();
    args.extend(["--device", "cpu", "--no-progress", "--d-model", "32"].map(String::from));
    let port = free_udp_port();
    let token = "k8s-0123456789abcdef0123456789abcdef";
    let nodes: Vec<_> = (0..nnodes.parse::<usize>().unwrap())
        .map(|i| {
            let rank = i.to_string();
            let mut a = args.clone();
            a.extend([
                "--metrics".into(),
                dir.join(format!("m{i}.jsonl")).display().to_string(),
            ]);
            let envs = [
                ("NODE_RANK", rank.as_str()),
                ("NNODES", nnodes.as_str()),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", &port.to_string()),
                ("WIRETRAIN_TOKEN", token),
                ("WIRETRAIN_JOB_ID", "5c3e8a34-k8s-test"),
            ]
            .map(|(k, v)| (k, v.to_string()));
            let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (*k, v.as_str())).collect();
            common::spawn(&a, &envs)
        })
        .collect();
    for (i, mut n) in nodes.into_iter().enumerate() {
        let status = common::wait_exit(&mut n, Duration::from_secs(180));
        assert!(status.success(), "pod {i}: {}", common::stderr_of(&mut n));
    }
    let m0 = common::jsonl(&dir.join("m0.jsonl"));
    let summary = m0.iter().find(|r| r.get("summary").is_some()).unwrap();
    assert_eq!(summary["world"], 2, "{summary}");
    assert!(has_checkpoint(&ck), "no checkpoint in {}", ck.display());
    let _ = std::fs::remove_dir_all(&dir);
}

fn has_checkpoint(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with("step-"))
}

/// A UDP port free on 127.0.0.1 now (node 0 binds it a moment later).
fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
