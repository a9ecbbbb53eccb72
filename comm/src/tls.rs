//! Job identity and TLS 1.3 configuration.
//!
//! The job token is the only secret. Every node derives from it the same Ed25519 key and a
//! self-signed *job CA* certificate (HMAC-SHA256 of the token as the key seed, rcgen), then
//! makes a fresh Ed25519 key of its own and a *node certificate* signed by the job CA. Every
//! QUIC connection is mutual TLS 1.3 with node certificates, checked in two layers:
//! - the chain: a certificate must be signed by the job CA (webpki), which only holders of the
//!   token can produce; a peer of another job fails here ("different job token");
//! - the pin: each node's certificate fingerprint (SHA-256) travels in the rank table the
//!   rendezvous distributes, and every node-to-node connection checks the exact fingerprint of
//!   the node it expects (client side in the handshake, server side right after it).
//!
//! The token never crosses the wire, node keys never leave their process, and there is no
//! plaintext fallback.

use crate::error::TransportError;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::RootCertStore;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// ALPN protocol id of wiretrain connections.
pub const ALPN: &[u8] = b"wiretrain";
/// The server name clients ask for (certificates are pinned, not name-checked).
pub const SERVER_NAME: &str = "wiretrain";

/// A job token. Its `Debug` never prints the secret.
#[derive(Clone)]
pub struct Token(Vec<u8>);

impl Token {
    /// Wraps the secret bytes as given (no check of its strength: see
    /// [`Self::strength_bits`]).
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        Self(secret.into())
    }

    /// A fresh random 256-bit token, hex encoded (for local jobs).
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand::random();
        Self(
            bytes
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
                .into_bytes(),
        )
    }

    /// The secret bytes (the key material certificates are derived from); never log them.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    /// The most entropy the token's text can carry, in bits: 4 per character of a hex token,
    /// 6 per character otherwise (base64, or printable text, whose ~6.6 bits per character a
    /// human choice never reaches), and 0 for a token of fewer than 8 distinct characters
    /// (`000…`, `abab…`). An upper bound: it can refuse a weak token, never vouch for one.
    pub fn strength_bits(&self) -> u32 {
        let t = &self.0;
        let mut seen = [false; 256];
        t.iter().for_each(|&b| seen[b as usize] = true);
        if seen.iter().filter(|&&s| s).count() < 8 {
            return 0;
        }
        let per_char = if t.iter().all(u8::is_ascii_hexdigit) {
            4
        } else {
            6
        };
        let chars = t.iter().filter(|&&b| b != b'=').count();
        u32::try_from(chars)
            .unwrap_or(u32::MAX)
            .saturating_mul(per_char)
    }

    /// Refuses a token that cannot carry [`MIN_TOKEN_BITS`]. TLS 1.3 shows a node's
    /// certificate, signed by the job CA the token derives, to any client before client
    /// authentication, so a weak token could be guessed offline from one harvested
    /// certificate.
    pub fn check_strength(&self) -> Result<(), String> {
        let bits = self.strength_bits();
        if bits >= MIN_TOKEN_BITS {
            return Ok(());
        }
        let what = if self.0.is_empty() {
            "is empty".to_string()
        } else {
            format!("carries at most {bits} bits ({} characters)", self.0.len())
        };
        Err(format!(
            "the job token {what}; at least {MIN_TOKEN_BITS} bits are needed (32 hex or 22 \
             base64 characters, random): make one with `openssl rand -hex 32`"
        ))
    }
}

/// The least entropy a job token must be able to carry, in bits.
pub const MIN_TOKEN_BITS: u32 = 128;

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token(<{} bytes redacted>)", self.0.len())
    }
}

impl From<String> for Token {
    fn from(s: String) -> Self {
        Self(s.into_bytes())
    }
}

impl From<&str> for Token {
    fn from(s: &str) -> Self {
        Self(s.as_bytes().to_vec())
    }
}

/// This node's TLS identity: the job CA (from the token) and a fresh node certificate.
pub struct JobIdentity {
    ca_cert: CertificateDer<'static>,
    cert: CertificateDer<'static>,
    key: PrivatePkcs8KeyDer<'static>,
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
}

