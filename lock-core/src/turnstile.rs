//! In-process fairness: waiters for one key take turns in arrival order.
//!
//! Without it, a task that releases a key and asks for it again at once learns of its own release
//! first (from the reply), while the other waiters hear of it one pub/sub hop later, so the
//! releasing task wins the race again and again (the benchmark measured it winning 63% of
//! handoffs among 16 tasks when holders do a round trip of work). A FIFO semaphore per key and
//! per [`Locker`](crate::Locker) makes local waiters queue instead: only the head of the queue
//! asks the server, and a task that asks again after releasing joins the back.
//!
//! The turn is held with the lease and handed on when the lease is released, dropped or lost; on
//! a release, as soon as the backend has put the release in line ahead of the next waiter's
//! acquire (`Backend::release_in_line`), before its answer. A holder that stops without dropping
//! its guard cannot stall the queue past its lease: waiters watch the current holder's lease and
//! take the turn back once it is lost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;

use crate::renew::LeaseState;

/// The turnstiles of one locker, by key; an entry lives while someone waits on or holds a turn.
#[derive(Default)]
pub(crate) struct Turnstiles {
    keys: Mutex<HashMap<String, Arc<Turnstile>>>,
}

struct Turnstile {
    /// One permit: the turn. tokio's semaphore queues acquirers in FIFO order.
    turn: Arc<Semaphore>,
    /// The lease holding the turn and its permit, if a lease holds it (the head waiter holds the
    /// permit without a lease while it waits for a holder elsewhere).
    holder: Mutex<Option<Holder>>,
    /// Bumped whenever `holder` changes, so waiters watch the right lease.
    changed: watch::Sender<u64>,
    /// Set to what went wrong when the waiter whose turn it was failed with a transient
    /// error (a server gone silent or away): the waiters queued behind it end with it at
    /// once, instead of each spending its own attempt's timeouts in turn while the rest of the
    /// queue runs out its wait.
    failed: watch::Sender<Arc<str>>,
}

/// Why [`TurnHandle::wait_turn`] ended without the turn.
#[derive(Debug)]
pub(crate) enum NoTurn {
    /// The deadline passed first.
    TimedOut,
    /// The waiter whose turn it was failed with a transient error (its text) while this one
    /// was queued behind it.
    AheadFailed(Arc<str>),
}

struct Holder {
    state: Arc<LeaseState>,
    permit: OwnedSemaphorePermit,
    /// The lease's guard was dropped and its release goes in the background: the turn goes on
    /// with a [`HandOn`] once that release is in line, not when waiters see the lease end.
    leaving: bool,
}

/// Hands the turn of a lease on when dropped: once its release is in line ahead of the next
/// waiter's acquire, or when the release cannot be sent. Dropped, never leaked, on every path.
///
/// It keeps no count on the turnstile: [`TurnHandle`]'s `Drop` removes the registry's entry by
/// that count, and a `HandOn` may outlive every handle. The count it takes while it hands on
/// is taken and given back under the registry's lock, where that `Drop` reads it.
pub(crate) struct HandOn {
    registry: Arc<Turnstiles>,
    turnstile: std::sync::Weak<Turnstile>,
    state: Arc<LeaseState>,
}

impl Drop for HandOn {
    fn drop(&mut self) {
        let _keys = self
            .registry
            .keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = self.turnstile.upgrade() {
            t.vacate(&self.state);
        }
    }
}

/// One user of a key's turnstile; the entry is removed when its last user is gone.
pub(crate) struct TurnHandle {
    registry: Arc<Turnstiles>,
    key: String,
    turnstile: Option<Arc<Turnstile>>,
}

