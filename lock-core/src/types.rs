use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};

/// Longest key accepted, in bytes, before the prefix is added.
///
/// ```
/// use lock_core::{Error, Locker, MAX_KEY_LEN};
/// let locker = Locker::memory();
/// assert!(locker.lock_key(&"k".repeat(MAX_KEY_LEN)).is_ok());
/// assert!(matches!(locker.lock_key(&"k".repeat(MAX_KEY_LEN + 1)), Err(Error::InvalidKey { .. })));
/// ```
pub const MAX_KEY_LEN: usize = 512;
/// Shortest TTL accepted: below it, network jitter alone eats the lease.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use lock_core::{Error, LockOptions, Locker, MIN_TTL};
/// let too_short = LockOptions::new().ttl(MIN_TTL / 2);
/// let refused = Locker::memory().try_acquire("k", &too_short).await;
/// assert!(matches!(refused, Err(Error::InvalidTtl { .. })));
/// # }
/// ```
pub const MIN_TTL: Duration = Duration::from_millis(10);
/// Longest TTL accepted. Longer work should keep a shorter lease renewed instead.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use lock_core::{Error, LockOptions, Locker, MAX_TTL};
/// use std::time::Duration;
/// let too_long = LockOptions::new().ttl(MAX_TTL + Duration::from_secs(1));
/// let refused = Locker::memory().try_acquire("k", &too_long).await;
/// assert!(matches!(refused, Err(Error::InvalidTtl { .. })));
/// # }
/// ```
pub const MAX_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// Longest [`LockOptions::keep_fence`](crate::LockOptions::keep_fence) accepted: a year.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use lock_core::{Error, LockOptions, Locker, MAX_KEEP_FENCE};
/// use std::time::Duration;
/// let opts = LockOptions::new().keep_fence(MAX_KEEP_FENCE + Duration::from_secs(1));
/// let refused = Locker::memory().try_acquire("k", &opts).await;
/// assert!(matches!(refused, Err(Error::InvalidDuration { what: "fence keep", .. })));
/// # }
/// ```
pub const MAX_KEEP_FENCE: Duration = Duration::from_secs(365 * 86_400);

/// The number a grant carries: strictly increasing per key across grants.
///
/// Pass it to the resource you protect and let the resource refuse writes with a lower fence
/// (see [`FenceGate`](crate::FenceGate)); that is what keeps data safe from a paused holder.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::{Fence, LockOptions, Locker};
/// let lease = Locker::memory().acquire("ledger", &LockOptions::new()).await?;
/// let fence: Fence = lease.fence();
/// // Store it beside the data; a write carrying a lower fence is refused, an equal one (the
/// // same lease writing again) admitted, and a row not yet fenced (NULL) taken.
/// let row = format!(
///     "UPDATE ledger SET balance = 10, fence = {fence} \
///      WHERE id = 1 AND (fence IS NULL OR fence <= {fence})"
/// );
/// # let _ = row;
/// assert!(fence > Fence(0));
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Fence(pub u64);

