//! HTTP test support: a real axum server on a loopback port, a real hyper client, and the
//! backends under test (memory, a real redis-server, a real valkey-server, clusters of them and
//! a Redlock quorum).
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use lock_core::{AnyBackend, Locker, MemoryBackend};
use tokio::net::{TcpListener, TcpStream};

use crate::support::{Cluster, Flavor, Server};

/// A backend under test, with the out-of-band delete that lease-loss tests need.
pub enum Harness {
    Memory(MemoryBackend),
    Server(Server),
    Cluster(Cluster),
    /// Independent servers, locked by a Redlock quorum.
    Quorum(Vec<Server>),
}

impl Harness {
    pub fn memory() -> Harness {
        Harness::Memory(MemoryBackend::new())
    }
    pub fn redis() -> Harness {
        Harness::Server(Server::start(Flavor::Redis))
    }
    pub fn valkey() -> Harness {
        Harness::Server(Server::start(Flavor::Valkey))
    }

    /// A 3-master Redis Cluster.
    pub fn redis_cluster() -> Harness {
        Harness::Cluster(Cluster::start(Flavor::Redis, 3, 0))
    }

    /// A 3-master Valkey Cluster.
    pub fn valkey_cluster() -> Harness {
        Harness::Cluster(Cluster::start(Flavor::Valkey, 3, 0))
    }

    /// A Redlock quorum of three independent Redis servers.
    pub fn quorum() -> Harness {
        Harness::Quorum((0..3).map(|_| Server::start(Flavor::Redis)).collect())
    }

    pub async fn locker_for(s: &Server) -> Locker {
        Locker::redis(&s.url()).await.expect("connect")
    }

    pub async fn locker(&self) -> Locker {
        match self {
            Harness::Memory(m) => Locker::new(AnyBackend::Memory(m.clone())),
            Harness::Server(s) => Locker::redis(&s.url()).await.expect("connect"),
            Harness::Cluster(c) => {
                let urls = c.urls();
                let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
                Locker::redis_cluster(&urls).await.expect("connect cluster")
            }
            Harness::Quorum(servers) => {
                let urls: Vec<String> = servers.iter().map(Server::url).collect();
                let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
                Locker::redlock(&urls).await.expect("connect quorum")
            }
        }
    }

    /// Deletes a lease from outside, as an operator or a failover would.
    pub fn delete(&self, locker: &Locker, key: &str) {
        let k = locker.lock_key(key).expect("key");
        match self {
            Harness::Memory(m) => {
                assert!(m.force_delete(&k), "no lease on {key} to delete");
            }
            Harness::Server(s) => {
                let n: i64 = s.cmd(&["DEL", k.lock_key()]);
                assert_eq!(n, 1, "no lease on {key} to delete");
            }
            Harness::Cluster(c) => {
                let n: i64 = c.cmd(&["DEL", k.lock_key()]);
                assert_eq!(n, 1, "no lease on {key} to delete");
            }
            // From every member: a quorum's lease is lost once too few still hold it.
            Harness::Quorum(servers) => {
                let n: i64 = servers
                    .iter()
                    .map(|s| s.cmd::<i64>(&["DEL", k.lock_key()]))
                    .sum();
                assert!(
                    n >= 2,
                    "no lease on {key} to delete on a majority ({n} of 3)"
                );
            }
        }
    }
}

/// Generates, in a module `$module`, one test per scenario (an `async fn(Harness)`) on the
/// backend `Harness::$harness()` makes.
#[macro_export]
macro_rules! on_harness {
    ($module:ident, $harness:ident: $($name:ident),*) => {
        mod $module {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { $crate::common::bounded(super::$name($crate::common::Harness::$harness())).await })*
        }
    };
}

/// Generates one test per backend from an `async fn(Harness)`.
#[macro_export]
macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        $crate::on_harness!(memory, memory: $($name),*);
        $crate::on_harness!(redis, redis: $($name),*);
        $crate::on_harness!(valkey, valkey: $($name),*);
    };
}

/// Generates one test per scenario on a 3-master Redis Cluster and a 3-master Valkey Cluster,
/// for the scenarios that reach the backend only through the layer's locker.
#[macro_export]
macro_rules! on_clusters {
    ($($name:ident),* $(,)?) => {
        $crate::on_harness!(redis_cluster, redis_cluster: $($name),*);
        $crate::on_harness!(valkey_cluster, valkey_cluster: $($name),*);
    };
}

/// Generates one test per scenario on a Redlock quorum of three Redis servers.
#[macro_export]
macro_rules! on_quorum {
    ($($name:ident),* $(,)?) => {
        $crate::on_harness!(quorum, quorum: $($name),*);
    };
}

