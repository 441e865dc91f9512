//! Rejections: the responses both layers give instead of running the handler.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::Full;

/// Why a layer answered a request itself instead of running the handler.
///
/// ```
/// use lock_tower::Reason;
///
/// // The reasons whose rejections say when to come back (`Retry-After`; `Unavailable` has
/// // none for a key whose fence is exhausted). `Reason` is `#[non_exhaustive]`, so a match
/// // needs a catch-all arm.
/// fn come_back_later(reason: Reason) -> bool {
///     match reason {
///         Reason::Busy | Reason::WaitTimeout | Reason::Unavailable => true,
///         _ => false,
///     }
/// }
///
/// assert!(come_back_later(Reason::Busy));
/// assert!(!come_back_later(Reason::KeyReused));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// No key could be extracted from the request (default 400).
    MissingKey,
    /// The extracted key is not acceptable (empty, too long, forbidden characters; default 400).
    InvalidKey,
    /// The request body was larger than the layer's cap while the layer had to read it
    /// (default 413).
    BodyTooLarge,
    /// Another request holds the key (default 409, with `Retry-After`).
    Busy,
    /// The layer waited for the key up to its deadline and the key stayed held (default 409,
    /// with `Retry-After`).
    WaitTimeout,
    /// The lease was lost while the handler ran; the handler was cancelled (default 503).
    LeaseLost,
    /// The lock backend could not be reached (default 503, with `Retry-After`), or can never
    /// lock this key (its stored fence is 2^64 - 1, `Error::FenceExhausted`, or the key holds
    /// a value of another type, `Error::WrongType`: 503 without `Retry-After`, logged at
    /// `error`), or (dedupe) a stored result changed from outside cannot be read (the same:
    /// 503 without `Retry-After`, logged at `error`).
    Unavailable,
    /// Dedupe only: the key was seen before with a different request (method, path or body;
    /// default 422).
    KeyReused,
    /// The layer's own settings are out of range or cannot work (a TTL below `MIN_TTL` or above
    /// `MAX_TTL`, a retention below 1 ms or above a year, a `LockLayer` key prefix no key can
    /// follow, an empty methods list, a body limit of 0 with a JSON-body key, a route parameter
    /// the route does not have, a `reject_status` that is not an error status), or a
    /// `DedupeLayer` runs on a backend with no
    /// result store (a Redlock quorum): every request would fail the same way, so this is a
    /// server error (default 500, no `Retry-After`), logged at `error` level.
    Misconfigured,
    /// The request body could not be read while the layer had to read it (the client broke
    /// off mid-body, or a body layer below failed; default 400).
    BodyUnreadable,
    /// Dedupe only: the handler's response body failed while the layer read it to store it;
    /// nothing was stored and the claim was released, so a retry runs the handler again
    /// (default 500).
    ResponseFailed,
}

impl Reason {
    /// The status a layer answers with unless configured otherwise.
    ///
    /// ```
    /// use http::StatusCode;
    /// use lock_tower::Reason;
    ///
    /// assert_eq!(Reason::MissingKey.default_status(), StatusCode::BAD_REQUEST);
    /// assert_eq!(Reason::BodyTooLarge.default_status(), StatusCode::PAYLOAD_TOO_LARGE);
    /// assert_eq!(Reason::Busy.default_status(), StatusCode::CONFLICT);
    /// assert_eq!(Reason::KeyReused.default_status(), StatusCode::UNPROCESSABLE_ENTITY);
    /// assert_eq!(Reason::Unavailable.default_status(), StatusCode::SERVICE_UNAVAILABLE);
    /// assert_eq!(Reason::Misconfigured.default_status(), StatusCode::INTERNAL_SERVER_ERROR);
    /// ```
    pub fn default_status(self) -> StatusCode {
        match self {
            Reason::MissingKey | Reason::InvalidKey | Reason::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            Reason::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Reason::Busy | Reason::WaitTimeout => StatusCode::CONFLICT,
            Reason::LeaseLost | Reason::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Reason::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Reason::Misconfigured | Reason::ResponseFailed => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn title(self) -> &'static str {
        match self {
            Reason::MissingKey => "Missing key",
            Reason::InvalidKey => "Invalid key",
            Reason::BodyTooLarge => "Request body too large",
            Reason::Busy => "Resource is locked",
            Reason::WaitTimeout => "Timed out waiting for the lock",
            Reason::LeaseLost => "Lock lost while handling the request",
            Reason::Unavailable => "Lock service unavailable",
            Reason::KeyReused => "Idempotency key reused with a different request",
            Reason::Misconfigured => "Lock layer misconfigured",
            Reason::BodyUnreadable => "Request body could not be read",
            Reason::ResponseFailed => "Response body failed",
        }
    }

    fn slug(self) -> &'static str {
        match self {
            Reason::MissingKey => "missing-key",
            Reason::InvalidKey => "invalid-key",
            Reason::BodyTooLarge => "body-too-large",
            Reason::Busy => "busy",
            Reason::WaitTimeout => "wait-timeout",
            Reason::LeaseLost => "lease-lost",
            Reason::Unavailable => "unavailable",
            Reason::KeyReused => "key-reused",
            Reason::Misconfigured => "misconfigured",
            Reason::BodyUnreadable => "body-unreadable",
            Reason::ResponseFailed => "response-failed",
        }
    }

