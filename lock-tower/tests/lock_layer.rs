//! `LockLayer` over a real axum server and a real HTTP client, on memory, Redis and Valkey
//! (and a subset on Redis and Valkey Clusters and a Redlock quorum).

mod common;
#[path = "../../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::{get, post};
use bytes::Bytes;
use common::{Drip, Harness, eventually, post as post_to, send, serve};
use http::{Method, Response, StatusCode};
use lock_tower::{Fence, HeldLease, KeyExtractor, LockLayer, Reason};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};

on_every_backend!(
    a_body_ending_in_trailers_frees_the_lease_before_they_go_out,
    held_key_gets_409_with_retry_after,
    sequential_requests_see_increasing_fences,
    concurrent_requests_run_one_at_a_time,
    missing_key_is_400_or_passes_through,
    lease_loss_cancels_the_handler,
    client_disconnect_during_handler_releases,
    client_disconnect_during_body_releases,
    client_disconnect_while_waiting_takes_nothing,
    waiting_gets_the_key_after_the_holder,
    json_body_key_is_handed_on_untouched,
    lease_loss_while_streaming_cuts_the_body,
    percent_encoded_paths_name_the_same_key,
    renewed_through_a_long_handler_and_body,
    a_body_that_ends_at_once_is_not_polled_again,
    a_streamed_body_with_a_length_is_released_before_its_last_byte,
    a_route_param_that_is_not_utf8_is_invalid_even_when_passing_through,
    an_unreadable_request_body_is_not_a_missing_key,
    a_panicking_handler_frees_the_lock,
    head_is_locked_where_get_is,
    a_response_without_a_body_frees_the_lease_before_it_goes_out,
    a_repeated_key_header_is_invalid_even_when_passing_through,
);

// A subset on a 3-master Redis Cluster and Valkey Cluster, and on a Redlock quorum.
on_clusters!(
    held_key_gets_409_with_retry_after,
    sequential_requests_see_increasing_fences,
    concurrent_requests_run_one_at_a_time,
    client_disconnect_during_handler_releases,
    waiting_gets_the_key_after_the_holder,
);
on_quorum!(
    held_key_gets_409_with_retry_after,
    sequential_requests_see_increasing_fences,
    concurrent_requests_run_one_at_a_time,
    client_disconnect_during_handler_releases,
    waiting_gets_the_key_after_the_holder,
    lease_loss_cancels_the_handler,
    lease_loss_while_streaming_cuts_the_body,
    renewed_through_a_long_handler_and_body,
);

/// A route whose handler reports it entered and then waits for `go`.
fn gated(layer: LockLayer, entered: mpsc::UnboundedSender<u64>, go: Arc<Semaphore>) -> Router {
    Router::new()
        .route(
            "/accounts/{id}/withdraw",
            post(move |Fence(f): Fence| {
                let entered = entered.clone();
                let go = go.clone();
                async move {
                    let _ = entered.send(f.0);
                    go.acquire().await.expect("gate").forget();
                    format!("fence {}", f.0)
                }
            }),
        )
        .route_layer(layer)
}

/// A finished response waits for its lease's release before it goes out (so the client's next
/// request finds the key free), but not for a server that stopped answering: the proxy stalls
/// as the handler returns, and the response still comes within about a second, not after the
/// release's response timeout and its resend (2 s each). The release lands once the stall ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_does_not_hold_a_finished_response() {
    let server = support::Server::start(support::Flavor::Redis);
    let proxy = support::proxy::Proxy::start(server.port).await;
    let locker = lock_core::Locker::redis(&proxy.url())
        .await
        .expect("connect through the proxy");
    let (tx, mut entered) = mpsc::unbounded_channel();
    let go = Arc::new(Semaphore::new(0));
    let layer = LockLayer::new(locker.clone(), KeyExtractor::route_param("id"))
        .ttl(Duration::from_secs(30));
    let addr = serve(gated(layer, tx, go.clone())).await;
    let first = tokio::spawn(async move { post_to(addr, "/accounts/7/withdraw").await });
    entered.recv().await.expect("entered");
    proxy.stall(true);
    let finished = Instant::now();
    go.add_permits(1);
    let first = first.await.expect("join");
    let waited = finished.elapsed();
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    assert!(
        waited < Duration::from_millis(1_800),
        "the response waited {waited:?} for a release the server did not answer"
    );
    proxy.stall(false);
    let k = locker.lock_key("7").expect("key");
    let released = eventually(Duration::from_secs(10), async || {
        server.cmd::<i64>(&["EXISTS", k.lock_key()]) == 0
    })
    .await;
    assert!(released, "the release never landed");
}

async fn held_key_gets_409_with_retry_after(h: Harness) {
    let locker = h.locker().await;
    let (tx, mut entered) = mpsc::unbounded_channel();
    let go = Arc::new(Semaphore::new(0));
    let layer =
        LockLayer::new(locker, KeyExtractor::route_param("id")).ttl(Duration::from_secs(20));
    let addr = serve(gated(layer, tx, go.clone())).await;

    let first = tokio::spawn(async move { post_to(addr, "/accounts/7/withdraw").await });
    entered.recv().await.expect("first entered");
    let second = post_to(addr, "/accounts/7/withdraw").await;
    assert_eq!(second.status, StatusCode::CONFLICT);
    assert_eq!(
        second.header("content-type"),
        Some("application/problem+json")
    );
    let after: u64 = second
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .expect("secs");
    // The holder's time left, rounded up: a 20 s lease taken a moment ago, not a fixed second.
    assert!((19..=20).contains(&after), "Retry-After {after}");
    let problem: serde_json::Value = serde_json::from_slice(&second.body).expect("json");
    assert_eq!(problem["status"], 409);
    // Another key is not affected.
    let other = tokio::spawn(async move { post_to(addr, "/accounts/8/withdraw").await });
    entered.recv().await.expect("other key entered");
    go.add_permits(2);
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    let other = other.await.expect("join");
    assert_eq!(other.status, StatusCode::OK);
}

/// `/accounts/%37/...` is the account axum routes as `7`: a path segment or route parameter is
/// the key once percent-decoded, so the encoded spelling cannot slip past the lock. A segment
/// that does not decode to UTF-8 is a 400.
async fn percent_encoded_paths_name_the_same_key(h: Harness) {
    for extractor in [
        KeyExtractor::path_segment(1),
        KeyExtractor::route_param("id"),
    ] {
        let locker = h.locker().await;
        let (tx, mut entered) = mpsc::unbounded_channel();
        let go = Arc::new(Semaphore::new(0));
        let layer = LockLayer::new(locker, extractor).ttl(Duration::from_secs(20));
        let addr = serve(gated(layer, tx, go.clone())).await;
        let first = tokio::spawn(async move { post_to(addr, "/accounts/7/withdraw").await });
        entered.recv().await.expect("first entered");
        let second = tokio::time::timeout(
            Duration::from_secs(10),
            post_to(addr, "/accounts/%37/withdraw"),
        )
        .await
        .expect("the encoded path got into the handler beside the plain one");
        assert_eq!(second.status, StatusCode::CONFLICT, "{}", second.text());
        go.add_permits(1);
        let first = first.await.expect("join");
        assert_eq!(first.status, StatusCode::OK, "{}", first.text());
        let bad = post_to(addr, "/accounts/%FF/withdraw").await;
        assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.text());
    }
}

async fn sequential_requests_see_increasing_fences(h: Harness) {
    let locker = h.locker().await;
    let app = Router::new()
        .route(
            "/accounts/{id}/withdraw",
            post(|Fence(f): Fence, HeldLease(info): HeldLease| async move {
                assert_eq!(info.fence(), f);
                assert!(info.remaining() > Duration::ZERO);
                format!("{}|{}", f.0, info.key())
            }),
        )
        .route_layer(
            LockLayer::new(locker, KeyExtractor::route_param("id")).key_prefix("withdraw:"),
        );
    let addr = serve(app).await;
    let mut last = 0u64;
    // Back to back: a request sent right after the previous response must never find the
    // previous lease still there (the layer releases before the last byte goes out).
    for _ in 0..20 {
        let r = post_to(addr, "/accounts/42/withdraw").await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        let text = r.text();
        let (fence, key) = text.split_once('|').expect("fence|key");
        assert_eq!(key, "withdraw:42");
        let fence: u64 = fence.parse().expect("fence");
        assert!(fence > last, "fence {fence} after {last}");
        last = fence;
    }
}

