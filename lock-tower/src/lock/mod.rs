//! [`LockLayer`]: one request at a time per key.
//!
//! Module layout as in tower-http: the layer (configuration and builder), the service, and the
//! response future (where the acquire happens).

mod layer;
pub(crate) mod service;

pub use self::layer::{DEFAULT_KEY_BODY_LIMIT, LockLayer};
pub use self::service::Lock;
pub use crate::future::ResponseFuture;
