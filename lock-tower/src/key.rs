//! Where a layer finds the key of a request.

use std::fmt;
use std::sync::Arc;

use axum::extract::RawPathParams;
use axum::extract::rejection::RawPathParamsRejection;
use axum_core::extract::FromRequestParts;
use bytes::Bytes;
use http::HeaderName;
use http::request::Parts;

use crate::reject::Reason;

/// Longest `Idempotency-Key` accepted, the common limit among senders and servers.
///
/// ```
/// use axum::{Router, body::Body, routing::post};
/// use lock_tower::{DedupeLayer, MAX_IDEMPOTENCY_KEY_LEN};
/// use tower_service::Service;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_tower::BoxError> {
/// let mut app: Router = Router::new()
///     .route("/orders", post(|| async { "created" }))
///     .layer(DedupeLayer::new(lock_core::Locker::memory()));
/// for (len, status) in [(MAX_IDEMPOTENCY_KEY_LEN, 200), (MAX_IDEMPOTENCY_KEY_LEN + 1, 400)] {
///     let req = http::Request::post("/orders")
///         .header("idempotency-key", "k".repeat(len))
///         .body(Body::empty())?;
///     assert_eq!(app.call(req).await?.status(), status);
/// }
/// # Ok(()) }
/// ```
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

type KeyFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

#[derive(Clone)]
enum Source {
    PathSegment(usize),
    RouteParam(Arc<str>),
    Header(HeaderName),
    IdempotencyKey,
    WebhookId,
    GithubDelivery,
    Json(Arc<str>),
    Fn(Arc<KeyFn>),
}

/// Where a layer reads the key of a request from.
///
/// ```
/// use lock_tower::KeyExtractor;
/// let by_account = KeyExtractor::route_param("id");
/// let by_header = KeyExtractor::header(http::HeaderName::from_static("x-account"));
/// let by_event = KeyExtractor::json_field("/id");
/// let custom = KeyExtractor::from_fn(|parts| parts.uri.query().map(str::to_owned));
/// # let _ = (by_account, by_header, by_event, custom);
/// ```
#[derive(Clone)]
pub struct KeyExtractor {
    source: Source,
}

impl fmt::Debug for KeyExtractor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match &self.source {
            Source::PathSegment(i) => format!("path segment {i}"),
            Source::RouteParam(p) => format!("route parameter `{p}`"),
            Source::Header(h) => format!("header `{h}`"),
            Source::IdempotencyKey => "Idempotency-Key header".to_owned(),
            Source::WebhookId => "webhook-id / svix-id header".to_owned(),
            Source::GithubDelivery => {
                "X-GitHub-Delivery header, scoped by path and query".to_owned()
            }
            Source::Json(p) => format!("JSON body field `{p}`"),
            Source::Fn(_) => "closure".to_owned(),
        };
        f.debug_tuple("KeyExtractor").field(&what).finish()
    }
}

/// Why no key came out of a request.
pub(crate) struct KeyProblem {
    pub(crate) reason: Reason,
    pub(crate) detail: String,
    /// Missing because of the route, not the request (the route has no parameter of the
    /// extractor's name): every request to it would miss the key the same way, so the layer's
    /// setup is at fault, not the client. Still a missing key where the user chose to pass
    /// those through (one layer over routes with and without the parameter).
    pub(crate) by_route: bool,
}

impl KeyProblem {
    /// The reason to answer with when the request is refused: a key the route cannot carry is
    /// the layer's fault (500, logged once per layer), not the client's (400).
    pub(crate) fn refusal(&self, rejections: &crate::reject::Rejections) -> Reason {
        if self.by_route {
            rejections.setup_logged.log(
                "the layer's route parameter is not in the route",
                &self.detail,
            );
            Reason::Misconfigured
        } else {
            self.reason
        }
    }
}

fn missing(detail: impl Into<String>) -> KeyProblem {
    KeyProblem {
        reason: Reason::MissingKey,
        detail: detail.into(),
        by_route: false,
    }
}

fn invalid(detail: impl Into<String>) -> KeyProblem {
    KeyProblem {
        reason: Reason::InvalidKey,
        detail: detail.into(),
        by_route: false,
    }
}

