//! A misconfigured layer answers every request 500, and says why in the log once, as an error,
//! not once per request: a busy route would otherwise bury the log in one line repeated. And a
//! lease that ran out under a handler that could not be cancelled is logged.
//! A test binary of its own, since it installs the process's global subscriber.

#[path = "../../tests/support/captured.rs"]
mod captured;
mod common;
#[path = "../../tests/support/mod.rs"]
mod support;

use std::time::Duration;

use axum::body::Body;
use axum::handler::HandlerWithoutStateExt;
use captured::Captured;
use common::claim_name;
use http::StatusCode;
use lock_tower::{DedupeLayer, KeyExtractor, LockLayer};
use tower_layer::Layer;
use tower_service::Service;

/// The lines of `log` holding `what`, at `level`.
fn count(log: &Captured, level: &str, what: &str) -> usize {
    log.text()
        .lines()
        .filter(|l| l.contains(level) && l.contains(what))
        .count()
}

async fn ok() -> &'static str {
    "ok"
}

/// Sends `n` POSTs through `svc`, each expected to be refused with a 500.
async fn refused<S, B>(svc: &mut S, n: usize)
where
    S: Service<http::Request<Body>, Response = http::Response<B>>,
    S::Error: std::fmt::Debug,
{
    for i in 0..n {
        let req = http::Request::post("/accounts/7/withdraw")
            .header("idempotency-key", format!("\"delivery-{i}\""))
            .body(Body::empty())
            .expect("request");
        let res = svc.call(req).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setup_problem_is_logged_once_per_layer() {
    let log = Captured::default();
    tracing_subscriber::fmt()
        .with_writer(log.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .init();

    let prefix = "the layer's key prefix is unusable";
    let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::path_segment(1))
        .key_prefix("tenant{a}:");
    let mut svc = layer.layer(ok.into_service());
    refused(&mut svc, 3).await;
    // A second service from the same layer (as a router makes one per route) shares its log.
    let mut again = layer.layer(ok.into_service());
    refused(&mut again, 2).await;
    assert_eq!(count(&log, "ERROR", prefix), 1);
    assert_eq!(count(&log, "DEBUG", prefix), 4);

    // Another setting out of range, on another layer: logged once again, for that layer.
    let ttl = "the layer's lease settings are out of range";
    let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::path_segment(1))
        .ttl(Duration::from_micros(10));
    let mut svc = layer.layer(ok.into_service());
    refused(&mut svc, 3).await;
    assert_eq!(
        (count(&log, "ERROR", ttl), count(&log, "DEBUG", ttl)),
        (1, 2)
    );

    let retention = "the layer's settings are out of range";
    let layer = DedupeLayer::new(lock_core::Locker::memory()).retention(Duration::ZERO);
    let mut svc = layer.layer(ok.into_service());
    refused(&mut svc, 3).await;
    assert_eq!(
        (
            count(&log, "ERROR", retention),
            count(&log, "DEBUG", retention)
        ),
        (1, 2)
    );

    // On a Redlock quorum, which has no store for results (lock-tower's README: "logged at
    // `error` once per layer and at `debug` after").
    let servers: Vec<support::Server> = (0..3)
        .map(|_| support::Server::start(support::Flavor::Redis))
        .collect();
    let urls: Vec<String> = servers.iter().map(support::Server::url).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let quorum = lock_core::Locker::redlock(&urls).await.expect("connect");
    let store = "the layer's backend cannot keep results";
    let layer = DedupeLayer::new(quorum);
    let mut svc = layer.layer(ok.into_service());
    refused(&mut svc, 3).await;
    let mut again = layer.layer(ok.into_service());
    refused(&mut again, 1).await;
    assert_eq!(
        (count(&log, "ERROR", store), count(&log, "DEBUG", store)),
        (1, 3)
    );

    // A handler that blocks its thread past the lease, on a runtime with no other thread to
    // renew it: it cannot be cancelled (it never waits), so its answer goes out, but the log
    // says the lease ran out under it.
    let ran_out = "the lease had run out by the end of the response";
    let status = std::thread::spawn(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::path_segment(1))
                .ttl(Duration::from_millis(100));
            let blocking = || async {
                std::thread::sleep(Duration::from_millis(300));
                "done"
            };
            let mut svc = layer.layer(blocking.into_service());
            let req = http::Request::post("/accounts/7/withdraw")
                .body(Body::empty())
                .expect("request");
            svc.call(req).await.expect("infallible").status()
        })
    })
    .join()
    .expect("the blocking runtime's thread");
    assert_eq!(status, StatusCode::OK);
    assert_eq!(count(&log, "WARN", ran_out), 1);

    // Refusals only an operator can mend are logged at `error`, one line per request: a key
    // whose stored fence is 2^64 - 1 (through either layer), and a stored result changed from
    // outside.
    let server = &servers[0];
    let locker = lock_core::Locker::redis(&server.url())
        .await
        .expect("connect");
    let exhausted = "no fence is left for the key";
    let key = locker.lock_key("7").expect("key");
    let _: () = server.cmd(&["SET", key.fence_key(), &u64::MAX.to_string()]);
    let layer = LockLayer::new(locker.clone(), KeyExtractor::path_segment(1));
    let res = post(&mut layer.layer(ok.into_service()), "x").await;
    assert_eq!(res, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(count(&log, "ERROR", exhausted), 1);
    // The claim of delivery "spent" in the default scope: the layer's claims namespace, and
    // the key's digest as its name (as in the dedupe tests).
    let claims = locker.with_namespace("dedupe").expect("namespace");
    let claim = claims
        .lock_key(&claim_name("", "spent"))
        .expect("claim key");
    let _: () = server.cmd(&["SET", claim.fence_key(), &u64::MAX.to_string()]);
    let mut dedupe = DedupeLayer::new(locker.clone()).layer(ok.into_service());
    let res = post(&mut dedupe, "spent").await;
    assert_eq!(res, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(count(&log, "ERROR", exhausted), 2);

    let unreadable = "stored result unreadable";
    assert_eq!(post(&mut dedupe, "kept").await, StatusCode::OK);
    let results: Vec<String> = server.cmd(&["KEYS", "*:result"]);
    assert_eq!(results.len(), 1, "{results:?}");
    let _: i64 = server.cmd(&["HSET", &results[0], "status", "42"]);
    assert_eq!(
        post(&mut dedupe, "kept").await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(count(&log, "ERROR", unreadable), 1);
}

/// Sends a POST with idempotency key `key` through `svc`; its status.
async fn post<S, B>(svc: &mut S, key: &str) -> StatusCode
where
    S: Service<http::Request<Body>, Response = http::Response<B>>,
    S::Error: std::fmt::Debug,
{
    let req = http::Request::post("/accounts/7/withdraw")
        .header("idempotency-key", format!("\"{key}\""))
        .body(Body::empty())
        .expect("request");
    svc.call(req).await.expect("infallible").status()
}
