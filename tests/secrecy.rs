//! Tokens are secrets: whoever knows a holder's token can release or extend its lease. No error
//! and no trace event may show one, least of all another holder's. Every span and event, at
//! every level, is captured while two holders contend (on memory, a real `redis-server` and
//! `valkey-server`, a Redis Cluster and a Redlock quorum: each backend logs in its own code),
//! and the text is searched for both tokens.

#[path = "support/captured.rs"]
mod captured;
mod support;

use std::time::Duration;

use captured::Captured;
use leasehold::{Error, LockOptions, Locker};
use support::{Cluster, Flavor, Server};
use tracing_subscriber::util::SubscriberInitExt;

/// Two holders contend: busy, wait timeout, extend, a stale release, a lost lease, a drop.
/// Returns both tokens and every error's `Display` and `Debug` text.
async fn contend(locker: &Locker, other: &Locker) -> (Vec<String>, Vec<String>) {
    let o = LockOptions::new().ttl(Duration::from_millis(300));
    let a = locker.try_acquire("secret", &o).await.expect("a");
    let mut errors = Vec::new();
    let mut note = |e: Error| errors.push(format!("{e} | {e:?}"));
    match other.try_acquire("secret", &o).await {
        Err(e @ Error::Busy { .. }) => note(e),
        r => panic!("expected Busy: {r:?}"),
    }
    match other
        .acquire("secret", &o.clone().wait(Duration::from_millis(50)))
        .await
    {
        Err(e @ Error::WaitTimeout { .. }) => note(e),
        r => panic!("expected WaitTimeout: {r:?}"),
    }
    a.extend(Duration::from_millis(300)).await.expect("extend");
    // A holder without renewal outlives its lease; the other takes the key; the first one's
    // extend and release then meet another holder's token on the server.
    let stale = other
        .acquire(
            "stale",
            &o.clone().renew(false).ttl(Duration::from_millis(50)),
        )
        .await
        .expect("stale");
    let stale_token = stale.token().as_str().to_owned();
    tokio::time::sleep(Duration::from_millis(80)).await;
    let b = locker.try_acquire("stale", &o).await.expect("b");
    let refused = stale.extend(Duration::from_millis(300)).await;
    note(refused.expect_err("a stale holder's extend is refused"));
    let lease_debug = format!("{b:?}");
    let tokens = vec![
        a.token().as_str().to_owned(),
        b.token().as_str().to_owned(),
        stale_token,
    ];
    errors.push(lease_debug);
    drop(a);
    b.release().await.expect("release");
    tokio::time::sleep(Duration::from_millis(50)).await;
    (tokens, errors)
}

/// Where the two contending lockers run.
enum Setup {
    Memory,
    Server(Flavor),
    Cluster,
    Quorum,
}

async fn no_token_leaks(setup: Setup) {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
        // Every span is printed with its fields when it opens, event or not.
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::NEW)
        .with_writer(captured.clone())
        .with_ansi(false)
        .finish();
    let _guard = subscriber.set_default();
    // Kept until the end: dropped, the servers stop.
    let (mut servers, mut cluster) = (Vec::new(), None);
    let (locker, other) = match setup {
        Setup::Memory => {
            let memory = leasehold::AnyBackend::Memory(leasehold::MemoryBackend::new());
            (Locker::new(memory.clone()), Locker::new(memory))
        }
        Setup::Server(flavor) => {
            servers.push(Server::start(flavor));
            let url = servers[0].url();
            (
                Locker::redis(&url).await.expect("connect"),
                Locker::redis(&url).await.expect("connect"),
            )
        }
        Setup::Cluster => {
            let urls = cluster.insert(Cluster::start(Flavor::Redis, 3, 0)).urls();
            let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
            (
                Locker::redis_cluster(&urls).await.expect("connect"),
                Locker::redis_cluster(&urls).await.expect("connect"),
            )
        }
        Setup::Quorum => {
            servers.extend((0..3).map(|_| Server::start(Flavor::Redis)));
            let urls: Vec<String> = servers.iter().map(Server::url).collect();
            let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
            (
                Locker::redlock(&urls).await.expect("connect"),
                Locker::redlock(&urls).await.expect("connect"),
            )
        }
    };
    let (tokens, errors) = contend(&locker, &other).await;
    let log = captured.text();
    assert!(
        log.contains("secret"),
        "the subscriber captured nothing: {log}"
    );
    for token in &tokens {
        assert_eq!(token.len(), 32, "a token is 128 bits in hex");
        assert!(!log.contains(token.as_str()), "a token in the trace: {log}");
        for e in &errors {
            assert!(!e.contains(token.as_str()), "a token in an error: {e}");
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn no_token_in_errors_or_traces_on_memory() {
    no_token_leaks(Setup::Memory).await
}

#[tokio::test(flavor = "current_thread")]
async fn no_token_in_errors_or_traces_on_redis() {
    no_token_leaks(Setup::Server(Flavor::Redis)).await
}

#[tokio::test(flavor = "current_thread")]
async fn no_token_in_errors_or_traces_on_valkey() {
    no_token_leaks(Setup::Server(Flavor::Valkey)).await
}

#[tokio::test(flavor = "current_thread")]
async fn no_token_in_errors_or_traces_on_a_cluster() {
    no_token_leaks(Setup::Cluster).await
}

#[tokio::test(flavor = "current_thread")]
async fn no_token_in_errors_or_traces_on_a_quorum() {
    no_token_leaks(Setup::Quorum).await
}
