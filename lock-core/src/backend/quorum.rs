//! Redlock over N independent Redis / Valkey servers, with fences that keep increasing when the
//! majority changes.
//!
//! # The algorithm
//!
//! A quorum is `N/2 + 1` of the N members. An acquire:
//!
//! 1. notes the monotonic clock, then asks every member at once to vote (`SET NX PX` with the
//!    token, reading the member's stored fence and its clock), each bounded by a per-member
//!    timeout much smaller than the TTL ([`QuorumConfig::member_timeout`], 250 ms by default,
//!    and never past the validity, since a later answer cannot count); once a quorum has
//!    granted, the rest are waited for only until half the validity is gone, so that one slow
//!    member cannot leave a lease shorter than the timeout no time (once a quorum found the key
//!    held, nothing more is waited for: step 3);
//! 2. with a quorum of grants and validity left (`ttl - elapsed - drift`, drift = 1% of the TTL
//!    plus 2 ms, elapsed counted from step 1), picks the fence `F` and writes it back to the
//!    granting members (below), and needs a quorum of those writes, still within the validity;
//!    the other writes are waited for only until the same half of the validity is gone, so a
//!    member that voted just in time does not cost the lease its slowness a second time;
//! 3. on any failure releases the key on every member that might hold it (all but those that
//!    answered "held by another"), then retries after a random delay
//!    ([`QuorumConfig::retries`], [`QuorumConfig::retry_delay`]) while the first half of the TTL
//!    lasts. A lease won by a retry counts its validity from the start of the round that won
//!    it (step 1 of that round), not of the first: each vote of that round set the TTL anew on
//!    its member, and the failed rounds' grants were given back before it began. A quorum of
//!    "held by another" is an ordinary busy answer and is not retried; it is answered as soon
//!    as that quorum has, without waiting for the other members or for the give-backs of what
//!    they may have granted, which go on in the background.
//!    Nor is a round whose release a member did not answer: that release may still land,
//!    checked against this token, and would take back the vote a next round with the same
//!    token won there (the grant then held by fewer members than it was counted with). The
//!    acquire ends with the round's answer, and a waiting [`Locker`](crate::Locker) tries again
//!    with a fresh token.
//!
//! Extend needs a quorum of members to renew within the validity; release runs on every member,
//! and both answer as soon as enough members have to decide (a hung member's call still runs to
//! the end in the background, while the runtime runs: a program that exits at once after a
//! release may leave a minority member's copy to expire with its TTL).
//!
//! # Fences on a quorum
//!
//! Each vote returns the member's stored fence `s_i` and its clock `t_i` in microseconds. The
//! client picks `F = max(max s_i + 1, max t_i)` and writes it to each granting member with a
//! script that sets the fence key to `max(stored, F)` **only while that member's lock key still
//! holds this token**. The grant is handed out only once a quorum `W` of members took the write.
//!
//! Why `F` strictly increases from one grant to the next: take a grant G1 (fence F1, write
//! quorum W1) and any grant G2 (fence F2, vote quorum A2) that took its members after G1 wrote
//! to them. Two quorums of the same N members share at least one member m. When G1 wrote F1 to
//! m, m's lock key held G1's token, so G2's `SET NX` on m succeeded only after G1's token left m;
//! G2 therefore read `s_m >= F1` on m and picked `F2 >= s_m + 1 > F1`. (Had G2 taken m first,
//! G1's token-checked write would have failed there, and m would not be in W1.) On every member
//! the fence key only ever grows, so this holds across any number of grants and any change of
//! majority: any two successful grants are ordered by their fences the same way they are
//! ordered on each member they share.
//!
//! # Limits
//!
//! - **Restarts without persistence.** A member restarted empty forgets its lock keys and fence
//!   keys. It can then help a second client form a quorum while the first lease is still valid
//!   (the known Redlock restart problem: run members with `appendonly yes` and `appendfsync
//!   always`, or keep a restarted member out for one maximum TTL), and it breaks the
//!   intersection argument above when it was the only shared member. The clock term `max t_i`
//!   covers that case: fences remain increasing as long as member clocks never step back and
//!   differ from each other by less than the time between the two grants. Without the clock
//!   term a restart would let the fence go backwards.
//! - **Clocks.** Validity is measured on the client's monotonic clock and assumes the servers
//!   expire keys at roughly the rate it runs (the drift allowance). As for every lease, a
//!   paused holder can outlive its lease: the fence, checked by the resource, is what keeps the
//!   data safe.
//! - **Timeouts.** A member that timed out may still have granted; the failure path releases it
//!   (token-checked), and a release that does not arrive leaves the key to expire with its TTL.
//! - **Members are distinct servers.** The same address listed twice is refused (under two
//!   database numbers too, and however its host is spelt: `Redis-A` and `redis-a`, `127.1`
//!   and `127.0.0.1`), but two names for one server (a host name and its IP, two host names)
//!   cannot be told apart and would count twice.
//!
//! # Wake-ups
//!
//! A waiter subscribes on every connected member: any release publishes on each member it
//! reaches, so one live member is enough to wake it, and a reconnecting member's subscriber
//! wakes everyone. Its wait begins once a quorum of members has subscribed (a lease is deleted,
//! and published, on a quorum, one of which is then always among them); a slower member's
//! subscription joins when it comes. A member that stays down only costs its share; waiters also have a timer.
//!
//! # Fence gates
//!
//! [`FenceGate::admit`](crate::FenceGate::admit) runs on every member: a fence is admitted when a
//! quorum admits it and no member has seen a higher one (then it is stale). An admitted fence is
//! stored on a quorum, which any later admit's quorum intersects, so a lower fence offered later
//! meets it and is refused.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::{Script, Value};
use tokio::time::Instant;
use tracing::{Instrument, debug, debug_span, warn};

use super::redis::{RedisBackend, RedisConfig, int, text, unexpected};
use super::{AcquireReply, Backend};
use crate::error::{Error, Result, classify};
use crate::types::{LockKey, Token, drift};
use crate::wake::{Wakeups, Watch};

