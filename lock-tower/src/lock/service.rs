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
use crate::extract::{Held, lock_held, lock_passed};
use crate::future::ResponseFuture;
use crate::key::{Key, KeyProblem};
use crate::reject::Reason;
use crate::util::{
    MethodFilter, ReplyBody, RequestBody, empty_methods, no_room_for_key, read_capped, reject,
};

/// The service [`LockLayer`](super::LockLayer) wraps around an inner service.
///
/// Without axum's router, wrap any Tower service (here an axum handler made one):
///
/// ```
/// use axum::{body::Body, handler::HandlerWithoutStateExt};
/// use lock_tower::{Fence, KeyExtractor, LockLayer, lock::Lock};
/// use tower_layer::Layer;
/// use tower_service::Service;
///
/// async fn settle(Fence(fence): Fence) -> String {
///     format!("settled under fence {fence}")
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_tower::BoxError> {
/// let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::path_segment(1));
/// let mut svc: Lock<_> = layer.layer(settle.into_service());
/// let res = svc.call(http::Request::post("/orders/42/settle").body(Body::empty())?).await?;
/// assert_eq!(res.status(), 200);
/// # Ok(()) }
/// ```
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
        let span = tracing::debug_span!(
            "lock_layer",
            key = tracing::field::Empty,
            fence = tracing::field::Empty
        );
        // Recorded on directly: `Span::current()` would look the span up on every request.
        ResponseFuture::new(run(self.cfg.clone(), inner, req, span.clone()).instrument(span))
    }
}

