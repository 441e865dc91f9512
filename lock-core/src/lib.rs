//! The lease engine of leasehold: fenced, renewing lease locks on Redis/Valkey and in memory.
//!
//! A [`Locker`] takes [`Lease`]s on keys. Each grant carries a strictly increasing [`Fence`];
//! protect your data with it through a [`FenceGate`] or your own check, because a lease alone
//! cannot stop a paused holder from writing after it expired.
//!
//! ```
//! use lock_core::{Locker, LockOptions, Error};
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
//! let locker = Locker::memory(); // or Locker::redis("redis://127.0.0.1/").await?
//! let a = locker.try_acquire("resource", &LockOptions::default()).await?;
//! let b = locker.try_acquire("resource", &LockOptions::default()).await;
//! assert!(matches!(b, Err(Error::Busy { .. })));
//! a.release().await?;
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backend;
mod error;
mod lease;
mod locker;
pub mod queue;
mod renew;
mod scope;
mod turnstile;
mod types;
mod wake;

pub use backend::{
    AcquireReply, AnyBackend, Backend, ClusterBackend, ClusterConn, MemoryBackend, QuorumBackend,
    QuorumConfig, RedisBackend, RedisConfig, RedisConn,
};
pub use error::{Error, Result};
pub use lease::{Lease, LeaseInfo, Release};
pub use locker::{DEFAULT_PREFIX, FenceGate, LockOptions, Locker};
#[doc(hidden)]
pub use scope::__private;
pub use scope::{current_fence, current_lease, default_locker, set_default_locker};
pub use types::{Fence, LockKey, MAX_KEEP_FENCE, MAX_KEY_LEN, MAX_TTL, MIN_TTL, Token};
pub use wake::{Wakeups, Watch};

/// The redis-rs crate this one is built on: its types appear in this crate's API (the source of
/// [`Error::Unavailable`], [`RedisConn`] and [`ClusterConn`] implement its `ConnectionLike`),
/// so use them from here rather than from a `redis` dependency of your own that could differ in
/// version.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::redis::AsyncCommands;
/// let backend = lock_core::RedisBackend::connect("redis://127.0.0.1:6379/").await?;
/// let mut conn = backend.connection();
/// let _: () = conn.set("greeting", "hello").await.map_err(lock_core::Error::Unavailable)?;
/// # Ok(()) }
/// ```
pub use redis;
