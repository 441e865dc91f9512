//! Servers that speak only TLS, with a test certificate authority made here. Declared with
//! `#[path]` by the tests that need it (feature `tls`), beside `mod support;`, so that other
//! crates sharing `support/` need neither the TLS dependencies nor the feature.
#![allow(dead_code)]

use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::{Cluster, Flavor, Server, TlsClient, free_port};

/// A fresh test CA and a certificate for 127.0.0.1 signed by it, in PEM.
struct TestCerts {
    ca: String,
    cert: String,
    key: String,
}

fn make_certs() -> TestCerts {
    // rustls needs one process-wide crypto provider, for the test-side clients too.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    // Distinct names: with rcgen's default name on both, OpenSSL (redis-cli, the cluster bus)
    // takes the server certificate for a self-signed one and refuses it.
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "leasehold test CA");
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().expect("server key");
    let mut params =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("server params");
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "127.0.0.1");
    let cert = params.signed_by(&key, &issuer).expect("server certificate");
    TestCerts {
        ca: ca_cert.pem(),
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

/// Writes the certificates into `dir` and returns the server arguments for TLS only on `port`.
fn tls_args(certs: &TestCerts, dir: &std::path::Path, port: u16) -> Vec<String> {
    let file = |name: &str, pem: &str| {
        let path = dir.join(name);
        std::fs::write(&path, pem).expect("write a test certificate");
        path.to_string_lossy().into_owned()
    };
    vec![
        // The plain port (given first by the support) is closed: TLS only.
        "--port".to_owned(),
        "0".to_owned(),
        "--tls-port".to_owned(),
        port.to_string(),
        "--tls-cert-file".to_owned(),
        file("server.crt", &certs.cert),
        "--tls-key-file".to_owned(),
        file("server.key", &certs.key),
        "--tls-ca-cert-file".to_owned(),
        file("ca.crt", &certs.ca),
        "--tls-auth-clients".to_owned(),
        "no".to_owned(),
    ]
}

const CLIENT: TlsClient = |url, ca| {
    redis::Client::build_with_tls(
        url,
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca),
        },
    )
};

/// Starts a server that speaks only TLS on a free port, with a certificate for 127.0.0.1 signed
/// by a fresh test CA (`Server::tls_ca` holds the CA, for clients to trust).
pub fn start_tls(flavor: Flavor) -> Server {
    let certs = make_certs();
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port();
    let extra = tls_args(&certs, dir.path(), port);
    Server::start_configured(
        flavor,
        port,
        extra,
        dir,
        Some((certs.ca.into_bytes(), CLIENT)),
    )
}

/// A free port whose cluster-bus twin (port + 10000) is free too.
fn free_port_pair() -> u16 {
    for _ in 0..200 {
        let port = free_port();
        if port < 55_535 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port pair for a cluster node")
}

/// A cluster of `masters` masters (no replicas) that speak only TLS, the cluster bus included
/// (`tls-cluster yes`, so the slot map names the TLS ports). Every node has the same test CA
/// (`Server::tls_ca`).
pub fn start_tls_cluster(flavor: Flavor, masters: usize) -> Cluster {
    let certs = make_certs();
    let nodes: Vec<Server> = (0..masters)
        .map(|_| {
            let dir = tempfile::tempdir().expect("temp dir");
            let port = free_port_pair();
            let mut extra = tls_args(&certs, dir.path(), port);
            extra.extend(
                [
                    "--tls-cluster",
                    "yes",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                ]
                .map(String::from),
            );
            Server::start_configured(
                flavor,
                port,
                extra,
                dir,
                Some((certs.ca.clone().into_bytes(), CLIENT)),
            )
        })
        .collect();
    let ca_file = tempfile::NamedTempFile::new().expect("CA file");
    std::fs::write(ca_file.path(), &certs.ca).expect("write the CA");
    let mut create = Command::new("redis-cli");
    create
        .arg("--tls")
        .arg("--cacert")
        .arg(ca_file.path())
        .arg("--cluster")
        .arg("create");
    for n in &nodes {
        create.arg(format!("127.0.0.1:{}", n.port));
    }
    let out = create
        .arg("--cluster-yes")
        .output()
        .expect("run redis-cli --cluster create");
    assert!(
        out.status.success(),
        "TLS cluster create failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let start = Instant::now();
    while !nodes.iter().all(|n| {
        redis::cmd("CLUSTER")
            .arg("INFO")
            .query::<String>(&mut n.conn())
            .is_ok_and(|i| i.contains("cluster_state:ok") && i.contains("cluster_slots_ok:16384"))
    }) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the TLS cluster did not become healthy"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Cluster { nodes }
}
