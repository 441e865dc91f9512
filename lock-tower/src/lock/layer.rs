use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response, StatusCode};
use http_body_util::Full;
use lock_core::{LockOptions, Locker};
use tower_layer::Layer;

use super::Lock;
use crate::key::KeyExtractor;
use crate::reject::{Reason, Rejection, Rejections};

/// The JSON body cap used when the key is a body field, unless configured otherwise.
///
/// ```
/// use axum::{Router, body::Body, routing::post};
/// use lock_tower::{DEFAULT_KEY_BODY_LIMIT, KeyExtractor, LockLayer};
/// use tower_service::Service;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_tower::BoxError> {
/// let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::json_field("/account"));
/// let mut app: Router = Router::new().route("/transfers", post(|| async { "sent" })).layer(layer);
///
/// assert_eq!(DEFAULT_KEY_BODY_LIMIT, 64 * 1024); // the README's "64 KiB"
/// let memo = "x".repeat(DEFAULT_KEY_BODY_LIMIT);
/// let body = format!(r#"{{"account": 7, "memo": "{memo}"}}"#);
/// let res = app.call(http::Request::post("/transfers").body(Body::from(body))?).await?;
/// assert_eq!(res.status(), 413);
/// # Ok(()) }
/// ```
pub const DEFAULT_KEY_BODY_LIMIT: usize = 64 * 1024;

#[derive(Clone)]
pub(crate) struct LockConfig {
    pub(crate) locker: Locker,
    pub(crate) key: KeyExtractor,
    pub(crate) prefix: String,
    /// Why the prefix can make no valid key, when it cannot: every request is then the layer's
    /// fault (500), not the client's (400).
    pub(crate) prefix_problem: Option<&'static str>,
    pub(crate) opts: LockOptions,
    pub(crate) wait: bool,
    pub(crate) methods: Option<Vec<Method>>,
    pub(crate) pass_unkeyed: bool,
    pub(crate) body_limit: usize,
    pub(crate) rejections: Rejections,
}

impl std::fmt::Debug for LockConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockConfig")
            .field("key", &self.key)
            .field("prefix", &self.prefix)
            .field("opts", &self.opts)
            .field("wait", &self.wait)
            .field("methods", &self.methods)
            .field("pass_unkeyed", &self.pass_unkeyed)
            .field("body_limit", &self.body_limit)
            .finish_non_exhaustive()
    }
}

impl LockConfig {
    pub(crate) fn method_filter(&self, method: &Method) -> crate::util::MethodFilter {
        crate::util::method_filter(self.methods.as_deref(), method)
    }
}

/// Runs at most one request at a time per key, across every process that shares the locker's
/// backend.
///
/// The layer takes a lease on the request's key before the handler runs, keeps it renewed while
/// the handler runs and while the response body streams, and releases it when the body ends or
/// is dropped (the client went away). The handler sees the grant's fence through the
/// [`Fence`](crate::Fence) extractor.
///
/// | situation | default answer |
/// |---|---|
/// | no key in the request | 400 (or pass through unlocked: [`pass_through_without_key`](Self::pass_through_without_key)) |
/// | key held by another request | 409 with `Retry-After` (the holder's time left), or wait: [`wait`](Self::wait) |
/// | waited up to the deadline | 409 with `Retry-After` |
/// | lease lost while the handler ran | handler cancelled (its future dropped), 503 |
/// | lease lost while the body streamed | the body ends with an error (the response is cut off) |
/// | lock backend unreachable | 503 with `Retry-After: 1` |
/// | the key's stored fence is 2^64 - 1 (`Error::FenceExhausted`: no grant is possible), or its server name holds another program's value (`Error::WrongType`) | 503 ([`Reason::Unavailable`]) without `Retry-After`, logged at `error` |
/// | the layer's [`ttl`](Self::ttl) out of range (below `MIN_TTL`, above `MAX_TTL`), a [`key_prefix`](Self::key_prefix) no key can follow, an empty [`methods`](Self::methods) list, a route parameter the route lacks, a JSON-body key with a [`body_limit`](Self::body_limit) of 0, or a [`reject_status`](Self::reject_status) that is not 4xx/5xx | 500 ([`Reason::Misconfigured`]), logged at `error` |
///
/// Every status is configurable ([`reject_status`](Self::reject_status)); bodies are
/// `application/problem+json` unless a [`rejection_response`](Self::rejection_response) is set.
///
/// Put capacity limits (tower's `ConcurrencyLimit`, `Buffer`, `RateLimit`) outside this layer,
/// not inside it: as every Tower middleware, the layer calls the inner service it made ready
/// in `poll_ready`, and that happens only once the lease is granted, so a slot reserved inside
/// would be held through the whole wait for the key (up to [`wait`](Self::wait)) and through
/// the read of a JSON body, keeping requests for other keys out.
///
/// ```
/// use axum::{Router, routing::post};
/// use lock_tower::{Fence, KeyExtractor, LockLayer};
/// use std::time::Duration;
///
/// async fn withdraw(Fence(fence): Fence) -> String {
///     format!("fence {fence}")
/// }
///
/// let locker = lock_core::Locker::memory(); // or Locker::redis(url).await?
/// let app: Router = Router::new()
///     .route("/accounts/{id}/withdraw", post(withdraw))
///     .route_layer(
///         LockLayer::new(locker, KeyExtractor::route_param("id"))
///             .key_prefix("account:")
///             .ttl(Duration::from_secs(10))
///             .methods([http::Method::POST]),
///     );
/// ```
#[derive(Clone, Debug)]
pub struct LockLayer {
    cfg: Arc<LockConfig>,
}

