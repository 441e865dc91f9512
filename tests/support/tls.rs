//! A server that speaks only TLS, with a test certificate authority made here. Declared with
//! `#[path]` by the tests that need it (feature `tls`), beside `mod support;`, so that other
//! crates sharing `support/` need neither the TLS dependencies nor the feature.

use crate::support::{Flavor, Server, TlsClient, free_port};

/// Starts a server that speaks only TLS on a free port, with a certificate for 127.0.0.1 signed
/// by a fresh test CA (`Server::tls_ca` holds the CA, for clients to trust).
pub fn start_tls(flavor: Flavor) -> Server {
    // rustls needs one process-wide crypto provider, for the test-side clients too.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().expect("temp dir");
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().expect("server key");
    let params =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("server params");
    let cert = params.signed_by(&key, &issuer).expect("server certificate");
    let file = |name: &str, pem: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, pem).expect("write a test certificate");
        path.to_string_lossy().into_owned()
    };
    let port = free_port();
    let extra = vec![
        // The plain port (given first by the support) is closed: TLS only.
        "--port".to_owned(),
        "0".to_owned(),
        "--tls-port".to_owned(),
        port.to_string(),
        "--tls-cert-file".to_owned(),
        file("server.crt", cert.pem()),
        "--tls-key-file".to_owned(),
        file("server.key", key.serialize_pem()),
        "--tls-ca-cert-file".to_owned(),
        file("ca.crt", ca_cert.pem()),
        "--tls-auth-clients".to_owned(),
        "no".to_owned(),
    ];
    let client: TlsClient = |url, ca| {
        redis::Client::build_with_tls(
            url,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca),
            },
        )
    };
    Server::start_configured(
        flavor,
        port,
        extra,
        dir,
        Some((ca_cert.pem().into_bytes(), client)),
    )
}
