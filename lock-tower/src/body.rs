//! The response body of both layers: it keeps the lease alive while the response streams and
//! releases it when the body ends or is dropped.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use lock_core::Lease;
use pin_project_lite::pin_project;

/// The error type of [`LockBody`]: the inner body's error, or [`LeaseLostWhileStreaming`].
///
/// ```
/// use axum::{body::Body, handler::HandlerWithoutStateExt};
/// use http_body_util::BodyExt;
/// use lock_tower::{BoxError, KeyExtractor, LockLayer};
/// use tower_layer::Layer;
/// use tower_service::Service;
///
/// async fn report() -> &'static str {
///     "monthly report"
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), BoxError> {
/// let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::path_segment(1));
/// let mut svc = layer.layer(report.into_service());
/// let res = svc.call(http::Request::post("/reports/2024-05").body(Body::empty())?).await?;
/// // Whatever failed (the handler's body or the lease), reading the body gives a `BoxError`.
/// let body: Result<_, BoxError> = res.into_body().collect().await;
/// assert_eq!(body?.to_bytes(), "monthly report");
/// # Ok(()) }
/// ```
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The lease was lost while the response body streamed; the body ends with this error, so the
/// client sees a cut-off response rather than a complete one produced without the lock.
///
/// ```
/// use axum::{body::Body, handler::HandlerWithoutStateExt};
/// use http_body_util::BodyExt;
/// use lock_core::{AnyBackend, Locker, MemoryBackend};
/// use lock_tower::{KeyExtractor, LeaseLostWhileStreaming, LockLayer};
/// use std::time::Duration;
/// use tower_layer::Layer;
/// use tower_service::Service;
/// # use std::{convert::Infallible, pin::Pin, task::{Context, Poll}};
/// # /// A feed that never sends its next frame.
/// # struct Endless;
/// # impl http_body::Body for Endless {
/// #     type Data = bytes::Bytes;
/// #     type Error = Infallible;
/// #     fn poll_frame(
/// #         self: Pin<&mut Self>,
/// #         _: &mut Context<'_>,
/// #     ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Infallible>>> {
/// #         Poll::Pending
/// #     }
/// # }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_tower::BoxError> {
/// let memory = MemoryBackend::new();
/// let locker = Locker::new(AnyBackend::Memory(memory.clone()));
/// // A short TTL, so the next renewal notices the loss soon.
/// let layer = LockLayer::new(locker.clone(), KeyExtractor::path_segment(1))
///     .ttl(Duration::from_millis(300));
/// let mut feed = layer.layer((|| async { Body::new(Endless) }).into_service());
/// let res = feed.call(http::Request::get("/feeds/4").body(Body::empty())?).await?;
///
/// // An operator deletes the lock while the body streams.
/// memory.force_delete(&locker.lock_key("4")?);
/// let err = res.into_body().collect().await.expect_err("the body is cut off");
/// assert!(err.is::<LeaseLostWhileStreaming>());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct LeaseLostWhileStreaming {
    key: String,
}

impl fmt::Display for LeaseLostWhileStreaming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "lease on `{}` was lost while the response streamed",
            self.key
        )
    }
}

impl std::error::Error for LeaseLostWhileStreaming {}

impl LeaseLostWhileStreaming {
    pub(crate) fn new(key: String) -> LeaseLostWhileStreaming {
        LeaseLostWhileStreaming { key }
    }
}

/// What a [`LockBody`] holds besides the body; boxed in it, since most responses are complete
/// at once and their lease is released before the body is handed on.
enum Hold {
    Holding {
        lease: Lease,
        lost: BoxFuture,
        /// The bytes still to come of a body whose length was declared. The server stops
        /// polling such a body once it wrote the last declared byte and drops it, so its end
        /// is never seen; the frame that completes the length counts as the end instead.
        left: Option<u64>,
    },
    /// The inner body ended, or failed; the final frame or the error (if any) waits until the
    /// release is done, so a client that reads the whole response, or sees it cut off, and
    /// sends the next request never finds its own lease still in place.
    Releasing {
        release: BoxFuture,
        pending: Option<Result<Frame<Bytes>, BoxError>>,
    },
}

/// A frame the layer already took from the inner body, handed on first. Data (the usual case)
/// is kept inline; trailers or an error, which would make every `LockBody` several times
/// larger, are boxed.
enum Prefix {
    None,
    Data(Bytes),
    Other(Box<Result<Frame<Bytes>, BoxError>>),
}

/// What a relay hands over: the frames of a body read by a task of the layer's own, then
/// `None` once the body ended well. A channel that closes without that `None` (the task
/// panicked, or its runtime shut down) ends the body with [`RelayBroken`], never cleanly.
pub(crate) type Relay = tokio::sync::mpsc::Receiver<Option<Result<Frame<Bytes>, BoxError>>>;

