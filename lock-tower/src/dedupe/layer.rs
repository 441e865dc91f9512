use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Method, Response, StatusCode, header};
use http_body_util::Full;
use lock_core::{LockOptions, Locker};
use tower_layer::Layer;

use super::Dedupe;
use super::store::Store;
use crate::key::KeyExtractor;
use crate::reject::{Reason, Rejection, Rejections};

/// How long a completed result is replayed, unless configured otherwise: 24 hours.
///
/// ```
/// use lock_tower::{DedupeLayer, dedupe::DEFAULT_RETENTION};
/// use std::time::Duration;
///
/// assert_eq!(DEFAULT_RETENTION, Duration::from_secs(24 * 60 * 60));
/// // Stripe retries a failed delivery for up to three days.
/// let stripe = DedupeLayer::new(lock_core::Locker::memory()).retention(3 * DEFAULT_RETENTION);
/// # let _ = stripe;
/// ```
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
/// The longest retention accepted: a year.
///
/// ```
/// use axum::{Router, body::Body, routing::post};
/// use lock_tower::{DedupeLayer, dedupe::MAX_RETENTION};
/// use std::time::Duration;
/// use tower_service::Service;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_tower::BoxError> {
/// // A year and a day: a setup error, answered 500 before the handler runs.
/// let too_long = MAX_RETENTION + Duration::from_secs(24 * 60 * 60);
/// let layer = DedupeLayer::new(lock_core::Locker::memory()).retention(too_long);
/// let mut app: Router = Router::new().route("/orders", post(|| async { "created" })).layer(layer);
///
/// let req = http::Request::post("/orders").header("idempotency-key", r#""o-1""#);
/// assert_eq!(app.call(req.body(Body::empty())?).await?.status(), 500);
/// # Ok(()) }
/// ```
pub const MAX_RETENTION: Duration = Duration::from_secs(365 * 24 * 60 * 60);
/// The largest response body stored for replay, unless configured otherwise: 256 KiB.
///
/// ```
/// use lock_tower::{DedupeLayer, dedupe::DEFAULT_STORED_BODY_LIMIT};
///
/// assert_eq!(DEFAULT_STORED_BODY_LIMIT, 256 * 1024);
/// // Replays of this endpoint carry whole exports of up to 1 MiB.
/// let exports = DedupeLayer::new(lock_core::Locker::memory())
///     .stored_body_limit(4 * DEFAULT_STORED_BODY_LIMIT);
/// # let _ = exports;
/// ```
pub const DEFAULT_STORED_BODY_LIMIT: usize = 256 * 1024;
/// The largest request body read (for the fingerprint and JSON keys): 1 MiB.
///
/// ```
/// use axum::{Router, body::Body, routing::post};
/// use lock_tower::{DedupeLayer, dedupe::DEFAULT_REQUEST_BODY_LIMIT};
/// use tower_service::Service;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_tower::BoxError> {
/// let layer = DedupeLayer::new(lock_core::Locker::memory());
/// let mut app: Router = Router::new().route("/uploads", post(|| async { "stored" })).layer(layer);
///
/// assert_eq!(DEFAULT_REQUEST_BODY_LIMIT, 1024 * 1024); // the README's "1 MiB"
/// let big = vec![b'x'; DEFAULT_REQUEST_BODY_LIMIT + 1];
/// let req = http::Request::post("/uploads").header("idempotency-key", r#""u-1""#);
/// assert_eq!(app.call(req.body(Body::from(big))?).await?.status(), 413);
/// # Ok(()) }
/// ```
pub const DEFAULT_REQUEST_BODY_LIMIT: usize = 1024 * 1024;

/// The lock-core namespace of the claims (and so of the results stored beside them).
const CLAIM_NAMESPACE: &str = "dedupe";

/// Response headers [`DedupeLayer::replay_header`] ignores. `Set-Cookie`: a key is shared by
/// whoever sends it, and a replay would hand the first caller's session to them. The framing
/// and hop-by-hop headers describe one connection or one transfer, not the answer: the server
/// sets them for the replay's own body (which may be omitted), and a stored `Content-Length`
/// or `Transfer-Encoding` would contradict it. The layer's own two replay headers are its to
/// set.
const NEVER_REPLAYED: [&str; 12] = [
    "set-cookie",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "upgrade",
    "te",
    "trailer",
    "proxy-authenticate",
    "idempotent-replayed",
    "idempotent-body-omitted",
];

