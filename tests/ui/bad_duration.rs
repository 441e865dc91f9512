use leasehold::{Error, locked};

#[locked(key = "job", ttl = "30")]
async fn no_unit() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job", wait = "1.5s")]
async fn fraction() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job", ttl = "1.0005s")]
async fn fraction_below_a_millisecond() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job", ttl = "2 weeks")]
async fn unknown_unit() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job", ttl = "1m 30s")]
async fn spaced() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job", ttl = "")]
async fn empty() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job", wait = "-1s")]
async fn negative() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job", wait = "99999999999999999999s")]
async fn overflow() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job", ttl = "30s"ms)]
async fn suffixed() -> Result<(), Error> {
    Ok(())
}

fn main() {
    let _ = no_unit();
    let _ = fraction();
    let _ = fraction_below_a_millisecond();
    let _ = unknown_unit();
    let _ = spaced();
    let _ = empty();
    let _ = negative();
    let _ = overflow();
    let _ = suffixed();
}