impl fmt::Debug for JobIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobIdentity")
            .field("node_sha256", &self.node_fingerprint())
            .finish_non_exhaustive()
    }
}

/// Why a handshake was refused, as the dialing side saw it.
#[derive(Debug, Default)]
pub struct Mismatch {
    /// The peer's certificate is not signed by this job's CA (another job token).
    pub job: AtomicBool,
    /// The peer is of this job but not the node the rank table names (a pinned fingerprint
    /// differs).
    pub node: AtomicBool,
}

/// Lowercase hex SHA-256 of a certificate: the fingerprint the rank table carries.
pub fn cert_sha256(cert: &[u8]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, cert);
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// The fingerprint of the certificate the peer of `conn` presented.
pub fn peer_sha256(conn: &quinn::Connection) -> Option<String> {
    let id = conn.peer_identity()?;
    let certs = id.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    certs.first().map(|c| cert_sha256(c))
}

/// Constant-time equality of two fingerprints (no early exit on the first difference).
pub fn same_fingerprint(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let diff = a
        .iter()
        .zip(b)
        .fold(u8::from(a.len() != b.len()), |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// How long a node certificate is valid: from a day before it was made (clocks of the nodes
/// may differ) to this long after.
pub const NODE_CERT_VALIDITY: std::time::Duration = std::time::Duration::from_secs(30 * 86_400);

impl JobIdentity {
    /// The identity of a job known by its token alone (see [`JobIdentity::for_job`]).
    pub fn from_token(token: &Token) -> Result<Self, TransportError> {
        Self::for_job(token, None)
    }

    /// The identity of job `job_id` (the launcher's nonce, Slurm's job id): mixed into the job
    /// CA, so a process of an earlier job that used the same token is not a member of this one.
    pub fn for_job(token: &Token, job_id: Option<&str>) -> Result<Self, TransportError> {
        let tls = |e: String| TransportError::Tls(e);
        let mac_key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.expose());
        let derive = |label: &str| -> [u8; 32] {
            let mut msg = label.as_bytes().to_vec();
            if let Some(j) = job_id {
                msg.extend_from_slice(b"\0job:");
                msg.extend_from_slice(j.as_bytes());
            }
            ring::hmac::sign(&mac_key, &msg)
                .as_ref()
                .try_into()
                .expect("sha256 is 32 bytes")
        };
        let seed = derive("wiretrain job identity v1");
        let pair = ring::signature::Ed25519KeyPair::from_seed_unchecked(&seed)
            .map_err(|e| tls(format!("ed25519 seed: {e}")))?;
        use ring::signature::KeyPair as _;
        // PKCS#8 v2 for Ed25519 (RFC 8410), the exact layout ring itself produces.
        let mut pkcs8 = hex_bytes("3051020101300506032b657004220420");
        pkcs8.extend_from_slice(&seed);
        pkcs8.extend_from_slice(&hex_bytes("812100"));
        pkcs8.extend_from_slice(pair.public_key().as_ref());
        let ca_key_der = PrivatePkcs8KeyDer::from(pkcs8);
        let ca_key =
            rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&ca_key_der, &rcgen::PKCS_ED25519)
                .map_err(|e| tls(format!("rcgen key: {e}")))?;
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())
            .map_err(|e| tls(format!("certificate params: {e}")))?;
        // The serial is public: its own derivation, never a part of the key's seed.
        ca.serial_number = Some(rcgen::SerialNumber::from_slice(
            &derive("wiretrain job CA serial v1")[..16],
        ));
        ca.distinguished_name = rcgen::DistinguishedName::new();
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "wiretrain job CA");
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
        ca.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca
            .self_signed(&ca_key)
            .map_err(|e| tls(format!("job CA certificate: {e}")))?;
        let node_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519)
            .map_err(|e| tls(format!("node key: {e}")))?;
        let mut node = rcgen::CertificateParams::new(vec![SERVER_NAME.to_string()])
            .map_err(|e| tls(format!("certificate params: {e}")))?;
        node.distinguished_name = rcgen::DistinguishedName::new();
        node.distinguished_name
            .push(rcgen::DnType::CommonName, "wiretrain node");
        // Valid for the job, not for ever (rcgen's default runs to the year 4096).
        let now = time::OffsetDateTime::now_utc();
        node.not_before = now - time::Duration::days(1);
        node.not_after = now + NODE_CERT_VALIDITY;
        node.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = node
            .signed_by(&node_key, &rcgen::Issuer::from_params(&ca, &ca_key))
            .map_err(|e| tls(format!("node certificate: {e}")))?;
        let mut roots = RootCertStore::empty();
        roots
            .add(ca_cert.der().clone())
            .map_err(|e| tls(format!("job CA as trust anchor: {e}")))?;
        Ok(Self {
            ca_cert: ca_cert.der().clone(),
            cert: cert.der().clone(),
            key: PrivatePkcs8KeyDer::from(node_key.serialize_der()),
            roots: Arc::new(roots),
            provider: Arc::new(rustls::crypto::ring::default_provider()),
        })
    }

    /// Short SHA-256 fingerprint of the job CA certificate (the same on every node of a job;
    /// safe to log: reveals nothing of the token).
    pub fn fingerprint(&self) -> String {
        cert_sha256(&self.ca_cert)[..16].to_string()
    }

    /// SHA-256 of this node's certificate, as the rank table carries it.
    pub fn node_fingerprint(&self) -> String {
        cert_sha256(&self.cert)
    }

    /// The QUIC server side: requires a client certificate signed by the job CA (which node
    /// it is, is checked against the rank table once the peer says who it is).
    pub fn server_config(&self) -> Result<QuicServerConfig, TransportError> {
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), self.provider.clone())
                .build()
                .map_err(|e| TransportError::Tls(e.to_string()))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TransportError::Tls(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(
                vec![self.cert.clone()],
                PrivateKeyDer::Pkcs8(self.key.clone_key()),
            )
            .map_err(|e| TransportError::Tls(e.to_string()))?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        QuicServerConfig::try_from(cfg).map_err(|e| TransportError::Tls(e.to_string()))
    }

    /// The QUIC client side: presents this node's certificate and requires the server's to be
    /// signed by the job CA and, with `pin`, to have exactly that fingerprint. `mismatch`
    /// records why a handshake was refused.
    pub fn client_config(
        &self,
        mismatch: Arc<Mismatch>,
        pin: Option<String>,
    ) -> Result<QuicClientConfig, TransportError> {
        let inner =
            WebPkiServerVerifier::builder_with_provider(self.roots.clone(), self.provider.clone())
                .build()
                .map_err(|e| TransportError::Tls(e.to_string()))?;
        let verifier = Arc::new(Pinned {
            inner,
            pin,
            mismatch,
        });
        let mut cfg = rustls::ClientConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TransportError::Tls(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(
                vec![self.cert.clone()],
                PrivateKeyDer::Pkcs8(self.key.clone_key()),
            )
            .map_err(|e| TransportError::Tls(e.to_string()))?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        QuicClientConfig::try_from(cfg).map_err(|e| TransportError::Tls(e.to_string()))
    }
}

