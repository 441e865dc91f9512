#![doc = include_str!("../README.md")]

mod body;
pub mod dedupe;
mod extract;
mod future;
mod key;
pub mod lock;
mod reject;
mod util;

pub use body::{BoxError, LeaseLostWhileStreaming, LockBody, RelayBroken};
pub use dedupe::DedupeLayer;
pub use extract::{Fence, HeldLease, MissingLease};
pub use future::ResponseFuture;
pub use key::{KeyExtractor, MAX_IDEMPOTENCY_KEY_LEN};
pub use lock::DEFAULT_KEY_BODY_LIMIT;
pub use lock::LockLayer;
pub use reject::{Reason, Rejection};
pub use util::RequestBody;
