use leasehold::{Error, locked};

#[locked(key = "job", ttl = "30")]
async fn no_unit() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job", wait = "1.5s")]
async fn fraction() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job", ttl = "2 weeks")]
async fn words() -> Result<(), Error> {
    Ok(())
}

fn main() {}