/// Settings for [`QuorumBackend`]. The defaults suit members on the same network.
///
/// ```
/// use lock_core::backend::QuorumConfig;
/// use std::time::Duration;
/// let config = QuorumConfig::default().member_timeout(Duration::from_millis(50)).retries(5);
/// assert_eq!(config.retries, 5);
/// ```
#[derive(Clone, Debug)]
pub struct QuorumConfig {
    /// How long one member may take to answer one step of an acquire (its vote, the fence
    /// write-back, the release after a failed round), a release or a fence-gate check (default
    /// 250 ms). An acquire never waits past the lease's validity (a later answer cannot count),
    /// and the members' own [`RedisConfig::response_timeout`] bounds it too. Renewal waits up to
    /// the lease's validity instead, but only for members whose answer still matters (see
    /// [`Backend::extend`] on [`QuorumBackend`]).
    pub member_timeout: Duration,
    /// How many more rounds an acquire tries after a round without a quorum (default 2); none
    /// after a round whose release a member left unanswered (see the module docs).
    pub retries: u32,
    /// The upper bound of the random pause before a retry (default 200 ms, and at most a quarter
    /// of the TTL; the pause is drawn from its upper half), so that competing clients stop
    /// splitting the votes.
    pub retry_delay: Duration,
    /// Connection settings for every member.
    pub redis: RedisConfig,
}

impl Default for QuorumConfig {
    fn default() -> Self {
        QuorumConfig {
            member_timeout: Duration::from_millis(250),
            retries: 2,
            retry_delay: Duration::from_millis(200),
            redis: RedisConfig::default(),
        }
    }
}

impl QuorumConfig {
    /// Sets [`member_timeout`](Self::member_timeout).
    ///
    /// ```
    /// use lock_core::QuorumConfig;
    /// use std::time::Duration;
    /// let config = QuorumConfig::default().member_timeout(Duration::from_millis(50));
    /// assert_eq!(config.member_timeout, Duration::from_millis(50));
    /// ```
    pub fn member_timeout(mut self, timeout: Duration) -> Self {
        self.member_timeout = timeout;
        self
    }
    /// Sets [`retries`](Self::retries).
    ///
    /// ```
    /// let config = lock_core::QuorumConfig::default().retries(0); // one round only
    /// assert_eq!(config.retries, 0);
    /// ```
    pub fn retries(mut self, retries: u32) -> Self {
        self.retries = retries;
        self
    }
    /// Sets [`retry_delay`](Self::retry_delay).
    ///
    /// ```
    /// use std::time::Duration;
    /// let config = lock_core::QuorumConfig::default().retry_delay(Duration::from_millis(50));
    /// assert_eq!(config.retry_delay, Duration::from_millis(50));
    /// ```
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }
    /// Sets the connection settings of every member.
    ///
    /// ```
    /// use lock_core::{QuorumConfig, RedisConfig};
    /// use std::time::Duration;
    /// let redis = RedisConfig::default().connection_timeout(Duration::from_millis(200));
    /// let config = QuorumConfig::default().redis(redis);
    /// assert_eq!(config.redis.connection_timeout, Duration::from_millis(200));
    /// ```
    pub fn redis(mut self, redis: RedisConfig) -> Self {
        self.redis = redis;
        self
    }
}

/// Redlock: one lease over N independent Redis or Valkey servers (N = 3 or 5 in practice), held
/// while a majority holds it, with fences that strictly increase even when the majority changes.
/// Clones share the connections. See the [module docs](self) for the algorithm, why the fences
/// increase, and the limits.
///
/// ```no_run
/// use lock_core::{Locker, LockOptions};
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// let locker = Locker::redlock(&[
///     "redis://10.0.0.1:6379/",
///     "redis://10.0.0.2:6379/",
///     "redis://10.0.0.3:6379/",
/// ])
/// .await?;
/// let lease = locker.acquire("orders:42", &LockOptions::default()).await?;
/// println!("fence {}", lease.fence());
/// lease.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct QuorumBackend {
    inner: Arc<Inner>,
}

struct Inner {
    /// Filled as each member connects; a member down at start-up is retried in the background.
    members: Vec<OnceLock<RedisBackend>>,
    quorum: usize,
    config: QuorumConfig,
    vote: Script,
    write_fence: Script,
    wakeups: Arc<Wakeups>,
    next_watch: AtomicU64,
    /// When a member's foreign key was last logged at `warn`: once in a while is enough to
    /// tell an operator, and every round of every waiter would bury the log.
    foreign_warned: std::sync::Mutex<Option<Instant>>,
}

/// How often a member holding a foreign key is logged at `warn` (at `debug` in between).
const FOREIGN_WARN_EVERY: Duration = Duration::from_secs(10);

/// One member's answer to a vote.
enum Vote {
    Granted { stored: u64, now_us: u64 },
    Held { remaining: Option<Duration> },
}

/// How one acquire round ended.
enum Round {
    Granted(u64),
    Held(Option<Duration>),
    Failed {
        agreed: usize,
        answered: usize,
        held: Option<Option<Duration>>,
        /// Every give-back of the round was answered. One that was not may still run on its
        /// member, token-checked on this token: another round with the same token could win
        /// that member and then lose its vote to the late give-back.
        settled: bool,
    },
    Refused(Error),
}

/// A member's server address in one spelling, so that one server written two ways is seen
/// listed twice: host names compared without case or a trailing dot, IP addresses in their
/// canonical form (`127.1`, `0x7f.0.0.1` and `127.0.0.1` are one address), as a browser reads
/// a URL's host. A host name and its IP still cannot be told apart without asking a resolver.
fn member_address(addr: &redis::ConnectionAddr) -> String {
    match addr {
        redis::ConnectionAddr::Tcp(host, port)
        | redis::ConnectionAddr::TcpTls { host, port, .. } => {
            let host = match url::Host::parse(host) {
                Ok(url::Host::Domain(name)) => name.trim_end_matches('.').to_owned(),
                Ok(ip) => ip.to_string(),
                Err(_) => host.to_ascii_lowercase(),
            };
            format!("{host}:{port}")
        }
        other => other.to_string(),
    }
}

