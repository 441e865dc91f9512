//! One renewal driver per `Locker`: a single task that keeps every lease of that locker alive in
//! batches and marks a lease lost before its local deadline when renewal does not get through.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::backend::Backend;
use crate::turnstile::HandOn;
use crate::types::{LockKey, Token, drift, warn_ahead};

/// What a lease and the driver share: the validity deadline and the lost signal.
pub(crate) struct LeaseState {
    times: Mutex<Times>,
    pub(crate) lost: Lost,
    /// Set when the holder starts a release: a renewal answered "not held" after that found
    /// the key deleted by the release, which is no loss to warn of. Kept apart from `lost`,
    /// which fires once the release is answered: fired sooner, it would tell watchers the
    /// lease is over while the server may still hold it, and let the next local waiter take
    /// its turn before the release is in line ahead of its acquire.
    pub(crate) releasing: std::sync::atomic::AtomicBool,
    /// Woken when the alarm moves earlier (an extend to a shorter TTL), so that a `lost()`
    /// already asleep until the old alarm wakes at the new one.
    earlier: Notify,
}

/// A one-way flag with waiters: set once, when the lease is lost. Lighter than a
/// `CancellationToken` (no tree node to allocate and unlink), which counts on the path every
/// lease takes.
#[derive(Default)]
pub(crate) struct Lost {
    set: AtomicBool,
    waiters: Notify,
}

impl Lost {
    pub(crate) fn cancel(&self) {
        if !self.set.swap(true, Ordering::AcqRel) {
            self.waiters.notify_waiters();
        }
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    pub(crate) async fn cancelled(&self) {
        let notified = self.waiters.notified();
        tokio::pin!(notified);
        // Registered before the flag is read, so a `cancel` in between still wakes us.
        notified.as_mut().enable();
        if self.is_cancelled() {
            return;
        }
        notified.await;
    }
}

#[derive(Clone, Copy)]
struct Times {
    /// The end of validity on the local clock: from before the request that granted or last
    /// renewed the lease, less the drift allowance.
    deadline: Instant,
    /// When the lease counts as lost if nothing renewed it: [`warn_ahead`] before the deadline.
    alarm: Instant,
    /// When the reply of the last explicit [`Lease::extend`](crate::Lease::extend) arrived
    /// (`None` before one). A request sent before then may have reached the server after that
    /// extend and set the expiry last, so its reply may only shorten the deadline.
    extended_at: Option<Instant>,
    /// The TTL of the last explicit extend answered (`None` before one): renewals carry it
    /// from then on. Kept here, beside `extended_at`, rather than only in the driver's entry
    /// (which learns of it a command later), so that a renewal reads its TTL and the extend
    /// sets it in one order: a renewal that read the old TTL was sent before the extend's reply
    /// in that order, and its reply may then only shorten.
    renew_ttl: Option<Duration>,
    /// Explicit extends sent and not settled yet. While one travels, a renewal may run before
    /// or after it on the server (and its reply be handled before or after the extend's), so
    /// the server's expiry is whichever ran last: only the earlier of the two is sure.
    extends_out: u32,
    /// The earliest deadline an extend still travelling may set: a renewal answered meanwhile
    /// is not taken past it.
    extends_min: Option<Instant>,
    /// The earliest deadline of the requests answered (or lost) while an extend travelled,
    /// renewals and other extends: that extend may have run before them, so its answer is not
    /// taken past it.
    answered_cap: Option<Instant>,
    /// Renewals sent and not settled yet, and the earliest deadline one of them may set. One
    /// that read its TTL before an extend was sent may still reach the server after it (two
    /// tasks write to one connection in either order) and set the expiry last, so an extend
    /// answered meanwhile is not taken past it.
    renewals_out: u32,
    renewals_min: Option<Instant>,
    /// The shortest TTL of a request of this lease whose outcome is unknown (a renewal or an
    /// extend that failed or was given up unanswered). It may still reach the server at any
    /// later time, after requests sent since were answered: written to a connection that went
    /// silent and was replaced, its bytes can be delivered when the stall ends. Landing at
    /// some time `a`, it sets the expiry to `a` plus its TTL; so every later answer's deadline
    /// is counted with no longer a TTL than it, from that answer's own send time (before `a`,
    /// or the later request ran last and set the expiry itself). For the rest of the lease:
    /// nothing tells when such a request can no longer land.
    unknown_ttl: Option<Duration>,
}

impl Times {
    fn new(deadline: Instant, ahead: Duration) -> Times {
        Times {
            deadline,
            alarm: deadline.checked_sub(ahead).unwrap_or(deadline),
            extended_at: None,
            renew_ttl: None,
            extends_out: 0,
            extends_min: None,
            answered_cap: None,
            renewals_out: 0,
            renewals_min: None,
            unknown_ttl: None,
        }
    }

    fn set(&mut self, deadline: Instant, ahead: Duration) {
        *self = Times {
            deadline,
            alarm: deadline.checked_sub(ahead).unwrap_or(deadline),
            ..*self
        };
    }

    /// A request carrying `ttl` ended with its outcome unknown, or may otherwise reach the
    /// server later (see `unknown_ttl`).
    fn unknown(&mut self, ttl: Duration) {
        self.unknown_ttl = Some(self.unknown_ttl.map_or(ttl, |t| t.min(ttl)));
    }

    fn renewal_settled(&mut self) {
        self.renewals_out = self.renewals_out.saturating_sub(1);
        if self.renewals_out == 0 {
            self.renewals_min = None;
        }
    }

    fn sent_before_extend(&self, sent: Instant) -> bool {
        // `<=`: a clock too coarse (or paused) to tell the two apart counts the renewal as
        // sent first, which at worst applies it more cautiously than it needed.
        self.extended_at.is_some_and(|at| sent <= at)
    }
}

impl LeaseState {
    /// `ahead`: how long before `deadline` the loss is signalled ([`warn_ahead`] of the TTL).
    pub(crate) fn new(deadline: Instant, ahead: Duration) -> Arc<LeaseState> {
        Arc::new(LeaseState {
            times: Mutex::new(Times::new(deadline, ahead)),
            lost: Lost::default(),
            releasing: std::sync::atomic::AtomicBool::new(false),
            earlier: Notify::new(),
        })
    }

