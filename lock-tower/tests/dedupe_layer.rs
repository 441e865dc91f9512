//! `DedupeLayer` over a real axum server and a real HTTP client, on memory, Redis and Valkey.

mod common;
#[path = "../../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use common::{Harness, Reply, send, serve};
use http::{Method, StatusCode};
use lock_tower::{DedupeLayer, Fence, KeyExtractor, Reason};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

on_every_backend!(
    concurrent_duplicates_run_the_handler_once,
    waiting_duplicates_all_get_the_replay,
    same_key_different_request_is_422,
    failed_first_attempt_is_not_stored,
    oversized_bodies,
    missing_or_malformed_keys,
    webhook_ids_and_github_scoping,
    json_id_key_and_body_handed_on,
    claim_loss_cancels_and_stores_nothing,
    result_is_not_stored_when_the_claim_changed_hands,
);

/// A webhook endpoint that counts its runs and answers something unique per run.
fn counting(layer: DedupeLayer, runs: Arc<AtomicUsize>, delay: Duration) -> Router {
    Router::new()
        .route(
            "/hooks/{name}",
            post(move |f: Option<Fence>, body: Bytes| {
                let runs = runs.clone();
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    tokio::time::sleep(delay).await;
                    (
                        StatusCode::CREATED,
                        [
                            ("content-type", "application/json"),
                            ("location", "/things/1"),
                            ("x-not-replayed", "1"),
                        ],
                        format!(
                            r#"{{"run":{n},"fence":{},"len":{}}}"#,
                            f.map_or(0, |f| f.0.0),
                            body.len()
                        ),
                    )
                }
            }),
        )
        .layer(layer)
}

async fn deliver(addr: std::net::SocketAddr, key: &str, body: &'static str) -> Reply {
    send(
        addr,
        Method::POST,
        "/hooks/a",
        &[("idempotency-key", key)],
        body,
    )
    .await
}