impl Turnstiles {
    pub(crate) fn enter(self: &Arc<Self>, key: &str) -> TurnHandle {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let t = keys
            .entry(key.to_owned())
            .or_insert_with(|| {
                Arc::new(Turnstile {
                    turn: Arc::new(Semaphore::new(1)),
                    holder: Mutex::new(None),
                    changed: watch::Sender::new(0),
                    failed: watch::Sender::new(Arc::from("")),
                })
            })
            .clone();
        TurnHandle {
            registry: self.clone(),
            key: key.to_owned(),
            turnstile: Some(t),
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl Drop for TurnHandle {
    fn drop(&mut self) {
        // Handles are only cloned or dropped under the registry lock, so the count is exact:
        // two means the map's copy and ours.
        let mut keys = self
            .registry
            .keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = self.turnstile.take()
            && Arc::strong_count(&t) == 2
        {
            keys.remove(&self.key);
        }
    }
}

impl TurnHandle {
    fn turnstile(&self) -> &Turnstile {
        // Only `drop` takes it out.
        self.turnstile
            .as_deref()
            .expect("a live handle has its turnstile")
    }

    /// Waits for this key's turn, in arrival order, until `give_up`, or until the waiter whose
    /// turn it is fails (see [`failed`](Self::failed)).
    pub(crate) async fn wait_turn(&self, give_up: Instant) -> Result<OwnedSemaphorePermit, NoTurn> {
        let t = self.turnstile();
        let mut changes = t.changed.subscribe();
        // Sees only failures from now on: one before this waiter came is not its own.
        let mut failures = t.failed.subscribe();
        let ahead_failed = |failures: &mut watch::Receiver<Arc<str>>| {
            NoTurn::AheadFailed(failures.borrow_and_update().clone())
        };
        let acquire = t.turn.clone().acquire_owned();
        tokio::pin!(acquire);
        loop {
            changes.mark_unchanged();
            let holder = t
                .holder
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
                .map(|h| (h.state.clone(), h.leaving));
            let holder_lost = async {
                match &holder {
                    // A leaving holder's turn comes with its `HandOn`: its lease ended when its
                    // guard was dropped, but the release that frees the key is not in line
                    // yet. At the latest when the lease runs out: a `HandOn` can be parked
                    // where nothing takes it (a driver on a runtime nobody drives any more).
                    Some((state, true)) => tokio::time::sleep_until(state.alarm()).await,
                    Some((state, false)) => state.wait_lost().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                // The free turn first: a deadline already passed (a wait of zero) still takes
                // a turn that is free, as the caller's one attempt.
                biased;
                // A turn handed on by a waiter that failed (it records the failure before its
                // permit goes) is that failure's too.
                permit = &mut acquire => {
                    if failures.has_changed().unwrap_or(false) {
                        return Err(ahead_failed(&mut failures));
                    }
                    // The semaphore is never closed.
                    return permit.map_err(|_| NoTurn::TimedOut);
                }
                _ = holder_lost => {
                    match &holder {
                        Some((state, true)) => t.vacate(state),
                        Some((state, false)) => t.vacate_lost(state),
                        None => {}
                    }
                }
                _ = changes.changed() => {}
                Ok(()) = failures.changed() => return Err(ahead_failed(&mut failures)),
                _ = tokio::time::sleep_until(give_up) => return Err(NoTurn::TimedOut),
            }
        }
    }

    /// Records, if `e` is transient, that the waiter holding the turn failed with it, so that
    /// the waiters queued behind it end at once (their own attempts would meet the same server
    /// one after another, each taking its timeouts, while the rest of the queue runs out its
    /// wait and ends with a `WaitTimeout` that is not transient). Waiters that arrive after it
    /// try for themselves. Returns `e`.
    pub(crate) fn failed(&self, e: crate::Error) -> crate::Error {
        if e.is_transient() {
            self.turnstile()
                .failed
                .send_replace(Arc::from(e.to_string()));
        }
        e
    }

    /// Records that `state`'s lease holds the turn, until [`vacate`](Self::vacate).
    pub(crate) fn hold(&self, state: Arc<LeaseState>, permit: OwnedSemaphorePermit) {
        let t = self.turnstile();
        *t.holder.lock().unwrap_or_else(PoisonError::into_inner) = Some(Holder {
            state,
            permit,
            leaving: false,
        });
        t.changed.send_modify(|n| *n += 1);
    }

    /// Hands the turn on if `state`'s lease still holds it.
    pub(crate) fn vacate(&self, state: &Arc<LeaseState>) {
        self.turnstile().vacate(state);
    }

    /// [`vacate`](Self::vacate) when the returned [`HandOn`] is dropped, wherever that is.
    pub(crate) fn hand_on(&self, state: Arc<LeaseState>) -> HandOn {
        HandOn {
            registry: self.registry.clone(),
            turnstile: Arc::downgrade(
                self.turnstile
                    .as_ref()
                    .expect("a live handle has its turnstile"),
            ),
            state,
        }
    }

    /// Marks `state`'s lease, if it holds the turn, as leaving: its guard was dropped, and the
    /// turn goes on with the returned [`HandOn`], not when waiters see the lease end (they
    /// would ask the server before the release that frees the key is in line).
    pub(crate) fn leave(&self, state: Arc<LeaseState>) -> HandOn {
        let t = self.turnstile();
        let marked = {
            let mut holder = t.holder.lock().unwrap_or_else(PoisonError::into_inner);
            match holder.as_mut() {
                Some(h) if Arc::ptr_eq(&h.state, &state) => {
                    h.leaving = true;
                    true
                }
                _ => false,
            }
        };
        if marked {
            t.changed.send_modify(|n| *n += 1);
        }
        self.hand_on(state)
    }
}

impl Turnstile {
    fn vacate(&self, state: &Arc<LeaseState>) {
        self.vacate_if(state, true);
    }

    /// A waiter saw `state`'s lease end: the turn goes on unless the lease is leaving, whose
    /// [`HandOn`] hands it on.
    fn vacate_lost(&self, state: &Arc<LeaseState>) {
        self.vacate_if(state, false);
    }

    fn vacate_if(&self, state: &Arc<LeaseState>, leaving_too: bool) {
        let permit = {
            let mut holder = self.holder.lock().unwrap_or_else(PoisonError::into_inner);
            match holder.as_ref() {
                Some(h) if Arc::ptr_eq(&h.state, state) && (leaving_too || !h.leaving) => {
                    holder.take().map(|h| h.permit)
                }
                _ => None,
            }
        };
        if permit.is_some() {
            self.changed.send_modify(|n| *n += 1);
        }
        // Dropping the permit wakes the next waiter in line.
        drop(permit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn turns_go_in_arrival_order_and_entries_are_removed() {
        let reg = Arc::new(Turnstiles::default());
        let far = Instant::now() + Duration::from_secs(5);
        let first = reg.enter("k");
        let permit = first.wait_turn(far).await.expect("free turn");
        let state = LeaseState::new(far, Duration::ZERO);
        first.hold(state.clone(), permit);

        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..4 {
            let (reg, order) = (reg.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let h = reg.enter("k");
                let p = h.wait_turn(far).await.expect("turn");
                order.lock().unwrap_or_else(PoisonError::into_inner).push(i);
                drop(p);
            }));
            // Let each task queue before the next arrives.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        first.vacate(&state);
        for t in tasks {
            t.await.expect("task");
        }
        assert_eq!(
            *order.lock().unwrap_or_else(PoisonError::into_inner),
            vec![0, 1, 2, 3]
        );
        drop(first);
        assert_eq!(reg.len(), 0, "no entry outlives its users");
    }

    /// A turn held by a lease of 5 s on key `k`, and a task queued behind it that returns
    /// whether it got the turn.
    async fn held_with_a_waiter() -> (
        Arc<Turnstiles>,
        TurnHandle,
        Arc<LeaseState>,
        tokio::task::JoinHandle<bool>,
    ) {
        let reg = Arc::new(Turnstiles::default());
        let far = Instant::now() + Duration::from_secs(5);
        let h = reg.enter("k");
        let permit = h.wait_turn(far).await.expect("free turn");
        let state = LeaseState::new(far, Duration::ZERO);
        h.hold(state.clone(), permit);
        let waiter = tokio::spawn({
            let reg = reg.clone();
            async move { reg.enter("k").wait_turn(far).await.is_ok() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        (reg, h, state, waiter)
    }

    /// A release hands the turn on from wherever its request goes out, possibly after its
    /// lease and handle are gone: a `HandOn` hands the turn on while the handle lives, and keeps
    /// no registry entry alive after it.
    #[tokio::test]
    async fn a_hand_on_goes_on_and_keeps_no_entry() {
        let (reg, h, state, waiter) = held_with_a_waiter().await;
        let far = Instant::now() + Duration::from_secs(5);
        assert!(!waiter.is_finished(), "the turn is held");
        drop(h.hand_on(state.clone()));
        assert!(waiter.await.expect("waiter"), "the waiter got the turn");

        let permit = h.wait_turn(far).await.expect("free turn again");
        h.hold(state.clone(), permit);
        let later = h.hand_on(state.clone());
        // The lease dropped before its release went out: it vacates, and its handle goes.
        h.vacate(&state);
        drop(h);
        assert_eq!(reg.len(), 0, "a pending hand-on keeps no entry");
        drop(later);
        assert_eq!(reg.len(), 0);
    }

    /// A dropped guard's lease ends at once for every view of it, but its turn waits for its
    /// `HandOn` (its release in line): a waiter that sees the lease end does not take it.
    #[tokio::test]
    async fn a_leaving_holder_hands_on_only_with_its_hand_on() {
        // The waiter watches the holder's lease before the guard is dropped.
        let (_reg, h, state, waiter) = held_with_a_waiter().await;
        let hand_on = h.leave(state.clone());
        state.lost.cancel();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "the turn waits for the hand-on");
        drop(hand_on);
        assert!(waiter.await.expect("waiter"), "the hand-on passed the turn");
    }

    #[tokio::test]
    async fn a_lost_holder_gives_up_the_turn() {
        let reg = Arc::new(Turnstiles::default());
        let h = reg.enter("k");
        let permit = h
            .wait_turn(Instant::now() + Duration::from_secs(1))
            .await
            .expect("turn");
        // A holder whose lease runs out in 50 ms and that never drops its guard.
        h.hold(
            LeaseState::new(Instant::now() + Duration::from_millis(50), Duration::ZERO),
            permit,
        );
        let waiter = reg.enter("k");
        let started = Instant::now();
        let got = waiter
            .wait_turn(Instant::now() + Duration::from_secs(5))
            .await;
        assert!(
            got.is_ok(),
            "the waiter gets the turn once the lease is lost"
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    /// A transient failure of the waiter holding the turn ends the waiters queued behind it;
    /// one that arrives after it asks for itself, and a failure that is not transient ends
    /// nobody else.
    #[tokio::test]
    async fn a_failure_of_the_first_in_line_ends_the_queue_behind_it() {
        let reg = Arc::new(Turnstiles::default());
        let far = Instant::now() + Duration::from_secs(5);
        let queue = |n| {
            (0..n)
                .map(|_| {
                    let reg = reg.clone();
                    tokio::spawn(async move { reg.enter("k").wait_turn(far).await.map(drop) })
                })
                .collect::<Vec<_>>()
        };
        let head = reg.enter("k");
        let permit = head.wait_turn(far).await.expect("free turn");
        let behind = queue(3);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let gone = redis::RedisError::from(std::io::Error::other("server gone"));
        let e = head.failed(crate::Error::Unavailable(gone));
        assert!(matches!(e, crate::Error::Unavailable(_)), "handed back");
        drop(permit);
        for w in behind {
            let ended = w.await.expect("waiter");
            assert!(
                matches!(ended, Err(NoTurn::AheadFailed(ref what)) if what.contains("server gone")),
                "{ended:?}"
            );
        }
        let permit = head
            .wait_turn(far)
            .await
            .expect("a later waiter asks for itself");
        let behind = queue(2);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let busy = crate::Error::Busy {
            key: "k".into(),
            remaining: None,
        };
        drop(head.failed(busy));
        drop(permit);
        for w in behind {
            assert!(
                w.await.expect("waiter").is_ok(),
                "not transient: turns go on"
            );
        }
    }

    #[tokio::test]
    async fn waiting_gives_up_at_the_deadline() {
        let reg = Arc::new(Turnstiles::default());
        let h = reg.enter("k");
        let _permit = h.wait_turn(Instant::now() + Duration::from_secs(1)).await;
        let other = reg.enter("k");
        let got = other
            .wait_turn(Instant::now() + Duration::from_millis(50))
            .await;
        assert!(matches!(got, Err(NoTurn::TimedOut)), "{got:?}");
    }
}