    fn times(&self) -> Times {
        *self.times.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// When the lease counts as lost unless renewed first.
    pub(crate) fn alarm(&self) -> Instant {
        self.times().alarm
    }

    /// The TTL a renewal sends now: the last answered extend's, else `granted` (the grant's);
    /// `None` while an explicit extend travels. A renewal sent then would run after the extend
    /// on the server and set the expiry last, but its reply could be handled before the
    /// extend's, whose answer would then claim a deadline the renewal had already cut short;
    /// the extend renews the lease itself, and the driver tries again a little later.
    /// A renewal that gets its TTL here counts as sent at `sent` until it is settled
    /// ([`renewed_next`](Self::renewed_next), or [`renewal_unknown`](Self::renewal_unknown)).
    pub(crate) fn renewal_ttl(&self, granted: Duration, sent: Instant) -> Option<Duration> {
        let mut t = self.times.lock().unwrap_or_else(PoisonError::into_inner);
        if t.extends_out > 0 {
            return None;
        }
        let ttl = t.renew_ttl.unwrap_or(granted);
        let deadline = sent + ttl - drift(ttl);
        t.renewals_out += 1;
        t.renewals_min = Some(t.renewals_min.map_or(deadline, |m| m.min(deadline)));
        Some(ttl)
    }

    /// A renewal sent at `sent` failed with its outcome unknown: it may have run, after an
    /// extend still travelling too, and set `deadline`.
    pub(crate) fn renewal_unknown(&self, deadline: Instant, ttl: Duration) {
        let mut t = self.times.lock().unwrap_or_else(PoisonError::into_inner);
        t.renewal_settled();
        t.unknown(ttl);
        if t.extends_out > 0 {
            t.answered_cap = Some(t.answered_cap.map_or(deadline, |c| c.min(deadline)));
        }
    }

    /// When to renew: at `planned`, unless the lease's alarm comes sooner than that allows. A
    /// reply that shortened the deadline (a renewal that ran after an extend to a longer TTL,
    /// or an extend to a shorter one) leaves the planned time, counted in the new TTL, after
    /// the alarm; halfway there leaves the renewal room to get through.
    fn renew_by(&self, planned: Instant) -> Instant {
        halfway_bound(planned, self.alarm())
    }

    /// A renewal sent at `sent` succeeded (see [`renewed_next`](Self::renewed_next)); `false`
    /// when the lease was already lost.
    #[cfg(test)]
    pub(crate) fn renewed(&self, sent: Instant, deadline: Instant, ahead: Duration) -> bool {
        self.renewal_answered(sent, deadline, ahead).is_some()
    }

    /// A renewal sent at `sent` succeeded. It moves the deadline forward only: a late reply of
    /// an older renewal must not shorten it. But one sent before an explicit extend's reply
    /// came may have run before or after that extend on the server, so it may only shorten;
    /// and while an extend travels, it is not taken past that extend's deadline.
    ///
    /// Loss is final: a reply that comes once the lease already counts as lost (its alarm
    /// passed, or loss was signalled) does not revive it, since `lost()` may have fired and
    /// its holder stopped; the lease is marked lost for good and `None` returned, and the
    /// driver stops renewing it.
    ///
    /// Otherwise it returns the lease's alarm after the reply and when to renew next: a third
    /// of the TTL renewals now carry (`granted`, unless an extend set another) after `sent`,
    /// but no later than halfway to the alarm. One look at the state, as the driver makes this
    /// call for every lease it renews.
    pub(crate) fn renewed_next(
        &self,
        sent: Instant,
        deadline: Instant,
        ahead: Duration,
        granted: Duration,
    ) -> Option<(Instant, Instant)> {
        let t = self.renewal_answered(sent, deadline, ahead)?;
        let ttl = t.renew_ttl.unwrap_or(granted);
        Some((t.alarm, halfway_bound(sent + ttl / 3, t.alarm)))
    }

    fn renewal_answered(&self, sent: Instant, deadline: Instant, ahead: Duration) -> Option<Times> {
        self.answered(sent, deadline, ahead, None)
    }

    /// An explicit extend sent at `sent` succeeded: the server's expiry is now the one it set,
    /// shorter or longer than before, so the deadline is set outright, though not past that of
    /// a renewal answered while it travelled. The same rules as
    /// [`renewed_next`](Self::renewed_next) hold for an extend sent before another extend's
    /// reply, and for one answered once the lease counts as lost (`false`: it stays lost).
    pub(crate) fn extended(
        &self,
        sent: Instant,
        deadline: Instant,
        ahead: Duration,
        ttl: Duration,
    ) -> bool {
        self.answered(sent, deadline, ahead, Some(ttl)).is_some()
    }

    /// An explicit extend about to be sent: from then on it may land and set the server's expiry
    /// to `deadline`, whether or not its answer ever comes back, so the local deadline may only
    /// shorten to it now. One that would lengthen it changes nothing yet.
    pub(crate) fn extending(&self, deadline: Instant, ahead: Duration) {
        {
            let mut t = self.times.lock().unwrap_or_else(PoisonError::into_inner);
            t.extends_out += 1;
            t.extends_min = Some(t.extends_min.map_or(deadline, |m| m.min(deadline)));
        }
        self.shorten(deadline, ahead, false);
    }

    /// An explicit extend is over, answered or not (after [`extended`](Self::extended) or
    /// [`maybe_extended`](Self::maybe_extended), if either): once none travels, renewals move
    /// the deadline as before.
    pub(crate) fn extend_settled(&self) {
        let mut t = self.times.lock().unwrap_or_else(PoisonError::into_inner);
        t.extends_out = t.extends_out.saturating_sub(1);
        if t.extends_out == 0 {
            t.extends_min = None;
            t.answered_cap = None;
        }
    }

    /// A request for this lease carrying `ttl` may still reach the server at any later time (an
    /// acquire's first send, answered by its retry): later deadlines are counted with no longer
    /// a TTL than it.
    pub(crate) fn may_land_late(&self, ttl: Duration) {
        self.times
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .unknown(ttl);
    }

    /// An explicit extend whose outcome is unknown (an error, or its caller gone before the
    /// answer): it may have set the server's expiry to `deadline`, so the local deadline may
    /// only shorten to it, and replies of renewals sent before now may have run before it on
    /// the server, so, as after an extend that answered, they may only shorten.
    pub(crate) fn maybe_extended(&self, deadline: Instant, ahead: Duration, ttl: Duration) {
        {
            let mut t = self.times.lock().unwrap_or_else(PoisonError::into_inner);
            t.unknown(ttl);
            if t.extends_out > 1 {
                // Another extend travelling may have run before this one.
                t.answered_cap = Some(t.answered_cap.map_or(deadline, |c| c.min(deadline)));
            }
        }
        self.shorten(deadline, ahead, true);
    }

    /// Shortens the deadline to `deadline` if that is earlier, marking later replies of
    /// renewals sent before now as overtaken when it does, or always with `mark`.
    fn shorten(&self, deadline: Instant, ahead: Duration, mark: bool) {
        let mut t = self.times.lock().unwrap_or_else(PoisonError::into_inner);
        let earlier = deadline < t.deadline;
        if mark || earlier {
            t.extended_at = Some(Instant::now());
        }
        if !earlier {
            return;
        }
        t.set(deadline, ahead);
        drop(t);
        // A `lost()` asleep until the old alarm must wake for the earlier one.
        self.earlier.notify_waiters();
    }

    /// A renewal or an extend (`extend_ttl`: its TTL) sent at `sent` succeeded with `deadline`;
    /// `None` (and the lease marked lost for good) when it already counted as lost.
    fn answered(
        &self,
        sent: Instant,
        deadline: Instant,
        ahead: Duration,
        extend_ttl: Option<Duration>,
    ) -> Option<Times> {
        let explicit = extend_ttl.is_some();
        let mut t = self.times.lock().unwrap_or_else(PoisonError::into_inner);
        // Judged under the lock that moves the alarm: looked at before taking it, the alarm
        // could pass in between, a reader see the lease lost, and this reply then move the
        // alarm on and make it look held again.
        if self.lost.is_cancelled() || t.alarm <= Instant::now() {
            if !explicit {
                t.renewal_settled();
            }
            drop(t);
            self.lost.cancel();
            return None;
        }
        let asked = deadline;
        let mut deadline = deadline;
        if let Some(ttl) = t.unknown_ttl {
            deadline = deadline.min(sent + ttl - drift(ttl));
        }
        if explicit {
            t.renew_ttl = extend_ttl;
            if t.extends_out > 1 {
                // Another extend travelling may have run before this one.
                let own = deadline;
                t.answered_cap = Some(t.answered_cap.map_or(own, |c| c.min(own)));
            }
            // A renewal answered while this extend travelled may have run after it, and so may
            // one still in flight (it may have reached the server after the extend), or another
            // extend still travelling (two callers extending one lease at once; the earliest
            // deadline of those travelling, this one's included, is then the cap).
            let others = (t.extends_out > 1).then_some(t.extends_min).flatten();
            for cap in [t.answered_cap, others, t.renewals_min]
                .into_iter()
                .flatten()
            {
                deadline = deadline.min(cap);
            }
        } else {
            t.renewal_settled();
        }
        if !explicit && t.extends_out > 0 {
            // An extend still travelling may run after this renewal, or may have run before it.
            t.answered_cap = Some(t.answered_cap.map_or(deadline, |c| c.min(deadline)));
            if let Some(min) = t.extends_min {
                deadline = deadline.min(min);
            }
        }
        // Capped by a shorter request's deadline: its margin is that of a lease that short, not
        // the longer TTL's (which could put the alarm before now).
        let ahead = if deadline < asked {
            ahead.min(warn_ahead(deadline.saturating_duration_since(sent)))
        } else {
            ahead
        };
        let before = t.alarm;
        // Sent before the last extend's reply came: it may have run before or after that extend
        // on the server, so it may only shorten. Explicit extends of one lease go one at a time
        // (the next is sent after the last one's answer was counted), so for one a tie is a clock
        // too coarse or paused to tell them apart, not an overtaking: it counts as sent after.
        let overtaken = if explicit {
            t.extended_at.is_some_and(|at| sent < at)
        } else {
            t.sent_before_extend(sent)
        };
        let takes = if overtaken {
            deadline < t.deadline
        } else {
            explicit || deadline > t.deadline
        };
        if takes {
            t.set(deadline, ahead);
            if explicit && !overtaken {
                t.extended_at = Some(Instant::now());
            }
        }
        let earlier = t.alarm < before;
        let after = *t;
        drop(t);
        if earlier {
            self.earlier.notify_waiters();
        }
        Some(after)
    }

    /// Resolves once the lease is lost: cancelled by the driver or a failed extend, or its
    /// alarm passed (the only signal a lease without renewal gets).
    pub(crate) async fn wait_lost(&self) {
        loop {
            // Registered before the alarm is read, so a move in between still wakes us.
            let earlier = self.earlier.notified();
            tokio::pin!(earlier);
            earlier.as_mut().enable();
            let alarm = self.alarm();
            tokio::select! {
                _ = self.lost.cancelled() => return,
                _ = earlier => {}
                _ = tokio::time::sleep_until(alarm) => {
                    // An extend may have moved the deadline while we slept.
                    if self.alarm() <= Instant::now() {
                        self.lost.cancel();
                        return;
                    }
                }
            }
        }
    }

    /// Whether the lease counts as lost. Seen once, for good: a lease whose alarm a reader saw
    /// pass is marked lost, so that a renewal answered a moment later cannot make it look held
    /// again (the reader may have stopped its work already).
    pub(crate) fn is_lost(&self) -> bool {
        if self.lost.is_cancelled() {
            return true;
        }
        if self.alarm() <= Instant::now() {
            self.lost.cancel();
            return true;
        }
        false
    }

    pub(crate) fn remaining(&self) -> Duration {
        let t = self.times();
        let now = Instant::now();
        if self.lost.is_cancelled() {
            return Duration::ZERO;
        }
        if t.alarm <= now {
            self.lost.cancel();
            return Duration::ZERO;
        }
        t.deadline.saturating_duration_since(now)
    }
}

/// `planned`, or halfway from now to `alarm` if that is sooner (see [`LeaseState::renew_by`]).
fn halfway_bound(planned: Instant, alarm: Instant) -> Instant {
    let now = Instant::now();
    planned.min(now + alarm.saturating_duration_since(now) / 2)
}

/// When a failed renewal is tried again: soon, and by halfway to the lease's alarm. The TTL
/// it renews with can be far longer than what is left (an extend to a short TTL of unknown
/// outcome caps the deadline, not the TTL), and a retry filed after the alarm would let one
/// brief refusal cost the lease. A millisecond at least, so an error that comes back at once
/// does not spin just before the alarm.
fn retry_at(e: &Entry) -> Instant {
    let now = Instant::now();
    let soon = now + (e.ttl / 10).min(Duration::from_millis(250));
    halfway_bound(soon, e.state.alarm()).max(now + Duration::from_millis(1))
}

pub(crate) enum Cmd {
    Add {
        id: u64,
        key: LockKey,
        token: Token,
        ttl: Duration,
        /// When the granting request was sent: the lease's validity counts from there, so its
        /// renewals must too.
        sent: Instant,
        state: Arc<LeaseState>,
    },
    Retune {
        id: u64,
        ttl: Duration,
    },
    /// The lease's deadline may have moved closer without a new TTL (an extend of unknown
    /// outcome): its next renewal is filed again, by halfway to the new alarm.
    Rescheduled {
        id: u64,
    },
    /// Stop tracking; with `release`, also release the lease in the background (guard dropped).
    Remove {
        id: u64,
        release: Option<Dropped>,
    },
}

/// A dropped guard's lease, to release in the background.
pub(crate) struct Dropped {
    pub(crate) key: LockKey,
    pub(crate) token: Token,
    /// The lease's turn, handed on once the release is in line (dropped, wherever it is).
    pub(crate) hand_on: Option<HandOn>,
}

impl Dropped {
    /// Releases the lease, handing its turn on once the release is in line.
    pub(crate) async fn release<B: Backend>(self, backend: &B) {
        let Dropped {
            key,
            token,
            hand_on,
        } = self;
        let first = match hand_on {
            Some(turn) => {
                backend
                    .release_in_line(&key, &token, move || drop(turn))
                    .await
            }
            None => backend.release(&key, &token).await,
        };
        match release_again_if_in_doubt(backend, &key, &token, first).await {
            Ok(held) => debug!(key = key.key(), held, "dropped lease released"),
            Err(e) => {
                warn!(key = key.key(), error = %e, "dropped lease not released; it expires with its TTL")
            }
        }
    }
}

/// A background release's answer once more, when the first gave none: its delete may never
/// have reached the server (a connection dropped before it went out), and nobody else will send
/// it, so the key would stay held for its TTL. A token-checked delete is safe to repeat; the
/// second answer is the one reported.
pub(crate) async fn release_again_if_in_doubt<B: Backend>(
    backend: &B,
    key: &LockKey,
    token: &Token,
    first: crate::error::Result<bool>,
) -> crate::error::Result<bool> {
    match first {
        Err(e) if e.may_have_landed() => {
            debug!(key = key.key(), error = %e, "background release got no verdict; sending it again");
            backend.release(key, token).await
        }
        other => other,
    }
}

impl Cmd {
    /// By when the driver must have seen this command; `None`: whenever it next looks.
    fn due(&self) -> Option<Instant> {
        match self {
            Cmd::Add { sent, ttl, .. } => Some(*sent + *ttl / 3),
            Cmd::Retune { .. } | Cmd::Rescheduled { .. } => Some(Instant::now()),
            // A dropped guard's release should not wait for the driver's next timer.
            Cmd::Remove {
                release: Some(_), ..
            } => Some(Instant::now()),
            Cmd::Remove { release: None, .. } => None,
        }
    }
}

/// How leases reach the driver. Commands queue here and the driver is woken only when one is
/// due before the driver's own next timer: a lease released within a third of its TTL (most
/// leases) then costs the driver nothing but skipping its add and remove in a later batch,
/// instead of two task wake-ups and four ordered-set updates.
pub(crate) struct Inbox {
    state: Mutex<InboxState>,
    wake: Notify,
    /// A driver task is alive for this inbox (cleared when its task ends or is dropped with
    /// its runtime), so that the next command starts another.
    pub(crate) running: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct InboxState {
    cmds: Vec<Cmd>,
    /// When the sleeping driver will look next; `None` while it is awake (it looks again
    /// before it sleeps).
    asleep_until: Option<Instant>,
    /// The earliest due time among the adds a release took back since the driver last took the
    /// queue (the commands it takes are filed with their own times). A driver with nothing to renew sleeps until then
    /// rather than indefinitely: otherwise, while every lease is released before the driver
    /// looks, each new add would find it asleep "forever" and wake it, one task wake-up per
    /// lease for nothing.
    earliest: Option<Instant>,
    /// Every `Locker` handle and lease is gone: drain what is queued and stop.
    closed: bool,
    /// Times the driver took the queue (tests count the wake-ups with it).
    #[cfg(test)]
    looks: usize,
}

/// Past this many queued commands the driver is woken anyway, which bounds the queue's memory
/// when leases are long and requests many.
pub(crate) const INBOX_LIMIT: usize = 1024;

/// How far back from the newest queued command a release looks for its lease's add: far enough
/// for a few dozen leases taken and released concurrently, short enough to cost little when
/// the add is not there.
const UNQUEUE_SCAN: usize = 64;

impl Inbox {
    pub(crate) fn new() -> Arc<Inbox> {
        Arc::new(Inbox {
            state: Mutex::new(InboxState::default()),
            wake: Notify::new(),
            running: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn push(&self, cmd: Cmd) {
        let due = cmd.due();
        let mut st = self.lock();
        if let Cmd::Remove { id, release: None } = cmd {
            // A lease released while its add still waits here (the common case) never reaches
            // the driver: both go at once, and the lease's key and state are freed now rather
            // than a batch later.
            let recent = st.cmds.len().saturating_sub(UNQUEUE_SCAN);
            if let Some(i) = st.cmds[recent..]
                .iter()
                .rposition(|c| matches!(c, Cmd::Add { id: added, .. } if *added == id))
            {
                let add = st.cmds.remove(recent + i);
                if let Some(due) = add.due() {
                    st.earliest = Some(st.earliest.map_or(due, |e| e.min(due)));
                }
                drop(st);
                drop(add);
                return;
            }
        }
        st.cmds.push(cmd);
        let wake = match (due, st.asleep_until) {
            (_, None) => false,
            (Some(due), Some(at)) => due < at || st.cmds.len() >= INBOX_LIMIT,
            (None, Some(_)) => st.cmds.len() >= INBOX_LIMIT,
        };
        if wake {
            // One wake-up is enough for everything queued until the driver looks.
            st.asleep_until = None;
        }
        drop(st);
        if wake {
            self.wake.notify_one();
        }
    }

    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.lock().cmds.len()
    }

    #[cfg(test)]
    pub(crate) fn looks(&self) -> usize {
        self.lock().looks
    }

    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_one();
    }
}

struct Entry {
    key: LockKey,
    token: Token,
    ttl: Duration,
    state: Arc<LeaseState>,
    /// The alarm this entry is filed under in `Driver::deadlines`.
    filed_deadline: Instant,
    /// When it is filed in `Driver::renews`; `None` while a renewal is in flight.
    filed_renew: Option<Instant>,
    /// When it may go early, with a batch sent for another lease's round, and the TTL it is
    /// filed under for that: its keys in `Driver::early` beside `filed_renew`.
    filed_early: (Duration, Instant),
    /// Whether `filed_renew` is the lease's next round (a third of its TTL after the last
    /// send), not a retry after a failure or a wait for an extend in flight. Only a round
    /// takes other leases along early: a lease retried every 250 ms while its node fails over
    /// would otherwise take every lease near its round along four times a second.
    planned: bool,
}

/// Leases due within this window of a due one renew in the same batch: early renewal is
/// harmless, and it turns many leases into few script calls.
const BATCH_WINDOW: Duration = Duration::from_millis(20);

/// How early a lease may renew to join a batch sent for another lease's round: a sixth of its
/// TTL (half its renewal interval), and at least [`BATCH_WINDOW`]. Leases renewed together
/// share a send time and so stay in step: leases of one TTL granted a moment apart (a burst
/// spread over a loaded machine, or over time) fall into one batch a round after their first
/// renewal, where a fixed window of a few milliseconds kept every phase it did not cover apart
/// for good, a call each per round. Only leases of the TTL of a lease whose round it is go
/// along (a script call carries one TTL, so a lease of another would go in a call of its own,
/// early for nothing).
fn batch_window(ttl: Duration) -> Duration {
    (ttl / 6).max(BATCH_WINDOW)
}

/// The leases of one batch: their ids and what the backend needs to renew them.
type Batch = (Vec<u64>, Vec<(LockKey, Token)>, Vec<Arc<LeaseState>>);

/// The leases of a renewal batch in flight, settled as of unknown outcome if the batch is
/// dropped unanswered (the driver's runtime shut down): a renewal counted as travelling for
/// ever would cap every later extend of its lease at the deadline it would have set.
struct Unsettled {
    states: Vec<Arc<LeaseState>>,
    deadline: Instant,
    ttl: Duration,
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        for state in &self.states {
            state.renewal_unknown(self.deadline, self.ttl);
        }
    }
}

type BatchResult = (
    Instant,
    Duration,
    Vec<u64>,
    crate::Result<Vec<Option<bool>>>,
);

/// Timers kept in ordered sets, so each wake-up costs O(log n) per lease it touches rather than a
/// scan of every lease.
#[derive(Default)]
struct Driver {
    entries: HashMap<u64, Entry>,
    deadlines: BTreeSet<(Instant, u64)>,
    renews: BTreeSet<(Instant, u64)>,
    /// The same leases by TTL, then by when each may go early (see [`batch_window`]).
    early: HashMap<Duration, BTreeSet<(Instant, u64)>>,
}

impl Driver {
    /// Files the lease's next round, at `at`.
    fn file_renew(&mut self, id: u64, at: Instant) {
        self.file(id, at, true);
    }