/// The task relaying a response body stopped before the body ended; the body ends with this
/// error, so the client sees a cut-off response rather than a short one that looks whole.
///
/// ```
/// use lock_tower::{BoxError, LeaseLostWhileStreaming, RelayBroken};
///
/// // Either way the client got a cut-off response and should send the request again.
/// fn cut_off(e: &BoxError) -> bool {
///     e.is::<LeaseLostWhileStreaming>() || e.is::<RelayBroken>()
/// }
///
/// let err: BoxError = Box::new(RelayBroken);
/// assert!(cut_off(&err));
/// assert!(!cut_off(&BoxError::from("connection reset")));
/// ```
#[derive(Debug)]
pub struct RelayBroken;

impl fmt::Display for RelayBroken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the response body's relay stopped before the body ended")
    }
}

impl std::error::Error for RelayBroken {}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Local { #[pin] body: Full<Bytes> },
        // `None` once the relay ended, so the end is reported without polling it again.
        Relayed { rx: Option<Relay>, hint: SizeHint },
    }
}

pin_project! {
    /// The response body of [`LockLayer`](crate::LockLayer) and
    /// [`DedupeLayer`](crate::DedupeLayer): the handler's body (or the layer's own answer) with
    /// the lease attached.
    ///
    /// While it streams, the lease stays renewed. When it ends, the lease is released before the
    /// last frame is handed on; when it is dropped unfinished (the client went away), the lease
    /// is released in the background. If the lease is lost meanwhile, the body ends with
    /// [`LeaseLostWhileStreaming`].
    ///
    /// ```
    /// use axum::{body::Body, handler::HandlerWithoutStateExt};
    /// use http_body_util::BodyExt;
    /// use lock_core::{LockOptions, Locker};
    /// use lock_tower::{KeyExtractor, LockBody, LockLayer};
    /// use tower_layer::Layer;
    /// use tower_service::Service;
    ///
    /// async fn statement() -> &'static str {
    ///     "balance: 120.00"
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let locker = Locker::memory();
    /// let layer = LockLayer::new(locker.clone(), KeyExtractor::path_segment(1));
    /// let mut svc = layer.layer(statement.into_service());
    /// let req = http::Request::get("/accounts/7/statement").body(Body::empty())?;
    /// let res: http::Response<LockBody<Body>> = svc.call(req).await?;
    /// assert_eq!(res.into_body().collect().await?.to_bytes(), "balance: 120.00");
    /// // The body ended, so the lease is already released.
    /// locker.try_acquire("7", &LockOptions::new()).await?;
    /// # Ok(()) }
    /// ```
    pub struct LockBody<B> {
        #[pin]
        kind: Kind<B>,
        prefix: Prefix,
        hold: Option<Box<Hold>>,
    }
}

impl<B> fmt::Debug for LockBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hold = match self.hold.as_deref() {
            None => "none",
            Some(Hold::Holding { .. }) => "holding",
            Some(Hold::Releasing { .. }) => "releasing",
        };
        f.debug_struct("LockBody")
            .field("hold", &hold)
            .finish_non_exhaustive()
    }
}

impl<B> LockBody<B> {
    /// The inner body as it is, with no lease.
    pub(crate) fn pass(body: B) -> Self {
        LockBody {
            kind: Kind::Inner { body },
            prefix: Prefix::None,
            hold: None,
        }
    }

    /// A body the layer produced itself.
    pub(crate) fn local(body: Full<Bytes>) -> Self {
        LockBody {
            kind: Kind::Local { body },
            prefix: Prefix::None,
            hold: None,
        }
    }

    /// The inner body, keeping `lease` until it ends, or until `declared` bytes (the length the
    /// response head announces, counting a frame handed on first with [`after`](Self::after))
    /// went out.
    pub(crate) fn holding(body: B, lease: Lease, declared: Option<u64>) -> Self {
        let info = lease.info();
        LockBody {
            kind: Kind::Inner { body },
            prefix: Prefix::None,
            hold: Some(Box::new(Hold::Holding {
                lease,
                lost: Box::pin(async move { info.lost().await }),
                left: declared,
            })),
        }
    }

    /// `prefix` first, then the frames a task of the layer sends through `rx`; `hint` is the
    /// size of what is still to come through it.
    pub(crate) fn relayed(prefix: Bytes, rx: Relay, hint: SizeHint) -> Self {
        LockBody {
            kind: Kind::Relayed { rx: Some(rx), hint },
            prefix: Prefix::Data(prefix),
            hold: None,
        }
    }

    /// This body, with a frame already taken from the inner body handed on first.
    pub(crate) fn after(mut self, first: Result<Frame<Bytes>, BoxError>) -> Self {
        self.prefix = match first.map(Frame::into_data) {
            Ok(Ok(data)) => Prefix::Data(data),
            Ok(Err(frame)) => Prefix::Other(Box::new(Ok(frame))),
            Err(e) => Prefix::Other(Box::new(Err(e))),
        };
        self
    }
}

