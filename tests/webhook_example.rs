//! The README's session with `examples/webhook.rs`, replayed against the example's own router
//! on the memory backend, over a real loopback connection: statuses, headers and bodies as the
//! README shows them (the fence and the order of the concurrent withdrawals aside).
#![cfg(feature = "tower")]

#[allow(dead_code)]
#[path = "../examples/webhook.rs"]
mod webhook;

use std::net::SocketAddr;
use std::time::Duration;

use leasehold::Locker;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One HTTP/1.1 exchange as curl shows it: status code, headers (names lower-case) and body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Sends one POST on a connection of its own (`Connection: close`) and reads the whole answer.
async fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await.expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.expect("read");
    let raw = String::from_utf8(raw).expect("a text answer");
    let (head, body) = raw.split_once("\r\n\r\n").expect("a head and a body");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .expect("a status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_session() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, webhook::app(Locker::memory())).await });

    // A withdrawal takes a second (the bank call); a second one on the same account meanwhile
    // is refused at once.
    let first = tokio::spawn(async move { post(addr, "/accounts/7/withdraw", &[], "2500").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let busy = post(addr, "/accounts/7/withdraw", &[], "100").await;
    assert_eq!(busy.status, 409, "{}", busy.body);
    assert_eq!(
        busy.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(busy.header("retry-after"), Some("10"));
    assert_eq!(
        busy.body,
        r#"{"detail":"lock `account:7` is held by another holder","status":409,"title":"Resource is locked","type":"urn:leasehold:problem:busy"}"#
    );
    let first = first.await.expect("join");
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("content-type"), Some("application/json"));
    let (shown, fence) = first
        .body
        .trim_end()
        .rsplit_once(r#","fence":"#)
        .expect("a fence");
    assert_eq!(shown, r#"{"account":"7","withdrawn":2500,"balance":7500"#);
    let fence: u64 = fence
        .strip_suffix('}')
        .and_then(|f| f.parse().ok())
        .expect("a numeric fence");
    assert!(fence > 0);

    // A payment webhook credits once per delivery id; the redelivery is the stored answer.
    let hook = [("webhook-id", "msg_2Lh9")];
    let credit = r#"{"account":"7","amount":500}"#;
    let paid = post(addr, "/hooks/payments", &hook, credit).await;
    assert_eq!(paid.status, 200, "{}", paid.body);
    assert_eq!(paid.header("content-type"), Some("application/json"));
    assert_eq!(
        paid.body,
        "{\"account\":\"7\",\"credited\":500,\"balance\":8000}\n"
    );
    assert_eq!(paid.header("idempotent-replayed"), None);
    let again = post(addr, "/hooks/payments", &hook, credit).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, paid.body, "the replay is the stored answer");

    let reused = post(
        addr,
        "/hooks/payments",
        &hook,
        r#"{"account":"7","amount":9999}"#,
    )
    .await;
    assert_eq!(reused.status, 422, "{}", reused.body);
    assert_eq!(
        reused.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(
        reused.body,
        r#"{"detail":"this key was used before with a different request (method, path or body)","status":422,"title":"Idempotency key reused with a different request","type":"urn:leasehold:problem:key-reused"}"#
    );

    let keyless = post(
        addr,
        "/hooks/payments",
        &[],
        r#"{"account":"7","amount":1}"#,
    )
    .await;
    assert_eq!(keyless.status, 400, "{}", keyless.body);
    assert_eq!(
        keyless.body,
        r#"{"detail":"neither `webhook-id` nor `svix-id` is present","status":400,"title":"Missing key","type":"urn:leasehold:problem:missing-key"}"#
    );
    // The refused and replayed requests moved no money.
    let last = post(addr, "/accounts/7/withdraw", &[], "8000").await;
    assert_eq!(last.status, 200, "{}", last.body);
    assert!(last.body.contains(r#""balance":0,"#), "{}", last.body);
}

/// Amounts the bank cannot take are answered, not a panic that drops the connection (and,
/// with the claim freed, every redelivery's too): a credit past `i64::MAX` is refused, and a
/// credit that is not positive is a bad request rather than a debit outside the account's
/// lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credits_the_bank_cannot_take_are_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, webhook::app(Locker::memory())).await });
    let huge = format!(r#"{{"account":"3","amount":{}}}"#, i64::MAX);
    for _ in 0..2 {
        let refused = post(
            addr,
            "/hooks/payments",
            &[("webhook-id", "msg_huge")],
            &huge,
        )
        .await;
        assert_eq!(refused.status, 422, "{}", refused.body);
    }
    for (id, amount) in [("msg_neg", "-500"), ("msg_zero", "0")] {
        let body = format!(r#"{{"account":"3","amount":{amount}}}"#);
        let bad = post(addr, "/hooks/payments", &[("webhook-id", id)], &body).await;
        assert_eq!(bad.status, 400, "{amount}: {}", bad.body);
    }
    let all = post(addr, "/accounts/3/withdraw", &[], "10000").await;
    assert_eq!(all.status, 200, "{}", all.body);
    assert!(all.body.contains(r#""balance":0,"#), "{}", all.body);
}
