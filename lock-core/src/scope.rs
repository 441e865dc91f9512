//! Runtime support for `#[locked]` functions: the process-wide default locker, the fence of the
//! lease the current task runs under, and the hidden entry point the attribute expands to.

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tracing::{Instrument, debug_span, field, warn};

use crate::backend::{AnyBackend, Backend};
use crate::error::{Error, Result};
use crate::lease::{LeaseInfo, Release};
use crate::locker::{LockOptions, Locker};
use crate::types::Fence;

static DEFAULT_LOCKER: OnceLock<Locker<AnyBackend>> = OnceLock::new();

tokio::task_local! {
    static CURRENT: LeaseInfo;
}

/// Installs the locker that `#[locked]` functions without `locker = ...` use. Call it once at
/// start-up; the default cannot be replaced afterwards, so every call site sees the same one.
///
/// Returns [`Error::DefaultLockerAlreadySet`] (and keeps the first locker) if one is installed.
///
/// ```
/// use lock_core::{Locker, set_default_locker, default_locker, Error};
/// set_default_locker(Locker::memory())?;
/// assert!(default_locker().is_some());
/// assert!(matches!(set_default_locker(Locker::memory()), Err(Error::DefaultLockerAlreadySet)));
/// # Ok::<(), Error>(())
/// ```
pub fn set_default_locker(locker: Locker) -> Result<()> {
    DEFAULT_LOCKER
        .set(locker)
        .map_err(|_| Error::DefaultLockerAlreadySet)
}

/// The locker installed by [`set_default_locker`], if any.
///
/// ```
/// use lock_core::{Locker, default_locker, set_default_locker};
/// if default_locker().is_none() {
///     set_default_locker(Locker::memory())?;
/// }
/// let locker = default_locker().expect("installed above");
/// # let _ = locker;
/// # Ok::<(), lock_core::Error>(())
/// ```
pub fn default_locker() -> Option<Locker> {
    DEFAULT_LOCKER.get().cloned()
}

/// The fence of the lease the current task runs under, inside a `#[locked]` function's body
/// (the innermost one, when they nest); `None` elsewhere.
///
/// The value lives in a tokio task-local, so a task spawned from the body does not see it: pass
/// the fence to such a task explicitly.
///
/// ```
/// assert_eq!(lock_core::current_fence(), None);
/// ```
pub fn current_fence() -> Option<Fence> {
    CURRENT.try_with(LeaseInfo::fence).ok()
}

/// A view of the lease the current task runs under (key, fence, time left, lost signal), inside a
/// `#[locked]` function's body; `None` elsewhere. Same scope rules as [`current_fence`]. The
/// `#[locked]` attribute is in `lock-macros` (the `leasehold` facade's `macros` feature), whose
/// docs show it inside a body.
///
/// ```
/// assert!(lock_core::current_lease().is_none());
/// ```
pub fn current_lease() -> Option<LeaseInfo> {
    CURRENT.try_with(LeaseInfo::clone).ok()
}

/// What the `#[locked]` attribute expands to. Not a public API: its shape changes with the macro.
#[doc(hidden)]
pub mod __private {
    use super::*;
    pub use crate::error::Error;

