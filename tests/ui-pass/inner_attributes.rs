// A body that opens with inner attributes keeps them at the top of the function's body, where
// Rust allows them (inside the expansion's future they would be an error).
#![deny(unused_variables)]

use leasehold::{Error, Locker, locked};

#[locked(key = "k", locker = Locker::memory())]
async fn f() -> Result<u8, Error> {
    #![allow(unused_variables)]
    let unused = 2;
    Ok(1)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(f().await.expect("locked"), 1);
}