    const ALL: usize = 11;

    fn index(self) -> usize {
        match self {
            Reason::MissingKey => 0,
            Reason::InvalidKey => 1,
            Reason::BodyTooLarge => 2,
            Reason::Busy => 3,
            Reason::WaitTimeout => 4,
            Reason::LeaseLost => 5,
            Reason::Unavailable => 6,
            Reason::KeyReused => 7,
            Reason::Misconfigured => 8,
            Reason::BodyUnreadable => 9,
            Reason::ResponseFailed => 10,
        }
    }
}

/// One rejection, as handed to a custom responder (see `rejection_response` on the layers).
///
/// ```
/// use axum::{Router, body::Body, routing::post};
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use lock_tower::{KeyExtractor, LockLayer, Rejection};
/// use tower_service::Service;
///
/// // Plain text, for clients that do not read problem+json.
/// fn plain(r: &Rejection) -> http::Response<Full<Bytes>> {
///     let mut res = http::Response::new(Full::from(format!("{:?}: {}", r.reason(), r.detail())));
///     *res.status_mut() = r.status();
///     res
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_tower::BoxError> {
/// let account = KeyExtractor::header(http::HeaderName::from_static("x-account"));
/// let layer = LockLayer::new(lock_core::Locker::memory(), account).rejection_response(plain);
/// let mut app: Router = Router::new().route("/transfers", post(|| async { "sent" })).layer(layer);
///
/// let res = app.call(http::Request::post("/transfers").body(Body::empty())?).await?;
/// assert_eq!(res.status(), 400);
/// assert!(axum::body::to_bytes(res.into_body(), 1024).await?.starts_with(b"MissingKey: "));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Rejection {
    reason: Reason,
    status: StatusCode,
    retry_after: Option<Duration>,
    detail: String,
}

