//! Tests of `plan`.

use super::*;

/// What the planner charges of `r` seconds of reductions issued unit by unit over `n` equal
/// units during a backward pass of `bwd` seconds.
fn red_exposed(r: f64, bwd: f64, n: f64) -> f64 {
    (r / n).max(r - bwd * (n - 1.0) / n)
}

fn zero_paper() -> PlanInput {
    PlanInput {
        params: 7.5e9,
        shape: None,
        seq: 1024,
        micro_batch: 1,
        global_batch: 64,
        nodes: 8,
        gpus_per_node: 8,
        device_mem: 32e9,
        precision: Precision::Mixed,
        wire: WireDtype::F16,
        wire_rows: Vec::new(),
        tflops: 100.0,
        intra: Link::preset("nvlink4").unwrap(),
        inter: Link::preset("ib-hdr").unwrap(),
        recompute: false,
        overlap: false,
        prefetch: false,
        rank_order: RankOrder::NodeMajor,
        units: Some(12.0),
        diloco: None,
    }
}

/// The ZeRO paper's Figure 1: Ψ = 7.5B, N = 64, K = 12: 120, 31.4, 16.6, 1.875 GB.
#[test]
fn reproduces_zero_figure_1_exactly() {
    let p = zero_paper();
    let gb = |st| {
        let (a, b, c) = p.model_states(st);
        (a + b + c) / 1e9
    };
    assert_eq!(gb(Strategy::Ddp), 120.0);
    assert_eq!(gb(Strategy::Zero1), 31.40625);
    assert_eq!(gb(Strategy::Zero2), 16.640625);
    assert_eq!(gb(Strategy::Zero3), 1.875);
    assert_eq!(format!("{:.1}", gb(Strategy::Zero1)), "31.4");
    assert_eq!(format!("{:.1}", gb(Strategy::Zero2)), "16.6");
    // The node-scope points of the two axes shard over a node's 8 devices (K = 12:
    // 2 + 2 + 12 bytes per parameter, of which hybrid shards the last 14, HSDP all 16).
    assert_eq!(gb(Strategy::Hybrid), 7.5 * (2.0 + 14.0 / 8.0));
    assert_eq!(gb(Strategy::Hsdp), 7.5 * 16.0 / 8.0);
}

/// HSDP composes ZeRO-3 inside the node with hybrid's traffic across nodes.
#[test]
fn hsdp_moves_zero3_bytes_inside_nodes_and_hybrid_bytes_between_them() {
    let p = zero_paper();
    let (_, intra3, _, _) = p.communication(Strategy::Zero3);
    let (_, _, inter_h, _) = p.communication(Strategy::Hybrid);
    let (v, intra, inter, _) = p.communication(Strategy::Hsdp);
    assert_eq!((v, intra, inter), (3.0 * 7.5e9, intra3, inter_h));
}

/// Communication volume per device: 2Ψ for DDP, ZeRO-1, ZeRO-2; 3Ψ for ZeRO-3 (the ZeRO
/// paper's section 7); and the bytes approach it as N grows.
#[test]
fn reproduces_the_communication_volumes() {
    let p = zero_paper();
    for (st, k) in [
        (Strategy::Ddp, 2.0),
        (Strategy::Zero1, 2.0),
        (Strategy::Zero2, 2.0),
        (Strategy::Zero3, 3.0),
    ] {
        let (v, intra, inter, _) = p.communication(st);
        assert_eq!(v, k * 7.5e9);
        // Every element crosses some link: intra (g−1)/g + inter (n−1)/(n·g) = (N−1)/N.
        let moved = (intra + inter) / p.wire.bytes_per_element();
        assert!(
            (moved - k * 7.5e9 * 63.0 / 64.0).abs() < 1.0,
            "{st}: {moved}"
        );
    }
}

#[test]
fn recommends_the_fastest_that_fits_and_says_why() {
    let mut p = zero_paper();
    let plans = p.plan();
    let fit: Vec<_> = plans
        .iter()
        .filter(|x| x.fits)
        .map(|x| x.strategy)
        .collect();
    // 32 GB devices: DDP's 120 GB does not fit; hybrid's 2Ψ + 14Ψ/8 = 28.1 GB does.
    assert_eq!(
        fit,
        [
            Strategy::Zero1,
            Strategy::Zero2,
            Strategy::Zero3,
            Strategy::Hybrid,
            Strategy::Hsdp
        ]
    );
    let r = plans.iter().find(|x| x.recommended).unwrap();
    assert!(r.fits);
    assert!(reason(&plans, p.device_mem).contains("; ddp does not fit"));
    // ZeRO-3 moves 1.5x the bytes, so on a slow network it is slower than ZeRO-2.
    p.inter = Link::preset("eth-10g").unwrap();
    let plans = p.plan();
    let t = |s| plans.iter().find(|x| x.strategy == s).unwrap().step_s;
    assert!(t(Strategy::Zero3) > t(Strategy::Zero2));
    // Nothing fits on a tiny device.
    p.device_mem = 1e9;
    let plans = p.plan();
    assert!(plans.iter().all(|x| !x.recommended));
    assert!(reason(&plans, p.device_mem).starts_with("nothing fits"));
}

