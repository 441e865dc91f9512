use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, instrument};

use crate::backend::{AnyBackend, Backend};
use crate::error::{Error, Result};
use crate::locker::Core;
use crate::renew::{Cmd, Dropped, LeaseState};
use crate::turnstile::TurnHandle;
use crate::types::{Fence, LockKey, Token, drift, warn_ahead};

/// What [`Lease::release`] found on the server.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::{LockOptions, Locker, Release};
/// let lease = Locker::memory().acquire("k", &LockOptions::new()).await?;
/// match lease.release().await? {
///     Release::Released => println!("released"),
///     Release::NotHeld => println!("it had expired: check what was written meanwhile"),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// This holder still held the lease, and it is now deleted.
    Released,
    /// The lease had already expired or been taken by another holder; nothing was touched.
    NotHeld,
}

/// A held lease: the guard returned by [`Locker::acquire`](crate::Locker::acquire).
///
/// While it lives (and renewal is on) the lease is renewed at about a third of its TTL. When
/// renewal is refused, or none gets through in time, [`lost`](Lease::lost) resolves before the
/// local deadline: the lease counts as lost 2.5% of its TTL + 3 ms ahead of it (the TTL of the
/// request that set the deadline: after an unanswered short extend, that short TTL's), which
/// leaves room for a late timer and a busy CPU (a process starved for longer hears of it late). Dropping the guard stops renewal at once and releases it in the
/// background; [`release`](Lease::release) does so in the foreground and reports what it found.
/// Either way, the next waiter of the same [`Locker`](crate::Locker) takes its turn once the
/// release is in line ahead of its acquire (see [`release`](Lease::release)), or answered on
/// a backend that cannot tell; for a dropped guard, at the latest when the lease runs out.
/// The background release is work on the runtime: a guard dropped as the runtime shuts down
/// (at the end of `main`) is usually not released, and its key stays held for its TTL, so
/// release it before the program ends.
///
/// ```
/// use lock_core::{Locker, LockOptions, Release};
/// use std::time::Duration;
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// let locker = Locker::memory();
/// let lease = locker.acquire("invoice:42", &LockOptions::new().ttl(Duration::from_secs(5))).await?;
/// assert!(lease.remaining() <= Duration::from_secs(5));
/// println!("fence {}", lease.fence());
/// assert_eq!(lease.release().await?, Release::Released);
/// # Ok(()) }
/// ```
pub struct Lease<B: Backend + Clone = AnyBackend> {
    pub(crate) core: Arc<Core<B>>,
    pub(crate) id: u64,
    pub(crate) key: LockKey,
    pub(crate) token: Token,
    pub(crate) fence: Fence,
    pub(crate) state: Arc<LeaseState>,
    /// Whether the renewal driver tracks this lease; leases without renewal never touch it.
    pub(crate) renewing: bool,
    /// This key's turn among the locker's waiters, when the lease came from waiting.
    pub(crate) turn: Option<TurnHandle>,
    /// Taken by each explicit extend for its whole trip: two extends of one lease never
    /// travel at once (see [`extend`](Self::extend)).
    pub(crate) extends: tokio::sync::Mutex<()>,
    pub(crate) done: bool,
}

impl<B: Backend + Clone> std::fmt::Debug for Lease<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key.key())
            .field("fence", &self.fence)
            .field("remaining", &self.remaining())
            .finish_non_exhaustive()
    }
}

