use leasehold::{Error, locked};

#[locked(key = "")]
async fn empty() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job:{{id}}")]
async fn braces() -> Result<(), Error> {
    Ok(())
}

#[locked(key = "job\t{id}")]
async fn control(id: u32) -> Result<u32, Error> {
    Ok(id)
}

#[locked(key = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")]
async fn long() -> Result<(), Error> {
    Ok(())
}

// Captures alone: a key that may be empty on some calls only, so not refused here.
#[locked(key = "{id}")]
async fn captured(id: String) -> Result<String, Error> {
    Ok(id)
}

fn main() {
    let _: &dyn std::future::Future<Output = Result<(), leasehold::Error>> = &empty();
    let _: &dyn std::future::Future<Output = Result<(), leasehold::Error>> = &braces();
    let _: &dyn std::future::Future<Output = Result<u32, leasehold::Error>> = &control(1);
    let _: &dyn std::future::Future<Output = Result<(), leasehold::Error>> = &long();
    let _: &dyn std::future::Future<Output = Result<String, leasehold::Error>> =
        &captured(String::new());
}