#[test]
fn shape_counts_parameters_and_activations() {
    // GPT-2 small: 12 layers, 768 wide, 50257 vocabulary, 1024 positions: 124M.
    let sh = Shape {
        layers: 12,
        hidden: 768,
        heads: 12,
        vocab: 50257,
    };
    let n = sh.params(1024);
    assert!((n - 124.4e6).abs() < 0.5e6, "{n}");
    let mut p = zero_paper();
    p.shape = Some(sh);
    p.seq = 1024;
    let full = p.activation_bytes();
    p.recompute = true;
    let re = p.activation_bytes();
    assert_eq!(re, 2.0 * 1024.0 * 768.0 * 12.0);
    assert!(full > 10.0 * re);
}

#[test]
fn zero3_prefetch_hides_its_gathers_up_to_the_compute_time() {
    let mut p = zero_paper();
    p.device_mem = 1e12;
    let z3 = |p: &PlanInput| {
        p.plan()
            .into_iter()
            .find(|x| x.strategy == Strategy::Zero3)
            .unwrap()
    };
    let plain = z3(&p);
    p.prefetch = true;
    let pre = z3(&p);
    assert_eq!(plain.comm_s, pre.comm_s);
    assert!(pre.step_s < plain.step_s);
    // Communication-bound here: the gathers outlast compute, the step is the communication.
    assert!(pre.compute_s < 2.0 * pre.comm_s / 3.0);
    assert!((pre.step_s - pre.comm_s).abs() < 1e-12);
    // Compute-bound (slower devices): the gathers hide behind compute and the
    // reduce-scatters, issued unit by unit, behind the backward pass (3/4 of compute, which
    // recomputes) but the last unit's.
    p.tflops = 5.0;
    let pre = z3(&p);
    assert!(pre.compute_s >= pre.comm_s);
    let want = pre.compute_s + pre.comm_s / 3.0 / 12.0;
    assert!((pre.step_s - want).abs() < 1e-9, "{pre:?} vs {want}");
    // Without prefetch the gathers wait in line; the reduce-scatters still hide.
    for tflops in [400.0, 100.0, 5.0] {
        p.tflops = tflops;
        p.prefetch = false;
        let z = z3(&p);
        let (c, t) = (z.comm_s, z.compute_s);
        let exposed = 2.0 * c / 3.0 + red_exposed(c / 3.0, 0.75 * t, 12.0);
        let want = t + exposed.max(c - t).max(0.0);
        assert!((z.step_s - want).abs() < 1e-9, "{tflops}: {z:?} vs {want}");
    }
}

/// With `--overlap`, DDP, ZeRO-1/2 and hybrid hide their gradient reductions behind the
/// backward pass (2/3 of compute) but the last unit's, not the gathers after the update;
/// DiLoCo overlaps nothing. One unit overlaps nothing; a model without units runs no ZeRO-3.
#[test]
fn unit_overlap_hides_reductions_up_to_the_backward_time() {
    let mut p = zero_paper();
    p.device_mem = 1e12;
    p.diloco = Some(DilocoPlan {
        inner_steps: 10,
        allowed: false,
    });
    let row = |p: &PlanInput, name: &str| p.plan().into_iter().find(|x| x.name == name).unwrap();
    for tflops in [400.0, 100.0, 5.0] {
        p.tflops = tflops;
        p.overlap = false;
        let off: Vec<_> = ["ddp", "zero2", "hybrid", "diloco"]
            .map(|n| row(&p, n))
            .into();
        p.overlap = true;
        for o in &off {
            let on = row(&p, &o.name);
            let (c, bwd) = (o.comm_s, 2.0 * o.compute_s / 3.0);
            // Without overlap every byte waits: compute + comm.
            assert!((o.step_s - (o.compute_s + c)).abs() < 1e-9, "{o:?}");
            let red = match o.name.as_str() {
                "ddp" => c,
                "zero2" => c / 2.0,
                "hybrid" => {
                    let p_c = p.comm(Strategy::Hybrid);
                    p_c.inter_s + p_c.intra_s / 2.0
                }
                _ => 0.0,
            };
            let exposed = c - red + red_exposed(red, bwd, 12.0);
            let want = o.compute_s + exposed.max(c - o.compute_s).max(0.0);
            assert!(
                (on.step_s - want).abs() < 1e-9,
                "{tflops}: {on:?} vs {want}"
            );
            if o.name != "diloco" {
                assert!(on.step_s < o.step_s, "{tflops}: {} overlaps", o.name);
            }
        }
    }
    p.units = Some(1.0);
    p.overlap = true;
    let one = row(&p, "ddp");
    assert!(
        (one.step_s - (one.compute_s + one.comm_s)).abs() < 1e-9,
        "{one:?}"
    );
    p.units = None;
    p.device_mem = 1e10; // only ZeRO-3 and HSDP fit
    let plans = p.plan();
    assert!(
        plans.iter().all(|x| !x.recommended),
        "no units: nothing to run"
    );
}

