//! Node certificates over real QUIC handshakes on loopback: a peer is accepted only with a
//! certificate signed by the job CA (derived from the token), and a pinned connection only by
//! the exact node certificate the rank table names. What the coordinator records is the
//! fingerprint of the certificate the peer actually presented.

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