/// The shortest retention accepted: Redis keeps results in whole milliseconds, and below one
/// the result would be deleted as soon as it was written.
pub(crate) const MIN_RETENTION: Duration = Duration::from_millis(1);

#[derive(Clone)]
pub(crate) struct DedupeConfig {
    /// The caller's locker in the `dedupe` namespace: claims live where no plain key (a
    /// `LockLayer` key taken from a request, whatever its prefix) can name them.
    pub(crate) claims: Locker,
    pub(crate) store: Store,
    pub(crate) key: KeyExtractor,
    pub(crate) scope: String,
    pub(crate) claim: LockOptions,
    pub(crate) wait: bool,
    pub(crate) methods: Option<Vec<Method>>,
    pub(crate) pass_unkeyed: bool,
    pub(crate) request_limit: usize,
    pub(crate) stored_limit: usize,
    pub(crate) retention: Duration,
    pub(crate) replay_headers: Vec<HeaderName>,
    pub(crate) rejections: Rejections,
}

impl std::fmt::Debug for DedupeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DedupeConfig")
            .field("key", &self.key)
            .field("scope", &self.scope)
            .field("claim", &self.claim)
            .field("wait", &self.wait)
            .field("methods", &self.methods)
            .field("retention", &self.retention)
            .field("stored_limit", &self.stored_limit)
            .finish_non_exhaustive()
    }
}

impl DedupeConfig {
    pub(crate) fn method_filter(&self, method: &Method) -> crate::util::MethodFilter {
        crate::util::method_filter(self.methods.as_deref(), method)
    }
}