impl Fence {
    /// The fence as a plain number.
    ///
    /// ```
    /// assert_eq!(lock_core::Fence(42).get(), 42);
    /// ```
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The random value that names one acquisition: 128 bits from the operating system's RNG.
///
/// Its `Debug` form is redacted, so logging a lease never reveals the token.
///
/// ```
/// use lock_core::Token;
/// let token = Token::generate();
/// assert_eq!(format!("{token:?}"), "Token(..)");
/// assert_ne!(token, Token::generate());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Token([u8; 32]);

/// OS randomness for tokens, read a page at a time: one `getrandom` call costs about as much as
/// the rest of an in-memory acquire and release together, and reading 4 KiB costs barely more
/// than reading 16 bytes. Every token still consists of bytes straight from the OS, each handed
/// out once.
struct Entropy {
    bytes: [u8; 4096],
    next: usize,
    /// The process the bytes were read in: a forked child must not replay its parent's bytes
    /// (both would then issue the same tokens).
    pid: u32,
}

thread_local! {
    static ENTROPY: std::cell::RefCell<Entropy> = const {
        std::cell::RefCell::new(Entropy { bytes: [0; 4096], next: 4096, pid: 0 })
    };
}

/// Sixteen bytes of OS randomness, each handed out once in this process. With `fork_checked`,
/// also never bytes a parent process had read before a `fork`; that check is a `getpid` system
/// call, which costs as much as the rest of an in-memory acquire's token.
fn os_random_16(fork_checked: bool) -> [u8; 16] {
    ENTROPY.with_borrow_mut(|e| {
        let pid = fork_checked.then(std::process::id);
        if e.next + 16 > e.bytes.len() || pid.is_some_and(|pid| pid != e.pid) {
            // The OS RNG failing is not a condition a lock library can recover from sensibly;
            // a predictable token would silently break release safety, so refusing is the only
            // option.
            getrandom::fill(&mut e.bytes).expect("the operating system's random source failed");
            e.next = 0;
            // Marked as this process's only once read: a failed read caught as a panic must
            // leave a parent's bytes marked as the parent's.
            if let Some(pid) = pid {
                e.pid = pid;
            }
        }
        let mut out = [0u8; 16];
        out.copy_from_slice(&e.bytes[e.next..e.next + 16]);
        // Issued bytes do not stay behind in the buffer.
        e.bytes[e.next..e.next + 16].fill(0);
        e.next += 16;
        out
    })
}

impl Token {
    /// Draws a fresh token from the OS random source.
    ///
    /// ```
    /// let token = lock_core::Token::generate();
    /// assert!(token.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
    /// ```
    pub fn generate() -> Token {
        Token::from_random(os_random_16(true))
    }

    /// As [`generate`](Token::generate), for a lease that lives in this process's memory alone
    /// (the memory backend): a forked child works on its own copy of that store, so the bytes
    /// its parent also hands out after the `fork` can never meet the child's tokens there, and
    /// the fork check is skipped. Every byte is still from the OS and handed out once in this
    /// process.
    pub(crate) fn generate_in_process() -> Token {
        Token::from_random(os_random_16(false))
    }

    fn from_random(random: [u8; 16]) -> Token {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut hex = [0u8; 32];
        for (i, b) in random.into_iter().enumerate() {
            hex[2 * i] = HEX[usize::from(b >> 4)];
            hex[2 * i + 1] = HEX[usize::from(b & 0xf)];
        }
        Token(hex)
    }

    /// The token as stored on the server (32 lowercase hex digits).
    ///
    /// ```
    /// let token = lock_core::Token::generate();
    /// assert_eq!(token.as_str().len(), 32);
    /// ```
    pub fn as_str(&self) -> &str {
        // Only `generate` builds a token, from hex digits.
        std::str::from_utf8(&self.0).expect("a token is ASCII hex")
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

/// Checks a user key before any round trip.
pub(crate) fn validate_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidKey {
            reason: "the key is empty",
        });
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Error::InvalidKey {
            reason: "the key is longer than MAX_KEY_LEN (512 bytes)",
        });
    }
    // Braces would end the hash tag early and split the lock and fence keys across cluster slots.
    if key.contains(['{', '}']) {
        return Err(Error::InvalidKey {
            reason: "the key contains `{` or `}`, which would break its hash tag",
        });
    }
    if key.chars().any(char::is_control) {
        return Err(Error::InvalidKey {
            reason: "the key contains a control character",
        });
    }
    Ok(())
}

/// A prefix or namespace: the rules of a key, and no `:`, which ends it inside the hash tag
/// (`{prefix:key}`), so that no other prefix and key can spell the same names.
pub(crate) fn validate_scope(scope: &str) -> Result<()> {
    validate_key(scope)?;
    if scope.contains(':') {
        return Err(Error::InvalidKey {
            reason: "a prefix or namespace contains `:`, which separates it from the key",
        });
    }
    Ok(())
}

