//! The in-process backend: the embedded default, with the same semantics as the Redis scripts.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use super::{AcquireReply, Backend};
use crate::error::{Error, Result};
use crate::types::{KeyHash, LockKey, Token};
use crate::wake::{Wakeups, Watch};

/// Leases kept in this process. Clones share the same state.
///
/// Expiry, fences, token-checked release and extend, and wake-ups behave as on Redis, so code
/// tested here behaves the same against a server (`tests/memory_parity.rs` drives both with the
/// same random sequences), down to a lease living through the millisecond of its expiry, as a
/// Redis key does. It only excludes holders within one process.
/// Its operations never wait (a mutex, no I/O): `try_acquire` and `release` on it complete on
/// their first poll, which callers such as lock-tower's `LockLayer` may rely on. The one
/// acquire that finds the map of keys doubled since the last sweep walks it under that mutex
/// to drop forgotten fences (`keep_fence`): constant on average, but at millions of keys
/// that acquire, and any other call waiting on the mutex meanwhile, takes milliseconds.
///
/// ```
/// use lock_core::{Locker, LockOptions};
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// let locker = Locker::memory();
/// let lease = locker.try_acquire("report", &LockOptions::default()).await?;
/// assert!(locker.try_acquire("report", &LockOptions::default()).await.is_err());
/// lease.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    state: Mutex<State>,
    wakeups: Arc<Wakeups>,
    /// State other layers keep with this store, one value per type (see `shared`).
    shared: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
}

#[derive(Default)]
struct State {
    /// One slot per key ever locked: the holder (if any) beside the key's last fence, which
    /// outlives every holder, unless its grant let it be forgotten (`keep_fence`). One map, so
    /// an acquire or a release hashes the key once.
    keys: HashMap<LockKey, Slot, KeyHash>,
    /// The size `keys` may reach before the next sweep for forgettable slots.
    sweep_above: usize,
    gates: HashMap<String, u64>,
}

/// The fewest slots worth sweeping for: below it a sweep would run on nearly every acquire.
const SWEEP_FLOOR: usize = 1024;

impl State {
    /// Drops the slots no lease holds whose fence may be forgotten by now, once the map has
    /// doubled since the last sweep: a full pass each time the map doubles costs each acquire
    /// a constant share, and the map stays within about twice the keys still in use.
    fn sweep(&mut self, now: Instant) {
        if self.keys.len() <= self.sweep_above {
            return;
        }
        // A fence the clock has not passed yet (grants within one microsecond, a clock stepped
        // back) is kept whatever its keep says: forgotten, the next grant would take a lower
        // one from the clock.
        let clock = now_micros();
        self.keys.retain(|_, slot| {
            slot.live(now).is_some()
                || slot.forget_at.is_none_or(|forget| forget > now)
                || slot.fence >= clock
        });
        self.sweep_above = (2 * self.keys.len()).max(SWEEP_FLOOR);
        // The table after a burst of one-use keys would otherwise stay at its peak size, and
        // every later sweep would walk it.
        if self.keys.capacity() > 4 * self.sweep_above {
            self.keys.shrink_to(self.sweep_above);
        }
    }
}

#[derive(Default)]
struct Slot {
    holder: Option<(Token, Instant)>,
    fence: u64,
    /// When the fence may be forgotten, as a fence key's expiry on a server; `None`: never.
    forget_at: Option<Instant>,
}

impl Slot {
    /// The holder and its expiry, unless the lease has expired by `now`: an expired holder is
    /// as good as gone, as on a server that has expired the key.
    fn live(&mut self, now: Instant) -> Option<&mut (Token, Instant)> {
        self.holder
            .as_mut()
            .filter(|(_, expires)| lives(*expires, now))
    }
}

/// How long past its expiry a lease is still held: the millisecond of its expiry.
const LAST_MILLISECOND: Duration = Duration::from_millis(1);