impl KeyExtractor {
    /// The `index`-th segment of the request path, counting from 0 after the leading `/` and
    /// counting empty segments as axum's router does (an empty one is no key), percent-decoded
    /// as axum's router decodes it. For `/accounts/7/withdraw` and `/accounts/%37/withdraw`,
    /// segment 1 is `7`; a segment that is not UTF-8 once decoded is an invalid key (400). Works with any Tower
    /// server and with `Router::layer` as well as `route_layer`.
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
    ///     // Read before routing, so `Router::layer` works too.
    ///     .layer(LockLayer::new(locker.clone(), KeyExtractor::path_segment(1)));
    ///
    /// let _held = locker.try_acquire("7", &LockOptions::new()).await?;
    /// // `%37` is `7` to the handler, so it must be the same lock.
    /// let req = http::Request::post("/accounts/%37/withdraw").body(Body::empty())?;
    /// assert_eq!(app.call(req).await?.status(), 409);
    /// # Ok(()) }
    /// ```
    pub fn path_segment(index: usize) -> KeyExtractor {
        KeyExtractor {
            source: Source::PathSegment(index),
        }
    }

    /// A parameter of the matched axum route (`/accounts/{id}/withdraw` → `id`),
    /// percent-decoded; a parameter that is not UTF-8 once decoded is an invalid key (400, also
    /// with `pass_through_without_key`). A route without a parameter of that name (a typo, or
    /// a layer over routes of which only some have it) fails every request the same way, so
    /// it is the layer's setup at fault: 500 ([`Reason::Misconfigured`]), logged at `error`,
    /// unless `pass_through_without_key` lets such requests through unlocked. Add the layer
    /// with `route_layer` (or to the `MethodRouter`): `Router::layer` also wraps the router's
    /// fallback, where no route matched and there is no parameter, so an unknown path would
    /// get the layer's 500 instead of axum's 404.
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
    ///
    /// let _held = locker.try_acquire("7", &LockOptions::new()).await?;
    /// for (path, status) in [("/accounts/7/withdraw", 409), ("/accounts/8/withdraw", 200)] {
    ///     let req = http::Request::post(path).body(Body::empty())?;
    ///     assert_eq!(app.call(req).await?.status(), status);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn route_param(name: &str) -> KeyExtractor {
        KeyExtractor {
            source: Source::RouteParam(name.into()),
        }
    }

    /// The value of a header, which must be visible ASCII; an empty or blank value (only
    /// whitespace, trimmed away) counts as absent. A header sent more than once is an invalid
    /// key (400, even with `pass_through_without_key`): the layer would lock on one value while
    /// the handler may read another. The same holds for the other header extractors.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use http::HeaderName;
    /// use lock_tower::{KeyExtractor, LockLayer};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let account = KeyExtractor::header(HeaderName::from_static("x-account"));
    /// let mut app: Router = Router::new()
    ///     .route("/transfers", post(|| async { "sent" }))
    ///     .layer(LockLayer::new(lock_core::Locker::memory(), account));
    ///
    /// // A blank value would give every such request one shared key, so it is no key (400).
    /// for (value, status) in [("7", 200), ("  ", 400)] {
    ///     let req = http::Request::post("/transfers").header("x-account", value);
    ///     assert_eq!(app.call(req.body(Body::empty())?).await?.status(), status);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn header(name: HeaderName) -> KeyExtractor {
        KeyExtractor {
            source: Source::Header(name),
        }
    }

    /// The `Idempotency-Key` header of the IETF httpapi draft. Its value is a structured-field
    /// string, so it arrives quoted (`"abc"`); the quotes and escapes are removed, and
    /// parameters after it (`"abc";v=1`) are checked and left out of the key. A bare value
    /// without quotes (as some senders use) is accepted as it is. Keys longer than
    /// [`MAX_IDEMPOTENCY_KEY_LEN`] are refused, and so are empty ones and ones of spaces alone
    /// (`""`, `"  "`), which every client sending one would share.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::{DedupeLayer, KeyExtractor};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let dedupe = DedupeLayer::new(lock_core::Locker::memory())
    ///     .key(KeyExtractor::idempotency_key());
    /// let mut app: Router = Router::new()
    ///     .route("/payments", post(|| async { "charged" }))
    ///     .layer(dedupe);
    ///
    /// // The structured-field string and the bare value name one key: the second is a replay.
    /// for (key, replayed) in [(r#""8e03978e""#, false), ("8e03978e", true)] {
    ///     let req = http::Request::post("/payments").header("idempotency-key", key);
    ///     let res = app.call(req.body(Body::empty())?).await?;
    ///     assert_eq!(res.headers().contains_key("idempotent-replayed"), replayed);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn idempotency_key() -> KeyExtractor {
        KeyExtractor {
            source: Source::IdempotencyKey,
        }
    }

    /// The delivery id of Standard Webhooks senders: the `webhook-id` header, or `svix-id`
    /// when `webhook-id` is absent or empty.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::{DedupeLayer, KeyExtractor};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let dedupe = DedupeLayer::new(lock_core::Locker::memory()).key(KeyExtractor::webhook_id());
    /// let mut app: Router = Router::new()
    ///     .route("/hooks/events", post(|| async { "handled" }))
    ///     .layer(dedupe);
    ///
    /// // Svix sends the same id as `svix-id`: one delivery, so the second is a replay.
    /// for (header, replayed) in [("webhook-id", false), ("svix-id", true)] {
    ///     let req = http::Request::post("/hooks/events").header(header, "msg_2KWPBgLlAfxd");
    ///     let res = app.call(req.body(Body::empty())?).await?;
    ///     assert_eq!(res.headers().contains_key("idempotent-replayed"), replayed);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn webhook_id() -> KeyExtractor {
        KeyExtractor {
            source: Source::WebhookId,
        }
    }

    /// GitHub's `X-GitHub-Delivery` header, scoped by the request's path and query as they
    /// arrived: GitHub sends the same delivery id to every hook that receives the event, so two
    /// hooks must not dedupe each other, and hooks on one path told apart by a query parameter
    /// (`/hooks/github?hook=ci`) are two hooks. The query is part of the scope because it is
    /// part of the request fingerprint: were it left out, the second hook would share the first
    /// one's key without ever matching its fingerprint, and get a 422. Under a `DedupeLayer` the
    /// key is hashed before it is stored; under a `LockLayer` it is the lock's name as it is, so
    /// a secret in the hook URL's query (`?token=...`) would appear in server keys and traces:
    /// keep secrets in headers.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::{DedupeLayer, KeyExtractor};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let dedupe = DedupeLayer::new(lock_core::Locker::memory())
    ///     .key(KeyExtractor::github_delivery());
    /// let mut app: Router = Router::new()
    ///     .route("/hooks/github", post(|| async { "handled" }))
    ///     .layer(dedupe);
    ///
    /// // One delivery id sent to two hooks: each handles it once.
    /// let hooks = [("?hook=ci", false), ("?hook=deploy", false), ("?hook=ci", true)];
    /// for (query, replayed) in hooks {
    ///     let req = http::Request::post(format!("/hooks/github{query}"))
    ///         .header("x-github-delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958");
    ///     let res = app.call(req.body(Body::empty())?).await?;
    ///     assert_eq!(res.headers().contains_key("idempotent-replayed"), replayed);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn github_delivery() -> KeyExtractor {
        KeyExtractor {
            source: Source::GithubDelivery,
        }
    }

    /// A field of a JSON request body, named by a JSON pointer (`/id`, `/data/object/id`); a
    /// string or a number. The layer reads the body up to its body cap and hands the same bytes
    /// on to the handler. A name without the leading `/` is a top-level field of that name
    /// (`"id"` is `/id`, and `"a/b"` the field `a/b`, not `b` inside `a`), rather than a pointer
    /// that can match nothing; `""` is the whole body (a JSON string or number).
    ///
    /// A string that is empty or only whitespace counts as absent (as an empty header does), so
    /// malformed events do not all share one key; so does an empty body. A body that is not JSON
    /// the layer can read is an invalid key (400, even with `pass_through_without_key`): the
    /// handler's own parser might still find the key in it, and must not run unlocked. So is a
    /// body whose shape the pointer does not fit (an array where it names a field, a string or
    /// number on its path): serde's derive fills a struct from an array by position, so
    /// `["7", 10]` is account 7 to a handler. An object without the field, or `null` on the
    /// path, is no key. A number is used as its decimal text, so `7`
    /// and `"7"` are one key (as a route parameter `7` and a body field `7` name one account);
    /// only whole numbers within 64 bits are keys (`7.5` or `1e30` are invalid, 400), since
    /// others are rounded when parsed and distinct ids could share a key.
    /// Keys longer than [`MAX_IDEMPOTENCY_KEY_LEN`] bytes are invalid (400).
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
    ///     .route("/transfers", post(|body: String| async move { body }))
    ///     .layer(LockLayer::new(locker.clone(), KeyExtractor::json_field("/account")));
    ///
    /// // The layer read the body, and the handler still gets it byte for byte.
    /// let req = http::Request::post("/transfers").body(Body::from(r#"{"account": 7}"#))?;
    /// let res = app.call(req).await?;
    /// assert_eq!(axum::body::to_bytes(res.into_body(), 1024).await?, r#"{"account": 7}"#);
    ///
    /// // `7` and `"7"` are one account, so one lock.
    /// let _held = locker.try_acquire("7", &LockOptions::new()).await?;
    /// let req = http::Request::post("/transfers").body(Body::from(r#"{"account": "7"}"#))?;
    /// assert_eq!(app.call(req).await?.status(), 409);
    /// # Ok(()) }
    /// ```
    pub fn json_field(pointer: &str) -> KeyExtractor {
        // `""` stays the pointer to the whole document.
        let pointer = if pointer.is_empty() || pointer.starts_with('/') {
            pointer.to_owned()
        } else {
            // RFC 6901 escapes, so that the name is one field whatever it holds.
            format!("/{}", pointer.replace('~', "~0").replace('/', "~1"))
        };
        KeyExtractor {
            source: Source::Json(pointer.into()),
        }
    }

    /// Any function of the request head; `None`, or a key that is empty or only whitespace
    /// (as an empty header is), means the request has no key.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::post};
    /// use lock_tower::{KeyExtractor, LockLayer};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// // One report run at a time per tenant, named in the query (`?tenant=acme`).
    /// let tenant = KeyExtractor::from_fn(|parts| {
    ///     let query = parts.uri.query()?;
    ///     query.split('&').find_map(|kv| kv.strip_prefix("tenant=")).map(str::to_owned)
    /// });
    /// let mut app: Router = Router::new()
    ///     .route("/reports", post(|| async { "queued" }))
    ///     .layer(LockLayer::new(lock_core::Locker::memory(), tenant));
    ///
    /// for (uri, status) in [("/reports?tenant=acme", 200), ("/reports", 400)] {
    ///     let req = http::Request::post(uri).body(Body::empty())?;
    ///     assert_eq!(app.call(req).await?.status(), status);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn from_fn(f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> KeyExtractor {
        KeyExtractor {
            source: Source::Fn(Arc::new(f)),
        }
    }

    /// Whether the key is in the body, so the layer must read it first.
    pub(crate) fn needs_body(&self) -> bool {
        matches!(self.source, Source::Json(_))
    }

    /// The key of a request; `body` is the buffered body, which only a key that
    /// [`needs_body`](Self::needs_body) reads.
    pub(crate) async fn extract(
        &self,
        parts: &mut Parts,
        body: Option<&Bytes>,
    ) -> Result<String, KeyProblem> {
        match &self.source {
            Source::PathSegment(i) => {
                // Empty segments count, as axum's router counts them: `/orgs//accounts/7`
                // routes with an empty `{org}`, and skipping it would lock another segment
                // than the account the handler acts on.
                let raw = parts
                    .uri
                    .path()
                    .split('/')
                    .skip(1)
                    .nth(*i)
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| missing(format!("the path has no segment {i}")))?;
                // Decoded as axum's router decodes it: `%37` and `7` are one account to the
                // handler, so they must be one key, or the encoded spelling slips past the lock.
                percent_encoding::percent_decode_str(raw)
                    .decode_utf8()
                    .map(|k| k.into_owned())
                    .map_err(|_| invalid(format!("path segment {i} is not UTF-8 once decoded")))
            }
            Source::RouteParam(name) => route_param(parts, name)
                .await
                .map(|k| k.as_str().to_owned()),
            Source::Header(name) => header_text(parts, name)?
                .ok_or_else(|| missing(format!("the `{name}` header is missing"))),
            Source::IdempotencyKey => {
                let raw = header_text(parts, &HeaderName::from_static("idempotency-key"))?
                    .ok_or_else(|| missing("the `Idempotency-Key` header is missing"))?;
                let key = parse_sf_string(&raw).map_err(invalid)?;
                // Spaces alone are as empty as "": as a blank header counts as none, so that
                // clients sending one do not all share one key.
                if key.trim().is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_LEN {
                    return Err(invalid(format!(
                        "the `Idempotency-Key` must have 1 to {MAX_IDEMPOTENCY_KEY_LEN} characters, \
                         not only spaces"
                    )));
                }
                Ok(key)
            }
            Source::WebhookId => {
                for name in ["webhook-id", "svix-id"] {
                    if let Some(v) = header_text(parts, &HeaderName::from_static(name))? {
                        return Ok(v);
                    }
                }
                Err(missing("neither `webhook-id` nor `svix-id` is present"))
            }
            Source::GithubDelivery => {
                let id = header_text(parts, &HeaderName::from_static("x-github-delivery"))?
                    .ok_or_else(|| missing("the `X-GitHub-Delivery` header is missing"))?;
                // No `#` in a path or query (a fragment is never sent), so the first one
                // ends the scope: two scopes and ids cannot spell the same key.
                let scope = full_uri(parts).path_and_query().map_or("/", |p| p.as_str());
                Ok(format!("{scope}#{id}"))
            }
            Source::Json(pointer) => {
                let body = body.ok_or_else(|| missing("the body was not read"))?;
                if body.iter().all(u8::is_ascii_whitespace) {
                    return Err(missing("the body is empty"));
                }
                // Not "no key": a handler's own parser may read the key from a body a `Value`
                // refuses (serde's derive skips an unknown field's lone surrogate, or one
                // nested past 128 levels), and a missing key may pass through unlocked.
                let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
                    invalid(format!("the body is not JSON the layer can read: {e}"))
                })?;
                let key = match value.pointer(pointer) {
                    Some(serde_json::Value::String(s)) => s.clone(),
                    // A whole number within 64 bits, exactly; any other number was rounded to
                    // a double when parsed, and distinct ids could then share one key.
                    Some(serde_json::Value::Number(n)) if n.is_u64() || n.is_i64() => n.to_string(),
                    Some(serde_json::Value::Number(_)) => {
                        return Err(invalid(format!(
                            "the body field `{pointer}` is a number that is not a whole number \
                             within 64 bits"
                        )));
                    }
                    Some(_) => {
                        return Err(invalid(format!(
                            "the body field `{pointer}` is neither a string nor a number"
                        )));
                    }
                    None => return Err(no_field(&value, pointer)),
                };
                if key.trim().is_empty() {
                    return Err(missing(format!("the body field `{pointer}` is empty")));
                }
                if key.len() > MAX_IDEMPOTENCY_KEY_LEN {
                    return Err(invalid(format!(
                        "the body field `{pointer}` is longer than {MAX_IDEMPOTENCY_KEY_LEN} bytes"
                    )));
                }
                Ok(key)
            }
            Source::Fn(f) => f(parts)
                .filter(|k| !k.trim().is_empty())
                .ok_or_else(|| missing("the request has no key")),
        }
    }
}