/// What a wait of `Duration::MAX` ("as long as it takes") comes to: about thirty years, as
/// tokio's own timers make of it. Also how far ahead the renewal driver's "no timer" is, for
/// senders comparing their due time with the driver's.
pub(crate) const FOREVER: Duration = Duration::from_secs(86_400 * 365 * 30);

/// `after` from `from`, where an `after` too long to add waits [`FOREVER`] instead of
/// panicking.
pub(crate) fn deadline_after(from: tokio::time::Instant, after: Duration) -> tokio::time::Instant {
    from.checked_add(after).unwrap_or_else(|| from + FOREVER)
}

/// Checks a TTL before any round trip.
pub(crate) fn validate_ttl(ttl: Duration) -> Result<()> {
    if ttl.is_zero() {
        return Err(Error::InvalidTtl {
            ttl,
            reason: "a zero TTL would expire before it is granted",
        });
    }
    if ttl < MIN_TTL {
        return Err(Error::InvalidTtl {
            ttl,
            reason: "below MIN_TTL (10 ms)",
        });
    }
    if ttl > MAX_TTL {
        return Err(Error::InvalidTtl {
            ttl,
            reason: "above MAX_TTL (24 h); renew a shorter lease instead",
        });
    }
    Ok(())
}

/// Checks how long an acquire waits for replicas: `WAIT n 0` would block until they answer,
/// however long that takes, so under 1 ms is refused, as is anything above `MAX_TTL`.
pub(crate) fn validate_replica_timeout(timeout: Duration) -> Result<()> {
    let reason = if timeout < Duration::from_millis(1) {
        "below 1 ms"
    } else if timeout > MAX_TTL {
        "above MAX_TTL"
    } else {
        return Ok(());
    };
    Err(Error::InvalidDuration {
        what: "replica timeout",
        value: timeout,
        reason,
    })
}

/// The clock-drift allowance subtracted from every lease: 1% of the TTL plus 2 ms, plus the
/// TTL's part of a millisecond, which the servers never see: TTLs go out as whole
/// milliseconds (`PX 10` for 10.9 ms), so a local deadline counted on the exact TTL would use
/// up to a millisecond of the allowance.
pub(crate) fn drift(ttl: Duration) -> Duration {
    ttl / 100
        + Duration::from_millis(2)
        + Duration::from_nanos(u64::from(ttl.subsec_nanos() % 1_000_000))
}

/// How long before its local deadline a lease that was not renewed counts as lost (2.5% of the
/// TTL plus 3 ms), so that `lost()` fires *before* the deadline: a timer wakes up to a
/// millisecond late, and on a busy machine the tasks that cancel and that wait for the signal
/// may each wait several milliseconds more for a CPU.
pub(crate) fn warn_ahead(ttl: Duration) -> Duration {
    ttl / 40 + Duration::from_millis(3)
}

/// Names one lock on the server: the lock key and its fence key share the hash tag
/// `{prefix:key}`, so both live in one cluster slot.
///
/// The server-side names are built once, when the key is checked, in one allocation that
/// clones share, and the key's hash is taken then too: the hot path (acquire, renew, release)
/// neither formats, allocates nor hashes key names.
///
/// ```
/// let names = lock_core::Locker::memory().lock_key("orders:7")?;
/// assert_eq!(names.key(), "orders:7");
/// assert_eq!(names.lock_key(), "{leasehold:orders:7}:lock");
/// assert_eq!(names.fence_key(), "{leasehold:orders:7}:fence");
/// assert_eq!(names.channel(), "{leasehold:orders:7}:released");
/// # Ok::<(), lock_core::Error>(())
/// ```
#[derive(Clone)]
pub struct LockKey {
    /// `user`, then `{prefix:user}:lock`, `{prefix:user}:fence` and `{prefix:user}:released`.
    names: Arc<str>,
    /// Where `user` ends.
    user_end: usize,
    /// The length of `{prefix:user}:`, the part the three server names share.
    tag_len: usize,
    /// The lock key's hash under a per-process random key (see [`KeyHasher`]).
    hash: u64,
}

