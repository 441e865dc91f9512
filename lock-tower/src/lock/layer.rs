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
    pub(crate) fn applies_to(&self, method: &Method) -> bool {
        self.methods.as_ref().is_none_or(|m| m.contains(method))
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
/// | the layer's [`ttl`](Self::ttl) out of range (below `MIN_TTL`, above `MAX_TTL`), or a [`key_prefix`](Self::key_prefix) no key can follow | 500 ([`Reason::Misconfigured`]), logged at `error` |
///
/// Every status is configurable ([`reject_status`](Self::reject_status)); bodies are
/// `application/problem+json` unless a [`rejection_response`](Self::rejection_response) is set.
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
    pub fn ttl(self, ttl: Duration) -> Self {
        self.with(|c| c.opts = c.opts.clone().ttl(ttl))
    }

    /// Wait up to `deadline` for a held key instead of answering 409 at once; after the
    /// deadline the answer is [`Reason::WaitTimeout`] (409 by default, 503 is a common choice).
    pub fn wait(self, deadline: Duration) -> Self {
        self.with(|c| {
            c.wait = true;
            c.opts = c.opts.clone().wait(deadline);
        })
    }

    /// Lock only requests with these methods (for example POST, PUT, PATCH, DELETE); others
    /// pass through unlocked. Default: every method.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.with(|c| c.methods = Some(methods))
    }

    /// Let requests without a key through, unlocked, instead of answering 400. A key that is
    /// present but invalid is still refused.
    pub fn pass_through_without_key(self) -> Self {
        self.with(|c| c.pass_unkeyed = true)
    }

    /// The most the layer reads of a request body to find a JSON key (default 64 KiB); above it
    /// the answer is [`Reason::BodyTooLarge`] (413). Unused for other key sources.
    pub fn body_limit(self, bytes: usize) -> Self {
        self.with(|c| c.body_limit = bytes)
    }

    /// The status to answer with for `reason`.
    pub fn reject_status(self, reason: Reason, status: StatusCode) -> Self {
        self.with(|c| c.rejections.set_status(reason, status))
    }

    /// Build rejection responses with `f` instead of the default problem+json body.
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
