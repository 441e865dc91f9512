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
}

fn missing(detail: impl Into<String>) -> KeyProblem {
    KeyProblem {
        reason: Reason::MissingKey,
        detail: detail.into(),
    }
}

fn invalid(detail: impl Into<String>) -> KeyProblem {
    KeyProblem {
        reason: Reason::InvalidKey,
        detail: detail.into(),
    }
}

impl KeyExtractor {
    /// The `index`-th non-empty segment of the request path, counting from 0, percent-decoded
    /// as axum's router decodes it. For `/accounts/7/withdraw` and `/accounts/%37/withdraw`,
    /// segment 1 is `7`; a segment that is not UTF-8 once decoded is an invalid key (400). Works with any Tower
    /// server and with `Router::layer` as well as `route_layer`.
    pub fn path_segment(index: usize) -> KeyExtractor {
        KeyExtractor {
            source: Source::PathSegment(index),
        }
    }

    /// A parameter of the matched axum route (`/accounts/{id}/withdraw` → `id`),
    /// percent-decoded; a parameter that is not UTF-8 once decoded is an invalid key (400, also
    /// with `pass_through_without_key`). axum only knows the parameters after routing, so add the layer with
    /// `route_layer` (or to the `MethodRouter`), not with `Router::layer`: there every request
    /// would miss its key.
    pub fn route_param(name: &str) -> KeyExtractor {
        KeyExtractor {
            source: Source::RouteParam(name.into()),
        }
    }

    /// The value of a header, which must be visible ASCII; an empty value counts as absent.
    pub fn header(name: HeaderName) -> KeyExtractor {
        KeyExtractor {
            source: Source::Header(name),
        }
    }

    /// The `Idempotency-Key` header of the IETF httpapi draft. Its value is a structured-field
    /// string, so it arrives quoted (`"abc"`); the quotes and escapes are removed. A bare value
    /// without quotes (as some senders use) is accepted as it is. Keys longer than
    /// [`MAX_IDEMPOTENCY_KEY_LEN`] are refused.
    pub fn idempotency_key() -> KeyExtractor {
        KeyExtractor {
            source: Source::IdempotencyKey,
        }
    }

    /// The delivery id of Standard Webhooks senders: the `webhook-id` header, or `svix-id`
    /// when `webhook-id` is absent or empty.
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
    pub fn github_delivery() -> KeyExtractor {
        KeyExtractor {
            source: Source::GithubDelivery,
        }
    }

    /// A field of a JSON request body, named by a JSON pointer (`/id`, `/data/object/id`); a
    /// string or a number. The layer reads the body up to its body cap and hands the same bytes
    /// on to the handler.
    ///
    /// A string that is empty or only whitespace counts as absent (as an empty header does), so
    /// malformed events do not all share one key. A number is used as its decimal text, so `7`
    /// and `"7"` are one key (as a route parameter `7` and a body field `7` name one account);
    /// only whole numbers within 64 bits are keys (`7.5` or `1e30` are invalid, 400), since
    /// others are rounded when parsed and distinct ids could share a key.
    /// Keys longer than [`MAX_IDEMPOTENCY_KEY_LEN`] bytes are invalid (400).
    pub fn json_field(pointer: &str) -> KeyExtractor {
        KeyExtractor {
            source: Source::Json(pointer.into()),
        }
    }

    /// Any function of the request head; `None` means the request has no key.
    pub fn from_fn(f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> KeyExtractor {
        KeyExtractor {
            source: Source::Fn(Arc::new(f)),
        }
    }

    /// Whether the key is in the body, so the layer must read it first.
    pub(crate) fn needs_body(&self) -> bool {
        matches!(self.source, Source::Json(_))
    }

    /// The key of a request; `body` is the buffered body when [`needs_body`](Self::needs_body)
    /// (or the layer buffers anyway).
    pub(crate) async fn extract(
        &self,
        parts: &mut Parts,
        body: Option<&Bytes>,
    ) -> Result<String, KeyProblem> {
        match &self.source {
            Source::PathSegment(i) => {
                let raw = parts
                    .uri
                    .path()
                    .split('/')
                    .filter(|s| !s.is_empty())
                    .nth(*i)
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
                if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_LEN {
                    return Err(invalid(format!(
                        "the `Idempotency-Key` must have 1 to {MAX_IDEMPOTENCY_KEY_LEN} characters"
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
                let value: serde_json::Value = serde_json::from_slice(body)
                    .map_err(|e| missing(format!("the body is not JSON: {e}")))?;
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
                    None => return Err(missing(format!("the body has no field `{pointer}`"))),
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
            Source::Fn(f) => f(parts).ok_or_else(|| missing("the request has no key")),
        }
    }
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
            _ => missing(format!("no route parameters: {e}")),
        })?;
    match params.iter().position(|(k, _)| k == name) {
        Some(i) => Ok(Key::Param(params, i)),
        None => Err(missing(format!("the route has no parameter `{name}`"))),
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
/// to `svix-id` and such requests do not all share one empty key.
fn header_text(parts: &Parts, name: &HeaderName) -> Result<Option<String>, KeyProblem> {
    match parts.headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim()).filter(|s| !s.is_empty()).map(str::to_owned))
            .map_err(|_| invalid(format!("the `{name}` header is not visible ASCII"))),
    }
}

/// An RFC 8941 string (`"..."` with `\"` and `\\` escapes, printable ASCII), or a bare value.
fn parse_sf_string(raw: &str) -> Result<String, String> {
    let Some(rest) = raw.strip_prefix('"') else {
        return Ok(raw.to_owned());
    };
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e @ ('"' | '\\')) => out.push(e),
                _ => return Err("bad escape in the structured string".to_owned()),
            },
            '"' => {
                return if chars.as_str().is_empty() {
                    Ok(out)
                } else {
                    Err("text after the closing quote".to_owned())
                };
            }
            ' '..='~' => out.push(c),
            _ => return Err("a character outside printable ASCII".to_owned()),
        }
    }
    Err("the structured string has no closing quote".to_owned())
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
    fn sf_strings() {
        assert_eq!(parse_sf_string(r#""abc""#).as_deref(), Ok("abc"));
        assert_eq!(parse_sf_string(r#""a\"b\\c""#).as_deref(), Ok(r#"a"b\c"#));
        assert_eq!(parse_sf_string("bare-key").as_deref(), Ok("bare-key"));
        assert!(parse_sf_string(r#""open"#).is_err());
        assert!(parse_sf_string(r#""a"b"#).is_err());
        assert!(parse_sf_string(r#""a\x""#).is_err());
    }
}
