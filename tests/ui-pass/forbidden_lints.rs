// A crate that forbids `unreachable_code` can use `#[locked]`: the expansion allows no lint
// (an `allow` under a `forbid` of the same lint is error E0453).
#![forbid(unreachable_code)]

use leasehold::{Error, Locker, locked};

#[locked(key = "k", locker = Locker::memory())]
async fn f() -> Result<u8, Error> {
    Ok(1)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(f().await.expect("locked"), 1);
}