async fn concurrent_requests_run_one_at_a_time(h: Harness) {
    let locker = h.locker().await;
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let ran = Arc::new(AtomicUsize::new(0));
    let (i, m, r) = (inside.clone(), most.clone(), ran.clone());
    let app = Router::new()
        .route(
            "/accounts/{id}/withdraw",
            post(move || {
                let (i, m, r) = (i.clone(), m.clone(), r.clone());
                async move {
                    let now = i.fetch_add(1, Ordering::SeqCst) + 1;
                    m.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    i.fetch_sub(1, Ordering::SeqCst);
                    r.fetch_add(1, Ordering::SeqCst);
                    "ok"
                }
            }),
        )
        .route_layer(
            LockLayer::new(locker, KeyExtractor::path_segment(1)).wait(Duration::from_secs(30)),
        );
    let addr = serve(app).await;
    let calls: Vec<_> = (0..20)
        .map(|_| tokio::spawn(async move { post_to(addr, "/accounts/1/withdraw").await }))
        .collect();
    for c in calls {
        let r = c.await.expect("join");
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    }
    assert_eq!(ran.load(Ordering::SeqCst), 20);
    assert_eq!(most.load(Ordering::SeqCst), 1, "two handlers ran at once");
}

async fn missing_key_is_400_or_passes_through(h: Harness) {
    let locker = h.locker().await;
    let handler = |f: Option<Fence>| async move { format!("{:?}", f.map(|f| f.0.0)) };
    let app = Router::new()
        .route("/strict", post(handler))
        .route_layer(LockLayer::new(
            locker.clone(),
            KeyExtractor::header(http::HeaderName::from_static("x-account")),
        ));
    let lenient = Router::new()
        .route("/lenient", post(handler).get(handler))
        .route_layer(
            LockLayer::new(
                locker.clone(),
                KeyExtractor::header(http::HeaderName::from_static("x-account")),
            )
            .pass_through_without_key()
            .methods([Method::POST]),
        );
    let unguarded = Router::new().route(
        "/bare",
        post(|Fence(f): Fence| async move { f.0.to_string() }),
    );
    let addr = serve(app.merge(lenient).merge(unguarded)).await;

    let r = post_to(addr, "/strict").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.text().contains("x-account"), "{}", r.text());
    let r = send(
        addr,
        Method::POST,
        "/strict",
        &[("x-account", "a{b")],
        Bytes::new(),
    )
    .await;
    assert_eq!(
        r.status,
        StatusCode::BAD_REQUEST,
        "invalid key: {}",
        r.text()
    );
    let r = send(
        addr,
        Method::POST,
        "/strict",
        &[("x-account", "a1")],
        Bytes::new(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.text().starts_with("Some("), "{}", r.text());

    let r = post_to(addr, "/lenient").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.text(), "None");
    // GET is outside the methods filter: unlocked even with a key.
    let r = send(
        addr,
        Method::GET,
        "/lenient",
        &[("x-account", "a1")],
        Bytes::new(),
    )
    .await;
    assert_eq!(r.text(), "None");
    let r = send(
        addr,
        Method::POST,
        "/lenient",
        &[("x-account", "a1")],
        Bytes::new(),
    )
    .await;
    assert!(r.text().starts_with("Some("), "{}", r.text());

    // The extractor on a route without the layer: a clear 500.
    let r = post_to(addr, "/bare").await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(r.text().contains("no LockLayer"), "{}", r.text());
}

