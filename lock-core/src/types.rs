use std::fmt;
use std::time::Duration;

use crate::error::{Error, Result};

/// Longest key accepted, in bytes, before the prefix is added.
pub const MAX_KEY_LEN: usize = 512;
/// Shortest TTL accepted: below it, network jitter alone eats the lease.
pub const MIN_TTL: Duration = Duration::from_millis(10);
/// Longest TTL accepted. Longer work should keep a shorter lease renewed instead.
pub const MAX_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// The number a grant carries: strictly increasing per key across grants.
///
/// Pass it to the resource you protect and let the resource refuse writes with a lower fence
/// (see [`FenceGate`](crate::FenceGate)); that is what keeps data safe from a paused holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Fence(pub u64);

impl Fence {
    /// The fence as a plain number.
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
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Token(String);

impl Token {
    /// Draws a fresh token from the OS random source.
    pub fn generate() -> Token {
        let mut bytes = [0u8; 16];
        // The OS RNG failing is not a condition a lock library can recover from sensibly; a
        // predictable token would silently break release safety, so refusing is the only option.
        getrandom::fill(&mut bytes).expect("the operating system's random source failed");
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(32);
        for b in bytes {
            s.push(HEX[usize::from(b >> 4)] as char);
            s.push(HEX[usize::from(b & 0xf)] as char);
        }
        Token(s)
    }

    /// The token as stored on the server (32 lowercase hex digits).
    pub fn as_str(&self) -> &str {
        &self.0
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

/// The clock-drift allowance subtracted from every lease: 1% of the TTL plus 2 ms.
pub(crate) fn drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// Names one lock on the server: the lock key and its fence key share the hash tag
/// `{prefix:key}`, so both live in one cluster slot.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LockKey {
    pub(crate) user: String,
    pub(crate) tag: String,
}

impl LockKey {
    pub(crate) fn new(prefix: &str, user: &str) -> LockKey {
        LockKey {
            user: user.to_owned(),
            tag: format!("{{{prefix}:{user}}}"),
        }
    }

    /// The key as the caller named it.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// The server key holding the holder's token.
    pub fn lock_key(&self) -> String {
        format!("{}:lock", self.tag)
    }

    /// The server key holding the last fence issued.
    pub fn fence_key(&self) -> String {
        format!("{}:fence", self.tag)
    }

    /// The channel a release publishes on, to wake waiters.
    pub fn channel(&self) -> String {
        format!("{}:released", self.tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