/// The request's way through the layer.
///
/// The future is boxed, and moved whole on its way into the box, so its size is paid on every
/// request (in copying, and above about a kilobyte in a slower `malloc` outside glibc's
/// per-thread cache). Hence an `async` block (an `async fn` keeps a second copy of its
/// arguments), the request split before it, the lock-core futures of the memory backend run
/// to completion on the stack ([`poll_now`]), and the rarer paths' futures boxed.
fn run<S, ReqBody, ResBody>(
    cfg: Arc<LockConfig>,
    mut inner: S,
    req: Request<ReqBody>,
    span: tracing::Span,
) -> impl Future<Output = Result<Response<LockBody<ResBody>>, S::Error>>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin,
    ResBody::Error: Into<BoxError>,
{
    let (mut parts, body) = req.into_parts();
    // A HEAD request's response goes out without its body, as a 204's or a 304's does.
    let reply = ReplyBody::of(&parts.method);
    // HTTP/1 servers stop polling a body at its declared length; HTTP/2 ones poll it to its
    // end (trailers, work after the last byte), which must still run under the lease.
    let ends_at_length = parts.version <= http::Version::HTTP_11;
    async move {
        match cfg.method_filter(&parts.method) {
            MethodFilter::Applies => {}
            MethodFilter::Skips => {
                lock_passed(&mut parts.extensions);
                let res = inner
                    .call(Request::from_parts(parts, Either::Left(body)))
                    .await?;
                return Ok(res.map(LockBody::pass));
            }
            MethodFilter::Empty => return Ok(empty_methods(&cfg.rejections)),
        }
        // Each step in a block of its own: a local's room is kept until its scope ends, even
        // after it was moved out, and a local alive across two awaits has room of its own in
        // every state of the future.
        if let Some(problem) = cfg.prefix_problem {
            cfg.rejections
                .setup_logged
                .log("the layer's key prefix is unusable", &problem);
            return Ok(reject(
                &cfg.rejections,
                Reason::Misconfigured,
                None,
                problem,
            ));
        }
        let in_process = matches!(cfg.locker.backend(), AnyBackend::Memory(_));
        let (body, lease) = {
            let (body, key) = {
                let (body, key) = if cfg.key.needs_body() {
                    if cfg.body_limit == 0 {
                        return Ok(no_room_for_key(&cfg.rejections));
                    }
                    match Box::pin(key_from_body(&cfg, &mut parts, body)).await {
                        Ok((body, key)) => (body, key),
                        Err(res) => return Ok(res),
                    }
                } else {
                    let key = cfg.key.extract_key(&mut parts, None).await;
                    (Either::Left(body), key)
                };
                match key {
                    Ok(k) if cfg.prefix.is_empty() => (body, k),
                    Ok(k) => (body, Key::Owned(format!("{}{}", cfg.prefix, k.as_str()))),
                    Err(p) if p.reason == Reason::MissingKey && cfg.pass_unkeyed => {
                        tracing::debug!(why = %p.detail, "no key; passing through unlocked");
                        lock_passed(&mut parts.extensions);
                        let res = inner.call(Request::from_parts(parts, body)).await?;
                        return Ok(res.map(LockBody::pass));
                    }
                    Err(p) => {
                        let reason = p.refusal(&cfg.rejections);
                        return Ok(reject(&cfg.rejections, reason, None, p.detail));
                    }
                }
            };
            span.record("key", key.as_str());
            let key = key.as_str();
            let taken = if cfg.wait {
                Box::pin(cfg.locker.acquire(key, &cfg.opts)).await
            } else if in_process {
                match poll_now(|| cfg.locker.try_acquire(key, &cfg.opts)) {
                    Poll::Ready(taken) => taken,
                    // Not reached with today's memory backend, whose acquire completes on its
                    // first poll; were it pending, the attempt has been dropped: make it again.
                    Poll::Pending => Box::pin(cfg.locker.try_acquire(key, &cfg.opts)).await,
                }
            } else {
                Box::pin(cfg.locker.try_acquire(key, &cfg.opts)).await
            };
            match taken {
                Ok(lease) => (body, lease),
                Err(e) => return Ok(refusal(&cfg, &e)),
            }
        };
        span.record("fence", lease.fence().0);
        lock_held(
            &mut parts.extensions,
            Held {
                fence: lease.fence(),
                info: lease.info(),
            },
        );
        let res = {
            let mut handler = std::pin::pin!(inner.call(Request::from_parts(parts, body)));
            // Most handlers answer on their first poll. Waiting on the loss signal registers a
            // waker and a timer, which cost more than such a handler, so the signal is armed
            // only once the handler has to wait (the acquire hands out no lease already lost, so
            // no check is needed before the first poll); from then on it is checked before the
            // handler, as a biased select would.
            // One await for all of it: a future awaited in two places would keep its room in
            // every later state of this one.
            let mut lost_signal: Option<Pin<Box<dyn Future<Output = ()> + Send + '_>>> = None;
            let raced = std::future::poll_fn(|cx| {
                if let Some(signal) = &mut lost_signal
                    && signal.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(None);
                }
                match handler.as_mut().poll(cx) {
                    Poll::Ready(res) => Poll::Ready(Some(res)),
                    Poll::Pending if lost_signal.is_some() => Poll::Pending,
                    Poll::Pending => {
                        let signal = lost_signal.insert(Box::pin(lease.lost()));
                        if signal.as_mut().poll(cx).is_ready() {
                            return Poll::Ready(None);
                        }
                        Poll::Pending
                    }
                }
            });
            match raced.await {
                Some(res) => res,
                None => return Ok(lost(&cfg, lease.key())),
            }
        };
        // The lease goes with the body, or is released at once when the body is already
        // complete. Most handlers return a body that is complete at once; finishing it here
        // releases the lease before the head goes out, so head and body leave in one write.
        // Held back behind a release round trip, the body would go out as a second small
        // segment, and Nagle's algorithm meeting the client's delayed ACK would add about
        // 40 ms to every response.
        let remote = {
            let (head, mut body) = res?.into_parts();
            let no_body = reply.omitted(head.status);
            let first = if no_body {
                // Not polled: the server sends no body here, whatever length it names.
                Poll::Pending
            } else if body.is_end_stream() {
                Poll::Ready(None)
            } else {
                // One poll only: a body that is not ready at once streams under the lease.
                std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await
            };
            // Converted at once: the inner error type need not be `Send`.
            let first = first.map(|f| f.map(|r| r.map_err(Into::<BoxError>::into)));
            let (body, done) = match first {
                Poll::Pending => {
                    let declared = if no_body {
                        Some(0)
                    } else {
                        declared_len(&head, &body, None).filter(|_| ends_at_length)
                    };
                    match declared {
                        // Nothing to send (a declared length of zero, a HEAD request, a 1xx,
                        // 204 or 304): the server drops the body unpolled, so the lease is
                        // released now, before the head goes out, not in the background when
                        // the body is dropped, where the client's next request could find it
                        // still held.
                        Some(0) => (LockBody::pass(body), Some(lease)),
                        declared => (LockBody::holding(body, lease, declared), None),
                    }
                }
                // Ended: an empty body goes out instead of the spent one, which is not polled
                // again (some bodies panic when polled past their end, and a spent body need
                // not say it ended).
                Poll::Ready(None) => (LockBody::local(Full::new(Bytes::new())), Some(lease)),
                // Complete with one data frame, the usual case: the frame is all that is left
                // to send, so the spent inner body is dropped, and the body that goes out is a
                // `Full` whose size is exact and that reports its end with its last frame.
                Poll::Ready(Some(Ok(frame))) if body.is_end_stream() => match frame.into_data() {
                    Ok(data) => (LockBody::local(Full::new(data)), Some(lease)),
                    Err(frame) => (LockBody::pass(body).after(Ok(frame)), Some(lease)),
                },
                Poll::Ready(Some(frame)) => {
                    match declared_len(&head, &body, Some(&frame)).filter(|_| ends_at_length) {
                        // A head that declares no body (`Content-Length: 0`) is all the server
                        // sends: it drops the body unpolled, frame and all, so the lease goes
                        // now, as in the pending case above.
                        Some(0) => (LockBody::pass(body).after(frame), Some(lease)),
                        declared => (LockBody::holding(body, lease, declared).after(frame), None),
                    }
                }
            };
            match done {
                None => return Ok(Response::from_parts(head, body)),
                Some(lease) if in_process => {
                    release_now(lease);
                    return Ok(Response::from_parts(head, body));
                }
                // Boxed, so the common path's future does not carry the response across it.
                Some(lease) => Box::pin(async move {
                    release_remote(lease).await;
                    Response::from_parts(head, body)
                }),
            }
        };
        Ok(remote.await)
    }
}

