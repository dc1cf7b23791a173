use idempotent::idempotent;

struct Parcel {
    id: u64,
}

// Takes the message by value: `key_fn` borrows it.
fn parcel_key(parcel: Parcel) -> u64 {
    parcel.id
}

#[idempotent(key_fn = parcel_key)]
async fn ship(parcel: Parcel) {
    let _ = parcel.id;
}

fn main() {}