async fn lease_loss_cancels_the_handler(h: Harness) {
    let locker = h.locker().await;
    let finished = Arc::new(AtomicBool::new(false));
    let dropped = Arc::new(AtomicBool::new(false));
    let (tx, mut entered) = mpsc::unbounded_channel();
    let (f2, d2) = (finished.clone(), dropped.clone());
    struct OnDrop(Arc<AtomicBool>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let app = Router::new()
        .route(
            "/jobs/{id}",
            post(move || {
                let (f2, d2, tx) = (f2.clone(), d2.clone(), tx.clone());
                async move {
                    let _guard = OnDrop(d2);
                    let _ = tx.send(());
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    f2.store(true, Ordering::SeqCst);
                    "done"
                }
            }),
        )
        // Renewal every ~330 ms finds the lease gone soon after the delete.
        .route_layer(
            LockLayer::new(locker.clone(), KeyExtractor::route_param("id"))
                .ttl(Duration::from_secs(1)),
        );
    let addr = serve(app).await;
    let started = tokio::time::Instant::now();
    let call = tokio::spawn(async move { post_to(addr, "/jobs/9").await });
    entered.recv().await.expect("entered");
    h.delete(&locker, "9");
    let r = call.await.expect("join");
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    assert!(r.text().contains("lease-lost"), "{}", r.text());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    assert!(dropped.load(Ordering::SeqCst), "handler future not dropped");
    assert!(
        !finished.load(Ordering::SeqCst),
        "handler ran to completion"
    );
}

/// Writes a request on a raw connection and returns the connection, for tests that hang up.
async fn raw_post(addr: std::net::SocketAddr, path: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!("POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    s
}

async fn client_disconnect_during_handler_releases(h: Harness) {
    let locker = h.locker().await;
    let (tx, mut entered) = mpsc::unbounded_channel();
    let go = Arc::new(Semaphore::new(0));
    // A long TTL: only the release on disconnect can free the key in time.
    let layer =
        LockLayer::new(locker, KeyExtractor::route_param("id")).ttl(Duration::from_secs(60));
    let addr = serve(gated(layer, tx, go.clone())).await;
    let conn = raw_post(addr, "/accounts/5/withdraw").await;
    entered.recv().await.expect("entered");
    assert_eq!(
        post_to(addr, "/accounts/5/withdraw").await.status,
        StatusCode::CONFLICT
    );
    drop(conn);
    // The gate opens only for a request that got into the handler, so the first handler, if
    // it were still running, could never finish and free the key itself.
    let freed = eventually(Duration::from_secs(10), async || {
        let mut call = tokio::spawn(async move { post_to(addr, "/accounts/5/withdraw").await });
        tokio::select! {
            _ = entered.recv() => {
                go.add_permits(1);
                call.await.expect("join").status == StatusCode::OK
            }
            answered = &mut call => {
                assert_eq!(answered.expect("join").status, StatusCode::CONFLICT);
                false
            }
        }
    })
    .await;
    assert!(freed, "the key stayed held after the client hung up");
}

async fn client_disconnect_during_body_releases(h: Harness) {
    let locker = h.locker().await;
    let app = Router::new()
        .route(
            "/feeds/{id}",
            post(|| async {
                Response::new(Body::new(Drip::new(Duration::from_millis(100), 10_000)))
            }),
        )
        .route("/quick/{id}", post(|| async { "quick" }))
        .route_layer(
            LockLayer::new(locker, KeyExtractor::route_param("id")).ttl(Duration::from_secs(60)),
        );
    let addr = serve(app).await;
    let mut conn = raw_post(addr, "/feeds/3").await;
    let mut buf = [0u8; 256];
    let n = conn.read(&mut buf).await.expect("read head");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // Still streaming: the key is held.
    assert_eq!(post_to(addr, "/quick/3").await.status, StatusCode::CONFLICT);
    drop(conn);
    let freed = eventually(Duration::from_secs(10), async || {
        post_to(addr, "/quick/3").await.status == StatusCode::OK
    })
    .await;
    assert!(
        freed,
        "the key stayed held after the client hung up mid-body"
    );
}

/// A client that hangs up while its request waits for the key takes nothing with it: its
/// handler never runs, and when the holder finishes, the next request gets the key at once
/// rather than after the TTL of a grant made for nobody (or a turn handed to a waiter gone).
async fn client_disconnect_while_waiting_takes_nothing(h: Harness) {
    let locker = h.locker().await;
    let (tx, mut entered) = mpsc::unbounded_channel();
    let go = Arc::new(Semaphore::new(0));
    // A long TTL and a long wait: only a waiter that leaves cleanly lets the third in quickly.
    let layer = LockLayer::new(locker, KeyExtractor::route_param("id"))
        .ttl(Duration::from_secs(60))
        .wait(Duration::from_secs(30));
    let addr = serve(gated(layer, tx, go.clone())).await;
    let first = tokio::spawn(async move { post_to(addr, "/accounts/8/withdraw").await });
    let f1 = entered.recv().await.expect("first entered");
    let waiter = raw_post(addr, "/accounts/8/withdraw").await;
    // Long enough for the waiter's request to be read and its wait to begin.
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(waiter);
    tokio::time::sleep(Duration::from_millis(300)).await;
    go.add_permits(1);
    assert_eq!(first.await.expect("join").status, StatusCode::OK);
    let third = tokio::spawn(async move { post_to(addr, "/accounts/8/withdraw").await });
    let f3 = tokio::time::timeout(Duration::from_secs(5), entered.recv())
        .await
        .expect("the key stayed held after the waiting client hung up")
        .expect("third entered");
    assert!(f3 > f1, "fence {f3} after {f1}");
    go.add_permits(1);
    assert_eq!(third.await.expect("join").status, StatusCode::OK);
    assert!(
        entered.try_recv().is_err(),
        "the handler of the client that hung up ran"
    );
}

/// A handler, or a response body, that outlasts the TTL four times over keeps the key: the
/// lease is renewed throughout. It is released when the handler answers, or when the body
/// ends, before the client sees the end: a request sent right after gets the key.
async fn renewed_through_a_long_handler_and_body(h: Harness) {
    let locker = h.locker().await;
    let ttl = Duration::from_millis(500);
    let app = Router::new()
        .route(
            "/slow/{id}",
            post(move || async move {
                tokio::time::sleep(ttl * 4).await;
                "slow"
            }),
        )
        .route(
            "/feed/{id}",
            post(move || async move { Response::new(Body::new(Drip::new(ttl / 3, 12))) }),
        )
        .route("/quick/{id}", post(|| async { "quick" }))
        .route_layer(LockLayer::new(locker, KeyExtractor::route_param("id")).ttl(ttl));
    let addr = serve(app).await;
    for (path, want) in [("/slow/1", "slow"), ("/feed/1", &"chunk\n".repeat(12))] {
        let want = want.to_owned();
        let long = tokio::spawn(async move { post_to(addr, path).await });
        tokio::time::sleep(ttl * 3).await;
        let during = post_to(addr, "/quick/1").await;
        assert_eq!(
            during.status,
            StatusCode::CONFLICT,
            "{path}: the key was free three TTLs in"
        );
        // The holder's time left, rounded up: the layer's short TTL, not the 30 s default.
        assert_eq!(during.header("retry-after"), Some("1"), "{path}");
        let long = long.await.expect("join");
        assert_eq!(long.status, StatusCode::OK, "{path}: {}", long.text());
        assert_eq!(long.text(), want);
        let after = post_to(addr, "/quick/1").await;
        assert_eq!(
            after.status,
            StatusCode::OK,
            "{path}: not released at the end"
        );
    }
}

async fn waiting_gets_the_key_after_the_holder(h: Harness) {
    let locker = h.locker().await;
    let (tx, mut entered) = mpsc::unbounded_channel();
    let go = Arc::new(Semaphore::new(0));
    let waiting = LockLayer::new(locker.clone(), KeyExtractor::route_param("id"))
        .wait(Duration::from_secs(20));
    let addr = serve(gated(waiting, tx, go.clone())).await;
    let first = tokio::spawn(async move { post_to(addr, "/accounts/1/withdraw").await });
    let f1 = entered.recv().await.expect("first");
    let second = tokio::spawn(async move { post_to(addr, "/accounts/1/withdraw").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        entered.try_recv().is_err(),
        "second ran while the first held the key"
    );
    go.add_permits(1);
    let f2 = entered
        .recv()
        .await
        .expect("second entered after the first");
    assert!(f2 > f1);
    go.add_permits(1);
    assert_eq!(first.await.expect("join").status, StatusCode::OK);
    assert_eq!(second.await.expect("join").status, StatusCode::OK);

    // A short deadline, answered with the configured status.
    let (tx, mut entered) = mpsc::unbounded_channel();
    let go = Arc::new(Semaphore::new(0));
    let short = LockLayer::new(locker, KeyExtractor::route_param("id"))
        .wait(Duration::from_millis(300))
        .reject_status(Reason::WaitTimeout, StatusCode::SERVICE_UNAVAILABLE);
    let addr = serve(gated(short, tx, go.clone())).await;
    let first = tokio::spawn(async move { post_to(addr, "/accounts/2/withdraw").await });
    entered.recv().await.expect("first");
    let r = post_to(addr, "/accounts/2/withdraw").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    assert!(r.header("retry-after").is_some());
    go.add_permits(1);
    assert_eq!(first.await.expect("join").status, StatusCode::OK);

    // Unconfigured, a wait that runs out is answered 409 with `Retry-After`.
    let (tx, mut entered) = mpsc::unbounded_channel();
    let go = Arc::new(Semaphore::new(0));
    let plain = LockLayer::new(h.locker().await, KeyExtractor::route_param("id"))
        .wait(Duration::from_millis(300));
    let addr = serve(gated(plain, tx, go.clone())).await;
    let first = tokio::spawn(async move { post_to(addr, "/accounts/3/withdraw").await });
    entered.recv().await.expect("first");
    let r = post_to(addr, "/accounts/3/withdraw").await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.text());
    assert!(r.header("retry-after").is_some());
    go.add_permits(1);
    assert_eq!(first.await.expect("join").status, StatusCode::OK);
}

async fn json_body_key_is_handed_on_untouched(h: Harness) {
    let locker = h.locker().await;
    let app = Router::new()
        .route(
            "/transfers",
            post(|Fence(_): Fence, body: Bytes| async move { body }),
        )
        .route_layer(
            LockLayer::new(locker, KeyExtractor::json_field("/account/id")).body_limit(1024),
        );
    let addr = serve(app).await;
    let body = r#"{"account":{"id":"acc_1"},"amount":  10 }"#;
    let r = send(addr, Method::POST, "/transfers", &[], body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.body, body.as_bytes());
    let r = send(addr, Method::POST, "/transfers", &[], r#"{"amount":1}"#).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = send(addr, Method::POST, "/transfers", &[], "not json").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let big = format!(r#"{{"account":{{"id":"a"}},"pad":"{}"}}"#, "x".repeat(2000));
    let r = send(addr, Method::POST, "/transfers", &[], big).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", r.text());

    // Unconfigured, the cap is DEFAULT_KEY_BODY_LIMIT (64 KiB): a body of exactly that size
    // is read, one byte more is refused.
    let app = Router::new()
        .route(
            "/transfers",
            post(|Fence(_): Fence, body: Bytes| async move { body.len().to_string() }),
        )
        .route_layer(LockLayer::new(
            h.locker().await,
            KeyExtractor::json_field("/account/id"),
        ));
    let addr = serve(app).await;
    let sized = |len: usize| {
        let frame = r#"{"account":{"id":"b"},"pad":""}"#;
        let pad = "x".repeat(len - frame.len());
        format!(r#"{{"account":{{"id":"b"}},"pad":"{pad}"}}"#)
    };
    let at_cap = sized(lock_tower::DEFAULT_KEY_BODY_LIMIT);
    let r = send(addr, Method::POST, "/transfers", &[], at_cap).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.text(), lock_tower::DEFAULT_KEY_BODY_LIMIT.to_string());
    let over = sized(lock_tower::DEFAULT_KEY_BODY_LIMIT + 1);
    let r = send(addr, Method::POST, "/transfers", &[], over).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", r.text());
}

async fn lease_loss_while_streaming_cuts_the_body(h: Harness) {
    let locker = h.locker().await;
    let app = Router::new()
        .route(
            "/feeds/{id}",
            post(|| async {
                Response::new(Body::new(Drip::new(Duration::from_millis(50), 10_000)))
            }),
        )
        .route_layer(
            LockLayer::new(locker.clone(), KeyExtractor::route_param("id"))
                .ttl(Duration::from_secs(1)),
        );
    let addr = serve(app).await;
    let mut tx = common::connect(addr).await;
    let req = http::Request::post("/feeds/4")
        .header("host", "x")
        .body(http_body_util::Full::new(Bytes::new()))
        .expect("request");
    let res = tx.send_request(req).await.expect("response");
    assert_eq!(res.status(), StatusCode::OK);
    let mut body = res.into_body();
    use http_body_util::BodyExt;
    let first = body.frame().await.expect("a frame").expect("no error yet");
    assert!(first.is_data());
    h.delete(&locker, "4");
    let started = tokio::time::Instant::now();
    let outcome = loop {
        match body.frame().await {
            Some(Ok(_)) => {
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "body kept streaming"
                );
            }
            Some(Err(e)) => break Ok(e),
            None => break Err("the body ended cleanly"),
        }
    };
    // The client sees a broken body (hyper reports the cut-off message), never a clean end.
    let err = outcome.expect("the body must end with an error once the lease is lost");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "cut only after {:?}: {err}",
        started.elapsed()
    );
}

/// A streaming body with nothing in it (an export of zero rows), which does not tell it has
/// ended until polled and panics if polled past its end, as `futures::stream::unfold` does.
struct EndsAtOnce {
    ended: bool,
}

impl http_body::Body for EndsAtOnce {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        assert!(!self.ended, "polled after it returned its end");
        self.ended = true;
        std::task::Poll::Ready(None)
    }
}