/// The length of a response body as the server will send it: the head's `Content-Length`, or
/// else the body's exact size (plus the frame `first` already taken from it). A body with a
/// declared length is dropped unpolled once that many bytes went out, so the layer must know
/// where it ends without seeing its end.
pub(crate) fn declared_len<B: Body>(
    head: &http::response::Parts,
    body: &B,
    first: Option<&Result<http_body::Frame<Bytes>, BoxError>>,
) -> Option<u64> {
    let from_head = head
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if from_head.is_some() {
        return from_head;
    }
    let taken = match first {
        None => 0,
        Some(Ok(frame)) => frame.data_ref().map_or(0, |d| d.len() as u64),
        // The body failed at once; it ends there, whatever its size said.
        Some(Err(_)) => return None,
    };
    // A size past `u64::MAX` is no size to declare.
    body.size_hint()
        .exact()
        .and_then(|rest| rest.checked_add(taken))
}

/// The JSON-body path: reads the body up to the cap, finds the key in it, and hands the same
/// bytes on. Boxed by the caller, so the common path does not carry its state.
async fn key_from_body<ReqBody, B>(
    cfg: &LockConfig,
    parts: &mut http::request::Parts,
    body: ReqBody,
) -> Result<(RequestBody<ReqBody>, Result<Key, KeyProblem>), Response<LockBody<B>>>
where
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
{
    match read_capped(body, cfg.body_limit).await {
        Ok(b) => {
            let key = cfg.key.extract(parts, Some(&b)).await.map(Key::Owned);
            Ok((Either::Right(Full::new(b)), key))
        }
        Err((reason, detail)) => Err(reject(&cfg.rejections, reason, None, detail)),
    }
}