impl LockLayer {
    /// A layer locking on the key `key` finds, on `locker`'s backend. Defaults: lease TTL 30 s
    /// (renewed), no waiting, every method, no key prefix, missing key → 400.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_core::{LockOptions, Locker};
    /// use lock_tower::{KeyExtractor, LockLayer};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let locker = Locker::memory();
    /// let mut app: Router = Router::new()
    ///     .route("/accounts/{id}/withdraw", post(|| async { "withdrawn" }))
    ///     .route_layer(LockLayer::new(locker.clone(), KeyExtractor::route_param("id")));
    /// let withdraw = || http::Request::post("/accounts/7/withdraw").body(Body::empty());
    /// assert_eq!(app.call(withdraw()?).await?.status(), 200);
    ///
    /// // While another process (here, the same locker) holds account 7: 409, and when to retry.
    /// let held = locker.try_acquire("7", &LockOptions::new()).await?;
    /// let res = app.call(withdraw()?).await?;
    /// assert_eq!(res.status(), 409);
    /// assert!(res.headers().contains_key("retry-after"));
    /// held.release().await?;
    /// assert_eq!(app.call(withdraw()?).await?.status(), 200);
    /// # Ok(()) }
    /// ```
    pub fn new(locker: Locker, key: KeyExtractor) -> LockLayer {
        LockLayer {
            cfg: Arc::new(LockConfig {
                locker,
                key,
                prefix: String::new(),
                prefix_problem: None,
                opts: LockOptions::new(),
                wait: false,
                methods: None,
                pass_unkeyed: false,
                body_limit: DEFAULT_KEY_BODY_LIMIT,
                rejections: Rejections::default(),
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut LockConfig)) -> Self {
        f(Arc::make_mut(&mut self.cfg));
        self
    }

    /// Text put before every extracted key, so two layers on one backend do not share locks by
    /// accident (`"withdraw:"` + `"7"` → lock `withdraw:7`).
    ///
    /// The prefix follows lock-core's rules for keys (no `{`, `}` or control characters, and
    /// room left under `MAX_KEY_LEN`); one that breaks them makes every request a 500
    /// ([`Reason::Misconfigured`]), logged at `error`.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_core::{LockOptions, Locker};
    /// use lock_tower::{KeyExtractor, LockLayer};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let locker = Locker::memory();
    /// let layer = LockLayer::new(locker.clone(), KeyExtractor::route_param("id"))
    ///     .key_prefix("account:");
    /// let mut app: Router = Router::new()
    ///     .route("/accounts/{id}/withdraw", post(|| async { "withdrawn" }))
    ///     .route_layer(layer);
    ///
    /// // A batch job outside HTTP locks the same account under its full name.
    /// let _job = locker.try_acquire("account:7", &LockOptions::new()).await?;
    /// let res = app.call(http::Request::post("/accounts/7/withdraw").body(Body::empty())?).await?;
    /// assert_eq!(res.status(), 409);
    /// # Ok(()) }
    /// ```
    pub fn key_prefix(self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        let problem = if prefix.contains(['{', '}']) {
            Some("the key prefix contains `{` or `}`")
        } else if prefix.chars().any(char::is_control) {
            Some("the key prefix contains a control character")
        } else if prefix.len() >= lock_core::MAX_KEY_LEN {
            Some("the key prefix leaves no room for a key under MAX_KEY_LEN")
        } else {
            None
        };
        self.with(|c| {
            c.prefix = prefix;
            c.prefix_problem = problem;
        })
    }

    /// The lease TTL (default 30 s). The lease is renewed at about a third of it while the
    /// request runs, so this only bounds how long a crashed process keeps the key. From
    /// lock-core's `MIN_TTL` to `MAX_TTL` (10 ms to 24 h); out of that range every request is
    /// answered 500 ([`Reason::Misconfigured`]).
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::{KeyExtractor, LockLayer};
    /// use std::time::Duration;
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::path_segment(0));
    /// // Below lock-core's MIN_TTL: a setup error, answered 500 before the handler runs.
    /// let ttls = [(Duration::from_secs(10), 200), (Duration::from_millis(1), 500)];
    /// for (ttl, status) in ttls {
    ///     let mut app: Router = Router::new()
    ///         .route("/reports", post(|| async { "done" }))
    ///         .layer(layer.clone().ttl(ttl));
    ///     let res = app.call(http::Request::post("/reports").body(Body::empty())?).await?;
    ///     assert_eq!(res.status(), status);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn ttl(self, ttl: Duration) -> Self {
        self.with(|c| c.opts = c.opts.clone().ttl(ttl))
    }

