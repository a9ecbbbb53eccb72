//! Node certificates over real QUIC handshakes on loopback: a peer is accepted only with a
//! certificate signed by the job CA (derived from the token), and a pinned connection only by
//! the exact node certificate the rank table names. What the coordinator records is the
//! fingerprint of the certificate the peer actually presented.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use wiretrain_comm::tls::{JobIdentity, Mismatch, SERVER_NAME, Token, peer_sha256};

fn server(id: &JobIdentity) -> quinn::Endpoint {
    let sc = quinn::ServerConfig::with_crypto(Arc::new(id.server_config().unwrap()));
    quinn::Endpoint::server(sc, "127.0.0.1:0".parse().unwrap()).unwrap()
}

/// Client `client` dials `srv` with `pin`; returns the client's result, what it recorded as
/// the reason, and the server's view (the fingerprint of the accepted client, if accepted).
async fn dial(
    srv: &quinn::Endpoint,
    client: &JobIdentity,
    pin: Option<String>,
) -> (bool, Arc<Mismatch>, Option<String>) {
    let mm = Arc::new(Mismatch::default());
    let cc = quinn::ClientConfig::new(Arc::new(client.client_config(mm.clone(), pin).unwrap()));
    let ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let s = srv.clone();
    let accepted = tokio::spawn(async move {
        let inc = s.accept().await?;
        let conn = inc.await.ok()?;
        // Wait until the server has the client's certificate (or the connection dies).
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.accept_uni()).await;
        peer_sha256(&conn)
    });
    let ok = match ep
        .connect_with(cc, srv.local_addr().unwrap(), SERVER_NAME)
        .unwrap()
        .await
    {
        Ok(c) => {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let alive = c.close_reason().is_none();
            c.close(0u32.into(), b"done");
            alive
        }
        Err(_) => false,
    };
    let seen = tokio::time::timeout(Duration::from_secs(5), accepted)
        .await
        .ok()
        .and_then(|r| r.ok())
        .flatten();
    (ok, mm, seen)
}

#[tokio::test]
async fn only_the_pinned_node_of_the_same_job_gets_in() {
    let token = Token::generate();
    let node_a = JobIdentity::from_token(&token).unwrap();
    let node_b = JobIdentity::from_token(&token).unwrap();
    let node_c = JobIdentity::from_token(&token).unwrap();
    let stranger = JobIdentity::from_token(&Token::generate()).unwrap();
    let srv = server(&node_a);

    // Same job, the pin names node A: in, and A records B's real certificate.
    let (ok, mm, seen) = dial(&srv, &node_b, Some(node_a.node_fingerprint())).await;
    assert!(ok && !mm.job.load(Ordering::SeqCst) && !mm.node.load(Ordering::SeqCst));
    assert_eq!(seen, Some(node_b.node_fingerprint()));

    // Same job, but the pin names node C: the client refuses A (a node of the job, not the
    // one the table names).
    let (ok, mm, _) = dial(&srv, &node_b, Some(node_c.node_fingerprint())).await;
    assert!(!ok);
    assert!(mm.node.load(Ordering::SeqCst) && !mm.job.load(Ordering::SeqCst));

    // Another token: the server's certificate is not signed by the client's job CA...
    let (ok, mm, _) = dial(&srv, &stranger, None).await;
    assert!(!ok && mm.job.load(Ordering::SeqCst));
    // ... and the other way round: a node of this job never connects to the stranger's server.
    let stranger_srv = server(&stranger);
    let (ok, _, seen) = dial(&stranger_srv, &node_b, None).await;
    assert!(!ok && seen.is_none());
}

/// The joiner → coordinator link pinned: node 0 writes its certificate's fingerprint (as
/// `launch` has it do); a joiner given it joins, a joiner given another fingerprint is refused
/// at the handshake naming the expected certificate, and a malformed one is a config error.
#[test]
fn a_joiner_given_the_coordinators_fingerprint_pins_it() {
    use wiretrain_comm::{Node, NodeConfig};
    let dir = std::env::temp_dir().join(format!("wiretrain-pin-master-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (addr_file, fp_file) = (dir.join("addr"), dir.join("sha256"));
    let _ = std::fs::remove_file(&addr_file);
    let token = || common::strong("pin-master");
    let (af, ff) = (addr_file.clone(), fp_file.clone());
    let node0 = std::thread::spawn(move || {
        let mut cfg =
            NodeConfig::new(2, Some(0), "127.0.0.1:0".parse().unwrap(), 1, token()).unwrap();
        cfg.addr_file(af)
            .fingerprint_file(ff)
            .rendezvous_timeout(Duration::from_secs(20));
        Node::join(cfg).map(|n| {
            let _ = n.shutdown();
        })
    });
    let master = common::node0_addr(&addr_file);
    let fp = std::fs::read_to_string(&fp_file).expect("node 0 wrote its fingerprint first");
    assert_eq!(fp.trim().len(), 64, "{fp}");

    let joiner = |pin: &str, bind: &str| {
        let mut cfg = NodeConfig::new(2, Some(1), master, 1, token()).unwrap();
        cfg.bind(bind.parse().unwrap())
            .rendezvous_timeout(Duration::from_secs(5));
        cfg.master_sha256(pin).unwrap();
        Node::join(cfg)
    };
    // Another certificate than the one named: refused at the handshake, not after.
    let wrong = "ab".repeat(32);
    let e = joiner(&wrong, "127.0.0.3:0").map(|_| ()).unwrap_err();
    let e = wiretrain_comm::error::report(&e);
    assert!(e.contains(&wrong) && e.contains("certificate"), "{e}");
    // The right one: the job forms.
    let n = joiner(&fp, "127.0.0.2:0").expect("the pinned coordinator is accepted");
    let _ = n.shutdown();
    node0.join().unwrap().expect("node 0");
    // Malformed: a config error naming the setting.
    let mut cfg = NodeConfig::new(2, Some(1), master, 1, token()).unwrap();
    let e = cfg
        .master_sha256("abc")
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("master_sha256") && e.contains("64 hex"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