/// Why `pointer` finds nothing in `value`. Missing only where a handler's parser finds no key
/// either: the nearest value on the path that exists is an object without the next field,
/// `null`, or an array too short for the next index. Any other shape is not "no key" (which
/// may pass through unlocked): an array reached with a field name (serde's derive fills a
/// struct from an array by position, so `["7", 10]` is account 7 to the handler), or a string
/// or number where an object should be.
fn no_field(value: &serde_json::Value, pointer: &str) -> KeyProblem {
    use serde_json::Value;
    let absent = || missing(format!("the body has no field `{pointer}`"));
    let mut at = value;
    for token in pointer.split('/').skip(1) {
        let token = token.replace("~1", "/").replace("~0", "~");
        at = match at {
            Value::Object(map) => match map.get(&token) {
                Some(next) => next,
                None => return absent(),
            },
            Value::Null => return absent(),
            // serde_json's rule for an index (no sign, no leading zero): a token it reads as
            // no index must not be read as one here, or `/items/01` would count as missing.
            Value::Array(items) => match Some(&token)
                .filter(|t| !t.starts_with('+') && (t.len() == 1 || !t.starts_with('0')))
                .map(|t| t.parse::<usize>())
            {
                Some(Ok(i)) => match items.get(i) {
                    Some(next) => next,
                    None => return absent(),
                },
                _ => {
                    return invalid(format!(
                        "the body has an array where `{pointer}` names a field"
                    ));
                }
            },
            _ => {
                return invalid(format!(
                    "the body has a string, number or boolean on the path of `{pointer}`"
                ));
            }
        };
    }
    absent()
}