    /// Wait up to `deadline` for a held key instead of answering 409 at once; after the
    /// deadline the answer is [`Reason::WaitTimeout`] (409 by default, 503 is a common choice).
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_core::{LockOptions, Locker};
    /// use lock_tower::{KeyExtractor, LockLayer};
    /// use std::time::Duration;
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let locker = Locker::memory();
    /// let layer = LockLayer::new(locker.clone(), KeyExtractor::route_param("id"))
    ///     .wait(Duration::from_secs(5));
    /// let mut app: Router = Router::new()
    ///     .route("/accounts/{id}/withdraw", post(|| async { "withdrawn" }))
    ///     .route_layer(layer);
    ///
    /// let held = locker.try_acquire("7", &LockOptions::new()).await?;
    /// tokio::spawn(async move {
    ///     tokio::time::sleep(Duration::from_millis(50)).await;
    ///     held.release().await
    /// });
    /// // Waits for the holder instead of answering 409.
    /// let res = app.call(http::Request::post("/accounts/7/withdraw").body(Body::empty())?).await?;
    /// assert_eq!(res.status(), 200);
    /// # Ok(()) }
    /// ```
    pub fn wait(self, deadline: Duration) -> Self {
        self.with(|c| {
            c.wait = true;
            c.opts = c.opts.clone().wait(deadline);
        })
    }