/// The layer's one early poll finds the body ended: the response goes out whole (200, empty),
/// the lease is released, and the spent body is never polled again.
async fn a_body_that_ends_at_once_is_not_polled_again(h: Harness) {
    let locker = h.locker().await;
    let app = Router::new()
        .route(
            "/exports/{id}",
            post(|| async { Response::new(Body::new(EndsAtOnce { ended: false })) }),
        )
        .route_layer(LockLayer::new(
            locker.clone(),
            KeyExtractor::route_param("id"),
        ));
    let addr = serve(app).await;
    for _ in 0..3 {
        let reply = post_to(addr, "/exports/7").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        assert_eq!(reply.text(), "");
    }
}

/// A streamed body with a declared length: hyper stops polling it once the last declared byte
/// is written and drops it, so its end is never seen as a `None`. The frame that completes the
/// length must release the lease before it goes out, so a client that reads the whole response
/// and sends its next request on the same key never finds its own lease still there. The next
/// request is pipelined behind the first (the strictest client: hyper takes it up the moment
/// the first body is dropped, before a release left to the lease's drop could run), and again
/// sent by a client that waits for the whole response first.
async fn a_streamed_body_with_a_length_is_released_before_its_last_byte(h: Harness) {
    let locker = h.locker().await;
    let chunks = 3;
    let app = Router::new()
        .route(
            "/feeds/{id}",
            post(move || async move {
                let mut res = Response::new(Body::new(Drip::new(Duration::from_millis(1), chunks)));
                let len = "chunk\n".len() * chunks;
                res.headers_mut()
                    .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(len));
                res
            }),
        )
        // Declared empty, though the body is not ready at once: the server sends no body and
        // never polls it.
        .route(
            "/empty/{id}",
            post(|| async {
                let mut res = Response::new(Body::new(Drip::new(Duration::from_millis(1), 1)));
                res.headers_mut()
                    .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(0));
                res
            }),
        )
        .route("/quick/{id}", post(|| async { "quick" }))
        .route_layer(
            LockLayer::new(locker, KeyExtractor::route_param("id")).ttl(Duration::from_secs(60)),
        );
    let addr = serve(app).await;
    let want = "chunk\n".repeat(chunks);
    for round in 0..20 {
        for (first, body) in [("/feeds/6", want.as_str()), ("/empty/6", "")] {
            let mut conn = TcpStream::connect(addr).await.expect("connect");
            let req = format!(
                "POST {first} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n\
                 POST /quick/6 HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            );
            conn.write_all(req.as_bytes()).await.expect("write");
            let mut raw = Vec::new();
            conn.read_to_end(&mut raw).await.expect("read");
            let raw = String::from_utf8_lossy(&raw);
            let answers: Vec<&str> = raw.split("HTTP/1.1 ").filter(|s| !s.is_empty()).collect();
            assert_eq!(answers.len(), 2, "round {round}, {first}: {raw}");
            assert!(answers[0].starts_with("200 "), "round {round}: {raw}");
            assert!(answers[0].ends_with(&format!("\r\n\r\n{body}")), "{raw}");
            assert!(
                answers[1].starts_with("200 "),
                "round {round}, /quick/6 right after {first}: {raw}"
            );
        }
    }
    use http_body_util::BodyExt;
    let mut tx = common::connect(addr).await;
    for round in 0..20 {
        for path in ["/feeds/6", "/quick/6", "/empty/6", "/quick/6"] {
            let req = http::Request::post(path)
                .header("host", "x")
                .body(http_body_util::Full::new(Bytes::new()))
                .expect("request");
            tx.ready().await.expect("connection ready");
            let res = tx.send_request(req).await.expect("response");
            let status = res.status();
            let body = res.into_body().collect().await.expect("body").to_bytes();
            let text = String::from_utf8_lossy(&body);
            assert_eq!(status, StatusCode::OK, "round {round}, {path}: {text}");
        }
    }
}

/// A route parameter that is not UTF-8 once percent-decoded names a key, only not a usable one:
/// an invalid key (400), never a missing one, which `pass_through_without_key` would run
/// unlocked.
async fn a_route_param_that_is_not_utf8_is_invalid_even_when_passing_through(h: Harness) {
    let locker = h.locker().await;
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let app = Router::new()
        .route(
            "/accounts/{id}/withdraw",
            post(move |f: Option<Fence>| {
                r.fetch_add(1, Ordering::SeqCst);
                async move { format!("{:?}", f.map(|f| f.0.0)) }
            }),
        )
        .route_layer(
            LockLayer::new(locker, KeyExtractor::route_param("id")).pass_through_without_key(),
        );
    let addr = serve(app).await;
    let bad = post_to(addr, "/accounts/%FF/withdraw").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.text());
    let problem: serde_json::Value = serde_json::from_slice(&bad.body).expect("json");
    assert_eq!(
        problem["type"], "urn:leasehold:problem:invalid-key",
        "{problem}"
    );
    assert_eq!(problem["title"], "Invalid key", "{problem}");
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the handler ran unlocked");
    let good = post_to(addr, "/accounts/%37/withdraw").await;
    assert_eq!(good.status, StatusCode::OK, "{}", good.text());
    assert!(good.text().starts_with("Some("), "{}", good.text());
}

/// A request body that breaks off while the layer reads it for a JSON key is answered as what
/// it is, not as a request without a key.
async fn an_unreadable_request_body_is_not_a_missing_key(h: Harness) {
    let locker = h.locker().await;
    let app = Router::new()
        .route("/transfers", post(|| async { "unreachable" }))
        .route_layer(LockLayer::new(locker, KeyExtractor::json_field("/id")));
    let addr = serve(app).await;
    let mut conn = TcpStream::connect(addr).await.expect("connect");
    // Ten bytes of a hundred announced, then the client stops sending.
    let req = "POST /transfers HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"id\": \"a";
    conn.write_all(req.as_bytes()).await.expect("write");
    conn.shutdown().await.expect("half-close");
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).await.expect("read");
    let raw = String::from_utf8_lossy(&raw);
    assert!(raw.starts_with("HTTP/1.1 400 "), "{raw}");
    assert!(
        raw.contains("urn:leasehold:problem:body-unreadable"),
        "{raw}"
    );
    assert!(raw.contains("Request body could not be read"), "{raw}");
}

