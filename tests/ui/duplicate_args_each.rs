use leasehold::{Error, Locker, locked};

#[locked(key = "a", key = "b")]
async fn two_keys() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "a", wait = "1s", wait = "2s")]
async fn two_waits() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "a", renew, renew = false)]
async fn two_renews() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "a", locker = _l, locker = _l)]
async fn two_lockers(_l: &Locker) -> Result<(), Error> {
    Ok(())
}

#[locked(key = "a", crate = leasehold, crate = "leasehold")]
async fn two_crates() -> Result<(), Error> {
    Ok(())
}

fn main() {
    let _ = two_keys();
    let _ = two_waits();
    let _ = two_renews();
    let _ = two_lockers(&Locker::memory());
    let _ = two_crates();
}