impl QuorumBackend {
    /// Connects to every member (`redis://host:port/db`) with default settings.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Locker, QuorumBackend};
    /// let backend = QuorumBackend::connect(&[
    ///     "redis://10.0.0.1:6379/",
    ///     "redis://10.0.0.2:6379/",
    ///     "redis://10.0.0.3:6379/",
    /// ])
    /// .await?;
    /// let locker = Locker::new(backend);
    /// # Ok(()) }
    /// ```
    pub async fn connect(urls: &[&str]) -> Result<QuorumBackend> {
        QuorumBackend::connect_with(urls, QuorumConfig::default()).await
    }

    /// Connects to every member with explicit settings.
    ///
    /// Needs at least three distinct members, and a quorum of them reachable now: the others
    /// are connected in the background as they come up. A URL that cannot be parsed is an
    /// [`Error::Unavailable`]; too few members or one listed twice is an
    /// [`Error::InvalidQuorum`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use lock_core::{Error, QuorumBackend, QuorumConfig};
    /// let two = ["redis://10.0.0.1:6379/", "redis://10.0.0.2:6379/"];
    /// let refused = QuorumBackend::connect_with(&two, QuorumConfig::default()).await;
    /// assert!(matches!(refused, Err(Error::InvalidQuorum { .. }))); // refused before connecting
    ///
    /// // A member timeout under 1 ms would count every vote as missing: refused too.
    /// let three = ["redis://10.0.0.1:6379/", "redis://10.0.0.2:6379/", "redis://10.0.0.3:6379/"];
    /// let zero = QuorumConfig { member_timeout: std::time::Duration::ZERO, ..QuorumConfig::default() };
    /// let refused = QuorumBackend::connect_with(&three, zero).await;
    /// assert!(matches!(refused, Err(Error::InvalidDuration { what: "member timeout", .. })));
    /// # }
    /// ```
    pub async fn connect_with(urls: &[&str], config: QuorumConfig) -> Result<QuorumBackend> {
        config.redis.validate()?;
        if config.member_timeout < Duration::from_millis(1) {
            return Err(Error::InvalidDuration {
                what: "member timeout",
                value: config.member_timeout,
                reason: "under 1 ms: every vote would count as missing",
            });
        }
        if urls.len() < 3 {
            return Err(Error::InvalidQuorum {
                reason: "a quorum needs at least 3 members (use one server directly otherwise)",
            });
        }
        let mut seen = Vec::with_capacity(urls.len());
        for url in urls {
            let client = redis::Client::open(*url).map_err(Error::Unavailable)?;
            let info = client.get_connection_info();
            // The address alone: two database numbers of one server are still one server,
            // which would vote twice and fail (or restart empty) as two members at once.
            let id = member_address(info.addr());
            if seen.contains(&id) {
                return Err(Error::InvalidQuorum {
                    reason: "a server is listed twice; it would vote twice",
                });
            }
            seen.push(id);
        }
        let inner = Arc::new(Inner {
            members: urls.iter().map(|_| OnceLock::new()).collect(),
            quorum: urls.len() / 2 + 1,
            config,
            vote: Script::new(include_str!("../lua/quorum_acquire.lua")),
            write_fence: Script::new(include_str!("../lua/quorum_fence.lua")),
            wakeups: Arc::new(Wakeups::default()),
            next_watch: AtomicU64::new(0),
            foreign_warned: std::sync::Mutex::new(None),
        });
        let redis_config = inner.config.redis.clone();
        let attempts = urls
            .iter()
            .map(|url| RedisBackend::connect_with(url, redis_config.clone()));
        let results = futures_util::future::join_all(attempts).await;
        let mut first_error = None;
        for (i, result) in results.into_iter().enumerate() {
            match result {
                Ok(backend) => {
                    let _ = inner.members[i].set(backend);
                }
                Err(e) => {
                    warn!(member = i, error = %e, "quorum member unreachable; retrying in the background");
                    tokio::spawn(reconnect(Arc::downgrade(&inner), i, urls[i].to_owned()));
                    first_error.get_or_insert(e);
                }
            }
        }
        let preloads = inner
            .members
            .iter()
            .filter_map(OnceLock::get)
            .map(|m| inner.preload(m));
        futures_util::future::join_all(preloads).await;
        let connected = inner.members.iter().filter(|m| m.get().is_some()).count();
        if connected < inner.quorum
            && let Some(e) = first_error
        {
            return Err(e);
        }
        Ok(QuorumBackend { inner })
    }

    /// How many members there are.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// let urls = [
    ///     "redis://a:6379/", "redis://b:6379/", "redis://c:6379/",
    ///     "redis://d:6379/", "redis://e:6379/",
    /// ];
    /// let backend = lock_core::QuorumBackend::connect(&urls).await?;
    /// assert_eq!((backend.members(), backend.quorum()), (5, 3));
    /// # Ok(()) }
    /// ```
    pub fn members(&self) -> usize {
        self.inner.members.len()
    }

    /// How many members must agree: `members / 2 + 1`.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// let urls = ["redis://a:6379/", "redis://b:6379/", "redis://c:6379/"];
    /// let backend = lock_core::QuorumBackend::connect(&urls).await?;
    /// assert_eq!(backend.quorum(), 2); // one member may be down
    /// # Ok(()) }
    /// ```
    pub fn quorum(&self) -> usize {
        self.inner.quorum
    }

    /// The per-member timeout for one acquire step: no answer after the validity can count.
    fn step_timeout(&self, valid_until: Instant) -> Duration {
        self.inner
            .config
            .member_timeout
            .min(valid_until.saturating_duration_since(Instant::now()))
    }

