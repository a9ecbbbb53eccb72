//! Tests of `plan`.

use super::*;

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
        tflops: 100.0,
        intra: Link::preset("nvlink4").unwrap(),
        inter: Link::preset("ib-hdr").unwrap(),
        recompute: false,
        overlap: 0.0,
        prefetch: false,
        rank_order: RankOrder::NodeMajor,
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
        let moved = (intra + inter) / p.wire.bytes();
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
            Strategy::Hybrid
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
    // Compute-bound (slower devices): only the reduce-scatter is exposed.
    p.tflops = 5.0;
    let pre = z3(&p);
    assert!(pre.compute_s >= 2.0 * pre.comm_s / 3.0);
    let want = pre.compute_s + pre.comm_s / 3.0;
    assert!((pre.step_s - want).abs() < 1e-9, "{} vs {want}", pre.step_s);
    // Other strategies are unaffected.
    assert_eq!(
        plain.step_s - plain.compute_s,
        plain.comm_s.max(0.0),
        "no overlap without prefetch"
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
    let mut p = zero_paper();
    p.overlap = 2.0;
    assert!(p.validate().is_err());
    assert!(zero_paper().validate().is_ok());
}