fn hex_bytes(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("static hex"))
        .collect()
}

/// The client's server-certificate check: the job CA's chain (webpki), then the pin.
#[derive(Debug)]
struct Pinned {
    inner: Arc<WebPkiServerVerifier>,
    pin: Option<String>,
    mismatch: Arc<Mismatch>,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let v = self
            .inner
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
            .inspect_err(|_| self.mismatch.job.store(true, Ordering::SeqCst))?;
        if let Some(pin) = &self.pin
            && !same_fingerprint(pin, &cert_sha256(end_entity))
        {
            self.mismatch.node.store(true, Ordering::SeqCst);
            return Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ));
        }
        Ok(v)
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls13RequiredForQuic,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ca_is_deterministic_per_token_and_node_certificates_are_not() {
        let a = JobIdentity::from_token(&"secret-a".into()).unwrap();
        let a2 = JobIdentity::from_token(&"secret-a".into()).unwrap();
        let b = JobIdentity::from_token(&"secret-b".into()).unwrap();
        assert_eq!(a.ca_cert, a2.ca_cert);
        assert_ne!(a.ca_cert, b.ca_cert);
        assert_ne!(
            a.cert, a2.cert,
            "every node has its own key and certificate"
        );
        assert_eq!(a.fingerprint(), a2.fingerprint());
        assert_eq!(a.fingerprint().len(), 16);
        assert_eq!(a.node_fingerprint().len(), 64);
        a.server_config().unwrap();
        a.client_config(Arc::default(), Some(a2.node_fingerprint()))
            .unwrap();
        assert!(same_fingerprint("ab", "ab") && !same_fingerprint("ab", "ac"));
        assert!(!same_fingerprint("ab", "abc"));
    }

    #[test]
    fn the_job_id_is_part_of_the_ca_and_the_serial_reveals_no_seed() {
        let t = Token::generate();
        let a = JobIdentity::for_job(&t, Some("job-1")).unwrap();
        let a2 = JobIdentity::for_job(&t, Some("job-1")).unwrap();
        let b = JobIdentity::for_job(&t, Some("job-2")).unwrap();
        let none = JobIdentity::from_token(&t).unwrap();
        assert_eq!(a.ca_cert, a2.ca_cert);
        assert_ne!(a.ca_cert, b.ca_cert, "another job, another CA");
        assert_ne!(a.ca_cert, none.ca_cert);
        // The CA key's seed appears nowhere in the public certificate (its serial once held
        // half of it).
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, t.expose());
        let seed = ring::hmac::sign(&key, b"wiretrain job identity v1\0job:job-1");
        for half in seed.as_ref().chunks(16) {
            assert!(!a.ca_cert.windows(16).any(|w| w == half));
        }
        // A node certificate of job-1 does not verify under job-2's CA.
        let verify = |roots: &Arc<RootCertStore>, cert: &CertificateDer<'static>, at: u64| {
            WebPkiClientVerifier::builder_with_provider(
                roots.clone(),
                Arc::new(rustls::crypto::ring::default_provider()),
            )
            .build()
            .unwrap()
            .verify_client_cert(
                cert,
                &[],
                UnixTime::since_unix_epoch(std::time::Duration::from_secs(at)),
            )
            .is_ok()
        };
        let now = UnixTime::now().as_secs();
        assert!(verify(&a.roots, &a2.cert, now));
        assert!(!verify(&b.roots, &a.cert, now));
        // Node certificates are valid around now, not for ever.
        assert!(verify(&a.roots, &a.cert, now - 3600));
        assert!(!verify(&a.roots, &a.cert, now - 3 * 86_400));
        assert!(verify(
            &a.roots,
            &a.cert,
            now + NODE_CERT_VALIDITY.as_secs() - 3600
        ));
        assert!(!verify(
            &a.roots,
            &a.cert,
            now + NODE_CERT_VALIDITY.as_secs() + 3600
        ));
    }

    #[test]
    fn weak_tokens_are_refused_with_how_to_make_one() {
        for weak in ["", "hunter2", "token-A", &"0".repeat(64), &"ab".repeat(40)] {
            let e = Token::from(weak).check_strength().unwrap_err();
            assert!(e.contains("openssl rand -hex 32"), "{weak}: {e}");
        }
        // 31 hex characters are 124 bits, 32 are 128.
        let hex = "0123456789abcdef0123456789abcdef";
        assert!(Token::from(&hex[..31]).check_strength().is_err());
        assert_eq!(Token::from(hex).strength_bits(), 128);
        assert!(Token::from(hex).check_strength().is_ok());
        // base64 of 16 random bytes: 22 characters and padding.
        assert!(
            Token::from("q83vEjRWeJq83vEjRWeJqw==")
                .check_strength()
                .is_ok()
        );
        assert!(
            Token::from("q83vEjRWeJq83vEjRWe==")
                .check_strength()
                .is_err()
        );
        assert!(Token::generate().check_strength().is_ok());
    }

    #[test]
    fn token_debug_is_redacted() {
        let t = Token::from("hunter2");
        assert!(!format!("{t:?}").contains("hunter2"));
        assert_eq!(Token::generate().expose().len(), 64);
    }
}