#[test]
fn a_scrambled_ring_sends_more_across_nodes() {
    let mut p = zero_paper();
    p.nodes = 2;
    p.gpus_per_node = 2;
    let (_, intra, inter, t) = p.communication(Strategy::Ddp);
    p.rank_order = RankOrder::Scrambled;
    let (_, s_intra, s_inter, s_t) = p.communication(Strategy::Ddp);
    // Node-major: Ψ/4 per device and collective across nodes; scrambled: 3Ψ/4, and
    // nothing inside the node.
    assert!((s_inter / inter - 3.0).abs() < 1e-9, "{s_inter} vs {inter}");
    assert!(intra > 0.0 && s_intra == 0.0);
    assert!(s_t > 2.5 * t);
}

#[test]
fn bad_input_is_refused() {
    let mut p = zero_paper();
    p.global_batch = 63;
    assert!(p.validate().unwrap_err().contains("--global-batch"));
    let mut p = zero_paper();
    p.params = -1.0;
    assert!(p.validate().unwrap_err().contains("--params"));
    assert!(zero_paper().validate().is_ok());
}

/// DiLoCo sends DDP's bytes between nodes once every H steps; inside the node it runs its
/// inner strategy every step; it keeps 8 more bytes per parameter (anchor and momentum).
#[test]
fn diloco_sends_ddps_inter_node_bytes_divided_by_h() {
    let mut p = zero_paper();
    p.device_mem = 1e15;
    p.diloco = Some(DilocoPlan {
        inner_steps: 50,
        allowed: false,
    });
    let ddp = p.comm(Strategy::Ddp);
    let d = p.diloco_comm(50);
    assert_eq!(d.inter_bytes, ddp.inter_bytes / 50.0);
    assert_eq!(d.inter_s, ddp.inter_s / 50.0);
    // Inside the node: an all-reduce every step, plus the outer one's share.
    assert_eq!(d.intra_bytes, ddp.intra_bytes * (1.0 + 1.0 / 50.0));
    let plans = p.plan();
    let row = |name: &str| plans.iter().find(|x| x.name == name).unwrap().clone();
    let (dl, dh) = (row("diloco"), row("diloco-hybrid"));
    assert_eq!((dl.diloco_inner_steps, dl.exact), (Some(50), false));
    assert_eq!(dh.strategy, Strategy::Hybrid);
    assert_eq!(dl.comm_bytes_inter, row("ddp").comm_bytes_inter / 50.0);
    assert_eq!(dl.optim_bytes, row("ddp").optim_bytes + 8.0 * p.params);
    assert_eq!(dh.optim_bytes, row("hybrid").optim_bytes + 8.0 * p.params);
    // On a slow network it is the fastest, but recommended only when allowed.
    p.inter = Link::gbits(0.02, 1000.0);
    let fastest = |plans: &[StrategyPlan]| {
        plans
            .iter()
            .max_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s))
            .unwrap()
            .name
            .clone()
    };
    let plans = p.plan();
    assert!(fastest(&plans).starts_with("diloco"));
    let rec = plans.iter().find(|x| x.recommended).unwrap();
    assert!(rec.exact, "{} recommended without --allow diloco", rec.name);
    p.diloco = Some(DilocoPlan {
        inner_steps: 50,
        allowed: true,
    });
    let plans = p.plan();
    let rec = plans.iter().find(|x| x.recommended).unwrap();
    assert!(rec.name.starts_with("diloco"), "{}", rec.name);
    assert!(reason(&plans, p.device_mem).starts_with("diloco"));
}

