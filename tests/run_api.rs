//! `wiretrain::run` in this process: ranks are real threads on the node's shared buffers. A
//! rank that panics, or returns an error, fails its peers at once with its message (not after
//! the 120 s collective timeout); ranks get the devices the specs name, recorded in the rank
//! table; specs the machine cannot satisfy are refused before anything starts.

#[path = "common/skip.rs"]
mod skip;

use std::time::{Duration, Instant};
use wiretrain::comm::ReduceOp;
use wiretrain::device::DeviceSpec;
use wiretrain::{JobOptions, RunError};

fn job(ranks: usize, devices: Vec<DeviceSpec>) -> JobOptions {
    JobOptions {
        ranks_per_node: Some(ranks),
        devices,
        nnodes: Some(1),
        ..JobOptions::default()
    }
}

/// Every rank but `bad` all-reduces in a loop; `bad` fails after a few rounds via `fail`.
/// Returns the error and the time from the failure to the end of the job (what the claim is
/// about: not the job's set-up, which a loaded machine can make slow).
fn fail_one(bad: usize, fail: fn(usize) -> Result<(), String>) -> (RunError, Duration) {
    let failed_at = std::sync::Arc::new(std::sync::OnceLock::<Instant>::new());
    let at = failed_at.clone();
    let res = wiretrain::run(job(3, vec![DeviceSpec::Cpu]), move |mut ctx| {
        for round in 0..1_000_000 {
            if ctx.rank() == bad && round == 3 {
                at.get_or_init(Instant::now);
                fail(ctx.rank())?;
            }
            ctx.pg
                .all_reduce(vec![1.0; 1024], ReduceOp::Sum)
                .wait()
                .map_err(|e| e.to_string())?;
        }
        Ok::<_, String>(())
    });
    let took = failed_at.get().expect("the bad rank failed").elapsed();
    (res.expect_err("a rank failed"), took)
}

/// [`fail_one`], which must fail within 5 s of the failure as rank `bad`'s error (a panic if
/// `panicked`) with `said` in the message.
fn check_fail_one(bad: usize, fail: fn(usize) -> Result<(), String>, panicked: bool, said: &str) {
    let (e, took) = fail_one(bad, fail);
    let msg = e.to_string();
    assert!(
        matches!(e, RunError::Rank { rank, panicked: p, .. } if rank == bad && p == panicked),
        "{msg}"
    );
    assert!(msg.contains(said), "{msg}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn a_panicking_rank_fails_its_peers_within_5_s_with_the_message() {
    check_fail_one(
        1,
        |r| panic!("device out of memory on rank {r} (test)"),
        true,
        "device out of memory on rank 1 (test)",
    );
}

#[test]
fn a_rank_returning_an_error_fails_its_peers_at_once() {
    check_fail_one(
        2,
        |r| Err(format!("rank {r} found a corrupt batch")),
        false,
        "rank 2 found a corrupt batch",
    );
}

#[test]
fn ranks_get_the_named_devices_and_the_rank_table_records_them() {
    let got = wiretrain::run(job(2, vec![DeviceSpec::WgpuCpu, DeviceSpec::Cpu]), |ctx| {
        Ok::<_, String>((
            ctx.local_rank(),
            ctx.rank_device.description.clone(),
            ctx.devices(),
        ))
    });
    let got = match got {
        Ok(g) => g,
        Err(RunError::Device(e)) => {
            return skip::skip_unless_ci(&format!(
                "no software Vulkan adapter here ({e}); apt-get install mesa-vulkan-drivers"
            ));
        }
        Err(e) => panic!("{e}"),
    };
    assert_eq!(got.len(), 2);
    let (_, d0, table) = &got[0];
    assert!(
        d0.starts_with("wgpu:") && d0.contains("(Cpu, Vulkan)"),
        "{d0}"
    );
    assert_eq!(got[1].1, "cpu (burn flex backend)");
    assert_eq!(table, &vec![d0.clone(), got[1].1.clone()]);
    assert_eq!(got[1].2, *table, "every rank sees the same table");
}

#[test]
fn impossible_device_specs_are_refused_before_the_job_starts() {
    let e = wiretrain::run(job(2, vec![DeviceSpec::WgpuIndex(99)]), |_| {
        Ok::<_, String>(())
    })
    .expect_err("no adapter 99");
    assert!(matches!(e, RunError::Device(_)), "{e}");
    assert!(
        e.to_string().contains("wgpu:99: there is no adapter 99"),
        "{e}"
    );
    let e = wiretrain::run(job(3, vec![DeviceSpec::Cpu, DeviceSpec::Cpu]), |_| {
        Ok::<_, String>(())
    })
    .expect_err("2 specs for 3 ranks");
    assert!(
        e.to_string().contains("2 device specs for 3 local ranks"),
        "{e}"
    );
}

/// Ranks whose models differ are refused by `Trainer::new` before training, naming the first
/// parameter that differs and its path and shape.
#[test]
fn ranks_with_different_models_are_refused_naming_the_parameter() {
    use wiretrain::models::char_lm::CharLmConfig;
    use wiretrain::{Strategy, Trainer, TrainerConfig};
    let res = wiretrain::run(job(2, vec![DeviceSpec::Cpu]), |ctx| {
        let device = ctx.device();
        let width = if ctx.rank() == 0 { 64 } else { 32 };
        let model = CharLmConfig::new(30).with_d_model(width).init(&device, 1);
        Trainer::new(model, &device, TrainerConfig::new(Strategy::Ddp), ctx.pg)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    let msg = res.expect_err("different models").to_string();
    assert!(
        msg.contains("parameter #0 differs between rank 0 and rank 1") && msg.contains("tok"),
        "{msg}"
    );
}

/// ZeRO-3 frees every unit's gathered parameters after use: after a step the model held by
/// the trainer keeps one placeholder element per parameter tensor of each unit instead of
/// the unit's parameters (against all 112 K of them before training), on every rank.
#[test]
fn zero3_frees_each_units_parameters_after_use() {
    use burn::module::Module;
    use wiretrain::data::DistributedSampler;
    use wiretrain::models::char_lm::{CharLm, CharLmConfig, Corpus};
    use wiretrain::{Strategy, Trainer, TrainerConfig};
    let corpus = std::sync::Arc::new(Corpus::shipped(64));
    let res = wiretrain::run(job(2, vec![DeviceSpec::Cpu]), move |ctx| {
        let device = ctx.device().autodiff();
        let model = CharLmConfig::new(corpus.vocab_size()).init(&device, 1);
        let tensors = wiretrain::flat::FlatLayout::of(&model).entries().len();
        let before = model.num_params();
        let mut sampler = DistributedSampler::new(corpus.len(), 16, ctx.world(), ctx.rank(), 1)?;
        let mut t =
            Trainer::with_units(model, &device, TrainerConfig::new(Strategy::Zero3), ctx.pg)
                .map_err(|e| e.to_string())?;
        for step in 0..2 {
            let (input, loss) = CharLm::unit_io(&corpus, &sampler.indices(step), &device);
            t.step_units(input, loss).map_err(|e| e.to_string())?;
        }
        Ok::<_, String>((before, tensors, t.model().num_params()))
    });
    for (before, tensors, after) in res.expect("trains") {
        eprintln!("model parameters: {before} before, {after} after a step ({tensors} tensors)");
        assert!(before > 100_000, "{before}");
        assert!(
            after <= tensors,
            "after a step the model holds {after} parameters (of {before}); at most one \
             placeholder per tensor ({tensors}) may stay"
        );
    }
}