/// Polls the future `make` returns once, with a waker that does nothing, and drops it if it is
/// not ready.
///
/// For the memory backend's lock-core futures, which complete on their first poll (a mutex,
/// no I/O; `MemoryBackend` documents it and lock-core's
/// `memory_operations_complete_on_first_poll` checks it): run here, on the stack, their kilobyte or so of state stays out of the layer's
/// future.
fn poll_now<F: Future>(make: impl FnOnce() -> F) -> Poll<F::Output> {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    std::pin::pin!(make()).poll(&mut cx)
}

fn lost<B>(cfg: &LockConfig, key: &str) -> Response<LockBody<B>> {
    tracing::warn!("lease lost while the handler ran; handler cancelled");
    reject(
        &cfg.rejections,
        Reason::LeaseLost,
        None,
        format!(
            "the lease on `{key}` was lost before the handler finished; the handler was cancelled"
        ),
    )
}

/// Releases `lease`, surviving the caller being dropped mid-way.
pub(crate) async fn release(lease: Lease, in_process: bool) {
    if in_process {
        release_now(lease);
    } else {
        release_remote(lease).await;
    }
}

/// Releases an in-process lease: that completes on its first poll (a mutex, no I/O), so
/// nothing can cut it short.
fn release_now(lease: Lease) {
    match poll_now(|| lease.release()) {
        Poll::Ready(outcome) => log_release(outcome),
        Poll::Pending => tracing::warn!(
            "in-process release did not complete at once; the lease expires with its TTL"
        ),
    }
}

/// A server round trip: if the client hangs up meanwhile, the response future is dropped, and
/// a release dropped in flight would leave the key held until its TTL ran out. A task carries
/// on regardless of who awaits it.
async fn release_remote(lease: Lease) {
    let release = tokio::spawn(async move { log_release(lease.release().await) });
    // The release goes on in its task past this bound: a server that stopped answering would
    // otherwise hold a finished response for its timeouts (a response timeout, and another
    // for the resend of a release of unknown outcome), though the work is done.
    let _ = tokio::time::timeout(RELEASE_BEFORE_HEAD, release).await;
}

/// How long a finished response waits for its lease's release before it goes out anyway.
const RELEASE_BEFORE_HEAD: std::time::Duration = std::time::Duration::from_secs(1);

pub(crate) fn log_release(outcome: lock_core::Result<lock_core::Release>) {
    match outcome {
        Ok(lock_core::Release::Released) => {}
        // Only a handler that never waited (it blocked its thread past the lease) or a body
        // that ended as the lease ran out gets here without the loss having been answered:
        // the work ran, in part unprotected, and the response went out as it was.
        Ok(lock_core::Release::NotHeld) => tracing::warn!(
            "the lease had run out by the end of the response: the handler or its body ran \
             past it without waiting, so neither could be cancelled"
        ),
        Err(e) => {
            tracing::warn!(error = %e, "release after the response failed; the lease expires with its TTL")
        }
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
        // The key's stored fence is 2^64 - 1: no grant is possible, now or later, so no
        // `Retry-After`, and an operator has to look.
        Error::FenceExhausted { .. } => {
            tracing::error!(error = %e, "no fence is left for the key; it cannot be locked");
            reject(
                rejections,
                Reason::Unavailable,
                None,
                "the lock service cannot lock this key",
            )
        }
        // Another program's value under the key's server name: a retry meets it again, so no
        // `Retry-After`, and an operator has to look (nothing was overwritten).
        Error::WrongType { .. } => {
            tracing::error!(error = %e, "the key's server name holds another program's value");
            reject(
                rejections,
                Reason::Unavailable,
                None,
                "the lock service cannot lock this key",
            )
        }
        Error::InvalidTtl { .. } | Error::InvalidDuration { .. } => {
            rejections
                .setup_logged
                .log("the layer's lease settings are out of range", e);
            reject(rejections, Reason::Misconfigured, None, e.to_string())
        }
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