/// A request's key, as the lock layer reads it: a route parameter stays in the parameter list
/// axum copied out for the layer instead of being copied once more.
pub(crate) enum Key {
    Owned(String),
    Param(RawPathParams, usize),
}

impl Key {
    pub(crate) fn as_str(&self) -> &str {
        match self {
            Key::Owned(s) => s,
            Key::Param(params, i) => params.iter().nth(*i).map_or("", |(_, v)| v),
        }
    }
}

impl KeyExtractor {
    /// [`extract`](Self::extract), without copying a route parameter.
    pub(crate) async fn extract_key(
        &self,
        parts: &mut Parts,
        body: Option<&Bytes>,
    ) -> Result<Key, KeyProblem> {
        match &self.source {
            Source::RouteParam(name) => route_param(parts, name).await,
            _ => self.extract(parts, body).await.map(Key::Owned),
        }
    }
}

/// The route parameter `name`, left in the parameter list axum copied out.
async fn route_param(parts: &mut Parts, name: &str) -> Result<Key, KeyProblem> {
    let params = RawPathParams::from_request_parts(parts, &())
        .await
        .map_err(|e| match e {
            // The request named a key, just not a usable one: as with a path segment, that is
            // a 400 and never a pass-through, or the request would run unlocked.
            RawPathParamsRejection::InvalidUtf8InPathParam(_) => {
                invalid(format!("a route parameter is not UTF-8 once decoded: {e}"))
            }
            _ => KeyProblem {
                by_route: true,
                ..missing(format!("no route parameters: {e}"))
            },
        })?;
    match params.iter().position(|(k, _)| k == name) {
        Some(i) => Ok(Key::Param(params, i)),
        None => Err(KeyProblem {
            by_route: true,
            ..missing(format!("the route has no parameter `{name}`"))
        }),
    }
}

