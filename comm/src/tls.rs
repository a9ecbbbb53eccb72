//! Job identity and TLS 1.3 configuration.
//!
//! Every node derives the same Ed25519 key and self-signed certificate from the job token
//! (HMAC-SHA256 of the token as the key seed), generated with rcgen. Both ends of every QUIC
//! connection present that certificate and accept only exactly that certificate (mutual TLS,
//! pinned). So a peer that does not know the token cannot complete a handshake, the token
//! itself never crosses the wire, and there is no plaintext fallback.

use crate::error::TransportError;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};
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

    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

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

/// The certificate and key every node of a job derives from its token.
pub struct JobIdentity {
    cert: CertificateDer<'static>,
    key: PrivatePkcs8KeyDer<'static>,
    provider: Arc<CryptoProvider>,
}

impl fmt::Debug for JobIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobIdentity").finish_non_exhaustive()
    }
}

impl JobIdentity {
    pub fn from_token(token: &Token) -> Result<Self, TransportError> {
        let tls = |e: String| TransportError::Tls(e);
        let mac_key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.expose());
        let seed = ring::hmac::sign(&mac_key, b"wiretrain job identity v1");
        let seed: [u8; 32] = seed.as_ref().try_into().expect("sha256 is 32 bytes");
        let pair = ring::signature::Ed25519KeyPair::from_seed_unchecked(&seed)
            .map_err(|e| tls(format!("ed25519 seed: {e}")))?;
        use ring::signature::KeyPair as _;
        // PKCS#8 v2 for Ed25519 (RFC 8410), the exact layout ring itself produces.
        let mut pkcs8 = hex_bytes("3051020101300506032b657004220420");
        pkcs8.extend_from_slice(&seed);
        pkcs8.extend_from_slice(&hex_bytes("812100"));
        pkcs8.extend_from_slice(pair.public_key().as_ref());
        let key = PrivatePkcs8KeyDer::from(pkcs8);
        let rc_key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&key, &rcgen::PKCS_ED25519)
            .map_err(|e| tls(format!("rcgen key: {e}")))?;
        let mut params = rcgen::CertificateParams::new(vec![SERVER_NAME.to_string()])
            .map_err(|e| tls(format!("certificate params: {e}")))?;
        params.serial_number = Some(rcgen::SerialNumber::from_slice(&seed[..16]));
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "wiretrain job");
        let cert = params
            .self_signed(&rc_key)
            .map_err(|e| tls(format!("self-signed certificate: {e}")))?;
        Ok(Self {
            cert: cert.der().clone(),
            key,
            provider: Arc::new(rustls::crypto::ring::default_provider()),
        })
    }

    /// SHA-256 fingerprint of the job certificate (safe to log: reveals nothing of the token).
    pub fn fingerprint(&self) -> String {
        let d = ring::digest::digest(&ring::digest::SHA256, &self.cert);
        d.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The QUIC server side: requires and pins the client's certificate.
    pub fn server_config(&self) -> Result<QuicServerConfig, TransportError> {
        let verifier = Arc::new(Pinned::new(self, Arc::new(AtomicBool::new(false))));
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

    /// The QUIC client side: pins the server's certificate and presents ours. `mismatch` is
    /// set when the server presented a different certificate (a different job token).
    pub fn client_config(
        &self,
        mismatch: Arc<AtomicBool>,
    ) -> Result<QuicClientConfig, TransportError> {
        let verifier = Arc::new(Pinned::new(self, mismatch));
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

/// Accepts exactly the job certificate, on both sides of the handshake.
#[derive(Debug)]
struct Pinned {
    expected: CertificateDer<'static>,
    provider: Arc<CryptoProvider>,
    mismatch: Arc<AtomicBool>,
}

impl Pinned {
    fn new(id: &JobIdentity, mismatch: Arc<AtomicBool>) -> Self {
        Self {
            expected: id.cert.clone(),
            provider: id.provider.clone(),
            mismatch,
        }
    }

    fn check(&self, presented: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        // Constant time: the comparison takes as long wherever the first difference is.
        let (a, b) = (presented.as_ref(), self.expected.as_ref());
        let diff = a
            .iter()
            .zip(b)
            .fold(u8::from(a.len() != b.len()), |acc, (x, y)| acc | (x ^ y));
        if std::hint::black_box(diff) == 0 {
            Ok(())
        } else {
            self.mismatch.store(true, Ordering::SeqCst);
            Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn tls13(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity)
            .map(|()| ServerCertVerified::assertion())
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
        self.tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.schemes()
    }
}

impl ClientCertVerifier for Pinned {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity)
            .map(|()| ClientCertVerified::assertion())
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
        self.tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_is_deterministic_per_token() {
        let a = JobIdentity::from_token(&"secret-a".into()).unwrap();
        let a2 = JobIdentity::from_token(&"secret-a".into()).unwrap();
        let b = JobIdentity::from_token(&"secret-b".into()).unwrap();
        assert_eq!(a.cert, a2.cert);
        assert_ne!(a.cert, b.cert);
        assert_eq!(a.fingerprint().len(), 16);
        a.server_config().unwrap();
        a.client_config(Arc::new(AtomicBool::new(false))).unwrap();
    }

    #[test]
    fn token_debug_is_redacted() {
        let t = Token::from("hunter2");
        assert!(!format!("{t:?}").contains("hunter2"));
        assert_eq!(Token::generate().expose().len(), 64);
    }
}
