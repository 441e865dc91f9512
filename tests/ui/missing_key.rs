use leasehold::{Error, locked};

#[locked(ttl = "5s")]
async fn run() -> Result<(), Error> {
    Ok(())
}

fn main() {
    let _: &dyn std::future::Future<Output = Result<(), leasehold::Error>> = &run();
}