/// The request's URI as it arrived: inside a router nested with `Router::nest`, axum hands on
/// the URI with the prefix stripped and keeps the original in `OriginalUri`. Two hooks nested
/// at different prefixes must not share a GitHub delivery scope or a fingerprint.
pub(crate) fn full_uri(parts: &Parts) -> &http::Uri {
    parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map_or(&parts.uri, |original| &original.0)
}

/// A header's value, trimmed; an empty one counts as absent, so that `webhook-id:` falls back
/// to `svix-id` and such requests do not all share one empty key. A header sent more than once
/// is no key: the layer would lock on one value while a handler or an upstream may read
/// another (an empty first one would even pass through unlocked).
fn header_text(parts: &Parts, name: &HeaderName) -> Result<Option<String>, KeyProblem> {
    if parts.headers.get_all(name).iter().nth(1).is_some() {
        return Err(invalid(format!(
            "the `{name}` header is sent more than once"
        )));
    }
    match parts.headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim()).filter(|s| !s.is_empty()).map(str::to_owned))
            .map_err(|_| invalid(format!("the `{name}` header is not visible ASCII"))),
    }
}

/// An RFC 8941 string item (`"..."` with `\"` and `\\` escapes, printable ASCII), or a bare
/// value. An item may carry parameters (`"abc";v=1`): they are checked and left out of the key,
/// which is the string alone.
fn parse_sf_string(raw: &str) -> Result<String, String> {
    let Some(rest) = raw.strip_prefix('"') else {
        return Ok(raw.to_owned());
    };
    let (key, rest) = sf_quoted(rest)?;
    sf_parameters(rest)?;
    Ok(key)
}