/// Handles each delivery once: the first request with a key runs the handler, duplicates get
/// its stored result.
///
/// The first request claims the key atomically (a lease with a fence, renewed while the handler
/// runs). When the handler finishes, its status, allow-listed headers and body are stored, but
/// only if the claim still holds (a token check in the same atomic step as the write), and the
/// claim is released.
///
/// | situation | answer |
/// |---|---|
/// | no key | 400 (or pass through: [`pass_through_without_key`](Self::pass_through_without_key)); a [`KeyExtractor::route_param`] the matched route does not have is the layer's setup at fault: 500 ([`Reason::Misconfigured`]), logged at `error` (or pass through) |
/// | duplicate while the first still runs | 409 with `Retry-After` (or wait: [`wait`](Self::wait)) |
/// | duplicate after the first completed | the stored status, headers and body, with `Idempotent-Replayed: true` |
/// | same key, different method, path or body | 422 ([`Reason::KeyReused`], configurable, e.g. 409) |
/// | first attempt answered 5xx, 429, 408, or another 4xx with `Retry-After` (a 409 from a [`LockLayer`](crate::LockLayer) inside) | not stored; the claim is released, so a retry runs the handler again |
/// | claim lost while the handler ran | handler cancelled, 503, nothing stored |
/// | claim lost while the layer reads or relays the response body (the body may still be doing the handler's work) | the body dropped, nothing stored: a 503 while nothing went out, else a cut-off body ([`LeaseLostWhileStreaming`](crate::LeaseLostWhileStreaming)) |
/// | client hangs up while the handler runs | handler cancelled (as axum does), claim released, nothing stored |
/// | client hangs up after the handler answered | the result is still stored and the claim released (a task of its own finishes them), so the retry gets the replay; the body is read on for at most one [`claim_ttl`](Self::claim_ttl) after the hang-up, then cut off with nothing stored and the claim released |
/// | result store write fails (backend refuses it or is down) | the first caller still gets the handler's answer; nothing is stored; the claim is released (with the backend down, it expires with its TTL), so a retry runs the handler again |
/// | result store unreachable when a request arrives | 503 with `Retry-After: 1`; the handler does not run |
/// | stored result changed from outside (a status no response has, a field gone, a value of another type) | 503 ([`Reason::Unavailable`]) without `Retry-After`, logged at `error`; neither replayed nor run again until it expires or is deleted |
/// | [`retention`](Self::retention) (1 ms to a year) or [`claim_ttl`](Self::claim_ttl) (lock-core's `MIN_TTL` to `MAX_TTL`) out of range | 500 ([`Reason::Misconfigured`]), logged at `error`; the handler does not run |
/// | the claim's stored fence is 2^64 - 1 (`Error::FenceExhausted`: no claim is possible), or its server name holds another program's value (`Error::WrongType`) | 503 ([`Reason::Unavailable`]) without `Retry-After`, logged at `error`; the handler does not run |
/// | a backend with no result store (a Redlock quorum), an empty [`methods`](Self::methods) list, a JSON-body key with a [`request_body_limit`](Self::request_body_limit) of 0, or a [`reject_status`](Self::reject_status) that is not 4xx/5xx | 500 ([`Reason::Misconfigured`], no `Retry-After`), logged at `error`; the handler does not run |
/// | request with a key, body above the cap (1 MiB) | 413 (the body is read only for a keyed request's fingerprint: without a key in the request head (header, path, route parameter, closure), the request is answered or passed through unread; a JSON-body key is looked for in the body, up to the cap) |
/// | response body fails while the layer reads it, or ends before its declared `Content-Length` | 500 ([`Reason::ResponseFailed`]); nothing stored, claim released (past the cap: the caller sees a cut-off body) |
/// | response body above the stored cap (256 KiB) | the first caller gets the full body; once it ended well (before the caller sees its end), the stored result keeps status and headers only, and replays carry an empty body with `Idempotent-Body-Omitted: true` and `Cache-Control: no-store`, without the headers that describe the missing bytes (`Content-Encoding`, `ETag`, `Last-Modified`, `Content-Location`, `Content-Range`, digests); if it fails past the cap, nothing is stored and the claim is released |
///
/// Keys are scoped by [`scope`](Self::scope) and hashed (SHA-256) before they become storage
/// keys, and the claims are taken in a lock-core namespace of their own
/// ([`Locker::with_namespace`]), so a hostile key can neither collide with nor reach another
/// namespace: not even a [`LockLayer`](crate::LockLayer) key spelled like a claim's name can
/// hold a delivery's claim. Results are kept for 24 h by default. On Redis they live beside the
/// claim (`{prefix:\x1Fdedupe:<hash>}:result` beside `{prefix:\x1Fdedupe:<hash>}:lock`, one
/// hash tag, where `\x1F` is the unit separator no key or prefix may contain) and survive a
/// restart of the service; on the memory backend they live with the memory store, so every
/// layer over one store shares them, as every layer over one server does.
///
/// Put capacity limits (tower's `ConcurrencyLimit`, `Buffer`, `RateLimit`) outside this layer,
/// not inside it: the inner service made ready in `poll_ready` is called only once the claim
/// is taken, so a slot reserved inside would be held through a duplicate's wait and the read
/// of the request body.
///
/// ```
/// use axum::{Router, routing::post};
/// use lock_tower::{DedupeLayer, KeyExtractor};
/// use std::time::Duration;
///
/// async fn on_event(body: bytes::Bytes) -> &'static str {
///     // ... apply the event once ...
///     "processed"
/// }
///
/// let locker = lock_core::Locker::memory();
/// let app: Router = Router::new()
///     .route("/hooks/stripe", post(on_event))
///     .layer(
///         DedupeLayer::new(locker)
///             .key(KeyExtractor::json_field("/id"))
///             .scope("stripe")
///             .retention(Duration::from_secs(3 * 24 * 60 * 60)),
///     );
/// ```
#[derive(Clone, Debug)]
pub struct DedupeLayer {
    cfg: Arc<DedupeConfig>,
}

