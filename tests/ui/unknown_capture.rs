use leasehold::{Error, locked};

#[locked(key = "order:{order}")]
async fn settle(order_id: u64) -> Result<u64, Error> {
    Ok(order_id)
}

fn main() {}
