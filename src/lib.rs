#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use lock_core::*;

#[cfg(feature = "macros")]
pub use lock_macros::locked;

/// Tower middleware: [`LockLayer`](lock_tower::LockLayer) (one request at a time per key) and
/// [`DedupeLayer`](lock_tower::DedupeLayer) (each webhook delivery handled once).
#[cfg(feature = "tower")]
pub use lock_tower as tower;