impl DedupeLayer {
    /// A layer on `locker`'s backend. Defaults: key from the `Idempotency-Key` header, methods
    /// POST, PUT, PATCH and DELETE, claim TTL 30 s (renewed), no waiting, retention 24 h,
    /// stored bodies up to 256 KiB, request bodies up to 1 MiB, replayed headers
    /// `content-type`, `content-language`, `content-location`, `location`, `etag`,
    /// `last-modified`, `cache-control`, `content-encoding` and `vary`.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::get};
    /// use lock_tower::DedupeLayer;
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let mut app: Router = Router::new()
    ///     .route("/orders", get(|| async { "orders" }).post(|| async { "created" }))
    ///     .layer(DedupeLayer::new(lock_core::Locker::memory()));
    ///
    /// // GET is not deduped, so it needs no key; a POST without `Idempotency-Key` is refused.
    /// let list = http::Request::get("/orders").body(Body::empty())?;
    /// assert_eq!(app.call(list).await?.status(), 200);
    /// let create = http::Request::post("/orders").body(Body::empty())?;
    /// assert_eq!(app.call(create).await?.status(), 400);
    /// # Ok(()) }
    /// ```
    pub fn new(locker: Locker) -> DedupeLayer {
        let claims = locker
            .with_namespace(CLAIM_NAMESPACE)
            .expect("`dedupe` is a valid namespace: no `:`, braces or control characters");
        DedupeLayer {
            cfg: Arc::new(DedupeConfig {
                store: Store::for_locker(&locker),
                claims,
                key: KeyExtractor::idempotency_key(),
                scope: String::new(),
                // Delivery ids come without end: each claim's fence is forgotten with its
                // result instead of kept for ever.
                claim: LockOptions::new().keep_fence(DEFAULT_RETENTION),
                wait: false,
                methods: Some(vec![
                    Method::POST,
                    Method::PUT,
                    Method::PATCH,
                    Method::DELETE,
                ]),
                pass_unkeyed: false,
                request_limit: DEFAULT_REQUEST_BODY_LIMIT,
                stored_limit: DEFAULT_STORED_BODY_LIMIT,
                retention: DEFAULT_RETENTION,
                replay_headers: vec![
                    header::CONTENT_TYPE,
                    header::CONTENT_LANGUAGE,
                    header::CONTENT_LOCATION,
                    header::LOCATION,
                    header::ETAG,
                    header::LAST_MODIFIED,
                    header::CACHE_CONTROL,
                    // A compression layer inside this one: the stored bytes are compressed,
                    // and a replay without these would be garbage to its caller.
                    header::CONTENT_ENCODING,
                    header::VARY,
                ],
                rejections: Rejections::default(),
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut DedupeConfig)) -> Self {
        f(Arc::make_mut(&mut self.cfg));
        self
    }

    /// Where the delivery id comes from (default [`KeyExtractor::idempotency_key`]).
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::{DedupeLayer, KeyExtractor};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let request_id = KeyExtractor::header(http::HeaderName::from_static("x-request-id"));
    /// let layer = DedupeLayer::new(lock_core::Locker::memory()).key(request_id);
    /// let mut app: Router = Router::new()
    ///     .route("/orders", post(|| async { "created" }))
    ///     .layer(layer);
    ///
    /// for replayed in [false, true] {
    ///     let req = http::Request::post("/orders").header("x-request-id", "req-81f3");
    ///     let res = app.call(req.body(Body::empty())?).await?;
    ///     assert_eq!(res.headers().contains_key("idempotent-replayed"), replayed);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn key(self, key: KeyExtractor) -> Self {
        self.with(|c| c.key = key)
    }

    /// A namespace for this layer's keys (for example the sender's name), so two endpoints
    /// with the same ids do not dedupe each other. Within a scope a key is shared by every
    /// caller: where callers choose their own keys, make the key per caller (a
    /// [`KeyExtractor::from_fn`] that joins the principal and the key).
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::{DedupeLayer, KeyExtractor};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let hooks = DedupeLayer::new(lock_core::Locker::memory()).key(KeyExtractor::webhook_id());
    /// let mut app: Router = Router::new()
    ///     .route("/hooks/a", post(|| async { "a" }).layer(hooks.clone().scope("sender-a")))
    ///     .route("/hooks/b", post(|| async { "b" }).layer(hooks.scope("sender-b")));
    ///
    /// // Two senders happen to use one id. Unscoped, the second delivery would be taken for
    /// // the first one's key reused on another path (422); scoped, each is handled.
    /// for hook in ["/hooks/a", "/hooks/b"] {
    ///     let req = http::Request::post(hook).header("webhook-id", "msg_1");
    ///     assert_eq!(app.call(req.body(Body::empty())?).await?.status(), 200);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn scope(self, scope: impl Into<String>) -> Self {
        let scope = scope.into();
        self.with(|c| c.scope = scope)
    }