    /// How many members renewed each lease, and for each lease how many members gave no answer
    /// for it (they may have renewed it too): those that did not answer at all, and those that
    /// refused that lease's key alone (see below); an error when the round outlasted the
    /// validity.
    async fn extend_counts(
        &self,
        items: &[(LockKey, Token)],
        ttl: Duration,
        wait: Duration,
    ) -> Result<(Vec<usize>, Vec<usize>)> {
        crate::types::validate_ttl(ttl)?;
        let started = Instant::now();
        let limit = ttl.saturating_sub(drift(ttl));
        let batch_key = items.first().map_or("(batch)", |(k, _)| k.key());
        let shared: Arc<[(LockKey, Token)]> = items.into();
        let mut calls = futures_util::stream::FuturesUnordered::new();
        for (i, slot) in self.inner.members.iter().enumerate() {
            let Some(member) = slot.get().cloned() else {
                continue;
            };
            let items = shared.clone();
            // Each member's renewal runs as a task of its own, so that one still under way when
            // the batch is decided completes anyway: a call dropped between `NOSCRIPT` and its
            // retry would leave that member without the script, always the slowest, and never
            // renewing again.
            // Per lease, as on one server: a member that refuses the whole call for one key
            // the ACL user may no longer touch sends each lease again alone, so the leases
            // beside it are still counted (with the call refused whole, each of them would
            // depend on that member, and on two such members none would be renewed).
            let task = tokio::spawn(async move {
                tokio::time::timeout(limit, member.extend_each(&items, ttl)).await
            });
            calls.push(async move { (i, task.await) });
        }
        let quorum = self.inner.quorum;
        let mut counts = vec![0usize; items.len()];
        // Per lease, the members that have not answered for it yet, or failed: either may
        // still have renewed. Not one that never connected: it was sent no grant, so it holds
        // none.
        let mut unknown = vec![calls.len(); items.len()];
        let mut outstanding = calls.len();
        // The members still out when the wait ends stay unknown; their calls run on.
        let give_up = started + wait.min(limit);
        while let Ok(Some((i, answer))) = tokio::time::timeout_at(give_up, calls.next()).await {
            outstanding -= 1;
            let answer = match answer {
                Ok(Ok(answer)) => answer,
                Ok(Err(_)) => Err(member_error("quorum member did not answer in time")),
                Err(_) => Err(member_error("quorum member's renewal task failed")),
            };
            match answer {
                Ok(held) if held.len() == items.len() => {
                    for ((c, u), h) in counts.iter_mut().zip(unknown.iter_mut()).zip(held) {
                        if let Some(h) = h {
                            *u -= 1;
                            *c += usize::from(h);
                        }
                    }
                }
                Ok(_) => warn!(member = i, "extend answered for a different batch size"),
                Err(e) => debug!(member = i, error = %e, "quorum extend failed"),
            }
            if counts
                .iter()
                .all(|&c| c >= quorum || c + outstanding < quorum)
            {
                break;
            }
        }
        if started.elapsed() >= limit {
            return Err(self.no_quorum("extend", batch_key, 0));
        }
        Ok((counts, unknown))
    }

    /// Whether a lease `renewed` members renewed is held, with `unknown` members silent: held
    /// on a quorum, or certainly not; `None` when it depends on the silent members.
    fn renewed(&self, renewed: usize, unknown: usize) -> Option<bool> {
        if renewed >= self.inner.quorum {
            Some(true)
        } else if renewed + unknown < self.inner.quorum {
            Some(false)
        } else {
            None
        }
    }

    fn no_quorum(&self, op: &'static str, key: &str, agreed: usize) -> Error {
        Error::NoQuorum {
            op,
            key: key.to_owned(),
            agreed,
            needed: self.inner.quorum,
            members: self.inner.members.len(),
        }
    }

