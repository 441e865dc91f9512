//! Small helpers both layers share.

use bytes::Bytes;
use http::Response;
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};

use crate::body::{BoxError, LockBody};
use crate::reject::{Reason, Rejections};

/// The request body the inner service sees: the original one, or the same bytes after a layer
/// had to read them (a JSON key, a dedupe fingerprint).
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
        Err(e) => Err((
            Reason::BodyUnreadable,
            format!("the request body could not be read: {e}"),
        )),
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