async fn unreachable_backend_is_503(mut h: Harness) {
    let Harness::Server(s) = &mut h else {
        unreachable!("only for servers")
    };
    let locker = Harness::locker_for(s).await;
    let app = Router::new()
        .route("/accounts/{id}/withdraw", post(|| async { "ok" }))
        .route_layer(LockLayer::new(
            locker.clone(),
            KeyExtractor::route_param("id"),
        ));
    let addr = serve(app).await;
    let wait = Duration::from_secs(30);
    let waiting = Router::new()
        .route("/accounts/{id}/withdraw", post(|| async { "ok" }))
        .route_layer(LockLayer::new(locker, KeyExtractor::route_param("id")).wait(wait));
    let waiting = serve(waiting).await;
    assert_eq!(
        post_to(addr, "/accounts/1/withdraw").await.status,
        StatusCode::OK
    );
    s.kill();
    let r = post_to(addr, "/accounts/1/withdraw").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(r.text().contains("unavailable"), "{}", r.text());
    // With a wait the same, at once: the wait is for a busy key, and an outage must not hold
    // every request for it.
    let t = Instant::now();
    let r = post_to(waiting, "/accounts/1/withdraw").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "answered after {:?} of a {wait:?} wait",
        t.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_redis_is_503() {
    common::bounded(unreachable_backend_is_503(Harness::redis())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_valkey_is_503() {
    common::bounded(unreachable_backend_is_503(Harness::valkey())).await
}

/// Statuses and bodies of rejections are the user's to choose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_can_be_customised() {
    let locker = lock_core::Locker::memory();
    let customised =
        |key| {
            LockLayer::new(locker.clone(), key)
                .reject_status(Reason::MissingKey, StatusCode::UNPROCESSABLE_ENTITY)
                .reject_status(Reason::Busy, StatusCode::TOO_MANY_REQUESTS)
                .rejection_response(|r| {
                    let mut res = http::Response::new(http_body_util::Full::new(Bytes::from(
                        format!("{:?} {}", r.reason(), r.retry_after().is_some()),
                    )));
                    *res.status_mut() = r.status();
                    res
                })
        };
    let (tx, mut entered) = mpsc::unbounded_channel();
    let go = Arc::new(Semaphore::new(0));
    let by_header = KeyExtractor::header(http::HeaderName::from_static("x-account"));
    let app = gated(customised(KeyExtractor::route_param("id")), tx, go.clone()).merge(
        Router::new()
            .route("/nokey", post(|| async { "unreachable" }))
            .route_layer(customised(by_header)),
    );
    let addr = serve(app).await;
    let r = post_to(addr, "/nokey").await;
    assert_eq!(
        (r.status, r.text().as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, "MissingKey false")
    );
    let first = tokio::spawn(async move { post_to(addr, "/accounts/1/withdraw").await });
    entered.recv().await.expect("entered");
    let r = post_to(addr, "/accounts/1/withdraw").await;
    assert_eq!(
        (r.status, r.text().as_str()),
        (StatusCode::TOO_MANY_REQUESTS, "Busy true")
    );
    go.add_permits(1);
    assert_eq!(first.await.expect("join").status, StatusCode::OK);
}

/// A responder that leaves the status as `Response::new` made it (200) still answers with the
/// rejection's status: a refusal sent as a success would tell the client its request ran, and
/// a `DedupeLayer` outside would store it as the request's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responder_without_a_status_still_refuses() {
    let locker = lock_core::Locker::memory();
    let layer =
        LockLayer::new(locker.clone(), KeyExtractor::route_param("id")).rejection_response(|r| {
            http::Response::new(http_body_util::Full::new(Bytes::from(
                r.detail().to_owned(),
            )))
        });
    let (tx, _entered) = mpsc::unbounded_channel();
    let addr = serve(gated(layer, tx, Arc::new(Semaphore::new(1)))).await;
    let held = locker
        .try_acquire("7", &lock_core::LockOptions::new())
        .await
        .expect("holder");
    let r = post_to(addr, "/accounts/7/withdraw").await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.text());
    assert!(r.header("retry-after").is_some());
    held.release().await.expect("release");
}

/// A TTL out of lock-core's range is the layer's own misconfiguration: every request gets a
/// 500 naming it, not a 503 that reads like an outage, and the handler never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_out_of_range_is_a_500() {
    for ttl in [Duration::ZERO, Duration::from_secs(365 * 86_400)] {
        let (tx, mut entered) = mpsc::unbounded_channel();
        let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::route_param("id"));
        let addr = serve(gated(layer.ttl(ttl), tx, Arc::new(Semaphore::new(1)))).await;
        let res = post_to(addr, "/accounts/7/withdraw").await;
        assert_eq!(res.status, StatusCode::INTERNAL_SERVER_ERROR, "{ttl:?}");
        assert_eq!(res.header("retry-after"), None);
        let problem: serde_json::Value = serde_json::from_slice(&res.body).expect("json");
        assert!(
            problem["detail"]
                .as_str()
                .is_some_and(|d| d.contains("ttl")),
            "{problem}"
        );
        assert!(entered.try_recv().is_err(), "the handler ran");
    }
}

/// A key prefix no key can follow is the layer's misconfiguration too: a 500 naming the prefix,
/// not a 400 blaming each client for its key; a usable prefix still locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_key_prefix_is_a_500() {
    let long = "p".repeat(lock_core::MAX_KEY_LEN);
    for prefix in ["tenant{a}:", "tenant\n", long.as_str()] {
        let (tx, mut entered) = mpsc::unbounded_channel();
        let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::route_param("id"))
            .key_prefix(prefix);
        let addr = serve(gated(layer, tx, Arc::new(Semaphore::new(1)))).await;
        let res = post_to(addr, "/accounts/7/withdraw").await;
        assert_eq!(res.status, StatusCode::INTERNAL_SERVER_ERROR, "{prefix:?}");
        let problem: serde_json::Value = serde_json::from_slice(&res.body).expect("json");
        assert!(
            problem["detail"]
                .as_str()
                .is_some_and(|d| d.contains("prefix")),
            "{problem}"
        );
        assert!(entered.try_recv().is_err(), "the handler ran");
    }
    let (tx, mut entered) = mpsc::unbounded_channel();
    let fits = "p".repeat(lock_core::MAX_KEY_LEN - 1);
    let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::route_param("id"))
        .key_prefix(fits);
    let addr = serve(gated(layer, tx, Arc::new(Semaphore::new(1)))).await;
    let res = post_to(addr, "/accounts/7/withdraw").await;
    assert_eq!(res.status, StatusCode::OK, "{}", res.text());
    assert!(entered.try_recv().is_ok(), "the handler did not run");
}

/// A key from a closure over the request head: here the `account` query parameter. Requests
/// with the same value take turns, another value runs beside them, and `None` is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_from_a_closure() {
    // A lock that wrongly held the other account would leave a wait below hanging.
    common::bounded(async {
        let account = KeyExtractor::from_fn(|parts| {
            parts
                .uri
                .query()?
                .split('&')
                .find_map(|kv| kv.strip_prefix("account="))
                .map(str::to_owned)
        });
        let (tx, mut entered) = mpsc::unbounded_channel();
        let go = Arc::new(Semaphore::new(0));
        let layer = LockLayer::new(lock_core::Locker::memory(), account);
        let addr = serve(gated(layer, tx, go.clone())).await;
        let first =
            tokio::spawn(async move { post_to(addr, "/accounts/x/withdraw?account=7").await });
        entered.recv().await.expect("first entered");
        let same = post_to(addr, "/accounts/y/withdraw?account=7").await;
        assert_eq!(same.status, StatusCode::CONFLICT, "{}", same.text());
        let other =
            tokio::spawn(async move { post_to(addr, "/accounts/x/withdraw?account=8").await });
        entered
            .recv()
            .await
            .expect("another account runs beside it");
        let none = post_to(addr, "/accounts/x/withdraw").await;
        assert_eq!(none.status, StatusCode::BAD_REQUEST, "{}", none.text());
        go.add_permits(2);
        assert_eq!(first.await.expect("join").status, StatusCode::OK);
        assert_eq!(other.await.expect("join").status, StatusCode::OK);
    })
    .await;
}

/// The fence without axum's extractors, as a non-axum Tower service reads it
/// (`Fence::from_extensions`); and `Option<HeldLease>` on a route without the layer is `None`,
/// not a rejection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_from_extensions_and_optional_lease() {
    let read = |req: axum::extract::Request| async move {
        Fence::from_extensions(req.extensions()).map_or("none".to_owned(), |f| f.0.0.to_string())
    };
    let optional = |lease: Option<HeldLease>| async move {
        lease.map_or("none".to_owned(), |HeldLease(l)| l.key().to_owned())
    };
    let guarded = Router::new()
        .route("/guarded/{id}", post(read))
        .route("/guarded-view/{id}", post(optional))
        .route_layer(LockLayer::new(
            lock_core::Locker::memory(),
            KeyExtractor::route_param("id"),
        ));
    let app = guarded
        .route("/bare", post(read))
        .route("/bare-view", post(optional));
    let addr = serve(app).await;
    let fence: u64 = post_to(addr, "/guarded/1")
        .await
        .text()
        .parse()
        .expect("a fence");
    assert!(fence > 0);
    assert_eq!(post_to(addr, "/guarded-view/1").await.text(), "1");
    assert_eq!(post_to(addr, "/bare").await.text(), "none");
    let bare = post_to(addr, "/bare-view").await;
    assert_eq!(
        (bare.status, bare.text()),
        (StatusCode::OK, "none".to_owned())
    );
}