thread_local! {
    /// Where names are assembled before they are copied into their one allocation.
    static SCRATCH: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// The per-process random key of every [`LockKey`]'s hash: as unpredictable to a caller who
/// chooses keys as the standard library's own `HashMap` hashing.
fn hash_key() -> &'static std::hash::RandomState {
    static STATE: std::sync::OnceLock<std::hash::RandomState> = std::sync::OnceLock::new();
    STATE.get_or_init(std::hash::RandomState::new)
}

impl LockKey {
    pub(crate) fn new(prefix: &str, user: &str) -> LockKey {
        use std::hash::BuildHasher;
        SCRATCH.with_borrow_mut(|buf| {
            buf.clear();
            // `user`, three times `{prefix:user}:`, and the suffixes `lock`, `fence`, `released`.
            buf.reserve(4 * user.len() + 3 * prefix.len() + 29);
            buf.push_str(user);
            let user_end = buf.len();
            // The shared tag once, then copied: `write!` would cost ten times as much, once
            // per request under a layer that names a lock per request.
            for part in ["{", prefix, ":", user, "}:lock"] {
                buf.push_str(part);
            }
            let tag = user_end..buf.len() - "lock".len();
            buf.extend_from_within(tag.clone());
            buf.push_str("fence");
            buf.extend_from_within(tag.clone());
            buf.push_str("released");
            let tag_len = tag.len();
            let hash = hash_key().hash_one(&buf[user_end..user_end + tag_len + "lock".len()]);
            let names = Arc::from(buf.as_str());
            // A huge prefix must not keep a huge buffer alive on this thread.
            if buf.capacity() > 4096 {
                *buf = String::new();
            }
            LockKey {
                names,
                user_end,
                tag_len,
                hash,
            }
        })
    }

    /// The key as the caller named it.
    ///
    /// ```
    /// let names = lock_core::Locker::memory().lock_key("orders:7")?;
    /// assert_eq!(names.key(), "orders:7");
    /// # Ok::<(), lock_core::Error>(())
    /// ```
    pub fn key(&self) -> &str {
        &self.names[..self.user_end]
    }

    fn lock_end(&self) -> usize {
        self.user_end + self.tag_len + "lock".len()
    }

    fn fence_end(&self) -> usize {
        self.lock_end() + self.tag_len + "fence".len()
    }

    /// The server key holding the holder's token.
    ///
    /// ```
    /// let names = lock_core::Locker::memory().lock_key("orders:7")?;
    /// assert_eq!(names.lock_key(), "{leasehold:orders:7}:lock");
    /// # Ok::<(), lock_core::Error>(())
    /// ```
    pub fn lock_key(&self) -> &str {
        &self.names[self.user_end..self.lock_end()]
    }

    /// The server key holding the last fence issued.
    ///
    /// ```
    /// let names = lock_core::Locker::memory().lock_key("orders:7")?;
    /// assert_eq!(names.fence_key(), "{leasehold:orders:7}:fence");
    /// # Ok::<(), lock_core::Error>(())
    /// ```
    pub fn fence_key(&self) -> &str {
        &self.names[self.lock_end()..self.fence_end()]
    }

    /// The channel a release publishes on, to wake waiters.
    ///
    /// ```
    /// let names = lock_core::Locker::memory().lock_key("orders:7")?;
    /// assert_eq!(names.channel(), "{leasehold:orders:7}:released");
    /// # Ok::<(), lock_core::Error>(())
    /// ```
    pub fn channel(&self) -> &str {
        &self.names[self.fence_end()..]
    }
}