    /// How long a completed result is replayed (default 24 h). Standard Webhooks suggests at
    /// least 5 minutes. Each claim's fence is kept as long too
    /// ([`LockOptions::keep_fence`](lock_core::LockOptions::keep_fence)), then forgotten with the
    /// result: delivery ids come without end, and none leaves anything behind for good. From 1 ms to [`MAX_RETENTION`]; out of that range every keyed request
    /// the layer would dedupe (see [`methods`](Self::methods)) is answered 500
    /// ([`Reason::Misconfigured`]) before the handler runs (a request without a key is answered
    /// as usual: 400, or passed on where the layer lets it).
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::DedupeLayer;
    /// use std::time::Duration;
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let layer = DedupeLayer::new(lock_core::Locker::memory())
    ///     .retention(Duration::from_millis(20));
    /// let mut app: Router = Router::new()
    ///     .route("/orders", post(|| async { "created" }))
    ///     .layer(layer);
    /// let create = || http::Request::post("/orders").header("idempotency-key", r#""o-1""#);
    ///
    /// app.call(create().body(Body::empty())?).await?;
    /// tokio::time::sleep(Duration::from_millis(50)).await;
    /// // Past the retention the result is forgotten: the same key runs the handler again.
    /// let res = app.call(create().body(Body::empty())?).await?;
    /// assert!(!res.headers().contains_key("idempotent-replayed"));
    /// # Ok(()) }
    /// ```
    pub fn retention(self, retention: Duration) -> Self {
        self.with(|c| {
            c.retention = retention;
            c.claim = c.claim.clone().keep_fence(retention);
        })
    }

    /// The claim's lease TTL (default 30 s, renewed while the handler runs). From lock-core's
    /// `MIN_TTL` to `MAX_TTL` (10 ms to 24 h); out of that range keyed requests are answered
    /// 500 ([`Reason::Misconfigured`]) before the handler runs.
    ///
    /// ```
    /// use lock_tower::{DedupeLayer, KeyExtractor};
    /// use std::time::Duration;
    ///
    /// // A process that dies mid-delivery holds the sender's retries off for at most 10 s.
    /// let layer = DedupeLayer::new(lock_core::Locker::memory())
    ///     .key(KeyExtractor::webhook_id())
    ///     .claim_ttl(Duration::from_secs(10));
    /// # let _ = layer;
    /// ```
    pub fn claim_ttl(self, ttl: Duration) -> Self {
        self.with(|c| c.claim = c.claim.clone().ttl(ttl))
    }

    /// Let a duplicate that arrives while the first still runs wait up to `deadline` for the
    /// first to finish (then get its result) instead of an immediate 409.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::DedupeLayer;
    /// use std::sync::{Arc, atomic::{AtomicUsize, Ordering}};
    /// use std::time::Duration;
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let runs = Arc::new(AtomicUsize::new(0));
    /// let counter = runs.clone();
    /// let charge = move || async move {
    ///     counter.fetch_add(1, Ordering::SeqCst);
    ///     tokio::time::sleep(Duration::from_millis(50)).await;
    ///     "charged"
    /// };
    /// let layer = DedupeLayer::new(lock_core::Locker::memory()).wait(Duration::from_secs(5));
    /// let app: Router = Router::new().route("/payments", post(charge)).layer(layer);
    /// let pay = || http::Request::post("/payments").header("idempotency-key", r#""p-1""#);
    ///
    /// // A retry sent while the first still runs waits for it and gets its answer, not a 409.
    /// let (a, b) = tokio::join!(
    ///     app.clone().call(pay().body(Body::empty())?),
    ///     app.clone().call(pay().body(Body::empty())?),
    /// );
    /// assert_eq!([a?.status(), b?.status()], [200, 200]);
    /// assert_eq!(runs.load(Ordering::SeqCst), 1);
    /// # Ok(()) }
    /// ```
    pub fn wait(self, deadline: Duration) -> Self {
        self.with(|c| {
            c.wait = true;
            c.claim = c.claim.clone().wait(deadline);
        })
    }

