//! A crate that re-exports leasehold's parts and writes `#[locked]` functions for its callers
//! from a `macro_rules!`, naming the re-export with `crate = $crate::__lh`. `$crate` resolves
//! by its span: this crate's, while the names the caller passes in carry the caller's. The
//! test `tests/locked_reexport.rs` is such a caller, in another crate.

/// What `#[locked]` reaches through `crate = $crate::__lh`: its own paths (`__private`) and the
/// attribute itself, as the `leasehold` facade re-exports them.
#[doc(hidden)]
pub mod __lh {
    pub use lock_core::*;
    pub use lock_macros::locked;
}
pub use lock_core::{Error, Locker};

/// Defines `async fn $name($locker: Locker) -> $ret`, run under the lease on `$key`, with
/// the locker and the return type named by the caller, and returning `$value`.
#[macro_export]
macro_rules! guarded {
    // The return type as loose tokens, not a `ty` fragment: they keep the caller's spans (a
    // fragment is one group spanned here).
    ($name:ident, $key:literal, $locker:ident, [$($ret:tt)*], $value:expr) => {
        #[$crate::__lh::locked(key = $key, crate = $crate::__lh, locker = $locker)]
        async fn $name($locker: $crate::Locker) -> $($ret)* {
            $value
        }
    };
}