impl<B: Backend + Clone> Lease<B> {
    /// The fence of this grant; strictly greater than every earlier grant's on the same key.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    /// let locker = Locker::memory();
    /// let a = locker.acquire("k", &LockOptions::new()).await?;
    /// let first = a.fence();
    /// a.release().await?;
    /// let b = locker.acquire("k", &LockOptions::new()).await?;
    /// assert!(b.fence() > first);
    /// # b.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn fence(&self) -> Fence {
        self.fence
    }

    /// The random token naming this acquisition.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    /// let locker = Locker::memory();
    /// let lease = locker.acquire("k", &LockOptions::new()).await?;
    /// assert_eq!(lease.token().as_str().len(), 32);
    /// # lease.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn token(&self) -> &Token {
        &self.token
    }

    /// The key as the caller named it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    /// let locker = Locker::memory();
    /// let lease = locker.acquire("invoice:42", &LockOptions::new()).await?;
    /// assert_eq!(lease.key(), "invoice:42");
    /// # lease.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn key(&self) -> &str {
        self.key.key()
    }

    /// Time left on the lease, measured on the local monotonic clock from before the request
    /// that granted or last renewed it, less the drift allowance. Never more than the truth
    /// while that clock runs (a suspended machine's does not count the suspension, while the
    /// server's TTL does); zero once the lease is lost (which, unrenewed, it is a little before
    /// this reaches zero).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    /// let locker = Locker::memory();
    /// use std::time::Duration;
    /// let lease = locker.acquire("k", &LockOptions::new().ttl(Duration::from_secs(2))).await?;
    /// let left = lease.remaining();
    /// assert!(left > Duration::ZERO && left < Duration::from_secs(2));
    /// # lease.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn remaining(&self) -> Duration {
        self.state.remaining()
    }

    /// Whether the lease is known to be lost: released, refused on renewal, or unrenewed
    /// within 2.5% of the TTL + 3 ms of its local deadline. A renewal answered after that does
    /// not make it false again (the holder may already have stopped on [`lost`](Self::lost)),
    /// and renewal of it stops.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    /// let locker = Locker::memory();
    /// use std::time::Duration;
    /// let opts = LockOptions::new().ttl(Duration::from_millis(500)).renew(false);
    /// let lease = locker.acquire("k", &opts).await?;
    /// assert!(!lease.is_lost());
    /// tokio::time::sleep(Duration::from_millis(600)).await;
    /// assert!(lease.is_lost());
    /// # Ok(()) }
    /// ```
    pub fn is_lost(&self) -> bool {
        self.state.is_lost()
    }

    /// Resolves when the lease is lost (renewal refused, or none through in time), before the
    /// local deadline.
    ///
    /// Race the work against it, so that work stops instead of running unprotected:
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    /// let locker = Locker::memory();
    /// use std::time::Duration;
    /// let opts = LockOptions::new().ttl(Duration::from_millis(50)).renew(false);
    /// let lease = locker.acquire("report", &opts).await?;
    /// let work = tokio::time::sleep(Duration::from_secs(10)); // longer than the lease
    /// tokio::select! {
    ///     _ = work => unreachable!("the lease ran out first"),
    ///     _ = lease.lost() => println!("lease lost: work stopped"),
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// [`Locker::with_lock`](crate::Locker::with_lock) does this for you.
    pub async fn lost(&self) {
        self.state.wait_lost().await
    }

    /// A cheap, cloneable view of this lease for code that must not own the guard.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    /// let locker = Locker::memory();
    /// let lease = locker.acquire("k", &LockOptions::new()).await?;
    /// let info = lease.info();
    /// assert_eq!((info.key(), info.fence()), (lease.key(), lease.fence()));
    /// lease.release().await?;
    /// assert!(info.is_lost()); // the view follows the lease
    /// # Ok(()) }
    /// ```
    pub fn info(&self) -> LeaseInfo {
        LeaseInfo {
            // The shared names, not a copy of the key: a view per request must not allocate.
            key: self.key.clone(),
            fence: self.fence,
            state: self.state.clone(),
        }
    }

    /// Resets the lease's TTL to `ttl` if this holder still holds it; later automatic renewals
    /// use the new TTL. A shorter TTL shortens the lease from the moment the extend is sent
    /// ([`remaining`](Self::remaining) and [`lost`](Self::lost) follow the new expiry), also
    /// when the call fails or its caller stops waiting, since it may have landed; a longer one
    /// counts once answered. Returns [`Error::LeaseLost`] (and marks the lease lost) if this
    /// holder no longer holds it, or if the lease was already lost: loss is final.
    ///
    /// Once a renewal or extend of this lease went unanswered or failed (or its acquire was
    /// answered only by a retry), that request may still reach the server later and set its
    /// own TTL from then, so from that point the lease counts every deadline, this one's
    /// included, with no longer a TTL than that request's: a longer extend is set on the
    /// server, but `remaining` does not count past what the stray request could leave. (Every
    /// failed extend counts so, even one the server refused outright: on a quorum, members
    /// may have run what the majority did not.)
    ///
    /// Poll the returned future to its end, or drop it: automatic renewal waits while an
    /// extend is on its way, so one left pending and unpolled (a `select!` branch that lost,
    /// kept for later) holds renewal off until it is polled again or dropped, and the lease
    /// can be lost meanwhile.
    ///
    /// Extends of one lease run one at a time: a second caller waits for the first's answer
    /// before sending its own. While two travel at once, neither answer can tell which ran
    /// last on the server, so each could only count up to the earlier deadline of the two;
    /// callers extending in a loop from two tasks would then see the lease run down, and be
    /// told it was lost, while every extend succeeded.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> lock_core::Result<()> {
    /// use std::time::Duration;
    /// use lock_core::{LockOptions, Locker};
    ///
    /// let locker = Locker::memory();
    /// let lease = locker.try_acquire("batch", &LockOptions::new().renew(false)).await?;
    /// lease.extend(Duration::from_secs(5)).await?;
    /// assert!(lease.remaining() <= Duration::from_secs(5));
    /// lease.release().await?;
    /// # Ok(()) }
    /// ```
    #[instrument(level = "debug", skip(self), fields(key = self.key.key()))]
    pub async fn extend(&self, ttl: Duration) -> Result<()> {
        crate::types::validate_ttl(ttl)?;
        let _one_at_a_time = self.extends.lock().await;
        // Loss is final: the holder may already have stopped on `lost()`, so a lost lease is
        // not extended back to life (the server's key, if still ours, expires or is released
        // on drop).
        if self.state.is_lost() {
            self.state.lost.cancel();
            return Err(Error::LeaseLost {
                key: self.key.key().to_owned(),
            });
        }
        // From the moment it is sent, the extend may land and set the server's expiry to `ttl`,
        // whether or not an answer comes back to us: a shorter TTL shortens the local deadline
        // now, and until the extend is answered, its failure or a caller that gives up waiting
        // (a timeout around this future) counts it as maybe landed (see `MaybeExtended`).
        let deadline = Instant::now() + ttl - drift(ttl);
        self.state.extending(deadline, warn_ahead(ttl));
        let mut unanswered = MaybeExtended {
            lease: self,
            deadline,
            ttl,
        };
        // Taken after the line above marked the extend as sent, so that its answer counts as
        // an extend's and not as a reply overtaken by one.
        let start = Instant::now();
        let held = self
            .core
            .backend
            .extend(&[(self.key.clone(), self.token.clone())], ttl)
            .await?;
        // One answer per item is the backend's contract; any other count says nothing about
        // this lease, so the extend stays one that may have landed (`unanswered` is dropped).
        let [held] = held[..] else {
            return Err(Error::OutcomeUnknown {
                op: "extend",
                key: self.key.key().to_owned(),
                source: redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "the backend answered an extend of one lease with another number of answers",
                    format!("{} answers", held.len()),
                )),
            });
        };
        unanswered.ttl = Duration::ZERO;
        if held {
            if !self
                .state
                .extended(start, start + ttl - drift(ttl), warn_ahead(ttl), ttl)
            {
                // Lost while the extend was on its way (its alarm passed): as above.
                return Err(Error::LeaseLost {
                    key: self.key.key().to_owned(),
                });
            }
            if self.renewing {
                self.core.send(Cmd::Retune { id: self.id, ttl });
            }
            Ok(())
        } else {
            self.state.lost.cancel();
            Err(Error::LeaseLost {
                key: self.key.key().to_owned(),
            })
        }
    }

    /// Stops renewal and deletes the lease if this holder still holds it. Idempotent on the
    /// server: a lease that expired or passed to another holder is reported as
    /// [`Release::NotHeld`] and left alone.
    ///
    /// The next holder may be granted the key before this returns, a waiter of this same
    /// [`Locker`](crate::Locker) included: on a Redis/Valkey server or a Redlock quorum, the
    /// next local waiter's acquire is sent as soon as the release is in line ahead of it on the
    /// connection, not when the release is answered. This lease's [`lost`](Self::lost) signal
    /// (and its [`LeaseInfo`]'s) fires when the answer comes.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    /// let locker = Locker::memory();
    /// use lock_core::Release;
    /// use std::time::Duration;
    /// let lease = locker.acquire("k", &LockOptions::new()).await?;
    /// assert_eq!(lease.release().await?, Release::Released);
    ///
    /// let short = LockOptions::new().ttl(Duration::from_millis(20)).renew(false);
    /// let lapsed = locker.acquire("k", &short).await?;
    /// tokio::time::sleep(Duration::from_millis(40)).await;
    /// assert_eq!(lapsed.release().await?, Release::NotHeld); // expired: nothing touched
    /// # Ok(()) }
    /// ```
    #[instrument(level = "debug", skip(self), fields(key = self.key.key(), fence = self.fence.0))]
    pub async fn release(mut self) -> Result<Release> {
        // A renewal still on its way that finds the key deleted by this release is not a loss.
        self.state
            .releasing
            .store(true, std::sync::atomic::Ordering::Release);
        if self.renewing {
            self.core.send(Cmd::Remove {
                id: self.id,
                release: None,
            });
        }
        let answer = self.release_on_server().await;
        // Answered, either way: nothing is left for `Drop` to do. A release cancelled before
        // this point (its caller dropped it mid-call) leaves `done` unset, and `Drop` sends it
        // again in the background: it may not have reached the server.
        self.done = true;
        // Ended for every view of it whatever the answer: renewal has stopped, and after a
        // failed release the key may be gone (or held by another) already. Not before the
        // answer: `info().lost()` would tell watchers the lease is over while the server may
        // still hold it, and waiters watching this lease would take the turn before the
        // release is in line ahead of their acquire.
        self.state.lost.cancel();
        let held = answer?;
        self.vacate_turn();
        debug!(held, "released");
        Ok(if held {
            Release::Released
        } else {
            Release::NotHeld
        })
    }
}

