//! [`LockLayer`]: one request at a time per key.
//!
//! Module layout as in tower-http: the layer (configuration and builder), the service, and the
//! response future (where the acquire happens).
//!
//! ```
//! use lock_tower::KeyExtractor;
//! use lock_tower::lock::{DEFAULT_KEY_BODY_LIMIT, LockLayer};
//!
//! // Order events are small: read at most a quarter of the default to find the key.
//! let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::json_field("/order_id"))
//!     .body_limit(DEFAULT_KEY_BODY_LIMIT / 4);
//! # let _ = layer;
//! ```

mod layer;
pub(crate) mod service;

pub use self::layer::{DEFAULT_KEY_BODY_LIMIT, LockLayer};
pub use self::service::Lock;
pub use crate::future::ResponseFuture;