    /// Runs `f` on the members `which`, all at once, each bounded by `limit`. A member not
    /// connected yet, or too slow, answers an error.
    async fn on_members<'a, T, F, Fut>(
        &'a self,
        which: &[usize],
        limit: Duration,
        f: F,
    ) -> Vec<(usize, Result<T>)>
    where
        F: Fn(&'a RedisBackend) -> Fut,
        Fut: Future<Output = Result<T>> + 'a,
    {
        futures_util::future::join_all(self.member_calls(which, limit, f)).await
    }

    /// The calls of [`on_members`](Self::on_members), not yet awaited.
    fn member_calls<'a, T, F, Fut>(
        &'a self,
        which: &[usize],
        limit: Duration,
        f: F,
    ) -> Vec<impl Future<Output = (usize, Result<T>)> + 'a>
    where
        F: Fn(&'a RedisBackend) -> Fut,
        Fut: Future<Output = Result<T>> + 'a,
    {
        which
            .iter()
            .map(|&i| {
                let member = self.inner.members.get(i).and_then(OnceLock::get);
                let call = member.map(&f);
                async move {
                    let result = match (call, member) {
                        (Some(call), Some(member)) => {
                            match tokio::time::timeout(limit, call).await {
                                Ok(r) => r,
                                Err(_) => Err(timed_out(member)),
                            }
                        }
                        _ => Err(member_error("quorum member not connected")),
                    };
                    (i, result)
                }
            })
            .collect()
    }

    fn all(&self) -> Vec<usize> {
        (0..self.inner.members.len()).collect()
    }

    /// The members connected so far (a member's connection, once made, stays).
    fn connected(&self) -> Vec<usize> {
        let members = self.inner.members.iter().enumerate();
        members
            .filter(|(_, slot)| slot.get().is_some())
            .map(|(i, _)| i)
            .collect()
    }

    async fn vote(
        &self,
        member: &RedisBackend,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Vote> {
        let reply: Value = self
            .inner
            .vote
            .key(key.lock_key())
            .key(key.fence_key())
            .arg(token.as_str())
            .arg(ttl.as_millis() as u64)
            .invoke_async(&mut member.connection())
            .await
            .map_err(|e| classify("acquire", key.key(), e))?;
        let Value::Array(items) = &reply else {
            return Err(unexpected("acquire", &reply));
        };
        match (items.first().and_then(int), items.len()) {
            (Some(1), 4) => {
                // As on a single server: a fence key holding anything but a canonical decimal
                // counts as no fence (and the write-back overwrites it); a canonical decimal
                // above 2^64 - 1 leaves no higher fence, so the acquire is refused.
                let raw = text(&items[1]);
                let canonical = !raw.starts_with('0') && raw.bytes().all(|b| b.is_ascii_digit());
                let stored = match raw.parse::<u64>() {
                    _ if !canonical => 0,
                    Ok(n) => n,
                    Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => u64::MAX,
                    Err(_) => 0,
                };
                let (secs, micros) = match (int(&items[2]), int(&items[3])) {
                    (Some(s), Some(u)) => (s.max(0) as u64, u.max(0) as u64),
                    _ => return Err(unexpected("acquire", &reply)),
                };
                Ok(Vote::Granted {
                    stored,
                    now_us: secs.saturating_mul(1_000_000).saturating_add(micros),
                })
            }
            (Some(0), 2) => {
                let pttl = int(&items[1]).unwrap_or(-1);
                Ok(Vote::Held {
                    remaining: (pttl >= 0).then(|| Duration::from_millis(pttl as u64)),
                })
            }
            (Some(-1), 3) => Err(Error::WrongType {
                server_key: if int(&items[2]) == Some(2) {
                    key.fence_key().to_owned()
                } else {
                    key.lock_key().to_owned()
                },
                found: text(&items[1]),
            }),
            _ => Err(unexpected("acquire", &reply)),
        }
    }

    async fn write_fence(
        &self,
        member: &RedisBackend,
        key: &LockKey,
        token: &Token,
        fence: u64,
    ) -> Result<bool> {
        let n: i64 = self
            .inner
            .write_fence
            .key(key.lock_key())
            .key(key.fence_key())
            .arg(token.as_str())
            .arg(fence.to_string())
            .invoke_async(&mut member.connection())
            .await
            .map_err(|e| classify("acquire", key.key(), e))?;
        Ok(n == 1)
    }

    /// One Redlock round: votes, fence write-back, and on failure the release of every member
    /// that may hold the key.
    async fn round(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        valid_until: Instant,
    ) -> Round {
        let quorum = self.inner.quorum;
        let mut calls: futures_util::stream::FuturesUnordered<_> = self
            .member_calls(&self.all(), self.step_timeout(valid_until), |m| {
                self.vote(m, key, token, ttl)
            })
            .into_iter()
            .collect();
        let mut votes = Vec::with_capacity(self.members());
        let (mut yes, mut no) = (0, 0);
        // Once a quorum has granted, the other members' answers are still waited for, since
        // every fence they report makes the next one safer (a member that restarted empty may
        // be the only one of a quorum another grant wrote to), but only until half the validity
        // is gone: a slow or silent member must not keep a short lease waiting until none of it
        // is left. A quorum's votes alone hold every earlier grant's fence, as each was written
        // to a quorum. A quorum of "held by another" reports no fence to use: nothing more is
        // waited for.
        let now = Instant::now();
        let patient_until = now + valid_until.saturating_duration_since(now) / 2;
        while no < quorum {
            let patience = (yes >= quorum).then_some(patient_until);
            let Some((i, vote)) = next_by(&mut calls, patience).await else {
                break;
            };
            match &vote {
                Ok(Vote::Granted { .. }) => yes += 1,
                Ok(Vote::Held { .. }) => no += 1,
                Err(_) => {}
            }
            votes.push((i, vote));
        }
        drop(calls);
        // Members still voting when the round was decided: their vote may yet land.
        let late: Vec<usize> = (0..self.members())
            .filter(|i| !votes.iter().any(|(v, _)| v == i))
            .collect();
        let mut granted = Vec::new();
        let (mut max_stored, mut max_now) = (0u64, 0u64);
        let mut held = 0;
        let mut shortest: Option<Option<Duration>> = None;
        let mut may_hold = Vec::new();
        let mut answered = 0;
        let mut refusal = None;
        let mut foreign = 0;
        // Members that refused for good (a server without a command the vote needs): the same
        // on every retry, so like a foreign key they can never vote yes.
        let mut lacking: Option<Error> = None;
        let mut lacks = 0;
        for (i, vote) in votes {
            match vote {
                Ok(Vote::Granted { stored, now_us }) => {
                    answered += 1;
                    granted.push(i);
                    may_hold.push(i);
                    max_stored = max_stored.max(stored);
                    max_now = max_now.max(now_us);
                }
                Ok(Vote::Held { remaining }) => {
                    answered += 1;
                    held += 1;
                    shortest = Some(match (shortest, remaining) {
                        (Some(Some(a)), Some(b)) => Some(a.min(b)),
                        (Some(Some(a)), None) => Some(a),
                        (_, r) => r,
                    });
                }
                // Not counted as answered: it can never vote yes, so it must not help make the
                // quorum of answers that calls a lost round contention rather than an outage.
                Err(e @ Error::WrongType { .. }) => {
                    foreign += 1;
                    refusal = Some(e);
                }
                Err(e) => {
                    // It may have granted before the reply was lost or late.
                    debug!(member = i, error = %e, "quorum vote failed");
                    may_hold.push(i);
                    if matches!(e, Error::Refused { .. }) && !e.is_transient() {
                        lacks += 1;
                        lacking = Some(e);
                    }
                }
            }
        }
        may_hold.extend(late);
        if let Some(e) = &refusal {
            self.inner.foreign_member(e, foreign);
        }
        if held >= quorum {
            // Contention, decided, and no next round follows with this token (a waiting
            // locker draws a fresh one): the give-backs are not waited for, so a hung member
            // costs a busy answer nothing. Token-checked, so members that never granted are
            // untouched.
            self.give_back_in_background(may_hold, key, token);
            return Round::Held(shortest.flatten());
        }
        let mut agreed = granted.len();
        if granted.len() >= quorum && max_stored == u64::MAX {
            // No higher fence exists: refuse, taking the votes back, rather than hand out a
            // fence equal to one already granted (as a single server refuses).
            let limit = self.inner.config.member_timeout;
            let _ = self
                .on_members(&may_hold, limit, |m| m.release(key, token))
                .await;
            return Round::Refused(Error::FenceExhausted {
                key: key.key().to_owned(),
            });
        }
        if granted.len() >= quorum && Instant::now() < valid_until {
            let fence = max_stored.saturating_add(1).max(max_now);
            let mut writes: futures_util::stream::FuturesUnordered<_> = self
                .member_calls(&granted, self.step_timeout(valid_until), |m| {
                    self.write_fence(m, key, token, fence)
                })
                .into_iter()
                .collect();
            // The same patience as for the votes, and the same deadline: a member whose vote
            // came just in time answers its write as slowly, and waiting for that one as well
            // would cost the lease its slowness twice. A quorum holding the fence is what the
            // next grant needs; a write left unanswered is token-checked and only raises the
            // stored fence, so it may land or not.
            let mut written = 0;
            while let Some((_, write)) =
                next_by(&mut writes, (written >= quorum).then_some(patient_until)).await
            {
                if matches!(write, Ok(true)) {
                    written += 1;
                }
            }
            drop(writes);
            if written >= quorum && Instant::now() < valid_until {
                return Round::Granted(fence);
            }
            debug!(written, "fence write-back found no quorum in time");
            agreed = written;
        }
        let mut settled = true;
        if !may_hold.is_empty() {
            // Token-checked, so members that never granted are untouched.
            let limit = self.inner.config.member_timeout;
            let released = self
                .on_members(&may_hold, limit, |m| m.release(key, token))
                .await;
            settled = !released
                .iter()
                .any(|(_, r)| r.as_ref().is_err_and(in_doubt));
        }
        if let Some(e) = refusal
            && granted.len() < quorum
        {
            // Only when the members with a foreign key leave too few to ever agree is the key
            // unusable; otherwise they are no votes like any other, and a round lost to a rival
            // or to members down is busy or no quorum, as it would be without them.
            if self.members() - foreign < quorum {
                return Round::Refused(e);
            }
        }
        // The same for members that cannot run the vote at all: a retry meets the same refusal,
        // and the server's own words say more than "no quorum" (which reads as transient).
        if let Some(e) = lacking
            && granted.len() < quorum
            && self.members().saturating_sub(foreign + lacks) < quorum
        {
            return Round::Refused(e);
        }
        Round::Failed {
            agreed,
            answered,
            held: (held > 0).then(|| shortest.flatten()),
            settled,
        }
    }

    /// Releases `which` members' copies of the lease, token-checked, on a task of its own that
    /// nobody waits for.
    fn give_back_in_background(&self, which: Vec<usize>, key: &LockKey, token: &Token) {
        if which.is_empty() {
            return;
        }
        let (this, key, token) = (self.clone(), key.clone(), token.clone());
        let limit = self.inner.config.member_timeout;
        tokio::spawn(async move {
            let _ = this
                .on_members(&which, limit, |m| m.release(&key, &token))
                .await;
        });
    }
}

/// The next answer of `calls`; with `until`, only one that comes by then. `None` when none is
/// left, or none came in time.
async fn next_by<S>(calls: &mut S, until: Option<Instant>) -> Option<S::Item>
where
    S: futures_util::Stream + Unpin,
{
    match until {
        Some(until) => tokio::time::timeout_at(until, calls.next())
            .await
            .ok()
            .flatten(),
        None => calls.next().await,
    }
}

/// The error of a member cut off by the quorum's own bound. Cut off before the connection's own
/// response timeout could fire (and start its check): a member whose connection went silent is
/// made again all the same.
fn timed_out(member: &RedisBackend) -> Error {
    member.connection().check();
    Error::Unavailable(
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "quorum member did not answer in time",
        )
        .into(),
    )
}

