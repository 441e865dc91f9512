//! Small helpers both layers share.

use bytes::Bytes;
use http::Response;
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};

use crate::body::{BoxError, LockBody};
use crate::reject::{Reason, Rejections};

/// The request body the inner service sees: the original one, or the same bytes after a layer
/// had to read them (a JSON key, a dedupe fingerprint).
///
/// A plain Tower service wrapped by a layer takes requests with this body:
///
/// ```
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::{BodyExt, Full};
/// use lock_tower::{BoxError, KeyExtractor, LockLayer, RequestBody};
/// use std::{future::Future, pin::Pin};
/// use tower_layer::Layer;
/// use tower_service::Service;
/// # use std::task::{Context, Poll};
///
/// #[derive(Clone)]
/// struct Echo;
///
/// impl Service<Request<RequestBody<Full<Bytes>>>> for Echo {
///     type Response = Response<Full<Bytes>>;
///     type Error = BoxError;
///     type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;
/// #   fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
/// #       Poll::Ready(Ok(()))
/// #   }
///     fn call(&mut self, req: Request<RequestBody<Full<Bytes>>>) -> Self::Future {
///         Box::pin(async move {
///             // The original body, or the same bytes once the layer read them: one content.
///             let body = req.into_body().collect().await?.to_bytes();
///             Ok(Response::new(Full::new(body)))
///         })
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), BoxError> {
/// let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::json_field("/id"));
/// let res = layer.layer(Echo).call(Request::new(Full::from(r#"{"id": 7}"#))).await?;
/// assert_eq!(res.into_body().collect().await?.to_bytes(), r#"{"id": 7}"#);
/// # Ok(()) }
/// ```
pub type RequestBody<B> = Either<B, Full<Bytes>>;

/// Reads a request body up to `cap` bytes.
pub(crate) async fn read_capped<B>(body: B, cap: usize) -> Result<Bytes, (Reason, String)>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match Limited::new(body, cap).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err((
            Reason::BodyTooLarge,
            format!("the request body is larger than {cap} bytes"),
        )),
        // A limit set outside this layer (tower-http's `RequestBodyLimitLayer` on a chunked
        // body) comes wrapped in the body's own error type, where axum's extractors look for
        // it too: still too large, not unreadable.
        Err(e) if over_a_limit(&*e) => Err((
            Reason::BodyTooLarge,
            "the request body is larger than a limit set before this layer".to_owned(),
        )),
        Err(e) => Err((
            Reason::BodyUnreadable,
            format!("the request body could not be read: {e}"),
        )),
    }
}

/// Whether `e` or an error it wraps is a body's length limit.
fn over_a_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(err) = next {
        if err.is::<LengthLimitError>() {
            return true;
        }
        next = err.source();
    }
    false
}

/// Whether a response with this status sends no body, whatever length it names: 1xx, 204,
/// and 304 (whose `Content-Length` is the representation's).
fn bodiless_status(status: http::StatusCode) -> bool {
    status.is_informational()
        || status == http::StatusCode::NO_CONTENT
        || status == http::StatusCode::NOT_MODIFIED
}

/// What a request's method means for its response's body: taken before the request goes to the
/// handler, which gets the method with the rest of its head.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReplyBody {
    /// A HEAD request: its answer names the length of a body that is not sent.
    head: bool,
    /// A CONNECT request: a 2xx answer turns the connection into a tunnel and sends no body.
    connect: bool,
}

impl ReplyBody {
    pub(crate) fn of(method: &http::Method) -> ReplyBody {
        ReplyBody {
            head: method == http::Method::HEAD,
            connect: method == http::Method::CONNECT,
        }
    }

    /// Whether the server sends no body with a response of `status` to this request, whatever
    /// the body holds or the head declares (hyper drops such a body unpolled).
    pub(crate) fn omitted(self, status: http::StatusCode) -> bool {
        self.head || (self.connect && status.is_success()) || bodiless_status(status)
    }
}

pub(crate) fn reject<B>(
    rejections: &Rejections,
    reason: Reason,
    retry_after: Option<std::time::Duration>,
    detail: impl Into<String>,
) -> Response<LockBody<B>> {
    rejections
        .respond(reason, retry_after, detail)
        .map(LockBody::local)
}

/// What a layer's method filter makes of a request's method.
pub(crate) enum MethodFilter {
    /// The layer applies.
    Applies,
    /// The method is not in the list: the request passes on untouched.
    Skips,
    /// The list was set empty: no request would ever be locked, which no one sets on purpose
    /// (a route that needs no lock needs no layer), so every request is the layer's fault.
    Empty,
}

/// HEAD counts as GET: axum runs a GET handler for a HEAD request, and it must not run unlocked
/// beside a GET that holds the key.
pub(crate) fn method_filter(
    methods: Option<&[http::Method]>,
    method: &http::Method,
) -> MethodFilter {
    match methods {
        None => MethodFilter::Applies,
        Some([]) => MethodFilter::Empty,
        Some(m)
            if m.contains(method)
                || (*method == http::Method::HEAD && m.contains(&http::Method::GET)) =>
        {
            MethodFilter::Applies
        }
        Some(_) => MethodFilter::Skips,
    }
}

/// The answer to every request through a layer whose method list is empty: 500, logged at
/// `error` once per layer.
pub(crate) fn empty_methods<B>(rejections: &Rejections) -> Response<LockBody<B>> {
    misconfigured(
        rejections,
        "the layer's method list is empty, so it would lock no request",
    )
}

/// The answer to every request through a layer that takes its key from a JSON body but may
/// read none of it (a body limit of 0): 500, logged at `error` once per layer. Each request
/// would otherwise be refused as too large (413) or as lacking its key (400), blaming clients
/// for the layer's setup.
pub(crate) fn no_room_for_key<B>(rejections: &Rejections) -> Response<LockBody<B>> {
    misconfigured(
        rejections,
        "the layer's body limit is 0, so it can read no JSON key from a request body",
    )
}

fn misconfigured<B>(rejections: &Rejections, detail: &'static str) -> Response<LockBody<B>> {
    rejections
        .setup_logged
        .log("the layer is misconfigured", &detail);
    reject(rejections, Reason::Misconfigured, None, detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A limit set outside the layer, its error wrapped in axum's body error (as a
    /// `RequestBodyLimitLayer` in front of a chunked body gives it), is a body too large
    /// (413), not an unreadable one (400). The layer's own cap says its size.
    #[tokio::test]
    async fn a_limit_set_outside_is_a_body_too_large() {
        let outer = Limited::new(Full::new(Bytes::from(vec![b'x'; 200])), 100);
        let wrapped = axum::body::Body::new(outer);
        let (reason, detail) = read_capped(wrapped, 1 << 20)
            .await
            .expect_err("over the limit");
        assert_eq!(reason, Reason::BodyTooLarge, "{detail}");

        let ours = read_capped(Full::new(Bytes::from(vec![b'x'; 200])), 100).await;
        let (reason, detail) = ours.expect_err("over the cap");
        assert_eq!(reason, Reason::BodyTooLarge);
        assert!(detail.contains("100 bytes"), "{detail}");

        let fine = read_capped(axum::body::Body::from("{}"), 100).await;
        assert_eq!(fine.expect("read"), Bytes::from_static(b"{}"));
    }
}
