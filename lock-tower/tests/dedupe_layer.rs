//! `DedupeLayer` over a real axum server and a real HTTP client, on memory, Redis and Valkey.

#[path = "../../tests/support/captured.rs"]
mod captured;
mod common;
#[path = "../../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::{any, get, post};
use bytes::Bytes;
use common::{Drip, Harness, Reply, claim_name, eventually, send, serve};
use http::{HeaderName, Method, Response, StatusCode};
use lock_tower::{DedupeLayer, Fence, HeldLease, KeyExtractor, LockLayer, Reason};

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};

on_every_backend!(
    concurrent_duplicates_run_the_handler_once,
    waiting_duplicates_all_get_the_replay,
    a_wait_that_runs_out_is_409,
    a_waiting_duplicate_runs_the_handler_after_a_failed_first,
    the_default_stored_body_cap_is_256_kib,
    same_key_different_request_is_422,
    failed_first_attempt_is_not_stored,
    a_conflict_that_says_when_to_retry_is_not_stored,
    a_timeout_answer_is_not_stored,
    a_body_shorter_than_its_length_stores_nothing,
    oversized_bodies,
    missing_or_malformed_keys,
    webhook_ids_and_github_scoping,
    json_id_key_and_body_handed_on,
    claim_loss_cancels_and_stores_nothing,
    claim_loss_while_the_body_streams_cuts_it,
    result_is_not_stored_when_the_claim_changed_hands,
    client_hangs_up_while_the_result_is_collected,
    client_hangs_up_while_the_handler_runs,
    results_expire_after_the_retention,
    deliveries_leave_nothing_behind_after_the_retention,
    a_failing_body_stores_nothing,
    a_body_ending_in_trailers_is_stored,
    a_stalled_body_is_bounded_by_a_body_timeout,
    a_slow_body_keeps_the_claim_until_it_ends,
    a_body_above_the_cap_that_fails_stores_nothing,
    a_relay_that_dies_cuts_the_body,
    an_empty_webhook_id_counts_as_absent,
    a_lock_key_spelled_like_a_claim_cannot_hold_a_delivery,
    github_hooks_told_apart_by_a_query_are_two_hooks,
    json_ids_empty_long_or_numeric,
    only_the_filtered_methods_are_deduplicated,
    a_head_request_is_deduplicated,
    nested_layers_with_one_claim_dedupe_once,
    replay_header_adds_to_the_allow_list,
    the_default_allow_list_is_replayed,
    caps_at_their_exact_boundaries,
    a_panicking_handler_frees_the_claim,
    an_unkeyed_request_is_answered_unread,
    a_body_that_lingers_past_its_length_is_stored,
    two_layers_on_one_locker_share_results,
    stacked_layers_agree_on_the_lease,
    a_repeated_key_header_is_invalid_even_when_passing_through,
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

/// A duplicate that waits (`wait`) for a first delivery that outlasts the wait gets 409 with
/// `Retry-After` (`Reason::WaitTimeout`), and the handler ran once.
async fn a_wait_that_runs_out_is_409(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = DedupeLayer::new(h.locker().await).wait(Duration::from_millis(200));
    let addr = serve(counting(layer, runs.clone(), Duration::from_millis(1_500))).await;
    let first = tokio::spawn(async move { deliver(addr, r#""evt-slow""#, "{}").await });
    assert!(
        common::eventually(Duration::from_secs(5), async || runs.load(Ordering::SeqCst)
            == 1)
        .await
    );
    let started = std::time::Instant::now();
    let waited = deliver(addr, r#""evt-slow""#, "{}").await;
    let took = started.elapsed();
    assert_eq!(waited.status, StatusCode::CONFLICT, "{}", waited.text());
    assert!(waited.header("retry-after").is_some());
    let problem: serde_json::Value = serde_json::from_slice(&waited.body).expect("json");
    assert_eq!(
        problem["type"], "urn:leasehold:problem:wait-timeout",
        "{problem}"
    );
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_millis(1_200),
        "a 200 ms wait answered after {took:?}"
    );
    assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A duplicate waiting for a first delivery that fails (5xx, not stored) does not get that
/// failure replayed: once the claim is free it claims the key and runs the handler itself.
async fn a_waiting_duplicate_runs_the_handler_after_a_failed_first(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/hooks/once-failing",
            post(move || {
                let n = r.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    if n == 1 {
                        tokio::time::sleep(Duration::from_millis(1_000)).await;
                        (StatusCode::BAD_GATEWAY, "upstream down")
                    } else {
                        (StatusCode::OK, "handled")
                    }
                }
            }),
        )
        .layer(DedupeLayer::new(h.locker().await).wait(Duration::from_secs(10)));
    let addr = serve(app).await;
    let first =
        tokio::spawn(async move { deliver_to(addr, "/hooks/once-failing", r#""evt-f""#).await });
    assert!(
        common::eventually(Duration::from_secs(5), async || runs.load(Ordering::SeqCst)
            == 1)
        .await
    );
    let sent = std::time::Instant::now();
    let second = deliver_to(addr, "/hooks/once-failing", r#""evt-f""#).await;
    // It waited for the first (1 s), rather than coming after it.
    assert!(
        sent.elapsed() >= Duration::from_millis(500),
        "{:?}",
        sent.elapsed()
    );
    assert_eq!(first.await.expect("first").status, StatusCode::BAD_GATEWAY);
    assert_eq!(
        (second.status, second.text().as_str()),
        (StatusCode::OK, "handled"),
        "the waiting duplicate got the failure"
    );
    assert_eq!(second.header("idempotent-replayed"), None);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Without `stored_body_limit`, bodies up to 256 KiB are stored and replayed whole, and one
/// byte more is replayed without its body.
async fn the_default_stored_body_cap_is_256_kib(h: Harness) {
    let app = Router::new()
        .route(
            "/hooks/sized/{n}",
            post(|axum::extract::Path(n): axum::extract::Path<usize>| async move { "x".repeat(n) }),
        )
        .layer(DedupeLayer::new(h.locker().await));
    let addr = serve(app).await;
    for (n, whole) in [(256 * 1024, true), (256 * 1024 + 1, false)] {
        let path = format!("/hooks/sized/{n}");
        let key = format!(r#""sized-{n}""#);
        let first = deliver_to(addr, &path, &key).await;
        assert_eq!(first.body.len(), n);
        let replay = deliver_to(addr, &path, &key).await;
        assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{n}");
        if whole {
            assert_eq!(replay.body, first.body, "{n}");
            assert_eq!(replay.header("idempotent-body-omitted"), None);
        } else {
            assert!(
                replay.body.is_empty(),
                "{n}: {} bytes replayed",
                replay.body.len()
            );
            assert_eq!(replay.header("idempotent-body-omitted"), Some("true"));
        }
    }
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
    // So is another method with the same key, path and body.
    let things = Arc::new(AtomicUsize::new(0));
    let any_addr = serve(any_method(
        DedupeLayer::new(locker.clone()).scope("methods"),
        things.clone(),
    ))
    .await;
    let key = [("idempotency-key", r#""m""#)];
    let r = send(any_addr, Method::POST, "/things", &key, "{}").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let r = send(any_addr, Method::PUT, "/things", &key, "{}").await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.text());
    let r = send(any_addr, Method::POST, "/things", &key, "{}").await;
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(things.load(Ordering::SeqCst), 1);

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

    // While the first still runs there is no stored request to compare with: a different
    // body is a duplicate like any other (409 with `Retry-After`); once the first has ended,
    // 422.
    let slow = Arc::new(AtomicUsize::new(0));
    let layer = DedupeLayer::new(h.locker().await).scope("running");
    let addr = serve(counting(layer, slow.clone(), Duration::from_millis(800))).await;
    let first = tokio::spawn(async move { deliver(addr, r#""r""#, r#"{"a":1}"#).await });
    assert!(
        eventually(Duration::from_secs(5), async || slow.load(Ordering::SeqCst)
            == 1)
        .await,
        "the first delivery never ran"
    );
    let r = deliver(addr, r#""r""#, r#"{"a":2}"#).await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.text());
    assert!(r.header("retry-after").is_some());
    assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
    let r = deliver(addr, r#""r""#, r#"{"a":2}"#).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.text());
    assert_eq!(slow.load(Ordering::SeqCst), 1);
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

/// A `LockLayer` inside the dedupe layer answers 409 with `Retry-After` while its key is held:
/// that answer is not stored (it would be replayed for a day and the delivery never handled),
/// so the sender's retry runs the handler once the key is free. A 409 the handler gives on its
/// own, with no `Retry-After`, is an answer and is stored.
async fn a_conflict_that_says_when_to_retry_is_not_stored(h: Harness) {
    let locker = h.locker().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let r2 = runs.clone();
    let app = Router::new()
        .route(
            "/accounts/{id}/hooks",
            post(move || {
                let runs = r2.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::OK, "done")
                }
            }),
        )
        .route_layer(LockLayer::new(
            locker.clone(),
            KeyExtractor::route_param("id"),
        ))
        .route(
            "/orders",
            post(|| async { (StatusCode::CONFLICT, "exists") }),
        )
        .layer(DedupeLayer::new(locker.clone()).key(KeyExtractor::webhook_id()));
    let addr = serve(app).await;
    let hit = |path: &'static str, id: &'static str| async move {
        send(addr, Method::POST, path, &[("webhook-id", id)], "{}").await
    };
    let account = locker
        .try_acquire("7", &lock_core::LockOptions::new())
        .await
        .expect("hold the account");
    let busy = hit("/accounts/7/hooks", "msg_busy").await;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{}", busy.text());
    assert!(busy.header("retry-after").is_some());
    account.release().await.expect("release");
    let retried = hit("/accounts/7/hooks", "msg_busy").await;
    assert_eq!(
        (retried.status, retried.text().as_str()),
        (StatusCode::OK, "done"),
        "the retry was answered from a stored 409"
    );
    assert_eq!(retried.header("idempotent-replayed"), None);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let first = hit("/orders", "msg_order").await;
    assert_eq!(first.status, StatusCode::CONFLICT);
    let again = hit("/orders", "msg_order").await;
    assert_eq!(
        (again.status, again.header("idempotent-replayed")),
        (StatusCode::CONFLICT, Some("true"))
    );
}

/// A `DedupeLayer` and a `LockLayer` on one route, in either order: the handler's lease is the
/// `LockLayer`'s, or none where it let the request through without one. The delivery's claim
/// never stands in for the lock: its fence, handed to the account's gate, would outrank the
/// account's lock holders.
async fn stacked_layers_agree_on_the_lease(h: Harness) {
    let locker = h.locker().await;
    let whose = |lease: Option<HeldLease>, fence: Option<Fence>| async move {
        assert_eq!(lease.as_ref().map(|l| l.0.fence()), fence.map(|f| f.0));
        lease.map_or_else(|| "none".to_owned(), |l| l.0.key().to_owned())
    };
    let dedupe = || DedupeLayer::new(locker.clone()).key(KeyExtractor::webhook_id());
    let account = || {
        LockLayer::new(
            locker.clone(),
            KeyExtractor::header(HeaderName::from_static("x-account")),
        )
        .pass_through_without_key()
    };
    // The lock outside, the dedupe inside.
    let lock_outside = Router::new()
        .route("/accounts/{id}/hooks", post(whose).layer(dedupe()))
        .route_layer(LockLayer::new(
            locker.clone(),
            KeyExtractor::route_param("id"),
        ))
        .route("/unlocked", post(whose).layer(dedupe()))
        .route_layer(account());
    // The dedupe outside, the lock inside.
    let dedupe_outside = Router::new()
        .route("/hooks", post(whose))
        .route_layer(account())
        .layer(dedupe());
    for (app, path, account, expected) in [
        (lock_outside.clone(), "/accounts/7/hooks", None, "7"),
        (lock_outside, "/unlocked", None, "none"),
        (dedupe_outside.clone(), "/hooks", Some("9"), "9"),
        (dedupe_outside, "/hooks", None, "none"),
    ] {
        let addr = serve(app).await;
        let id = format!("msg_{path}_{account:?}");
        let mut headers = vec![("webhook-id", id.as_str())];
        headers.extend(account.map(|a| ("x-account", a)));
        let res = send(addr, Method::POST, path, &headers, "{}").await;
        assert_eq!(
            (res.status, res.text().as_str()),
            (StatusCode::OK, expected),
            "{path}, account {account:?}"
        );
    }
}

/// A 408 (a timeout layer inside this one answering for a handler it cut off) asks the sender
/// to try again: it is not stored, so the retry runs the handler rather than getting the 408
/// replayed for the whole retention.
async fn a_timeout_answer_is_not_stored(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/hooks/slow",
            post(move || {
                let n = r.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    if n == 1 {
                        (StatusCode::REQUEST_TIMEOUT, "timed out")
                    } else {
                        (StatusCode::OK, "done")
                    }
                }
            }),
        )
        .layer(DedupeLayer::new(h.locker().await));
    let addr = serve(app).await;
    let first = deliver_to(addr, "/hooks/slow", r#""slow""#).await;
    assert_eq!(first.status, StatusCode::REQUEST_TIMEOUT);
    let retried = deliver_to(addr, "/hooks/slow", r#""slow""#).await;
    assert_eq!(
        (retried.status, retried.text().as_str()),
        (StatusCode::OK, "done"),
        "the retry was answered from a stored 408"
    );
    assert_eq!(retried.header("idempotent-replayed"), None);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A response that declares a `Content-Length` and ends before it (below the stored-body cap,
/// and above it, where the rest is relayed): the caller cannot be sent it whole, so nothing is
/// stored and the sender's retry runs the handler again, instead of getting the short body
/// replayed as a success. A status that sends no body (304, 204) is never short, and is
/// answered without waiting for its body.
async fn a_body_shorter_than_its_length_stores_nothing(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let (r, r2) = (runs.clone(), runs.clone());
    // Two 6-byte chunks under a declared length of 100.
    let short = move || {
        r.fetch_add(1, Ordering::SeqCst);
        async {
            Response::builder()
                .header("content-length", "100")
                .body(Body::new(Drip::new(Duration::from_millis(1), 2)))
                .expect("response")
        }
    };
    let app = Router::new()
        .route(
            "/hooks/small",
            post(short.clone()).layer(DedupeLayer::new(h.locker().await)),
        )
        .route(
            "/hooks/big",
            post(short).layer(DedupeLayer::new(h.locker().await).stored_body_limit(8)),
        )
        // A body that says it has ended as soon as its one frame is taken, above the cap.
        .route(
            "/hooks/big-whole",
            post(move || {
                r2.fetch_add(1, Ordering::SeqCst);
                async {
                    Response::builder()
                        .header("content-length", "100")
                        .body(Body::from("x".repeat(40)))
                        .expect("response")
                }
            })
            .layer(DedupeLayer::new(h.locker().await).stored_body_limit(8)),
        )
        // A 304 names the representation's length and has no body: nothing is short.
        .route(
            "/hooks/not-modified",
            post(|| async {
                Response::builder()
                    .status(StatusCode::NOT_MODIFIED)
                    .header("content-length", "100")
                    .body(Body::empty())
                    .expect("response")
            })
            .layer(DedupeLayer::new(h.locker().await)),
        )
        // A 204 sends no body whatever its body would yield: one that never ends is not waited
        // for (the server drops it unpolled).
        .route(
            "/hooks/no-content",
            post(|| async {
                Response::builder()
                    .status(StatusCode::NO_CONTENT)
                    .body(Body::new(common::Lingering(Some(Bytes::from_static(b"x")))))
                    .expect("response")
            })
            .layer(DedupeLayer::new(h.locker().await)),
        );
    let addr = serve(app).await;

    let first = deliver_to(addr, "/hooks/small", r#""small""#).await;
    assert_eq!(
        first.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{}",
        first.text()
    );
    let problem: serde_json::Value = serde_json::from_slice(&first.body).expect("json");
    assert_eq!(problem["type"], "urn:leasehold:problem:response-failed");
    let again = deliver_to(addr, "/hooks/small", r#""small""#).await;
    assert_eq!(
        again.header("idempotent-replayed"),
        None,
        "{}",
        again.text()
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the retry did not run the handler"
    );

    // Above the cap the head has gone out with the first bytes: the body is cut off, and the
    // claim freed before the cut reaches the caller, so the retry runs the handler (and is cut
    // off in turn) rather than getting a replay.
    let big = async || {
        let mut tx = common::connect(addr).await;
        let req = http::Request::post("/hooks/big")
            .header("host", "x")
            .header("idempotency-key", r#""big""#)
            .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
            .expect("request");
        use http_body_util::BodyExt;
        match tx.send_request(req).await {
            Ok(res) => {
                let replayed = res.headers().get("idempotent-replayed").cloned();
                (
                    res.into_body().collect().await.map(|b| b.to_bytes().len()),
                    replayed,
                )
            }
            Err(e) => (Err(e), None),
        }
    };
    for run in 3..=4 {
        let (outcome, replayed) = big().await;
        assert!(
            outcome.is_err(),
            "the short body ended cleanly: {outcome:?}"
        );
        assert_eq!(replayed, None);
        assert_eq!(
            runs.load(Ordering::SeqCst),
            run,
            "the retry did not run the handler"
        );
    }

    for run in 5..=6 {
        let cut = deliver_to(addr, "/hooks/big-whole", r#""big-whole""#).await;
        assert_eq!(
            cut.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{}",
            cut.text()
        );
        assert_eq!(
            runs.load(Ordering::SeqCst),
            run,
            "the retry did not run the handler"
        );
    }
    let first = deliver_to(addr, "/hooks/not-modified", r#""nm""#).await;
    assert_eq!(first.status, StatusCode::NOT_MODIFIED);
    let replay = deliver_to(addr, "/hooks/not-modified", r#""nm""#).await;
    assert_eq!(
        (replay.status, replay.header("idempotent-replayed")),
        (StatusCode::NOT_MODIFIED, Some("true"))
    );
    for replayed in [None, Some("true")] {
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            deliver_to(addr, "/hooks/no-content", r#""nc""#),
        )
        .await
        .expect("the 204 was held back waiting for a body it does not send");
        assert_eq!(
            (answer.status, answer.header("idempotent-replayed")),
            (StatusCode::NO_CONTENT, replayed)
        );
    }
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
                    let described = [
                        ("etag", "\"v1\""),
                        ("last-modified", "Wed, 02 Dec 2026 10:00:00 GMT"),
                        ("cache-control", "public, max-age=600"),
                        ("content-location", "/exports/1"),
                        ("content-type", "text/plain"),
                    ];
                    (StatusCode::ACCEPTED, described, big)
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
    // The empty replay does not claim to be the representation the first caller got: a cache
    // would otherwise keep it under the original's validators.
    assert_eq!(first.header("etag"), Some("\"v1\""));
    for gone in ["etag", "last-modified", "content-location"] {
        assert_eq!(
            dup.header(gone),
            None,
            "{gone} replayed beside an omitted body"
        );
    }
    assert_eq!(dup.header("cache-control"), Some("no-store"));
    assert_eq!(dup.header("content-type"), Some("text/plain"));
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
    // A key of spaces alone is as empty as "": every client sending one would share it.
    for bad in [r#""open"#, r#""a"b"#, "\"\"", "\"  \"", "\" \""] {
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

/// A key header sent twice is an invalid key for every header extractor (`header`,
/// `idempotency_key`, `webhook_id` by either of its headers, `github_delivery`): 400 and the
/// handler does not run, also under `pass_through_without_key`, which lets through only a
/// request without a key (an empty first value must not make it one). Sent once, the same
/// header is deduplicated, so the 400s are the repetition's.
async fn a_repeated_key_header_is_invalid_even_when_passing_through(h: Harness) {
    let locker = h.locker().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let extractors = common::header_extractors();
    let modes = ["strict", "lenient"];
    let mut app = Router::new();
    for (header, key) in &extractors {
        for mode in modes {
            // A scope per route: one key on two routes would otherwise be a reused key (422).
            let layer = DedupeLayer::new(locker.clone())
                .key(key.clone())
                .scope(format!("{header}/{mode}"));
            let layer = match mode {
                "lenient" => layer.pass_through_without_key(),
                _ => layer,
            };
            let runs = runs.clone();
            let handler = post(move || {
                runs.fetch_add(1, Ordering::SeqCst);
                async { "ran" }
            });
            app = app.route(&format!("/{header}/{mode}"), handler.layer(layer));
        }
    }
    let addr = serve(app).await;
    let headers: Vec<&str> = extractors.iter().map(|(h, _)| *h).collect();
    common::assert_repeated_key_headers_refused(addr, &headers, &modes, "{}").await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "a handler ran on a repeated key"
    );
    for (header, _) in &extractors {
        for mode in modes {
            let path = format!("/{header}/{mode}");
            for replayed in [None, Some("true")] {
                let r = send(addr, Method::POST, &path, &[(*header, "7")], "{}").await;
                assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.text());
                assert_eq!(r.header("idempotent-replayed"), replayed, "{path}");
            }
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2 * extractors.len());
}

/// The body is read only for a keyed request's fingerprint: a request without a header key is
/// passed on with its body untouched, whatever its size, or refused before it sends its body.
async fn an_unkeyed_request_is_answered_unread(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let locker = h.locker().await;
    let lenient = DedupeLayer::new(locker.clone())
        .request_body_limit(1024)
        .pass_through_without_key();
    let addr = serve(counting(lenient, runs.clone(), Duration::ZERO)).await;
    let r = send(addr, Method::POST, "/hooks/a", &[], "y".repeat(4096)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    assert!(r.text().contains(r#""len":4096"#), "{}", r.text());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // A keyed request is still held to the cap.
    let r = send(
        addr,
        Method::POST,
        "/hooks/a",
        &[("idempotency-key", r#""k1""#)],
        "y".repeat(4096),
    )
    .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let strict = DedupeLayer::new(locker).request_body_limit(1024);
    let addr = serve(counting(strict, runs.clone(), Duration::ZERO)).await;
    let r = send(addr, Method::POST, "/hooks/a", &[], "y".repeat(4096)).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    // Announced and never sent: the answer comes without it, for a missing key and for an
    // invalid one.
    let no_key = "";
    let invalid = "idempotency-key: \"a\"b\r\n";
    for extra in [no_key, invalid] {
        let head =
            format!("POST /hooks/a HTTP/1.1\r\nhost: test\r\n{extra}content-length: 4096\r\n\r\n");
        assert_eq!(
            &status_without_body(addr, &head).await,
            b"HTTP/1.1 400",
            "{extra:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The status line answered to a request head `head` whose announced body is never sent.
async fn status_without_body(addr: std::net::SocketAddr, head: &str) -> [u8; 12] {
    use tokio::io::AsyncReadExt;
    let mut conn = TcpStream::connect(addr).await.expect("connect");
    conn.write_all(head.as_bytes())
        .await
        .expect("send the head");
    let mut status = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(5), conn.read_exact(&mut status))
        .await
        .expect("answered without the body")
        .expect("read the status line");
    status
}

/// A response body with a `Content-Length` that stays pending after its last byte (a stream
/// whose sender lingers): without the layer the server sends it and stops polling; the layer,
/// which reads it whole before it answers, must stop at its declared end too, not wait for an
/// end that never comes while the claim is renewed for ever.
async fn a_body_that_lingers_past_its_length_is_stored(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r2 = runs.clone();
    let app = Router::new()
        .route(
            "/hooks/linger",
            post(move || {
                let runs = r2.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Response::builder()
                        .status(StatusCode::CREATED)
                        .header("content-length", "5")
                        .body(Body::new(common::Lingering(Some(Bytes::from_static(
                            b"hello",
                        )))))
                        .expect("response")
                }
            }),
        )
        .layer(DedupeLayer::new(h.locker().await));
    let addr = serve(app).await;
    let deliver = || {
        send(
            addr,
            Method::POST,
            "/hooks/linger",
            &[("idempotency-key", r#""l-1""#)],
            "{}",
        )
    };
    let first = tokio::time::timeout(Duration::from_secs(5), deliver())
        .await
        .expect("the answer waited for a body end that never comes");
    assert_eq!(
        (first.status, first.text().as_str()),
        (StatusCode::CREATED, "hello")
    );
    let replay = tokio::time::timeout(Duration::from_secs(5), deliver())
        .await
        .expect("the duplicate hung");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.text(), "hello");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
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

    // The same hooks nested under two prefixes (two organisations' endpoints): axum strips the
    // prefix before the layer sees the path, yet each endpoint is its own hook.
    // One layer (one store, on memory too), applied in both nested routers.
    let layer = DedupeLayer::new(locker.clone())
        .key(KeyExtractor::github_delivery())
        .scope("nested");
    let hooks = || counting(layer.clone(), runs.clone(), Duration::ZERO);
    let nested = Router::new()
        .nest("/org-a", hooks())
        .nest("/org-b", hooks());
    let addr = serve(nested).await;
    for path in ["/org-a/hooks/ci", "/org-b/hooks/ci", "/org-a/hooks/ci"] {
        let r = send(addr, Method::POST, path, &delivery, "{}").await;
        assert_eq!(r.status, StatusCode::CREATED, "{path}: {}", r.text());
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        4,
        "each nested endpoint ran once, and only once"
    );

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
    assert_eq!(runs.load(Ordering::SeqCst), 5);
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

/// `locker` in the namespace the layer takes its claims in.
fn claims(locker: &lock_core::Locker) -> lock_core::Locker {
    locker.with_namespace("dedupe").expect("namespace")
}

/// The server keys of a claim (its lock key) and of the result stored beside it.
fn claim_keys(locker: &lock_core::Locker, scope: &str, key: &str) -> (String, String) {
    let lock_key = claims(locker)
        .lock_key(&claim_name(scope, key))
        .expect("key")
        .lock_key()
        .to_owned();
    let result_key = format!("{}:result", lock_key.strip_suffix(":lock").expect("suffix"));
    (lock_key, result_key)
}

/// A route `/hooks/{scope}` behind a `DedupeLayer` whose handler answers `201 run N` and
/// calls `fault` during its first run (the fault then hits the layer's store step).
fn faulting_on_first_run(
    locker: &lock_core::Locker,
    scope: &'static str,
    claim_ttl: Duration,
    fault: impl Fn() + Clone + Send + Sync + 'static,
) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r2 = runs.clone();
    let app = Router::new()
        .route(
            &format!("/hooks/{scope}"),
            post(move || {
                let (fault, runs) = (fault.clone(), r2.clone());
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst);
                    if n == 0 {
                        fault();
                    }
                    (StatusCode::CREATED, format!("run {n}"))
                }
            }),
        )
        .layer(
            DedupeLayer::new(locker.clone())
                .scope(scope)
                .claim_ttl(claim_ttl),
        );
    (app, runs)
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
    h.delete(&claims(&locker), &claim_name("s", "lost"));
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

/// The handler's body may still be doing its work: a claim lost while the layer reads it (a
/// 503, nothing having gone out) or relays it above the stored-body cap (the stream broken)
/// cuts it, as a duplicate may run beside it, and stores nothing, so the retry runs again.
async fn claim_loss_while_the_body_streams_cuts_it(h: Harness) {
    use http_body_util::BodyExt;
    for (cap, scope) in [(None, "below"), (Some(4), "above")] {
        let locker = h.locker().await;
        let runs = Arc::new(AtomicUsize::new(0));
        let r = runs.clone();
        let mut layer = DedupeLayer::new(locker.clone())
            .scope(scope)
            .claim_ttl(Duration::from_millis(300));
        if let Some(cap) = cap {
            layer = layer.stored_body_limit(cap);
        }
        let path = format!("/hooks/{scope}");
        let app = Router::new()
            .route(
                &path,
                post(move || {
                    r.fetch_add(1, Ordering::SeqCst);
                    // Five chunks of 6 bytes, 400 ms apart: well over the claim's TTL.
                    async { Body::new(Drip::new(Duration::from_millis(400), 5)) }
                }),
            )
            .layer(layer);
        let addr = serve(app).await;
        let mut tx = common::connect(addr).await;
        let req = http::Request::post(path.as_str())
            .header("host", "x")
            .header("idempotency-key", r#""cut""#)
            .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
            .expect("request");
        let first = tokio::spawn(async move { tx.send_request(req).await });
        assert!(
            eventually(Duration::from_secs(5), async || runs.load(Ordering::SeqCst)
                == 1)
            .await,
            "{scope}: the first delivery never ran"
        );
        if cap.is_none() {
            // Below the cap nothing goes out before the body has ended.
            h.delete(&claims(&locker), &claim_name(scope, "cut"));
            let res = first.await.expect("join").expect("response");
            assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE, "{scope}");
        } else {
            // Above it the head goes out with the first chunk, and the rest is relayed.
            let res = first.await.expect("join").expect("response");
            assert_eq!(res.status(), StatusCode::OK, "{scope}");
            h.delete(&claims(&locker), &claim_name(scope, "cut"));
            let body = res.into_body().collect().await.map(|b| b.to_bytes());
            assert!(
                body.is_err(),
                "{scope}: the body ended cleanly although its claim was lost: {body:?}"
            );
        }
        // Nothing stored: the retry runs the handler again.
        let again = deliver_to(addr, &path, r#""cut""#).await;
        assert_eq!(again.status, StatusCode::OK, "{scope}: {}", again.text());
        assert_eq!(again.header("idempotent-replayed"), None, "{scope}");
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{scope}");
    }
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

/// Two layers built over one locker (an app built twice, or two routers) share their claims,
/// and so their results too: a delivery handled through one is replayed through the other, on
/// the memory backend as on a server.
async fn two_layers_on_one_locker_share_results(h: Harness) {
    let locker = h.locker().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let a = serve(counting(
        DedupeLayer::new(locker.clone()),
        runs.clone(),
        Duration::ZERO,
    ))
    .await;
    let b = serve(counting(
        DedupeLayer::new(locker),
        runs.clone(),
        Duration::ZERO,
    ))
    .await;
    let original = deliver(a, r#""shared-1""#, "{}").await;
    assert_eq!(original.status, StatusCode::CREATED);
    let replay = deliver(b, r#""shared-1""#, "{}").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, original.body);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The handler finishes after its claim was deleted and taken by another holder (before renewal
/// noticed): the token check in the store refuses the write, so no duplicate is ever answered
/// from a result produced without a valid claim.
async fn result_is_not_stored_when_the_claim_changed_hands(h: Harness) {
    let locker = h.locker().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (h2, l2, r2) = (Arc::new(h), claims(&locker), runs.clone());
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

// The result store's other transport: 3-master Redis and Valkey Clusters (claim and result
// share one hash tag, so the store script runs on the node that owns the claim).
on_clusters!(
    concurrent_duplicates_run_the_handler_once,
    result_is_not_stored_when_the_claim_changed_hands,
    survives_a_service_restart,
    waiting_duplicates_all_get_the_replay,
    same_key_different_request_is_422,
);

/// Writes a keyed delivery on a raw connection and returns the connection, for tests that
/// hang up before the answer.
async fn raw_deliver(addr: std::net::SocketAddr, path: &str, key: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\ncontent-length: 2\r\n\r\n{{}}"
    );
    s.write_all(req.as_bytes()).await.expect("write");
    s
}

/// A body that never ends (a stream, a heartbeat), whose caller hung up: the layer reads on for
/// one claim TTL, then stores nothing and releases the claim, so the sender's retry runs the
/// handler again instead of getting 409 for ever (the claim stayed renewed while the body
/// streamed). Above the stored cap (streamed to the caller as it came) and below it (buffered,
/// the head not yet sent: a trickle under the default 256 KiB cap).
/// An unconfigured layer holds a keyed request's body to `DEFAULT_REQUEST_BODY_LIMIT` (1 MiB):
/// a body of exactly that size runs, one byte more is 413 with the handler not run. An unkeyed
/// body passed through (`pass_through_without_key`) is not held to it, whatever its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_request_body_limit_is_one_mib() {
    use lock_tower::dedupe::DEFAULT_REQUEST_BODY_LIMIT;
    assert_eq!(DEFAULT_REQUEST_BODY_LIMIT, 1 << 20);
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = DedupeLayer::new(lock_core::Locker::memory());
    let addr = serve(counting(layer, runs.clone(), Duration::ZERO)).await;
    let limit = DEFAULT_REQUEST_BODY_LIMIT;
    for (key, len, status, ran) in [
        (r#""at""#, limit, StatusCode::CREATED, 1),
        (r#""over""#, limit + 1, StatusCode::PAYLOAD_TOO_LARGE, 1),
    ] {
        let body = "y".repeat(len);
        let r = send(
            addr,
            Method::POST,
            "/hooks/a",
            &[("idempotency-key", key)],
            body,
        )
        .await;
        assert_eq!(r.status, status, "{len} bytes: {}", r.text());
        assert_eq!(runs.load(Ordering::SeqCst), ran, "{len} bytes");
        if status == StatusCode::CREATED {
            assert!(
                r.text().contains(&format!(r#""len":{len}"#)),
                "{}",
                r.text()
            );
        }
    }

    // 1.5 MiB: above the layer's default, below axum's own 2 MB for the handler's `Bytes`.
    let layer = DedupeLayer::new(lock_core::Locker::memory()).pass_through_without_key();
    let addr = serve(counting(layer, runs.clone(), Duration::ZERO)).await;
    let unkeyed = "y".repeat(DEFAULT_REQUEST_BODY_LIMIT * 3 / 2);
    let r = send(addr, Method::POST, "/hooks/a", &[], unkeyed).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    assert!(r.text().contains(r#""len":1572864"#), "{}", r.text());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_body_after_a_hang_up_frees_the_claim() {
    for cap in [Some(10), None] {
        let layer = DedupeLayer::new(lock_core::Locker::memory()).claim_ttl(Duration::from_secs(1));
        let layer = match cap {
            Some(cap) => layer.stored_body_limit(cap),
            None => layer,
        };
        let freed =
            freed_after_a_hang_up(layer, Duration::from_millis(300), Duration::from_secs(8)).await;
        assert!(
            freed.is_some(),
            "cap {cap:?}: the claim was still held 8 s after the caller hung up"
        );
    }
}

/// A caller who hangs up while the body is still under the cap, which it passes later: the
/// claim TTL the body is read on for counts from the hang-up, not from when the relay above the
/// cap first fails to hand a frame on (a TTL more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_up_below_the_cap_counts_from_the_hang_up() {
    // Six bytes every 50 ms: the 360-byte cap is passed about 3 s in, within the 5 s TTL.
    let layer = DedupeLayer::new(lock_core::Locker::memory())
        .claim_ttl(Duration::from_secs(5))
        .stored_body_limit(360);
    let freed = freed_after_a_hang_up(layer, Duration::ZERO, Duration::from_secs(15))
        .await
        .expect("the claim was still held 15 s after the caller hung up");
    // About 5 s; counted from the relay's first failed send it would be about 8 s.
    assert!(
        freed < Duration::from_millis(6_500),
        "the claim was freed {freed:?} after the hang-up, more than a 5 s claim TTL"
    );
}

/// A body above the cap that sends one frame and then nothing, neither ending nor failing (a
/// stream whose producer hangs): the relay never gets a frame to fail to hand on, so it must
/// see the caller hang up by itself. The claim is freed a claim TTL after the hang-up. (It was
/// held for ever: every retry 409, the relay task and its renewing lease kept.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_body_above_the_cap_after_a_hang_up_frees_the_claim() {
    let layer = DedupeLayer::new(lock_core::Locker::memory())
        .claim_ttl(Duration::from_secs(1))
        .stored_body_limit(10);
    let silent = || Body::new(common::Lingering(Some(Bytes::from(vec![b'x'; 64]))));
    let freed = freed_after_a_hang_up_with(
        layer,
        Duration::from_millis(300),
        Duration::from_secs(8),
        silent,
    )
    .await
    .expect("the claim was still held 8 s after the caller hung up");
    assert!(
        freed < Duration::from_millis(3_000),
        "the claim was freed {freed:?} after the hang-up, against a 1 s claim TTL"
    );
}

/// Serves a route under `layer` whose body drips six bytes every 50 ms for ever, delivers one
/// keyed request and hangs up `linger` after its handler started; then retries until one runs
/// the handler again. How long after the hang-up that was, or `None` within `limit`.
async fn freed_after_a_hang_up(
    layer: DedupeLayer,
    linger: Duration,
    limit: Duration,
) -> Option<Duration> {
    let drip = || Body::new(Drip::new(Duration::from_millis(50), usize::MAX));
    freed_after_a_hang_up_with(layer, linger, limit, drip).await
}

/// As [`freed_after_a_hang_up`], the route answering with the body `make` gives.
async fn freed_after_a_hang_up_with(
    layer: DedupeLayer,
    linger: Duration,
    limit: Duration,
    make: fn() -> Body,
) -> Option<Duration> {
    let (tx, mut entered) = mpsc::unbounded_channel();
    let app = Router::new()
        .route(
            "/hooks/stream",
            post(move || {
                let tx = tx.clone();
                async move {
                    let _ = tx.send(());
                    Response::new(make())
                }
            }),
        )
        .layer(layer);
    let addr = serve(app).await;
    let key = r#""endless""#;
    let conn = raw_deliver(addr, "/hooks/stream", key).await;
    entered.recv().await.expect("entered");
    tokio::time::sleep(linger).await;
    drop(conn);
    let hung_up = std::time::Instant::now();
    // Retries, each left open long enough for its request to reach the handler (a connection
    // closed at once can end the request before it does), until one runs the handler again.
    let again = eventually(limit, async || {
        let retry = raw_deliver(addr, "/hooks/stream", key).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(retry);
        entered.try_recv().is_ok()
    })
    .await;
    again.then(|| hung_up.elapsed())
}

/// The client hangs up after the handler answered, while the layer still reads the answer's
/// body to store it. The handler's work is done, so its result is still stored and the claim
/// released: the sender's retry gets the replay instead of a second run (or a 409 until the
/// claim's TTL ran out). Also for a body above the stored cap, which the layer streams to the
/// caller as it comes: it reads on to the end after the hang-up, and records status and
/// headers, as it would had the caller stayed.
async fn client_hangs_up_while_the_result_is_collected(h: Harness) {
    // Five chunks of six bytes: 30 under a cap of 1 KiB, and above a cap of 10.
    for cap in [1024, 10] {
        let locker = h.locker().await;
        let runs = Arc::new(AtomicUsize::new(0));
        let (tx, mut entered) = mpsc::unbounded_channel();
        let r2 = runs.clone();
        let app = Router::new()
            .route(
                "/hooks/drip",
                post(move || {
                    let (runs, tx) = (r2.clone(), tx.clone());
                    async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        let _ = tx.send(());
                        // Five chunks, 100 ms apart: the hang-up comes after the first.
                        Response::new(Body::new(Drip::new(Duration::from_millis(100), 5)))
                    }
                }),
            )
            // A long TTL: only a release can free the claim within the test.
            .layer(
                DedupeLayer::new(locker)
                    .claim_ttl(Duration::from_secs(60))
                    .stored_body_limit(cap),
            );
        let addr = serve(app).await;
        let key = format!(r#""gone-{cap}""#);
        let conn = raw_deliver(addr, "/hooks/drip", &key).await;
        entered.recv().await.expect("entered");
        tokio::time::sleep(Duration::from_millis(150)).await;
        drop(conn);
        let last = deliver_until_not_busy(addr, "/hooks/drip", &key).await;
        assert_eq!(last.status, StatusCode::OK, "cap {cap}: {}", last.text());
        assert_eq!(
            last.header("idempotent-replayed"),
            Some("true"),
            "cap {cap}: the result was not stored after the client hung up"
        );
        if cap == 10 {
            assert_eq!(last.header("idempotent-body-omitted"), Some("true"));
            assert_eq!(last.text(), "");
        } else {
            assert_eq!(last.header("idempotent-body-omitted"), None);
            assert_eq!(last.text(), "chunk\n".repeat(5));
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "cap {cap}: the handler ran again"
        );
    }
}

/// A client that hangs up while the handler still runs: the handler is cancelled (its future
/// dropped, as axum does), the claim is released at once, nothing is stored, and the sender's
/// retry runs the handler again.
async fn client_hangs_up_while_the_handler_runs(h: Harness) {
    struct Cancelled(Arc<AtomicUsize>);
    impl Drop for Cancelled {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let locker = h.locker().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let cancelled = Arc::new(AtomicUsize::new(0));
    let go = Arc::new(Semaphore::new(0));
    let (tx, mut entered) = mpsc::unbounded_channel();
    let (r2, c2, g2) = (runs.clone(), cancelled.clone(), go.clone());
    let app = Router::new()
        .route(
            "/hooks/slow",
            post(move || {
                let (runs, cancelled, go, tx) = (r2.clone(), c2.clone(), g2.clone(), tx.clone());
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    let guard = Cancelled(cancelled);
                    let _ = tx.send(());
                    go.acquire().await.expect("gate").forget();
                    std::mem::forget(guard);
                    format!("run {n}")
                }
            }),
        )
        // A long TTL: only a release can free the claim within the test.
        .layer(DedupeLayer::new(locker).claim_ttl(Duration::from_secs(60)));
    let addr = serve(app).await;
    let conn = raw_deliver(addr, "/hooks/slow", r#""hang-up""#).await;
    entered.recv().await.expect("entered");
    drop(conn);
    let dropped = eventually(Duration::from_secs(10), async || {
        cancelled.load(Ordering::SeqCst) == 1
    })
    .await;
    assert!(
        dropped,
        "the handler was not cancelled when the client hung up"
    );
    // The retry soon stops getting 409 (the claim is released, not left to its 60 s TTL) and
    // is not a replay (nothing was stored): it runs the handler.
    go.add_permits(100);
    let last = deliver_until_not_busy(addr, "/hooks/slow", r#""hang-up""#).await;
    assert_eq!(last.status, StatusCode::OK, "{}", last.text());
    assert_eq!(last.text(), "run 2");
    assert_eq!(last.header("idempotent-replayed"), None);
    assert!(
        entered.try_recv().is_ok(),
        "the retry did not run the handler"
    );
}

/// A response body that sends one chunk and then fails, as one cut off by tower-http's
/// `ResponseBodyTimeoutLayer` does.
struct Broken(bool);

impl http_body::Body for Broken {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        let frame = if self.0 {
            Err(std::io::Error::other("the body broke"))
        } else {
            self.0 = true;
            Ok(http_body::Frame::data(Bytes::from_static(b"partial")))
        };
        std::task::Poll::Ready(Some(frame))
    }
}

/// A response body that fails while the layer collects it (the README's advice for stalled
/// bodies relies on this): the caller gets a 500, nothing is stored, and the claim is released
/// at once, so the retry runs the handler again instead of meeting a 409 or a replay.
async fn a_failing_body_stores_nothing(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new().route(
        "/hooks/broken",
        post(move || {
            r.fetch_add(1, Ordering::SeqCst);
            async { Response::new(Body::new(Broken(false))) }
        })
        .layer(DedupeLayer::new(h.locker().await)),
    );
    let addr = serve(app).await;
    for run in 1..=2 {
        let res = deliver_to(addr, "/hooks/broken", r#""broken""#).await;
        assert_eq!(
            res.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "run {run}: {}",
            res.text()
        );
        assert_eq!(res.header("idempotent-replayed"), None);
        // Answered as every other failure of the layer: a problem+json body naming it.
        assert_eq!(
            res.header("content-type"),
            Some("application/problem+json"),
            "run {run}"
        );
        let problem: serde_json::Value = serde_json::from_slice(&res.body).expect("json");
        assert_eq!(problem["status"], 500, "{problem}");
        assert_eq!(
            problem["type"], "urn:leasehold:problem:response-failed",
            "{problem}"
        );
        assert_eq!(
            runs.load(Ordering::SeqCst),
            run,
            "the handler did not run again"
        );
    }
}

/// The README's advice for a response body that stalls, as it is written: tower-http's
/// `ResponseBodyTimeoutLayer` inside `DedupeLayer`, as a `.layer` call of its own (axum boxes
/// the body between the two; `DedupeLayer` needs an `Unpin` body, which tower-http's
/// `TimeoutBody` is not). A body that sends a chunk and then never ends fails at the timeout:
/// the caller gets 500, nothing is stored, and the claim is released, so the sender's retry runs
/// the handler again instead of getting 409 for as long as the body stalls.
async fn a_stalled_body_is_bounded_by_a_body_timeout(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new().route(
        "/hooks/stalled",
        post(move || {
            r.fetch_add(1, Ordering::SeqCst);
            async {
                Response::new(Body::new(common::Lingering(Some(Bytes::from_static(
                    b"partial",
                )))))
            }
        })
        .layer::<_, std::convert::Infallible>(tower_http::timeout::ResponseBodyTimeoutLayer::new(
            Duration::from_millis(300),
        ))
        .layer(DedupeLayer::new(h.locker().await)),
    );
    let addr = serve(app).await;
    for run in 1..=2 {
        let started = tokio::time::Instant::now();
        let res = tokio::time::timeout(
            Duration::from_secs(10),
            deliver_to(addr, "/hooks/stalled", r#""stalled""#),
        )
        .await
        .expect("the stalled body held the answer past its timeout");
        assert_eq!(
            res.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "run {run}: {}",
            res.text()
        );
        assert!(started.elapsed() >= Duration::from_millis(300), "run {run}");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            run,
            "the retry did not run again"
        );
    }
}

/// A response body slower than the claim's TTL (README: "a body that stalls keeps the claim
/// renewed, and the sender's retries get 409 until it ends"): duplicates sent while it is still
/// coming get 409, long after the claim's first TTL ran out, and once it has ended they get
/// its replay; the handler ran once.
async fn a_slow_body_keeps_the_claim_until_it_ends(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/hooks/slow",
            post(move || {
                r.fetch_add(1, Ordering::SeqCst);
                async { Body::new(Drip::new(Duration::from_millis(1_000), 2)) }
            }),
        )
        .layer(DedupeLayer::new(h.locker().await).claim_ttl(Duration::from_millis(500)));
    let addr = serve(app).await;
    let first = tokio::spawn(deliver_to(addr, "/hooks/slow", r#""slow""#));
    assert!(
        eventually(Duration::from_secs(5), async || runs.load(Ordering::SeqCst)
            == 1)
        .await,
        "the first delivery never ran"
    );
    // Three claim TTLs (500 ms) into a body that takes four (two chunks a second apart).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let r = deliver_to(addr, "/hooks/slow", r#""slow""#).await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.text());
    let first = first.await.expect("first");
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    assert_eq!(first.text(), "chunk\nchunk\n");
    let again = deliver_to(addr, "/hooks/slow", r#""slow""#).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text());
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.text(), first.text());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A body that ends with trailers and never says it ended after them: the trailers are its
/// end, so the result is stored and answered (the trailers themselves are not stored), rather
/// than the layer waiting for a frame that never comes.
async fn a_body_ending_in_trailers_is_stored(h: Harness) {
    use http_body_util::BodyExt;
    use tower_service::Service;
    let mut app: Router = Router::new()
        .route(
            "/hooks/trailers",
            post(|| async { Body::new(common::ThenTrailers(0)) }),
        )
        .layer(DedupeLayer::new(h.locker().await));
    let req = || {
        http::Request::post("/hooks/trailers")
            .header("idempotency-key", r#""trailers""#)
            .body(Body::empty())
            .expect("request")
    };
    for replayed in [false, true] {
        let res = tokio::time::timeout(Duration::from_secs(5), app.call(req()))
            .await
            .expect("the layer waited past the trailers")
            .expect("infallible");
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers().contains_key("idempotent-replayed"), replayed);
        let body = res.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(body, "x");
    }
}

/// A response body that sends `head` and then fails with an error.
struct FailsAfter(Option<Bytes>);

/// As [`FailsAfter`], failing by a panic.
struct PanicsAfter(Option<Bytes>);

fn head_then(
    head: &mut Option<Bytes>,
    panics: bool,
) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
    let frame = match head.take() {
        Some(head) => Ok(http_body::Frame::data(head)),
        None if panics => panic!("the response body panicked (on purpose, in a test)"),
        None => Err(std::io::Error::other("the body broke")),
    };
    std::task::Poll::Ready(Some(frame))
}

impl http_body::Body for FailsAfter {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        head_then(&mut self.0, false)
    }
}

impl http_body::Body for PanicsAfter {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        head_then(&mut self.0, true)
    }
}

/// A body above the cap whose relay task dies (the body panics in it): the caller sees a
/// cut-off response, never a short one that ends cleanly.
async fn a_relay_that_dies_cuts_the_body(h: Harness) {
    let app = Router::new()
        .route(
            "/hooks/panics",
            post(|| async {
                let big = Bytes::from("x".repeat(4096));
                Response::new(Body::new(PanicsAfter(Some(big))))
            }),
        )
        .layer(DedupeLayer::new(h.locker().await).stored_body_limit(8));
    let addr = serve(app).await;
    let mut tx = common::connect(addr).await;
    let req = http::Request::post("/hooks/panics")
        .header("host", "x")
        .header("idempotency-key", r#""dies""#)
        .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
        .expect("request");
    use http_body_util::BodyExt;
    let outcome = match tx.send_request(req).await {
        Ok(res) => res.into_body().collect().await.map(|b| b.to_bytes().len()),
        Err(e) => Err(e),
    };
    assert!(
        outcome.is_err(),
        "the body ended cleanly after {outcome:?} bytes although its relay died"
    );
}

/// A body above the stored-body cap streams on to the caller after the layer stopped keeping
/// it, and may still fail there. Nothing may be stored for it and the claim must be freed, so
/// the sender's retry runs the handler again rather than getting a replayed success whose body
/// never arrived. A streamed body above the cap that ends well (its end sent, or its declared
/// length reached) is recorded, without its body, before the caller sees its end, so the next
/// duplicate is a replay.
async fn a_body_above_the_cap_that_fails_stores_nothing(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let drip = || Drip::new(Duration::from_millis(1), 5);
    let want = "chunk\n".repeat(5);
    let app = Router::new()
        .route(
            "/hooks/big",
            post(move || {
                let first = r.fetch_add(1, Ordering::SeqCst) == 0;
                async move {
                    if first {
                        let big = Bytes::from("x".repeat(4096));
                        Response::new(Body::new(FailsAfter(Some(big))))
                    } else {
                        Response::new(Body::new(drip()))
                    }
                }
            }),
        )
        .route(
            "/hooks/sized",
            post(move || async move {
                let mut res = Response::new(Body::new(drip()));
                res.headers_mut()
                    .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(30));
                res
            }),
        )
        .layer(
            // Below two chunks: the layer stops keeping each body after its second chunk.
            DedupeLayer::new(h.locker().await)
                .stored_body_limit(8)
                .claim_ttl(Duration::from_secs(60)),
        );
    let addr = serve(app).await;
    let mut tx = common::connect(addr).await;
    let req = http::Request::post("/hooks/big")
        .header("host", "x")
        .header("idempotency-key", r#""big-broken""#)
        .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
        .expect("request");
    use http_body_util::BodyExt;
    // The server cuts the connection at the error, before or after the head got out.
    let outcome = match tx.send_request(req).await {
        Ok(res) => res.into_body().collect().await.map(|_| ()),
        Err(e) => Err(e),
    };
    assert!(outcome.is_err(), "the first caller must see the body break");
    let retry = deliver_to(addr, "/hooks/big", r#""big-broken""#).await;
    assert_eq!(retry.status, StatusCode::OK, "{}", retry.text());
    assert_eq!(
        retry.header("idempotent-replayed"),
        None,
        "the failed body was recorded as a success"
    );
    assert_eq!(retry.text(), want);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the retry did not run again"
    );
    for path in ["/hooks/big", "/hooks/sized"] {
        let key = if path == "/hooks/big" {
            r#""big-broken""#
        } else {
            let first = deliver_to(addr, path, r#""sized""#).await;
            assert_eq!(first.status, StatusCode::OK, "{}", first.text());
            assert_eq!(first.header("idempotent-replayed"), None);
            assert_eq!(first.text(), want);
            r#""sized""#
        };
        let dup = deliver_to(addr, path, key).await;
        assert_eq!(dup.status, StatusCode::OK, "{path}: {}", dup.text());
        assert_eq!(dup.header("idempotent-replayed"), Some("true"), "{path}");
        assert_eq!(
            dup.header("idempotent-body-omitted"),
            Some("true"),
            "{path}"
        );
        assert!(dup.body.is_empty(), "{path}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// An empty `webhook-id` is no delivery id: the layer falls back to `svix-id`, so deliveries
/// that carry only an empty `webhook-id` beside their `svix-id` do not all share one slot, and
/// with neither id the request has no key (400).
async fn an_empty_webhook_id_counts_as_absent(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = DedupeLayer::new(h.locker().await).key(KeyExtractor::webhook_id());
    let addr = serve(counting(layer, runs.clone(), Duration::ZERO)).await;
    for (n, id) in ["msg_1", "msg_2", "msg_1"].into_iter().enumerate() {
        let r = send(
            addr,
            Method::POST,
            "/hooks/a",
            &[("webhook-id", ""), ("svix-id", id)],
            "{}",
        )
        .await;
        assert_eq!(r.status, StatusCode::CREATED, "{id}: {}", r.text());
        let replayed = (n == 2).then_some("true");
        assert_eq!(r.header("idempotent-replayed"), replayed, "{id}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let r = send(addr, Method::POST, "/hooks/a", &[("webhook-id", " ")], "{}").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    assert!(r.text().contains("missing-key"), "{}", r.text());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A stored result is replayed for the retention only: after it, the same delivery runs the
/// handler again.
async fn results_expire_after_the_retention(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = DedupeLayer::new(h.locker().await).retention(Duration::from_secs(2));
    let addr = serve(counting(layer, runs.clone(), Duration::ZERO)).await;
    let sent = tokio::time::Instant::now();
    let first = deliver(addr, r#""short-lived""#, "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = deliver(addr, r#""short-lived""#, "{}").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    // Still kept three quarters into the retention.
    tokio::time::sleep_until(sent + Duration::from_millis(1_500)).await;
    let late = deliver(addr, r#""short-lived""#, "{}").await;
    assert_eq!(
        late.header("idempotent-replayed"),
        Some("true"),
        "forgotten before its 2 s retention"
    );
    let mut again = None;
    let ran_again = eventually(Duration::from_secs(10), async || {
        let r = deliver(addr, r#""short-lived""#, "{}").await;
        let fresh = r.header("idempotent-replayed").is_none();
        again = Some(r);
        fresh
    })
    .await;
    let again = again.expect("delivered");
    assert!(ran_again, "still replayed 10 s after a 2 s retention");
    // Forgotten soon after the retention, with room for a loaded machine.
    let forgotten_after = sent.elapsed();
    assert!(
        forgotten_after < Duration::from_millis(3_500),
        "replayed until {forgotten_after:?} after a 2 s retention"
    );
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Delivery ids come without end, so nothing a delivery leaves may outlive its retention: not
/// the result, and not the claim's fence either (which lock-core otherwise keeps for ever, one
/// per key ever locked). On a server every key of the deliveries is gone; in memory the store's
/// entries stay within what its sweeps allow, not one per delivery.
async fn deliveries_leave_nothing_behind_after_the_retention(h: Harness) {
    // In memory, batches each longer than the retention, so that sweeps find the earlier
    // ones over; on a server one batch well within it, so that its keys are all seen first.
    // Claims of a second on a server: each claim's reply must come within its TTL, and its
    // renewals until the result is stored, on a loaded machine too.
    let (batches, per_batch, retention, claim) = match h {
        Harness::Memory(_) => (
            3,
            1_000,
            Duration::from_millis(100),
            Duration::from_millis(100),
        ),
        _ => (1, 100, Duration::from_secs(2), Duration::from_secs(1)),
    };
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = DedupeLayer::new(h.locker().await)
        .retention(retention)
        .claim_ttl(claim);
    let addr = serve(counting(layer, runs.clone(), Duration::ZERO)).await;
    for batch in 0..batches {
        for i in 0..per_batch {
            let key = format!(r#""d-{batch}-{i}""#);
            assert_eq!(deliver(addr, &key, "{}").await.status, StatusCode::CREATED);
        }
        if let Harness::Server(_) = h {
            let dbsize: i64 = server_cmd(&h, &["DBSIZE"]);
            assert!(
                dbsize >= 2 * per_batch,
                "{dbsize} keys: the results and fences"
            );
        }
        tokio::time::sleep(retention * 2).await;
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        batches as usize * per_batch as usize
    );
    match &h {
        Harness::Memory(m) => {
            let kept = m.kept_keys();
            assert!(
                kept <= 2_048,
                "{kept} claim entries kept for 3000 deliveries"
            );
        }
        _ => {
            let mut left = -1;
            let gone = eventually(Duration::from_secs(5), async || {
                left = server_cmd(&h, &["DBSIZE"]);
                left == 0
            })
            .await;
            assert!(gone, "{left} keys left on the server after the retention");
        }
    }
}

/// By default a result is kept 24 hours: the TTL of its key on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_retention_is_a_day_on_redis() {
    let h = Harness::redis();
    let runs = Arc::new(AtomicUsize::new(0));
    let addr = serve(counting(
        DedupeLayer::new(h.locker().await),
        runs,
        Duration::ZERO,
    ))
    .await;
    assert_eq!(
        deliver(addr, r#""kept""#, "{}").await.status,
        StatusCode::CREATED
    );
    let (_, result_key) = claim_keys(&h.locker().await, "", "kept");
    let pttl: i64 = server_cmd(&h, &["PTTL", &result_key]);
    let day = 24 * 60 * 60 * 1000;
    assert!((day - 60_000..=day).contains(&pttl), "PTTL {pttl} ms");
}

/// Delivers `key` to `path` until the answer is no longer 409 (the claim was freed), for up to
/// 10 s, and returns that answer.
async fn deliver_until_not_busy(addr: std::net::SocketAddr, path: &str, key: &str) -> Reply {
    let mut last = None;
    let answered = eventually(Duration::from_secs(10), async || {
        let r = deliver_to(addr, path, key).await;
        let done = r.status != StatusCode::CONFLICT;
        last = Some(r);
        done
    })
    .await;
    let last = last.expect("at least one retry");
    assert!(answered, "the claim stayed held: {}", last.text());
    last
}

async fn deliver_to(addr: std::net::SocketAddr, path: &str, key: &str) -> Reply {
    send(addr, Method::POST, path, &[("idempotency-key", key)], "{}").await
}

/// Runs `args` on the test's server (standalone Redis or Valkey).
fn server_cmd<T: ::redis::FromRedisValue>(h: &Harness, args: &[&str]) -> T {
    match h {
        Harness::Server(s) => s.cmd(args),
        _ => panic!("this scenario needs a standalone server"),
    }
}

/// The store write fails for real after the handler ran: the layer's locker logs in as an ACL
/// user limited to the lock prefix, and the handler narrows that user's keys to the claim's
/// `:lock` and `:fence` keys, so the server refuses the store script (`NOPERM` on the result
/// key) while claims can still be taken and released. The first caller still gets the
/// handler's answer, nothing is stored, and the claim is released at once rather than left to
/// its TTL. While the store is refused a retry gets 503 (the result cannot be looked up, so
/// the handler is not run blind); once the rule is back the retry runs the handler, and its
/// result is stored and replayed.
///
/// (Out of memory is not such a fault: with `maxmemory 1` and `noeviction` the store script
/// still writes, since Redis lets a script that already wrote, here its `DEL`, finish.)
async fn store_write_failure_still_answers_and_frees_the_claim(h: Harness) {
    let port = match &h {
        Harness::Server(s) => s.port,
        _ => panic!("this scenario needs a standalone server"),
    };
    let user = |keys: &[&str]| {
        let mut args = vec!["ACL", "SETUSER", "dedupe", "on", ">pw", "resetkeys"];
        args.extend_from_slice(keys);
        args.extend_from_slice(&["resetchannels", "&{leasehold:*", "+@all"]);
        let _: () = server_cmd(&h, &args);
    };
    user(&["~{leasehold:*"]);
    let url = format!("redis://dedupe:pw@127.0.0.1:{port}/");
    let locker = lock_core::Locker::redis(&url)
        .await
        .expect("connect as the ACL user");
    let h = Arc::new(h);
    let h2 = h.clone();
    let (app, runs) =
        faulting_on_first_run(&locker, "refused", Duration::from_secs(60), move || {
            let _: () = server_cmd(
                &h2,
                &[
                    "ACL",
                    "SETUSER",
                    "dedupe",
                    "resetkeys",
                    "~{leasehold:*}:lock",
                    "~{leasehold:*}:fence",
                ],
            );
        });
    let addr = serve(app).await;
    let (lock_key, result_key) = claim_keys(&locker, "refused", "k");

    let first = deliver_to(addr, "/hooks/refused", r#""k""#).await;
    assert_eq!(
        (first.status, first.text().as_str()),
        (StatusCode::CREATED, "run 0")
    );
    assert_eq!(first.header("idempotent-replayed"), None);
    let stored: i64 = server_cmd(&h, &["EXISTS", &result_key]);
    assert_eq!(
        stored, 0,
        "the store write was not refused; the fault did not happen"
    );
    let held: i64 = server_cmd(&h, &["EXISTS", &lock_key]);
    assert_eq!(held, 0, "the claim was left held after the store failed");

    let during = deliver_to(addr, "/hooks/refused", r#""k""#).await;
    assert_eq!(
        during.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        during.text()
    );
    assert!(during.header("retry-after").is_some());
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let _: () = server_cmd(
        &h,
        &["ACL", "SETUSER", "dedupe", "resetkeys", "~{leasehold:*"],
    );
    let retry = deliver_to(addr, "/hooks/refused", r#""k""#).await;
    assert_eq!(
        (retry.status, retry.text().as_str()),
        (StatusCode::CREATED, "run 1")
    );
    assert_eq!(retry.header("idempotent-replayed"), None);
    let dup = deliver_to(addr, "/hooks/refused", r#""k""#).await;
    assert_eq!(
        (
            dup.status,
            dup.text().as_str(),
            dup.header("idempotent-replayed")
        ),
        (StatusCode::CREATED, "run 1", Some("true"))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A stored result changed from outside (a status no response has, a field gone, a flag the
/// layer never writes) is neither replayed, which would answer what the handler never said,
/// nor run again, which would repeat a delivery already handled: 503 without `Retry-After`
/// (no retry reads it better), and the handler does not run.
async fn a_corrupted_stored_result_is_refused(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = DedupeLayer::new(h.locker().await);
    let addr = serve(counting(layer, runs.clone(), Duration::ZERO)).await;
    let (_, result_key) = claim_keys(&h.locker().await, "", "mended");
    let corruptions: [&[&str]; 5] = [
        &["HSET", &result_key, "status", "42"],
        &["HDEL", &result_key, "body"],
        &["HSET", &result_key, "omitted", "yes"],
        &["HDEL", &result_key, "fp"],
        // Not a hash at all: a string written over it.
        &["SET", &result_key, "junk"],
    ];
    for corrupt in corruptions {
        let _: i64 = server_cmd(&h, &["DEL", &result_key]);
        let first = deliver(addr, r#""mended""#, "{}").await;
        assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
        let ran = runs.load(Ordering::SeqCst);
        let _: ::redis::Value = server_cmd(&h, corrupt);
        let r = deliver(addr, r#""mended""#, "{}").await;
        assert_eq!(
            r.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{corrupt:?}: {}",
            r.text()
        );
        assert_eq!(r.header("retry-after"), None, "{corrupt:?}");
        assert_eq!(r.header("idempotent-replayed"), None, "{corrupt:?}");
        assert!(r.text().contains("unreadable"), "{corrupt:?}: {}", r.text());
        assert_eq!(runs.load(Ordering::SeqCst), ran, "{corrupt:?}: ran again");
    }
}

/// The client hangs up while the store write is on its way to the server: replies are held
/// back by a proxy, so the layer is still awaiting the store script when the connection
/// closes. The write and the release complete anyway; the retry gets the replay.
async fn client_hangs_up_while_the_result_is_stored(h: Harness) {
    let port = match &h {
        Harness::Server(s) => s.port,
        _ => panic!("this scenario needs a standalone server"),
    };
    let proxy = support::proxy::Proxy::start(port).await;
    let locker = lock_core::Locker::redis(&proxy.url())
        .await
        .expect("connect through the proxy");
    let runs = Arc::new(AtomicUsize::new(0));
    let (tx, mut entered) = mpsc::unbounded_channel();
    let go = Arc::new(Semaphore::new(0));
    let (r2, g2) = (runs.clone(), go.clone());
    let app = Router::new()
        .route(
            "/hooks/slowstore",
            post(move || {
                let (runs, tx, go) = (r2.clone(), tx.clone(), g2.clone());
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst);
                    let _ = tx.send(());
                    if n == 0 {
                        go.acquire().await.expect("gate").forget();
                    }
                    format!("run {n}")
                }
            }),
        )
        .layer(DedupeLayer::new(locker.clone()).claim_ttl(Duration::from_secs(60)));
    let addr = serve(app).await;
    let conn = raw_deliver(addr, "/hooks/slowstore", r#""slow""#).await;
    entered.recv().await.expect("entered");
    // From here every reply takes 600 ms: the store script's answer is still on its way when
    // the client leaves 200 ms after the handler returned.
    proxy.delay_replies(Duration::from_millis(600));
    go.add_permits(1);
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(conn);
    let (lock_key, _) = claim_keys(&locker, "", "slow");
    let released = eventually(Duration::from_secs(10), async || {
        server_cmd::<i64>(&h, &["EXISTS", &lock_key]) == 0
    })
    .await;
    assert!(released, "the claim stayed held after the client hung up");
    proxy.delay_replies(Duration::ZERO);
    let retry = deliver_to(addr, "/hooks/slowstore", r#""slow""#).await;
    assert_eq!(
        (
            retry.status,
            retry.text().as_str(),
            retry.header("idempotent-replayed")
        ),
        (StatusCode::OK, "run 0", Some("true")),
        "the result was not stored after the client hung up"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The server goes away while the handler runs: the first caller still gets the handler's
/// answer (nothing can be stored), and a delivery that arrives while the server is down is
/// answered 503 with `Retry-After: 1`, its handler not run.
async fn backend_down_still_answers_then_refuses(flavor: support::Flavor) {
    let mut s = support::Server::start(flavor);
    let locker = lock_core::Locker::redis(&s.url()).await.expect("connect");
    let runs = Arc::new(AtomicUsize::new(0));
    let addr = serve(counting(
        DedupeLayer::new(locker),
        runs.clone(),
        Duration::from_millis(500),
    ))
    .await;
    let first = tokio::spawn(async move { deliver(addr, r#""going""#, "{}").await });
    assert!(
        eventually(Duration::from_secs(5), async || runs.load(Ordering::SeqCst)
            == 1)
        .await,
        "the handler never ran"
    );
    s.kill();
    let first = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the first caller got no answer within 10 s of the server going away")
        .expect("join");
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert!(first.text().contains(r#""run":1"#), "{}", first.text());

    let r = deliver(addr, r#""while-down""#, "{}").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "a handler ran while the server was down"
    );
}

/// Faults only a real server can show (a refused write, slow replies).
mod server_faults {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn backend_down_on_redis() {
        common::bounded(backend_down_still_answers_then_refuses(
            support::Flavor::Redis,
        ))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn backend_down_on_valkey() {
        common::bounded(backend_down_still_answers_then_refuses(
            support::Flavor::Valkey,
        ))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn store_write_failure_on_redis() {
        common::bounded(store_write_failure_still_answers_and_frees_the_claim(
            Harness::redis(),
        ))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn store_write_failure_on_valkey() {
        common::bounded(store_write_failure_still_answers_and_frees_the_claim(
            Harness::valkey(),
        ))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_corrupted_stored_result_is_refused_on_redis() {
        common::bounded(a_corrupted_stored_result_is_refused(Harness::redis())).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_corrupted_stored_result_is_refused_on_valkey() {
        common::bounded(a_corrupted_stored_result_is_refused(Harness::valkey())).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn client_hangs_up_while_the_result_is_stored_on_redis() {
        common::bounded(client_hangs_up_while_the_result_is_stored(Harness::redis())).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn client_hangs_up_while_the_result_is_stored_on_valkey() {
        common::bounded(client_hangs_up_while_the_result_is_stored(Harness::valkey())).await
    }
}

/// The layer logged in as the `leasehold-dedupe` user of `docs/leasehold.acl` (the rule the
/// README quotes): a burst of duplicates that wait (claim, wake-up subscription, renewal of a
/// short claim, result look-up and store, release) runs the handler once and answers every
/// caller with the stored result, a later duplicate is replayed from the server, and the server
/// denied nothing along the way (its ACL log stays empty).
async fn runs_as_its_acl_user(s: support::Server) {
    let _: () = s.cmd(&["ACL", "LOG", "RESET"]);
    let url = s.acl_user_url_for("leasehold-dedupe");
    let locker = lock_core::Locker::redis(&url)
        .await
        .expect("connect as the ACL user");
    let (lock_key, result_key) = dedupes_once(&locker).await;
    assert_eq!(
        s.cmd::<i64>(&["EXISTS", &result_key]),
        1,
        "no stored result"
    );
    assert_eq!(
        s.cmd::<i64>(&["EXISTS", &lock_key]),
        0,
        "the claim was left held"
    );
    nothing_denied(s.cmd(&["ACL", "LOG"]));
}

/// The same on a 3-master cluster, as `leasehold-dedupe-cluster` on every node (the plain rule
/// lacks the sharded publish and `CLUSTER SLOTS`).
async fn runs_as_its_acl_user_on_a_cluster(flavor: support::Flavor) {
    let c = support::Cluster::start(flavor, 3, 0);
    let urls: Vec<String> = c
        .nodes
        .iter()
        .map(|n| {
            let _: () = n.cmd(&["ACL", "LOG", "RESET"]);
            n.acl_user_url_for("leasehold-dedupe-cluster")
        })
        .collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let locker = lock_core::Locker::redis_cluster(&urls)
        .await
        .expect("connect as the cluster ACL user");
    let (lock_key, result_key) = dedupes_once(&locker).await;
    assert_eq!(
        c.cmd::<i64>(&["EXISTS", &result_key]),
        1,
        "no stored result"
    );
    assert_eq!(
        c.cmd::<i64>(&["EXISTS", &lock_key]),
        0,
        "the claim was left held"
    );
    for n in &c.nodes {
        nothing_denied(n.cmd(&["ACL", "LOG"]));
    }
}

/// Five waiting duplicates and a later one through the layer on `locker`: the handler runs
/// once, every caller gets its result. Returns the claim's lock and result keys.
async fn dedupes_once(locker: &lock_core::Locker) -> (String, String) {
    let runs = Arc::new(AtomicUsize::new(0));
    // A claim of 1 s renews at a third of it, while the handler still runs.
    let layer = DedupeLayer::new(locker.clone())
        .claim_ttl(Duration::from_secs(1))
        .wait(Duration::from_secs(30));
    let addr = serve(counting(layer, runs.clone(), Duration::from_millis(600))).await;
    let calls: Vec<_> = (0..5)
        .map(|_| tokio::spawn(async move { deliver(addr, r#""acl-1""#, "{}").await }))
        .collect();
    let mut bodies = Vec::new();
    let mut replayed = 0;
    for c in calls {
        let r = c.await.expect("join");
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
        replayed += usize::from(r.header("idempotent-replayed") == Some("true"));
        bodies.push(r.body);
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran more than once"
    );
    assert_eq!(replayed, 4, "the waiting duplicates were not replayed");
    assert!(bodies.iter().all(|b| *b == bodies[0]));
    let later = deliver(addr, r#""acl-1""#, "{}").await;
    assert_eq!(later.header("idempotent-replayed"), Some("true"));
    assert_eq!(later.body, bodies[0]);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    claim_keys(locker, "", "acl-1")
}

/// A server's `ACL LOG` holds no denial but the client library's optional `CLIENT SETINFO`.
fn nothing_denied(log: Vec<std::collections::HashMap<String, String>>) {
    let denied: Vec<_> = log
        .iter()
        // The client library names itself on connect (`CLIENT SETINFO`, Valkey and Redis 7.2+)
        // and carries on when that is refused; the locks' rule does not grant it either.
        .filter(|e| e.get("object").map(String::as_str) != Some("client|setinfo"))
        .collect();
    assert!(denied.is_empty(), "the server denied commands: {denied:?}");
}

/// The store script run as it ships, by a user whose `GET` is taken away while `EVALSHA` is
/// not: the denied read of the claim comes back as the server's error (the layer logs that the
/// store failed), never as 0, which the layer reads as a claim that lapsed. Nothing is written.
async fn store_script_reports_a_refused_read(s: support::Server) {
    let url = s.acl_user_url_for("leasehold-dedupe");
    let _: () = s.cmd(&["ACL", "SETUSER", "leasehold-dedupe", "-get"]);
    let client = ::redis::Client::open(url).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect as the ACL user");
    let (lock_key, result_key) = (
        "{leasehold:\x1Fdedupe:x}:lock",
        "{leasehold:\x1Fdedupe:x}:result",
    );
    let _: () = s.cmd(&["SET", lock_key, "token"]);
    let script = ::redis::Script::new(include_str!("../src/lua/store_result.lua"));
    let stored: ::redis::RedisResult<i64> = script
        .key(lock_key)
        .key(result_key)
        .arg("token")
        .arg(60_000)
        .arg("fp")
        .arg(201)
        .arg("")
        .arg("body")
        .arg(0)
        .invoke_async(&mut conn)
        .await;
    match stored {
        Err(e) if e.code().is_some() => {}
        other => panic!("want the server's refusal, got {other:?}"),
    }
    assert_eq!(
        s.cmd::<i64>(&["EXISTS", result_key]),
        0,
        "a result was written"
    );
    // The same call with the rule restored stores it: the refusal was the denied GET.
    s.acl_user_url_for("leasehold-dedupe");
    let stored: i64 = script
        .key(lock_key)
        .key(result_key)
        .arg("token")
        .arg(60_000)
        .arg("fp")
        .arg(201)
        .arg("")
        .arg("body")
        .arg(0)
        .invoke_async(&mut conn)
        .await
        .expect("store");
    assert_eq!(stored, 1);
}

/// A server state that refuses commands, for the dedupe scenarios below.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusing {
    /// `maxmemory 1` with `noeviction`: commands that may grow memory are refused (OOM).
    Oom,
    /// The server turned into a replica of a master that is not there: writes are refused
    /// (READONLY), its data stays.
    ReadOnly,
    /// The layer's ACL user loses every command (NOPERM).
    NoPerm,
    /// Writes stopped after a background save failed (MISCONF).
    Misconf,
}

/// Where the server writes its dump; a directory put there makes the next save fail.
fn dump_path(s: &support::Server) -> std::path::PathBuf {
    let dir: Vec<String> = s.cmd(&["CONFIG", "GET", "dir"]);
    let file: Vec<String> = s.cmd(&["CONFIG", "GET", "dbfilename"]);
    std::path::Path::new(&dir[1]).join(&file[1])
}

/// Starts a background save and returns how it ended (`ok` or `err`).
fn bgsave(s: &support::Server) -> String {
    let _: String = s.cmd(&["BGSAVE"]);
    let field = |name: &str| {
        let info: String = s.cmd(&["INFO", "persistence"]);
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap_or_default()
            .trim()
            .to_owned()
    };
    let give_up = std::time::Instant::now() + Duration::from_secs(10);
    while field("rdb_bgsave_in_progress") != "0" {
        assert!(std::time::Instant::now() < give_up, "BGSAVE never ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    field("rdb_last_bgsave_status")
}

fn set_refusing(s: &support::Server, how: Refusing, on: bool) {
    match (how, on) {
        (Refusing::Oom, true) => {
            let _: () = s.cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
            let _: () = s.cmd(&["CONFIG", "SET", "maxmemory", "1"]);
        }
        (Refusing::Oom, false) => {
            let _: () = s.cmd(&["CONFIG", "SET", "maxmemory", "0"]);
        }
        (Refusing::ReadOnly, true) => {
            let port = support::free_port().to_string();
            let _: () = s.cmd(&["REPLICAOF", "127.0.0.1", &port]);
        }
        (Refusing::ReadOnly, false) => {
            let _: () = s.cmd(&["REPLICAOF", "NO", "ONE"]);
        }
        (Refusing::NoPerm, true) => {
            let _: () = s.cmd(&["ACL", "SETUSER", "leasehold-dedupe", "-@all"]);
        }
        (Refusing::NoPerm, false) => {
            s.acl_user_url_for("leasehold-dedupe");
        }
        (Refusing::Misconf, true) => {
            // Writes stop only with save points configured (the support starts with none).
            let _: () = s.cmd(&["CONFIG", "SET", "save", "3600 1"]);
            let _: () = s.cmd(&["CONFIG", "SET", "stop-writes-on-bgsave-error", "yes"]);
            std::fs::create_dir(dump_path(s)).expect("a directory where the dump goes");
            assert_eq!(bgsave(s), "err", "the background save did not fail");
        }
        (Refusing::Misconf, false) => {
            std::fs::remove_dir(dump_path(s)).expect("remove the directory");
            assert_eq!(bgsave(s), "ok", "the background save still fails");
        }
    }
}

/// Every key with its value or hash, read as the default user.
fn keys_and_values(s: &support::Server) -> Vec<(String, String)> {
    let mut conn = s.conn();
    let mut keys: Vec<String> = ::redis::cmd("KEYS")
        .arg("*")
        .query(&mut conn)
        .expect("KEYS");
    keys.sort();
    keys.into_iter()
        .map(|k| {
            let kind: String = ::redis::cmd("TYPE").arg(&k).query(&mut conn).expect("TYPE");
            let v = if kind == "hash" {
                let h: std::collections::BTreeMap<String, Vec<u8>> = ::redis::cmd("HGETALL")
                    .arg(&k)
                    .query(&mut conn)
                    .expect("HGETALL");
                format!("{h:?}")
            } else {
                let v: Option<String> = ::redis::cmd("GET").arg(&k).query(&mut conn).expect("GET");
                format!("{v:?}")
            };
            (k, v)
        })
        .collect()
}

/// The server refuses before the handler runs: a new delivery is answered 503 with
/// `Retry-After`, the handler does not run and no key changes. A stored answer is still replayed
/// where the look-up (a read) is allowed (OOM, READONLY, MISCONF), and refused with 503 where it
/// is not (NOPERM). Once the server recovers the delivery runs once and its duplicate is replayed.
async fn refused_before_the_handler(s: support::Server, how: Refusing) {
    let url = s.acl_user_url_for("leasehold-dedupe");
    let locker = lock_core::Locker::redis(&url)
        .await
        .expect("connect as the ACL user");
    let runs = Arc::new(AtomicUsize::new(0));
    let addr = serve(counting(
        DedupeLayer::new(locker),
        runs.clone(),
        Duration::ZERO,
    ))
    .await;
    let stored = deliver(addr, r#""before""#, "{}").await;
    assert_eq!(stored.status, StatusCode::CREATED);

    set_refusing(&s, how, true);
    let before = keys_and_values(&s);
    let r = deliver(addr, r#""new""#, "{}").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    assert!(r.header("retry-after").is_some(), "503 without Retry-After");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran while refused"
    );
    let replay = deliver(addr, r#""before""#, "{}").await;
    if how == Refusing::NoPerm {
        assert_eq!(
            replay.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            replay.text()
        );
    } else {
        assert_eq!(
            (replay.header("idempotent-replayed"), &replay.body),
            (Some("true"), &stored.body),
            "a stored answer was not replayed while only writes were refused"
        );
    }
    assert_eq!(keys_and_values(&s), before, "keys changed while refused");

    set_refusing(&s, how, false);
    let mut last = None;
    let ran = eventually(Duration::from_secs(5), async || {
        let r = deliver(addr, r#""new""#, "{}").await;
        let ok = r.status == StatusCode::CREATED;
        last = Some(r);
        ok
    })
    .await;
    let last = last.expect("a delivery");
    assert!(ran, "not recovered: {} {}", last.status, last.text());
    assert_eq!(last.header("idempotent-replayed"), None);
    let dup = deliver(addr, r#""new""#, "{}").await;
    assert_eq!(dup.header("idempotent-replayed"), Some("true"));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// The server turns into a replica while the handler runs: the first caller still gets the
/// handler's answer, the store script is refused (READONLY) and nothing is stored. The claim's
/// release is refused too, so the claim stays on the server until its TTL runs out (a
/// duplicate meanwhile gets 409); after that the retry runs the handler again and is stored.
async fn store_refused_while_read_only(s: support::Server) {
    let locker = lock_core::Locker::redis(&s.url()).await.expect("connect");
    let s = Arc::new(s);
    let s2 = s.clone();
    // A claim long enough that the duplicate below meets it, short for the test.
    let (app, runs) =
        faulting_on_first_run(&locker, "demoted", Duration::from_secs(2), move || {
            set_refusing(&s2, Refusing::ReadOnly, true)
        });
    let addr = serve(app).await;
    let (lock_key, result_key) = claim_keys(&locker, "demoted", "k");

    let first = deliver_to(addr, "/hooks/demoted", r#""k""#).await;
    assert_eq!(
        (first.status, first.text().as_str()),
        (StatusCode::CREATED, "run 0")
    );
    assert_eq!(
        s.cmd::<i64>(&["EXISTS", &result_key]),
        0,
        "a result was stored"
    );
    assert_eq!(
        s.cmd::<i64>(&["EXISTS", &lock_key]),
        1,
        "the claim's release was not refused; the fault did not happen"
    );
    set_refusing(&s, Refusing::ReadOnly, false);
    let dup = deliver_to(addr, "/hooks/demoted", r#""k""#).await;
    assert_eq!(dup.status, StatusCode::CONFLICT, "{}", dup.text());
    let mut last = None;
    let ran = eventually(Duration::from_secs(5), async || {
        let r = deliver_to(addr, "/hooks/demoted", r#""k""#).await;
        let ok = r.status != StatusCode::CONFLICT;
        last = Some(r);
        ok
    })
    .await;
    let last = last.expect("a delivery");
    assert!(ran, "the claim outlived its TTL");
    assert_eq!(
        (
            last.status,
            last.text().as_str(),
            last.header("idempotent-replayed")
        ),
        (StatusCode::CREATED, "run 1", None)
    );
    let replay = deliver_to(addr, "/hooks/demoted", r#""k""#).await;
    assert_eq!(
        (replay.text().as_str(), replay.header("idempotent-replayed")),
        ("run 1", Some("true"))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Out of memory (`maxmemory 1`, `noeviction`) from inside the handler: the store script
/// deletes before it writes, and a script that has written is let finish, so the result is
/// still stored and the claim released; a duplicate, with memory still full, gets the replay.
async fn stored_while_out_of_memory(s: support::Server) {
    let locker = lock_core::Locker::redis(&s.url()).await.expect("connect");
    let s = Arc::new(s);
    let s2 = s.clone();
    let (app, runs) = faulting_on_first_run(&locker, "full", Duration::from_secs(2), move || {
        set_refusing(&s2, Refusing::Oom, true)
    });
    let addr = serve(app).await;
    let (lock_key, result_key) = claim_keys(&locker, "full", "k");
    let first = deliver_to(addr, "/hooks/full", r#""k""#).await;
    assert_eq!(
        (first.status, first.text().as_str()),
        (StatusCode::CREATED, "run 0")
    );
    assert_eq!(
        s.cmd::<i64>(&["EXISTS", &result_key]),
        1,
        "no result stored"
    );
    assert_eq!(
        s.cmd::<i64>(&["EXISTS", &lock_key]),
        0,
        "the claim was not released"
    );
    let dup = deliver_to(addr, "/hooks/full", r#""k""#).await;
    assert_eq!(
        (
            dup.status,
            dup.text().as_str(),
            dup.header("idempotent-replayed")
        ),
        (StatusCode::CREATED, "run 0", Some("true"))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The fault was on all along: a plain write is still refused.
    let refused: Result<(), _> = ::redis::cmd("SET")
        .arg("probe")
        .arg("1")
        .query(&mut s.conn());
    assert!(refused.is_err(), "memory was not full");
    set_refusing(&s, Refusing::Oom, false);
}

/// The layer against a server that refuses commands.
mod refusing {
    use super::*;

    macro_rules! refusing {
        ($($name:ident: $flavor:ident, $how:ident;)*) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                common::bounded(refused_before_the_handler(
                    support::Server::start(support::Flavor::$flavor),
                    Refusing::$how,
                ))
                .await
            }
        )*};
    }

    refusing! {
        before_the_handler_oom_on_redis: Redis, Oom;
        before_the_handler_oom_on_valkey: Valkey, Oom;
        before_the_handler_readonly_on_redis: Redis, ReadOnly;
        before_the_handler_readonly_on_valkey: Valkey, ReadOnly;
        before_the_handler_noperm_on_redis: Redis, NoPerm;
        before_the_handler_noperm_on_valkey: Valkey, NoPerm;
        before_the_handler_misconf_on_redis: Redis, Misconf;
        before_the_handler_misconf_on_valkey: Valkey, Misconf;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn store_refused_while_read_only_on_redis() {
        common::bounded(store_refused_while_read_only(support::Server::start(
            support::Flavor::Redis,
        )))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stored_while_out_of_memory_on_redis() {
        common::bounded(stored_while_out_of_memory(support::Server::start(
            support::Flavor::Redis,
        )))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stored_while_out_of_memory_on_valkey() {
        common::bounded(stored_while_out_of_memory(support::Server::start(
            support::Flavor::Valkey,
        )))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn store_refused_while_read_only_on_valkey() {
        common::bounded(store_refused_while_read_only(support::Server::start(
            support::Flavor::Valkey,
        )))
        .await
    }
}

/// The layer under the restricted user of `docs/leasehold.acl`.
mod acl_user {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_as_its_acl_user_on_redis() {
        common::bounded(runs_as_its_acl_user(support::Server::start(
            support::Flavor::Redis,
        )))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_as_its_acl_user_on_valkey() {
        common::bounded(runs_as_its_acl_user(support::Server::start(
            support::Flavor::Valkey,
        )))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_as_its_acl_user_on_a_redis_cluster() {
        common::bounded(runs_as_its_acl_user_on_a_cluster(support::Flavor::Redis)).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_as_its_acl_user_on_a_valkey_cluster() {
        common::bounded(runs_as_its_acl_user_on_a_cluster(support::Flavor::Valkey)).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn store_script_reports_a_refused_read_on_redis() {
        common::bounded(store_script_reports_a_refused_read(support::Server::start(
            support::Flavor::Redis,
        )))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn store_script_reports_a_refused_read_on_valkey() {
        common::bounded(store_script_reports_a_refused_read(support::Server::start(
            support::Flavor::Valkey,
        )))
        .await
    }
}

/// A retention or claim TTL out of range is the layer's own misconfiguration: a 500 naming it,
/// before the handler runs (its result could not be stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_out_of_range_are_a_500() {
    let layers = [
        (
            "retention",
            DedupeLayer::new(lock_core::Locker::memory()).retention(Duration::ZERO),
        ),
        // Below a millisecond: Redis would be told to keep the result 0 ms (`PEXPIRE key 0`
        // deletes it), so duplicates would run the handler again.
        (
            "retention",
            DedupeLayer::new(lock_core::Locker::memory()).retention(Duration::from_micros(500)),
        ),
        (
            "ttl",
            DedupeLayer::new(lock_core::Locker::memory()).claim_ttl(Duration::from_micros(500)),
        ),
        (
            "retention",
            DedupeLayer::new(lock_core::Locker::memory()).retention(Duration::MAX),
        ),
        (
            "ttl",
            DedupeLayer::new(lock_core::Locker::memory()).claim_ttl(Duration::MAX),
        ),
    ];
    for (named, layer) in layers {
        let ran = Arc::new(AtomicUsize::new(0));
        let addr = serve(counting(layer, ran.clone(), Duration::ZERO)).await;
        let res = deliver(addr, r#""misconfigured""#, "{}").await;
        assert_eq!(res.status, StatusCode::INTERNAL_SERVER_ERROR, "{named}");
        let problem: serde_json::Value = serde_json::from_slice(&res.body).expect("json");
        assert!(
            problem["detail"]
                .as_str()
                .is_some_and(|d| d.to_lowercase().contains(named)),
            "{problem}"
        );
        assert_eq!(ran.load(Ordering::SeqCst), 0, "the handler ran");
    }
}

/// The retention's bounds themselves are in range. A year (and, for comparison, a second):
/// the delivery runs and its duplicate is replayed. 1 ms: accepted (no 500), the delivery
/// runs, and a duplicate 20 ms later runs again; whether its result was stored for that
/// millisecond this cannot tell (a shorter retention is `results_expire_after_the_retention`'s
/// subject).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_at_its_bounds_is_accepted() {
    for retention in [
        Duration::from_millis(1_000),
        lock_tower::dedupe::MAX_RETENTION,
    ] {
        let ran = Arc::new(AtomicUsize::new(0));
        let layer = DedupeLayer::new(lock_core::Locker::memory()).retention(retention);
        let addr = serve(counting(layer, ran.clone(), Duration::ZERO)).await;
        let first = deliver(addr, r#""bounds""#, "{}").await;
        assert_eq!(
            first.status,
            StatusCode::CREATED,
            "{retention:?}: {}",
            first.text()
        );
        let again = deliver(addr, r#""bounds""#, "{}").await;
        assert_eq!(
            again.header("idempotent-replayed"),
            Some("true"),
            "{retention:?}"
        );
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }
    // At the lower bound the result is kept 1 ms: the delivery runs, and a duplicate soon
    // after runs again.
    let ran = Arc::new(AtomicUsize::new(0));
    let layer = DedupeLayer::new(lock_core::Locker::memory()).retention(Duration::from_millis(1));
    let addr = serve(counting(layer, ran.clone(), Duration::ZERO)).await;
    let first = deliver(addr, r#""brief""#, "{}").await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    tokio::time::sleep(Duration::from_millis(20)).await;
    let again = deliver(addr, r#""brief""#, "{}").await;
    assert_eq!(
        (again.status, again.header("idempotent-replayed")),
        (StatusCode::CREATED, None)
    );
    assert_eq!(ran.load(Ordering::SeqCst), 2);
}

/// A setting under which no delivery can be deduplicated is answered 500 for every request
/// the layer dedupes, and only for those: an unkeyed request the layer was told to pass on
/// still passes, and the answer does not hang on whether the store is reachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_out_of_range_spare_unkeyed_requests_and_need_no_store() {
    let layers = [
        DedupeLayer::new(lock_core::Locker::memory()).retention(Duration::ZERO),
        DedupeLayer::new(lock_core::Locker::memory()).claim_ttl(Duration::from_micros(500)),
    ];
    for layer in layers {
        let ran = Arc::new(AtomicUsize::new(0));
        let addr = serve(counting(
            layer.pass_through_without_key(),
            ran.clone(),
            Duration::ZERO,
        ))
        .await;
        let res = send(addr, Method::POST, "/hooks/a", &[], "{}").await;
        assert_eq!(res.status, StatusCode::CREATED, "{}", res.text());
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }
    // A claim TTL out of range on a store that has gone away: still the layer's 500 (no
    // `Retry-After`), not the store's 503.
    let mut server = support::Server::start(support::Flavor::Redis);
    let locker = lock_core::Locker::redis(&server.url())
        .await
        .expect("connect");
    server.kill();
    let ran = Arc::new(AtomicUsize::new(0));
    let layer = DedupeLayer::new(locker).claim_ttl(Duration::MAX);
    let addr = serve(counting(layer, ran.clone(), Duration::ZERO)).await;
    let res = deliver(addr, r#""gone""#, "{}").await;
    assert_eq!(
        res.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{}",
        res.text()
    );
    assert_eq!(res.header("retry-after"), None);
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the handler ran");
}

/// The claim name as the layer spelled it before its claims had a namespace of their own: a
/// plain key any client could name.
fn unnamespaced_claim_name(scope: &str, key: &str) -> String {
    format!("dedupe:{}", claim_name(scope, key))
}

/// A client sends a `LockLayer` route (no key prefix, keyed by a header) the name of a delivery's
/// claim as it would be spelled as a plain key, and holds that lock; another holds it with a plain
/// `try_acquire`. Neither can keep the delivery from being handled: the claims live in a namespace
/// no plain key can name.
async fn a_lock_key_spelled_like_a_claim_cannot_hold_a_delivery(h: Harness) {
    let locker = h.locker().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let go = Arc::new(Semaphore::new(0));
    let (tx, mut entered) = mpsc::unbounded_channel();
    let g2 = go.clone();
    let locked = Router::new()
        .route(
            "/resources",
            post(move || {
                let (go, tx) = (g2.clone(), tx.clone());
                async move {
                    let _ = tx.send(());
                    go.acquire().await.expect("gate").forget();
                    "released"
                }
            }),
        )
        .route_layer(LockLayer::new(
            locker.clone(),
            KeyExtractor::header(HeaderName::from_static("x-resource")),
        ));
    let hooks = counting(
        DedupeLayer::new(locker.clone()),
        runs.clone(),
        Duration::ZERO,
    );
    let addr = serve(locked.merge(hooks)).await;

    let hostile = unnamespaced_claim_name("", "evt-hostile");
    let holder = tokio::spawn(async move {
        send(
            addr,
            Method::POST,
            "/resources",
            &[("x-resource", hostile.as_str())],
            "",
        )
        .await
    });
    entered
        .recv()
        .await
        .expect("the hostile request holds its lock");
    let r = deliver(addr, r#""evt-hostile""#, "{}").await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    assert_eq!(r.header("idempotent-replayed"), None);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler did not run");

    let plain = locker
        .try_acquire(
            &unnamespaced_claim_name("", "evt-plain"),
            &lock_core::LockOptions::new().ttl(Duration::from_secs(60)),
        )
        .await
        .expect("a plain key spelled like the claim");
    let r = deliver(addr, r#""evt-plain""#, "{}").await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the handler did not run");
    plain.release().await.expect("release");

    go.add_permits(1);
    let held = holder.await.expect("join");
    assert_eq!(held.status, StatusCode::OK, "{}", held.text());
}

/// Two GitHub hooks on one path, told apart by a query parameter, get the same delivery id:
/// each runs once and replays its own answer (no 422 from the other hook's fingerprint).
async fn github_hooks_told_apart_by_a_query_are_two_hooks(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = DedupeLayer::new(h.locker().await).key(KeyExtractor::github_delivery());
    let addr = serve(counting(layer, runs.clone(), Duration::ZERO)).await;
    let delivery = [("x-github-delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958")];
    let mut firsts = std::collections::HashMap::new();
    for (path, replayed) in [
        ("/hooks/gh?hook=ci", None),
        ("/hooks/gh?hook=deploy", None),
        ("/hooks/gh?hook=ci", Some("true")),
        ("/hooks/gh?hook=deploy", Some("true")),
    ] {
        let r = send(addr, Method::POST, path, &delivery, "{}").await;
        assert_eq!(r.status, StatusCode::CREATED, "{path}: {}", r.text());
        assert_eq!(r.header("idempotent-replayed"), replayed, "{path}");
        let first = firsts.entry(path).or_insert_with(|| r.body.clone());
        assert_eq!(*first, r.body, "{path}: another hook's answer");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "each hook ran once");
}

/// A Stripe-style JSON id: an empty or blank one is no id (400, or pass-through, where two
/// such events are not deduplicated against each other); ids are capped like
/// `Idempotency-Key`; a number and the string of its digits are one key.
async fn json_ids_empty_long_or_numeric(h: Harness) {
    let locker = h.locker().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let r2 = runs.clone();
    let handler = move |body: Bytes| {
        let runs = r2.clone();
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            body
        }
    };
    let app = Router::new()
        .route(
            "/hooks/stripe",
            post(handler.clone())
                .layer(DedupeLayer::new(locker.clone()).key(KeyExtractor::json_field("/id"))),
        )
        .route(
            "/hooks/lenient",
            post(handler).layer(
                DedupeLayer::new(locker)
                    .key(KeyExtractor::json_field("/id"))
                    .scope("lenient")
                    .pass_through_without_key(),
            ),
        );
    let addr = serve(app).await;
    let event = |path: &'static str, body: String| async move {
        send(addr, Method::POST, path, &[], body).await
    };
    for id in [r#""""#, r#""   ""#] {
        let r = event("/hooks/stripe", format!(r#"{{"id":{id},"n":1}}"#)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "id {id}: {}", r.text());
        assert!(r.text().contains("missing-key"), "{}", r.text());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // Passing through, two malformed events with empty ids are two events.
    for n in 1..=2 {
        let body = format!(r#"{{"id":"","n":{n}}}"#);
        let r = event("/hooks/lenient", body.clone()).await;
        assert_eq!(r.status, StatusCode::OK, "event {n}: {}", r.text());
        assert_eq!(r.text(), body);
        assert_eq!(r.header("idempotent-replayed"), None);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    let at_cap = "e".repeat(lock_tower::MAX_IDEMPOTENCY_KEY_LEN);
    let r = event("/hooks/stripe", format!(r#"{{"id":"{at_cap}"}}"#)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let over = "e".repeat(lock_tower::MAX_IDEMPOTENCY_KEY_LEN + 1);
    let r = event("/hooks/stripe", format!(r#"{{"id":"{over}"}}"#)).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    assert!(r.text().contains("invalid-key"), "{}", r.text());
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    // `7` and `"7"` are one key (documented): the second is the same key with another body.
    let r = event("/hooks/stripe", r#"{"id":7}"#.to_owned()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let r = event("/hooks/stripe", r#"{"id":"7"}"#.to_owned()).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.text());
    assert_eq!(runs.load(Ordering::SeqCst), 4);

    // Numbers that are not whole 64-bit ones were rounded when parsed: two distinct ids above
    // 2^64 would share a key, so they are refused.
    for id in [
        "7.5",
        "1e30",
        "18446744073709551616",
        "-9223372036854775809",
    ] {
        let r = event("/hooks/stripe", format!(r#"{{"id":{id}}}"#)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "id {id}: {}", r.text());
        assert!(r.text().contains("invalid-key"), "{}", r.text());
    }
    let r = event("/hooks/stripe", format!(r#"{{"id":{}}}"#, u64::MAX)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(runs.load(Ordering::SeqCst), 5);
}

/// A route for every method whose handler counts its runs and answers `run N`.
fn any_method(layer: DedupeLayer, runs: Arc<AtomicUsize>) -> Router {
    Router::new()
        .route(
            "/things",
            any(move || {
                let runs = runs.clone();
                async move { format!("run {}", runs.fetch_add(1, Ordering::SeqCst) + 1) }
            }),
        )
        .layer(layer)
}

/// By default POST, PUT, PATCH and DELETE are deduplicated and a keyed GET runs every time;
/// `methods` narrows that to the methods given.
async fn only_the_filtered_methods_are_deduplicated(h: Harness) {
    let locker = h.locker().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let addr = serve(any_method(DedupeLayer::new(locker.clone()), runs.clone())).await;
    let key = [("idempotency-key", r#""m-1""#)];
    for n in 1..=2 {
        let r = send(addr, Method::GET, "/things", &key, "").await;
        assert_eq!((r.status, r.text()), (StatusCode::OK, format!("run {n}")));
        assert_eq!(r.header("idempotent-replayed"), None, "GET {n}");
    }
    for (n, method) in [Method::POST, Method::PUT, Method::PATCH, Method::DELETE]
        .into_iter()
        .enumerate()
    {
        let key = format!("\"m-{method}\"");
        let key = [("idempotency-key", key.as_str())];
        let first = send(addr, method.clone(), "/things", &key, "").await;
        assert_eq!(first.text(), format!("run {}", n + 3), "{method}");
        let dup = send(addr, method.clone(), "/things", &key, "").await;
        assert_eq!(
            (dup.text(), dup.header("idempotent-replayed")),
            (first.text(), Some("true")),
            "{method}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 6);

    let runs = Arc::new(AtomicUsize::new(0));
    let put_only = DedupeLayer::new(locker)
        .scope("put-only")
        .methods([Method::PUT]);
    let addr = serve(any_method(put_only, runs.clone())).await;
    let key = [("idempotency-key", r#""m-2""#)];
    let first = send(addr, Method::PUT, "/things", &key, "").await;
    let dup = send(addr, Method::PUT, "/things", &key, "").await;
    assert_eq!(first.text(), "run 1");
    assert_eq!(
        (dup.text(), dup.header("idempotent-replayed")),
        ("run 1".to_owned(), Some("true"))
    );
    for n in 2..=3 {
        let r = send(addr, Method::POST, "/things", &key, "").await;
        assert_eq!(r.text(), format!("run {n}"), "POST outside the filter");
        assert_eq!(r.header("idempotent-replayed"), None);
    }
}

/// A router-wide `DedupeLayer` and a route's own on one locker, with the same scope and key
/// source: the inner one finds the claim held by the outer one for this very request and lets
/// it by, so the delivery is handled once and replayed after; it used to find the claim taken
/// and answer 409, which the outer layer passed on unstored, to every delivery for ever.
async fn nested_layers_with_one_claim_dedupe_once(h: Harness) {
    let locker = h.locker().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = post(move || {
        let runs = counted.clone();
        async move { format!("run {}", runs.fetch_add(1, Ordering::SeqCst) + 1) }
    })
    .layer(DedupeLayer::new(locker.clone()).stored_body_limit(1 << 20));
    let app = Router::new()
        .route("/orders", handler)
        .layer(DedupeLayer::new(locker));
    let addr = serve(app).await;
    let key = [("idempotency-key", r#""nested-1""#)];
    let first = send(addr, Method::POST, "/orders", &key, "{}").await;
    assert_eq!(
        (first.status, first.text()),
        (StatusCode::OK, "run 1".to_owned())
    );
    assert_eq!(first.header("idempotent-replayed"), None);
    let dup = send(addr, Method::POST, "/orders", &key, "{}").await;
    assert_eq!(
        (dup.status, dup.text()),
        (StatusCode::OK, "run 1".to_owned())
    );
    assert_eq!(dup.header("idempotent-replayed"), Some("true"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A HEAD request under a layer that covers GET (so HEAD too): axum runs the GET handler and
/// sends its head, the body's length and no body. The layer stores that answer and replays it,
/// both where axum drops the body outside the layer (a route of this router) and where it
/// drops it inside (a router nested as a service under the layer). In the second the layer
/// used to take the missing body for one cut short: 500, nothing stored, the handler run again
/// on every retry.
async fn a_head_request_is_deduplicated(h: Harness) {
    let locker = h.locker().await;
    for nested in [false, true] {
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        let export = get(move || {
            let runs = counted.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                "data"
            }
        });
        let app = if nested {
            Router::new().nest_service("/api", Router::new().route("/export", export))
        } else {
            Router::new().route("/api/export", export)
        };
        let layer = DedupeLayer::new(locker.clone())
            .methods([Method::GET])
            .scope(if nested { "nested" } else { "route" });
        let addr = serve(app.layer(layer)).await;
        let key = [("idempotency-key", r#""head-1""#)];
        let first = send(addr, Method::HEAD, "/api/export", &key, "").await;
        assert_eq!(
            first.status,
            StatusCode::OK,
            "nested {nested}: {}",
            first.text()
        );
        assert_eq!(first.header("content-length"), Some("4"), "nested {nested}");
        assert_eq!(first.header("idempotent-replayed"), None, "nested {nested}");
        let dup = send(addr, Method::HEAD, "/api/export", &key, "").await;
        assert_eq!(
            dup.status,
            StatusCode::OK,
            "nested {nested}: {}",
            dup.text()
        );
        assert_eq!(
            dup.header("idempotent-replayed"),
            Some("true"),
            "nested {nested}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "nested {nested}");
    }
}

/// Every header of the default allow-list comes back on a replay, repeated ones as often as
/// they were sent, and values with a `:` or bytes above ASCII survive the store's encoding;
/// others are left out.
async fn the_default_allow_list_is_replayed(h: Harness) {
    let listed: &[(&str, &[u8])] = &[
        ("content-type", b"application/json; charset=utf-8"),
        ("content-language", b"de-CH"),
        ("content-location", b"/things/1?v=2"),
        ("location", b"https://example.test:8443/things/1"),
        ("etag", b"W/\"caf\xe9\""),
        ("last-modified", b"Fri, 04 Dec 2026 23:00:00 GMT"),
        ("cache-control", b"no-store"),
        ("cache-control", b"private"),
        ("content-encoding", b"identity"),
        ("vary", b"accept-encoding"),
    ];
    let app = Router::new()
        .route(
            "/hooks/all",
            post(move || async move {
                let mut res = Response::builder().status(StatusCode::CREATED);
                for (name, value) in listed {
                    res = res.header(*name, http::HeaderValue::from_bytes(value).expect("value"));
                }
                res.header("x-not-listed", "1")
                    .body(Body::from("{}"))
                    .expect("response")
            }),
        )
        .layer(DedupeLayer::new(h.locker().await));
    let addr = serve(app).await;
    let first = deliver_to(addr, "/hooks/all", r#""all""#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = deliver_to(addr, "/hooks/all", r#""all""#).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    for name in [
        "content-type",
        "content-language",
        "content-location",
        "location",
        "etag",
        "last-modified",
        "cache-control",
        "content-encoding",
        "vary",
    ] {
        let sent: Vec<&[u8]> = listed
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, v)| *v)
            .collect();
        let got: Vec<&[u8]> = replay
            .headers
            .get_all(name)
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        assert_eq!(got, sent, "{name}");
    }
    assert_eq!(replay.header("x-not-listed"), None);
}

/// `replay_header` ignores the headers that must not be replayed: a session cookie would go to
/// whoever else sends the key, and framing headers would contradict the replay's own body.
#[tokio::test]
async fn headers_never_replayed_stay_off_the_replay() {
    use http::header::{CONNECTION, CONTENT_LENGTH, SET_COOKIE};
    let (logs, logging) = captured::capture(tracing::Level::WARN);
    let layer = DedupeLayer::new(lock_core::Locker::memory())
        .replay_header(SET_COOKIE)
        .replay_header(CONTENT_LENGTH)
        .replay_header(CONNECTION)
        .replay_header(HeaderName::from_static("x-kept"))
        .stored_body_limit(4);
    drop(logging);
    // One warning for each header ignored, none for the one kept.
    let text = logs.text();
    assert_eq!(text.matches("WARN").count(), 3, "{text}");
    assert!(
        text.contains("set-cookie") && text.contains("never replayed") && !text.contains("x-kept"),
        "{text}"
    );
    let app = Router::new()
        .route(
            "/hooks/cookie",
            // Every header the layer must not replay is set by the handler itself, so that the
            // layer sees it (hyper adds its own framing headers only after the layer).
            post(|| async {
                (
                    [
                        ("set-cookie", "sid=first-caller"),
                        ("x-kept", "1"),
                        ("content-length", "9"),
                        ("connection", "keep-alive"),
                    ],
                    "signed in",
                )
            }),
        )
        .layer(layer);
    let addr = serve(app).await;
    let first = deliver_to(addr, "/hooks/cookie", r#""c-1""#).await;
    assert_eq!(first.header("set-cookie"), Some("sid=first-caller"));
    assert_eq!(first.header("content-length"), Some("9"));
    assert_eq!(first.header("connection"), Some("keep-alive"));
    let replay = deliver_to(addr, "/hooks/cookie", r#""c-1""#).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("x-kept"), Some("1"));
    assert_eq!(replay.header("set-cookie"), None);
    assert_eq!(replay.header("connection"), None);
    // The body was above the cap: the replay's is empty, and so says its length.
    assert_eq!(replay.header("idempotent-body-omitted"), Some("true"));
    assert_eq!(replay.header("content-length"), Some("0"));
    assert!(replay.body.is_empty());
}

/// A body long enough for tower-http's compression, which leaves bodies under 32 bytes as
/// they are.
const COMPRESSIBLE: &str = "processed: the event was applied once, and only once. \
                            processed: the event was applied once, and only once.";

/// A handler answering `COMPRESSIBLE`, counting its runs.
fn compressible(runs: Arc<AtomicUsize>) -> axum::routing::MethodRouter {
    post(move || {
        runs.fetch_add(1, Ordering::SeqCst);
        async { COMPRESSIBLE }
    })
}

/// One delivery of the key `"gz-1"`, accepting gzip or no encoding at all.
async fn deliver_accepting(addr: std::net::SocketAddr, gzip: bool) -> Reply {
    let key = ("idempotency-key", r#""gz-1""#);
    let headers: &[(&str, &str)] = if gzip {
        &[key, ("accept-encoding", "gzip")]
    } else {
        &[key]
    };
    send(addr, Method::POST, "/hooks/gz", headers, "{}").await
}

/// Gzip output: its magic bytes, and not the plain body.
fn assert_gzip(r: &Reply, what: &str) {
    assert_eq!(r.header("content-encoding"), Some("gzip"), "{what}");
    assert!(r.body.starts_with(&[0x1f, 0x8b]), "{what}: {:?}", r.body);
    assert_ne!(r.body, COMPRESSIBLE.as_bytes(), "{what}");
}

/// README: a compression layer outside `DedupeLayer` gets the result stored uncompressed, and
/// each replay is compressed for its own caller. The first delivery accepts gzip and gets it; a
/// duplicate that accepts no encoding gets the handler's plain bytes replayed, and one that
/// accepts gzip gets the same bytes compressed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compression_outside_the_layer_compresses_each_replay_for_its_caller() {
    let runs = Arc::new(AtomicUsize::new(0));
    let dedupe = DedupeLayer::new(lock_core::Locker::memory());
    let app = Router::new()
        .route("/hooks/gz", compressible(runs.clone()).layer(dedupe))
        .layer(tower_http::compression::CompressionLayer::new());
    let addr = serve(app).await;

    let first = deliver_accepting(addr, true).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_gzip(&first, "first delivery");

    let plain = deliver_accepting(addr, false).await;
    assert_eq!(plain.status, StatusCode::OK, "{}", plain.text());
    assert_eq!(plain.header("idempotent-replayed"), Some("true"));
    assert_eq!(plain.header("content-encoding"), None);
    assert_eq!(plain.text(), COMPRESSIBLE);

    let gzipped = deliver_accepting(addr, true).await;
    assert_eq!(gzipped.header("idempotent-replayed"), Some("true"));
    assert_gzip(&gzipped, "gzip replay");
    // Compression is deterministic: the same plain bytes give the first delivery's gzip bytes.
    assert_eq!(gzipped.body, first.body);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// README: a compression layer inside `DedupeLayer` gets the compressed bytes stored, and they
/// are replayed with their `Content-Encoding` and `Vary` whatever the retry accepts: a
/// duplicate that accepts no encoding still gets the first delivery's gzip bytes, labelled as
/// gzip (without the label they would be garbage to it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compression_inside_the_layer_replays_the_compressed_bytes() {
    let runs = Arc::new(AtomicUsize::new(0));
    let dedupe = DedupeLayer::new(lock_core::Locker::memory());
    let app = Router::new().route(
        "/hooks/gz",
        compressible(runs.clone())
            .layer::<_, std::convert::Infallible>(tower_http::compression::CompressionLayer::new())
            .layer(dedupe),
    );
    let addr = serve(app).await;

    let first = deliver_accepting(addr, true).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_gzip(&first, "first delivery");
    assert_eq!(first.header("vary"), Some("accept-encoding"));

    let replay = deliver_accepting(addr, false).await;
    assert_eq!(replay.status, StatusCode::OK, "{}", replay.text());
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("content-encoding"), Some("gzip"));
    assert_eq!(replay.header("vary"), Some("accept-encoding"));
    assert_eq!(replay.body, first.body);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// `replay_header` adds a header to the allow-list: it is on the replay, beside the defaults,
/// while a header not listed is not.
async fn replay_header_adds_to_the_allow_list(h: Harness) {
    let app = Router::new()
        .route(
            "/hooks/headers",
            post(|| async {
                (
                    StatusCode::ACCEPTED,
                    [
                        ("content-type", "text/plain"),
                        ("x-request-id", "req-1"),
                        ("x-not-listed", "1"),
                    ],
                    "accepted",
                )
            }),
        )
        .layer(
            DedupeLayer::new(h.locker().await)
                .replay_header(HeaderName::from_static("x-request-id"))
                // Already replayed by default: naming it again must not double it.
                .replay_header(http::header::CONTENT_TYPE),
        );
    let addr = serve(app).await;
    let first = deliver_to(addr, "/hooks/headers", r#""h-1""#).await;
    assert_eq!(first.header("x-not-listed"), Some("1"));
    let replay = deliver_to(addr, "/hooks/headers", r#""h-1""#).await;
    assert_eq!(replay.status, StatusCode::ACCEPTED);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("x-request-id"), Some("req-1"));
    assert_eq!(replay.header("content-type"), Some("text/plain"));
    assert_eq!(replay.headers.get_all("content-type").iter().count(), 1);
    assert_eq!(replay.header("x-not-listed"), None);
    assert_eq!(replay.text(), "accepted");
}

/// Every cap at its exact value is accepted and one past it is not: a response body of exactly
/// the stored cap is stored whole, one byte more is omitted; a request body of exactly the
/// request cap is read, one byte more is 413; an `Idempotency-Key` of exactly
/// `MAX_IDEMPOTENCY_KEY_LEN` characters is a key, one more is 400.
async fn caps_at_their_exact_boundaries(h: Harness) {
    const CAP: usize = 64;
    let runs = Arc::new(AtomicUsize::new(0));
    let r2 = runs.clone();
    let app = Router::new()
        .route(
            "/hooks/{len}",
            post(
                move |axum::extract::Path(len): axum::extract::Path<usize>| {
                    let runs = r2.clone();
                    async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        "r".repeat(len)
                    }
                },
            ),
        )
        .layer(
            DedupeLayer::new(h.locker().await)
                .stored_body_limit(CAP)
                .request_body_limit(CAP),
        );
    let addr = serve(app).await;
    for (len, omitted) in [(CAP, None), (CAP + 1, Some("true"))] {
        let (path, key) = (format!("/hooks/{len}"), format!("\"body-cap-{len}\""));
        let first = deliver_to(addr, &path, &key).await;
        assert_eq!(first.body.len(), len);
        let replay = deliver_to(addr, &path, &key).await;
        assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{len}");
        assert_eq!(replay.header("idempotent-body-omitted"), omitted, "{len}");
        let want = if omitted.is_some() { 0 } else { len };
        assert_eq!(replay.body.len(), want, "{len}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    let hit = |key: String, body: String| async move {
        send(
            addr,
            Method::POST,
            "/hooks/1",
            &[("idempotency-key", key.as_str())],
            body,
        )
        .await
    };
    let r = hit(r#""req-cap""#.to_owned(), "q".repeat(CAP)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let r = hit(r#""req-over""#.to_owned(), "q".repeat(CAP + 1)).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", r.text());
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    let max = lock_tower::MAX_IDEMPOTENCY_KEY_LEN;
    for (len, status) in [(max, StatusCode::OK), (max + 1, StatusCode::BAD_REQUEST)] {
        for key in ["k".repeat(len), format!("\"{}\"", "q".repeat(len))] {
            let r = hit(key, String::new()).await;
            assert_eq!(r.status, status, "a key of {len}: {}", r.text());
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 5);
}

/// A handler that panics: the connection is dropped (axum has no panic handler of its own),
/// and with it the layer's future, which must free the claim (the release a dropped lease
/// sends), not leave it to its TTL; nothing is stored, so the retry runs the handler.
async fn a_panicking_handler_frees_the_claim(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r2 = runs.clone();
    let app = Router::new()
        .route(
            "/hooks/panics",
            post(move || {
                let runs = r2.clone();
                async move {
                    if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                        panic!("the handler panicked (on purpose, in a test)");
                    }
                    "recovered"
                }
            }),
        )
        // A long TTL: only a release can free the claim within the test.
        .layer(DedupeLayer::new(h.locker().await).claim_ttl(Duration::from_secs(60)));
    let addr = serve(app).await;
    let mut tx = common::connect(addr).await;
    let req = http::Request::post("/hooks/panics")
        .header("host", "x")
        .header("idempotency-key", r#""panics""#)
        .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
        .expect("request");
    // The connection drops; were a panic handler in front, it would answer 500.
    if let Ok(res) = tx.send_request(req).await {
        assert!(res.status().is_server_error(), "a panic answered {res:?}");
    }
    let retry = deliver_until_not_busy(addr, "/hooks/panics", r#""panics""#).await;
    assert_eq!(
        (
            retry.status,
            retry.text().as_str(),
            retry.header("idempotent-replayed")
        ),
        (StatusCode::OK, "recovered", None)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// On a Redlock quorum the layer has nowhere shared to keep results: a setup problem, so a 500
/// (`Misconfigured`, no `Retry-After`, since retrying cannot help) and the handler never runs
/// for a keyed request; one without a key gets its 400, or passes on where the layer lets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_backend_is_a_misconfiguration() {
    common::bounded(async {
        let servers: Vec<support::Server> = (0..3)
            .map(|_| support::Server::start(support::Flavor::Redis))
            .collect();
        let urls: Vec<String> = servers.iter().map(support::Server::url).collect();
        let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
        let locker = lock_core::Locker::redlock(&urls).await.expect("connect");
        let runs = Arc::new(AtomicUsize::new(0));
        let addr = serve(counting(
            DedupeLayer::new(locker.clone()),
            runs.clone(),
            Duration::ZERO,
        ))
        .await;
        for key in [r#""q-1""#, r#""q-1""#, r#""q-2""#] {
            let r = deliver(addr, key, "{}").await;
            assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", r.text());
            assert_eq!(r.header("retry-after"), None, "a setup problem said retry");
            assert_eq!(r.header("content-type"), Some("application/problem+json"));
            let problem: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
            assert_eq!(
                problem["type"], "urn:leasehold:problem:misconfigured",
                "{problem}"
            );
        }
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler ran");
        // A request without a key is not deduplicated, so it meets no missing store: its 400
        // as on any backend, or the handler where the layer passes such requests on.
        let r = send(addr, Method::POST, "/hooks/a", &[], "{}").await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler ran");
        let passing = serve(counting(
            DedupeLayer::new(locker).pass_through_without_key(),
            runs.clone(),
            Duration::ZERO,
        ))
        .await;
        let r = send(passing, Method::POST, "/hooks/a", &[], "{}").await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "passed on, the handler ran once"
        );
    })
    .await
}

/// A claim whose stored fence is 2^64 - 1 (set from outside) can never be taken: 503 without
/// `Retry-After`, since no retry can succeed, and the handler does not run; other keys are
/// served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_claim_fence_is_503_without_retry_after() {
    common::bounded(async {
        let server = support::Server::start(support::Flavor::Redis);
        let locker = lock_core::Locker::redis(&server.url())
            .await
            .expect("connect");
        let claim = claims(&locker)
            .lock_key(&claim_name("", "spent"))
            .expect("key");
        let _: () = server.cmd(&["SET", claim.fence_key(), &u64::MAX.to_string()]);
        let runs = Arc::new(AtomicUsize::new(0));
        let addr = serve(counting(
            DedupeLayer::new(locker.clone()),
            runs.clone(),
            Duration::ZERO,
        ))
        .await;
        let r = deliver(addr, r#""spent""#, "{}").await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
        assert_eq!(r.header("retry-after"), None, "retrying cannot help");
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler ran");
        let fresh = deliver(addr, r#""fresh""#, "{}").await;
        assert_eq!(fresh.status, StatusCode::CREATED, "{}", fresh.text());
        // A result stored before the fence ran out is still replayed: the store is read
        // before any claim is taken.
        let fresh_claim = claims(&locker)
            .lock_key(&claim_name("", "fresh"))
            .expect("key");
        let _: () = server.cmd(&["SET", fresh_claim.fence_key(), &u64::MAX.to_string()]);
        let replay = deliver(addr, r#""fresh""#, "{}").await;
        assert_eq!(replay.status, StatusCode::CREATED, "{}", replay.text());
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(replay.body, fresh.body);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    })
    .await
}

/// A response whose first frame alone is over the stored-body cap is handed on as it came,
/// not copied into the layer's buffer first (a 300 KiB `Bytes` here; a handler's large body
/// would otherwise take twice its size while it passes): the caller's frame is the handler's
/// own buffer. Nothing is stored but the status (`Idempotent-Body-Omitted` on replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_first_frame_is_handed_on_uncopied() {
    use http_body_util::BodyExt;
    use tower_service::Service;
    static BIG: [u8; 300 * 1024] = [7; 300 * 1024];
    let mut app: Router = Router::new()
        .route(
            "/hooks/big",
            post(|| async { Body::from(Bytes::from_static(&BIG)) }),
        )
        .layer(DedupeLayer::new(lock_core::Locker::memory()));
    let req = || {
        http::Request::post("/hooks/big")
            .header("idempotency-key", r#""big""#)
            .body(Body::empty())
            .expect("request")
    };
    let res = app.call(req()).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK);
    let mut body = res.into_body();
    let frame = body
        .frame()
        .await
        .expect("a frame")
        .expect("no error")
        .into_data()
        .expect("data");
    assert_eq!(frame.len(), BIG.len());
    assert_eq!(frame.as_ptr(), BIG.as_ptr(), "the frame was copied");
    drop(body);
    let replay = app.call(req()).await.expect("infallible");
    assert_eq!(
        replay
            .headers()
            .get("idempotent-body-omitted")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
}

/// A claim whose lock key holds another program's value (a hash): 503 without `Retry-After`,
/// since a retry meets the same value; nothing is overwritten and the handler does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_key_holding_another_type_is_503_without_retry_after() {
    common::bounded(async {
        let server = support::Server::start(support::Flavor::Redis);
        let locker = lock_core::Locker::redis(&server.url())
            .await
            .expect("connect");
        let (lock_key, _) = claim_keys(&locker, "", "taken");
        let _: i64 = server.cmd(&["HSET", &lock_key, "theirs", "1"]);
        let runs = Arc::new(AtomicUsize::new(0));
        let addr = serve(counting(
            DedupeLayer::new(locker),
            runs.clone(),
            Duration::ZERO,
        ))
        .await;
        let r = deliver(addr, r#""taken""#, "{}").await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
        assert_eq!(r.header("retry-after"), None, "retrying cannot help");
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler ran");
        let theirs: String = server.cmd(&["HGET", &lock_key, "theirs"]);
        assert_eq!(theirs, "1");
    })
    .await
}

/// An empty method list would dedupe nothing, a refusal sent as a success would tell the
/// sender its delivery was handled, and a JSON-body key with a body limit of 0 can never be
/// read (each delivery was refused as too large): all the layer's fault, 500, the handler not
/// run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setups_that_dedupe_nothing_are_a_500() {
    let locker = lock_core::Locker::memory();
    for layer in [
        DedupeLayer::new(locker.clone()).methods(Vec::new()),
        DedupeLayer::new(locker.clone()).reject_status(Reason::MissingKey, StatusCode::ACCEPTED),
        DedupeLayer::new(locker.clone())
            .key(KeyExtractor::json_field("/id"))
            .request_body_limit(0),
    ] {
        let runs = Arc::new(AtomicUsize::new(0));
        let addr = serve(counting(layer, runs.clone(), Duration::ZERO)).await;
        let r = send(addr, Method::POST, "/hooks/a", &[], "{}").await;
        assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", r.text());
        let problem: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(problem["type"], "urn:leasehold:problem:misconfigured");
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler ran");
    }
}

/// A `route_param` key the matched route does not have fails every request the same way: the
/// layer's setup at fault, 500, the handler not run; passed through where the user chose that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_param_the_route_lacks_is_a_500() {
    let locker = lock_core::Locker::memory();
    for (pass, want) in [
        (false, StatusCode::INTERNAL_SERVER_ERROR),
        (true, StatusCode::CREATED),
    ] {
        let mut layer = DedupeLayer::new(locker.clone()).key(KeyExtractor::route_param("delivery"));
        if pass {
            layer = layer.pass_through_without_key();
        }
        let runs = Arc::new(AtomicUsize::new(0));
        let addr = serve(counting(layer, runs.clone(), Duration::ZERO)).await;
        let r = send(addr, Method::POST, "/hooks/a", &[], "{}").await;
        assert_eq!(r.status, want, "{}", r.text());
        assert_eq!(
            runs.load(Ordering::SeqCst),
            usize::from(pass),
            "pass {pass}"
        );
    }
}