impl<B: Backend + Clone> Lease<B> {
    /// The token-checked delete, asked twice when the first answer was lost.
    async fn release_on_server(&self) -> Result<bool> {
        // The next local waiter goes once the release is in line on the connection: its
        // acquire reaches the server behind the release, a round trip sooner than if it waited
        // for the answer. Only the turn goes early; the lease ends for every other view of it
        // when the answer comes.
        let first = match &self.turn {
            Some(turn) => {
                let turn = turn.hand_on(self.state.clone());
                (self.core.backend)
                    .release_in_line(&self.key, &self.token, move || drop(turn))
                    .await
            }
            None => self.core.backend.release(&self.key, &self.token).await,
        };
        let held = match first {
            Ok(held) => held,
            // A token-checked delete is safe to repeat; only the second answer can be ambiguous.
            // So after a reply lost or unreadable (the first delete may have run).
            Err(e) if e.may_have_landed() => {
                let source = match e {
                    Error::OutcomeUnknown { source, .. } | Error::Unavailable(source) => source,
                    other => return Err(other),
                };
                match self.core.backend.release(&self.key, &self.token).await {
                    Ok(true) => true,
                    // The lease is gone, but whether the first delete took it or it had
                    // already expired is unknown: the first call's failure is the cause.
                    Ok(false) => {
                        return Err(Error::OutcomeUnknown {
                            op: "release",
                            key: self.key.key().to_owned(),
                            source,
                        });
                    }
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        Ok(held)
    }

    fn vacate_turn(&self) {
        if let Some(turn) = &self.turn {
            turn.vacate(&self.state);
        }
    }
}

/// An explicit extend sent and not settled yet; dropped, it tells the lease state the extend is
/// over. Dropped unanswered (the call failed, or its caller's future was dropped), the extend
/// may still have landed: the deadline may only shorten to its expiry, and a renewal sent
/// meanwhile, which may have run before it on the server (another connection, a quorum member,
/// a resent call), may no longer lengthen it.
struct MaybeExtended<'a, B: Backend + Clone> {
    lease: &'a Lease<B>,
    deadline: Instant,
    /// The extend's TTL; zero once it was answered.
    ttl: Duration,
}

impl<B: Backend + Clone> Drop for MaybeExtended<'_, B> {
    fn drop(&mut self) {
        let lease = self.lease;
        if !self.ttl.is_zero() {
            lease
                .state
                .maybe_extended(self.deadline, warn_ahead(self.ttl), self.ttl);
            if lease.renewing {
                // The deadline may have moved closer: the next renewal must come by halfway
                // to it, not on the schedule of the longer TTL, or the lease is lost at the
                // shortened deadline with no renewal tried.
                lease.core.send(Cmd::Rescheduled { id: lease.id });
            }
        }
        lease.state.extend_settled();
    }
}

impl<B: Backend + Clone> Drop for Lease<B> {
    fn drop(&mut self) {
        if self.done {
            // Also after a failed release: the next waiter must not wait for the lease's
            // deadline.
            self.vacate_turn();
            return;
        }
        // The turn goes on once the background release is in line ahead of the next waiter's
        // acquire (or as soon as it cannot be sent: the `HandOn` goes with it, and hands on
        // wherever it is dropped). Handed on now, the waiter would ask while the key is still
        // held, and pay a subscription and another round trip for it.
        let hand_on = self.turn.as_ref().map(|t| t.leave(self.state.clone()));
        self.state.lost.cancel();
        let mut dropped = Dropped {
            key: self.key.clone(),
            token: self.token.clone(),
            hand_on,
        };
        if self.renewing {
            if !self.core.driver_can_run() {
                // The release waits in the queue for a driver some later runtime starts: the
                // turn goes on now, not with it.
                dropped.hand_on = None;
            }
            // Never blocks: the driver stops renewing and releases on its own task.
            self.core.send(Cmd::Remove {
                id: self.id,
                release: Some(dropped),
            });
        } else if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let core = self.core.clone();
            rt.spawn(async move { dropped.release(&core.backend).await });
        } else {
            // Outside a runtime this thread cannot run the release, but the driver may be
            // running on another one (a multi-thread runtime's workers go on without this
            // thread); with none, the lease expires with its TTL (and the command, dropped,
            // hands the turn on).
            let _ = self.core.send_if_running(Cmd::Remove {
                id: self.id,
                release: Some(dropped),
            });
        }
    }
}