/// Whether a lease that expires at `expires` is still held at `now`, as a key on Redis is:
/// there a key's expiry is a whole millisecond (the command's, plus the TTL) and the key is
/// expired only once the clock is past it (`now > when`), so it lives through the millisecond
/// of its expiry, from the TTL to 1 ms longer after the command, with a `PTTL` of 0 in that
/// last millisecond. Here a grant counts as made at the start of its millisecond: held until
/// 1 ms past `expires`, the longest a server keeps it, with 0 left meanwhile. Ended at the
/// exact instant, a lease was free here (on a paused clock, always) when a server still held
/// its key.
fn lives(expires: Instant, now: Instant) -> bool {
    now.saturating_duration_since(expires) < LAST_MILLISECOND
}

/// `d` in whole milliseconds, as the Redis backend sends a TTL or a keep (`PX`): a fraction kept
/// here would hold a lease up to a millisecond longer than a server holds its key.
fn as_sent(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl MemoryBackend {
    /// An empty store.
    ///
    /// ```
    /// use lock_core::{Locker, MemoryBackend};
    /// let backend = MemoryBackend::new();
    /// // Two lockers over one store see the same locks (clones share it).
    /// let (a, b) = (Locker::new(backend.clone()), Locker::new(backend));
    /// # let _ = (a, b);
    /// ```
    pub fn new() -> MemoryBackend {
        MemoryBackend::default()
    }

    /// A value of type `T` kept with this store and shared by everyone using it (its clones,
    /// every `Locker` over it), made with `T::default()` the first time it is asked for.
    ///
    /// For layers built on lock-core that keep data beside the locks: on a server that data
    /// lives next to the keys, so two users of one server see the same; here it lives with the
    /// store, so two users of one store do too (lock-tower's `DedupeLayer` keeps its results
    /// so). Use a type of your own, so that nobody else's value shares the slot.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use lock_core::MemoryBackend;
    ///
    /// #[derive(Default)]
    /// struct Deliveries(AtomicU64);
    ///
    /// let store = MemoryBackend::new();
    /// store.clone().shared::<Deliveries>().0.fetch_add(1, Ordering::Relaxed);
    /// assert_eq!(store.shared::<Deliveries>().0.load(Ordering::Relaxed), 1);
    /// assert_eq!(MemoryBackend::new().shared::<Deliveries>().0.load(Ordering::Relaxed), 0);
    /// ```
    pub fn shared<T: Any + Send + Sync + Default>(&self) -> Arc<T> {
        let slots = || {
            self.inner
                .shared
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        let found = slots().get(&TypeId::of::<T>()).cloned();
        if let Some(value) = found
            && let Ok(value) = value.downcast::<T>()
        {
            return value;
        }
        // Made without the lock held: a `Default` may itself ask this store for a value. Two
        // callers racing here each make one, and the first to insert wins for both.
        let made: Arc<dyn Any + Send + Sync> = Arc::new(T::default());
        let value = slots().entry(TypeId::of::<T>()).or_insert(made).clone();
        match value.downcast::<T>() {
            Ok(value) => value,
            // Unreachable: the slot is keyed by `T`'s own type id.
            Err(_) => Arc::new(T::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a lease on `key` is held and unexpired, as `EXISTS` on its lock key would tell.
    /// For tests and tools.
    ///
    /// ```
    /// use lock_core::{Locker, LockOptions, MemoryBackend, AnyBackend};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// let memory = MemoryBackend::new();
    /// let locker = Locker::new(AnyBackend::Memory(memory.clone()));
    /// let key = locker.lock_key("report")?;
    /// let lease = locker.try_acquire("report", &LockOptions::default()).await?;
    /// assert!(memory.is_held(&key));
    /// lease.release().await?;
    /// assert!(!memory.is_held(&key));
    /// # Ok(()) }
    /// ```
    pub fn is_held(&self, key: &LockKey) -> bool {
        let mut st = self.state();
        let now = Instant::now();
        st.keys
            .get_mut(key)
            .is_some_and(|slot| slot.live(now).is_some())
    }

    /// How many keys the store keeps an entry for: every key held, and every key whose fence
    /// it remembers, which is every key ever locked unless its grants let the fence be
    /// forgotten ([`LockOptions::keep_fence`](crate::LockOptions::keep_fence); forgotten
    /// entries go in sweeps, so some stay a while past their time). For tests and metrics.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{AnyBackend, LockOptions, Locker, MemoryBackend};
    ///
    /// let memory = MemoryBackend::new();
    /// let locker = Locker::new(AnyBackend::Memory(memory.clone()));
    /// locker.try_acquire("report", &LockOptions::new()).await?.release().await?;
    /// assert_eq!(memory.kept_keys(), 1); // its fence stays, for the next grant
    /// # Ok(()) }
    /// ```
    pub fn kept_keys(&self) -> usize {
        self.state().keys.len()
    }

    /// Deletes a lease whoever holds it, as an operator's `DEL` would; returns whether there
    /// was an unexpired one. For tests and tools. Waiters are not woken, as by a `DEL`.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{AnyBackend, LockOptions, Locker, MemoryBackend, Release};
    ///
    /// let memory = MemoryBackend::new();
    /// let locker = Locker::new(AnyBackend::Memory(memory.clone()));
    /// let lease = locker.try_acquire("job", &LockOptions::new()).await?;
    /// assert!(memory.force_delete(&locker.lock_key("job")?));
    /// assert_eq!(lease.release().await?, Release::NotHeld);
    /// # Ok(()) }
    /// ```
    pub fn force_delete(&self, key: &LockKey) -> bool {
        let mut st = self.state();
        let now = Instant::now();
        st.keys
            .get_mut(key)
            .and_then(|slot| slot.holder.take())
            .is_some_and(|(_, expires)| lives(expires, now))
    }
}

impl MemoryBackend {
    /// An acquire; `keep` is how long the fence outlives the grant (at least `ttl`), `None`
    /// for ever.
    fn grant(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        keep: Option<Duration>,
    ) -> Result<AcquireReply> {
        crate::types::validate_ttl(ttl)?;
        let (ttl, keep) = (as_sent(ttl), keep.map(as_sent));
        let mut st = self.state();
        // Read under the lock, as a server judges the key when the command runs: a clock read
        // before a wait for the lock would see an expired lease as held.
        let now = Instant::now();
        st.sweep(now);
        let slot = st.keys.entry(key.clone()).or_default();
        let fence = slot.fence;
        // As a fence key on a server: gone once its keep ran out, the clock past it.
        let forgotten = slot.forget_at.is_some_and(|f| !lives(f, now));
        if let Some((holder, expires)) = slot.live(now) {
            if holder == token {
                *expires = now + ttl;
                if forgotten {
                    // A retry after the keep ran out while the lease, extended, still held
                    // (an extend renews the lock, not the fence's keep): as acquire.lua, which
                    // finds no fence key then, the grant takes one from the clock and keeps it
                    // anew; above the one forgotten (the clock has passed it by then, as its
                    // keep covered its lead; the rise by one holds within a microsecond).
                    slot.fence = now_micros().max(fence.saturating_add(1));
                    slot.forget_at = keep
                        .map(|keep| keep.min(crate::types::MAX_KEEP_FENCE).max(ttl))
                        .and_then(|keep| now.checked_add(keep));
                    return Ok(AcquireReply::Granted {
                        fence: slot.fence,
                        valid_from: None,
                    });
                }
                return Ok(AcquireReply::Granted {
                    fence,
                    valid_from: None,
                });
            }
            // 0 in the lease's last millisecond, as `PTTL` answers then.
            return Ok(AcquireReply::Held {
                remaining: Some(expires.saturating_duration_since(now)),
            });
        }
        let clock = now_micros();
        // As acquire.lua: no fence above 2^64 - 1 exists, so none is granted (nothing changed).
        let Some(next) = slot.fence.checked_add(1) else {
            return Err(Error::FenceExhausted {
                key: key.key().to_owned(),
            });
        };
        slot.fence = next.max(clock);
        slot.holder = Some((token.clone(), now + ttl));
        // As acquire.lua's `put_fence`: a fence ahead of the clock (a clock stepped back) is
        // kept the keep past the moment the clock reaches it, and one over a year ahead for
        // ever; forgotten sooner, the next grant could take a lower one from the clock. A keep
        // too long to add is as good as for ever. The keep is capped at a year as the Redis
        // backend caps it: this trait method is public, and a caller may pass `Duration::MAX`.
        let ahead = Duration::from_micros(slot.fence - clock);
        slot.forget_at = keep
            .filter(|_| ahead <= crate::types::MAX_KEEP_FENCE)
            .and_then(|keep| {
                keep.min(crate::types::MAX_KEEP_FENCE)
                    .max(ttl)
                    .checked_add(ahead)
            })
            .and_then(|keep| now.checked_add(keep));
        Ok(AcquireReply::Granted {
            fence: slot.fence,
            valid_from: None,
        })
    }
}

fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

impl Backend for MemoryBackend {
    const NAME: &'static str = "in-memory";

    async fn acquire(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<AcquireReply> {
        self.grant(key, token, ttl, None)
    }

    async fn acquire_keeping_fence(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        keep: Duration,
    ) -> Result<AcquireReply> {
        self.grant(key, token, ttl, Some(keep))
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool> {
        let released = {
            let mut st = self.state();
            // Read under the lock, as a server would judge the key when the command runs.
            let now = Instant::now();
            let slot = st.keys.get_mut(key);
            slot.is_some_and(|slot| {
                let ours = slot.live(now).is_some_and(|(h, _)| h == token);
                if ours {
                    slot.holder = None;
                }
                ours
            })
        };
        if released {
            self.inner.wakeups.wake(key.channel());
        }
        Ok(released)
    }

    async fn extend(&self, items: &[(LockKey, Token)], ttl: Duration) -> Result<Vec<bool>> {
        crate::types::validate_ttl(ttl)?;
        let ttl = as_sent(ttl);
        let mut st = self.state();
        // Under the lock, as in `release`: read before a wait for it, the clock would let an
        // extend renew a lease that expired while it waited.
        let now = Instant::now();
        Ok(items
            .iter()
            .map(
                |(key, token)| match st.keys.get_mut(key).and_then(|s| s.live(now)) {
                    Some((holder, expires)) if holder == token => {
                        *expires = now + ttl;
                        true
                    }
                    _ => false,
                },
            )
            .collect())
    }

    async fn admit(&self, gate_key: &str, fence: u64) -> Result<Option<u64>> {
        let mut st = self.state();
        let highest = st.gates.entry(gate_key.to_owned()).or_insert(0);
        if fence < *highest {
            return Ok(Some(*highest));
        }
        *highest = fence;
        Ok(None)
    }

    async fn watch(&self, key: &LockKey) -> Result<Watch> {
        let channel = key.channel().to_owned();
        let (rx, _) = self.inner.wakeups.register(&channel);
        Ok(Watch {
            rx,
            channel,
            wakeups: self.inner.wakeups.clone(),
            on_last: None,
        })
    }

    fn wakeups(&self) -> &Arc<Wakeups> {
        &self.inner.wakeups
    }

    // An acquire completes on its first poll: it cannot be dropped in flight.
    fn undoes_abandoned_grants(&self) -> bool {
        true
    }

    fn token(&self) -> Token {
        Token::generate_in_process()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    thread_local! {
        static STORE: std::cell::RefCell<Option<MemoryBackend>> = const { std::cell::RefCell::new(None) };
    }

    #[derive(Default)]
    struct Part(u8);

    /// Made from another shared value of the same store.
    struct Outer(Arc<Part>);

    impl Default for Outer {
        fn default() -> Self {
            let store = STORE.with_borrow(|s| s.clone()).expect("store set");
            Outer(store.shared::<Part>())
        }
    }

    /// A `Default` that asks the same store for another value does not deadlock, and the
    /// values are shared by the store's clones.
    #[test]
    fn shared_values_may_be_made_from_shared_values() {
        let store = MemoryBackend::new();
        STORE.with_borrow_mut(|s| *s = Some(store.clone()));
        let outer = store.clone().shared::<Outer>();
        assert!(Arc::ptr_eq(&outer.0, &store.shared::<Part>()));
        assert!(Arc::ptr_eq(&outer, &store.shared::<Outer>()));
        assert_eq!(outer.0.0, 0);
    }

    /// Runs a memory operation, which completes on its first poll.
    pub(crate) fn at_once<F: Future>(f: F) -> F::Output {
        match std::pin::pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(out) => out,
            Poll::Pending => panic!("memory operations complete at once"),
        }
    }

    /// A keep of `Duration::MAX` ("for ever", as a caller of the public trait method may
    /// pass) on a fence ahead of the clock is capped as on Redis: granted, not a panic that
    /// left the key held by a token nobody was given. And a stored fence of 2^64 - 1 refuses
    /// the grant with nothing changed, as acquire.lua does.
    #[test]
    fn extreme_keeps_and_fences_are_refused_or_capped_not_a_panic() {
        let memory = MemoryBackend::new();
        let key = crate::Locker::memory().lock_key("k").expect("key");
        let ahead = Slot {
            holder: None,
            fence: now_micros() + 1_000_000,
            forget_at: None,
        };
        memory.state().keys.insert(key.clone(), ahead);
        let granted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            at_once(memory.acquire_keeping_fence(
                &key,
                &Token::generate(),
                Duration::from_secs(1),
                Duration::MAX,
            ))
        }));
        assert!(
            matches!(granted, Ok(Ok(AcquireReply::Granted { .. }))),
            "{granted:?}"
        );

        let spent = crate::Locker::memory().lock_key("spent").expect("key");
        let last = Slot {
            holder: None,
            fence: u64::MAX,
            forget_at: None,
        };
        memory.state().keys.insert(spent.clone(), last);
        let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            at_once(memory.acquire(&spent, &Token::generate(), Duration::from_secs(1)))
        }));
        assert!(
            matches!(refused, Ok(Err(Error::FenceExhausted { .. }))),
            "{refused:?}"
        );
        assert!(!memory.is_held(&spent));

        // The grant of 2^64 - 1 itself, retried with its token, is handed back that fence, as
        // acquire.lua does (`fence_ahead_of_the_clock_rises_by_one` on Redis and Valkey).
        let last = crate::Locker::memory().lock_key("last").expect("key");
        let before_last = Slot {
            holder: None,
            fence: u64::MAX - 1,
            forget_at: None,
        };
        memory.state().keys.insert(last.clone(), before_last);
        let token = Token::generate();
        for attempt in ["first", "retried"] {
            let reply = at_once(memory.acquire(&last, &token, Duration::from_secs(1)));
            assert!(
                matches!(
                    reply,
                    Ok(AcquireReply::Granted {
                        fence: u64::MAX,
                        ..
                    })
                ),
                "{attempt} grant: {reply:?}"
            );
            assert!(memory.is_held(&last));
        }
    }

    /// An extend (or a grant) that waits for the store's lock judges the lease when it gets
    /// the lock, as a server judges a key when the command runs: a lease that expired while it
    /// waited is not renewed (it was, on a clock read before the wait).
    #[test]
    fn expiry_is_judged_when_the_lock_is_taken() {
        let memory = MemoryBackend::new();
        let locker = crate::Locker::memory();
        let key = locker.lock_key("waited").expect("key");
        let token = Token::generate();
        let ttl = Duration::from_millis(200);
        let sent = std::time::Instant::now();
        let granted = at_once(memory.acquire(&key, &token, ttl));
        assert!(matches!(granted, Ok(AcquireReply::Granted { .. })));
        let held = memory.state();
        let (m, k, t) = (memory.clone(), key.clone(), token.clone());
        let (calling, called) = std::sync::mpsc::channel();
        let extend = std::thread::spawn(move || {
            calling.send(()).expect("the test waits for this");
            at_once(m.extend(&[(k, t)], Duration::from_secs(10))).expect("extend")
        });
        // The extend is called while the lease is live (not merely once this thread got round
        // to it, which could be after the expiry and test nothing), and waits for the lock
        // past the lease's expiry.
        called.recv().expect("the extend's thread started");
        assert!(
            sent.elapsed() < ttl,
            "the extend's thread started only after the lease expired: nothing tested"
        );
        std::thread::sleep(
            (sent + ttl + Duration::from_millis(50))
                .saturating_duration_since(std::time::Instant::now()),
        );
        drop(held);
        assert_eq!(extend.join().expect("the extend's thread"), [false]);
        assert!(!memory.is_held(&key));
    }

    /// A lease lives through the millisecond of its expiry, as a key on Redis does (its expiry
    /// is a whole millisecond, and it is expired only once the clock is past it): exactly its
    /// TTL after the grant it is still held, with 0 left (`PTTL` 0), and can be released or
    /// extended by its holder; 1 ms later it is gone. On the paused clock, as tests of code
    /// over this backend run: ending it at the exact instant freed a key that Redis still held.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_lease_is_held_through_the_millisecond_of_its_expiry() {
        let memory = MemoryBackend::new();
        let locker = crate::Locker::memory();
        let (extended, released) = (
            locker.lock_key("extended").expect("key"),
            locker.lock_key("released").expect("key"),
        );
        let (holder, other) = (Token::generate(), Token::generate());
        let ttl = Duration::from_millis(100);
        for key in [&extended, &released] {
            let granted = at_once(memory.acquire(key, &holder, ttl)).expect("acquire");
            assert!(
                matches!(granted, AcquireReply::Granted { .. }),
                "{granted:?}"
            );
        }
        tokio::time::advance(ttl).await;
        for key in [&extended, &released] {
            assert!(
                memory.is_held(key),
                "{}: gone at its expiry instant",
                key.key()
            );
            let reply = at_once(memory.acquire(key, &other, ttl)).expect("acquire");
            assert_eq!(
                reply,
                AcquireReply::Held {
                    remaining: Some(Duration::ZERO)
                },
                "{}",
                key.key()
            );
        }
        let items = [(extended.clone(), holder.clone())];
        assert_eq!(at_once(memory.extend(&items, ttl)).expect("extend"), [true]);
        assert!(at_once(memory.release(&released, &holder)).expect("release"));

        // The extended lease: still held 999 µs past its new expiry, gone 1 ms past it.
        tokio::time::advance(ttl + Duration::from_micros(999)).await;
        assert!(memory.is_held(&extended));
        tokio::time::advance(Duration::from_micros(1)).await;
        assert!(!memory.is_held(&extended));
        let reply = at_once(memory.acquire(&extended, &other, ttl)).expect("acquire");
        assert!(matches!(reply, AcquireReply::Granted { .. }), "{reply:?}");
    }

    /// A TTL with a fraction of a millisecond holds as long as on Redis, which is sent whole
    /// milliseconds: 10.9 ms is 10 ms there, so the lease is free 11.5 ms on (through its last
    /// millisecond, not 1.9 ms past it); an extend's likewise.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_fraction_of_a_millisecond_is_not_held() {
        let memory = MemoryBackend::new();
        let key = crate::Locker::memory().lock_key("fraction").expect("key");
        let (holder, other) = (Token::generate(), Token::generate());
        let ttl = Duration::from_micros(10_900);
        let granted = at_once(memory.acquire(&key, &holder, ttl)).expect("acquire");
        assert!(
            matches!(granted, AcquireReply::Granted { .. }),
            "{granted:?}"
        );
        match at_once(memory.acquire(&key, &other, ttl)).expect("acquire") {
            AcquireReply::Held { remaining } => {
                assert_eq!(
                    remaining,
                    Some(Duration::from_millis(10)),
                    "as PTTL answers"
                )
            }
            reply => panic!("{reply:?}"),
        }
        tokio::time::advance(Duration::from_micros(11_500)).await;
        let taken = at_once(memory.acquire(&key, &other, ttl)).expect("acquire");
        assert!(matches!(taken, AcquireReply::Granted { .. }), "{taken:?}");
        let items = [(key.clone(), other.clone())];
        assert_eq!(at_once(memory.extend(&items, ttl)).expect("extend"), [true]);
        tokio::time::advance(Duration::from_micros(11_500)).await;
        assert_eq!(
            at_once(memory.extend(&items, ttl)).expect("extend"),
            [false]
        );
    }

    /// The holder's repeated acquire (a lost reply's retry) once a keep-fence grant's keep ran
    /// out while its lease, extended, still held: as on Redis, whose fence key has expired by
    /// then, it gets a fence higher than the grant's, kept anew; within the keep, the grant's own.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_retry_past_the_keep_takes_a_new_fence() {
        let memory = MemoryBackend::new();
        let key = crate::Locker::memory().lock_key("kept").expect("key");
        let token = Token::generate();
        let ms = Duration::from_millis;
        let fence = |reply| match reply {
            AcquireReply::Granted { fence, .. } => fence,
            other => panic!("{other:?}"),
        };
        let first = fence(
            at_once(memory.acquire_keeping_fence(&key, &token, ms(20), ms(0))).expect("acquire"),
        );
        let items = [(key.clone(), token.clone())];
        assert_eq!(
            at_once(memory.extend(&items, ms(1_000))).expect("extend"),
            [true]
        );
        tokio::time::advance(ms(15)).await;
        let within = fence(at_once(memory.acquire(&key, &token, ms(1_000))).expect("acquire"));
        assert_eq!(within, first, "a retry within the keep");
        tokio::time::advance(ms(45)).await;
        let past = fence(at_once(memory.acquire(&key, &token, ms(1_000))).expect("acquire"));
        assert!(
            past > first,
            "a retry past the keep answered {past}, the grant had {first}"
        );
        // Kept anew (for ever: the retry named no keep), so the next retry answers it again.
        tokio::time::advance(ms(100)).await;
        let again = fence(at_once(memory.acquire(&key, &token, ms(1_000))).expect("acquire"));
        assert_eq!(again, past);
    }

    /// A fence ahead of the clock is kept the keep past the moment the clock reaches it, as
    /// on Redis (`put_fence` in acquire.lua), not the keep past the grant; over a year ahead,
    /// for ever.
    #[test]
    fn a_fence_ahead_of_the_clock_is_kept_past_it() {
        let memory = MemoryBackend::new();
        let locker = crate::Locker::memory();
        let key = locker.lock_key("ahead").expect("key");
        let keep = Duration::from_millis(100);
        for (ahead, kept_at_least) in [
            (
                Duration::from_secs(10),
                Some(Duration::from_secs(10) + keep),
            ),
            (Duration::from_secs(2 * 365 * 86_400), None),
        ] {
            let fence = now_micros() + u64::try_from(ahead.as_micros()).expect("micros");
            memory.state().keys.insert(
                key.clone(),
                Slot {
                    holder: None,
                    fence,
                    forget_at: None,
                },
            );
            let before = Instant::now();
            let granted = at_once(memory.acquire_keeping_fence(
                &key,
                &Token::generate(),
                Duration::from_millis(10),
                keep,
            ));
            assert!(
                matches!(granted, Ok(AcquireReply::Granted { fence: f, .. }) if f == fence + 1),
                "{granted:?}"
            );
            let forget_at = memory.state().keys.get(&key).expect("slot").forget_at;
            match kept_at_least {
                Some(at_least) => {
                    let at = forget_at.expect("forgotten some day");
                    // Within a few milliseconds of the clock reading: at least the keep past
                    // the fence, less what passed between the readings.
                    assert!(
                        at + Duration::from_millis(5) >= before + at_least,
                        "{ahead:?}"
                    );
                }
                None => assert_eq!(forget_at, None, "{ahead:?}"),
            }
        }
    }

    /// A fence whose keep ran out is forgotten on this backend only when a sweep drops its
    /// entry (README, Clocks): until then the next grant's fence rises from it, even where
    /// the clock has fallen behind it (a clock stepped back after the keep ran out), rather
    /// than coming from the clock alone as on a server whose fence key expired.
    #[test]
    fn a_forgotten_fence_not_yet_swept_still_rises() {
        let memory = MemoryBackend::new();
        let key = crate::Locker::memory().lock_key("stepped").expect("key");
        let fence = now_micros() + 10_000_000;
        memory.state().keys.insert(
            key.clone(),
            Slot {
                holder: None,
                fence,
                forget_at: Some(Instant::now() - Duration::from_millis(1)),
            },
        );
        let granted = at_once(memory.acquire_keeping_fence(
            &key,
            &Token::generate(),
            Duration::from_millis(10),
            Duration::from_millis(100),
        ));
        assert!(
            matches!(granted, Ok(AcquireReply::Granted { fence: f, .. }) if f == fence + 1),
            "{granted:?}, the forgotten fence was {fence}"
        );
    }

    /// A sweep drops exactly the entries no lease holds whose keep is over, and runs only
    /// once the map has grown past its threshold.
    #[test]
    fn a_sweep_keeps_what_is_held_or_remembered() {
        let locker = crate::Locker::memory();
        let key = |k: &str| locker.lock_key(k).expect("key");
        let now = Instant::now();
        let (past, future) = (now - Duration::from_millis(1), now + Duration::from_secs(1));
        let slot = |expires: Option<Instant>, forget_at| Slot {
            holder: expires.map(|e| (Token::generate(), e)),
            fence: 1,
            forget_at,
        };
        let ahead = Slot {
            fence: now_micros() + 60_000_000,
            ..slot(None, Some(past))
        };
        let mut st = State::default();
        st.keys.insert(key("forever"), slot(None, None));
        st.keys.insert(key("forgotten"), slot(None, Some(past)));
        st.keys
            .insert(key("holder-expired"), slot(Some(past), Some(past)));
        st.keys.insert(key("remembered"), slot(None, Some(future)));
        st.keys
            .insert(key("held-past-keep"), slot(Some(future), Some(past)));
        st.keys.insert(key("ahead-of-the-clock"), ahead);
        st.sweep_above = 5;
        st.sweep(now);
        let mut left: Vec<&str> = st.keys.keys().map(LockKey::key).collect();
        left.sort_unstable();
        assert_eq!(
            left,
            [
                "ahead-of-the-clock",
                "forever",
                "held-past-keep",
                "remembered"
            ]
        );
        assert_eq!(st.sweep_above, SWEEP_FLOOR);
        st.keys.insert(key("forgotten"), slot(None, Some(past)));
        st.sweep(now);
        assert_eq!(st.keys.len(), 5, "swept below the threshold");
    }

    /// After a burst of one-use keys the table shrinks with the sweep, rather than staying at
    /// its peak size for every later sweep to walk.
    #[test]
    fn a_sweep_gives_back_the_table() {
        let locker = crate::Locker::memory();
        let now = Instant::now();
        let mut st = State::default();
        for i in 0..100_000 {
            let key = locker.lock_key(&format!("once:{i}")).expect("key");
            let slot = Slot {
                holder: None,
                fence: 1,
                forget_at: Some(now - Duration::from_millis(1)),
            };
            st.keys.insert(key, slot);
        }
        st.sweep(now);
        assert!(st.keys.is_empty());
        assert!(
            st.keys.capacity() <= 4 * SWEEP_FLOOR,
            "capacity {}",
            st.keys.capacity()
        );
    }
}