    /// Lock only requests with these methods (for example POST, PUT, PATCH, DELETE); others
    /// pass through unlocked. Default: every method. GET covers HEAD, which axum answers
    /// with the GET handler. An empty list would lock nothing: every request is then answered
    /// 500 ([`Reason::Misconfigured`]), logged at `error`.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::get};
    /// use http::Method;
    /// use lock_core::{LockOptions, Locker};
    /// use lock_tower::{KeyExtractor, LockLayer};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let locker = Locker::memory();
    /// let layer = LockLayer::new(locker.clone(), KeyExtractor::route_param("id"))
    ///     .methods([Method::POST, Method::DELETE]);
    /// let mut app: Router = Router::new()
    ///     .route("/accounts/{id}", get(|| async { "balance" }).post(|| async { "updated" }))
    ///     .route_layer(layer);
    ///
    /// // Reads do not queue behind a writer.
    /// let _held = locker.try_acquire("7", &LockOptions::new()).await?;
    /// for (method, status) in [(Method::GET, 200), (Method::POST, 409)] {
    ///     let req = http::Request::builder().method(method).uri("/accounts/7");
    ///     assert_eq!(app.call(req.body(Body::empty())?).await?.status(), status);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.with(|c| c.methods = Some(methods))
    }

    /// Let requests without a key through, unlocked, instead of answering 400. A key that is
    /// present but invalid is still refused.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::{KeyExtractor, LockLayer};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let account = KeyExtractor::header(http::HeaderName::from_static("x-account"));
    /// let layer = LockLayer::new(lock_core::Locker::memory(), account).pass_through_without_key();
    /// let mut app: Router = Router::new()
    ///     .route("/quotes", post(|| async { "quoted" }))
    ///     .layer(layer);
    ///
    /// let res = app.call(http::Request::post("/quotes").body(Body::empty())?).await?;
    /// assert_eq!(res.status(), 200);
    /// // Braces are not allowed in a key: the request named one, just not a usable one.
    /// let req = http::Request::post("/quotes").header("x-account", "{7}");
    /// assert_eq!(app.call(req.body(Body::empty())?).await?.status(), 400);
    /// # Ok(()) }
    /// ```
    pub fn pass_through_without_key(self) -> Self {
        self.with(|c| c.pass_unkeyed = true)
    }

    /// The most the layer reads of a request body to find a JSON key (default 64 KiB); above it
    /// the answer is [`Reason::BodyTooLarge`] (413). Unused for other key sources. With a
    /// JSON-body key, 0 leaves no room for the key: every request is answered 500
    /// ([`Reason::Misconfigured`]), logged at `error`.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::{KeyExtractor, LockLayer};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// // Transfer requests are small; refuse anything bigger before reading all of it.
    /// let account = KeyExtractor::json_field("/account");
    /// let layer = LockLayer::new(lock_core::Locker::memory(), account).body_limit(1024);
    /// let mut app: Router = Router::new()
    ///     .route("/transfers", post(|| async { "sent" }))
    ///     .layer(layer);
    ///
    /// let body = format!(r#"{{"account": 7, "memo": "{}"}}"#, "x".repeat(1024));
    /// let res = app.call(http::Request::post("/transfers").body(Body::from(body))?).await?;
    /// assert_eq!(res.status(), 413);
    /// # Ok(()) }
    /// ```
    pub fn body_limit(self, bytes: usize) -> Self {
        self.with(|c| c.body_limit = bytes)
    }

    /// The status to answer with for `reason`. It must be an error status (4xx or 5xx): a
    /// refusal answered as a success would tell the client its request ran, so with any other
    /// status those refusals are answered 500 ([`Reason::Misconfigured`]), logged at `error`.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use http::StatusCode;
    /// use lock_core::{LockOptions, Locker};
    /// use lock_tower::{KeyExtractor, LockLayer, Reason};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let locker = Locker::memory();
    /// let layer = LockLayer::new(locker.clone(), KeyExtractor::route_param("id"))
    ///     .reject_status(Reason::Busy, StatusCode::TOO_MANY_REQUESTS);
    /// let mut app: Router = Router::new()
    ///     .route("/accounts/{id}/withdraw", post(|| async { "withdrawn" }))
    ///     .route_layer(layer);
    ///
    /// let _held = locker.try_acquire("7", &LockOptions::new()).await?;
    /// let res = app.call(http::Request::post("/accounts/7/withdraw").body(Body::empty())?).await?;
    /// assert_eq!(res.status(), 429);
    /// assert!(res.headers().contains_key("retry-after"));
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
    /// use lock_tower::{KeyExtractor, LockLayer};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let account = KeyExtractor::header(http::HeaderName::from_static("x-account"));
    /// let layer = LockLayer::new(lock_core::Locker::memory(), account).rejection_response(|r| {
    ///     // The API's own error shape instead of problem+json.
    ///     let body = serde_json::json!({ "error": r.detail() }).to_string();
    ///     let mut res = http::Response::new(body.into());
    ///     *res.status_mut() = r.status();
    ///     res
    /// });
    /// let mut app: Router = Router::new()
    ///     .route("/transfers", post(|| async { "sent" }))
    ///     .layer(layer);
    ///
    /// let res = app.call(http::Request::post("/transfers").body(Body::empty())?).await?;
    /// assert_eq!(res.status(), 400);
    /// let body = axum::body::to_bytes(res.into_body(), 1024).await?;
    /// let error: serde_json::Value = serde_json::from_slice(&body)?;
    /// assert!(error["error"].is_string());
    /// # Ok(()) }
    /// ```
    pub fn rejection_response(
        self,
        f: impl Fn(&Rejection) -> Response<Full<Bytes>> + Send + Sync + 'static,
    ) -> Self {
        self.with(|c| c.rejections.set_responder(f))
    }
}

impl<S> Layer<S> for LockLayer {
    type Service = Lock<S>;

    fn layer(&self, inner: S) -> Lock<S> {
        Lock {
            inner,
            cfg: self.cfg.clone(),
        }
    }
}
