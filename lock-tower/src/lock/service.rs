use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{Either, Full};
use lock_core::{AnyBackend, Error, Lease};
use tower_service::Service;
use tracing::Instrument;

use super::layer::LockConfig;
use crate::body::{BoxError, LockBody};
use crate::extract::Held;
use crate::future::ResponseFuture;
use crate::reject::Reason;
use crate::util::{RequestBody, read_capped, reject};

/// The service [`LockLayer`](super::LockLayer) wraps around an inner service.
#[derive(Clone, Debug)]
pub struct Lock<S> {
    pub(crate) inner: S,
    pub(crate) cfg: Arc<LockConfig>,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Lock<S>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + Unpin + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<LockBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The clone is not necessarily ready; the one `poll_ready` readied goes into the future.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let cfg = self.cfg.clone();
        let span = tracing::debug_span!(
            "lock_layer",
            key = tracing::field::Empty,
            fence = tracing::field::Empty
        );
        // Recorded on directly: `Span::current()` would look the span up on every request.
        ResponseFuture::new(run(cfg, inner, req, span.clone()).instrument(span))
    }
}

async fn run<S, ReqBody, ResBody>(
    cfg: Arc<LockConfig>,
    mut inner: S,
    req: Request<ReqBody>,
    span: tracing::Span,
) -> Result<Response<LockBody<ResBody>>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin,
    ResBody::Error: Into<BoxError>,
{
    if !cfg.applies_to(req.method()) {
        let res = inner.call(req.map(Either::Left)).await?;
        return Ok(res.map(LockBody::pass));
    }
    let rejections = &cfg.rejections;
    let (mut parts, body) = req.into_parts();
    let (body, bytes) = if cfg.key.needs_body() {
        match read_capped(body, cfg.body_limit).await {
            Ok(b) => (Either::Right(Full::new(b.clone())), Some(b)),
            Err((reason, detail)) => return Ok(reject(rejections, reason, None, detail)),
        }
    } else {
        (Either::Left(body), None)
    };
    let key = match cfg.key.extract(&mut parts, bytes.as_ref()).await {
        Ok(k) if cfg.prefix.is_empty() => k,
        Ok(k) => format!("{}{k}", cfg.prefix),
        Err(p) if p.reason == Reason::MissingKey && cfg.pass_unkeyed => {
            tracing::debug!(why = %p.detail, "no key; passing through unlocked");
            let res = inner.call(Request::from_parts(parts, body)).await?;
            return Ok(res.map(LockBody::pass));
        }
        Err(p) => return Ok(reject(rejections, p.reason, None, p.detail)),
    };
    span.record("key", key.as_str());
    let taken = if cfg.wait {
        cfg.locker.acquire(&key, &cfg.opts).await
    } else {
        cfg.locker.try_acquire(&key, &cfg.opts).await
    };
    let lease = match taken {
        Ok(lease) => lease,
        Err(e) => return Ok(refusal(&cfg, &e)),
    };
    span.record("fence", lease.fence().0);
    parts.extensions.insert(Held {
        fence: lease.fence(),
        info: lease.info(),
    });
    let in_process = matches!(cfg.locker.backend(), AnyBackend::Memory(_));
    let lost = |key: &str| {
        tracing::warn!("lease lost while the handler ran; handler cancelled");
        reject(
            rejections,
            Reason::LeaseLost,
            None,
            format!(
                "the lease on `{key}` was lost before the handler finished; the handler was cancelled"
            ),
        )
    };
    if lease.is_lost() {
        return Ok(lost(&key));
    }
    let mut handler = std::pin::pin!(inner.call(Request::from_parts(parts, body)));
    // Most handlers answer on their first poll. Waiting on the loss signal registers a waker
    // and a timer, which cost more than such a handler, so that happens only when the handler
    // has to wait; a lease found lost above is the same answer as before.
    let res = match std::future::poll_fn(|cx| Poll::Ready(handler.as_mut().poll(cx))).await {
        Poll::Ready(res) => res,
        Poll::Pending => tokio::select! {
            biased;
            _ = lease.lost() => return Ok(lost(&key)),
            res = &mut handler => res,
        },
    };
    Ok(finish(res?, lease, in_process).await)
}

/// Attaches the lease to the response body, or releases it at once when the body is already
/// complete.
///
/// Most handlers return a body that is complete at once. Finishing it here releases the lease
/// before the head goes out, so head and body leave in one write. Held back behind a release
/// round trip, the body would go out as a second small segment, and Nagle's algorithm meeting
/// the client's delayed ACK would add about 40 ms to every response.
async fn finish<B>(res: Response<B>, lease: Lease, in_process: bool) -> Response<LockBody<B>>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let (head, mut body) = res.into_parts();
    let first = if body.is_end_stream() {
        Poll::Ready(None)
    } else {
        // One poll only: a body that is not ready at once streams under the lease.
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await
    };
    // Converted at once: the inner error type need not be `Send`, and the release below awaits.
    let first = first.map(|f| f.map(|r| r.map_err(Into::<BoxError>::into)));
    let body = match first {
        Poll::Pending => LockBody::holding(body, lease),
        Poll::Ready(None) => {
            release(lease, in_process).await;
            LockBody::pass(body)
        }
        Poll::Ready(Some(Ok(frame))) if body.is_end_stream() => {
            release(lease, in_process).await;
            LockBody::pass(body).after(Ok(frame))
        }
        Poll::Ready(Some(frame)) => LockBody::holding(body, lease).after(frame),
    };
    Response::from_parts(head, body)
}

/// Releases `lease`, surviving the caller being dropped mid-way.
pub(crate) async fn release(lease: Lease, in_process: bool) {
    if in_process {
        // In process the release completes on its first poll; nothing can cut it short.
        log_release(lease.release().await);
        return;
    }
    // A server round trip: if the client hangs up meanwhile, the response future is dropped,
    // and a release dropped in flight would leave the key held until its TTL ran out. A task
    // carries on regardless of who awaits it.
    if let Ok(outcome) = tokio::spawn(lease.release()).await {
        log_release(outcome);
    }
}

pub(crate) fn log_release(outcome: lock_core::Result<lock_core::Release>) {
    if let Err(e) = outcome {
        tracing::warn!(error = %e, "release after the response failed; the lease expires with its TTL");
    }
}

/// The answer to a failed acquire.
pub(crate) fn refusal<B>(cfg: &LockConfig, e: &Error) -> Response<LockBody<B>> {
    refuse(&cfg.rejections, e)
}

pub(crate) fn refuse<B>(
    rejections: &crate::reject::Rejections,
    e: &Error,
) -> Response<LockBody<B>> {
    use std::time::Duration;
    match e {
        Error::Busy { remaining, .. } => reject(
            rejections,
            Reason::Busy,
            Some(remaining.unwrap_or(Duration::from_secs(1))),
            e.to_string(),
        ),
        Error::WaitTimeout { .. } => reject(
            rejections,
            Reason::WaitTimeout,
            Some(Duration::from_secs(1)),
            e.to_string(),
        ),
        Error::InvalidKey { .. } => reject(rejections, Reason::InvalidKey, None, e.to_string()),
        other => {
            tracing::warn!(error = %other, "lock backend failed");
            reject(
                rejections,
                Reason::Unavailable,
                Some(Duration::from_secs(1)),
                "the lock service is unavailable",
            )
        }
    }
}