    /// Files a retry of the lease (after a failure, or while an extend travels), at `at`.
    fn file_retry(&mut self, id: u64, at: Instant) {
        self.file(id, at, false);
    }

    fn file(&mut self, id: u64, at: Instant, planned: bool) {
        self.unfile_renew(id);
        if let Some(e) = self.entries.get_mut(&id) {
            let early = if planned {
                at.checked_sub(batch_window(e.ttl)).unwrap_or(at)
            } else {
                at
            };
            e.filed_renew = Some(at);
            e.filed_early = (e.ttl, early);
            e.planned = planned;
            self.renews.insert((at, id));
            self.early.entry(e.ttl).or_default().insert((early, id));
        }
    }

    /// Takes the lease out of the renewal timers; whether it was filed for its round.
    fn unfile_renew(&mut self, id: u64) -> Option<bool> {
        let e = self.entries.get_mut(&id)?;
        let at = e.filed_renew.take()?;
        self.renews.remove(&(at, id));
        let (ttl, early) = e.filed_early;
        if let Some(set) = self.early.get_mut(&ttl) {
            set.remove(&(early, id));
            if set.is_empty() {
                self.early.remove(&ttl);
            }
        }
        Some(e.planned)
    }

    /// The first lease of TTL `ttl` whose time to go early has come by `now`.
    fn first_early(&self, ttl: Duration, now: Instant) -> Option<u64> {
        let &(early, id) = self.early.get(&ttl)?.first()?;
        (early <= now).then_some(id)
    }