/// Runs a scenario with a generous bound, so a hang fails loudly instead of stalling the suite.
pub async fn bounded(f: impl Future<Output = ()>) {
    tokio::time::timeout(Duration::from_secs(120), f)
        .await
        .expect("scenario did not finish within 120 s");
}

/// Serves `app` on a free loopback port until the test ends.
pub async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    addr
}

/// A complete response.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// A client connection of its own to `addr`, for tests that read a response frame by frame or
/// send several requests on one connection.
pub async fn connect(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    tx
}

/// One request on its own connection.
pub async fn send(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Reply {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(body.into())).expect("request");
    let res = tx.send_request(req).await.expect("response");
    let (parts, body) = res.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub async fn post(addr: SocketAddr, path: &str) -> Reply {
    send(addr, Method::POST, path, &[], Bytes::new()).await
}

/// A response body that yields `chunks` chunks, one per `every`.
pub struct Drip {
    sleep: Pin<Box<tokio::time::Sleep>>,
    every: Duration,
    left: usize,
}

impl Drip {
    pub fn new(every: Duration, chunks: usize) -> Drip {
        Drip {
            sleep: Box::pin(tokio::time::sleep(every)),
            every,
            left: chunks,
        }
    }
}

impl Body for Drip {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        ready!(self.sleep.as_mut().poll(cx));
        let next = tokio::time::Instant::now() + self.every;
        self.sleep.as_mut().reset(next);
        self.left -= 1;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"chunk\n")))))
    }
}

/// A response body that yields its one chunk and then stays pending without ever ending, as a
/// stream whose sender lingers does; sent with a `Content-Length`, the server stops polling it
/// after the chunk.
pub struct Lingering(pub Option<Bytes>);

impl Body for Lingering {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.0.take() {
            Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
            None => Poll::Pending,
        }
    }
}

/// A response body that yields `x`, then trailers, then stays pending: it never says it
/// ended, as a stream body that sent its trailers does not.
pub struct ThenTrailers(pub u8);

impl Body for ThenTrailers {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0 += 1;
        match self.0 {
            1 => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"x"))))),
            2 => {
                let mut trailers = http::HeaderMap::new();
                trailers.insert("x-checksum", http::HeaderValue::from_static("1"));
                Poll::Ready(Some(Ok(Frame::trailers(trailers))))
            }
            _ => Poll::Pending,
        }
    }
}

/// Polls `f` every 20 ms until it returns true or `limit` passes.
pub async fn eventually(limit: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let start = tokio::time::Instant::now();
    loop {
        if f().await {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A dedupe claim's key name in the layer's claims namespace, computed as the layer does
/// (SHA-256 of the length-prefixed scope and key), so the test can delete the claim from
/// outside.
pub fn claim_name(scope: &str, key: &str) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for p in [scope.as_bytes(), key.as_bytes()] {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Every header key extractor, each with the header it reads (`webhook_id` once by each of its
/// two headers): for the tests of a key header sent twice.
pub fn header_extractors() -> [(&'static str, lock_tower::KeyExtractor); 5] {
    use lock_tower::KeyExtractor;
    [
        (
            "x-delivery",
            KeyExtractor::header(http::HeaderName::from_static("x-delivery")),
        ),
        ("idempotency-key", KeyExtractor::idempotency_key()),
        ("webhook-id", KeyExtractor::webhook_id()),
        ("svix-id", KeyExtractor::webhook_id()),
        ("x-github-delivery", KeyExtractor::github_delivery()),
    ]
}

/// Sends each route `/{header}/{mode}` its key header twice (two values, the same value twice,
/// and an empty first value) with `body`, and checks each is refused as an invalid key.
pub async fn assert_repeated_key_headers_refused(
    addr: SocketAddr,
    headers: &[&str],
    modes: &[&str],
    body: &'static str,
) {
    for header in headers {
        for mode in modes {
            let path = format!("/{header}/{mode}");
            for [first, second] in [["7", "8"], ["7", "7"], ["", "7"]] {
                let twice = [(*header, first), (*header, second)];
                let r = send(addr, Method::POST, &path, &twice, body).await;
                assert_eq!(
                    r.status,
                    StatusCode::BAD_REQUEST,
                    "{path} {twice:?}: {}",
                    r.text()
                );
                assert!(
                    r.text().contains("invalid-key") && r.text().contains("more than once"),
                    "{path} {twice:?}: {}",
                    r.text()
                );
            }
        }
    }
}

/// A response body that yields `x`, then fails: a handler whose stream broke midway.
pub struct ThenError(pub u8);

impl Body for ThenError {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.0 += 1;
        match self.0 {
            1 => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"x"))))),
            2 => Poll::Ready(Some(Err(std::io::Error::other("the stream broke")))),
            _ => Poll::Ready(None),
        }
    }
}
