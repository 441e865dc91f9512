// Outer attributes stay on the function, above `#[locked]` or below it: `#[must_use]` (with
// its reason, which only the function's own attribute gives) and `#[deprecated]` still fire
// at a caller.
#![deny(unused_must_use, deprecated)]

use leasehold::{Error, Locker, locked};

#[must_use = "the count says how many orders were settled"]
#[locked(key = "count", locker = Locker::memory())]
async fn count() -> Result<u32, Error> {
    Ok(1)
}

#[locked(key = "old-count", locker = Locker::memory())]
#[deprecated(note = "use `count`")]
async fn old_count() -> Result<u32, Error> {
    Ok(1)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    count().await;
    let _ = old_count().await;
}
