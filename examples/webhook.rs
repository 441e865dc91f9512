//! An axum service with a locked route and a deduplicated webhook endpoint.
//!
//! ```text
//! cargo run --example webhook --features tower                      # memory backend, 127.0.0.1:3000
//! cargo run --example webhook --features tower -- --addr 127.0.0.1:8080 --redis redis://127.0.0.1:6379/
//! ```
//!
//! - `POST /accounts/{id}/withdraw` (body: an amount) runs one request per account at a time
//!   (`LockLayer`); the handler takes a second, like a slow bank call, so a concurrent request
//!   for the same account gets 409. The answer shows the grant's fence, which the bank checks
//!   in the same step as the withdrawal (a holder paused past its lease cannot write after
//!   the next one).
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

/// Balances in cents, starting at 10000 per account, each with the highest fence a withdrawal
/// was made under. A real service keeps both in a database row and checks the fence in the
/// same `UPDATE ... WHERE fence <= $fence` that moves the money.
#[derive(Clone, Default)]
struct Bank {
    accounts: Arc<Mutex<HashMap<String, Account>>>,
}

struct Account {
    balance: i64,
    fence: u64,
}

/// Why the bank refused a change.
enum Refused {
    /// The balance would go below zero (or past `i64::MAX`): the balance as it stands.
    Funds(i64),
    /// The withdrawal's lease is older than one the account has already seen: a holder that
    /// was paused past its lease, writing after the next holder did.
    Stale,
}

impl Bank {
    /// Adds `delta` to the balance, in one step with the fence check: `fence` is the
    /// withdrawal's lease (credits, which need no lock, pass `None`).
    fn apply(&self, account: &str, delta: i64, fence: Option<u64>) -> Result<i64, Refused> {
        let mut all = self.accounts.lock().unwrap_or_else(PoisonError::into_inner);
        let a = all.entry(account.to_owned()).or_insert(Account {
            balance: 10_000,
            fence: 0,
        });
        if fence.is_some_and(|f| f < a.fence) {
            return Err(Refused::Stale);
        }
        match a.balance.checked_add(delta).filter(|b| *b >= 0) {
            Some(balance) => {
                a.balance = balance;
                a.fence = a.fence.max(fence.unwrap_or(0));
                Ok(balance)
            }
            None => Err(Refused::Funds(a.balance)),
        }
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
    match bank.apply(&account, -amount, Some(fence.0)) {
        Ok(balance) => json(
            StatusCode::OK,
            format!(
                r#"{{"account":"{account}","withdrawn":{amount},"balance":{balance},"fence":{fence}}}"#
            ),
        ),
        Err(Refused::Funds(balance)) => json(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(r#"{{"error":"insufficient funds","balance":{balance}}}"#),
        ),
        Err(Refused::Stale) => json(
            StatusCode::CONFLICT,
            r#"{"error":"a newer holder of this account's lock has written since"}"#.into(),
        ),
    }
}

async fn payment_hook(State(bank): State<Bank>, body: Bytes) -> Answer {
    let event: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let (Some(account), Some(amount)) = (
        event["account"].as_str(),
        event["amount"].as_i64().filter(|a| *a > 0),
    ) else {
        let msg = r#"{"error":"need a JSON body with account and a positive amount"}"#;
        return json(StatusCode::BAD_REQUEST, msg.into());
    };
    match bank.apply(account, amount, None) {
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

#[cfg(test)]
mod tests {
    use super::{Bank, Refused};

    /// A withdrawal under a fence older than one the account has seen is refused and moves
    /// nothing; the same fence again (one lease writing twice) and a newer one pass.
    #[test]
    fn an_older_fence_is_refused() {
        let bank = Bank::default();
        assert!(matches!(bank.apply("1", -100, Some(7)), Ok(9_900)));
        assert!(matches!(
            bank.apply("1", -100, Some(6)),
            Err(Refused::Stale)
        ));
        assert!(matches!(bank.apply("1", -100, Some(7)), Ok(9_800)));
        assert!(matches!(bank.apply("1", 50, None), Ok(9_850)));
        assert!(matches!(bank.apply("1", -100, Some(8)), Ok(9_750)));
        assert!(matches!(bank.apply("1", -1, Some(7)), Err(Refused::Stale)));
        assert!(matches!(
            bank.apply("1", i64::MAX, None),
            Err(Refused::Funds(9_750))
        ));
    }
}