impl Rejection {
    /// Why the request was rejected.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use http::HeaderValue;
    /// use lock_tower::{DedupeLayer, Reason};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let layer = DedupeLayer::new(lock_core::Locker::memory()).rejection_response(|r| {
    ///     let mut res = r.problem_response();
    ///     // Tell API clients what they forgot; keep the default for everything else.
    ///     if r.reason() == Reason::MissingKey {
    ///         let help = HeaderValue::from_static("</docs/idempotency>; rel=\"help\"");
    ///         res.headers_mut().insert(http::header::LINK, help);
    ///     }
    ///     res
    /// });
    /// let mut app: Router = Router::new()
    ///     .route("/orders", post(|| async { "created" }))
    ///     .layer(layer);
    ///
    /// let res = app.call(http::Request::post("/orders").body(Body::empty())?).await?;
    /// assert_eq!(res.status(), 400);
    /// assert!(res.headers().contains_key("link"));
    /// # Ok(()) }
    /// ```
    pub fn reason(&self) -> Reason {
        self.reason
    }
    /// The status configured for this reason.
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
    /// let layer = LockLayer::new(locker.clone(), KeyExtractor::path_segment(1))
    ///     .reject_status(Reason::Busy, StatusCode::TOO_MANY_REQUESTS)
    ///     // The responder sees the configured status, not the default 409.
    ///     .rejection_response(|r| {
    ///         let text = r.status().canonical_reason().unwrap_or("rejected");
    ///         let mut res = http::Response::new(text.into());
    ///         *res.status_mut() = r.status();
    ///         res
    ///     });
    /// let mut app: Router = Router::new()
    ///     .route("/jobs/{id}", post(|| async { "ran" }))
    ///     .layer(layer);
    ///
    /// let _held = locker.try_acquire("nightly", &LockOptions::new()).await?;
    /// let res = app.call(http::Request::post("/jobs/nightly").body(Body::empty())?).await?;
    /// assert_eq!(res.status(), 429);
    /// assert_eq!(axum::body::to_bytes(res.into_body(), 1024).await?, "Too Many Requests");
    /// # Ok(()) }
    /// ```
    pub fn status(&self) -> StatusCode {
        self.status
    }
    /// When the client may usefully try again, for `Busy`, `WaitTimeout` and `Unavailable`
    /// (but not for a key whose fence is exhausted or that holds a value of another type,
    /// which no retry can lock, nor for an unreadable stored result).
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
    /// let layer = LockLayer::new(locker.clone(), KeyExtractor::path_segment(1))
    ///     .rejection_response(|r| {
    ///         let mut res = r.problem_response();
    ///         // `Retry-After` is in whole seconds; some clients want it finer.
    ///         if let Some(after) = r.retry_after() {
    ///             res.headers_mut().insert("retry-after-ms", (after.as_millis() as u64).into());
    ///         }
    ///         res
    ///     });
    /// let mut app: Router = Router::new()
    ///     .route("/jobs/{id}", post(|| async { "ran" }))
    ///     .layer(layer);
    ///
    /// let opts = LockOptions::new().ttl(Duration::from_secs(20));
    /// let _held = locker.try_acquire("nightly", &opts).await?;
    /// let res = app.call(http::Request::post("/jobs/nightly").body(Body::empty())?).await?;
    /// let ms: u64 = res.headers()["retry-after-ms"].to_str()?.parse()?;
    /// assert!(0 < ms && ms <= 20_000);
    /// # Ok(()) }
    /// ```
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }
    /// A human-readable explanation.
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
    ///     let mut res = http::Response::new(r.detail().to_owned().into());
    ///     *res.status_mut() = r.status();
    ///     res
    /// });
    /// let mut app: Router = Router::new()
    ///     .route("/transfers", post(|| async { "sent" }))
    ///     .layer(layer);
    ///
    /// let res = app.call(http::Request::post("/transfers").body(Body::empty())?).await?;
    /// let detail = axum::body::to_bytes(res.into_body(), 1024).await?;
    /// assert!(std::str::from_utf8(&detail)?.contains("x-account"));
    /// # Ok(()) }
    /// ```
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The default answer: an RFC 9457 `application/problem+json` body, with `Retry-After` (in
    /// whole seconds, rounded up) where the rejection has one.
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
    ///     // The default answer, plus a header of the API's own.
    ///     let mut res = r.problem_response();
    ///     res.headers_mut().insert("cache-control", http::HeaderValue::from_static("no-store"));
    ///     res
    /// });
    /// let mut app: Router = Router::new()
    ///     .route("/transfers", post(|| async { "sent" }))
    ///     .layer(layer);
    ///
    /// let res = app.call(http::Request::post("/transfers").body(Body::empty())?).await?;
    /// assert_eq!(res.headers()["content-type"], "application/problem+json");
    /// assert_eq!(res.headers()["cache-control"], "no-store");
    /// let problem: serde_json::Value =
    ///     serde_json::from_slice(&axum::body::to_bytes(res.into_body(), 4096).await?)?;
    /// assert_eq!(problem["type"], "urn:leasehold:problem:missing-key");
    /// assert_eq!(problem["status"], 400);
    /// # Ok(()) }
    /// ```
    pub fn problem_response(&self) -> Response<Full<Bytes>> {
        let body = serde_json::json!({
            "type": format!("urn:leasehold:problem:{}", self.reason.slug()),
            "title": self.reason.title(),
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        let mut res = Response::new(Full::new(Bytes::from(body.to_string())));
        *res.status_mut() = self.status;
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = self.retry_after {
            res.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        res
    }
}

/// Whole seconds, rounded up, at least 1: `Retry-After: 0` would invite a hot retry loop.
pub(crate) fn retry_after_secs(d: Duration) -> u64 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    secs.max(1)
}

type Responder = dyn Fn(&Rejection) -> Response<Full<Bytes>> + Send + Sync;

/// The status per reason and the responder, shared by a layer's services.
#[derive(Clone)]
pub(crate) struct Rejections {
    statuses: [Option<StatusCode>; Reason::ALL],
    responder: Option<Arc<Responder>>,
    pub(crate) setup_logged: SetupLogged,
}

impl Default for Rejections {
    fn default() -> Self {
        Rejections {
            statuses: [None; Reason::ALL],
            responder: None,
            setup_logged: SetupLogged::default(),
        }
    }
}

/// Whether a layer has logged its setup problem yet. Every request through a misconfigured
/// layer fails the same way, so the first is logged as an error and the rest at `debug`: one
/// line for the operator, not one per request. A clone (a builder changed further) starts
/// afresh, since its settings, and so its problem, may differ.
#[derive(Default)]
pub(crate) struct SetupLogged(AtomicBool);

impl Clone for SetupLogged {
    fn clone(&self) -> Self {
        SetupLogged::default()
    }
}

impl SetupLogged {
    /// Logs `problem` (what is wrong) with `detail`: at `error` the first time, at `debug` after.
    pub(crate) fn log(&self, problem: &str, detail: &dyn fmt::Display) {
        if self.0.swap(true, Ordering::Relaxed) {
            tracing::debug!(%detail, "{problem}");
        } else {
            tracing::error!(
                %detail,
                "{problem}; every request it applies to is answered 500 (logged once per layer)"
            );
        }
    }
}

impl fmt::Debug for Rejections {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rejections")
            .field("statuses", &self.statuses)
            .field("custom_responder", &self.responder.is_some())
            .finish()
    }
}

impl Rejections {
    pub(crate) fn set_status(&mut self, reason: Reason, status: StatusCode) {
        self.statuses[reason.index()] = Some(status);
    }

    pub(crate) fn set_responder(
        &mut self,
        f: impl Fn(&Rejection) -> Response<Full<Bytes>> + Send + Sync + 'static,
    ) {
        self.responder = Some(Arc::new(f));
    }

    pub(crate) fn respond(
        &self,
        reason: Reason,
        retry_after: Option<Duration>,
        detail: impl Into<String>,
    ) -> Response<Full<Bytes>> {
        let status = self.statuses[reason.index()].unwrap_or_else(|| reason.default_status());
        let rejection = if status.is_client_error() || status.is_server_error() {
            Rejection {
                reason,
                status,
                retry_after,
                detail: detail.into(),
            }
        } else {
            // A refusal sent as a success (or a redirect, or a bodiless 204/304) would tell the
            // client its request ran when it did not: the layer's setup is at fault.
            let detail = format!(
                "the status set for {reason:?} rejections, {status}, is not an error status"
            );
            self.setup_logged.log("the layer is misconfigured", &detail);
            Rejection {
                reason: Reason::Misconfigured,
                status: StatusCode::INTERNAL_SERVER_ERROR,
                retry_after: None,
                detail,
            }
        };
        tracing::debug!(reason = ?reason, status = rejection.status.as_u16(), detail = %rejection.detail, "rejected");
        match &self.responder {
            Some(f) => {
                let mut res = f(&rejection);
                // A refusal answered as a success would tell the client its request ran, and a
                // `DedupeLayer` outside would store it as the request's answer: a responder
                // that leaves the status as it found it (200) gets the rejection's.
                if !(res.status().is_client_error() || res.status().is_server_error()) {
                    *res.status_mut() = rejection.status;
                }
                // Senders' retries and a `DedupeLayer` outside (which stores a 4xx without it as
                // the request's final answer) count on it, whatever body the responder chose.
                if let Some(after) = rejection.retry_after
                    && !res.headers().contains_key(RETRY_AFTER)
                {
                    res.headers_mut()
                        .insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
                }
                res
            }
            None => rejection.problem_response(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1_001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(30)), 30);
    }

    #[test]
    fn statuses_are_configurable() {
        let mut r = Rejections::default();
        assert_eq!(
            r.respond(Reason::Busy, None, "x").status(),
            StatusCode::CONFLICT
        );
        r.set_status(Reason::Busy, StatusCode::TOO_MANY_REQUESTS);
        let res = r.respond(Reason::Busy, Some(Duration::from_millis(1500)), "x");
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(res.headers()[RETRY_AFTER], "2");
        assert_eq!(res.headers()[CONTENT_TYPE], "application/problem+json");
    }

    #[test]
    fn a_responder_keeps_retry_after() {
        let mut r = Rejections::default();
        r.set_responder(|rej| {
            let mut res = Response::new(Full::new(Bytes::from_static(b"{}")));
            *res.status_mut() = rej.status();
            res
        });
        let res = r.respond(Reason::Busy, Some(Duration::from_millis(2_500)), "x");
        assert_eq!(res.headers()[RETRY_AFTER], "3");
        assert!(
            !r.respond(Reason::MissingKey, None, "x")
                .headers()
                .contains_key(RETRY_AFTER)
        );
        // One the responder sets is its own.
        r.set_responder(|rej| {
            let mut res = Response::new(Full::new(Bytes::new()));
            *res.status_mut() = rej.status();
            res.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("60"));
            res
        });
        let res = r.respond(Reason::Busy, Some(Duration::from_secs(2)), "x");
        assert_eq!(res.headers()[RETRY_AFTER], "60");
    }

    #[test]
    fn a_status_that_is_not_an_error_is_refused() {
        for status in [StatusCode::OK, StatusCode::NO_CONTENT, StatusCode::FOUND] {
            let mut r = Rejections::default();
            r.set_status(Reason::Busy, status);
            let res = r.respond(Reason::Busy, Some(Duration::from_secs(3)), "x");
            assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR, "{status}");
            assert!(!res.headers().contains_key(RETRY_AFTER));
            // Only the reason set wrong is affected.
            assert_eq!(r.respond(Reason::MissingKey, None, "x").status(), 400);
        }
    }
}