/// The string whose opening quote was just read, and what follows its closing quote.
fn sf_quoted(rest: &str) -> Result<(String, &str), String> {
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e @ ('"' | '\\')) => out.push(e),
                _ => return Err("bad escape in the structured string".to_owned()),
            },
            '"' => return Ok((out, chars.as_str())),
            ' '..='~' => out.push(c),
            _ => return Err("a character outside printable ASCII".to_owned()),
        }
    }
    Err("the structured string has no closing quote".to_owned())
}

/// RFC 8941 parameters after an item: `*( ";" *SP key [ "=" bare-item ] )`. A value is a
/// string or a run of the characters tokens, numbers, byte sequences and booleans use.
fn sf_parameters(mut rest: &str) -> Result<(), String> {
    let bad = || Err("text after the closing quote that is not `;key=value` parameters".to_owned());
    while !rest.is_empty() {
        let Some(after) = rest.strip_prefix(';') else {
            return bad();
        };
        let after = after.trim_start_matches(' ');
        let key_len = after
            .find(|c: char| !matches!(c, 'a'..='z' | '0'..='9' | '_' | '-' | '.' | '*'))
            .unwrap_or(after.len());
        if !after.starts_with(|c: char| c.is_ascii_lowercase() || c == '*') {
            return bad();
        }
        rest = &after[key_len..];
        if let Some(value) = rest.strip_prefix('=') {
            rest = if let Some(quoted) = value.strip_prefix('"') {
                sf_quoted(quoted)?.1
            } else {
                let len = value
                    .find(|c: char| c == ';' || !c.is_ascii_graphic() || c == '"')
                    .unwrap_or(value.len());
                if len == 0 {
                    return bad();
                }
                &value[len..]
            };
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extract_json(pointer: &str, body: &[u8]) -> Result<String, KeyProblem> {
        let (mut parts, ()) = http::Request::new(()).into_parts();
        let body = Bytes::copy_from_slice(body);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(KeyExtractor::json_field(pointer).extract(&mut parts, Some(&body)))
    }

    /// A key header sent twice is refused, whichever of its values is empty: the layer would
    /// lock one value while the handler may read the other.
    #[test]
    fn a_repeated_key_header_is_not_a_key() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        for values in [["", "7"], ["8", "7"]] {
            let mut req = http::Request::new(());
            for v in values {
                req.headers_mut().append(
                    "x-account",
                    http::HeaderValue::from_str(v).expect("header value"),
                );
            }
            let (mut parts, ()) = req.into_parts();
            let got = rt.block_on(
                KeyExtractor::header(HeaderName::from_static("x-account"))
                    .extract(&mut parts, None),
            );
            assert!(
                matches!(&got, Err(p) if p.reason == Reason::InvalidKey),
                "{values:?}: {:?}",
                got.as_ref().map_err(|p| (p.reason, &p.detail))
            );
        }
    }

    /// A body where the field's path meets an array or a scalar is not "no key": a handler's
    /// parser may read the key there (serde's derive fills a struct from an array by position),
    /// so it must not pass through unlocked. An object without the field, `null`, or an array
    /// too short for an index is still no key.
    #[test]
    fn a_path_through_an_array_or_scalar_is_not_a_missing_key() {
        for (ptr, body) in [
            ("/account", &br#"["7",10]"#[..]),
            ("/account/id", br#"{"account":["7"]}"#),
            ("/account/id", br#"{"account":"7"}"#),
            // Not indexes to serde_json, so the path names no element: not a missing key.
            ("/items/01", br#"{"items":["a","b"]}"#),
            ("/items/+1", br#"{"items":["a","b"]}"#),
        ] {
            let got = extract_json(ptr, body);
            assert!(
                matches!(&got, Err(p) if p.reason == Reason::InvalidKey),
                "{ptr} {}: {:?}",
                String::from_utf8_lossy(body),
                got.as_ref().map_err(|p| (p.reason, &p.detail))
            );
        }
        for (ptr, body) in [
            ("/account", &br#"{"amount":10}"#[..]),
            ("/account/id", br#"{"account":null}"#),
            ("/account/id", br#"{"account":{}}"#),
            ("/items/1", br#"{"items":["a"]}"#),
        ] {
            let got = extract_json(ptr, body);
            assert!(
                matches!(&got, Err(p) if p.reason == Reason::MissingKey),
                "{ptr} {}: {:?}",
                String::from_utf8_lossy(body),
                got.as_ref().map_err(|p| (p.reason, &p.detail))
            );
        }
        assert_eq!(
            extract_json("/items/0", br#"{"items":["a"]}"#).ok(),
            Some("a".to_owned())
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

        /// Any header text: a key or a typed problem, never a panic.
        #[test]
        fn any_idempotency_header_gets_an_answer(raw in "\\PC{0,80}|\"[ -~]{0,40}\"?") {
            let _ = parse_sf_string(&raw);
        }

        /// A printable key, quoted and escaped as RFC 8941 says, comes back unchanged.
        #[test]
        fn quoted_keys_round_trip(key in "[ -~]{0,64}") {
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            proptest::prop_assert_eq!(parse_sf_string(&quoted), Ok(key));
        }

        /// Any body bytes: the JSON key extractor answers, never panics.
        #[test]
        fn any_body_gets_an_answer(body in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = extract_json("/id", &body);
        }

        /// A JSON object with a string or number `id` yields it.
        #[test]
        fn json_ids_are_found(id in "[a-zA-Z0-9_]{1,40}", number in proptest::num::u64::ANY, as_number in proptest::bool::ANY) {
            let (body, expected) = if as_number {
                (format!("{{\"id\": {number}, \"x\": [1, 2]}}"), number.to_string())
            } else {
                (format!("{{\"x\": null, \"id\": \"{id}\"}}"), id)
            };
            proptest::prop_assert_eq!(extract_json("/id", body.as_bytes()).ok(), Some(expected));
        }
    }

    #[test]
    fn a_bare_json_field_name_is_a_top_level_field() {
        let body = br#"{"id": "evt_1", "a/b": "slash", "t~": "tilde", "a": {"b": "nested"}}"#;
        assert_eq!(extract_json("id", body).ok().as_deref(), Some("evt_1"));
        assert_eq!(extract_json("a/b", body).ok().as_deref(), Some("slash"));
        assert_eq!(extract_json("t~", body).ok().as_deref(), Some("tilde"));
        assert_eq!(extract_json("/a/b", body).ok().as_deref(), Some("nested"));
        assert_eq!(
            extract_json("", br#""whole""#).ok().as_deref(),
            Some("whole")
        );
    }

    #[test]
    fn a_blank_key_from_a_closure_is_no_key() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        for blank in ["", "  ", "\t"] {
            let (mut parts, ()) = http::Request::new(()).into_parts();
            let key = KeyExtractor::from_fn(move |_| Some(blank.to_owned()));
            let got = rt.block_on(key.extract(&mut parts, None));
            assert!(
                matches!(&got, Err(p) if p.reason == Reason::MissingKey),
                "{blank:?}: {:?}",
                got.as_ref().map_err(|p| &p.detail)
            );
        }
    }

    #[test]
    fn sf_strings() {
        assert_eq!(parse_sf_string(r#""abc""#).as_deref(), Ok("abc"));
        assert_eq!(parse_sf_string(r#""a\"b\\c""#).as_deref(), Ok(r#"a"b\c"#));
        assert_eq!(parse_sf_string("bare-key").as_deref(), Ok("bare-key"));
        assert!(parse_sf_string(r#""open"#).is_err());
        assert!(parse_sf_string(r#""a"b"#).is_err());
        // Parameters are checked and left out of the key.
        assert_eq!(parse_sf_string(r#""abc";v=1"#).as_deref(), Ok("abc"));
        assert_eq!(
            parse_sf_string(r#""abc"; v=1;flag;n="x;y";t=*tok"#).as_deref(),
            Ok("abc")
        );
        assert!(parse_sf_string(r#""abc";"#).is_err());
        assert!(parse_sf_string(r#""abc";V=1"#).is_err());
        assert!(parse_sf_string(r#""abc";v="#).is_err());
        assert!(parse_sf_string(r#""abc";v="open"#).is_err());
        assert!(parse_sf_string(r#""abc" ;v=1"#).is_err());
        assert!(parse_sf_string(r#""a\x""#).is_err());
    }
}
