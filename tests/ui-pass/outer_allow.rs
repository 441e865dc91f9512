// A lint level on the function, above `#[locked]` or below it, stays on the function and
// covers what it wrote: here an unused parameter, under a crate-wide `deny`.
#![deny(unused_variables)]

use leasehold::{Error, Locker, locked};

#[allow(unused_variables)]
#[locked(key = "above", locker = Locker::memory())]
async fn above(unused: u32) -> Result<u8, Error> {
    Ok(1)
}

#[locked(key = "below", locker = Locker::memory())]
#[allow(unused_variables)]
async fn below(unused: u32) -> Result<u8, Error> {
    Ok(2)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(above(0).await.expect("locked"), 1);
    assert_eq!(below(0).await.expect("locked"), 2);
}