/// A cloneable view of a held lease: its key, fence, time left and lost signal.
///
/// ```
/// # #[tokio::main] async fn main() -> lock_core::Result<()> {
/// use lock_core::{LockOptions, Locker};
///
/// let locker = Locker::memory();
/// let lease = locker.try_acquire("export", &LockOptions::new()).await?;
/// let info = lease.info();
/// // Handed to code that must not own the guard (a spawned task, a request extension).
/// let watcher = tokio::spawn(async move {
///     tokio::select! {
///         _ = info.lost() => "lost",
///         _ = tokio::time::sleep(std::time::Duration::from_millis(10)) => "still held",
///     }
/// });
/// assert_eq!(watcher.await.unwrap(), "still held");
/// lease.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LeaseInfo {
    key: LockKey,
    fence: Fence,
    state: Arc<LeaseState>,
}

impl std::fmt::Debug for LeaseInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseInfo")
            .field("key", &self.key.key())
            .field("fence", &self.fence)
            .finish_non_exhaustive()
    }
}

impl LeaseInfo {
    /// The key as the caller named it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// # use lock_core::{LockOptions, Locker};
    /// # let lease = Locker::memory().acquire("job:9", &LockOptions::new()).await?;
    /// let info = lease.info();
    /// assert_eq!(info.key(), "job:9");
    /// # Ok(()) }
    /// ```
    pub fn key(&self) -> &str {
        self.key.key()
    }
    /// The fence of the grant.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// # use lock_core::{LockOptions, Locker};
    /// # let lease = Locker::memory().acquire("job:9", &LockOptions::new()).await?;
    /// let info = lease.info();
    /// assert_eq!(info.fence(), lease.fence());
    /// # Ok(()) }
    /// ```
    pub fn fence(&self) -> Fence {
        self.fence
    }
    /// Time left, as [`Lease::remaining`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// # use lock_core::{LockOptions, Locker};
    /// # let lease = Locker::memory().acquire("job:9", &LockOptions::new()).await?;
    /// let info = lease.info();
    /// assert!(info.remaining() > std::time::Duration::ZERO);
    /// # Ok(()) }
    /// ```
    pub fn remaining(&self) -> Duration {
        self.state.remaining()
    }
    /// Whether the lease is known to be lost.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// # use lock_core::{LockOptions, Locker};
    /// # let lease = Locker::memory().acquire("job:9", &LockOptions::new()).await?;
    /// let info = lease.info();
    /// assert!(!info.is_lost());
    /// drop(lease);
    /// assert!(info.is_lost());
    /// # Ok(()) }
    /// ```
    pub fn is_lost(&self) -> bool {
        self.state.is_lost()
    }
    /// Resolves when the lease is lost or released.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// # use lock_core::{LockOptions, Locker};
    /// # let lease = Locker::memory().acquire("job:9", &LockOptions::new()).await?;
    /// let info = lease.info();
    /// let watcher = tokio::spawn(async move { info.lost().await });
    /// lease.release().await?;
    /// watcher.await.expect("the watcher task"); // resolved by the release
    /// # Ok(()) }
    /// ```
    pub async fn lost(&self) {
        self.state.wait_lost().await
    }
}