/// A handler that panics: the connection is dropped (axum has no panic handler of its own),
/// and with it the layer's future, whose lease must be released then, not left to its TTL.
async fn a_panicking_handler_frees_the_lock(h: Harness) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r2 = runs.clone();
    let app = Router::new()
        .route(
            "/accounts/{id}/withdraw",
            post(move |Fence(f): Fence| {
                let runs = r2.clone();
                async move {
                    if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                        panic!("the handler panicked (on purpose, in a test)");
                    }
                    format!("fence {}", f.0)
                }
            }),
        )
        // A long TTL: only a release can free the key within the test.
        .route_layer(
            LockLayer::new(h.locker().await, KeyExtractor::route_param("id"))
                .ttl(Duration::from_secs(60)),
        );
    let addr = serve(app).await;
    let mut tx = common::connect(addr).await;
    let req = http::Request::post("/accounts/7/withdraw")
        .header("host", "x")
        .body(http_body_util::Full::new(Bytes::new()))
        .expect("request");
    // The connection drops; were a panic handler in front, it would answer 500.
    if let Ok(res) = tx.send_request(req).await {
        assert!(res.status().is_server_error(), "a panic answered {res:?}");
    }
    let mut last = None;
    let freed = eventually(Duration::from_secs(10), async || {
        let r = post_to(addr, "/accounts/7/withdraw").await;
        let done = r.status != StatusCode::CONFLICT;
        last = Some(r);
        done
    })
    .await;
    let last = last.expect("a retry");
    assert!(
        freed,
        "the key stayed locked after the panic: {}",
        last.text()
    );
    assert_eq!(last.status, StatusCode::OK, "{}", last.text());
    assert!(last.text().starts_with("fence "), "{}", last.text());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// `HeldLease` on a route without a layer: the documented 500, as for `Fence`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_lease_without_a_layer_is_a_500() {
    let app = Router::new().route(
        "/bare",
        post(|HeldLease(info): HeldLease| async move { info.key().to_owned() }),
    );
    let addr = serve(app).await;
    let r = post_to(addr, "/bare").await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let problem: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(problem["type"], "urn:leasehold:problem:missing-lease");
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("`HeldLease`"), "{problem}");
    assert!(detail.contains("no LockLayer or DedupeLayer"), "{problem}");
    assert!(detail.contains("pass_through_without_key"), "{problem}");
}

/// What the docs say of `Router::layer` with a route parameter: the matched routes get their
/// parameter and are locked, but the layer also wraps the fallback, so an unknown path gets the
/// layer's 500 (no route there has the parameter) instead of axum's 404; with `route_layer` it
/// keeps its 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_layer_also_wraps_the_fallback() {
    let locker = lock_core::Locker::memory();
    let routes = || Router::new().route("/accounts/{id}/withdraw", post(|| async { "ok" }));
    let layer = || LockLayer::new(locker.clone(), KeyExtractor::route_param("id"));
    let wrapped = serve(routes().layer(layer())).await;
    let routed = serve(routes().route_layer(layer())).await;
    let held = locker
        .try_acquire("7", &lock_core::LockOptions::new())
        .await
        .expect("hold");
    for addr in [wrapped, routed] {
        assert_eq!(
            post_to(addr, "/accounts/7/withdraw").await.status,
            StatusCode::CONFLICT
        );
        assert_eq!(
            post_to(addr, "/accounts/8/withdraw").await.status,
            StatusCode::OK
        );
    }
    assert_eq!(
        post_to(wrapped, "/nowhere").await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        post_to(routed, "/nowhere").await.status,
        StatusCode::NOT_FOUND
    );
    held.release().await.expect("release");
}

/// Under `pass_through_without_key`, only a missing key passes unlocked: a key that is there but
/// unusable, from a header (braces, too long) or a JSON field (too long), is still a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_key_is_refused_even_when_passing_through() {
    let ran = Arc::new(AtomicUsize::new(0));
    let handler = |ran: Arc<AtomicUsize>| {
        post(move || {
            ran.fetch_add(1, Ordering::SeqCst);
            async { "ran" }
        })
    };
    let app = Router::new()
        .route(
            "/by-header",
            handler(ran.clone()).route_layer(
                LockLayer::new(
                    lock_core::Locker::memory(),
                    KeyExtractor::header(http::HeaderName::from_static("x-job")),
                )
                .pass_through_without_key(),
            ),
        )
        .route(
            "/by-json",
            handler(ran.clone()).route_layer(
                LockLayer::new(lock_core::Locker::memory(), KeyExtractor::json_field("/id"))
                    .pass_through_without_key(),
            ),
        );
    let addr = serve(app.clone()).await;
    let long = "k".repeat(lock_core::MAX_KEY_LEN + 1);
    for value in ["a{b", long.as_str()] {
        let res = send(addr, Method::POST, "/by-header", &[("x-job", value)], "").await;
        assert_eq!(
            res.status,
            StatusCode::BAD_REQUEST,
            "{value:?}: {}",
            res.text()
        );
    }
    let body = format!(r#"{{"id": "{long}"}}"#);
    // A body the layer cannot read as JSON may still hold the key for a handler's own parser
    // (serde's derive skips an unknown field's lone surrogate, or one nested past 128 levels,
    // which a `Value` refuses): not "no key", or the handler would run unlocked.
    let deep = format!(
        r#"{{"id": 7, "x": {}{}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    for body in [
        body.as_str(),
        r#"{"id": 7, "memo": "\ud800"}"#,
        &deep,
        "not json",
    ] {
        let res = send(addr, Method::POST, "/by-json", &[], body.to_owned()).await;
        assert_eq!(
            res.status,
            StatusCode::BAD_REQUEST,
            "{body:.40}: {}",
            res.text()
        );
    }
    // A header value that is not visible ASCII (obs-text, which HTTP/1 carries) is a key
    // the layer cannot read, not an absent one.
    {
        use tower_service::Service;
        let mut app = app.clone();
        let req = http::Request::post("/by-header")
            .header(
                "x-job",
                http::HeaderValue::from_bytes(b"caf\xe9").expect("obs-text"),
            )
            .body(Body::empty())
            .expect("request");
        let res = app.call(req).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::BAD_REQUEST);
        let problem = axum::body::to_bytes(res.into_body(), 4096)
            .await
            .expect("body");
        assert!(
            String::from_utf8_lossy(&problem).contains("invalid-key"),
            "{problem:?}"
        );
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0, "a handler ran unlocked");
    // Without a key at all, both pass; an empty body holds no key either.
    let res = send(addr, Method::POST, "/by-header", &[], "").await;
    assert_eq!(res.status, StatusCode::OK, "{}", res.text());
    for body in ["{}", "", " \n"] {
        let res = send(addr, Method::POST, "/by-json", &[], body).await;
        assert_eq!(res.status, StatusCode::OK, "{body:?}: {}", res.text());
    }
    assert_eq!(ran.load(Ordering::SeqCst), 4);
    // A JSON body id is held to `MAX_IDEMPOTENCY_KEY_LEN` (255 bytes), well below a key's own
    // 512: at the limit it locks and runs, one byte over it is a 400 and does not.
    let max = lock_tower::MAX_IDEMPOTENCY_KEY_LEN;
    for (len, status, ran_so_far) in [
        (max, StatusCode::OK, 5),
        (max + 1, StatusCode::BAD_REQUEST, 5),
    ] {
        let body = format!(r#"{{"id": "{}"}}"#, "e".repeat(len));
        let res = send(addr, Method::POST, "/by-json", &[], body).await;
        assert_eq!(res.status, status, "{len} bytes: {}", res.text());
        assert_eq!(ran.load(Ordering::SeqCst), ran_so_far, "{len} bytes");
    }
}

/// A key header sent twice is an invalid key for every header extractor (`header`,
/// `idempotency_key`, `webhook_id` by either of its headers, `github_delivery`): 400 and the
/// handler does not run, also under `pass_through_without_key`, where an empty first value
/// must not make it a missing key that runs unlocked. Sent once, the same header locks and the
/// handler runs under the lease, so the 400s are the repetition's.
async fn a_repeated_key_header_is_invalid_even_when_passing_through(h: Harness) {
    let locker = h.locker().await;
    let ran = Arc::new(AtomicUsize::new(0));
    let extractors = common::header_extractors();
    let modes = ["strict", "lenient"];
    let mut app = Router::new();
    for (header, key) in &extractors {
        for mode in modes {
            let layer = LockLayer::new(locker.clone(), key.clone());
            let layer = match mode {
                "lenient" => layer.pass_through_without_key(),
                _ => layer,
            };
            let ran = ran.clone();
            let handler = post(move |f: Option<Fence>| {
                ran.fetch_add(1, Ordering::SeqCst);
                async move { if f.is_some() { "locked" } else { "unlocked" } }
            });
            app = app.route(&format!("/{header}/{mode}"), handler.route_layer(layer));
        }
    }
    let addr = serve(app).await;
    let headers: Vec<&str> = extractors.iter().map(|(h, _)| *h).collect();
    common::assert_repeated_key_headers_refused(addr, &headers, &modes, "").await;
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "a handler ran on a repeated key"
    );
    for (header, _) in &extractors {
        for mode in modes {
            let path = format!("/{header}/{mode}");
            let r = send(addr, Method::POST, &path, &[(*header, "7")], "").await;
            assert_eq!(
                (r.status, r.text().as_str()),
                (StatusCode::OK, "locked"),
                "{path}"
            );
        }
    }
    assert_eq!(ran.load(Ordering::SeqCst), 2 * extractors.len());
}