/// Takes a relayed data frame off the size still to come.
fn shrink(hint: &mut SizeHint, frame: &Frame<Bytes>) {
    let n = frame.data_ref().map_or(0, |d| d.len() as u64);
    let mut left = SizeHint::new();
    // Upper first: `set_lower` refuses a lower bound above the current upper one.
    if let Some(u) = hint.upper() {
        left.set_upper(u.saturating_sub(n));
    }
    left.set_lower(hint.lower().saturating_sub(n));
    *hint = left;
}

/// Counts a data frame against the declared length of a held body; true when it is the frame
/// that completes it, which must then be treated as the body's end.
fn completes_declared(hold: &mut Option<Box<Hold>>, frame: &Frame<Bytes>) -> bool {
    let Some(Hold::Holding {
        left: Some(left), ..
    }) = hold.as_deref_mut()
    else {
        return false;
    };
    let Some(data) = frame.data_ref() else {
        return false;
    };
    *left = left.saturating_sub(data.len() as u64);
    *left == 0
}

impl<B> Body for LockBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        loop {
            if let Some(Hold::Releasing { release, pending }) = this.hold.as_deref_mut() {
                ready!(release.as_mut().poll(cx));
                let frame = pending.take();
                *this.hold = None;
                return Poll::Ready(frame);
            }
            if let Some(Hold::Holding { lease, lost, .. }) = this.hold.as_deref_mut()
                && lost.as_mut().poll(cx).is_ready()
            {
                let key = lease.key().to_owned();
                tracing::warn!(key = %key, "lease lost while the response streamed");
                // Dropping the guard stops renewal; there is nothing left to release.
                *this.hold = None;
                return Poll::Ready(Some(Err(Box::new(LeaseLostWhileStreaming { key }))));
            }
            let (frame, at_end) = match std::mem::replace(this.prefix, Prefix::None) {
                // A prefix is handed on before the rest of the body, so it is never the end.
                Prefix::Data(data) => (Some(Ok(Frame::data(data))), false),
                Prefix::Other(first) => (Some(*first), false),
                Prefix::None => match this.kind.as_mut().project() {
                    KindProj::Inner { mut body } => {
                        let f = ready!(body.as_mut().poll_frame(cx));
                        let f = f.map(|r| r.map_err(Into::into));
                        (f, body.is_end_stream())
                    }
                    KindProj::Local { mut body } => {
                        let f = ready!(body.as_mut().poll_frame(cx));
                        let f = f.map(|r| r.map_err(|never| match never {}));
                        (f, body.is_end_stream())
                    }
                    KindProj::Relayed { rx, hint } => {
                        let f = match rx {
                            Some(r) => match ready!(r.poll_recv(cx)) {
                                Some(item) => item,
                                None => Some(Err(Box::new(RelayBroken) as BoxError)),
                            },
                            None => None,
                        };
                        match &f {
                            Some(Ok(frame)) => shrink(hint, frame),
                            _ => *rx = None,
                        }
                        (f, rx.is_none())
                    }
                },
            };
            match frame {
                // Trailers are a body's last frame: servers send them and drop the body without
                // polling it again, whatever `is_end_stream` says.
                Some(Ok(f))
                    if !at_end && !f.is_trailers() && !completes_declared(this.hold, &f) =>
                {
                    return Poll::Ready(Some(Ok(f)));
                }
                // The body is complete (it ended, its declared length is reached, or its
                // trailers came) or failed: release first (if holding), then hand on the last
                // frame or the error.
                end => {
                    let pending = end;
                    match this.hold.take().map(|hold| *hold) {
                        Some(Hold::Holding { lease, .. }) => {
                            *this.hold = Some(Box::new(Hold::Releasing {
                                // A task, so a client hanging up during the release
                                // (dropping this body) cannot cut it short.
                                release: Box::pin(async move {
                                    if let Ok(outcome) = tokio::spawn(lease.release()).await {
                                        crate::lock::service::log_release(outcome);
                                    }
                                }),
                                pending,
                            }));
                        }
                        _ => return Poll::Ready(pending),
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // While a lease is attached the body must be polled to its end, or the release would
        // only happen on drop.
        self.hold.is_none()
            && matches!(self.prefix, Prefix::None)
            && match &self.kind {
                Kind::Inner { body } => body.is_end_stream(),
                Kind::Local { body } => body.is_end_stream(),
                Kind::Relayed { rx, .. } => rx.is_none(),
            }
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Local { body } => body.size_hint(),
            Kind::Relayed { hint, .. } => *hint,
        };
        let n = match &self.prefix {
            Prefix::None => None,
            Prefix::Data(data) => Some(data.len() as u64),
            Prefix::Other(first) => match &**first {
                Ok(f) => Some(f.data_ref().map_or(0, |d| d.len() as u64)),
                Err(_) => None,
            },
        };
        if let Some(n) = n {
            let mut shifted = SizeHint::new();
            // Upper first: `set_lower` refuses a lower bound above the current upper one.
            if let Some(u) = hint.upper() {
                shifted.set_upper(u.saturating_add(n));
            }
            shifted.set_lower(hint.lower().saturating_add(n));
            hint = shifted;
        }
        hint
    }
}
