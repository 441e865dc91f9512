use leasehold::{Error, locked};

#[locked(key = "job", ttl = "5ms")]
async fn too_short() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job", ttl = "25h")]
async fn too_long() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job", ttl = "24h1ms")]
async fn just_too_long() -> Result<(), Error> {
    Ok(())
}

// The bounds themselves are accepted, and `wait` has none: no error expected here. These name
// `leasehold::Error` by path, so that the imported `Error` is used by the refused items alone.
#[locked(key = "job", ttl = "10ms", wait = "48h")]
async fn shortest() -> Result<(), leasehold::Error> {
    Ok(())
}

#[locked(key = "job", ttl = "24h")]
async fn longest() -> Result<(), leasehold::Error> {
    Ok(())
}

fn main() {
    let _ = too_short();
    let _ = too_long();
    let _ = just_too_long();
    let _ = shortest();
    let _ = longest();
}