// Identity is the server-side lock key: it names the prefix and the user key together.
impl PartialEq for LockKey {
    fn eq(&self, other: &LockKey) -> bool {
        Arc::ptr_eq(&self.names, &other.names)
            || (self.hash == other.hash && self.lock_key() == other.lock_key())
    }
}

impl Eq for LockKey {}

// The hash taken when the key was built (of the lock key, so it agrees with `Eq`).
impl std::hash::Hash for LockKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// A hasher for maps keyed by [`LockKey`] alone (the memory backend's; the carried hash exists
/// for it): it passes on the hash each key carries, which was taken with a per-process random
/// key when the key was built.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, _: &[u8]) {
        unreachable!("KeyHash serves maps keyed by LockKey, which hashes as one u64");
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// The `BuildHasher` of maps keyed by [`LockKey`].
pub(crate) type KeyHash = std::hash::BuildHasherDefault<KeyHasher>;

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockKey")
            .field("key", &self.key())
            .field("lock_key", &self.lock_key())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A local deadline is counted on the TTL the server was sent, in whole milliseconds, less
    /// the full allowance.
    #[test]
    fn the_local_validity_never_counts_a_fraction_the_server_did_not_get() {
        for ttl in [
            Duration::from_micros(10_999),
            Duration::from_millis(10),
            Duration::from_micros(1_500_700),
            Duration::from_nanos(86_399_999_999_999),
        ] {
            let sent = Duration::from_millis(ttl.as_millis() as u64);
            assert!(
                ttl - drift(ttl) <= sent - sent / 100 - Duration::from_millis(2),
                "{ttl:?}"
            );
        }
    }

    #[test]
    fn a_forked_child_reads_afresh_instead_of_replaying_the_parents_bytes() {
        let _ = Token::generate();
        // What `fork` leaves the child: the parent's unread bytes, marked with the parent's pid.
        ENTROPY.with_borrow_mut(|e| {
            e.bytes = [0xab; 4096];
            e.next = 0;
            e.pid = e.pid.wrapping_add(1);
        });
        assert_ne!(
            os_random_16(true),
            [0xab; 16],
            "replayed the parent's bytes"
        );
        ENTROPY.with_borrow(|e| assert_eq!((e.pid, e.next), (std::process::id(), 16)));
    }

    /// The memory backend's draws skip the fork check (no `getpid`) but share the page with
    /// fork-checked draws, so that no bytes are handed out twice in one process either way.
    #[test]
    fn in_process_draws_skip_the_fork_check_and_never_repeat() {
        let _ = Token::generate();
        let recorded = ENTROPY.with_borrow_mut(|e| {
            e.pid = e.pid.wrapping_add(1);
            e.pid
        });
        let mut seen = std::collections::HashSet::new();
        for _ in 0..300 {
            let local = Token::generate_in_process();
            assert!(local.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
            assert!(seen.insert(local));
        }
        ENTROPY.with_borrow(|e| assert_eq!(e.pid, recorded, "checked the pid"));
        // The page ran out and was read again along the way (4096 / 16 = 256 draws a page);
        // mixed with fork-checked draws, still nothing repeats.
        for i in 0..600 {
            let token = if i % 2 == 0 {
                Token::generate()
            } else {
                Token::generate_in_process()
            };
            assert!(seen.insert(token));
        }
    }

    #[test]
    fn tokens_are_128_bit_hex_and_distinct() {
        let a = Token::generate();
        let b = Token::generate();
        assert_eq!(a.as_str().len(), 32);
        assert!(a.as_str().chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        assert_eq!(format!("{a:?}"), "Token(..)");
    }

    #[test]
    fn key_names_identity_and_hash() {
        use std::collections::HashMap;
        // The names of a plain key: `lock_and_fence_share_a_hash_tag`.
        let k = LockKey::new("app", "orders:1");
        let e = LockKey::new("", "x");
        assert_eq!(
            [e.key(), e.lock_key(), e.fence_key(), e.channel()],
            ["x", "{:x}:lock", "{:x}:fence", "{:x}:released"]
        );
        // A prefix past the scratch buffer's cap: names stay whole, and the next key is right.
        let long = "p".repeat(5000);
        let l = LockKey::new(&long, "k");
        assert_eq!(l.fence_key(), format!("{{{long}:k}}:fence"));
        assert_eq!(LockKey::new("app", "orders:2").key(), "orders:2");
        // Built apart, the same names are one key; another prefix or user is another key, also
        // in a map that trusts the carried hash.
        let mut map: HashMap<LockKey, u8, KeyHash> = HashMap::default();
        map.insert(k.clone(), 1);
        map.insert(LockKey::new("app", "orders:1"), 2);
        map.insert(LockKey::new("app2", "orders:1"), 3);
        map.insert(LockKey::new("app", "orders:10"), 4);
        assert_eq!(map.len(), 3);
        assert_eq!(map[&k], 2);
        assert_ne!(k, LockKey::new("ap", "p:orders:1"));
    }

    #[test]
    fn keys_are_validated() {
        assert!(validate_key("orders:1").is_ok());
        assert!(matches!(validate_key(""), Err(Error::InvalidKey { .. })));
        assert!(validate_key(&"k".repeat(MAX_KEY_LEN)).is_ok());
        assert!(validate_key(&"k".repeat(MAX_KEY_LEN + 1)).is_err());
        assert!(validate_key("a}b").is_err());
        assert!(validate_key("a\nb").is_err());
    }

    #[test]
    fn ttls_are_validated() {
        assert!(validate_ttl(Duration::ZERO).is_err());
        assert!(validate_ttl(Duration::from_millis(9)).is_err());
        assert!(validate_ttl(MIN_TTL).is_ok());
        assert!(validate_ttl(MAX_TTL).is_ok());
        assert!(validate_ttl(MAX_TTL + Duration::from_millis(1)).is_err());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

        /// Any string gets an answer, never a panic, and the answer is exactly the documented
        /// rule: non-empty, at most MAX_KEY_LEN bytes, no braces, no control characters.
        #[test]
        fn any_key_is_judged_by_the_documented_rule(key in "\\PC{0,8}|.{0,600}|[{}\\x00-\\x1f a-z]{0,20}") {
            let expected = !key.is_empty()
                && key.len() <= MAX_KEY_LEN
                && !key.contains(['{', '}'])
                && !key.chars().any(char::is_control);
            proptest::prop_assert_eq!(validate_key(&key).is_ok(), expected);
        }

        /// Any TTL gets an answer, never a panic.
        #[test]
        fn any_ttl_is_judged(ms in 0u64..(2 * 24 * 3_600_000), nanos in 0u32..1_000_000) {
            let ttl = Duration::from_millis(ms) + Duration::from_nanos(u64::from(nanos));
            let expected = ttl >= MIN_TTL && ttl <= MAX_TTL;
            proptest::prop_assert_eq!(validate_ttl(ttl).is_ok(), expected);
        }
    }

    #[test]
    fn lock_and_fence_share_a_hash_tag() {
        let k = LockKey::new("lh", "job:7");
        assert_eq!(k.lock_key(), "{lh:job:7}:lock");
        assert_eq!(k.fence_key(), "{lh:job:7}:fence");
        assert_eq!(k.channel(), "{lh:job:7}:released");
        assert_eq!(k.key(), "job:7");
        assert_eq!(k, LockKey::new("lh", "job:7"));
        assert_ne!(k, LockKey::new("other", "job:7"));
    }

    #[test]
    fn tokens_stay_distinct_across_many_draws() {
        // Crosses several refills of the per-thread buffer.
        let mut seen = std::collections::HashSet::new();
        for _ in 0..2_000 {
            assert!(seen.insert(Token::generate()));
        }
    }
}