    /// The return types a `#[locked]` function may have: `Result<T, E>` with `E: From<Error>`,
    /// so that busy, timeout and lease-lost can be returned as the function's own error.
    #[diagnostic::on_unimplemented(
        message = "a `#[locked]` function must return `Result<T, E>` with `E: From<leasehold::Error>`, not `{Self}`",
        label = "`#[locked]` returns busy, wait-timeout and lease-lost errors through this type",
        note = "if this is a `Result`, its error type needs `impl From<leasehold::Error>`"
    )]
    pub trait LockedOutput {
        /// The function's result for a failure of the lock itself.
        fn from_lock_error(err: Error) -> Self;
    }

    impl<T, E: From<Error>> LockedOutput for std::result::Result<T, E> {
        fn from_lock_error(err: Error) -> Self {
            Err(E::from(err))
        }
    }

    /// What `locker = ...` may name: a locker, a reference to one, or an `Arc` of one.
    #[diagnostic::on_unimplemented(
        message = "`locker = ...` must be a `Locker` (or a reference or `Arc` to one), not `{Self}`"
    )]
    pub trait LockerSource {
        /// The locker's backend.
        type Backend: Backend + Clone;
        /// A clone of the locker (cheap: lockers share their state).
        fn to_locker(&self) -> Locker<Self::Backend>;
    }

    impl<B: Backend + Clone> LockerSource for Locker<B> {
        type Backend = B;
        fn to_locker(&self) -> Locker<B> {
            self.clone()
        }
    }

    impl<L: LockerSource + ?Sized> LockerSource for &L {
        type Backend = L::Backend;
        fn to_locker(&self) -> Locker<L::Backend> {
            (**self).to_locker()
        }
    }

    impl<L: LockerSource + ?Sized> LockerSource for Arc<L> {
        type Backend = L::Backend;
        fn to_locker(&self) -> Locker<L::Backend> {
            (**self).to_locker()
        }
    }

    /// The default locker, or the error a call without one returns.
    pub fn default_locker() -> Result<Locker> {
        super::default_locker().ok_or(Error::NoDefaultLocker)
    }

    /// The attribute's arguments, evaluated at the call.
    pub struct Settings {
        /// The function's name, for the span.
        pub function: &'static str,
        /// `ttl = ...`; the [`LockOptions`] default when absent.
        pub ttl: Option<Duration>,
        /// `wait = ...`; absent means fail fast with [`Error::Busy`].
        pub wait: Option<Duration>,
        /// `renew = ...`; on when absent.
        pub renew: Option<bool>,
    }

    /// Acquires the lease on `key`, runs `body` under it with the fence in the task-local, and
    /// releases it. A lost lease drops `body` and returns [`Error::LeaseLost`]; a panicking body
    /// unwinds through here, and dropping the guard stops renewal and releases in the background.
    ///
    /// `from_lock_error` is [`LockedOutput::from_lock_error`], passed in rather than required as
    /// a bound so that a wrong return type is reported once, where the expansion names it.
    /// Never called: `if false { return never::<R>(); }` at the top of the body names its
    /// output type `R`, so that rustc checks its `?` and `return` against the function's written
    /// return type. A call of a function that returns `R`, not `!`, leaves no unreachable code
    /// for the expansion to allow (a crate that `forbid`s such a lint refuses an `allow`).
    pub fn never<R>() -> R {
        unreachable!("named by `#[locked]`'s expansion, never called")
    }

    pub async fn locked<B, R, Fut>(
        locker: Result<Locker<B>>,
        key: String,
        settings: Settings,
        from_lock_error: fn(Error) -> R,
        body: Fut,
    ) -> R
    where
        B: Backend + Clone,
        Fut: Future<Output = R>,
    {
        let span = debug_span!(
            "locked",
            function = settings.function,
            key = %key,
            fence = field::Empty
        );
        // Recorded on this span itself: with it disabled, `Span::current()` would be the
        // caller's, and a `fence` field of theirs would be overwritten.
        let own = span.clone();
        let run = async move {
            let locker = match locker {
                Ok(l) => l,
                Err(e) => return from_lock_error(e),
            };
            let mut opts = LockOptions::default();
            if let Some(ttl) = settings.ttl {
                opts = opts.ttl(ttl);
            }
            if let Some(renew) = settings.renew {
                opts = opts.renew(renew);
            }
            let acquired = match settings.wait {
                Some(wait) => locker.acquire(&key, &opts.wait(wait)).await,
                None => locker.try_acquire(&key, &opts).await,
            };
            let lease = match acquired {
                Ok(lease) => lease,
                Err(e) => return from_lock_error(e),
            };
            own.record("fence", lease.fence().0);
            let body = CURRENT.scope(lease.info(), body);
            tokio::select! {
                biased;
                _ = lease.lost() => from_lock_error(Error::LeaseLost { key }),
                out = body => {
                    // Lost meanwhile, though its `lost()` had not woken yet: as `with_lock`.
                    if lease.is_lost() {
                        return from_lock_error(Error::LeaseLost { key });
                    }
                    // The body finished while the lease was, as far as we knew, held: its result
                    // stands. A release that finds the lease gone is only worth a warning.
                    match lease.release().await {
                        Ok(Release::Released) => {}
                        Ok(Release::NotHeld) => warn!("lease had lapsed by the time the body finished"),
                        Err(e) => warn!(error = %e, "release failed; the lease expires with its ttl"),
                    }
                    out
                }
            }
        };
        run.instrument(span).await
    }
}