    fn file_deadline(&mut self, id: u64) {
        if let Some(alarm) = self.entries.get(&id).map(|e| e.state.alarm()) {
            self.file_deadline_at(id, alarm);
        }
    }

    fn file_deadline_at(&mut self, id: u64, alarm: Instant) {
        if let Some(e) = self.entries.get_mut(&id) {
            self.deadlines.remove(&(e.filed_deadline, id));
            e.filed_deadline = alarm;
            self.deadlines.insert((alarm, id));
        }
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        self.unfile_renew(id);
        let e = self.entries.remove(&id)?;
        self.deadlines.remove(&(e.filed_deadline, id));
        Some(e)
    }

    fn next_wake(&self) -> Option<Instant> {
        let d = self.deadlines.first().map(|(t, _)| *t);
        let r = self.renews.first().map(|(t, _)| *t);
        match (d, r) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// Marks the inbox driverless when the driver's task ends: by returning, or by being dropped
/// with its runtime, also before it was first polled.
struct Running(Arc<Inbox>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0
            .running
            .store(false, std::sync::atomic::Ordering::Release);
    }
}

/// Starts the renewal driver of `inbox` on `runtime`; the caller has set `inbox.running`.
pub(crate) fn spawn<B: Backend + Clone>(
    runtime: &tokio::runtime::Handle,
    backend: B,
    inbox: Arc<Inbox>,
) {
    // Made before the task, and moved into it: a task dropped unpolled (its runtime shut down
    // first) still clears the flag, or no later runtime would start a driver.
    let running = Running(inbox.clone());
    runtime.spawn(async move {
        let _running = running;
        run(backend, inbox).await;
    });
}

async fn run<B: Backend + Clone>(backend: B, inbox: Arc<Inbox>) {
    let mut d = Driver::default();
    let mut inflight = FuturesUnordered::new();
    let mut cmds = Vec::new();
    loop {
        let (closed, earliest) = {
            let mut st = inbox.lock();
            std::mem::swap(&mut cmds, &mut st.cmds);
            #[cfg(test)]
            {
                st.looks += 1;
            }
            (st.closed, st.earliest.take())
        };
        apply_all(&backend, &mut d, &mut cmds);
        if closed {
            return;
        }
        let now = Instant::now();
        while let Some(&(at, id)) = d.deadlines.first() {
            if at > now {
                break;
            }
            d.deadlines.remove(&(at, id));
            let Some(e) = d.entries.get(&id) else {
                continue;
            };
            let fresh = e.state.alarm();
            if fresh > now {
                // An explicit extend moved the deadline since it was filed.
                if let Some(e) = d.entries.get_mut(&id) {
                    e.filed_deadline = fresh;
                }
                d.deadlines.insert((fresh, id));
                continue;
            }
            if let Some(e) = d.remove(id) {
                warn!(
                    key = e.key.key(),
                    "lease lost: no renewal got through before its deadline"
                );
                e.state.lost.cancel();
            }
        }
        let mut due: HashMap<Duration, Batch> = HashMap::new();
        // Taken before any lease's TTL is read, not when the future is first polled (a loop
        // turn later, maybe): an extend answered after a TTL was read must count this renewal
        // as sent before it, so that its reply, carrying the TTL from before the extend, may
        // then only shorten the deadline.
        let sent_at = Instant::now();
        let mut deferred = Vec::new();
        let mut lost = Vec::new();
        // Puts a lease taken out of the timers into its batch; the TTL it is filed by when it
        // went into one.
        let mut batch = |d: &Driver, id: u64| -> Option<Duration> {
            let e = d.entries.get(&id)?;
            // Counted lost already (an extend answered after the alarm, a holder that saw the
            // alarm pass): renewed no more, as its holder may have stopped; a renewal would
            // only keep the key from others for another TTL.
            if e.state.is_lost() {
                lost.push(id);
                return None;
            }
            let Some(ttl) = e.state.renewal_ttl(e.ttl, sent_at) else {
                deferred.push((id, e.ttl));
                return None;
            };
            let slot = due.entry(ttl).or_default();
            slot.0.push(id);
            slot.1.push((e.key.clone(), e.token.clone()));
            slot.2.push(e.state.clone());
            Some(e.ttl)
        };
        // The leases due, and those due within the batch window of them.
        let mut rounds = HashSet::new();
        if d.renews.first().is_some_and(|(t, _)| *t <= now) {
            while let Some(&(at, id)) = d.renews.first() {
                if at > now + BATCH_WINDOW {
                    break;
                }
                match d.unfile_renew(id) {
                    Some(planned) => {
                        if let Some(ttl) = batch(&d, id)
                            && planned
                        {
                            rounds.insert(ttl);
                        }
                    }
                    // Filed under no entry (not expected): dropped, or it would be looked at
                    // again at once, for ever.
                    None => {
                        d.renews.remove(&(at, id));
                    }
                }
            }
        }
        // With them, for each TTL whose round went into a batch, the leases of that TTL whose
        // time to go early has come.
        for ttl in rounds {
            while let Some(id) = d.first_early(ttl, now) {
                if d.unfile_renew(id).is_some() {
                    batch(&d, id);
                } else if let Some(set) = d.early.get_mut(&ttl) {
                    set.pop_first();
                }
            }
        }
        for id in lost {
            if let Some(e) = d.remove(id) {
                debug!(key = e.key.key(), "lease already lost; not renewed");
            }
        }
        for (id, ttl) in deferred.drain(..) {
            d.file_retry(id, now + (ttl / 10).min(Duration::from_millis(250)));
        }
        for (ttl, (ids, items, states)) in due {
            let backend = backend.clone();
            debug!(count = items.len(), ?ttl, "renewing leases");
            inflight.push(async move {
                let mut unsettled = Unsettled {
                    states,
                    deadline: sent_at + ttl - drift(ttl),
                    ttl,
                };
                let result = backend.extend_each(&items, ttl).await;
                // Answered: `settle` takes the leases from here, in the same turn of the driver.
                unsettled.states.clear();
                (sent_at, ttl, ids, result)
            });
        }
        // Looking again at `earliest` finds nothing to do when its adds were taken back, but
        // it is no later than any wake-up those adds asked for, and it keeps the adds that
        // follow them (due later) from waking the driver.
        let next_wake = match (d.next_wake(), earliest) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        {
            let mut st = inbox.lock();
            if !st.cmds.is_empty() || st.closed {
                // More came meanwhile: look again at once, but through the select below, so
                // that renewal replies are taken in even while commands never stop coming.
                drop(st);
                inbox.wake.notify_one();
            } else {
                st.asleep_until =
                    Some(next_wake.unwrap_or_else(|| Instant::now() + crate::types::FOREVER));
            }
        }
        let sleep = async {
            match next_wake {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = inbox.wake.notified() => {},
            Some(result) = inflight.next(), if !inflight.is_empty() => {
                settle(&mut d, result);
            },
            _ = sleep => {},
        }
        inbox.lock().asleep_until = None;
    }
}

/// Applies a batch of queued commands in order, skipping leases added and removed within it.
fn apply_all<B: Backend + Clone>(backend: &B, d: &mut Driver, cmds: &mut Vec<Cmd>) {
    if cmds.is_empty() {
        return;
    }
    let removed: HashSet<u64> = cmds
        .iter()
        .filter_map(|c| match c {
            Cmd::Remove { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    for cmd in cmds.drain(..) {
        match cmd {
            Cmd::Add { id, .. } if removed.contains(&id) => {}
            cmd => apply(backend, d, cmd),
        }
    }
}

fn apply<B: Backend + Clone>(backend: &B, d: &mut Driver, cmd: Cmd) {
    match cmd {
        Cmd::Add {
            id,
            key,
            token,
            ttl,
            sent,
            state,
        } => {
            let deadline = state.alarm();
            d.entries.insert(
                id,
                Entry {
                    key,
                    token,
                    ttl,
                    state,
                    filed_deadline: deadline,
                    filed_renew: None,
                    filed_early: (ttl, deadline),
                    planned: true,
                },
            );
            d.deadlines.insert((deadline, id));
            // Counted from the grant's arrival instead, a round trip above a third of the TTL
            // would send the first renewal too late for its reply to beat the deadline.
            d.file_renew(id, sent + ttl / 3);
        }
        Cmd::Retune { id, ttl } => {
            if let Some(e) = d.entries.get_mut(&id) {
                e.ttl = ttl;
                if e.filed_renew.is_some() {
                    let at = e.state.renew_by(Instant::now() + ttl / 3);
                    d.file_renew(id, at);
                }
                d.file_deadline(id);
            }
        }
        Cmd::Rescheduled { id } => {
            let refiled = d
                .entries
                .get(&id)
                .map(|e| e.filed_renew.map(|at| (e.state.renew_by(at), e.planned)));
            if let Some(filed) = refiled {
                // None: a renewal is in flight, and its answer files the next one by the
                // new alarm.
                if let Some((at, planned)) = filed {
                    d.file(id, at, planned);
                }
                d.file_deadline(id);
            }
        }
        Cmd::Remove { id, release } => {
            d.remove(id);
            if let Some(dropped) = release {
                let backend = backend.clone();
                tokio::spawn(async move { dropped.release(&backend).await });
            }
        }
    }
}

fn settle(d: &mut Driver, (sent_at, ttl, ids, result): BatchResult) {
    match result {
        Ok(answers) => {
            // One answer per lease is the backend's contract; with any other count no answer
            // can be matched to its lease, so every lease of the batch is retried (a lease
            // left without one would never be filed for renewal again).
            let answers = if answers.len() == ids.len() {
                answers
            } else {
                warn!(
                    sent = ids.len(),
                    answered = answers.len(),
                    "the backend answered a renewal batch with another number of answers; retrying each lease"
                );
                vec![None; ids.len()]
            };
            for (id, held) in ids.iter().zip(answers) {
                let Some(e) = d.entries.get(id) else { continue };
                let Some(held) = held else {
                    // This lease's part of the batch failed: retry it like a failed batch.
                    e.state.renewal_unknown(sent_at + ttl - drift(ttl), ttl);
                    let retry = retry_at(e);
                    debug!(key = e.key.key(), "renewal outcome unknown; retrying");
                    d.file_retry(*id, retry);
                    continue;
                };
                if !held {
                    if let Some(e) = d.remove(*id) {
                        if e.state.lost.is_cancelled() || e.state.releasing.load(Ordering::Acquire)
                        {
                            // Released or dropped meanwhile (or lost and said so already): the
                            // holder's own delete, not a loss to warn of.
                            debug!(
                                key = e.key.key(),
                                "renewal found the lease gone after it ended"
                            );
                        } else {
                            warn!(
                                key = e.key.key(),
                                "lease lost: the server no longer holds it"
                            );
                            e.state.lost.cancel();
                        }
                    }
                    continue;
                }
                let deadline = sent_at + ttl - drift(ttl);
                match e
                    .state
                    .renewed_next(sent_at, deadline, warn_ahead(ttl), e.ttl)
                {
                    Some((alarm, next)) => {
                        d.file_deadline_at(*id, alarm);
                        d.file_renew(*id, next);
                    }
                    None => {
                        debug!(
                            key = e.key.key(),
                            "renewal answered after the lease counted as lost; it stays lost"
                        );
                        d.remove(*id);
                    }
                }
            }
        }
        Err(err) => {
            for id in &ids {
                let Some(e) = d.entries.get(id) else { continue };
                e.state.renewal_unknown(sent_at + ttl - drift(ttl), ttl);
                // Retry soon; the deadline timer marks the lease lost if none succeeds in time.
                let retry = retry_at(e);
                debug!(key = e.key.key(), error = %err, "renewal failed; retrying");
                d.file_retry(*id, retry);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AHEAD: Duration = Duration::ZERO;

    fn deadline(state: &LeaseState) -> Instant {
        state.times().deadline
    }

    /// A renewal sent while an extend to a longer TTL travels may run after it on the server
    /// and set the expiry last; its reply handled before the extend's (two tasks woken by one
    /// read of the connection run in either order) must cap what the extend's answer sets.
    #[test]
    fn a_renewal_answered_during_an_extend_caps_it() {
        let t0 = Instant::now();
        let s = LeaseState::new(t0 + Duration::from_secs(30), AHEAD);
        s.extending(t0 + Duration::from_secs(300), AHEAD);
        let sent = t0 + Duration::from_millis(1);
        assert!(s.renewed(sent, sent + Duration::from_secs(30), AHEAD));
        assert!(s.extended(
            t0,
            t0 + Duration::from_secs(300),
            AHEAD,
            Duration::from_secs(300)
        ));
        s.extend_settled();
        assert!(
            deadline(&s) <= sent + Duration::from_secs(30),
            "the extend's answer set a deadline past the renewal's"
        );
        // Once no extend travels, renewals move the deadline forward again.
        let later = t0 + Duration::from_secs(1);
        assert!(s.renewed(later, later + Duration::from_secs(300), AHEAD));
        assert_eq!(deadline(&s), later + Duration::from_secs(300));
    }

    /// While an extend to a shorter TTL travels, a renewal with the old, longer TTL answered
    /// meanwhile may have run before it: its reply must not lengthen the lease past the
    /// extend's deadline.
    #[test]
    fn a_renewal_answered_during_a_shortening_extend_does_not_lengthen() {
        let t0 = Instant::now();
        let s = LeaseState::new(t0 + Duration::from_secs(30), AHEAD);
        s.extending(t0 + Duration::from_secs(5), AHEAD);
        let sent = Instant::now() + Duration::from_millis(1);
        assert!(s.renewed(sent, sent + Duration::from_secs(30), AHEAD));
        assert!(deadline(&s) <= t0 + Duration::from_secs(5));
    }

    /// One connection's worth of renewals and explicit extends, sent in some order and
    /// answered (or, for extends, lost) in any order: the server runs them in the order sent,
    /// as one multiplexed connection does, and the lease's local deadline must never pass the
    /// server's expiry, whichever order the replies are handled in.
    mod interleavings {
        use super::*;
        use proptest::prelude::*;

        #[derive(Clone, Debug)]
        enum Step {
            /// The driver takes a renewal's TTL (the request is then on its way to the wire).
            Renew,
            /// An extend to this many ms is started.
            Extend(u64),
            /// A request on its way (the one at this index, modulo their count) is written: the
            /// server runs it now. Two tasks share the connection, so requests reach it in any
            /// order, and run in the order they reach it.
            Write(usize),
            /// The reply of a request that ran (at this index, modulo their count) is handled;
            /// with the flag, it is lost instead (the caller sees an error).
            Answer(usize, bool),
            /// The caller of a request not yet written (at this index, modulo their count)
            /// gives up on it, as on a connection that went silent and was replaced: its
            /// outcome is unknown, and it may still reach the server at any later time (bytes
            /// stuck on the old connection), long after later requests were answered.
            GiveUp(usize),
            /// Let this many ms pass.
            Wait(u64),
        }

        fn step() -> impl Strategy<Value = Step> {
            prop_oneof![
                3 => Just(Step::Renew),
                2 => (50u64..3_000).prop_map(Step::Extend),
                5 => (0usize..8).prop_map(Step::Write),
                5 => (0usize..8, proptest::bool::weighted(0.2))
                    .prop_map(|(i, l)| Step::Answer(i, l)),
                1 => (0usize..8).prop_map(Step::GiveUp),
                2 => (1u64..400).prop_map(Step::Wait),
            ]
        }

        struct Sent {
            at: Instant,
            ttl: Duration,
            explicit: bool,
            /// Whether the key was still there when the server ran it.
            held: bool,
            /// Its caller gave up before it was written: it runs, unanswered, if ever written.
            orphan: bool,
        }

        fn run(steps: Vec<Step>) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let granted = Duration::from_millis(1_000);
                let t0 = Instant::now();
                // The server's expiry of the key; `None` once it expired.
                let mut expiry = Some(t0 + granted);
                let s = LeaseState::new(t0 + granted - drift(granted), warn_ahead(granted));
                let mut unwritten: Vec<Sent> = Vec::new();
                let mut ran: Vec<Sent> = Vec::new();
                // Renewals taken and not answered yet.
                let mut renewing = 0;
                for step in steps {
                    tokio::time::advance(Duration::from_millis(1)).await;
                    let now = Instant::now();
                    if expiry.is_some_and(|e| e <= now) {
                        expiry = None;
                    }
                    match step {
                        // As the driver: one renewal of a lease at a time, and none while an
                        // extend travels.
                        Step::Renew if renewing == 0 => {
                            if let Some(ttl) = s.renewal_ttl(granted, now) {
                                renewing += 1;
                                unwritten.push(Sent {
                                    at: now,
                                    ttl,
                                    explicit: false,
                                    held: false,
                                    orphan: false,
                                });
                            }
                        }
                        Step::Extend(ms) => {
                            let ttl = Duration::from_millis(ms);
                            s.extending(now + ttl - drift(ttl), warn_ahead(ttl));
                            // As `Lease::extend`: the send time is read after the extend was
                            // marked as sent, on a clock that moved meanwhile (read at the same
                            // instant, the extend would count as sent before itself and its
                            // answer could only shorten, a branch production does not take).
                            tokio::time::advance(Duration::from_micros(1)).await;
                            let at = Instant::now();
                            unwritten.push(Sent {
                                at,
                                ttl,
                                explicit: true,
                                held: false,
                                orphan: false,
                            });
                        }
                        Step::Write(i) if !unwritten.is_empty() => {
                            let mut r = unwritten.remove(i % unwritten.len());
                            r.held = expiry.is_some();
                            if r.held {
                                expiry = Some(now + r.ttl);
                            }
                            if !r.orphan {
                                ran.push(r);
                            }
                        }
                        Step::GiveUp(i) if unwritten.iter().any(|r| !r.orphan) => {
                            let waiting: Vec<usize> = (0..unwritten.len())
                                .filter(|&j| !unwritten[j].orphan)
                                .collect();
                            let r = &mut unwritten[waiting[i % waiting.len()]];
                            r.orphan = true;
                            let deadline = r.at + r.ttl - drift(r.ttl);
                            if r.explicit {
                                s.maybe_extended(deadline, warn_ahead(r.ttl), r.ttl);
                                s.extend_settled();
                            } else {
                                s.renewal_unknown(deadline, r.ttl);
                                renewing -= 1;
                            }
                        }
                        // A lost answer of a request that ran (or found the key gone:
                        // `held`); one given up before it ran is `GiveUp`.
                        Step::Answer(i, lost) if !ran.is_empty() => {
                            let r = ran.remove(i % ran.len());
                            let deadline = r.at + r.ttl - drift(r.ttl);
                            let ahead = warn_ahead(r.ttl);
                            match (r.explicit, r.held, lost) {
                                (true, _, true) => s.maybe_extended(deadline, ahead, r.ttl),
                                (false, _, true) => s.renewal_unknown(deadline, r.ttl),
                                (true, true, false) => {
                                    s.extended(r.at, deadline, ahead, r.ttl);
                                }
                                (false, true, false) => {
                                    s.renewed(r.at, deadline, ahead);
                                }
                                (_, false, false) => s.lost.cancel(),
                            }
                            if r.explicit {
                                s.extend_settled();
                            } else {
                                renewing -= 1;
                            }
                        }
                        Step::Renew | Step::Write(_) | Step::Answer(..) | Step::GiveUp(_) => {}
                        Step::Wait(ms) => tokio::time::advance(Duration::from_millis(ms)).await,
                    }
                    if s.is_lost() {
                        continue;
                    }
                    let local = s.times().deadline;
                    let server = expiry.unwrap_or(now);
                    assert!(
                        local <= server,
                        "the lease is held until {:?} here, the server keeps it until {:?}",
                        local - t0,
                        server - t0
                    );
                }
            });
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2_000))]
            #[test]
            fn the_local_deadline_never_passes_the_servers_expiry(
                steps in proptest::collection::vec(step(), 1..48)
            ) {
                run(steps);
            }
        }
    }

    #[test]
    fn renewals_move_the_deadline_forward_only() {
        let t0 = Instant::now();
        let s = LeaseState::new(t0 + Duration::from_secs(10), AHEAD);
        s.renewed(t0, t0 + Duration::from_secs(12), AHEAD);
        assert_eq!(deadline(&s), t0 + Duration::from_secs(12));
        // A late reply of an older renewal.
        s.renewed(t0, t0 + Duration::from_secs(11), AHEAD);
        assert_eq!(deadline(&s), t0 + Duration::from_secs(12));
    }

    /// A renewal answered after the alarm passed does not bring the lease back: `lost()` may
    /// have fired and its holder stopped, so `is_lost()` must not turn false again.
    #[test]
    fn a_late_renewal_does_not_revive_a_lost_lease() {
        let t0 = Instant::now();
        let s = LeaseState::new(t0 - Duration::from_millis(1), AHEAD);
        assert!(s.is_lost());
        assert!(!s.renewed(t0, t0 + Duration::from_secs(10), AHEAD));
        assert!(s.is_lost(), "revived by a late renewal");
        assert_eq!(s.remaining(), Duration::ZERO);
        assert!(s.lost.is_cancelled(), "the loss is signalled for good");
    }

    /// An extend to 3 s whose outcome is unknown, then the reply of a renewal (30 s) sent
    /// before it: that renewal may have run before the extend on the server, whose expiry is
    /// then the extend's, so its reply must not bring the 30 s back.
    #[test]
    fn an_unknown_extend_is_not_undone_by_an_earlier_renewal() {
        let t0 = Instant::now();
        let s = LeaseState::new(t0 + Duration::from_secs(30), AHEAD);
        let renewal_sent = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        s.maybe_extended(
            Instant::now() + Duration::from_secs(3),
            AHEAD,
            Duration::from_secs(3),
        );
        assert!(s.remaining() <= Duration::from_secs(3));
        assert!(s.renewed(renewal_sent, renewal_sent + Duration::from_secs(30), AHEAD));
        assert!(
            s.remaining() <= Duration::from_secs(3),
            "an earlier renewal's reply moved the deadline to {:?}",
            s.remaining()
        );
    }

    /// A renewal carrying 1 s given up unanswered (its connection went silent and was
    /// replaced), then an extend to 30 s answered: the stranded renewal may still be delivered
    /// afterwards and set the expiry to 1 s from then, so the extend's deadline is counted with
    /// 1 s, and so is every later one.
    #[test]
    fn a_request_of_unknown_outcome_caps_later_deadlines_at_its_ttl() {
        let t0 = Instant::now();
        let second = Duration::from_secs(1);
        let s = LeaseState::new(t0 + second, AHEAD);
        let ttl = s.renewal_ttl(second, t0).expect("no extend travels");
        s.renewal_unknown(t0 + ttl - drift(ttl), ttl);
        let sent = Instant::now();
        let thirty = Duration::from_secs(30);
        s.extending(sent + thirty - drift(thirty), AHEAD);
        assert!(s.extended(sent, sent + thirty - drift(thirty), AHEAD, thirty));
        s.extend_settled();
        assert!(
            s.remaining() <= second,
            "{:?} left where the stranded renewal may set 1 s",
            s.remaining()
        );
        let later = Instant::now();
        assert!(s.renewed(later, later + thirty - drift(thirty), AHEAD));
        assert!(s.remaining() <= second, "{:?} left", s.remaining());
        assert!(!s.is_lost());
    }

    /// A renewal carrying a long TTL (30 s) is sent; then an extend to 10 s, longer than the
    /// 5 s left, which changes nothing while it travels, goes unanswered (an error, or its
    /// caller gone) and is settled, as the lease's guard does. It may have run after the
    /// renewal on the server and set 10 s last, so the renewal's reply, handled afterwards,
    /// may only shorten: taken as sent, it would claim 30 s.
    #[test]
    fn an_unanswered_extend_leaves_earlier_renewals_only_shortening() {
        let t0 = Instant::now();
        let s = LeaseState::new(t0 + Duration::from_secs(5), AHEAD);
        let renewal_sent = Instant::now();
        let ttl = s.renewal_ttl(Duration::from_secs(30), renewal_sent);
        assert_eq!(ttl, Some(Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(2));
        let ten = Instant::now() + Duration::from_secs(10);
        s.extending(ten, AHEAD);
        s.maybe_extended(ten, AHEAD, Duration::from_secs(10));
        s.extend_settled();
        assert!(s.remaining() <= Duration::from_secs(5));
        assert!(s.renewed(renewal_sent, renewal_sent + Duration::from_secs(30), AHEAD));
        assert!(
            s.remaining() <= Duration::from_secs(5),
            "a renewal sent before an unanswered extend moved the deadline to {:?}",
            s.remaining()
        );
    }

    /// A longer extend about to be sent changes nothing until it is answered.
    #[test]
    fn a_longer_extend_counts_only_once_answered() {
        let t0 = Instant::now();
        let s = LeaseState::new(t0 + Duration::from_secs(3), AHEAD);
        s.extending(t0 + Duration::from_secs(30), AHEAD);
        assert_eq!(deadline(&s), t0 + Duration::from_secs(3));
        let sent = Instant::now();
        assert!(s.extended(
            sent,
            sent + Duration::from_secs(30),
            AHEAD,
            Duration::from_secs(30)
        ));
        assert_eq!(deadline(&s), sent + Duration::from_secs(30));
    }

    #[test]
    fn an_extend_sets_the_deadline_even_when_shorter() {
        let t0 = Instant::now();
        let s = LeaseState::new(t0 + Duration::from_secs(30), AHEAD);
        s.extended(
            t0,
            t0 + Duration::from_secs(1),
            AHEAD,
            Duration::from_secs(1),
        );
        assert_eq!(deadline(&s), t0 + Duration::from_secs(1));
        assert!(s.remaining() <= Duration::from_secs(1));
    }

    #[test]
    fn replies_sent_before_an_extend_came_back_only_shorten() {
        let t0 = Instant::now();
        let s = LeaseState::new(t0 + Duration::from_secs(30), AHEAD);
        s.extended(
            t0,
            t0 + Duration::from_secs(5),
            AHEAD,
            Duration::from_secs(5),
        );
        // Sent before the extend's reply, with the old TTL: it may have run first on the
        // server, so it must not bring the old expiry back...
        s.renewed(t0, t0 + Duration::from_secs(30), AHEAD);
        assert_eq!(deadline(&s), t0 + Duration::from_secs(5));
        // ...and may have run last, so a shorter expiry is taken.
        s.renewed(t0, t0 + Duration::from_secs(2), AHEAD);
        assert_eq!(deadline(&s), t0 + Duration::from_secs(2));
        // The same for a second extend sent before the first one's reply.
        s.extended(
            t0,
            t0 + Duration::from_secs(20),
            AHEAD,
            Duration::from_secs(20),
        );
        assert_eq!(deadline(&s), t0 + Duration::from_secs(2));
        // A renewal sent afterwards moves it forward again.
        let later = Instant::now() + Duration::from_millis(1);
        s.renewed(later, later + Duration::from_secs(5), AHEAD);
        assert_eq!(deadline(&s), later + Duration::from_secs(5));
    }
}
