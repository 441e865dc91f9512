//! The TTL bounds `#[locked]` checks at compile time are copies of lock-core's (a proc-macro
//! cannot read them cheaply); this keeps the copies from drifting, in both directions: a copy
//! stricter than lock-core would refuse TTLs that work, a looser one would let through TTLs that
//! fail on every call. The out-of-range literals themselves are `tests/ui/ttl_out_of_range.rs`.
#![cfg(feature = "macros")]

use std::time::Duration;

use leasehold::{Error, Locker, MAX_KEY_LEN, MAX_TTL, MIN_TTL, locked};

#[path = "../lock-macros/src/ttl_bounds.rs"]
mod mirrored;

#[test]
fn mirrored_bounds_equal_lock_core() {
    assert_eq!(
        mirrored::MIN_TTL,
        MIN_TTL,
        "lock-macros/src/ttl_bounds.rs MIN_TTL"
    );
    assert_eq!(
        mirrored::MAX_TTL,
        MAX_TTL,
        "lock-macros/src/ttl_bounds.rs MAX_TTL"
    );
    assert_eq!(
        mirrored::MAX_KEY_LEN,
        MAX_KEY_LEN,
        "lock-macros/src/ttl_bounds.rs MAX_KEY_LEN"
    );
}

#[locked(key = "shortest", locker = locker, ttl = "10ms")]
async fn shortest(locker: &Locker) -> Result<(), Error> {
    Ok(())
}

#[locked(key = "longest", locker = locker, ttl = "24h")]
async fn longest(locker: &Locker) -> Result<Duration, Error> {
    Ok(leasehold::current_lease().expect("lease").remaining())
}

// The longest key literal the macro accepts (MAX_KEY_LEN bytes of fixed text).
#[locked(key = "kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk", locker = locker)]
async fn longest_key(locker: &Locker) -> Result<usize, Error> {
    Ok(leasehold::current_lease().expect("lease").key().len())
}

/// The literals at the edges of the range the macro accepts are accepted at run time too.
#[tokio::test]
async fn edge_literals_run() {
    let locker = Locker::memory();
    // A 10 ms lease may be counted lost before the body is polled on a loaded machine; what
    // matters here is that lock-core does not refuse the TTL.
    let r = shortest(&locker).await;
    assert!(
        matches!(r, Ok(()) | Err(Error::LeaseLost { .. })),
        "10ms: {r:?}"
    );
    // What is left is net of the clock-drift allowance (1% of the TTL and 2 ms).
    let left = longest(&locker).await.expect("24h");
    assert_eq!(longest_key(&locker).await.expect("512 bytes"), MAX_KEY_LEN);
    assert!(left > MAX_TTL * 98 / 100 && left <= MAX_TTL, "{left:?}");
}
