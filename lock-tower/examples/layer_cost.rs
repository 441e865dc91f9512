//! A probe for the cost `LockLayer` adds to a request, without HTTP or sockets: requests go
//! straight into an axum `Router` (routing, the layer, the handler, the response body), so an
//! instruction counter sees the layer's path in isolation. Run it under callgrind, whose counts
//! repeat exactly where wall-clock and CPU time on a shared machine do not:
//!
//! ```text
//! cargo build --release -p lock-tower --example layer_cost
//! valgrind --tool=callgrind target/release/examples/layer_cost bare 20000
//! valgrind --tool=callgrind target/release/examples/layer_cost layer 20000
//! valgrind --tool=callgrind target/release/examples/layer_cost core 20000
//! ```
//!
//! Modes: `bare` (the route alone), `layer` (the same route behind `LockLayer` on the memory
//! backend, keyed by a route parameter, as in `bench_http`), `core` (only `try_acquire` and
//! `release` on the memory backend, the lock-core share of `layer`). Each mode also runs with
//! 0 requests; (count at N - count at 0) / N is the cost of one request, and
//! layer - bare - core is what the layer itself costs.

use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use lock_core::{LockOptions, Locker};
use lock_tower::{KeyExtractor, LockLayer};
use tower_service::Service;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Keys per run, as `bench_http` uses one key per connection.
const KEYS: usize = 32;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "layer".to_owned());
    let n: usize = args.next().map_or(Ok(20_000), |s| s.parse())?;
    let locker = Locker::memory();
    let mut app = Router::new()
        .route("/bare/{id}", post(|| async { "ok" }))
        .merge(
            Router::new()
                .route("/memory/{id}", post(|| async { "ok" }))
                .route_layer(LockLayer::new(
                    locker.clone(),
                    KeyExtractor::route_param("id"),
                )),
        )
        // As `axum::serve` does: without it, every request would build its route (and apply
        // the layer to it) anew, a cost a served app does not pay.
        .with_state(());
    // Paths and keys made up front, so the loop costs the same in every mode.
    let prefix = match mode.as_str() {
        "bare" => "/bare",
        "layer" | "core" => "/memory",
        other => return Err(format!("unknown mode `{other}` (bare, layer, core)").into()),
    };
    let paths: Vec<String> = (0..KEYS).map(|k| format!("{prefix}/{k}")).collect();
    let keys: Vec<String> = (0..KEYS).map(|k| k.to_string()).collect();
    let opts = LockOptions::new();
    let start = Instant::now();
    for i in 0..n {
        if mode == "core" {
            let lease = locker.try_acquire(&keys[i % KEYS], &opts).await?;
            lease.release().await?;
            continue;
        }
        let req = Request::post(paths[i % KEYS].as_str()).body(Body::empty())?;
        let res = app.call(req).await?;
        if res.status() != StatusCode::OK {
            return Err(format!("{}: {}", paths[i % KEYS], res.status()).into());
        }
        res.into_body().collect().await?;
    }
    if n > 0 {
        let per = start.elapsed().as_secs_f64() * 1e9 / n as f64;
        println!("{mode}: {n} requests, {per:.0} ns each (wall clock, this run)");
    }
    Ok(())
}
