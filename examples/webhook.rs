//! An axum service with a locked route and a deduplicated webhook endpoint.
//!
//! ```text
//! cargo run --example webhook --features tower                      # memory backend, 127.0.0.1:3000
//! cargo run --example webhook --features tower -- --addr 127.0.0.1:8080 --redis redis://127.0.0.1:6379/
//! ```
//!
//! - `POST /accounts/{id}/withdraw` (body: an amount) runs one request per account at a time
//!   (`LockLayer`); the handler takes a second, like a slow bank call, so a concurrent request
//!   for the same account gets 409. The answer shows the grant's fence.
//! - `POST /hooks/payments` (JSON `{"account": "7", "amount": 25}`, header `webhook-id`)
//!   credits the account once per delivery id (`DedupeLayer`); redeliveries get the stored
//!   answer with `Idempotent-Replayed: true`, a different body under the same id gets 422.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderName, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use leasehold::Locker;
use leasehold::tower::{DedupeLayer, Fence, KeyExtractor, LockLayer};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Balances in cents, starting at 10000 per account. A real service keeps them in a database
/// and checks the fence there.
#[derive(Clone, Default)]
struct Bank {
    balances: Arc<Mutex<HashMap<String, i64>>>,
}

impl Bank {
    fn apply(&self, account: &str, delta: i64) -> Result<i64, i64> {
        let mut b = self.balances.lock().unwrap_or_else(PoisonError::into_inner);
        let balance = b.entry(account.to_owned()).or_insert(10_000);
        if *balance + delta < 0 {
            return Err(*balance);
        }
        *balance += delta;
        Ok(*balance)
    }
}

/// A JSON answer.
type Answer = (StatusCode, [(HeaderName, &'static str); 1], String);

fn json(status: StatusCode, body: String) -> Answer {
    (status, [(CONTENT_TYPE, "application/json")], body + "\n")
}

async fn withdraw(
    State(bank): State<Bank>,
    Path(account): Path<String>,
    Fence(fence): Fence,
    body: Bytes,
) -> Answer {
    let Some(amount) = std::str::from_utf8(&body)
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .filter(|a| *a > 0)
    else {
        let msg = r#"{"error":"the body must be a positive amount"}"#;
        return json(StatusCode::BAD_REQUEST, msg.into());
    };
    // The slow part of a real withdrawal (a call to the bank), during which the account is locked.
    tokio::time::sleep(Duration::from_secs(1)).await;
    match bank.apply(&account, -amount) {
        Ok(balance) => json(
            StatusCode::OK,
            format!(
                r#"{{"account":"{account}","withdrawn":{amount},"balance":{balance},"fence":{fence}}}"#
            ),
        ),
        Err(balance) => json(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(r#"{{"error":"insufficient funds","balance":{balance}}}"#),
        ),
    }
}

async fn payment_hook(State(bank): State<Bank>, body: Bytes) -> Answer {
    let event: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let (Some(account), Some(amount)) = (event["account"].as_str(), event["amount"].as_i64())
    else {
        let msg = r#"{"error":"need a JSON body with account and amount"}"#;
        return json(StatusCode::BAD_REQUEST, msg.into());
    };
    match bank.apply(account, amount) {
        Ok(balance) => json(
            StatusCode::OK,
            format!(r#"{{"account":"{account}","credited":{amount},"balance":{balance}}}"#),
        ),
        Err(_) => json(
            StatusCode::UNPROCESSABLE_ENTITY,
            r#"{"error":"refused"}"#.into(),
        ),
    }
}

/// The service: a locked withdrawal route and a deduplicated payment webhook on `locker`.
/// (`tests/webhook_example.rs` replays the README's session against it.)
pub fn app(locker: Locker) -> Router {
    let bank = Bank::default();
    Router::new()
        .route("/accounts/{id}/withdraw", post(withdraw))
        .route_layer(
            LockLayer::new(locker.clone(), KeyExtractor::route_param("id"))
                .key_prefix("account:")
                .ttl(Duration::from_secs(10)),
        )
        // On the method router, so only this endpoint is deduplicated.
        .route(
            "/hooks/payments",
            post(payment_hook).layer(
                DedupeLayer::new(locker)
                    .key(KeyExtractor::webhook_id())
                    .scope("payments"),
            ),
        )
        .with_state(bank)
}

struct Args {
    addr: String,
    redis: Option<String>,
}

fn args() -> Result<Args, BoxError> {
    let mut out = Args {
        addr: "127.0.0.1:3000".into(),
        redis: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--addr" => out.addr = it.next().ok_or("--addr needs a value")?,
            "--redis" => out.redis = Some(it.next().ok_or("--redis needs a URL")?),
            "-h" | "--help" => {
                println!("usage: webhook [--addr HOST:PORT] [--redis redis://HOST:PORT/]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument `{other}` (try --help)").into()),
        }
    }
    Ok(out)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = args()?;
    let (locker, backend) = match &args.redis {
        Some(url) => (Locker::redis(url).await?, format!("redis at {url}")),
        None => (Locker::memory(), "memory".to_owned()),
    };
    let app = app(locker);
    let listener = tokio::net::TcpListener::bind(&args.addr).await?;
    println!(
        "listening on http://{} (backend: {backend})",
        listener.local_addr()?
    );
    axum::serve(listener, app).await?;
    Ok(())
}