impl Inner {
    /// Says that `foreign` members hold a key of a foreign type (`e`, one of their errors):
    /// they count as no votes, leaving the quorum that much less room for members down.
    fn foreign_member(&self, e: &Error, foreign: usize) {
        let now = Instant::now();
        let due = {
            let mut last = self
                .foreign_warned
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let due = last.is_none_or(|at| now >= at + FOREIGN_WARN_EVERY);
            if due {
                *last = Some(now);
            }
            due
        };
        if due {
            warn!(error = %e, foreign, "quorum members hold a foreign key; counted as no votes");
        } else {
            debug!(error = %e, foreign, "quorum members hold a foreign key; counted as no votes");
        }
    }

    /// Loads the quorum scripts on a member, so that its first vote is one round trip rather
    /// than three (`NOSCRIPT`, load, run), which a short member timeout might not allow.
    async fn preload(&self, member: &RedisBackend) {
        let mut conn = member.connection();
        for script in [&self.vote, &self.write_fence] {
            if let Err(e) = script.load_async(&mut conn).await {
                debug!(error = %e, "quorum script not preloaded; it loads on first use");
            }
        }
    }
}

/// Connects a member that was down at start-up, for as long as the backend lives.
async fn reconnect(inner: Weak<Inner>, index: usize, url: String) {
    let mut pause = Duration::from_millis(200);
    loop {
        tokio::time::sleep(pause).await;
        let Some(config) = inner.upgrade().map(|i| i.config.redis.clone()) else {
            return;
        };
        match RedisBackend::connect_with(&url, config).await {
            Ok(backend) => {
                if let Some(inner) = inner.upgrade() {
                    inner.preload(&backend).await;
                    let _ = inner.members[index].set(backend);
                    debug!(member = index, "quorum member connected");
                }
                return;
            }
            Err(e) => debug!(member = index, error = %e, "quorum member still unreachable"),
        }
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

impl Backend for QuorumBackend {
    // Each member is a master of its own: `WAIT` on one says nothing of the grant's safety,
    // which comes from the majority, so replicas are not waited for.
    const NAME: &'static str = "quorum";

    fn held_wakes_waiters(&self) -> bool {
        true
    }

    async fn acquire(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<AcquireReply> {
        crate::types::validate_ttl(ttl)?;
        let span = debug_span!("quorum_acquire", key = key.key(), members = self.members());
        async move {
            let started = Instant::now();
            let mut round = 0;
            loop {
                // Each round's validity counts from its own start: its votes set the lease's
                // TTL on each member anew, and a failed round gave its grants back before the
                // next began (none is tried after a give-back that went unanswered).
                let round_started = Instant::now();
                let valid_until = round_started + ttl.saturating_sub(drift(ttl));
                let (agreed, answered, held, settled) =
                    match self.round(key, token, ttl, valid_until).await {
                        Round::Granted(fence) => {
                            debug!(fence, rounds = round + 1, "quorum granted");
                            return Ok(AcquireReply::Granted {
                                fence,
                                valid_from: Some(round_started),
                            });
                        }
                        Round::Held(remaining) => return Ok(AcquireReply::Held { remaining }),
                        Round::Refused(e) => return Err(e),
                        Round::Failed {
                            agreed,
                            answered,
                            held,
                            settled,
                        } => (agreed, answered, held, settled),
                    };
                round += 1;
                // Short leases retry sooner: a pause longer than the lease would end every retry.
                let pause = pause(self.inner.config.retry_delay.min(ttl / 4));
                if !settled {
                    debug!("a give-back went unanswered; no more rounds with this token");
                }
                // A grant late in the TTL is worth little; past half of it, stop retrying.
                if !settled
                    || round > self.inner.config.retries
                    || started.elapsed() + pause >= ttl / 2
                {
                    return match held {
                        // Enough members answered, some for another holder: that is contention,
                        // and waiting (wake-up or timer) is the right answer.
                        Some(remaining) if answered >= self.inner.quorum => {
                            Ok(AcquireReply::Held { remaining })
                        }
                        _ => Err(self.no_quorum("acquire", key.key(), agreed)),
                    };
                }
                debug!(agreed, answered, ?pause, "no quorum; retrying");
                tokio::time::sleep(pause).await;
            }
        }
        .instrument(span)
        .await
    }

    /// Runs on every member, and answers as soon as the answers so far decide it. `false` when the members that answered show the lease was not
    /// held by a quorum (however many copies it still had, deleted here: a holder cut off from
    /// most members, whose key a rival took there, is told `NotHeld`, not `Released`). `true`
    /// when a quorum deleted it. [`Error::NoQuorum`] when fewer did and the members that did
    /// not answer decide it: the lease may have been held on a quorum or not, and `Released`
    /// would tell a holder whose majority a rival took that it held the lock to the end (the
    /// copies left expire with their TTL).
    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool> {
        self.release_in_line(key, token, || {}).await
    }

    /// In line once every connected member's release is: each goes on its member's connection,
    /// which the next acquire's vote on that member follows.
    async fn release_in_line(
        &self,
        key: &LockKey,
        token: &Token,
        in_line: impl FnOnce() + Send + 'static,
    ) -> Result<bool> {
        let limit = self.inner.config.member_timeout;
        // Not a member that never connected: it was sent no grant, so it holds none, and
        // counted as one that did not answer it would turn a `NotHeld` into `NoQuorum`.
        let members: Vec<(usize, RedisBackend)> = self
            .connected()
            .into_iter()
            .filter_map(|i| self.inner.members.get(i)?.get().cloned().map(|m| (i, m)))
            .collect();
        // Counted before any call is made, so that only the last one in line calls `in_line`.
        let left = Arc::new(AtomicUsize::new(members.len()));
        let in_line = Arc::new(Mutex::new(Some(in_line)));
        // Each member's release is a task of its own: the answer is decided once enough
        // members have answered, and a hung member's release still goes out and lands when it
        // can, without the holder waiting for it.
        let mut calls: futures_util::stream::FuturesUnordered<_> = members
            .into_iter()
            .map(|(i, member)| {
                let (key, token) = (key.clone(), token.clone());
                let (left, in_line) = (left.clone(), in_line.clone());
                let task = tokio::spawn(async move {
                    let release = member.release_in_line(&key, &token, move || {
                        if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                            let last = in_line
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .take();
                            if let Some(f) = last {
                                f();
                            }
                        }
                    });
                    match tokio::time::timeout(limit, release).await {
                        Ok(r) => r,
                        Err(_) => Err(timed_out(&member)),
                    }
                });
                async move { (i, task.await) }
            })
            .collect();
        let quorum = self.inner.quorum;
        // Unknown: failed or cut off, so it may have deleted its copy or not.
        let (mut released, mut unknown, mut outstanding) = (0, 0, calls.len());
        loop {
            if released >= quorum {
                return Ok(true);
            }
            if released + unknown + outstanding < quorum {
                return Ok(false);
            }
            let Some((i, answer)) = calls.next().await else {
                break;
            };
            outstanding -= 1;
            match answer {
                Ok(Ok(true)) => released += 1,
                Ok(Ok(false)) => {}
                Ok(Err(e)) => {
                    debug!(member = i, error = %e, "quorum release failed");
                    unknown += 1;
                }
                Err(_) => unknown += 1,
            }
        }
        Err(self.no_quorum("release", key.key(), released))
    }

    /// A lease is renewed when a quorum renewed it within the validity. When too few members
    /// answered to tell either way for some lease of the batch, the whole batch is an
    /// [`Error::NoQuorum`] (the renewal driver asks [`extend_each`](Backend::extend_each)
    /// instead, which retries only that lease).
    ///
    /// It returns as soon as every lease of the batch is decided, so a slow or hung member costs
    /// nothing while the others agree (its renewal still runs to completion in the background).
    /// When the answer depends on slow members it waits for them up to the validity (ttl less
    /// drift), as a single server's renewal would: a large batch on a busy server takes a while,
    /// and giving up early would only send the same work again.
    async fn extend(&self, items: &[(LockKey, Token)], ttl: Duration) -> Result<Vec<bool>> {
        let (counts, unknown) = self.extend_counts(items, ttl, ttl).await?;
        let decided: Option<Vec<bool>> = (counts.iter().zip(&unknown))
            .map(|(&c, &u)| self.renewed(c, u))
            .collect();
        decided.ok_or_else(|| {
            let batch_key = items.first().map_or("(batch)", |(k, _)| k.key());
            let agreed = counts.iter().copied().min().unwrap_or(0);
            self.no_quorum("extend", batch_key, agreed)
        })
    }

    /// As [`extend`](Backend::extend), one answer per lease: `None` for a lease whose answer
    /// depends on members that did not answer, so that one undecided lease does not count the
    /// leases a quorum did renew (or certainly did not) as unknown too. Nor does it hold back
    /// their answers: it waits at most a quarter of `ttl` for the members it depends on, well
    /// before the other leases' deadlines, where a hung member's call would run to the
    /// validity (the renewal driver asks again for the undecided one).
    async fn extend_each(
        &self,
        items: &[(LockKey, Token)],
        ttl: Duration,
    ) -> Result<Vec<Option<bool>>> {
        let (counts, unknown) = self.extend_counts(items, ttl, ttl / 4).await?;
        Ok((counts.into_iter().zip(unknown))
            .map(|(c, u)| self.renewed(c, u))
            .collect())
    }

    /// Admitted when a quorum admits `fence` and no member has seen a higher one.
    async fn admit(&self, gate_key: &str, fence: u64) -> Result<Option<u64>> {
        let limit = self.inner.config.member_timeout;
        let answers = self
            .on_members(&self.all(), limit, |m| m.admit(gate_key, fence))
            .await;
        let mut admitted = 0;
        let mut highest = None;
        let mut refusal = None;
        let mut foreign = 0;
        for (_, answer) in answers {
            match answer {
                Ok(None) => admitted += 1,
                Ok(Some(h)) => highest = Some(highest.map_or(h, |x: u64| x.max(h))),
                Err(e @ Error::WrongType { .. }) => {
                    foreign += 1;
                    refusal = Some(e);
                }
                Err(_) => {}
            }
        }
        if let Some(e) = &refusal {
            self.inner.foreign_member(e, foreign);
        }
        if highest.is_some() {
            return Ok(highest);
        }
        if admitted >= self.inner.quorum {
            return Ok(None);
        }
        // As in an acquire: a foreign key is the answer only when it leaves too few members to
        // ever agree; otherwise the gate lacked a quorum this time, which may pass.
        match refusal {
            Some(e) if self.members() - foreign < self.inner.quorum => Err(e),
            _ => Err(self.no_quorum("admit", gate_key, admitted)),
        }
    }

    /// Subscribes on every connected member and forwards their wake-ups to one watch of its own.
    async fn watch(&self, key: &LockKey) -> Result<Watch> {
        // A channel name of its own per watch: each watch owns its forwarding task and stops it
        // when dropped.
        let id = self.inner.next_watch.fetch_add(1, Ordering::Relaxed);
        let channel = format!("{}#{id}", key.channel());
        let (rx, _) = self.inner.wakeups.register(&channel);
        // The watch exists before the first await: a caller that leaves while the members
        // subscribe (a timeout around the acquire) drops it, and the registration with it.
        let mut watch = Watch {
            rx,
            channel: channel.clone(),
            wakeups: self.inner.wakeups.clone(),
            on_last: None,
        };
        // Longer than a member's own wait for its subscription's confirmation (it gives up after
        // at most `LONGEST_CONFIRM_WAIT`, and returns its watch unconfirmed but subscribed): cut
        // off first, a slow member's watch would be dropped, and its subscription with it, so a
        // wake-up that member carries once it confirms would never reach this waiter. A member
        // that hangs still costs no more than its own wait.
        let limit = self
            .inner
            .config
            .member_timeout
            .max(crate::wake::LONGEST_CONFIRM_WAIT + Duration::from_millis(500));
        // Each member subscribes on a task of its own, and the watch is ready once a quorum
        // has: a lease held on a quorum is deleted, and published, by a quorum of members at
        // its release, so one is always among these. A slower member's watch joins the others
        // when it comes, and a hung one keeps no waiter from its first try after subscribing.
        // (A key held on a minority only, by a round that is still giving its votes back, may
        // publish only on a member not yet joined: that waiter wakes on its timer.)
        let (arrive, mut arrived) = tokio::sync::mpsc::unbounded_channel::<Watch>();
        for slot in &self.inner.members {
            let Some(member) = slot.get().cloned() else {
                continue;
            };
            let (key, arrive) = (key.clone(), arrive.clone());
            tokio::spawn(async move {
                if let Ok(Ok(w)) = tokio::time::timeout(limit, member.watch(&key)).await {
                    let _ = arrive.send(w);
                }
            });
        }
        drop(arrive);
        let mut member_watches = Vec::new();
        while member_watches.len() < self.inner.quorum {
            match arrived.recv().await {
                Some(w) => member_watches.push(w),
                // Every member answered or gave up: fewer than a quorum subscribed.
                None => break,
            }
        }
        let wakeups = self.inner.wakeups.clone();
        let forward_to = channel;
        let forwarder = tokio::spawn(async move {
            let mut member_watches = member_watches;
            let mut more = true;
            loop {
                let late = {
                    let changes = async {
                        if member_watches.is_empty() {
                            std::future::pending::<()>().await;
                        }
                        let changes = member_watches.iter_mut().map(|w| Box::pin(w.changed()));
                        futures_util::future::select_all(changes).await;
                    };
                    tokio::select! {
                        w = arrived.recv(), if more => Some(w),
                        () = changes => {
                            wakeups.wake(&forward_to);
                            None
                        }
                    }
                };
                match late {
                    Some(Some(w)) => member_watches.push(w),
                    Some(None) if member_watches.is_empty() => return,
                    Some(None) => more = false,
                    None => {}
                }
            }
        });
        // The channel is this watch's alone, so it is always its last watcher.
        watch.on_last = Some(Box::new(move |_| forwarder.abort()));
        Ok(watch)
    }

    fn wakeups(&self) -> &Arc<Wakeups> {
        &self.inner.wakeups
    }
}

/// A random pause in the upper half of `max`, from the OS RNG.
fn pause(max: Duration) -> Duration {
    let mut b = [0u8; 4];
    let frac = if getrandom::fill(&mut b).is_ok() {
        f64::from(u32::from_le_bytes(b)) / f64::from(u32::MAX)
    } else {
        0.5
    };
    max / 2 + (max / 2).mul_f64(frac)
}

/// Whether a member call that failed may still run on the member: its reply was lost or late
/// (the connection dropped after sending, or the quorum's own timeout cut it off). One answered
/// unreadable ran already: nothing of it is still to come.
fn in_doubt(e: &Error) -> bool {
    match e {
        Error::OutcomeUnknown { .. } => true,
        Error::Unavailable(e) => e.is_timeout(),
        _ => false,
    }
}

fn member_error(what: &'static str) -> Error {
    Error::Unavailable(redis::RedisError::from((redis::ErrorKind::Io, what)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pause before a retry is drawn from the upper half of its bound (the retry delay,
    /// at most a quarter of the TTL at the call site), never past it.
    #[test]
    fn a_retry_pause_is_in_the_upper_half_of_its_bound() {
        for max in [
            Duration::from_millis(1),
            Duration::from_millis(200),
            Duration::from_secs(3),
        ] {
            for _ in 0..1_000 {
                let p = pause(max);
                assert!(p >= max / 2 && p <= max, "{p:?} for {max:?}");
            }
        }
        assert_eq!(pause(Duration::ZERO), Duration::ZERO);
    }
}
