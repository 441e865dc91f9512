use leasehold::locked;

#[derive(Debug)]
struct AppError;

#[locked(key = "job")]
async fn run() -> Result<(), AppError> {
    Ok(())
}

fn main() {}
