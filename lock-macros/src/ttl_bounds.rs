//! The TTL bounds and the key length lock-core enforces at run time, mirrored here so that a
//! `ttl` literal outside them is a compile error rather than an `InvalidTtl` on every call, and
//! so is a key literal whose fixed text is too long for any call (`InvalidKey`). They are copied because
//! depending on lock-core from this proc-macro would build it, with tokio and redis, a second time
//! for the host, only to read two constants. `tests/locked_bounds.rs` includes this file and
//! asserts that they equal `leasehold::MIN_TTL`, `MAX_TTL` and `MAX_KEY_LEN`; it must stay free of
//! other items for that.

use std::time::Duration;

/// `lock_core::MIN_TTL`, from `lock-core/src/types.rs`.
pub(crate) const MIN_TTL: Duration = Duration::from_millis(10);
/// `lock_core::MAX_TTL`, from `lock-core/src/types.rs`.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// `lock_core::MAX_KEY_LEN`, from `lock-core/src/types.rs`.
pub(crate) const MAX_KEY_LEN: usize = 512;