/// `methods([GET])` covers HEAD too: axum runs the GET handler for a HEAD request, which must
/// not run unlocked beside a GET that holds the key.
async fn head_is_locked_where_get_is(h: Harness) {
    use tower_service::Service;
    let locker = h.locker().await;
    let mut app: Router = Router::new()
        .route("/exports/{id}", get(|| async { "exported" }))
        .route_layer(
            LockLayer::new(locker.clone(), KeyExtractor::route_param("id")).methods([Method::GET]),
        );
    let held = locker
        .try_acquire("7", &lock_core::LockOptions::new())
        .await
        .expect("hold");
    for method in [Method::GET, Method::HEAD] {
        let req = http::Request::builder()
            .method(method.clone())
            .uri("/exports/7")
            .body(Body::empty())
            .expect("request");
        let res = app.call(req).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::CONFLICT, "{method}");
    }
    held.release().await.expect("release");
}

/// A response that sends no body (to a HEAD request, a 2xx to CONNECT, a 204 or 304, or one
/// whose head declares a length of zero) frees its lease before it is returned, not when the server drops the body it never polls: the client's next
/// request on the key must not find its own lease still held.
async fn a_response_without_a_body_frees_the_lease_before_it_goes_out(h: Harness) {
    use tower_service::Service;
    let locker = h.locker().await;
    // A body that is not complete at once: otherwise it would be finished, and the lease
    // released, whatever the status.
    let streaming = |status: StatusCode| {
        move || async move {
            Response::builder()
                .status(status)
                .body(Body::new(common::Lingering(Some(Bytes::from_static(b"x")))))
                .expect("response")
        }
    };
    let mut app: Router = Router::new()
        .route("/feeds/{id}", get(streaming(StatusCode::OK)))
        .route("/empty/{id}", post(streaming(StatusCode::NO_CONTENT)))
        .route("/same/{id}", post(streaming(StatusCode::NOT_MODIFIED)))
        .route(
            "/socket/{id}",
            get(streaming(StatusCode::SWITCHING_PROTOCOLS)),
        )
        .route(
            "/tunnel/{id}",
            axum::routing::on(
                axum::routing::MethodFilter::CONNECT,
                streaming(StatusCode::OK),
            ),
        )
        // A head that declares no body, over a body whose first frame is ready at once: the
        // server sends the head alone and drops the body, frame and all.
        .route(
            "/blank/{id}",
            post(|| async {
                Response::builder()
                    .header(http::header::CONTENT_LENGTH, 0)
                    .body(Body::new(common::Lingering(Some(Bytes::new()))))
                    .expect("response")
            }),
        )
        .route_layer(LockLayer::new(
            locker.clone(),
            KeyExtractor::route_param("id"),
        ));
    // 101: the upgraded connection is not under the lock (README).
    for (method, uri, key) in [
        (Method::POST, "/empty/2", "2"),
        (Method::POST, "/same/3", "3"),
        (Method::GET, "/socket/4", "4"),
        // A 2xx to CONNECT: the connection becomes a tunnel, no body is sent.
        (Method::CONNECT, "/tunnel/5", "5"),
        (Method::POST, "/blank/6", "6"),
    ] {
        let req = http::Request::builder()
            .method(method.clone())
            .uri(uri)
            .body(Body::empty())
            .expect("request");
        let res = app.call(req).await.expect("infallible");
        // The response (and its body) is still here, unsent.
        let free = locker
            .try_acquire(key, &lock_core::LockOptions::new())
            .await;
        assert!(free.is_ok(), "{method} {uri}: the lease is still held");
        drop(res);
    }
    // HEAD through the layer alone: axum's router swaps a HEAD response's body for an empty
    // one before it returns, which would drop the layer's body (and free the lease) whatever
    // the layer did.
    use axum::handler::HandlerWithoutStateExt;
    use tower_layer::Layer;
    let mut svc = LockLayer::new(locker.clone(), KeyExtractor::path_segment(1))
        .layer(streaming(StatusCode::OK).into_service());
    let req = http::Request::head("/feeds/1")
        .body(Body::empty())
        .expect("request");
    let res = svc.call(req).await.expect("infallible");
    let free = locker
        .try_acquire("1", &lock_core::LockOptions::new())
        .await;
    assert!(free.is_ok(), "HEAD: the lease is still held");
    drop(res);
}

/// `POST /exports/9` through a `LockLayer` on `locker` keyed by the route's `id`, the handler
/// answering `make()`: the response body, its first frame (data) read.
async fn export_past_its_first_frame<B>(locker: &lock_core::Locker, make: fn() -> B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    use http_body_util::BodyExt;
    use tower_service::Service;
    let mut app: Router = Router::new()
        .route(
            "/exports/{id}",
            post(move || async move { Body::new(make()) }),
        )
        .route_layer(LockLayer::new(
            locker.clone(),
            KeyExtractor::route_param("id"),
        ));
    let req = http::Request::post("/exports/9")
        .body(Body::empty())
        .expect("request");
    let mut body = app.call(req).await.expect("infallible").into_body();
    let data = body.frame().await.expect("a frame").expect("no error");
    assert!(data.is_data());
    body
}

/// A body that fails midway ends there: the lease is released before the error is handed on,
/// as before a last frame, so a client that sees the response cut off and sends its request
/// again does not meet its own lease (it was released in the background after the error went
/// out). On a current-thread runtime, where a background release cannot run before the test
/// asks.
#[tokio::test]
async fn a_body_that_fails_frees_the_lease_before_the_error_goes_out() {
    use http_body_util::BodyExt;
    let locker = lock_core::Locker::memory();
    let mut body = export_past_its_first_frame(&locker, || common::ThenError(0)).await;
    let failed = body.frame().await.expect("a frame");
    assert!(failed.is_err(), "the body's error was not handed on");
    let free = locker
        .try_acquire("9", &lock_core::LockOptions::new())
        .await;
    assert!(free.is_ok(), "still held once the error went out: {free:?}");
    drop(body);
}

/// A body that ends with trailers (and does not say it ended after them, as a stream body
/// does not): the lease is released before the trailers are handed on, since the server sends
/// them and drops the body without polling it again.
async fn a_body_ending_in_trailers_frees_the_lease_before_they_go_out(h: Harness) {
    use http_body_util::BodyExt;
    let locker = h.locker().await;
    let mut body = export_past_its_first_frame(&locker, || common::ThenTrailers(0)).await;
    let held = locker
        .try_acquire("9", &lock_core::LockOptions::new())
        .await;
    assert!(
        matches!(held, Err(lock_core::Error::Busy { .. })),
        "released before the body ended: {held:?}"
    );
    let trailers = body.frame().await.expect("a frame").expect("no error");
    assert!(trailers.is_trailers());
    // The body is kept, as a server that sent the trailers keeps it until it drops it.
    let free = locker
        .try_acquire("9", &lock_core::LockOptions::new())
        .await;
    assert!(free.is_ok(), "the lease is still held after the trailers");
    drop(body);
}

/// `path_segment` counts segments as axum's router does, empty ones included: a request with
/// an empty `{org}` still locks the account the handler acts on, not the segment after it.
#[tokio::test]
async fn path_segments_count_as_the_router_counts_them() {
    use tower_service::Service;
    let locker = lock_core::Locker::memory();
    let mut app: Router = Router::new()
        .route(
            "/v1/orgs/{org}/accounts/{id}/withdraw",
            post(|| async { "withdrawn" }),
        )
        .layer(LockLayer::new(
            locker.clone(),
            KeyExtractor::path_segment(4),
        ));
    let held = locker
        .try_acquire("7", &lock_core::LockOptions::new())
        .await
        .expect("hold");
    for uri in [
        "/v1/orgs/acme/accounts/7/withdraw",
        "/v1/orgs//accounts/7/withdraw",
    ] {
        let req = http::Request::post(uri)
            .body(Body::empty())
            .expect("request");
        let res = app.call(req).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::CONFLICT, "{uri}");
    }
    held.release().await.expect("release");
    // An empty segment at the key's place is no key.
    let req = http::Request::post("/v1/orgs/acme/accounts//withdraw")
        .body(Body::empty())
        .expect("request");
    let res = app.call(req).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
}