async fn concurrent_duplicates_run_the_handler_once(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = DedupeLayer::new(h.locker().await);
    let addr = serve(counting(layer, runs.clone(), Duration::from_millis(300))).await;
    let calls: Vec<_> = (0..20)
        .map(|_| tokio::spawn(async move { deliver(addr, r#""evt-1""#, "{}").await }))
        .collect();
    let mut originals = Vec::new();
    let mut replays = Vec::new();
    for c in calls {
        let r = c.await.expect("join");
        match r.status {
            StatusCode::CREATED if r.header("idempotent-replayed").is_none() => originals.push(r),
            StatusCode::CREATED => replays.push(r),
            StatusCode::CONFLICT => {
                assert!(r.header("retry-after").is_some(), "409 without Retry-After");
                assert_eq!(r.header("content-type"), Some("application/problem+json"));
            }
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran more than once"
    );
    assert_eq!(originals.len(), 1);
    let original = &originals[0];
    // After completion, a duplicate gets the stored answer, byte for byte.
    let again = deliver(addr, r#""evt-1""#, "{}").await;
    replays.push(again);
    for r in &replays {
        assert_eq!(r.status, StatusCode::CREATED);
        assert_eq!(r.body, original.body, "replayed bytes differ");
        assert_eq!(r.header("idempotent-replayed"), Some("true"));
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.header("location"), Some("/things/1"));
        assert_eq!(
            r.header("x-not-replayed"),
            None,
            "a header outside the allow-list"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The bare form of the same key is the same key.
    let bare = deliver(addr, "evt-1", "{}").await;
    assert_eq!(bare.header("idempotent-replayed"), Some("true"));
    // Another key runs.
    let other = deliver(addr, r#""evt-2""#, "{}").await;
    assert_eq!(other.header("idempotent-replayed"), None);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

async fn waiting_duplicates_all_get_the_replay(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = DedupeLayer::new(h.locker().await).wait(Duration::from_secs(30));
    let addr = serve(counting(layer, runs.clone(), Duration::from_millis(300))).await;
    let calls: Vec<_> = (0..20)
        .map(|_| tokio::spawn(async move { deliver(addr, r#""evt-w""#, "{}").await }))
        .collect();
    let mut bodies = Vec::new();
    let mut replayed = 0;
    for c in calls {
        let r = c.await.expect("join");
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
        replayed += usize::from(r.header("idempotent-replayed") == Some("true"));
        bodies.push(r.body);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(replayed, 19);
    assert!(bodies.iter().all(|b| *b == bodies[0]));
}

async fn same_key_different_request_is_422(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let locker = h.locker().await;
    let addr = serve(counting(
        DedupeLayer::new(locker.clone()),
        runs.clone(),
        Duration::ZERO,
    ))
    .await;
    assert_eq!(
        deliver(addr, r#""k""#, r#"{"a":1}"#).await.status,
        StatusCode::CREATED
    );
    let r = deliver(addr, r#""k""#, r#"{"a":2}"#).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    // Another path with the same key is a different request too.
    let r = send(
        addr,
        Method::POST,
        "/hooks/b",
        &[("idempotency-key", r#""k""#)],
        r#"{"a":1}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let layer = DedupeLayer::new(locker)
        .scope("conflicting")
        .reject_status(Reason::KeyReused, StatusCode::CONFLICT);
    let addr = serve(counting(layer, runs.clone(), Duration::ZERO)).await;
    assert_eq!(
        deliver(addr, r#""k""#, "1").await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        deliver(addr, r#""k""#, "2").await.status,
        StatusCode::CONFLICT
    );
}

async fn failed_first_attempt_is_not_stored(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r2 = runs.clone();
    let app = Router::new()
        .route(
            "/hooks/flaky",
            post(move || {
                let runs = r2.clone();
                async move {
                    match runs.fetch_add(1, Ordering::SeqCst) {
                        0 => (StatusCode::INTERNAL_SERVER_ERROR, "boom"),
                        1 => (StatusCode::TOO_MANY_REQUESTS, "slow down"),
                        2 => (StatusCode::SERVICE_UNAVAILABLE, "later"),
                        _ => (StatusCode::OK, "finally"),
                    }
                }
            }),
        )
        .layer(DedupeLayer::new(h.locker().await).key(KeyExtractor::webhook_id()));
    let addr = serve(app).await;
    let hit = || {
        send(
            addr,
            Method::POST,
            "/hooks/flaky",
            &[("webhook-id", "msg_1")],
            "{}",
        )
    };
    assert_eq!(hit().await.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(hit().await.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(hit().await.status, StatusCode::SERVICE_UNAVAILABLE);
    let ok = hit().await;
    assert_eq!((ok.status, ok.text().as_str()), (StatusCode::OK, "finally"));
    assert_eq!(ok.header("idempotent-replayed"), None);
    let replay = hit().await;
    assert_eq!(
        (replay.status, replay.text().as_str()),
        (StatusCode::OK, "finally")
    );
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        4,
        "each retry after a failure ran once more"
    );
}

async fn oversized_bodies(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r2 = runs.clone();
    let big = "x".repeat(4096);
    let app = Router::new()
        .route(
            "/hooks/big",
            post(move || {
                let (runs, big) = (r2.clone(), big.clone());
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::ACCEPTED, big)
                }
            }),
        )
        .layer(
            DedupeLayer::new(h.locker().await)
                .request_body_limit(1024)
                .stored_body_limit(1024),
        );
    let addr = serve(app).await;
    let too_big = "y".repeat(2048);
    let r = send(
        addr,
        Method::POST,
        "/hooks/big",
        &[("idempotency-key", r#""b1""#)],
        too_big,
    )
    .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    // A response above the stored cap reaches the first caller whole...
    let first = send(
        addr,
        Method::POST,
        "/hooks/big",
        &[("idempotency-key", r#""b2""#)],
        "{}",
    )
    .await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    assert_eq!(first.body.len(), 4096);
    // ...and duplicates get its status without the body, marked as such; it does not run again.
    let dup = send(
        addr,
        Method::POST,
        "/hooks/big",
        &[("idempotency-key", r#""b2""#)],
        "{}",
    )
    .await;
    assert_eq!(dup.status, StatusCode::ACCEPTED);
    assert!(dup.body.is_empty());
    assert_eq!(dup.header("idempotent-replayed"), Some("true"));
    assert_eq!(dup.header("idempotent-body-omitted"), Some("true"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

async fn missing_or_malformed_keys(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let locker = h.locker().await;
    let addr = serve(counting(
        DedupeLayer::new(locker.clone()),
        runs.clone(),
        Duration::ZERO,
    ))
    .await;
    let r = send(addr, Method::POST, "/hooks/a", &[], "{}").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.text().contains("Idempotency-Key"), "{}", r.text());
    for bad in [r#""open"#, r#""a"b"#, "\"\""] {
        let r = deliver(addr, bad, "{}").await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "key {bad}: {}", r.text());
    }
    let long = format!("\"{}\"", "k".repeat(256));
    let r = send(
        addr,
        Method::POST,
        "/hooks/a",
        &[("idempotency-key", &long)],
        "{}",
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // Braces and other odd characters are fine: keys are hashed before they are stored.
    assert_eq!(
        deliver(addr, r#""{x}:*""#, "{}").await.status,
        StatusCode::CREATED
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let lenient = DedupeLayer::new(locker)
        .scope("lenient")
        .pass_through_without_key();
    let addr = serve(counting(lenient, runs.clone(), Duration::ZERO)).await;
    for _ in 0..2 {
        let r = send(addr, Method::POST, "/hooks/a", &[], "{}").await;
        assert_eq!(r.status, StatusCode::CREATED);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3, "unkeyed requests each ran");
}

async fn webhook_ids_and_github_scoping(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let locker = h.locker().await;
    let gh = counting(
        DedupeLayer::new(locker.clone()).key(KeyExtractor::github_delivery()),
        runs.clone(),
        Duration::ZERO,
    );
    let addr = serve(gh).await;
    let delivery = [("x-github-delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958")];
    // One event, two hooks: each hook runs once.
    for path in ["/hooks/ci", "/hooks/deploy", "/hooks/ci", "/hooks/deploy"] {
        let r = send(addr, Method::POST, path, &delivery, "{}").await;
        assert_eq!(r.status, StatusCode::CREATED);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    let svix = counting(
        DedupeLayer::new(locker)
            .key(KeyExtractor::webhook_id())
            .scope("svix"),
        runs.clone(),
        Duration::ZERO,
    );
    let addr = serve(svix).await;
    let r = send(
        addr,
        Method::POST,
        "/hooks/a",
        &[("svix-id", "msg_9")],
        "{}",
    )
    .await;
    assert_eq!(r.header("idempotent-replayed"), None);
    let r = send(
        addr,
        Method::POST,
        "/hooks/a",
        &[("webhook-id", "msg_9")],
        "{}",
    )
    .await;
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

async fn json_id_key_and_body_handed_on(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r2 = runs.clone();
    let app = Router::new()
        .route(
            "/hooks/stripe",
            post(move |body: Bytes| {
                let runs = r2.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    body
                }
            }),
        )
        .layer(DedupeLayer::new(h.locker().await).key(KeyExtractor::json_field("/id")));
    let addr = serve(app).await;
    let event = r#"{"id":"evt_1NG8Du2eZvKYlo2CUI79vXWy","type":"charge.succeeded" , "data":{}}"#;
    let first = send(addr, Method::POST, "/hooks/stripe", &[], event).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body, event.as_bytes(), "the handler saw other bytes");
    let dup = send(addr, Method::POST, "/hooks/stripe", &[], event).await;
    assert_eq!(dup.body, event.as_bytes());
    assert_eq!(dup.header("idempotent-replayed"), Some("true"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let r = send(addr, Method::POST, "/hooks/stripe", &[], r#"{"type":"x"}"#).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
}

/// The claim's key name, computed as the layer does (SHA-256 of the length-prefixed scope and
/// key), so the test can delete the claim from outside.
fn claim_name(scope: &str, key: &str) -> String {
    let mut h = Sha256::new();
    for p in [scope.as_bytes(), key.as_bytes()] {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p);
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    format!("dedupe:{hex}")
}

async fn claim_loss_cancels_and_stores_nothing(h: Harness) {
    let locker = h.locker().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (tx, mut entered) = mpsc::unbounded_channel();
    let r2 = runs.clone();
    let app = Router::new()
        .route(
            "/hooks/slow",
            post(move || {
                let (runs, tx) = (r2.clone(), tx.clone());
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst);
                    let _ = tx.send(());
                    if n == 0 {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                    }
                    "done"
                }
            }),
        )
        .layer(
            DedupeLayer::new(locker.clone())
                .scope("s")
                .claim_ttl(Duration::from_secs(1)),
        );
    let addr = serve(app).await;
    let hit = || {
        send(
            addr,
            Method::POST,
            "/hooks/slow",
            &[("idempotency-key", r#""lost""#)],
            "{}",
        )
    };
    let first = tokio::spawn(hit());
    entered.recv().await.expect("entered");
    h.delete(&locker, &claim_name("s", "lost"));
    let r = first.await.expect("join");
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    // Nothing was stored: the retry runs the handler.
    let r = hit().await;
    assert_eq!(
        (r.status, r.header("idempotent-replayed")),
        (StatusCode::OK, None)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A stored result lives in Redis, so a new instance of the service (new locker, new layer,
/// new server) replays it.
async fn survives_a_service_restart(h: Harness) {
    let first_runs = Arc::new(AtomicUsize::new(0));
    let addr = serve(counting(
        DedupeLayer::new(h.locker().await),
        first_runs.clone(),
        Duration::ZERO,
    ))
    .await;
    let original = deliver(addr, r#""restart-1""#, "{}").await;
    assert_eq!(original.status, StatusCode::CREATED);

    let second_runs = Arc::new(AtomicUsize::new(0));
    let addr2 = serve(counting(
        DedupeLayer::new(h.locker().await),
        second_runs.clone(),
        Duration::ZERO,
    ))
    .await;
    let replay = deliver(addr2, r#""restart-1""#, "{}").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, original.body);
    assert_eq!(second_runs.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_a_service_restart_on_redis() {
    survives_a_service_restart(Harness::redis()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_a_service_restart_on_valkey() {
    survives_a_service_restart(Harness::valkey()).await
}

/// The handler finishes after its claim was deleted and taken by another holder (before renewal
/// noticed): the token check in the store refuses the write, so no duplicate is ever answered
/// from a result produced without a valid claim.
async fn result_is_not_stored_when_the_claim_changed_hands(h: Harness) {
    let locker = h.locker().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (h2, l2, r2) = (Arc::new(h), locker.clone(), runs.clone());
    let h3 = h2.clone();
    let intruder: Arc<tokio::sync::Mutex<Option<lock_core::Lease>>> = Arc::default();
    let i2 = intruder.clone();
    let app = Router::new()
        .route(
            "/hooks/stolen",
            post(move || {
                let (h, l, runs, intruder) = (h3.clone(), l2.clone(), r2.clone(), i2.clone());
                async move {
                    if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                        let name = claim_name("", "stolen");
                        h.delete(&l, &name);
                        let opts = lock_core::LockOptions::new().ttl(Duration::from_secs(30));
                        let lease = l.try_acquire(&name, &opts).await.expect("intruder");
                        *intruder.lock().await = Some(lease);
                    }
                    "done"
                }
            }),
        )
        .layer(DedupeLayer::new(locker));
    let addr = serve(app).await;
    let hit = || {
        send(
            addr,
            Method::POST,
            "/hooks/stolen",
            &[("idempotency-key", r#""stolen""#)],
            "{}",
        )
    };
    // The first caller still gets the handler's answer...
    let first = hit().await;
    assert_eq!(first.status, StatusCode::OK);
    // ...but it was not stored: while the intruder holds the claim a duplicate gets 409, not a
    // replay, and once it is released the retry runs the handler again.
    let dup = hit().await;
    assert_eq!(dup.status, StatusCode::CONFLICT, "{}", dup.text());
    let lease = intruder.lock().await.take().expect("intruder lease");
    lease.release().await.expect("release");
    let retry = hit().await;
    assert_eq!(
        (retry.status, retry.header("idempotent-replayed")),
        (StatusCode::OK, None)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    drop(h2);
}

/// The result store's other transport: a 3-master Redis Cluster (claim and result share one
/// hash tag, so the store script runs on the node that owns the claim).
mod redis_cluster {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_duplicates_run_the_handler_once() {
        common::bounded(super::concurrent_duplicates_run_the_handler_once(
            Harness::redis_cluster(),
        ))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn result_is_not_stored_when_the_claim_changed_hands() {
        common::bounded(super::result_is_not_stored_when_the_claim_changed_hands(
            Harness::redis_cluster(),
        ))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn survives_a_service_restart() {
        common::bounded(super::survives_a_service_restart(Harness::redis_cluster())).await
    }
}
