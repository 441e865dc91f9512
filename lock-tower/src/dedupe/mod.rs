//! [`DedupeLayer`]: each webhook delivery (or idempotent request) handled once.
//!
//! Module layout as in tower-http: the layer (configuration and builder), the service, the
//! response future (shared with [`lock`](crate::lock)), and the result store.
//!
//! ```
//! use lock_tower::dedupe::{DEFAULT_RETENTION, DedupeLayer};
//!
//! // Kept a week, for a sender that retries for up to five days.
//! let layer = DedupeLayer::new(lock_core::Locker::memory()).retention(7 * DEFAULT_RETENTION);
//! # let _ = layer;
//! ```

mod layer;
mod service;
mod store;

pub use self::layer::{
    DEFAULT_REQUEST_BODY_LIMIT, DEFAULT_RETENTION, DEFAULT_STORED_BODY_LIMIT, DedupeLayer,
    MAX_RETENTION,
};
pub use self::service::Dedupe;
pub use crate::future::ResponseFuture;