    /// Dedupe only these methods (default POST, PUT, PATCH, DELETE); others pass through. An
    /// empty list would dedupe nothing: every request is then answered 500
    /// ([`Reason::Misconfigured`]), logged at `error`.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use http::Method;
    /// use lock_tower::DedupeLayer;
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// // PUT replaces the whole order, idempotent by itself; only POST needs dedupe.
    /// let layer = DedupeLayer::new(lock_core::Locker::memory()).methods([Method::POST]);
    /// let mut app: Router = Router::new()
    ///     .route("/orders", post(|| async { "created" }).put(|| async { "replaced" }))
    ///     .layer(layer);
    ///
    /// for (method, status) in [(Method::PUT, 200), (Method::POST, 400)] {
    ///     let req = http::Request::builder().method(method).uri("/orders");
    ///     assert_eq!(app.call(req.body(Body::empty())?).await?.status(), status);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.with(|c| c.methods = Some(methods))
    }

    /// Let requests without a key through, without dedupe, instead of answering 400. With a key
    /// taken from the head (a header, the path, a closure), such a request's body is handed on
    /// unread, whatever its size; with a JSON-body key, the body is read (up to the
    /// [cap](Self::request_body_limit)) to look for the key, and handed on.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::DedupeLayer;
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// // Clients that send an `Idempotency-Key` get dedupe; older ones are served as before.
    /// let layer = DedupeLayer::new(lock_core::Locker::memory()).pass_through_without_key();
    /// let mut app: Router = Router::new()
    ///     .route("/orders", post(|| async { "created" }))
    ///     .layer(layer);
    ///
    /// for _ in 0..2 {
    ///     let res = app.call(http::Request::post("/orders").body(Body::empty())?).await?;
    ///     assert_eq!(res.status(), 200);
    ///     assert!(!res.headers().contains_key("idempotent-replayed"));
    /// }
    /// # Ok(()) }
    /// ```
    pub fn pass_through_without_key(self) -> Self {
        self.with(|c| c.pass_unkeyed = true)
    }

    /// The largest request body read for the fingerprint (default 1 MiB); a keyed request
    /// above it gets 413. With a key from the request head, 0 admits only requests without a
    /// body; with a JSON-body key it leaves no room for the key: every request is answered 500
    /// ([`Reason::Misconfigured`]), logged at `error`.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::{DedupeLayer, KeyExtractor};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// // Webhook events are a few KiB; do not buffer a megabyte per delivery.
    /// let layer = DedupeLayer::new(lock_core::Locker::memory())
    ///     .key(KeyExtractor::webhook_id())
    ///     .request_body_limit(16 * 1024);
    /// let mut app: Router = Router::new().route("/hooks", post(|| async { "ok" })).layer(layer);
    ///
    /// let req = http::Request::post("/hooks").header("webhook-id", "msg_1");
    /// let res = app.call(req.body(Body::from(vec![b'x'; 32 * 1024]))?).await?;
    /// assert_eq!(res.status(), 413);
    /// # Ok(()) }
    /// ```
    pub fn request_body_limit(self, bytes: usize) -> Self {
        self.with(|c| c.request_limit = bytes)
    }

    /// The largest response body stored for replay (default 256 KiB); see the table above for
    /// what happens beyond it.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::DedupeLayer;
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let layer = DedupeLayer::new(lock_core::Locker::memory()).stored_body_limit(8);
    /// let mut app: Router = Router::new()
    ///     .route("/exports", post(|| async { "a body longer than 8 bytes" }))
    ///     .layer(layer);
    /// let export = || http::Request::post("/exports").header("idempotency-key", r#""e-1""#);
    ///
    /// let first = app.call(export().body(Body::empty())?).await?;
    /// let body = axum::body::to_bytes(first.into_body(), 1024).await?;
    /// assert_eq!(body, "a body longer than 8 bytes");
    /// // The replay keeps status and headers (not those describing the missing bytes), and
    /// // says the body was not kept.
    /// let replay = app.call(export().body(Body::empty())?).await?;
    /// assert_eq!(replay.headers()["idempotent-body-omitted"], "true");
    /// assert!(axum::body::to_bytes(replay.into_body(), 1024).await?.is_empty());
    /// # Ok(()) }
    /// ```
    pub fn stored_body_limit(self, bytes: usize) -> Self {
        self.with(|c| c.stored_limit = bytes)
    }

    /// Replay this response header too (beside the defaults); naming one already listed
    /// changes nothing. `Set-Cookie` (a caller's session would go to whoever else sends the
    /// key), the framing and hop-by-hop headers (`Content-Length`, `Transfer-Encoding`,
    /// `Connection`, `Keep-Alive`, `Proxy-Connection`, `Upgrade`, `TE`, `Trailer`,
    /// `Proxy-Authenticate`: they belong to one transfer, and the server sets them for the
    /// replay's own) and the layer's own `Idempotent-Replayed` and `Idempotent-Body-Omitted` are
    /// never replayed: naming one is ignored, with a warning.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use http::HeaderName;
    /// use lock_tower::DedupeLayer;
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let layer = DedupeLayer::new(lock_core::Locker::memory())
    ///     .replay_header(HeaderName::from_static("x-charge-id"));
    /// let charge = || async { ([("x-charge-id", "ch_3MtwBw")], "charged") };
    /// let mut app: Router = Router::new().route("/payments", post(charge)).layer(layer);
    /// let pay = || http::Request::post("/payments").header("idempotency-key", r#""p-1""#);
    ///
    /// app.call(pay().body(Body::empty())?).await?;
    /// let replay = app.call(pay().body(Body::empty())?).await?;
    /// assert_eq!(replay.headers()["idempotent-replayed"], "true");
    /// assert_eq!(replay.headers()["x-charge-id"], "ch_3MtwBw");
    /// # Ok(()) }
    /// ```
    pub fn replay_header(self, name: HeaderName) -> Self {
        if NEVER_REPLAYED.contains(&name.as_str()) {
            tracing::warn!(header = %name, "DedupeLayer::replay_header: this header is never replayed; ignored");
            return self;
        }
        self.with(|c| {
            // Listed twice, a header would be stored and replayed twice.
            if !c.replay_headers.contains(&name) {
                c.replay_headers.push(name)
            }
        })
    }

    /// The status to answer with for `reason` (for example 409 instead of 422 for
    /// [`Reason::KeyReused`]). It must be an error status (4xx or 5xx): with any other, those
    /// refusals are answered 500 ([`Reason::Misconfigured`]), logged at `error`.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use http::StatusCode;
    /// use lock_tower::{DedupeLayer, Reason};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let layer = DedupeLayer::new(lock_core::Locker::memory())
    ///     .reject_status(Reason::KeyReused, StatusCode::CONFLICT);
    /// let mut app: Router = Router::new()
    ///     .route("/orders", post(|| async { "created" }))
    ///     .layer(layer);
    /// let order = |body| {
    ///     let req = http::Request::post("/orders").header("idempotency-key", r#""o-1""#);
    ///     req.body(Body::from(body))
    /// };
    ///
    /// assert_eq!(app.call(order(r#"{"qty": 1}"#)?).await?.status(), 200);
    /// // The same key with another body: 409 here instead of the default 422.
    /// assert_eq!(app.call(order(r#"{"qty": 2}"#)?).await?.status(), 409);
    /// # Ok(()) }
    /// ```
    pub fn reject_status(self, reason: Reason, status: StatusCode) -> Self {
        self.with(|c| c.rejections.set_status(reason, status))
    }

    /// Build rejection responses with `f` instead of the default problem+json body.
    ///
    /// A rejection that says when to come back ([`Rejection::retry_after`]) gets its
    /// `Retry-After` header even where `f` leaves it out: senders' retries count on it, and so
    /// does a `DedupeLayer` outside, which would otherwise store the refusal as the request's
    /// answer. A `Retry-After` that `f` sets is kept. A response whose status is not an error
    /// (4xx or 5xx; `Response::new` leaves 200) goes out with the rejection's status
    /// ([`Rejection::status`]) instead: a refusal answered as a success would tell the client
    /// its request ran.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::{DedupeLayer, Reason};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let layer = DedupeLayer::new(lock_core::Locker::memory()).rejection_response(|r| {
    ///     // The API's own error codes instead of problem+json.
    ///     let code = match r.reason() {
    ///         Reason::MissingKey => "IDEMPOTENCY_KEY_REQUIRED",
    ///         _ => "REJECTED",
    ///     };
    ///     let mut res = http::Response::new(format!(r#"{{"code":"{code}"}}"#).into());
    ///     *res.status_mut() = r.status();
    ///     res
    /// });
    /// let mut app: Router = Router::new()
    ///     .route("/orders", post(|| async { "created" }))
    ///     .layer(layer);
    ///
    /// let res = app.call(http::Request::post("/orders").body(Body::empty())?).await?;
    /// assert_eq!(res.status(), 400);
    /// let body = axum::body::to_bytes(res.into_body(), 1024).await?;
    /// assert_eq!(body, r#"{"code":"IDEMPOTENCY_KEY_REQUIRED"}"#);
    /// # Ok(()) }
    /// ```
    pub fn rejection_response(
        self,
        f: impl Fn(&Rejection) -> Response<Full<Bytes>> + Send + Sync + 'static,
    ) -> Self {
        self.with(|c| c.rejections.set_responder(f))
    }
}

impl<S> Layer<S> for DedupeLayer {
    type Service = Dedupe<S>;

    fn layer(&self, inner: S) -> Dedupe<S> {
        Dedupe {
            inner,
            cfg: self.cfg.clone(),
        }
    }
}