/// A body of declared length frees the lease with its last byte over HTTP/1, whose server
/// drops it there; over HTTP/2 the server polls it to its end (trailers, work after the last
/// byte), and the lease is held until then.
#[tokio::test]
async fn the_declared_length_ends_the_lease_over_http1_only() {
    use http_body_util::BodyExt;
    use tower_service::Service;
    let locker = lock_core::Locker::memory();
    let mut app: Router = Router::new()
        .route(
            "/feeds/{id}",
            post(|| async {
                Response::builder()
                    .header("content-length", "1")
                    .body(Body::new(common::Lingering(Some(Bytes::from_static(b"x")))))
                    .expect("response")
            }),
        )
        .route_layer(LockLayer::new(
            locker.clone(),
            KeyExtractor::route_param("id"),
        ));
    for (version, key, freed) in [
        (http::Version::HTTP_11, "1", true),
        (http::Version::HTTP_2, "2", false),
    ] {
        let req = http::Request::post(format!("/feeds/{key}"))
            .version(version)
            .body(Body::empty())
            .expect("request");
        let mut body = app.call(req).await.expect("infallible").into_body();
        let frame = body.frame().await.expect("a frame").expect("data");
        assert_eq!(frame.into_data().ok().as_deref(), Some(&b"x"[..]));
        let free = locker
            .try_acquire(key, &lock_core::LockOptions::new())
            .await
            .is_ok();
        assert_eq!(free, freed, "{version:?}");
    }
}

/// HTTP/2, where requests are streams of one connection: a second stream for a held key gets
/// its 409 while the first waits in its handler; a stream the client resets (its response
/// future dropped: `RST_STREAM`, the connection stays open) frees the key, and the next
/// request on the same connection gets it. On HTTP/1.1 only a closed connection tells the
/// server the client went away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_lock_and_a_reset_stream_releases() {
    common::bounded(async {
        let (tx, mut entered) = mpsc::unbounded_channel();
        let go = Arc::new(Semaphore::new(0));
        let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::route_param("id"))
            .ttl(Duration::from_secs(60));
        let addr = serve(gated(layer, tx, go.clone())).await;
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut h2, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .expect("HTTP/2 handshake");
        let connection = tokio::spawn(conn);
        let request = || {
            http::Request::post(format!("http://{addr}/accounts/5/withdraw"))
                .body(http_body_util::Full::new(Bytes::new()))
                .expect("request")
        };
        let first = h2.send_request(request());
        let first = tokio::spawn(first);
        entered
            .recv()
            .await
            .expect("the first stream entered its handler");
        let second = h2.send_request(request()).await.expect("second stream");
        assert_eq!(second.status(), StatusCode::CONFLICT);
        assert_eq!(second.version(), http::Version::HTTP_2);
        // Dropping the response future resets the stream; the connection stays up.
        first.abort();
        // No permit is given until a new request is in the handler: the first stream, were it
        // still running, would stay in the gate holding the key, and every try would get 409.
        let freed = eventually(Duration::from_secs(10), async || {
            let mut call = tokio::spawn(h2.send_request(request()));
            tokio::select! {
                answered = &mut call => {
                    let status = answered.expect("join").expect("response").status();
                    assert_eq!(status, StatusCode::CONFLICT);
                    false
                }
                _ = entered.recv() => {
                    go.add_permits(1);
                    // Were the first stream still in the gate (the key freed some other way),
                    // the permit would go to it, first in line, and this one would wait on.
                    let done = tokio::time::timeout(Duration::from_secs(5), call)
                        .await
                        .expect("the permit went to a first stream that was never cancelled")
                        .expect("join")
                        .expect("response");
                    assert_eq!(done.status(), StatusCode::OK);
                    true
                }
            }
        })
        .await;
        assert!(freed, "the key stayed held after its stream was reset");
        assert!(
            !connection.is_finished(),
            "the connection closed: the release came from that, not from the reset"
        );
    })
    .await
}

/// Setups that would lock nothing, or refuse with a success, are the layer's fault: 500
/// (`Reason::Misconfigured`) and the handler does not run, never a request let through unlocked
/// or a refusal the client reads as done. A JSON-body key with a body limit of 0 can read no
/// key, so every request would be refused as too large or keyless, blaming the client. A route parameter the route lacks passes through
/// where the user chose that (one layer over routes with and without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setups_that_lock_nothing_are_a_500() {
    let locker = lock_core::Locker::memory();
    let ran = Arc::new(AtomicUsize::new(0));
    let handler = |ran: Arc<AtomicUsize>| {
        post(move |fence: Option<Fence>| {
            ran.fetch_add(1, Ordering::SeqCst);
            async move { format!("{:?}", fence.map(|f| f.0)) }
        })
    };
    let by_id = || KeyExtractor::route_param("id");
    let app = Router::new()
        .route(
            "/no-methods/{id}",
            handler(ran.clone())
                .route_layer(LockLayer::new(locker.clone(), by_id()).methods(Vec::new())),
        )
        .route(
            "/busy-is-ok/{id}",
            handler(ran.clone()).route_layer(
                LockLayer::new(locker.clone(), by_id()).reject_status(Reason::Busy, StatusCode::OK),
            ),
        )
        .route(
            "/typo/{id}",
            handler(ran.clone()).route_layer(LockLayer::new(
                locker.clone(),
                KeyExtractor::route_param("account"),
            )),
        )
        .route(
            "/no-room/{id}",
            handler(ran.clone()).route_layer(
                LockLayer::new(locker.clone(), KeyExtractor::json_field("/id")).body_limit(0),
            ),
        )
        .route(
            "/typo-passes/{id}",
            handler(ran.clone()).route_layer(
                LockLayer::new(locker.clone(), KeyExtractor::route_param("account"))
                    .pass_through_without_key(),
            ),
        );
    let addr = serve(app).await;
    let held = locker
        .try_acquire("7", &lock_core::LockOptions::new())
        .await
        .expect("hold");
    for path in ["/no-methods/7", "/busy-is-ok/7", "/typo/7", "/no-room/7"] {
        let r = post_to(addr, path).await;
        assert_eq!(
            r.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{path}: {}",
            r.text()
        );
        let problem: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(
            problem["type"], "urn:leasehold:problem:misconfigured",
            "{path}"
        );
        assert_eq!(r.header("retry-after"), None, "{path}");
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0, "a handler ran");
    // Only the reason whose status was set wrong is affected: a free key still runs locked.
    let r = post_to(addr, "/busy-is-ok/8").await;
    assert_eq!(
        (r.status, r.text().starts_with("Some(")),
        (StatusCode::OK, true),
        "{}",
        r.text()
    );
    let r = post_to(addr, "/typo-passes/7").await;
    assert_eq!((r.status, r.text()), (StatusCode::OK, "None".to_owned()));
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    held.release().await.expect("release");
}

/// Keys no grant can be made for, set up from outside: a stored fence of 2^64 - 1 (no higher
/// one exists), and a lock key holding another program's value (a hash). Each is 503 without
/// `Retry-After`, since a retry meets the same state; the handler does not run, and the hash is
/// left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_no_grant_can_be_made_for_are_503_without_retry_after() {
    common::bounded(async {
        let server = support::Server::start(support::Flavor::Redis);
        let locker = lock_core::Locker::redis(&server.url())
            .await
            .expect("connect");
        let exhausted = locker.lock_key("8").expect("key");
        let _: () = server.cmd(&["SET", exhausted.fence_key(), &u64::MAX.to_string()]);
        let foreign = locker.lock_key("9").expect("key");
        let _: i64 = server.cmd(&["HSET", foreign.lock_key(), "theirs", "1"]);
        let (tx, mut entered) = mpsc::unbounded_channel();
        let layer = LockLayer::new(locker, KeyExtractor::route_param("id"));
        // One permit: a handler that ran would finish and answer 200, not hang.
        let addr = serve(gated(layer, tx, Arc::new(Semaphore::new(1)))).await;
        for account in ["8", "9"] {
            let r = post_to(addr, &format!("/accounts/{account}/withdraw")).await;
            assert_eq!(
                r.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{account}: {}",
                r.text()
            );
            assert_eq!(
                r.header("retry-after"),
                None,
                "{account}: retrying cannot help"
            );
            assert!(entered.try_recv().is_err(), "{account}: the handler ran");
        }
        let theirs: String = server.cmd(&["HGET", foreign.lock_key(), "theirs"]);
        assert_eq!(theirs, "1");
    })
    .await
}