/// int8 carries one byte per element plus an f32 scale per 128: 33/128 of f32's bytes between
/// nodes.
#[test]
fn int8_wire_bytes() {
    let mut p = zero_paper();
    p.wire = WireDtype::F32;
    let f32_bytes = p.comm(Strategy::Zero2);
    p.wire = WireDtype::Int8;
    let int8 = p.comm(Strategy::Zero2);
    let k = 33.0 / 128.0;
    assert!((int8.inter_bytes / f32_bytes.inter_bytes - k).abs() < 1e-12);
    // Inside the node elements move as the model holds them: the wire dtype is between nodes.
    assert_eq!(int8.intra_bytes, f32_bytes.intra_bytes);
    assert_eq!(int8.volume, f32_bytes.volume, "the elements are the same");
}

/// HSDP's prefetch hides its two node gathers (2/3 of its intra-node time); its reductions
/// (the inter-node all-reduce included) hide behind the backward pass.
#[test]
fn hsdp_prefetch_hides_its_node_gathers() {
    let mut p = zero_paper();
    p.device_mem = 1e15;
    p.intra = Link::preset("pcie4").unwrap();
    p.tflops = 5.0; // compute-bound: every gather is hidden
    let hsdp = |p: &PlanInput| p.plan().into_iter().find(|x| x.name == "hsdp").unwrap();
    let plain = hsdp(&p);
    p.prefetch = true;
    let pre = hsdp(&p);
    let c = p.comm(Strategy::Hsdp);
    assert!(pre.compute_s > 2.0 * c.intra_s / 3.0);
    // The reductions (the all-reduce across nodes, a third of the node time) hide behind
    // the backward pass, 3/4 of compute (it recomputes), as far as it lasts.
    let red = c.inter_s + c.intra_s / 3.0;
    let red_wait = red_exposed(red, 0.75 * pre.compute_s, 12.0);
    let want = pre.compute_s + c.seconds() - 2.0 * c.intra_s / 3.0 - red + red_wait;
    assert!((pre.step_s - want).abs() < 1e-9, "{} vs {want}", pre.step_s);
    let want = plain.compute_s + c.seconds() - red + red_wait;
    assert!(
        (plain.step_s - want).abs() < 1e-9,
        "{} vs {want}",
        plain.step_s
    );
}

/// wiretrain runs ZeRO-3 and HSDP unit by unit, recomputing each unit's forward: their rows
/// charge 8Ψ FLOPs per token and recomputed activations whether or not --recompute is given.
#[test]
fn stage_3_rows_always_recompute() {
    let mut p = zero_paper();
    p.shape = Some(Shape {
        layers: 12,
        hidden: 768,
        heads: 12,
        vocab: 50257,
    });
    let plans = p.plan();
    let row = |name: &str| plans.iter().find(|x| x.name == name).unwrap();
    for name in ["zero3", "hsdp"] {
        assert_eq!(
            row(name).compute_s,
            row("ddp").compute_s * 8.0 / 6.0,
            "{name}"
        );
        assert!(row(name).activation_bytes < row("ddp").activation_bytes / 10.0);
    }
    assert_eq!(row("zero2").compute_s, row("ddp").compute_s);
    p.recompute = true;
    let plans = p.plan();
    let c: Vec<f64> = plans.iter().map(|x| x.compute_s).collect();
    assert!(c.iter().all(|&x| x == c[0]), "{c:?}");
}

/// A row of its own wire dtype (`--wire f32,diloco=int8`): DiLoCo's deltas travel as int8
/// (33/128 of f32's bytes between nodes), the other rows keep f32.
#[test]
fn a_row_can_put_its_own_dtype_on_the_wire() {
    let mut p = zero_paper();
    p.wire = WireDtype::F32;
    p.diloco = Some(DilocoPlan {
        inner_steps: 8,
        allowed: true,
    });
    let row = |p: &PlanInput, n: &str| p.plan().into_iter().find(|x| x.name == n).unwrap();
    let (ddp, dil) = (row(&p, "ddp"), row(&p, "diloco"));
    p.wire_rows = vec![("diloco".into(), WireDtype::Int8)];
    let (ddp8, dil8) = (row(&p, "ddp"), row(&p, "diloco"));
    assert_eq!(ddp.comm_bytes_inter, ddp8.comm_bytes_inter);
    assert_eq!((ddp8.wire, dil8.wire), (WireDtype::F32, WireDtype::Int8));
    let k = dil8.comm_bytes_inter / dil.comm_bytes_inter;
    assert!((k - 33.0 / 128.0).abs() < 1e-12, "{k}");
    assert!(dil8.step_s < dil.step_s);
}
